"""remat: activation checkpointing of the repeated blocks.

The room: ``Remat`` (a plan value) and its install (each block's ``forward`` wrapped in
``torch.utils.checkpoint``; ``selective`` keeps the matmul and attention outputs).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ._forward import remat_forward as _remat_forward
from ...core.errors import ConfigError, check_choice
from .._install import mark_checkpointed
from .._protocol import Phase, Transform

POLICIES = ("none", "full", "selective")


@dataclasses.dataclass(frozen=True)
class Remat(Transform):
    """Recompute activations in backward. ``full`` keeps only each block's input;
    ``selective`` also keeps matmul outputs (recomputes the cheap elementwise ops).
    ``every=n`` (``full`` only) checkpoints the first of every ``n`` blocks and keeps the
    others' activations: memory between none and full for a fraction of the recompute.
    ``count=k`` (``full`` only, in place of ``every``) checkpoints ``k`` of the blocks,
    spread evenly: the finer step between them (each block checkpointed trades its saved
    activations for a third of its work again). ``offload=k`` keeps the saved activations
    of the first ``k`` blocks not checkpointed in host memory between their forward and
    backward, copied out and back on a stream of their own beside the compute (each block
    offloaded trades its saved activations for two copies over the host link instead of
    recomputation; the values are the same bits)."""

    kind: ClassVar[str] = "remat"
    phase: ClassVar[Phase] = Phase.REMAT

    policy: str = "full"
    every: int = 1
    count: int | None = None
    offload: int = 0

    def __post_init__(self):
        check_choice(self.policy, "remat", "policy", POLICIES)
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"remat(every={self.every!r}): every must be an int >= 1 (1 "
                              f"checkpoints every block, 2 every other one)")
        if self.every > 1 and self.policy != "full":
            raise ConfigError(f"remat({self.policy!r}, every={self.every}): every applies to "
                              f"remat('full') only; use remat('full', every={self.every}) or "
                              f"remat({self.policy!r})")
        if self.count is not None:
            if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
                raise ConfigError(f"remat(count={self.count!r}): count must be an int >= 0, "
                                  f"the number of blocks to checkpoint")
            if self.policy != "full" or self.every != 1:
                raise ConfigError(f"remat({self.policy!r}, every={self.every}, count="
                                  f"{self.count}): count applies to remat('full') alone, in "
                                  f"place of every; use remat('full', count={self.count})")

        if isinstance(self.offload, bool) or not isinstance(self.offload, int) or \
                self.offload < 0:
            raise ConfigError(f"remat(offload={self.offload!r}): offload must be an int >= 0, "
                              f"the number of blocks whose saved activations wait in host "
                              f"memory")
        if self.offload and self.policy != "full":
            raise ConfigError(f"remat({self.policy!r}, offload={self.offload}): offload takes "
                              f"blocks remat('full') leaves whole; use remat('full', count=k, "
                              f"offload={self.offload}) (count=0 checkpoints none)")

    def rows(self, plan) -> tuple[str, ...]:
        """``remat``, and ``remat(offload)`` where blocks' activations wait in host memory
        (a variant of its own in the composition table)."""
        return ("remat",) + (("remat(offload)",) if self.offload else ())

    def offloaded(self, blocks) -> list:
        """The blocks of ``blocks`` whose saved activations wait in host memory: the first
        ``offload`` of those not checkpointed (the earliest hold theirs longest, and their
        copies come back last in the backward)."""
        blocks = list(blocks)
        ck = set(map(id, self.checkpointed(blocks)))
        return [b for b in blocks if id(b) not in ck][:self.offload]

    def checkpointed(self, blocks) -> list:
        """The blocks of ``blocks`` (in order) this remat checkpoints: every ``every``-th
        from the first, or ``count`` of them at evenly spread positions."""
        blocks = list(blocks)
        if self.policy == "none":
            return []
        if self.count is None:
            return blocks[::self.every]
        n, k = len(blocks), min(self.count, len(blocks))
        return [blocks[i * n // k] for i in range(k)]

    def check(self, plan) -> None:
        n = len(plan.model.blocks)
        if self.count is not None and self.count > n:
            owner = plan.model.cls or "the model"
            raise ConfigError(f"remat('full', count={self.count}): {owner} has {n} repeated "
                              f"blocks; give a count <= {n}")
        whole = n - len(self.checkpointed(range(n)))
        if self.offload > whole:
            owner = plan.model.cls or "the model"
            raise ConfigError(f"{self!r}: {owner} has {n} repeated blocks and {whole} of them "
                              f"are not checkpointed; give offload <= {whole}, or checkpoint "
                              f"fewer (count=)")

    def install(self, ctx) -> None:
        if self.policy == "none":
            return None
        cfg = getattr(ctx.model, "config", None)
        if getattr(cfg, "use_cache", False):
            # A KV cache would grow again on every recomputed block (HF does the same).
            cfg.use_cache = False
        mods = dict(ctx.model.named_modules())
        local = [b for b in ctx.plan.model.blocks if b in mods and b not in ctx.dropped]
        for b in self.checkpointed(local):
            mods[b].forward = _remat_forward(mods[b].forward, self.policy)
            mark_checkpointed(mods[b])
        if self.offload:
            from ._offload import HostActivations

            off = set(self.offloaded(local))
            host = HostActivations(len(local), {i for i, b in enumerate(local) if b in off})
            for i, b in enumerate(local):
                mods[b].forward = host.wrap(i, mods[b], mods[b].forward)
        return None

    def profile(self, plan, model) -> None:
        # With every > 1 the profiled block runs as the blocks kept whole do; the estimate
        # hooks below take the checkpointed share out.
        if self.policy == "none" or self._partial():
            return None
        seen = [0, 0]
        for b in plan.model.blocks[:1]:
            m = model.get_submodule(b)
            m.forward = _remat_forward(m.forward, self.policy, seen)
        # Selective checkpointing runs every op of the block's forward and recompute
        # through its Python dispatch mode: host time the step model counts per op.
        return {"hooked": [lambda: tuple(seen)]} if self.policy == "selective" else None

    def _partial(self) -> bool:
        """Whether some blocks run whole (``every`` > 1 or a ``count``): the profiled block
        then runs whole and the estimates take the checkpointed share out."""
        return self.every > 1 or self.count is not None

    def _share(self, plan) -> float:
        """The fraction of the blocks checkpointed under ``every`` or ``count`` (0 when
        every block is: the profile itself is checkpointed then)."""
        n = len(plan.model.blocks)
        return len(self.checkpointed(range(n))) / n if self._partial() and n else 0.0

    def activation_memory(self, plan, rows: list, *, batch: int, seq: int) -> list:
        """A checkpointed block keeps its input only: its share of every block's other
        saved rows goes; an offloaded block's saved rows wait in host memory, so its share
        goes too."""
        n = len(plan.model.blocks)
        share = self._share(plan) + (self.offload / n if n else 0.0)
        if not share:
            return rows
        what = "neither checkpointed nor offloaded" if self.offload else "not checkpointed"
        return [dataclasses.replace(r, copies=r.copies * (1 - share),
                                    note=(r.note + f" x{1 - share:.2f} {what}").strip())
                if r.in_block and r.role != "block_input" and r.copies > 1 else r for r in rows]

    def work_share(self, plan, parts: dict) -> dict:
        """The checkpointed blocks run their forward again: a third of a block's forward and
        backward work (the matmuls' share) per checkpointed block."""
        share = self._share(plan)
        if not share or "blocks" not in parts:
            return parts
        return {**parts, "blocks": parts["blocks"] + parts["blocks"].scale(share / 3)}

    def __repr__(self) -> str:
        every = f", every={self.every}" if self.every != 1 else ""
        count = f", count={self.count}" if self.count is not None else ""
        off = f", offload={self.offload}" if self.offload else ""
        return f"remat({self.policy!r}{every}{count}{off})"


def remat(policy="full", every: int = 1, count: int | None = None, offload: int = 0):
    """Activation checkpointing of the repeated blocks (``'none'|'full'|'selective'``);
    ``every=n`` checkpoints one block in ``n``, ``count=k`` checkpoints ``k`` blocks spread
    evenly (``full`` only), ``offload=k`` keeps ``k`` of the others' saved activations in
    host memory from their forward to their backward. Given a function instead, ``jax.remat``'s: the function
    recomputed in the backward, inside ``shard_map`` too (``meshlab.core.shard_map.remat``).

    >>> remat('selective')
    remat('selective')
    >>> remat('full', every=2).checkpointed(['l0', 'l1', 'l2', 'l3', 'l4'])
    ['l0', 'l2', 'l4']
    >>> remat('full', count=3).checkpointed(['l0', 'l1', 'l2', 'l3', 'l4', 'l5', 'l6', 'l7'])
    ['l0', 'l2', 'l5']
    >>> remat('full', count=3, offload=2).offloaded(['l0', 'l1', 'l2', 'l3', 'l4', 'l5'])
    ['l1', 'l3']
    """
    if callable(policy):
        if (every, count, offload) != (1, None, 0):
            raise ConfigError("remat(fn) recomputes one function; every= and count= choose "
                              "blocks of a model: give remat('full', ...) for those")
        from ...core.shard_map import remat as remat_fn

        return remat_fn(policy)
    return Remat(policy, every, count, offload)
