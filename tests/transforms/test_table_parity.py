"""Every cell of the composition table marked composes, trained on gloo against one process.

The cases are the table's: one per cell whose status is ``composes``, spelled as
``tests/transforms/_pairs.py`` spells the pair (a small Llama, a small Qwen3-MoE where
``expert_route`` is in it, each parallel axis of size 2, ``data_parallel('dp')`` added over
two ranks where the pair holds no data axis and the mesh stays within 4 ranks). Each runs
``meshlab.verify``: two steps of the layout and of its reference side by side on every
rank, then the loss of each step, every parameter's gradient and weight after each step,
and the starting weights, against the reference within the tolerance of the cell's rows.
``step_in_backward`` runs on a mesh of one rank (beside ``zero_shard(3)``, on its data
ranks), as its room requires. One gloo world per
world size serves 40 cases at a time (``_Worlds``).

References and tolerances, by the rows of the cell (``_setting``):

* float64 where the rows allow it: the reference is the single process in float64, and a
  difference beyond rounding is a missing, doubled or misplaced term (``_F64``);
* float32 where a row computes in float32 whatever the model's dtype: ``offload`` (its
  CPU AdamW keeps fp32 masters), ``precision`` (its dtypes are fp32's neighbours), ``fuse``
  (meshlab's CPU kernels run for float32, a float64 input takes the op's reference path
  and would leave the kernels out), ``expert_route`` (``grouped_mm`` has no float64
  kernel) (``_F32``);
* ``precision('bf16')`` / ``precision('fp16')``: the single process under the same autocast,
  at the tolerance of that dtype (``_BF16``, ``_FP16``); ``precision('fp8')``: the single
  process with the same layers in float8 under bf16 autocast, at float8's (``_FP8``; beside
  ``lora``, peft's reference with the same layers swapped);
* ``lora``: the single process with the same adapters (peft's, started as meshlab starts
  them: ``meshlab.verify``'s own reference for a spec with adapters); ``lora(quantize)``:
  the same on the same layers quantized by bitsandbytes, in float32 (it does not quantize
  float64);
* ``sequence('all_to_all')`` / ``sequence('ring')``: both models attend through SDPA, not
  the eager attention the others use: eager takes its softmax in float32 whatever the
  dtype, which the float64 comparison would see as a difference of 1e-7.

The optimizer is SGD (lr 0.1): an update is the gradient times the learning rate, so the
report reads each gradient from it, ZeRO-1's slices and offloaded gradients included.
``offload(optimizer)`` runs meshlab's CPU AdamW only, so its cells take AdamW with
``eps=1`` (``_ADAM``): Adam's update ``m / (sqrt(v) + eps)`` is then about ``lr * g`` for
the gradients of these models (well below 1), as SGD's, so a gradient off by a factor
moves the weights by that factor, where a small ``eps`` would divide the factor out (Adam
is blind to a gradient's scale) and turn float32 rounding in a near-zero gradient into a
step of ``lr``. The report compares those updates, so float8's absolute tolerance (a
gradient's) is scaled by ``lr`` for them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshlab.transforms import composition

from tests import _models as M
from tests._world import World
from tests.transforms import _pairs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 2
# (atol, rtol) per tensor: |layout - reference| <= atol + rtol * max|reference|.
# float64: rounding in another reduction order is ~1e-16 of a value; 1e-10 leaves six
# orders of magnitude for the sums of two steps and is still 1e6 below a missing term.
_F64 = (1e-10, 1e-8)
# float32: ~6e-8 per rounding, a few hundred terms per sum, and a gradient read from an
# SGD update carries the weights' rounding (6e-8 of 1.0) divided by lr (0.1): 6e-7.
_F32 = (1e-5, 1e-4)
# bf16 keeps 8 bits of mantissa (2^-8 = 3.9e-3 per rounding): the layout rounds where the
# reference does not (FSDP2 casts the weights, tensor parallelism rounds partial sums
# before the reduction), a value passing about eight such roundings in two blocks.
_BF16 = (1e-3, 8 * 2 ** -8)
# fp16 keeps 11 bits (2^-11 = 4.9e-4), the same eight roundings.
_FP16 = (2e-4, 8 * 2 ** -11)
# float8 (e4m3 keeps 3 bits, e5m2 2: 2^-4 and 2^-3 per rounding): each rank takes its dynamic
# scales over its own batch, the single process over the whole one, so the values each
# rounds differ by a scale, and any of them may round one step apart; the comparison sees
# a term missing or doubled, not rounding. Exactness against one process that runs each
# rank's batch as a microbatch is tests/transforms/precision/test_float8_gloo.py's.
_FP8 = (2e-2, 0.15)
_ADAM = dict(optimizer="AdamW", lr=0.1, options=dict(eps=1.0))
_SGD = dict(optimizer="SGD", lr=0.1, options={})


def _slug(row: str) -> str:
    return row.replace("'", "")


CELLS = [(a, b) for (a, b), c in composition.table(declared=False).items()
         if c.status == composition.COMPOSES]


_ZERO2 = "with zero_shard(2, 'dp')"


def _context(a: str, b: str) -> tuple[str, int]:
    """The spelling of ``a x b`` the case runs and its ranks: the first of
    ``_pairs.contexts`` the table runs on 2 or 4 ranks; else (a pair refused beside
    ``data_parallel`` over several data ranks: gradients reduced in bf16 or fp16, or
    offloaded as the backward makes them) the pair beside ``zero_shard(2, 'dp')``, FSDP2,
    which composes with both; else ``step_in_backward``'s, on one rank."""
    ctxs = _pairs.contexts(a, b)
    for ctx in ctxs:
        if math.prod(ctx.mesh.values()) in (2, 4) and ctx.expected().outcome == "runnable":
            return ctx.label, math.prod(ctx.mesh.values())
    alone = next(c for c in ctxs if c.label == "alone")
    mesh = _with_zero2(alone.mesh)
    exp = composition.expect(set(alone.rows) | {"zero_shard(2)"}, data_ranks=2)
    if exp.outcome == "runnable" and math.prod(mesh.values()) <= 4:
        return _ZERO2, math.prod(mesh.values())
    if "step_in_backward" in (a, b) and alone.expected().outcome == "runnable":
        return alone.label, math.prod(alone.mesh.values())
    raise AssertionError(f"{a} x {b}: no runnable spelling on 1, 2 or 4 ranks")


def _with_zero2(mesh: dict) -> dict:
    return {"dp": 2, **{k: v for k, v in mesh.items() if k != "dp"}}


def _spelled(a: str, b: str, label: str):
    """(the spec, the mesh, the family, the rows) of the spelling ``_context`` chose."""
    import meshlab as ml

    ctx = next(c for c in _pairs.contexts(a, b)
               if c.label == (label if label != _ZERO2 else "alone"))
    spec, mesh, rows = ctx.spec(), ctx.mesh, set(ctx.rows)
    if label == _ZERO2:
        spec, mesh, rows = spec | ml.zero_shard(2, "dp"), _with_zero2(mesh), rows | {
            "zero_shard(2)"}
    # dynamo's graphs and AOTAutograd's backward are what composes with the other rooms;
    # inductor's code generation is the same for every composition (shown against eager
    # in tests/transforms/compile/test_compile.py) and costs ~20 s a graph on 2 cores
    spec = _pairs._compose([dataclasses.replace(t, backend="aot_eager")
                            if isinstance(t, ml.transforms.Compile) else t
                            for t in spec.parts])
    return spec, mesh, ctx.family, rows


def _setting(rows) -> dict:
    """The dtype, the tolerance, the optimizer and the attention of a case, by its rows."""
    rows = set(rows)
    # the coarsest dtype a value passes through, the compute's or the reduction's (each
    # gradient is rounded to it once before the sum)
    tol = next((t for names, t in (({"precision('fp8')"}, _FP8),
                                   ({"precision('bf16')", "precision(reduce='bf16')"}, _BF16),
                                   ({"precision('fp16')", "precision(reduce='fp16')"}, _FP16))
                if rows & names), None)
    f32 = any(r.startswith(("offload", "precision", "fuse")) or r == "expert_route"
              or r == "lora(quantize)" for r in rows)
    opt = _ADAM if "offload(optimizer)" in rows else _SGD
    if tol == _FP8 and opt is _ADAM:
        # the report reads AdamW's updates, about lr times the gradients (eps=1): float8's
        # absolute tolerance, a gradient's, scaled to them (unscaled it exceeds the largest
        # update of these models, and a gradient off by half would pass)
        tol = (_FP8[0] * opt["lr"], _FP8[1])
    return dict(dtype="float32" if f32 else "float64",
                tol=tol or (_F32 if f32 else _F64),
                opt=opt,
                sdpa=bool(rows & {"sequence('all_to_all')", "sequence('ring')"}),
                pipeline="pipeline" in rows)


def _build(family: str, sdpa: bool):
    model = M.build(family)
    if sdpa:
        model.config._attn_implementation = "sdpa"
    return model


def cell_case(rank, world, a, b, label):
    """``ml.verify`` of the cell's spec on this world; returns (ok, the report's text)."""
    import meshlab as ml

    spec, mesh, family, rows = _spelled(a, b, label)
    s = _setting(rows)
    dtype = getattr(torch, s["dtype"])
    model = _build(family, s["sdpa"])
    data = M.batches(STEPS, batch=8 if s["pipeline"] else 4, seq=8)
    atol, rtol = s["tol"]
    report = ml.verify(model, spec, ml.Mesh(**mesh), [{"input_ids": b} for b in data],
                       optimizer=getattr(torch.optim, s["opt"]["optimizer"]),
                       lr=s["opt"]["lr"], optimizer_options=s["opt"]["options"],
                       dtype=dtype, atol=atol, rtol=rtol)
    return report.ok, str(report)


class _Worlds:
    """One gloo world per world size, started afresh every ``RUNS`` cases: a world that
    ran a few dozen cases runs the later ones several times slower (measured: a compiled
    block's case at 3.5 s in a fresh world, 59 s after the module's other 300 cases), and a
    world starts in about a second."""

    RUNS = 40

    def __init__(self):
        self.worlds: dict[int, tuple[World, int]] = {}

    def get(self, n: int) -> World:
        w, runs = self.worlds.get(n, (None, 0))
        if w is None or runs >= self.RUNS:
            if w is not None:
                w.close()
            w, runs = World(n), 0
        self.worlds[n] = (w, runs + 1)
        return w

    def close(self) -> None:
        for w, _ in self.worlds.values():
            w.close()


@pytest.fixture(scope="module")
def worlds():
    w = _Worlds()
    yield w
    w.close()


@pytest.mark.parametrize("a,b", CELLS, ids=[f"{_slug(a)}-{_slug(b)}" for a, b in CELLS])
def test_cell(worlds, a, b):
    """The pair trains as one process does (the cell names this test unless it names an
    earlier one)."""
    cell = composition.cell(a, b)
    node = composition.parity_test(a, b)
    assert node.endswith(f"[{_slug(a)}-{_slug(b)}]")
    assert cell.test is not None, f"{a} x {b} composes and names no test; it is {node}"
    label, n = _context(a, b)
    world = worlds.get(n)
    out = world.run(cell_case, a=a, b=b, label=label)
    ok, text = out[0]
    assert all(o == out[0] for o in out), "the ranks' reports differ"
    assert ok, f"{a} x {b} ({label}, {n} ranks):\n{text}"
