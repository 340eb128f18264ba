"""fuse: run a Hugging Face model's RMSNorm, rotary embedding, attention, gated MLP and loss on
meshlab's fused ops (``meshlab.ops``), routed at materialize time.

The room: ``Fuse`` (a plan value), its checks (ops the traced model has nothing to route
for or whose probe disagrees, found by its plan step; a head the loss would need whole but
tensor parallelism splits; the rooms whose loss or attention replaces fuse's are the
composition table's) and its install, the Hugging Face routing of ``_hf`` (also usable on
its own: ``fuse_model(model)``), each routing probed against what it replaces.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from ...core.errors import ConfigError
from ...planning.plan import Plan
from .._protocol import Phase, Transform
from ._hf import FUSABLE as FUSABLE, NORMS as NORMS, causal_lm_loss as causal_lm_loss
from ._hf import fuse as fuse_model, fused_labels as fused_labels, refusals
from ._hf import fused_loss_of as fused_loss_of
from ._hf import head_loss as head_loss


@dataclasses.dataclass(frozen=True)
class Fuse(Transform):
    """Route ``ops`` (any of ``rms_norm``, ``rotary``, ``attention``, ``mlp``, ``loss``) to
    meshlab's custom ops without changing any class (instance forwards only); each routing
    is probed against the module it replaces when the plan is made from the model (``plan``
    refuses what the install would) and again when it is installed. With ``rms_norm``, a
    decoder layer's middle residual add also runs inside its second norm, the residual
    stream's gradient inside its first norm's backward, and its query/key/value input
    gradient inside those products, where a probe of the layer proves it (reported, never
    refused)."""

    kind: ClassVar[str] = "fuse"
    phase: ClassVar[Phase] = Phase.KERNELS

    ops: tuple[str, ...] = FUSABLE

    def __post_init__(self):
        ops = (self.ops,) if isinstance(self.ops, str) else \
            tuple(self.ops) if isinstance(self.ops, (tuple, list)) else None
        bad = None if ops is None else [o for o in ops if not isinstance(o, str)
                                        or o not in FUSABLE]
        if ops is None or bad or not ops or len(set(ops)) != len(ops):
            given = ", ".join(map(repr, ops if ops is not None else (self.ops,)))
            raise ConfigError(f"fuse({given}): choose "
                              f"distinct op names from {FUSABLE}, e.g. fuse('rms_norm', "
                              f"'loss'), or fuse() for all of them")
        object.__setattr__(self, "ops", ops)

    def apply(self, plan: Plan) -> Plan:
        if plan.source is None:                # no module to probe: the install checks
            return plan
        refused = tuple(refusals(plan.source, self.ops).items())
        return plan.replace(model=dataclasses.replace(plan.model, fuse_refusals=refused))

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """``fuse`` for the norms, rotary embedding and MLP, and ``fuse('attention')`` and
        ``fuse('loss')`` for the ops other rooms replace too (sequence parallelism's
        attention, the pipeline's loss)."""
        return ((("fuse",) if set(self.ops) & {"rms_norm", "rotary", "mlp"} else ())
                + tuple(f"fuse({op!r})" for op in ("attention", "loss") if op in self.ops))

    def check(self, plan: Plan) -> None:
        refused = dict(plan.model.fuse_refusals)
        why = next((refused[op] for op in self.ops if op in refused), None)
        if why is not None:
            raise ConfigError(why)
        if "loss" in self.ops and any(r.kind == "pipeline" and r.blocks is not None
                                      for r in plan.rooms):
            raise ConfigError("fuse('loss') with pipeline(blocks=...): the fused loss runs on "
                              "the last stage of a Hugging Face decoder's pipeline (its final "
                              "norm, then the head); a model whose blocks are declared ends "
                              "its last stage in its own code, so leave 'loss' out of fuse()")
        head, tp = plan.model.head, plan.roles.tp
        if "loss" in self.ops and head is not None and tp is not None and any(
                e.module == head and tp in e.mesh_spec.axes for e in plan.params):
            raise ConfigError(f"fuse('loss') with {head} sharded by shard(): the fused loss "
                              f"needs the whole vocabulary on each rank; leave 'loss' out of "
                              f"fuse() (the vocabulary-parallel cross-entropy runs instead; the "
                              f"composition table's fuse('loss') x shard composes with the head "
                              f"whole on each rank: see docs/composition.md)")

    def check_batch(self, plan: Plan, batch, layout) -> None:
        """meshlab's fused attention reads a padded or packed batch as causal attention
        within segments (``ops.attention.causal_segments``: each packed sample a segment,
        each padding token one of its own), exactly as transformers masks it for every
        token another token attends to. A padding token's own output is not transformers'
        (it sees itself alone), so a batch whose labels would read it (a label other than
        -100 right after a token with ``attention_mask`` 0) is refused before the step's
        first collective; no sample run alone has such a label either."""
        if "attention" not in self.ops or not layout.padded:
            return
        mask, labels = batch.get("attention_mask"), batch.get("labels")
        if not isinstance(mask, Tensor) or not isinstance(labels, Tensor) or \
                mask.dim() != 2 or tuple(labels.shape) != tuple(mask.shape):
            return
        reads = (mask[:, :-1] == 0) & (labels[:, 1:].to(mask.device) != -100)
        if bool(reads.any()):
            row, col = (int(x) for x in reads.nonzero()[0])
            raise ConfigError(
                f"fuse('attention'): row {row} of this batch labels column {col + 1} (not "
                f"-100) after a padding token (attention_mask 0 at column {col}), so the "
                f"loss reads that padding token's output, which meshlab's fused attention "
                f"(a padding token attends to itself alone) does not compute as transformers' "
                f"attention does. Label the token after padding -100 (a sample run alone "
                f"has no token before its first), or leave 'attention' out of fuse()")

    def install(self, ctx) -> None:
        fuse_model(ctx.model, self.ops)

    def profile(self, plan: Plan, model) -> dict | None:
        fuse_model(model, self.ops)
        return {"loss": _fused_loss} if "loss" in self.ops else None

    def __repr__(self) -> str:
        return "fuse()" if self.ops == FUSABLE else f"fuse{self.ops!r}".replace(",)", ")")


def _fused_loss(forward, batch):
    """The step's loss through the fused head, for the activation profile."""
    with fused_labels(batch["labels"]):
        return forward(input_ids=batch["input_ids"], use_cache=False).logits


def fuse(*ops: str) -> Fuse:
    """Fused ops for a Hugging Face model: ``fuse()`` routes all of them, ``fuse('rms_norm',
    'loss')`` those named."""
    return Fuse(tuple(ops) or FUSABLE)
