"""fuse: run a Hugging Face model's RMSNorm, rotary embedding, attention, gated MLP and loss on
meshlab's fused ops (``meshlab.ops``), routed at materialize time.

The room: ``Fuse`` (a plan value), its checks (ops the traced model has nothing to route
for or whose probe disagrees, found by its plan step; the rooms whose loss or attention
replaces fuse's are the composition table's) and its install, the Hugging Face routing of
``_hf`` (also usable on its own: ``fuse_model(model)``), each routing probed against what
it replaces. A head tensor parallelism splits over the vocabulary takes the split loss
(``ops.linear_cross_entropy_split``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from ...core.errors import ConfigError, check_choice
from ...planning.decisions import register_decision
from ...planning.plan import Plan
from .._packing import check_labels_after_padding
from .._protocol import Phase, Transform
from ._hf import FUSABLE as FUSABLE, NORMS as NORMS, causal_lm_loss as causal_lm_loss
from ._hf import fuse as fuse_model, fused_labels as fused_labels, findings
from ._hf import refusals as refusals
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
    # an op that finds nothing in the model to route: 'refuse' it (ops named in fuse(...)),
    # or 'leave' it out and record that in the plan (fuse() as written, without names)
    absent: str = "refuse"

    def __post_init__(self):
        check_choice(self.absent, "fuse", "absent", ("refuse", "leave"))
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
        refused, absent = findings(plan.source, self.ops)
        return plan.replace(model=dataclasses.replace(
            plan.model, fuse_refusals=tuple(refused.items()), fuse_absent=absent))

    def routed(self, plan: Plan | None) -> tuple[str, ...]:
        """The ops this room routes in ``plan``'s model: its ``ops``, less, where
        ``absent='leave'``, those ``_left`` names."""
        if self.absent != "leave" or plan is None:
            return self.ops
        left = self._left(plan)
        return tuple(op for op in self.ops if op not in left)

    def _left(self, plan: Plan) -> dict[str, str]:
        """Ops left out, each with why: those that find nothing in the model to route."""
        refused = dict(plan.model.fuse_refusals)
        return {op: refused.get(op, "nothing to route") for op in plan.model.fuse_absent}

    def decide(self, plan: Plan) -> "FuseLeft | None":
        """The ops left out (``_left``), each with why."""
        if self.absent != "leave":
            return None
        left = self._left(plan)
        pairs = tuple((op, left[op]) for op in self.ops if op in left)
        return FuseLeft(pairs) if pairs else None

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """``fuse`` for the norms, rotary embedding and MLP, and ``fuse('attention')`` and
        ``fuse('loss')`` for the ops other rooms replace too (sequence parallelism's
        attention, the pipeline's loss); of the ops routed in the plan's model."""
        ops = self.routed(plan)
        return ((("fuse",) if set(ops) & {"rms_norm", "rotary", "mlp"} else ())
                + tuple(f"fuse({op!r})" for op in ("attention", "loss") if op in ops))

    def check(self, plan: Plan) -> None:
        ops = self.routed(plan)
        refused = dict(plan.model.fuse_refusals)
        why = next((refused[op] for op in ops if op in refused), None)
        if why is not None:
            raise ConfigError(why)
        if "loss" in ops and any(r.kind == "pipeline" and r.blocks is not None
                                 for r in plan.rooms):
            raise ConfigError("fuse('loss') with pipeline(blocks=...): the fused loss runs on "
                              "the last stage of a Hugging Face decoder's pipeline (its final "
                              "norm, then the head); a model whose blocks are declared ends "
                              "its last stage in its own code, so leave 'loss' out of fuse()")

    def check_batch(self, plan: Plan, batch, layout) -> None:
        """meshlab's fused attention reads a padded or packed batch as causal attention
        within segments (``ops._attention_hf.causal_segments``: each packed sample a segment,
        each padding token one of its own), exactly as transformers masks it for every
        token another token attends to. A padding token's own output is not transformers'
        (it sees itself alone), so a batch whose labels would read it (a label other than
        -100 right after a token with ``attention_mask`` 0) is refused before the step's
        first collective; no sample run alone has such a label either."""
        if "attention" in self.routed(plan):
            check_labels_after_padding(batch, layout, "fuse('attention')",
                                       "leave 'attention' out of fuse()")

    def install(self, ctx) -> None:
        ops = self.routed(ctx.plan)
        if ops:                 # absent='leave' in a model with none of them: the plan says
            fuse_model(ctx.model, ops)

    def profile(self, plan: Plan, model) -> dict | None:
        ops = self.routed(plan)
        if ops:
            fuse_model(model, ops)
        return {"loss": _fused_loss} if "loss" in ops else None

    def __repr__(self) -> str:
        if self.ops == FUSABLE and self.absent == "leave":
            return "fuse()"
        named = ", ".join(map(repr, self.ops))
        return f"fuse({named})" if self.absent == "refuse" else f"fuse({named}, absent='leave')"


@dataclasses.dataclass(frozen=True)
class FuseLeft:
    """The ops ``fuse`` left out for finding nothing in the model to route, each with the
    finding (``absent='leave'``: ``fuse()`` as written without names)."""

    left: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        return "fuse left " + "; ".join(f"{op} ({why})" for op, why in self.left)

    def to_json(self) -> dict:
        return {"left": [list(x) for x in self.left]}

    @classmethod
    def from_json(cls, d: dict) -> "FuseLeft":
        return cls(tuple(tuple(x) for x in d["left"]))


register_decision("fuse.left", FuseLeft)


def _fused_loss(forward, batch):
    """The step's loss through the fused head, for the activation profile."""
    with fused_labels(batch["labels"]):
        return forward(input_ids=batch["input_ids"], use_cache=False).logits


def fuse(*ops: str, absent: str | None = None) -> Fuse:
    """Fused ops for a Hugging Face model: ``fuse()`` routes each of them the model has
    (an op that finds nothing to route, such as the gated MLP of a mixture-of-experts
    model, is left out, and ``plan.decision(FuseLeft)`` says why); ``fuse('rms_norm',
    'loss')`` routes those named, and refuses one that finds nothing, unless
    ``absent='leave'``.

    >>> fuse()
    fuse()
    >>> fuse('rms_norm', 'loss')
    fuse('rms_norm', 'loss')
    >>> fuse('rms_norm', 'mlp', absent='leave')
    fuse('rms_norm', 'mlp', absent='leave')
    """
    if absent is None:
        absent = "refuse" if ops else "leave"
    return Fuse(tuple(ops) or FUSABLE, absent)
