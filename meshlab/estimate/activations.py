"""Activation memory per rank: the profile of one block (``meshlab.estimate.profile``), scaled by
the rooms to what one rank of the mesh holds.

Two sets of rows come out, each an ``ActRow`` (a storage of the profile, the module that
made it, and how many copies of it a rank holds):

* ``saved``: what the forward leaves for the backward, on the rank that holds most:
  one copy per block the rank runs, one of what lives outside the blocks; the hidden
  states between blocks once per block when the block keeps its input (checkpointing),
  the last block's output once when the final norm keeps it;
* ``peak``: what is alive at the step's highest moment: the profile's own peak (one
  block's backward, the loss and its gradient, the gradients made so far) plus the other
  blocks' saved activations, and the transients the rooms add there (ZeRO-3's gathered
  unit, ZeRO-2's gathered parameters).

The rooms rewrite both (``Transform.activation_memory``): ``shard`` divides what lives between
a column- and a row-parallel linear by the TP degree (and, with sequence parallelism, the
rest of the residual stream too); ``sequence`` divides by its axis; ``pipeline`` keeps its
stage's blocks, each times the microbatches in flight; ``zero_shard`` adds its gathers.
Gradients in the peak are counted at the size the rank keeps (``room_rows``).
"""

from __future__ import annotations

from ..planning.rows import ActRow as ActRow

import dataclasses

from .profile import Saved, profile


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Per-rank rows (module docstring); ``saved`` and ``peak`` are their byte totals."""

    saved_rows: tuple[ActRow, ...]
    peak_rows: tuple[ActRow, ...]
    batch: int
    seq: int

    @property
    def saved(self) -> int:
        return int(sum(r.total for r in self.saved_rows))

    @property
    def peak(self) -> int:
        """Activations, temporaries and gradients alive at the forward/backward's peak."""
        return int(sum(r.total for r in self.peak_rows))

    def by_module(self, rows: str = "saved") -> dict[str, int]:
        """Bytes per module (``rows``: ``'saved'`` or ``'peak'``)."""
        out: dict[str, int] = {}
        for r in getattr(self, f"{rows}_rows"):
            out[r.module] = out.get(r.module, 0) + int(r.total)
        return out


def _row(s: Saved, block: str, copies: float = 1.0) -> ActRow:
    inside = s.in_block(block) or s.role == "block_input"
    return ActRow(module=s.module, op=s.op, dtype=s.dtype, shape=s.shape, bytes=float(s.bytes),
                  copies=copies, in_block=inside, grad=s.grad, users=s.users, role=s.role)


def estimate_activations(plan, batch: int, seq: int, grad_bytes: dict[str, int],
                         inputs=None, loss=None) -> ActivationEstimate:
    """The per-rank activation rows of ``plan`` for ``batch`` sequences of ``seq`` tokens
    per data-parallel rank (the module docstring); ``grad_bytes``: FQN -> the bytes of the
    gradient the rank keeps (``plan.memory()``'s rows); ``inputs`` and ``loss`` the
    example step (``meshlab.estimate.example``)."""
    from ..core.errors import PlanError

    model = plan.source
    if model is None:
        raise PlanError("plan.memory(batch=, seq=): this plan has no model to profile (it was "
                        "read from JSON); plan the model itself with meshlab.plan(model, spec, "
                        "mesh) to count activations")
    pr = profile(model, plan, batch, seq, inputs, loss)
    n_blocks = len(plan.model.blocks)
    saved = [_row(s, pr.block, _copies(s, pr.block, n_blocks)) for s in pr.saved]
    others = [_row(s, pr.block, _copies(s, pr.block, n_blocks) - 1) for s in pr.saved
              if _copies(s, pr.block, n_blocks) > 1]
    peak = [_row(s, pr.block) for s in pr.peak] + others
    for t in plan.rooms:
        saved = list(t.activation_memory(plan, saved, batch=batch, seq=seq))
        peak = list(t.activation_memory(plan, peak, batch=batch, seq=seq))
    peak = _local_grads(plan, peak, grad_bytes)
    return ActivationEstimate(tuple(saved), tuple(peak), batch, seq)


def _copies(s: Saved, block: str, n_blocks: int) -> int:
    """How many of ``s`` a model of ``n_blocks`` blocks holds. A block's input is the
    previous block's output: kept once per block if the profiled block keeps its input
    (checkpointing, a norm that saves it); its own output once (the last block's, if the
    final norm keeps it)."""
    if s.role == "block_input":
        return n_blocks
    if s.role == "block_output":
        return 1
    return n_blocks if s.in_block(block) else 1


_FULL: list = []      # (params, {fqn: bytes}): the last few parameter tables' whole bytes


def _full_bytes(params) -> dict[str, int]:
    """FQN -> the bytes of the whole parameter, read-only: a function of the parameter
    table alone (immutable), kept for the last few tables (layouts share bound tables)."""
    for table, full in _FULL:
        if table is params:
            return full
    full = {e.fqn: e.numel * _bytes(e.dtype) for e in params}
    _FULL.insert(0, (params, full))
    del _FULL[4:]
    return full


def _local_grads(plan, rows: list[ActRow], local: dict[str, int]) -> list[ActRow]:
    """Gradients in the peak at the size the rank keeps them (the rooms' memory rows)."""
    full = _full_bytes(plan.params)
    out = []
    for r in rows:
        if r.grad and r.grad in full and full[r.grad]:
            r = dataclasses.replace(r, bytes=r.bytes * local.get(r.grad, 0) / full[r.grad],
                                    note="grad at its local size")
        out.append(r)
    return out


def _bytes(dtype: str) -> int:
    from ..core.units import dtype_bytes

    return dtype_bytes(dtype)
