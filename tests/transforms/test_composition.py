"""The composition table (``meshlab.transforms.composition``) against what ``plan`` does.

* ``docs/composition.md`` is the table's page, regenerated and compared;
* every pair of rows has exactly one cell, every composing cell names a test, and that
  test exists (its file, its function, its parametrize id);
* every pair of rows, planned on a fake mesh as ``tests/transforms/_pairs.py`` spells it
  (with ``data_parallel`` added, and alone), does what the table says: a ``composes``
  cell plans runnable, a ``not yet`` cell is refused as its cell says (raised, or recorded
  in ``plan.not_runnable``), naming the cell and the page;
* ``|`` reads the table for two transforms of one kind and for a pair in the wrong order,
  and a transform written outside meshlab takes a row of its own.

Fake meshes only: no process starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from typing import ClassVar

import pytest

import meshlab as ml
from meshlab.transforms import Transform, composition

from tests import _models as M
from tests.transforms import _pairs

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_page_is_the_table():
    page = (REPO / composition.PAGE).read_text()
    assert page == composition.page(), (
        f"{composition.PAGE} is stale: run python scripts/composition_matrix.py --page")


def test_every_pair_of_rows_has_exactly_one_cell():
    names = list(composition.ROWS)
    seen: dict[frozenset, tuple] = {}
    for a, b in composition.CELLS:
        assert a in composition.ROWS and b in composition.ROWS and a != b, (a, b)
        assert frozenset((a, b)) not in seen, (a, b, seen.get(frozenset((a, b))))
        seen[frozenset((a, b))] = (a, b)
    assert set(seen) == {frozenset((a, b)) for a, b in _pairs.pairs(names)}
    assert list(_pairs.ROWS) == names               # the measurement spells every row
    with pytest.raises(ml.PlanError, match="given twice"):
        composition._index([("shard", "remat", composition.composes()),
                            ("remat", "shard", composition.composes())])


def test_every_composing_cell_names_its_test():
    """A pair marked composes names the test that trains it against one process: an earlier
    one, or its case of tests/transforms/test_table_parity.py (which runs every such
    cell); a composes cell without one fails here."""
    bare = [f"{a} x {b}" for (a, b), c in composition.table(declared=False).items()
            if c.status == composition.COMPOSES and not c.test]
    assert not bare, f"composes, but names no parity test: {bare}"
    named = [c.test for c in composition.table(declared=False).values()
             if c.test and c.test.startswith("tests/transforms/test_table_parity.py::")]
    for (a, b), c in composition.table(declared=False).items():
        if c.test and c.test.startswith("tests/transforms/test_table_parity.py::"):
            assert c.test == composition.parity_test(a, b), (a, b, c.test)
    assert len(named) == len(set(named)) > 150


def _ids(fn) -> set[str]:
    """The parametrize ids pytest gives ``fn`` (its marks, nearest the function first)."""
    out = [""]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        ids = mark.kwargs.get("ids")
        if ids is None:
            ids = ["-".join(_idval(v, n, i) for v, n in zip(
                value if len(names) > 1 else (value,), names)) for i, value in enumerate(values)]
        out = [f"{o}-{i}" if o else i for o in out for i in ids]
    return set(out) - {""}


def _idval(value, name: str, index: int) -> str:
    """pytest's id of one parameter value: the value for strings, numbers and booleans,
    the name of a class or function, else the argument name and the index."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    if isinstance(getattr(value, "__name__", None), str):
        return value.__name__
    return f"{name}{index}"


def test_the_named_tests_exist():
    named = {c.test for c in composition.table(declared=False).values() if c.test}
    assert len(named) > 30
    for node in sorted(named):
        path, _, rest = node.partition("::")
        func, _, param = rest.partition("[")
        assert (REPO / path).is_file(), node
        module = importlib.import_module(path[:-3].replace("/", "."))
        fn = getattr(module, func, None)
        assert callable(fn) and func.startswith("test_"), node
        if param:
            assert param[:-1] in _ids(fn), (node, sorted(_ids(fn)))
        else:
            assert not _ids(fn), (node, "names no parametrize id")


@pytest.mark.parametrize("row", list(composition.ROWS))
def test_each_pair_plans_as_its_cell_says(row):
    names = list(composition.ROWS)
    wrong = []
    for a, b in _pairs.pairs(names):
        if a != row:
            continue
        for ctx in _pairs.contexts(a, b):
            exp = ctx.expected()
            try:
                p = ctx.plan()
            except ml.ConfigError as e:
                got, msg = "raises", str(e)
            else:
                got, msg = ("not runnable", " | ".join(p.not_runnable)) if p.not_runnable \
                    else ("runnable", "")
            if not exp.matches(got, msg):
                wrong.append(f"{a} x {b} [{ctx.label}]: planned {got} ({msg[:200]}), the "
                             f"table says {exp.outcome} ({exp.pairs})")
            if "composition table:" in msg:
                assert f"see {composition.PAGE})" in msg, msg
    assert not wrong, "\n".join(wrong)


def test_a_refusal_names_its_cell_and_the_page():
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(M.build("llama"), ml.zero_shard(1, "dp") | ml.step_in_backward(),
                ml.Mesh(dp=2, fake=True))
    assert str(e.value) == (
        "step_in_backward() with zero_shard(stage=1, axis='dp') is not yet shown to train "
        "like the ordinary step; leave one of them out (composition table: "
        "step_in_backward x zero_shard(1): not yet; see docs/composition.md)")


def test_data_parallel_keeps_parameters_on_the_host_as_fsdp2_units():
    """``data_parallel | offload(params)`` plans FSDP2 over a size-1 shard dimension: the
    gradient all-reduce is FSDP2's (none left to the backward's buckets), and the plan's
    traffic is the same all-reduce of every gradient over dp as plain data parallelism."""
    from meshlab.transforms._gradsync import plan_reductions

    mesh = ml.Mesh(dp=2, fake=True)
    off = ml.plan(M.build("llama"), ml.data_parallel("dp") | ml.offload(
        params=1.0, grads=1.0, optimizer=1.0), mesh)
    plain = ml.plan(M.build("llama"), ml.data_parallel("dp"), mesh)
    assert off.runnable and off.memory().host > 0
    assert plan_reductions(off) == [] and plan_reductions(plain) != []

    # one all-reduce per FSDP2 unit instead of the buckets, the same bytes (gradients, the
    # count of parameters each rank had a gradient for, the loss)
    assert off.comm().bytes("all_reduce", "dp") == plain.comm().bytes("all_reduce", "dp")
    assert off.comm().count("all_reduce", "dp") == len(off.model.blocks) + 3


def test_a_refusal_over_several_data_ranks_is_none_on_one():
    """A cell refused over more than one data rank applies there only. The offload(grads)
    cells that had that scope compose at any count of data ranks now."""
    from meshlab.transforms._cell import not_yet

    c = not_yet("a reason", scope=composition.SEVERAL_DATA_RANKS)
    assert not composition.applies(c, 1) and composition.applies(c, 2)
    mesh1, mesh2 = ml.Mesh(dp=1, fake=True), ml.Mesh(dp=2, fake=True)
    for spec in (lambda: ml.data_parallel("dp") | ml.offload(grads=1.0, optimizer=1.0),
                 lambda: ml.zero_shard(1, "dp") | ml.offload(grads=1.0, optimizer=1.0)):
        assert ml.plan(M.build("llama"), spec(), mesh1).runnable
        assert ml.plan(M.build("llama"), spec(), mesh2).runnable


def test_two_transforms_of_one_kind_read_their_cell():
    # two that combine into one value (hybrid sharding) take both rows, whose cell composes
    p = ml.plan(M.build("llama"), ml.data_parallel("dp") | ml.zero_shard(3, "fsdp"),
                ml.Mesh(dp=2, fsdp=2, fake=True))
    assert p.options == (ml.zero_shard(3, "fsdp", replicate="dp"),) and p.runnable
    assert composition.cell("data_parallel", "zero_shard(3)").status == composition.COMPOSES
    with pytest.raises(ml.ConfigError, match="would both replicate and shard"):
        ml.data_parallel("dp") | ml.zero_shard(3, "dp")
    with pytest.raises(ml.ConfigError, match=r"zero_shard\(1\) x zero_shard\(3\): meaningless"):
        ml.zero_shard(1) | ml.zero_shard(3)
    with pytest.raises(ml.ConfigError) as e:            # one row twice
        ml.zero_shard(1, "dp") | ml.zero_shard(1, "fsdp")
    assert str(e.value).endswith("two zero transforms in one spec; the second would silently "
                                 "replace the first. Keep one")


def test_the_order_the_table_asks_for():
    cfg = dict(r=2, target_modules=["q_proj"])
    shard = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
    with pytest.raises(ml.ConfigError, match=r"lora x shard: composes with shard first"):
        ml.plan(M.build("llama"), ml.lora(**cfg) | shard, ml.Mesh(tp=2, fake=True))
    assert ml.plan(M.build("llama"), shard | ml.lora(**cfg), ml.Mesh(tp=2, fake=True)).runnable


@dataclasses.dataclass(frozen=True)
class _Undeclared(Transform):
    """A transform from outside meshlab that declares no cell."""

    kind: ClassVar[str] = "undeclared_probe"


def test_a_transform_from_outside_takes_a_row_of_its_own():
    assert ml.plan(M.build("llama"), _Undeclared(), ml.Mesh(dp=1, fake=True)).runnable
    c = composition.cell("undeclared_probe", "remat")
    assert c.status == "not yet" and "undeclared_probe" in c.reason
    with pytest.raises(ml.ConfigError, match=r"undeclared_probe x remat: not yet"):
        ml.plan(M.build("llama"), ml.remat() | _Undeclared(), ml.Mesh(dp=1, fake=True))
    with pytest.raises(ml.ConfigError, match="a row of meshlab's own table"):
        composition.declare("remat", {})


def test_the_rows_each_room_takes():
    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    sp = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES) | ml.Rules(seq="tp"))
    p = ml.plan(M.build("llama"), sp | ml.zero_shard(2, "dp")
                | ml.precision("fp16", reduce="bf16"), mesh)
    rows = {r for t in p.rooms for r in t.rows(p)}
    assert rows == {"shard", "sequence('split_gather')", "zero_shard(2)", "precision('fp16')",
                    "precision(reduce='bf16')", "precision(loss_scale)"}
    assert ml.offload(params=0.5, grads=0.5, optimizer=1.0).rows(None) == (
        "offload(optimizer)", "offload(grads)", "offload(params)")
    assert ml.fuse().rows(None) == ("fuse", "fuse('attention')", "fuse('loss')")
    assert ml.data_parallel("dp").rows(None) == ("data_parallel",)


def test_the_readme_counts_the_cells_that_compose():
    import re

    cells = composition.table(declared=False)
    n = sum(c.status == composition.COMPOSES for c in cells.values())
    text = (REPO / "README.md").read_text()
    got = re.search(r"marks as composing \((\d+) of the table's (\d+)\)", " ".join(text.split()))
    assert got is not None and (int(got[1]), int(got[2])) == (n, len(cells)), (got, n)
