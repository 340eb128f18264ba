"""sequence: shard activations along the sequence over a mesh axis.

* ``split_gather``: Megatron sequence parallelism inside tensor parallelism — the axis
  must be the tensor-parallel one; the blocks' outputs are sequence-sharded between the
  TP regions (the same as mapping the logical ``seq`` axis to it in Rules).
* ``all_to_all``: DeepSpeed-Ulysses — each rank keeps a slice of the sequence through the
  whole block stack; attention exchanges sequence for heads with an all-to-all before and
  after (the head count must divide over the axis).
* ``ring``: context parallelism — K/V blocks travel around the ring with online-softmax
  accumulation; the sequence is split in 2n chunks, rank r keeping chunks r and 2n-1-r so
  the causal work is balanced.

For ``all_to_all`` and ``ring`` the sequence is split before the first block and gathered
after the last, so the embeddings, final norm and head see the whole sequence. Padded and
packed batches (``attention_mask``, ``position_ids`` that start again): the model builds
its mask of the whole sequence before the split; Ulysses hands it to SDPA over the whole
sequence of its heads, ring attention reads it as causal segments and masks each block
pair with the segments of its positions.

Beside ``fuse('attention')``: ring attention computes every block pair on
``meshlab::attention`` in any case; Ulysses then runs each rank's heads over the whole
sequence on it too (SDPA otherwise), K and V sent with their own heads where those divide
over the axis.

2-D sequence parallelism, Ulysses over one axis and ring attention over another:
``sequence('sp', 'all_to_all') | sequence('cp', 'ring')`` combine into one value,
``sequence('sp', mode='all_to_all', ring='cp')`` (``_usp``). The sequence is cut over
both; each attention trades the sequence for heads over ``sp`` and runs the ring over
``cp``, which takes the role ``cp`` (context).

Odd lengths are never padded silently: a sequence not divisible by the axis raises.

The room: ``Sequence`` (claims the ``sp`` role), its checks, its install (``_ulysses``,
``_ring``; the split/gather hooks of ``_hooks`` are shared with Megatron SP) and its
gradient sync (block parameters saw one slice of the sequence: summed over the axis).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from ...core.errors import ConfigError, check_choice, check_name
from ...planning.plan import Plan
from ...core.rules import Rules
from .._gradsync import Reduction
from .._packing import check_labels_after_padding
from .._protocol import Part, Phase, Transform

MODES = ("split_gather", "all_to_all", "ring")


@dataclasses.dataclass(frozen=True)
class Sequence(Transform):
    kind: ClassVar[str] = "sequence"
    phase: ClassVar[Phase] = Phase.SEQUENCE

    axis: str = "sp"
    mode: str = "all_to_all"
    ring: str | None = None          # 2-D: ring attention over this axis, Ulysses over axis

    def __post_init__(self):
        check_name(self.axis, "sequence", "axis", example="sp")
        check_choice(self.mode, "sequence", "mode", MODES)
        if self.ring is not None:
            check_name(self.ring, "sequence", "ring", example="cp")
            if self.mode != "all_to_all":
                raise ConfigError(f"sequence({self.axis!r}, mode={self.mode!r}, "
                                  f"ring={self.ring!r}): ring= is the ring axis of 2-D "
                                  f"sequence parallelism beside Ulysses; use "
                                  f"mode='all_to_all'")
            if self.ring == self.axis:
                raise ConfigError(_same_axis(self.axis))

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes the sequence is cut over between the blocks (none for split_gather,
        whose cut is shard's)."""
        if self.mode == "split_gather":
            return ()
        return (self.axis,) + ((self.ring,) if self.ring else ())

    def combine(self, other):
        """``sequence(a, 'all_to_all') | sequence(r, 'ring')`` (either order): 2-D sequence
        parallelism, ``sequence(a, mode='all_to_all', ring=r)``. One axis for both is
        refused."""
        if not isinstance(other, Sequence) or self.ring or other.ring or \
                {self.mode, other.mode} != {"all_to_all", "ring"}:
            return None
        uly, ring = (self, other) if self.mode == "all_to_all" else (other, self)
        if uly.axis == ring.axis:
            raise ConfigError(_same_axis(uly.axis))
        return Sequence(uly.axis, "all_to_all", ring.axis)

    def apply(self, plan: Plan) -> Plan:
        if self.mode == "split_gather":
            rules = Rules(seq=self.axis)
            return plan.replace(rules=rules if plan.rules is None else plan.rules | rules)
        if not plan.model.blocks:
            raise ConfigError(f"sequence({self.mode}) needs a model with repeated blocks")
        return plan

    def claims(self, plan: Plan):
        if self.mode == "split_gather":
            return {}
        return {"sp": (self.axis,), **({"cp": (self.ring,)} if self.ring else {})}

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """Its mode: ``sequence('all_to_all')``, ``sequence('ring')`` or
        ``sequence('split_gather')``; 2-D takes the rows of both its modes."""
        return (f"sequence({self.mode!r})",) + (("sequence('ring')",) if self.ring else ())

    def work_share(self, plan: Plan, parts: dict) -> dict:
        """Each rank computes its share of the sequence (Ulysses: of the heads)."""
        n = math.prod(plan.mesh_shape.get(a, 1) for a in self.axes)
        if n == 1:
            return parts
        return {k: w.scale(1 / n, ops=1.0) for k, w in parts.items()}

    def profile(self, plan: Plan, model) -> dict | None:
        """The profiled copy attends as this room's attention does (``profile_attention``
        of ``_ring`` / ``_ulysses``: what it keeps, on one process at the whole sequence),
        not as the model's own eager or SDPA attention; split_gather runs the model's."""
        if self.mode == "split_gather":
            return None
        try:
            from transformers import AttentionInterface
        except ImportError:          # no Hugging Face model to route (check() refuses it)
            return None
        from . import _ring, _ulysses

        impl = _ring if self.mode == "ring" or self.ring else _ulysses
        AttentionInterface.register(impl.PROFILE_NAME, impl.profile_attention)
        _ulysses.set_attention(model, impl.PROFILE_NAME)
        return None

    def activation_memory(self, plan: Plan, rows: list, *, batch: int, seq: int) -> list:
        """Inside the blocks every rank holds its share of the sequence (Ulysses: of the
        heads inside attention, the same bytes); outside them, and where the hidden states
        are cut and joined, the whole sequence (``_memory``). split_gather is shard()'s
        sequence parallelism. 2-D: the share of both axes, the tables as the ring keeps
        them."""
        n = math.prod(plan.mesh_shape.get(a, 1) for a in self.axes)
        if n == 1:
            return rows
        from ._memory import rank_rows

        cfg = plan.model.config_get
        mode = "ring" if self.ring else self.mode
        return rank_rows(rows, n=n, mode=mode, block=plan.model.blocks[0],
                         n_blocks=len(plan.model.blocks),
                         width=cfg("hidden_size") or cfg("n_embd"))

    def check(self, plan: Plan) -> None:
        from ..zero._batchnorm import batch_norms

        sizes = plan.mesh_shape
        for a in (self.axis,) + ((self.ring,) if self.ring else ()):
            if a not in sizes:
                raise ConfigError(f"sequence axis {a!r} is not a mesh axis {tuple(sizes)}")
        bn = next(iter(batch_norms(plan, instance=True)), None)
        if bn is not None:
            raise ConfigError(f"{self!r}: {bn.fqn} ({bn.cls}) would normalize with the "
                              f"statistics of this rank's part of the sequence, where one "
                              f"process normalizes with the whole sample's or batch's; not "
                              f"supported")
        if self.mode == "split_gather":
            if plan.roles.tp != self.axis:
                raise ConfigError(
                    f"sequence({self.axis!r}, 'split_gather') is Megatron sequence parallelism "
                    f"inside tensor parallelism: {self.axis!r} must be the tensor-parallel axis "
                    f"(it is {plan.roles.tp!r}); shard over it or use mode='all_to_all' (the "
                    f"composition table's sequence('split_gather') row is shard's Megatron SP; "
                    f"see docs/composition.md)")
            return
        _refuse_non_causal(plan, self.mode)
        heads = plan.model.config_get("num_attention_heads")
        if heads is None:
            raise ConfigError(f"sequence({self.mode}) needs a Hugging Face model (config with "
                              f"num_attention_heads)")
        n = sizes[self.axis]
        if self.mode == "all_to_all" and heads % n:
            raise ConfigError(f"sequence(all_to_all): {heads} attention heads do not divide over "
                              f"{n} ranks; use a sequence axis size that divides {heads}")

    def check_batch(self, plan: Plan, batch, layout) -> None:
        """Ring attention reads a padded batch as causal segments, as ``fuse('attention')``
        does: a batch whose loss would read a padding token's output is refused as there.
        Ulysses runs SDPA over transformers' own mask: the same outputs as the model's
        SDPA attention, padding tokens' included; a model on another attention (eager's
        fully masked rows, flash-attention's dropped padding) computes a padding token's
        output otherwise, so the same batch is refused there."""
        if self.mode == "ring" or self.ring:
            check_labels_after_padding(batch, layout, repr(self),
                                       "use sequence(..., 'all_to_all')")
            return
        own = plan.model.config_get("attn_implementation")
        if self.mode == "all_to_all" and own not in (None, "sdpa"):
            check_labels_after_padding(
                batch, layout, repr(self), "load the model with attn_implementation='sdpa'",
                f"Ulysses' SDPA does not compute as the model's {own!r} attention does")

    def install(self, ctx) -> Part | None:
        if self.mode == "split_gather":
            return None            # shard's room runs Megatron SP
        from . import _ring
        from . import _ulysses

        group = ctx.group(self.axis)
        blocks = ctx.plan.model.blocks
        held = frozenset(b for b in blocks if b not in ctx.dropped)   # a pipeline stage's
        if self.ring:                    # 2-D: Ulysses over axis around the ring over ring
            from . import _usp

            _usp.install(ctx.model, blocks, group, ctx.group(self.ring), held)
        elif self.mode == "ring":          # every block pair on meshlab::attention already
            _ring.install(ctx.model, blocks, group, held)
        else:                            # fuse('attention'): each rank's heads on it too
            _ulysses.install(ctx.model, blocks, group, held,
                             fused=_fused_attention(ctx.plan))
        return None

    def reductions(self, plan: Plan) -> list:
        """Every block parameter sees this rank's slice of the sequence only: its
        gradient is summed over the sequence axis (Megatron SP's are shard's)."""
        if self.mode == "split_gather":
            return []
        blocks = plan.model.blocks
        names = frozenset(e.fqn for e in plan.params
                          if any(e.fqn.startswith(b + ".") for b in blocks))
        return [Reduction(self.axes, average=False, names=names, order=5)]

    def comm(self, plan: Plan, *, batch, seq, coord):
        """Per block, Ulysses moves q, k, v and the output through one all-to-all each way
        (k and v after GQA expansion: heads x seq/n x head_dim), and the sequence is
        gathered once after the blocks and once (gradients) before them; ring sends K and
        V (their own heads) n - 1 steps forward in the forward and again in the backward,
        their gradients n steps home, and gathers the sequence as Ulysses does. 2-D:
        Ulysses over its axis on S/(a r) (K and V with their own heads where those divide
        over it, as the 2-D attention sends them), its gather joining S/r; the ring over
        the other on H/a heads of S/r."""
        sizes = plan.mesh_shape
        if not self.axes or math.prod(sizes.get(a, 1) for a in self.axes) == 1 or \
                batch is None or seq is None:
            return []
        a = sizes.get(self.axis, 1)
        if self.mode == "ring":
            return _ring_ops(plan, self.axis, a, batch, seq, heads_cut=1)
        r = sizes.get(self.ring, 1) if self.ring else 1
        own = _fused_attention(plan) or self.ring is not None
        ops = _ulysses_ops(plan, self.axis, a, batch, seq // r, own) if a > 1 else []
        if self.ring and r > 1:
            ops += _ring_ops(plan, self.ring, r, batch, seq, heads_cut=a)
        return ops

    def __repr__(self) -> str:
        ring = f", ring={self.ring!r}" if self.ring else ""
        return f"sequence({self.axis!r}, mode={self.mode!r}{ring})"


def _same_axis(axis: str) -> str:
    return (f"sequence: Ulysses and ring attention both over {axis!r}; 2-D sequence "
            f"parallelism needs an axis for each (sequence('sp', 'all_to_all') | "
            f"sequence('cp', 'ring'))")


def split_axes(plan: Plan) -> tuple[str, ...]:
    """The axes Ulysses and ring attention cut the sequence over between the blocks."""
    s = plan.get(Sequence)
    return () if s is None else s.axes


def _widths(plan: Plan):
    """(hidden size, q width, heads, K/V heads, bytes per element, blocks)."""
    from ...core.units import dtype_bytes

    cfg = plan.model.config_get
    h = cfg("hidden_size") or cfg("n_embd")
    heads = cfg("num_attention_heads") or cfg("n_head")
    # a model without a config: q, k and v as wide as the hidden states
    width = heads * (cfg("head_dim") or h // heads) if heads else h
    wb = dtype_bytes(plan.params[0].dtype) if plan.params else 4
    return h, width, heads, cfg("num_key_value_heads") or heads, wb, len(plan.model.blocks)


def _ring_ops(plan: Plan, axis: str, n: int, batch: int, seq: int, heads_cut: int) -> list:
    """K and V with their own (grouped) heads, ``1/heads_cut`` of them: n - 1 shifts each
    in the forward and again in the backward's recompute, and their gradients
    (accumulated in at least float32) n shifts home; the sequence gathered once after the
    blocks and once (gradients) before them."""
    from .._protocol import CommOp

    h, width, heads, kv_heads, wb, L = _widths(plan)
    piece = batch * (seq // n) * width * wb // heads_cut
    # 2-D: K/V heads that do not divide over the Ulysses axis were expanded to the queries'
    kv = piece * kv_heads // heads if heads and kv_heads % heads_cut == 0 else piece
    dkv = kv * max(wb, 4) // wb
    count = L * (4 * (n - 1) + 2 * n)
    nbytes = L * (4 * (n - 1) * kv + 2 * n * dkv)
    return [CommOp("send", axis, count, nbytes), CommOp("recv", axis, count, nbytes),
            CommOp("all_gather", axis, 2, 2 * batch * seq * h * wb)]


def _ulysses_ops(plan: Plan, axis: str, n: int, batch: int, seq: int, own: bool) -> list:
    """The all-to-alls of ``seq`` tokens over ``n`` ranks (K and V with their own heads
    where ``own`` and those divide over the axis) and the gather of the sequence."""
    from .._protocol import CommOp

    h, width, heads, kv_heads, wb, L = _widths(plan)
    piece = batch * (seq // n) * width * wb
    kv = piece * kv_heads // heads if heads and own and kv_heads % n == 0 else piece
    return [CommOp("all_to_all", axis, 8 * L, 4 * L * (piece + kv)),
            CommOp("all_gather", axis, 2, 2 * batch * seq * h * wb)]


def _fused_attention(plan: Plan) -> bool:
    """Whether the spec routes attention to ``meshlab::attention`` (``fuse('attention')``):
    Ulysses then runs each rank's heads on it, K and V with their own heads."""
    return any("attention" in t.routed(plan) for t in plan.rooms
               if getattr(t, "kind", "") == "fuse")


def _refuse_non_causal(plan: Plan, mode: str) -> None:
    """Ulysses and ring attention are shown for decoder-only models whose attention
    modules say they are causal (``is_causal``); an encoder-decoder, a bidirectional
    encoder, or attention that does not say (ALiBi's BLOOM) is refused."""
    model, cls = plan.model, plan.model.cls or "this model"
    fix = "use tensor parallelism with Megatron SP (shard with seq mapped to the tp axis)"
    if model.config_get("is_encoder_decoder"):
        raise ConfigError(f"sequence({mode}): {cls} is an encoder-decoder model; meshlab "
                          f"splits the sequence of one decoder-only stack; {fix}")
    blocks = tuple(model.blocks)
    attn = [m for m in model.modules if any(m.fqn.startswith(b + ".") for b in blocks)
            and m.get("is_causal") is not None]
    if not attn:
        raise ConfigError(f"sequence({mode}): no attention module in {cls}'s blocks says it "
                          f"is causal (is_causal), and meshlab's sequence-parallel attention "
                          f"is shown for causal attention only; {fix}")
    own = next((m for m in attn if not m.get("attention_interface")), None)
    if own is not None:
        raise ConfigError(f"sequence({mode}): {own.fqn} ({own.cls}) runs its own attention "
                          f"kernel, not through transformers' AttentionInterface, where "
                          f"meshlab's sequence-parallel attention enters; {fix}")
    bidi = next((m for m in attn if not m.get("is_causal")), None)
    if bidi is not None:
        raise ConfigError(f"sequence({mode}): {bidi.fqn} ({bidi.cls}) attends both ways "
                          f"(is_causal=False); meshlab's sequence-parallel attention is "
                          f"causal; {fix}")


def sequence(axis: str = "sp", mode: str = "all_to_all", ring: str | None = None) -> Sequence:
    """Sequence parallelism over ``axis`` (``'split_gather'``, ``'all_to_all'`` or
    ``'ring'``); ``ring``: beside Ulysses, ring attention over that axis (2-D, the same
    value as ``sequence(axis, 'all_to_all') | sequence(ring, 'ring')``).

    >>> sequence('sp', 'all_to_all')
    sequence('sp', mode='all_to_all')
    >>> sequence('sp', 'all_to_all', ring='cp')
    sequence('sp', mode='all_to_all', ring='cp')
    """
    return Sequence(axis, mode, ring)
