"""Each row of the composition table as a spec on a fake mesh, and each pair of rows as one.

Shared by ``scripts/composition_matrix.py`` (which measures what ``ml.plan`` does with
every pair) and ``tests/transforms/test_composition.py`` (which holds the table against
it). A pair is planned on a small Llama (a small Qwen3-MoE where ``expert_route`` is in
it), each parallel axis of size 2, with ``data_parallel('dp')`` added over ``dp=2``
(``zero_shard(3, 'dp')`` where ``offload(params)`` needs it), and alone. ``step_in_backward``
is shown on one process only: its pairs add ``data_parallel`` over one rank, and run alone
on one rank unless the other row needs an axis. ``data_parallel x zero_shard(s)`` is hybrid
sharding over two data axes: ``data_parallel('rep') | zero_shard(s, 'dp')`` on
``rep=2, dp=2``; ``sequence('all_to_all') x sequence('ring')`` is 2-D sequence parallelism,
``sequence('sp', 'all_to_all') | sequence('cp', 'ring')`` on ``cp=2, sp=2``.

A condition that is not a pair is kept out of the way here, refused by its room for a
reason the table's note names: ``fuse('mlp')`` named in a model whose MLPs are mixtures of
experts (the ``fuse`` row asks for its ops with ``absent='leave'``, which leaves the MLP
out there and routes the norms and rotary embedding).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tests import _models as M


def _ml():
    import meshlab as ml

    return ml


def _tp(seq: bool = False):
    """``shard`` by the auto policy over tp, the head split over the vocabulary (Megatron
    SP with ``seq``)."""
    ml = _ml()
    rules = ml.Rules(**M.TP_RULES)
    return ml.shard(ml.policies.auto, rules | ml.Rules(seq="tp") if seq else rules)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row's spelling: its transforms for a family and the rows beside the pair
    (``others``), the mesh axes they use, the rows the same value takes too, and where in
    a spec they go (``shard`` before ``lora``)."""

    build: Callable[[str, frozenset], list]
    axes: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    order: int = 50


def _const(*make: Callable[[], object]) -> Callable[[str, frozenset], list]:
    return lambda family, others: [m() for m in make]


def _fuse(family: str, others: frozenset) -> list:
    """The row's three ops, each where the model has it: a mixture-of-experts model has no
    gated MLP to route, which fuse leaves out (the plan says so)."""
    return [_ml().fuse("rms_norm", "rotary", "mlp", absent="leave")]


def _shard(family: str, others: frozenset) -> list:
    return [_tp()]


def _sg(family: str, others: frozenset) -> list:
    """Megatron SP as ``sequence('tp', 'split_gather')``; beside another sequence mode (a
    spec holds one ``sequence()``) as what ``shard`` with seq -> tp turns on."""
    if any(r.startswith("sequence") for r in others - {"sequence('split_gather')"}):
        return [_tp(seq=True)]
    return [_tp(), _ml().sequence("tp", "split_gather")]


ROWS: dict[str, Row] = {
    "shard": Row(_shard, ("tp",), order=0),
    "data_parallel": Row(_const(lambda: _ml().data_parallel("dp")), ("dp",), order=30),
    **{f"zero_shard({s})": Row(_const(lambda s=s: _ml().zero_shard(s, "dp")), ("dp",),
                               order=30) for s in (1, 2, 3)},
    "offload(optimizer)": Row(_const(lambda: _ml().offload(optimizer=1.0)), order=60),
    "offload(grads)": Row(_const(lambda: _ml().offload(grads=1.0, optimizer=1.0)),
                          also=("offload(optimizer)",), order=60),
    "offload(params)": Row(_const(lambda: _ml().offload(params=1.0, grads=1.0, optimizer=1.0)),
                           also=("offload(optimizer)", "offload(grads)"), order=60),
    "pipeline": Row(_const(lambda: _ml().pipeline("pp")), ("pp",), order=70),
    "sequence('split_gather')": Row(_sg, ("tp",), also=("shard",), order=0),
    "sequence('all_to_all')": Row(_const(lambda: _ml().sequence("sp", "all_to_all")), ("sp",),
                                  order=20),
    "sequence('ring')": Row(_const(lambda: _ml().sequence("sp", "ring")), ("sp",), order=20),
    "expert_route": Row(_const(lambda: _ml().expert_route("ep")), ("ep",), order=10),
    "lora": Row(_const(lambda: _ml().lora(r=2, target_modules=["q_proj", "v_proj"])), order=5),
    "lora(quantize)": Row(_const(lambda: _ml().lora(
        r=2, target_modules=["q_proj", "v_proj"],
        quantize=_ml().Quantize(compute_dtype="float32"))), also=("lora",), order=5),
    "remat": Row(_const(lambda: _ml().remat()), order=40),
    "remat(offload)": Row(_const(lambda: _ml().remat("full", count=0, offload=1)),
                          also=("remat",), order=40),
    "precision('fp32')": Row(_const(lambda: _ml().precision("fp32")), order=40),
    "precision('bf16')": Row(_const(lambda: _ml().precision("bf16")), order=40),
    "precision('fp16')": Row(_const(lambda: _ml().precision("fp16", loss_scale=None)), order=40),
    "precision(reduce='bf16')": Row(_const(lambda: _ml().precision("bf16", reduce="bf16")),
                                    also=("precision('bf16')",), order=40),
    "precision(reduce='fp16')": Row(
        _const(lambda: _ml().precision("fp16", reduce="fp16", loss_scale=None)),
        also=("precision('fp16')",), order=40),
    "precision(loss_scale)": Row(_const(lambda: _ml().precision("fp16")),
                                 also=("precision('fp16')",), order=40),
    "precision('fp8')": Row(_const(lambda: _ml().precision("fp8")), order=40),
    "fuse": Row(_fuse, order=40),
    "fuse('attention')": Row(_const(lambda: _ml().fuse("attention")), order=40),
    "fuse('loss')": Row(_const(lambda: _ml().fuse("loss")), order=40),
    "compile_blocks": Row(_const(lambda: _ml().compile_blocks()), order=40),
    "step_in_backward": Row(_const(lambda: _ml().step_in_backward()), order=90),
}

# Pairs one value spells (``offload(grads=1, optimizer=1)``, ``precision('bf16',
# reduce='bf16')``, ``fuse('rms_norm', 'attention')``, ``shard`` with seq -> tp): the value
# and every row it takes.
_P = lambda *a, **k: (lambda: _ml().precision(*a, **k))        # noqa: E731
_ONE_VALUE: dict[frozenset, tuple[Callable, tuple[str, ...]]] = {
    frozenset({"offload(optimizer)", "offload(grads)"}): (ROWS["offload(grads)"].build, ()),
    frozenset({"offload(optimizer)", "offload(params)"}):
        (ROWS["offload(params)"].build, ("offload(grads)",)),
    frozenset({"offload(grads)", "offload(params)"}):
        (ROWS["offload(params)"].build, ("offload(optimizer)",)),
    frozenset({"remat", "remat(offload)"}):
        (_const(lambda: _ml().remat("full", count=1, offload=1)), ()),
    frozenset({"shard", "sequence('split_gather')"}):
        (lambda family, others: [_tp(seq=True)], ()),
    frozenset({"lora", "lora(quantize)"}): (ROWS["lora(quantize)"].build, ()),
    frozenset({"fuse", "fuse('attention')"}):
        (_const(lambda: _ml().fuse("rms_norm", "attention")), ()),
    frozenset({"fuse", "fuse('loss')"}): (_const(lambda: _ml().fuse("rms_norm", "loss")), ()),
    frozenset({"fuse('attention')", "fuse('loss')"}):
        (_const(lambda: _ml().fuse("attention", "loss")), ()),
    **{frozenset({f"precision('{c}')", f"precision(reduce='{r}')"}):
       (_const(_P(c, reduce=r, loss_scale=None)), ())
       for c in ("fp32", "bf16", "fp16") for r in ("bf16", "fp16")},
    **{frozenset({f"precision('{c}')", "precision(loss_scale)"}):
       (_const(_P(c, loss_scale=1024.0)), ()) for c in ("fp32", "bf16", "fp16", "fp8")},
    **{frozenset({"precision('fp8')", f"precision(reduce='{r}')"}):
       (_const(_P("fp8", reduce=r)), ()) for r in ("bf16", "fp16")},
    **{frozenset({f"precision(reduce='{r}')", "precision(loss_scale)"}):
       (_const(_P(r, reduce=r, loss_scale="dynamic")), (f"precision('{r}')",))
       for r in ("bf16", "fp16")},
}


def _hybrid(stage: int) -> Callable[[str, frozenset], list]:
    return lambda family, others: [_ml().data_parallel("rep"), _ml().zero_shard(stage, "dp")]


# Pairs spelled over a mesh axis of their own besides their rows' (placed first in the
# mesh): hybrid sharding replicates over one data axis and shards over another; 2-D
# sequence parallelism runs Ulysses over sp and the ring over cp.
_OWN_AXIS = {**{frozenset({"data_parallel", f"zero_shard({s})"}): (_hybrid(s), ("rep",))
                for s in (1, 2, 3)},
             frozenset({"sequence('all_to_all')", "sequence('ring')"}): (
                 _const(lambda: _ml().sequence("sp", "all_to_all"),
                        lambda: _ml().sequence("cp", "ring")), ("cp",))}

@dataclasses.dataclass(frozen=True)
class Context:
    """One way to plan a pair: the spec, the mesh, the family, and every row the spec
    takes (the pair's, the rows its transforms bring, the added ones)."""

    pair: tuple[str, str]
    spec: Callable[[], object]
    mesh: dict
    family: str
    rows: tuple[str, ...]
    label: str

    @property
    def data_ranks(self) -> int:
        """The ranks of the data axis the spec's data-parallel row runs over."""
        data = any(r == "data_parallel" or r.startswith("zero_shard") for r in self.rows)
        return self.mesh.get("rep", 1) * self.mesh.get("dp", 1) if data else 1

    def plan(self):
        ml = _ml()
        return ml.plan(M.build(self.family), self.spec(), ml.Mesh(**self.mesh, fake=True))

    def expected(self):
        """What the composition table says ``plan`` does (``composition.Expected``)."""
        from meshlab.transforms import composition

        return composition.expect(self.rows, self.data_ranks)


def _compose(parts: list):
    out = parts[0]
    for t in parts[1:]:
        out = out | t
    return out


def contexts(a: str, b: str) -> list[Context]:
    """The ways to plan ``a x b``: with a data-parallel row added (unless the pair has
    one), then alone (unless ``offload(params)`` needs ``zero_shard(3)``)."""
    ra, rb = ROWS[a], ROWS[b]
    family = "qwen3_moe" if "expert_route" in (a, b) else "llama"
    one = _ONE_VALUE.get(frozenset({a, b}))
    rows = {a, b} | (set(one[1]) if one else set(ra.also) | set(rb.also))
    pair = frozenset({a, b})
    own = _OWN_AXIS.get(pair)
    axes = {x: 2 for x in (own[1] if own else ()) + ra.axes + rb.axes}
    dp = 1 if "step_in_backward" in (a, b) else 2

    def spec_of(extra: Callable[[], list]):
        def spec():
            if own:
                parts = [(0, t) for t in own[0](family, pair)]
            elif one:
                parts = [(0, t) for t in one[0](family, pair)]
            else:
                parts = [(r.order, t) for r in (ra, rb) for t in r.build(family, pair)]
            parts += [(30, t) for t in extra()]
            return _compose([t for _, t in sorted(parts, key=lambda x: x[0])])
        return spec

    out = []
    has_data = any(r == "data_parallel" or r.startswith("zero_shard") for r in rows)
    needs3 = "offload(params)" in rows
    if not has_data:
        stage = 3 if needs3 else 0
        extra_row = "zero_shard(3)" if needs3 else "data_parallel"
        out.append(Context((a, b), spec_of(lambda: [_ml().zero_shard(stage, "dp")]),
                           {"dp": dp, **axes}, family, tuple(sorted(rows | {extra_row})),
                           "with zero_shard(3, 'dp')" if needs3 else "with data_parallel('dp')"))
    if has_data or not needs3:
        out.append(Context((a, b), spec_of(lambda: []), axes or {"dp": 1}, family,
                           tuple(sorted(rows)), "alone"))
    return out


def pairs(names) -> list[tuple[str, str]]:
    """Every unordered pair of ``names``, in order."""
    names = list(names)
    return [(names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))]
