"""This rank's pipeline stages and the schedule that runs them: meshlab's stages of a
Hugging Face decoder (``_stage``), or the model's own forward on declared blocks
(``_blocks``); the batch reaches them as ``_feed`` says."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...core.agree import agree, alone
from ...core.digest import batch_entry, data_coords
from ...core.errors import ConfigError
from .._head import elsewhere, fused_loss_of
from .._install import StageRoots
from .._protocol import Part
from ._feed import Feed, decoder_feed, microbatch, own_feed, signature_of
from ._guard import StageFailures, UndoSetupForward, guarded_loss
from ._schedule import PipelineStages, stages, torch_actions
from ._stage import (DecoderStage, check_pooled_rows, head_name, model_layout, pools,
                     prune, seq_split)

KEPT_SCHEDULES = 4        # schedules of the loss functions used last, per pipeline


class PipelineSetup:
    """Chosen before initialization (which blocks this rank keeps); the other ranks'
    blocks are dropped right after it, so every rank initializes the same values."""

    def __init__(self, t, ctx):
        self.t = t
        self.all = stages(ctx.plan, t)
        rank = ctx.coordinate(t.axis)
        self.mine = [s for s in self.all if s.rank == rank]
        self.kept = {b for s in self.mine for b in s.blocks}
        self.first = any(s.first for s in self.mine)
        self.last = any(s.last for s in self.mine)
        self.sides = ctx.plan.decision(PipelineStages)
        ctx.dropped |= set(ctx.plan.model.blocks) - self.kept
        ctx.after_init.append(self.prune)
        # the stage modules run the forward: a room wrapping its root wraps each of them
        self.roots = StageRoots()
        ctx.keep(self.roots)

    def prune(self, model: nn.Module) -> None:
        if self.t.blocks is not None:
            from ._blocks import prune as prune_declared

            prune_declared(model, _all_blocks(self), self.kept, self.sides.before,
                           self.sides.after, self.first, self.last)
            return
        prune(model, self.kept)
        base = getattr(model, model.base_model_prefix)
        lay = model_layout(model)
        if not self.first:
            for part in lay.first_only:
                setattr(base, part, elsewhere())
        if not self.last:
            setattr(base, lay.norm, elsewhere())
            setattr(model, head_name(model), elsewhere())

    def build(self, ctx) -> "PipelinePart":
        from torch.distributed.pipelining import PipelineStage

        mesh = ctx.device_mesh(self.t.axis)
        group = mesh.get_group()
        failures = StageFailures()
        tied = self._tied_head(ctx, group)          # before the stages read the head
        built = [PipelineStage(self.roots.wrap(self._module(ctx, s, failures)), s.index,
                               len(self.all), ctx.device, group=group)
                 for s in self.mine]
        _refuse_generate(ctx.model)
        sig = None if self.t.blocks is None else signature_of(ctx.model)
        return PipelinePart(self.t, group, built, self.kept, self.first, self.last,
                            failures=failures, signature=sig, tied=tied,
                            classifier=ctx.model.config if sig is None and pools(ctx.model)
                            else None, model=ctx.model)

    def _tied_head(self, ctx, group) -> "TiedHead | None":
        """A head tied to the token embeddings, run on another rank than the first stage's
        (``check_untied`` allowed it): the two ranks' ``TiedHead``; None elsewhere."""
        if self.t.blocks is not None or not any(e.tied_to for e in ctx.plan.params):
            return None
        src = next(s.rank for s in self.all if s.first)
        dst = next(s.rank for s in self.all if s.last)
        if src == dst:
            return None
        ends = _ends_group(ctx, self.t.axis, group, src, dst)
        if not (self.first or self.last):
            return None                      # a middle stage: no part in it
        base = getattr(ctx.model, ctx.model.base_model_prefix)
        owner = getattr(base, model_layout(ctx.model).embed) if self.first else None
        copy = None
        fsdp = _fsdp(ctx.plan)
        if self.last and not self.first:
            copy = ctx.model.lm_head
            if not fsdp:
                w = copy._parameters.pop("weight")
                # the last stage's own copy of the first stage's weight, refreshed from it
                # before every schedule; not a parameter: no optimizer, norm or checkpoint
                # counts it twice
                copy.register_buffer("weight", w.detach().clone().requires_grad_(
                    w.requires_grad), persistent=False)
            # under FSDP2 the copy stays the head's parameter, sharded over the data ranks
            # as the owner is (the two ranks' shards line up), its gradient dropped once
            # added to the owner's: the optimizer skips it, the norm does not count it
        ranks = dist.get_process_group_ranks(group)
        return TiedHead(ends, ranks[src], owner, copy, fsdp)

    def _module(self, ctx, s, failures) -> nn.Module:
        """What stage ``s`` runs: the model's own forward on its view of the model
        (declared blocks), or meshlab's stage of a Hugging Face decoder's parts."""
        if self.t.blocks is None:
            return DecoderStage(ctx.model, [int(b.rsplit(".", 1)[1]) for b in s.blocks],
                                s.first, s.last, failures, seq_split(ctx.plan))
        from ._blocks import OwnStage, stage_view
        from ._p2p import hidden_size

        view, pairs = stage_view(ctx.model, _all_blocks(self), s.blocks, self.sides.before,
                                 self.sides.after, s.first, s.last)
        return OwnStage(ctx.model, view, pairs, hidden_size(ctx.plan) or 0, failures)


def _ends_group(ctx, axis: str, group, src: int, dst: int):
    """The group of the two pipeline ranks ``src`` and ``dst`` (coordinates on ``axis``)
    of this rank's pipeline: the pipeline's own group when it has no other rank; else one
    group per pipeline of the mesh, every rank making each in the same order."""
    if group.size() == 2:
        return group
    dm = ctx.mesh.device_mesh
    p = group.size()
    rows = dm.mesh.movedim(ctx.mesh.axis_names.index(axis), -1).reshape(-1, p).tolist()
    mine = None
    for row in rows:
        g = dist.new_group([row[src], row[dst]])
        if dist.get_rank() in (row[src], row[dst]):
            mine = g
    return mine


def _fsdp(plan) -> bool:
    from ..zero import ZeroShard

    z = plan.get(ZeroShard)
    return z is not None and z.fsdp(plan)


@dataclasses.dataclass
class TiedHead:
    """The LM head tied to the token embeddings across pipeline ranks (Megatron's shared
    embedding, owned once): the first stage's rank holds the weight (``owner``, the
    parameter the optimizer steps), the last stage's rank a copy (``copy``, a buffer the
    head reads). Before a schedule the copy takes the owner's values; after a backward the
    copy's gradient is added to the owner's and dropped, so the owner's gradient is one
    process's (the embedding's plus the head's) before the data ranks reduce it."""

    group: Any
    src: int                      # the owner's global rank
    owner_module: Any = None      # the embedding (first stage's rank)
    copy_module: Any = None       # the head (last stage's rank)
    fsdp: bool = False            # both FSDP2 parameters, sharded alike over the data ranks
    seen: int = -1                # the owner's version the copy last took

    # read at each use: FSDP2 replaces a module's parameters when it wraps the stage
    @property
    def owner(self):
        return None if self.owner_module is None else self.owner_module.weight

    @property
    def copy(self):
        return None if self.copy_module is None else self.copy_module.weight

    @torch.no_grad()
    def refresh(self) -> None:
        from ...core.tensors import local

        t = self.owner if self.owner is not None else self.copy
        dist.broadcast(local(t), src=self.src, group=self.group)

    @torch.no_grad()
    def refresh_if_changed(self) -> None:
        """``refresh`` where the owner's weight changed in place since the copy last took
        it (an optimizer step, a load): one integer agreed between the two ranks, for
        callers that read the head many times between steps (decoding)."""
        if self._version() != self.seen:
            self.refresh()
            self.seen = self._version()     # the broadcast may count as a write itself

    def _version(self) -> int:
        """The owner's version counter, agreed between the two ranks."""
        from ...core.tensors import local

        t = self.owner if self.owner is not None else self.copy
        v = torch.tensor([local(t)._version if self.owner is not None else -1],
                         dtype=torch.int64, device=local(t).device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
        return int(v)

    @torch.no_grad()
    def sum_grads(self) -> None:
        from ...core.tensors import local

        if self.owner is not None:
            if self.owner.grad is None:
                self.owner.grad = torch.zeros_like(self.owner)
            dist.all_reduce(local(self.owner.grad), group=self.group)
            return
        copy = self.copy
        g = copy.grad
        dist.all_reduce(local(g) if g is not None else torch.zeros_like(local(copy)),
                        group=self.group)
        copy.grad = None


def _all_blocks(setup: PipelineSetup) -> tuple[str, ...]:
    """Every block of the pipeline, in order (the plan's, as the stages split them)."""
    return tuple(b for s in setup.all for b in s.blocks)


def _refuse_generate(model: nn.Module) -> None:
    """transformers' ``generate`` runs the whole model on one rank; a pipeline rank holds
    only its stages, so it is refused with the way that works."""
    if getattr(model, "generate", None) is None:
        return

    def refused(*args, **kwargs):
        raise ConfigError(f"{type(model).__name__}.generate on a pipelined model: each rank "
                          f"holds only its stages. Decode with meshlab.inference."
                          f"InferenceEngine(model, ...), which runs the stages in turn")
    model.generate = refused


def check_keys(batch) -> None:
    """The keys meshlab's stages of a Hugging Face decoder read: ``input_ids`` (the first
    stage), ``attention_mask`` and ``position_ids`` (every stage, which builds the mask
    and positions of its microbatch from them as the model's forward does: padding and
    packed samples train as one process) and ``labels`` (the loss). Any other key would
    be dropped, so it is refused by name. ``step`` runs this before its first collective
    (``Pipeline.check_batch``), where a refusal on one rank reaches every rank."""
    from ...core.errors import ConfigError
    from ._feed import DECODER_KEYS

    if not isinstance(batch, Mapping):
        return
    read = ("input_ids", *DECODER_KEYS, "labels")
    unknown = [k for k in batch if k not in read]
    if unknown:
        raise ConfigError(f"step: a pipelined model's stages of a Hugging Face decoder read "
                          f"batch keys {list(read)} only; batch key(s) {unknown} would be "
                          f"dropped and the stages would train on other inputs than the "
                          f"model's forward on one process; drop them from the batch")


def _pipeline_batch(batch, microbatches: int):
    """The schedule's input ids and targets, checked before its first send: the schedule
    cuts dim 0 into ``microbatches`` equal parts, and a batch that does not divide would
    fail on the last stage alone. Batch shapes are the same on every rank (``step`` agreed
    on them), so this raises ``ConfigError`` on every rank alike."""
    from ...core.errors import ConfigError

    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ConfigError(f"step: a pipelined model reads batch['input_ids'] (and "
                              f"batch['labels'], default the ids); this batch has "
                              f"{sorted(map(str, batch))}")
        check_keys(batch)
        x, target = batch["input_ids"], batch.get("labels", batch["input_ids"])
    else:
        x = target = batch
    for name, t in (("input_ids", x), ("labels", target)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ConfigError(f"step: a pipelined model's batch[{name!r}] must be a tensor of "
                              f"shape (batch, seq), got {type(t).__name__}")
    if x.shape[0] % microbatches or x.shape[0] == 0 or target.shape[0] != x.shape[0]:
        raise ConfigError(
            f"step: pipeline(microbatches={microbatches}) cuts the local batch into "
            f"{microbatches} equal microbatches, but input_ids has {x.shape[0]} rows (labels "
            f"{target.shape[0]}); use a batch size per data-parallel rank that is a multiple "
            f"of {microbatches}, or pipeline(microbatches=...) that divides {x.shape[0]}")
    return x, target


def microbatch_count(t, ranks: int, batch) -> int:
    """How many microbatches ``batch`` is cut into over ``ranks`` pipeline ranks:
    ``pipeline(microbatches=...)``, or with ``microbatch_size`` its rows over that size
    (refused by name where the size does not divide them, or leaves fewer microbatches
    than the schedule runs stages), the same on every rank (their shapes agree)."""
    from ...core.errors import ConfigError

    size = t.microbatch_size
    if size is None:
        return t.microbatches
    tensors = [batch] if isinstance(batch, torch.Tensor) else \
        [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0] \
        if isinstance(batch, Mapping) else []
    rows = tensors[0].shape[0] if tensors else 0
    stages = ranks * t.v
    if rows == 0 or rows % size or rows // size < stages:
        raise ConfigError(f"pipeline(microbatch_size={size}) cuts each batch into "
                          f"microbatches of {size} rows, at least {stages} of them (one per "
                          f"stage); this batch has {rows} rows per data-parallel rank. Use "
                          f"a batch of a multiple of {size} rows, at least {stages * size}")
    return rows // size


@dataclasses.dataclass
class PipelinePart(Part):
    """Runs the step through the schedule; the gradient norm is summed over the stages."""

    runs_step: ClassVar[bool] = True

    t: Any
    group: Any
    stages: list
    kept: set
    first: bool
    last: bool
    failures: StageFailures = dataclasses.field(default_factory=StageFailures)
    # the forward the stages run, for declared blocks (``_feed``); None: a decoder's stages
    signature: Any = None
    # the schedules of the loss functions used last (a new function each step, a lambda
    # made in the loop, builds one each step: only the latest few are kept)
    _schedules: collections.OrderedDict = dataclasses.field(
        default_factory=collections.OrderedDict)
    tied: TiedHead | None = None     # the LM head tied to the embeddings across ranks
    classifier: Any = None           # a sequence classifier's config: its last stage pools
    _m: int = 0                      # this call's microbatches (``feed``)
    _scale: float = 1.0
    _weight: float = 1.0
    _feed: Feed | None = None
    model: Any = dataclasses.field(default=None, repr=False)    # the names of its buffers
    _buffers_watched: bool = False

    def norm_groups(self) -> tuple:
        return (self.group,)

    def after_step(self) -> None:
        """Under FSDP2 a tied head's copy is a parameter that checkpoints save: it takes
        the owner's updated values at once (elsewhere it does before the next schedule)."""
        if self.tied is not None and self.tied.fsdp:
            self.tied.refresh()

    def schedule(self, loss_fn):
        """torch's schedule runtime over the action lists the plan simulates and draws
        (``_schedule.torch_actions``): each rank runs its own list, sends as soon as a stage has
        computed and waits for a receive only where its input is used."""
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        m = self._m
        key = (id(loss_fn), m)
        if key not in self._schedules:

            # The loss is the caller's, of the microbatch the schedule's target names
            # (``_feed``). Each microbatch's loss is weighed here (``_weight``: divided by
            # their number for the mean), so the backward accumulates the step's loss's
            # gradient; torch's own ``scale_grads`` divides every gradient after the
            # schedule instead, including gradients accumulated before this call (a second
            # call without zero_grad would hold g2 + g1 / m).
            def stage_loss(out, index):
                mb = microbatch(self._feed, index)
                # a fused loss: the last stage ends at the norm, the loss runs its head
                last = next(st.submod for st in self.stages if st.is_last)
                if getattr(loss_fn, "runs_head", False):
                    loss = loss_fn(last.head, out, mb)
                elif isinstance(last, DecoderStage) and fused_loss_of(last._model[0]):
                    raise ConfigError(
                        "this model's loss is fused (fuse('loss')): its last stage hands the "
                        "final hidden states to the fused head, not logits, so a loss "
                        "function cannot run on them; leave 'loss' out of fuse() to pass one")
                else:
                    loss = loss_fn(out, mb)
                return loss * (self._scale * self._weight)

            sched = _PipelineScheduleRuntime(self.stages, m,
                                             loss_fn=guarded_loss(stage_loss, self.failures),
                                             scale_grads=False)
            sched._prepare_schedule_with_comms(torch_actions(
                self.t.schedule, self.group.size(), m, self.t.v))
            self._schedules[key] = sched
            while len(self._schedules) > KEPT_SCHEDULES:
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        return self._schedules[key]

    def run_step(self, rt, opt, batch, loss_fn, reduction=None) -> float:
        """The schedule runs the microbatches; the loss comes from the last stage."""
        scale = opt.loss_scale() if hasattr(opt, "loss_scale") else 1.0
        loss, _ = self.forward_backward(rt, batch, loss_fn, reduction=reduction, scale=scale)
        opt.step()
        opt.zero_grad()
        return loss

    def evaluate(self, rt, batch, loss_fn, reduction=None) -> float:
        """The schedule's forward only; the loss comes from the last stage."""
        return self.forward_only(rt, batch, loss_fn, reduction=reduction)[0]

    def forward_backward(self, rt, batch, loss_fn, *, return_outputs: bool = False,
                         scale: float = 1.0, reduction=None):
        """Forward and backward of every microbatch through the schedule, the gradients
        reduced; no optimizer step. The backward runs on the loss times ``scale`` (fp16's
        loss scale). Returns (the unscaled loss, on every rank; the last stage's merged
        outputs when ``return_outputs``, else None). The loss is ``reduction``'s
        (``meshlab.step``'s ``_Reduce``; None: ``'mean'``): the mean over microbatches and
        data ranks of ``loss_fn``'s; for ``'sum'`` and ``'tokens'``, ``loss_fn`` returns
        its microbatch's sum, and the loss is the sum over the global batch (divided by
        the global token count ``step`` counted before the schedule, for ``'tokens'``)."""
        return self._run(rt, batch, loss_fn, True, return_outputs, scale, reduction)

    def forward_only(self, rt, batch, loss_fn, *, return_outputs: bool = False,
                     reduction=None):
        """The forward of every microbatch through the schedule, under ``no_grad``: no
        backward, no gradient touched. Returns what ``forward_backward`` returns."""
        with torch.no_grad():
            return self._run(rt, batch, loss_fn, False, return_outputs, 1.0, reduction)

    def _weigh(self, reduction) -> float:
        """What each microbatch's loss is multiplied by: 1/m for the mean; for a sum, 1
        (the token count's inverse for ``'tokens'``) times ``step``'s backward scale, the
        data-parallel size, which undoes the data ranks' average of the gradients and of
        the loss (``_run``), as ``step`` does without a pipeline."""
        if reduction is None or reduction.reduction == "mean":
            return 1.0 / self._m
        return reduction.factor * reduction.backward_scale

    def feed(self, batch) -> Feed:
        """The schedule's inputs for ``batch`` (``_feed``), checked before any send."""
        m = self._m = microbatch_count(self.t, self.group.size(), batch)
        if self.signature is not None:
            return own_feed(batch, m, self.signature)
        x = _pipeline_batch(batch, m)[0]
        if self.classifier is not None:     # refused on every rank before the first send
            check_pooled_rows(self.classifier.pad_token_id, x.shape[0] // m)
        return decoder_feed(batch, m, x, ids=self.classifier is not None)

    def _run(self, rt, batch, loss_fn, train: bool, return_outputs: bool, scale: float,
             reduction=None):
        feed = self.feed(batch)
        losses: list = []
        sched = self.schedule(loss_fn)
        if self.tied is not None:        # the head's copy takes the weight's last values
            self.tied.refresh()
        self._scale, self._weight, self._feed = scale, self._weigh(reduction), feed
        sync = rt.grad_sync if train else None
        if sync is not None:         # the microbatches accumulate; one reduction after
            sync.enabled = False
        out = None
        call = sched.step if train else sched.eval
        held = self._hold_grads(sched, train)
        setup = _sets_up(sched, train)
        undo = UndoSetupForward(self.stages) if setup else None
        watch = self._watch(train, setup)
        try:
            with rt.autocast():
                args = feed.args if self.first else ()
                target = {"target": feed.index} if self.last else {}
                out = call(*args, **target, losses=losses, return_outputs=return_outputs,
                           **feed.kwargs)
        except Exception as e:     # after the stages' communication: agreed below
            self.failures.record(e)
        finally:
            self._feed = None
            if sync is not None:
                sync.enabled = True
        if undo is not None:
            undo.remove()
        found, peers = watch.finish("pipeline") if watch is not None else (None, {})
        if found is not None:
            self.failures.record(found)
        self._settle(rt, feed.batch, peers)
        if train and self.tied is not None:
            self.tied.sum_grads()
        if sync is not None:
            sync.flush()
        for p, g in held:              # reduced before this call: added to this call's sums
            p.grad = g if p.grad is None else p.grad.add_(g)
        # Summed on the device and read once, by the caller: no host round trip per
        # microbatch.
        t = (torch.stack([l.detach().to(torch.float64) for l in losses]).sum().reshape(1) /
             scale if losses else          # each already weighed (``_weigh``)
             torch.zeros(1, dtype=torch.float64, device=rt.device))
        dist.all_reduce(t, group=self.group)      # only the last stage holds a loss
        if rt.dp_group is not None and rt.dp_size > 1:
            dist.all_reduce(t, group=rt.dp_group)
            t /= rt.dp_size
        return float(t), (out if self.last and return_outputs else None)

    def _hold_grads(self, sched, train: bool) -> list:
        """The gradients held before this call, taken off the stages' parameters where
        torch's schedule sets its stages up on this call (its first, a loss function of
        another identity, a switch between training and evaluation): that setup runs a
        forward and backward for the tensors' metadata and then drops the gradients of
        every FSDP2 module in a stage. ``_run`` adds them back to the call's own sums once
        the call went through (a failed one drops both, as ``_settle`` says); without an
        FSDP2 stage, or without a setup on this call, nothing is taken."""
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(st.submod, FSDPModule) for st in self.stages):
            return []
        if not _sets_up(sched, train):
            return []                  # set up for this kind of call already: no setup
        held = []
        for st in self.stages:
            for p in st.submod.parameters():
                if p.grad is not None:
                    held.append((p, p.grad))
                    p.grad = None
        return held

    def _watch(self, train: bool, setup: bool):
        """On the first training schedule, a watch of the buffers each stage's forward
        changes (``train._buffers.ForwardWatch``; ``setup``: each stage's first forward is
        the schedule's setup, not counted); else None."""
        if not train or self._buffers_watched:
            return None
        from .._buffers import ForwardWatch

        self._buffers_watched = True
        names = {id(t): n for n, t in (*self.model.named_buffers(),
                                        *self.model.named_parameters())} \
            if self.model is not None else {}
        return ForwardWatch([(f"stage {st.stage_index}", st.submod) for st in self.stages],
                            names, skip_first=setup)

    def _settle(self, rt, batch, buffers=None) -> None:
        """Every rank agrees the schedule went through, on the batch the stages read
        together (and on ``buffers``, ``ForwardWatch``'s peers): or every rank drops the
        step's gradients and raises (the rank whose stage failed its own error, the others
        ``PeerError``; ``_guard``)."""
        error = self.failures.take()
        # a batch on the device was compared by ``step``: not read again here
        peers = None if alone(rt.ctrl_group) else {
            **batch_entry(batch, data_coords(rt), device_reads=False), **(buffers or {})}
        agreed = False
        try:
            agree(rt.ctrl_group, "pipeline schedule", error=error, peers=peers)
            agreed = True
        finally:
            if not agreed:
                for st in self.stages:
                    st.submod.zero_grad(set_to_none=True)


def _sets_up(sched, train: bool) -> bool:
    """Whether torch's schedule sets its stages up on this call (its first, or a switch
    between training and evaluation): a forward of each stage on the first microbatch's
    inputs (later stages on uninitialized tensors of their shapes) before the schedule's
    own, and a backward for the gradients' metadata."""
    fwd = getattr(sched, "_stages_forward_initialized", None)
    bwd = getattr(sched, "_stages_backward_initialized", None)
    return not (fwd is True and bwd is not None and bwd == train)
