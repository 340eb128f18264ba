"""``step``: one training step of a parallelized model — microbatches, mixed precision,
loss scaling, and the pipeline schedule where a room runs the step itself."""

from __future__ import annotations

import contextlib
import gc
import inspect
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..core.agree import agree, alone
from ..core.errors import ConfigError, MeshlabError, check_bool, check_int
from ..core.sections import section
from ._buffers import watch as watch_buffers
from ._content import batch_peers, hyperparameters
from .optimizer import MeshOptimizer
from ..transforms._install import runtime_of
from ..transforms.fuse import fused_loss_of
from ..transforms._packing import as_packed, layout_of
from ..transforms._protocol import Transform
from ..transforms.zero._batchnorm import refuse_in_microbatches


def _split(batch, k: int) -> list:
    """``batch`` cut into ``k`` equal microbatches along dim 0 (every tensor of a dict; other
    values repeated). Checked before the step's first collective: batch shapes are the same
    on every rank, so a batch that does not divide raises on every rank alike."""
    k = check_int(k, "step", "microbatches", example=2)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] == 0:
            raise ConfigError(f"step: a batch tensor of shape {tuple(batch.shape)} holds no "
                              f"samples along dim 0, where microbatches are cut; give a "
                              f"batch of shape (batch, ...) with batch >= 1")
        if batch.shape[0] % k:
            raise ConfigError(f"step(microbatches={k}): local batch size {batch.shape[0]} does "
                              f"not divide into {k} microbatches; use a batch size that is a "
                              f"multiple of {k}, or microbatches that divide {batch.shape[0]}")
        return list(batch.chunk(k))
    if isinstance(batch, Mapping):
        parts = {key: _split(v, k) if isinstance(v, torch.Tensor) else [v] * k
                 for key, v in batch.items()}
        return [{key: parts[key][i] for key in batch} for i in range(k)]
    raise ConfigError(f"step: batch must be a tensor or a dict of tensors, got {type(batch).__name__}")


def _forward_params(model: nn.Module) -> tuple[set[str], bool]:
    """The keyword names ``model.forward`` accepts, and whether it takes ``**kwargs``."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return set(), True
    kinds = {p.kind for p in sig.parameters.values()}
    names = {n for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, inspect.Parameter.VAR_KEYWORD in kinds


def _call(model: nn.Module, mb, inputs):
    """The forward of one microbatch, by ``step``'s convention (see ``step``)."""
    if inputs is not None:
        if callable(inputs):
            args = inputs(mb)
            return model(*args) if isinstance(args, tuple) else model(args)
        missing = [k for k in inputs if k not in mb]
        if missing:
            raise ConfigError(f"step(inputs={list(inputs)}): the batch has no key(s) {missing}; "
                              f"it has {sorted(mb)}")
        return model(*[mb[k] for k in inputs])
    if not isinstance(mb, Mapping):
        return model(mb)
    names, var_kw = _forward_params(model)
    keys = [k for k in mb if k != "labels"]
    unknown = [k for k in keys if k not in names and not var_kw]
    if unknown:
        raise ConfigError(
            f"step: the batch has keys {sorted(mb)}, but {type(model).__name__}.forward takes "
            f"{sorted(names) or 'no keyword arguments'}; key(s) {unknown} have no parameter. "
            f"Pass inputs=['{keys[0]}'] to call model(batch['{keys[0]}']) positionally, or "
            f"inputs=lambda b: (b['x'],) for any mapping")
    return model(**{k: mb[k] for k in keys})


def _loss(loss_fn, out, mb):
    if loss_fn is not None:
        return loss_fn(out, mb)
    from ..transforms.losses import causal_lm_loss

    if not isinstance(mb, Mapping) or not ({"input_ids", "labels"} & set(mb)):
        got = sorted(mb) if isinstance(mb, Mapping) else type(mb).__name__
        raise ConfigError(
            f"step: the default loss is the causal-LM loss of batch['labels'] (or "
            f"batch['input_ids']) against output.logits; this batch has {got}. Pass "
            f"loss_fn=lambda output, batch: ... to compute the loss yourself")
    return causal_lm_loss(out, mb)


def _router_aux(model: nn.Module, mb) -> float:
    """The weight of a mixture of experts' router load-balancing loss in the model's own
    loss (``router_aux_loss_coef``, where the forward returns the router's logits:
    ``output_router_logits`` in the batch or the config), else 0."""
    cfg = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(cfg, "router_aux_loss_coef", None))
    given = mb.get("output_router_logits") if isinstance(mb, Mapping) else None
    on = given if given is not None else getattr(cfg, "output_router_logits", False)
    return float(coef) if coef and on else 0.0


def _router_term(model: nn.Module, out, mb):
    """``router_aux_loss_coef * output.aux_loss``, what the model's own loss adds to the
    causal-LM loss, or None where it adds nothing."""
    coef = _router_aux(model, mb)
    if not coef:
        return None
    aux = getattr(out, "aux_loss", None) if not isinstance(out, Mapping) else out.get("aux_loss")
    if aux is None:
        raise ConfigError(f"step: {type(model).__name__} returns the router's logits "
                          f"(output_router_logits) and weighs its load-balancing loss by "
                          f"router_aux_loss_coef={coef}, but its output has no aux_loss to "
                          f"add to the default loss; pass loss_fn=... to compute the loss "
                          f"yourself")
    return coef * aux


def _check_router_aux(model: nn.Module, rt, batch, microbatches: int, loss_fn) -> None:
    """The default loss adds the router's load-balancing loss as the model's own loss
    does, from the global batch's statistics; a batch cut into microbatches (or a
    pipeline's) runs its forwards apart, and the loss of their statistics is not the
    whole batch's, so that is refused."""
    if loss_fn is not None or not _router_aux(model, batch):
        return
    where = "a pipeline's microbatches" if rt.roles.pp is not None else \
        f"microbatches={microbatches}" if microbatches > 1 else None
    if where is not None:
        raise ConfigError(
            f"step: {type(model).__name__}'s loss adds the router's load-balancing loss "
            f"(router_aux_loss_coef={_router_aux(model, batch)}), a statistic of the whole "
            f"batch's routing, and {where} run the forward on parts of it apart: their "
            f"losses would not be the whole batch's. Use microbatches=1 without a pipeline, "
            f"or set output_router_logits=False (or router_aux_loss_coef=0) to train "
            f"without it, or pass loss_fn=... that computes it as you intend")


def _check_mode(train, opt, inputs, rt) -> None:
    """``train`` is a bool, the optimizer one ``step`` can step (evaluation needs none),
    and ``inputs`` is not given to a pipeline, whose stages read the batch by its keys."""
    check_bool(train, "step", "train")
    if train:
        _check_optimizer(opt, rt)
    if inputs is not None and rt.roles.pp is not None:
        raise ConfigError("step(inputs=...) with a pipeline: the stages read the batch by its "
                          "keys (the key named as the forward's first parameter goes to the "
                          "first stage, the others to every stage by name); name the batch's "
                          "keys after the forward's parameters and drop inputs=")


def _check_optimizer(opt, rt) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"step(model, opt, batch): opt must be a torch optimizer or "
                          f"meshlab.optimizer(...), got {type(opt).__name__}")
    if not isinstance(opt, MeshOptimizer):
        from ..transforms.precision import PrecisionPart

        prec = rt.part(PrecisionPart)
        if prec is not None and prec.scaler() is not None:
            raise ConfigError("precision('fp16') scales the loss, so the step must unscale "
                              "the gradients and skip overflows: build the optimizer with "
                              "meshlab.optimizer(model, torch.optim.AdamW, ...)")


@contextlib.contextmanager
def _gc_paused(pause: bool):
    """Python's automatic garbage collection off inside, the young generations collected
    once on the way out; nothing where ``pause`` is False or collection is already off
    (the caller manages it)."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(1)


def step(model: nn.Module, opt: torch.optim.Optimizer, batch, loss_fn: Callable | None = None,
         *, microbatches: int = 1, inputs=None, pause_gc: bool = True,
         reduction: str = "mean", num_tokens: Callable | None = None,
         train: bool = True) -> float:
    """One training step: forward/backward over ``microbatches`` slices of this rank's
    ``batch``, then ``opt.step()`` and ``opt.zero_grad()``. Returns the loss of the global
    batch as ``reduction`` defines it, and the gradients are that loss's, as one process
    computes them on the whole global batch:

    * ``'mean'`` (the default): ``loss_fn`` returns the mean over its microbatch; the step's
      loss is the mean of those over microbatches and data-parallel ranks (equal to the
      global mean when every microbatch counts alike). The default loss is the mean over
      the global batch's labelled tokens, as one process takes it: where rows hold
      different numbers of labels (padding, prompts masked with -100) and the step cuts
      the batch (data-parallel ranks, microbatches, a pipeline's), it runs as
      ``'tokens'``;
    * ``'sum'``: ``loss_fn`` returns the sum over its microbatch; the step's loss is the sum
      over the global batch (data-parallel gradients are summed, not averaged);
    * ``'tokens'``: ``loss_fn`` returns the sum over its microbatch's tokens; the step's
      loss is that sum over the global batch divided by the global count of tokens
      (``num_tokens(microbatch)``, by default the labelled next-token positions:
      ``batch['labels'][:, 1:] != -100``), the token-weighted mean a single process takes
      of a padded batch. The default loss follows the reduction. The token count is
      known before the step runs, so a pipeline's schedule weighs each microbatch's sum
      by it on the last stage, as the step does without one.

    The convention, for a dict ``batch``: every key but ``labels`` is passed to the model
    by name (``model(input_ids=...)``: labels go to ``loss_fn``, not to the model, which
    would otherwise compute a second loss), and ``loss_fn(output, batch)`` defaults to the
    causal-LM loss of ``batch['labels']`` (or ``batch['input_ids']``) against
    ``output.logits`` (plus a mixture of experts' router loss, ``_router_term``). A
    tensor ``batch`` is passed positionally. For any other model,
    say how to call it: ``inputs=['idx']`` calls ``model(batch['idx'])``; ``inputs=fn``
    calls ``model(*fn(batch))``. A key the forward does not take, or a batch the default
    loss cannot read, raises ``ConfigError`` naming the keys. Padded and packed batches:
    ``_prepared``.

    ``opt`` may be any torch optimizer (gradients are synchronized by the backward);
    ``meshlab.optimizer`` is needed for fp16 loss scaling, ZeRO-1 and clipping.

    ``pause_gc``: Python's automatic garbage collection is paused for the step and its
    young generations are collected once at the end. A collection then costs one short
    pause per step, not pauses at random points of a step the host sets the pace of (on
    one rank, stalling the others at the next collective), and the reference cycles a
    step makes (selective checkpointing's) are freed every step. ``False`` leaves the
    collector alone, as does a collector the caller has turned off.

    ``train=False`` evaluates: the forward and loss of every microbatch under
    ``torch.no_grad()``, no backward and no optimizer step (``opt`` may be None), and the
    same loss of the global batch; a pipelined model runs its schedule's forward only.
    Dropout and the like follow ``model.train()`` / ``model.eval()`` as the caller set them.
    """
    rt = runtime_of(model)
    fused = fused_loss_of(model)
    mbs, error = None, None
    try:
        _check_mode(train, opt, inputs, rt)
        _check_fused(fused, loss_fn)
        mbs = _prepared(model, rt, batch, _split(batch, microbatches), inputs,
                        loss_fn is None)
        _check_reduction(reduction, num_tokens, rt)
        _check_router_aux(model, rt, batch, microbatches, loss_fn)
        if not isinstance(pause_gc, bool):
            raise ConfigError(f"step(pause_gc={pause_gc!r}): pass True (pause Python's "
                              f"garbage collection for the step) or False")
    except MeshlabError as e:
        error = e
    reduction = _agreed(rt, opt, batch, microbatches, reduction, loss_fn is None, train,
                        error)
    agreed = opt.agreed_by_caller() if isinstance(opt, MeshOptimizer) else \
        contextlib.nullcontext()
    run = _run if train else _evaluate
    with _gc_paused(pause_gc), agreed:
        loss = run(model, rt, opt, mbs, batch, loss_fn, inputs, fused,
                   _Reduce(reduction, num_tokens, rt, mbs))
    # Read after the collection on the way out of the pause: it then runs while the device
    # still works through the optimizer, not while it waits for the next step.
    return float(loss)


def _check_fused(fused: bool, loss_fn) -> None:
    if fused and loss_fn is not None:
        raise ConfigError("this model's loss is fused (fuse('loss')): its head returns the "
                          "causal-LM loss, not logits, so a loss_fn cannot run; leave 'loss' "
                          "out of fuse() to pass one")


def _agreed(rt, opt, batch, microbatches: int, reduction: str, default_loss: bool,
            train: bool, error) -> str:
    """The ranks agree on the step before its first collective (one small exchange): its
    shape, and what must be equal beyond shapes (the batch among the ranks that read it
    together, the optimizer's hyper-parameters), which would otherwise train silently
    wrong. Returns the reduction the step runs: ``'tokens'`` in place of ``'mean'`` for
    the default loss where the global batch's rows hold different numbers of labels
    (``_labelled_per_row``, which the exchange carries)."""
    peers = {**batch_peers(rt, batch), **(hyperparameters(opt) if train else {})} \
        if error is None and not alone(rt.ctrl_group) else None
    spread = _labelled_per_row(batch) if error is None and reduction == "mean" and \
        default_loss and _splits(rt, microbatches) else None
    spreads = agree(rt.ctrl_group, "step", {"batch": _shapes(batch),
                                            "microbatches": microbatches,
                                            "reduction": reduction}, error, peers=peers,
                    shared=spread)
    if spread is not None and len({n for s in spreads for n in s}) > 1:
        return "tokens"
    return reduction


def _run(model, rt, opt, mbs, batch, loss_fn, inputs, fused, red: "_Reduce"):
    """The step's work once its shape is agreed: a room's own schedule, or forward and
    backward over the microbatches, the optimizer, and the loss of the global batch (a
    float from a room's schedule, else a tensor not yet read from the device)."""
    for part in rt.parts:
        done = part.run_step(rt, opt, batch, *red.room_args(part, loss_fn, fused))
        if done is not None:
            return done
    scaler = getattr(opt, "scaler", None)
    # The loss stays on the device until the optimizer's work is queued: reading it after
    # each backward would stop the host there, and the GPU would then wait for the host to
    # launch the optimizer and the next step's first kernels.
    total, done = None, False
    watch = watch_buffers(model, rt, len(mbs))     # the first step that cuts the batch
    try:
        for i, mb in enumerate(mbs):
            rt.set_gradient_sync(model, i == len(mbs) - 1)
            loss = _forward(model, rt, mb, loss_fn, inputs, fused, red)
            if watch is not None and i < 2:
                watch.check(rt, i)
            # the data-parallel reduction averages gradients: ``backward_scale`` undoes it
            # where the global loss is a sum over the ranks
            scale = red.backward_scale * (opt.loss_scale() if scaler is not None else 1.0)
            (loss * scale if scale != 1.0 else loss).backward()
            part = _whole(loss.detach()).to(torch.float64)
            total = part if total is None else total + part
        done = True
    finally:
        if watch is not None:
            watch.close()
        if not done:     # the earlier microbatches' gradients must not reach the next step
            rt.set_gradient_sync(model, True)
            opt.zero_grad()
    opt.step()
    opt.zero_grad()
    if rt.dp_group is not None and rt.dp_size > 1:
        t = total.reshape(1).to(rt.device)
        dist.all_reduce(t, group=rt.dp_group)
        return t[0] * red.backward_scale / rt.dp_size
    return total


def _evaluate(model, rt, opt, mbs, batch, loss_fn, inputs, fused, red: "_Reduce"):
    """``step(..., train=False)``: a room's own forward-only pass (the pipeline's
    schedule), or the forward and loss of every microbatch under ``no_grad``; the loss of
    the global batch as ``_run`` returns it."""
    for part in rt.parts:
        done = part.evaluate(rt, batch, *red.room_args(part, loss_fn, fused))
        if done is not None:
            return done
    total = None
    with torch.no_grad():
        for mb in mbs:
            part = _whole(_forward(model, rt, mb, loss_fn, inputs, fused, red)).to(torch.float64)
            total = part if total is None else total + part
    if rt.dp_group is not None and rt.dp_size > 1:
        t = total.reshape(1).to(rt.device)
        dist.all_reduce(t, group=rt.dp_group)
        return t[0] * red.backward_scale / rt.dp_size
    return total


def _forward(model, rt, mb, loss_fn, inputs, fused, red):
    """One microbatch's forward and loss, as one collective section: an exception on one
    rank (a bad batch its loop skips) reaches every rank before any of them enters the
    backward's reductions, and every rank raises together (``core.sections``)."""
    with section(rt.ctrl_group, "step: forward and loss"), rt.autocast():
        if fused:
            from ..transforms.fuse._hf import step_loss

            labels = mb["labels"] if "labels" in mb else mb["input_ids"]
            mean, out = step_loss(model, mb, labels, with_output=True)
            raw = red.default(mean, mb)
        elif loss_fn is None:
            out = _call(model, mb, inputs)
            raw = red.default(_loss(None, out, mb), mb)
        else:
            return _loss(loss_fn, _call(model, mb, inputs), mb) * red.factor
        loss = raw * red.factor
        aux = _router_term(model, out, mb)
        # the router's load-balancing loss is the global batch's on every rank (computed
        # over the data axes, ``transforms.expert._aux``), added once to the global loss:
        # the backward's scale and the data-parallel average leave it as it is
        return loss if aux is None else loss + aux.to(loss.dtype) / red.backward_scale


def _prepared(model, rt, batch, mbs: list, inputs, default_loss: bool) -> list:
    """The microbatches as the forward gets them, checked before the step's first
    collective (an error here reaches every rank through the step's agreement).

    Padded and packed batches: each room that cannot train one as one process would
    refuses it (``check_batch(plan, batch, layout)``: ``fuse('attention')``, a label that
    would read a padding token's output; the pipeline's decoder stages, a key they do not
    read, while they build each microbatch's mask and positions from its
    ``attention_mask`` and ``position_ids`` as the model's forward does). For a
    forward that takes ``position_ids`` and ``use_cache`` (a Hugging Face model's), a
    batch with ``position_ids`` runs with ``use_cache=False``, and where its rows pack
    several samples (positions that start again inside a row) a 2-D ``attention_mask`` is
    folded into the position ids and dropped (``transforms._packing.as_packed``):
    transformers masks packed samples only so, and each sample then attends to itself
    alone, as run one by one. A training forward runs without a KV cache unless the batch
    asks for one (``apply.materialize._no_cache_in_training``). A BatchNorm that would
    normalize each microbatch alone is refused (``zero._batchnorm.refuse_in_microbatches``)."""
    if len(mbs) > 1:
        refuse_in_microbatches(model, f"step(microbatches={len(mbs)})",
                               "use microbatches=1, or evaluation mode for the BatchNorm "
                               "(module.eval()), which normalizes with its running statistics")
    checks = [t.check_batch for t in rt.plan.rooms or rt.plan.options
              if isinstance(t, Transform) and type(t).check_batch is not Transform.check_batch]
    if checks:
        layout = layout_of(batch)
        seen = _default_labels(batch) if default_loss else batch
        for check in checks:
            try:
                check(rt.plan, seen, layout)
            except ConfigError as e:
                if seen is batch:
                    raise
                raise ConfigError(f"{e} (this batch has no 'labels': the default loss takes "
                                  f"its input_ids as labels, padding tokens included; pass "
                                  f"labels, -100 at padding)") from None
    if inputs is not None:               # the caller says how the model is called
        return mbs
    names, _ = _forward_params(model)
    return [as_packed(mb, names) for mb in mbs]


def _default_labels(batch):
    """``batch`` as the default loss reads it: a dict without ``labels`` labelled by its
    ``input_ids``."""
    if isinstance(batch, dict) and "labels" not in batch and \
            isinstance(batch.get("input_ids"), torch.Tensor):
        return {**batch, "labels": batch["input_ids"]}
    return batch


_REDUCTIONS = ("mean", "sum", "tokens")


def _splits(rt, microbatches) -> bool:
    """Whether the step cuts the global batch: over data-parallel ranks, into microbatches,
    or by a room that runs its own microbatches (the pipeline's schedule)."""
    return rt.dp_size > 1 or microbatches != 1 or any(part.runs_step for part in rt.parts)


def _labelled_per_row(batch) -> list[int] | None:
    """The least and the most labelled next-token positions of this rank's rows, for the
    default loss under ``reduction='mean'``: where rows of the global batch hold
    different numbers, the mean of the parts' means is not the batch's mean over its
    tokens, which one process takes, and the step weighs the parts by their tokens
    (``'tokens'``). None for a batch the default loss does not read."""
    mask = _label_mask(batch)
    if mask is None or not mask.numel():
        return None
    rows = mask.sum(1)
    return [int(rows.min()), int(rows.max())]


def _label_mask(batch) -> torch.Tensor | None:
    """Which next-token positions of a batch the default loss counts (a label not -100,
    from ``batch['labels']``, else ``batch['input_ids']``, as (rows, positions)); None for
    a batch without them."""
    if not isinstance(batch, Mapping) or not ({"input_ids", "labels"} & set(batch)):
        return None
    labels = batch.get("labels", batch.get("input_ids"))
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        return None
    return labels[:, 1:] != -100


def _check_reduction(reduction, num_tokens, rt) -> None:
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"step(reduction={reduction!r}): one of {_REDUCTIONS} ('mean': "
                          f"loss_fn returns a mean; 'sum': a sum; 'tokens': a sum over "
                          f"tokens, divided by the global token count)")
    if num_tokens is not None and (reduction != "tokens" or not callable(num_tokens)):
        raise ConfigError("step(num_tokens=...): a function of a microbatch, with "
                          "reduction='tokens' only")


def _labelled(mb) -> torch.Tensor:
    """The default count of a microbatch's tokens: next-token positions with a label."""
    mask = _label_mask(mb)
    if mask is None:
        raise ConfigError("step(reduction='tokens'): the default token count reads "
                          "batch['labels'] (or batch['input_ids']); pass num_tokens=fn for "
                          "this batch")
    return mask.sum()


class _Reduce:
    """How the step's microbatch losses make the global batch's loss (``step``'s
    ``reduction``): the factor each microbatch's loss is multiplied by, and the scale its
    backward runs at, which undoes the data-parallel average for a sum over the ranks."""

    def __init__(self, reduction: str, num_tokens, rt, mbs):
        self.reduction = reduction
        self.backward_scale = float(rt.dp_size) if reduction != "mean" else 1.0
        self.factor = 1.0 / len(mbs) if reduction == "mean" else 1.0
        self.count = None
        if reduction == "tokens":
            count = sum((num_tokens or _labelled)(mb) for mb in mbs)
            count = torch.as_tensor(count, dtype=torch.float64, device=rt.device).reshape(1)
            if rt.dp_group is not None and rt.dp_size > 1:
                dist.all_reduce(count, group=rt.dp_group)
            self.count = count
            self.factor = 1.0 / float(count.clamp(min=1))

    def default(self, mean: torch.Tensor, mb) -> torch.Tensor:
        """The default (causal-LM) loss, a mean over the microbatch's labelled tokens, as
        this reduction wants it: the mean, or the sum (mean times the count)."""
        return mean if self.reduction == "mean" else _summed(mean, mb)

    def room_args(self, part, loss_fn, fused: bool = False) -> tuple:
        """The loss a room that runs the step itself (the pipeline's schedule) runs on
        each microbatch, and this reduction, which it weighs those losses by
        (``PipelinePart._weigh``): the caller's loss, or the default one as this reduction
        wants it, through the fused head where ``fuse('loss')`` routed it (one function
        of each kind: the schedule is built once per loss function). Any other room's
        ``run_step`` takes the loss alone."""
        if not part.runs_step:
            return (loss_fn or _default_loss,)
        if loss_fn is None:
            mean = self.reduction == "mean"
            loss_fn = (_fused_head_mean if mean else _fused_head_sum) if fused else \
                (_default_loss if mean else _default_sum)
        return (loss_fn, self)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A scalar loss as a plain tensor: a DTensor's full value (a partial sum reduced, as
    ``float()`` of it would), any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _shapes(batch) -> object:
    """The shapes and dtypes of a batch's tensors (what every rank's batch must share)."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape), str(batch.dtype)]
    if isinstance(batch, Mapping):
        return {str(k): _shapes(v) for k, v in batch.items()}
    return type(batch).__name__


def _default_loss(out, batch):
    return _loss(None, out, batch)


def _default_sum(out, batch):
    """The default loss as a sum over the microbatch's labelled tokens (``'sum'`` and
    ``'tokens'``, under a room that runs the step itself)."""
    return _summed(_loss(None, out, batch), batch)


def _summed(mean, batch):
    """A mean over the microbatch's labelled tokens as their sum."""
    return mean * _labelled(batch).clamp(min=1).to(mean.dtype)


def _fused_head_mean(head, hidden, batch):
    """The default loss through a fused head (``fuse('loss')``) on a pipeline's last stage,
    which hands over its final hidden states: the mean over the labelled tokens."""
    from ..transforms.fuse import head_loss

    return head_loss(head, hidden, batch.get("labels", batch["input_ids"]))


def _fused_head_sum(head, hidden, batch):
    """``_fused_head_mean`` as a sum over the microbatch's labelled tokens."""
    return _summed(_fused_head_mean(head, hidden, batch), batch)


_fused_head_mean.runs_head = _fused_head_sum.runs_head = True


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Backwards inside accumulate gradients locally, without communication (DDP's
    ``no_sync``); the first backward after it synchronizes the sums.

    >>> with ml.no_sync(model):            # doctest: +SKIP
    ...     model(**mb0).loss.backward()
    >>> model(**mb1).loss.backward()       # reduces mb0 + mb1  # doctest: +SKIP
    """
    rt = runtime_of(model)
    rt.set_gradient_sync(model, False)
    try:
        yield model
    finally:
        rt.set_gradient_sync(model, True)
