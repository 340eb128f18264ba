"""Sequence parallelism on the local-shard path: when it is on, and what it refuses.

Megatron SP splits the residual stream's sequence over the TP axis between the first
block and the last, gathers it where each region starts and reduce-scatters where each
ends; a model whose layout breaks that chain (two stacks of blocks, a column-parallel
module outside any region, a region outside the blocks or with several inputs) is
refused here, from the plan alone.
"""

from __future__ import annotations


from ...core.errors import ConfigError
from ...planning.plan import Plan
from ._styles import ColWise

# ``_Scan`` in annotations is the layout's scan (``_layout``), which imports this module.


def sequence_parallel(plan: Plan, axis: str) -> bool:
    """Megatron SP: the blocks' outputs are split on the sequence over the TP axis."""
    blocks = set(plan.model.blocks)
    return any(a.module in blocks and a.output is not None and len(a.output) > 1
               and a.output.dim_axes(1) == (axis,) for a in plan.activations)


def _refuse_sp_stacks(scan: _Scan) -> None:
    """Sequence parallelism splits the sequence before the first block and gathers it
    after the last: one chain of blocks. An encoder-decoder model has two."""
    stacks = list(dict.fromkeys(
        a.module.rpartition(".")[0] for a in scan.plan.activations
        if a.output is not None and len(a.output) > 1 and a.output.dim_axes(1) ==
        (scan.axis,) and a.module.rpartition(".")[2].isdigit()))
    if len(stacks) < 2:
        return
    raise ConfigError(
        f"sequence parallelism over {scan.axis!r}: the activation specs split the sequence "
        f"of the blocks of {len(stacks)} stacks ({', '.join(stacks)}): "
        f"{scan.plan.model.cls or 'the model'} is an encoder-decoder model, and meshlab "
        f"splits the sequence once before the first block and gathers it after the last, "
        f"one chain of blocks (the decoder's cross-attention would read the encoder's "
        f"output split). Run it with tensor parallelism alone: map 'seq' to None in Rules")


def _sp_without_regions(plan: Plan, axis: str) -> str:
    mods = [a.module for a in plan.activations if a.module in plan.model.blocks and
            a.output is not None and len(a.output) > 1 and a.output.dim_axes(1) == (axis,)]
    shown = ", ".join(mods[:2]) + (", ..." if len(mods) > 2 else "")
    return (f"sequence parallelism: the activation specs split the output of {shown} on "
            f"the sequence (dim 1) over {axis!r}, which the local-shard path runs only for "
            f"a policy that marks the model's tensor-parallel regions (it splits the "
            f"sequence before the first block and gathers it where each region starts). "
            f"Write a Policy with regions and sequence_parallel for this model "
            f"(docs/policies.md shows one), or drop the activation spec: without regions the "
            f"model runs in DTensor mode, where ml.constrain(h, P('batch', {axis!r}, None)) "
            f"on the residual stream between blocks shards the sequence (docs/policies.md, "
            f"'Without a policy')")


def _refuse_sp_outside_regions(scan: _Scan) -> None:
    """Under sequence parallelism the residual stream between regions holds this rank's
    share of the sequence; only a region's entry gathers it. A column-parallel module
    outside every region (the output head aside) would read a sequence shard as if it
    were the whole input, and the row-parallel module after it scatter a dim that is not
    the sequence."""
    if not scan.sp:
        return
    for m in scan.modules:
        if isinstance(m.style, ColWise) and not m.style.in_region and \
                m.fqn not in scan.regions:
            raise ConfigError(
                f"{m.fqn}: column-parallel outside every tensor-parallel region, under "
                f"sequence parallelism: its input is this rank's share of the sequence, "
                f"which only a region's entry gathers (a module that takes the (batch, "
                f"seq, hidden) stream, listed in the policy's regions). This model gives "
                f"{m.fqn} no such module to enter by; drop 'seq' from the rules (tensor "
                f"parallelism without sequence parallelism runs it)")


def _refuse_sp_regions(scan: _Scan) -> tuple[str, ...]:
    """The regions every tensor input of which enters (``Policy.multi_input_regions``);
    under sequence parallelism, refuses those and any region outside the blocks: the
    sequence is split only between the first block and the last, so a region after them
    (SAM's mask decoder) would gather a whole sequence again, and its row-parallel join
    scatter it."""
    multi = tuple(a.module for a in scan.plan.activations if "tp_region_all_inputs" in a.tags)
    if not scan.sp:
        return multi
    blocks = scan.plan.model.blocks
    for r in scan.regions:
        inside = any(r == b or r.startswith(b + ".") for b in blocks)
        if inside and r not in multi:
            continue
        why = ("takes several inputs (query, key, value), each of which would need its "
               "own sequence gather" if inside else
               f"lies outside the repeated blocks ({blocks[0] if blocks else 'none'}, ...), "
               f"where the sequence is whole")
        raise ConfigError(
            f"sequence parallelism over {scan.axis!r}: the tensor-parallel region {r} {why}; "
            f"meshlab splits the sequence before the first block and gathers it after the "
            f"last, and runs every region's row-parallel join as a reduce-scatter of the "
            f"sequence. Run {scan.plan.model.cls or 'this model'} with tensor parallelism "
            f"alone: map 'seq' to None in Rules")
    return multi
