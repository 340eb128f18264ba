"""How plans and their estimates show in a REPL, a notebook and a rich console, and that the
committed notebooks carry their executed outputs (meta models and fake meshes only)."""

from __future__ import annotations

import ast
import io
import json
import pathlib
import re

import pytest
from rich.console import Console

import meshlab as ml
from meshlab.policies import presets
from meshlab.estimate.comm import CommEstimate
from meshlab.estimate.memory import MemoryEstimate

from tests import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
RULES = ml.Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
MESH = ml.Mesh(dp=2, tp=2, fake=True)
UNIT = re.compile(r"\d (B|KiB|MiB|GiB|TiB)\b")


@pytest.fixture(scope="module")
def tiny():
    return presets.build("tiny-llama")


@pytest.fixture(scope="module")
def plan(tiny):
    spec = (ml.shard(ml.policies.auto, RULES) | ml.zero_shard(3, "dp") | ml.precision("bf16")
            | ml.remat("full"))
    return ml.plan(tiny, spec, MESH)


@pytest.fixture(scope="module")
def refused(tiny):
    """ZeRO-3 over dp alone leaves tp unused: a plan parallelize refuses."""
    return ml.plan(tiny, ml.zero_shard(3, "dp"), MESH)


def _rich_text(renderable, width: int = 200) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# -- plans ---------------------------------------------------------------------------------

def test_plan_repr_is_one_short_line(plan):
    text = repr(plan)
    assert len(text) < 500 and "\n" not in text
    assert text.startswith("Plan(model=LlamaForCausalLM, mesh={dp:2, tp:2}, 21 params")
    assert "zero_shard(stage=3, axis='dp')" in text and "refused: 0" in text


def test_plan_repr_of_an_unbound_plan(tiny):
    text = repr(ml.trace(tiny))
    assert "mesh=unbound" in text and "transforms: none" in text and len(text) < 500


def test_plan_repr_counts_refusals(refused):
    text = repr(refused)
    assert len(text) < 500 and "refused: 1 (mesh axis 'tp'" in text


def test_str_plan_is_still_the_table(plan):
    text = str(plan)
    assert "meshlab plan: LlamaForCausalLM" in text and "model.layers.*.mlp.up_proj.weight" in text
    assert "bytes/rank" in text


def test_plan_html_shows_parameters_specs_memory_and_transforms(plan):
    html = plan._repr_html_()
    for e in plan:
        if ".1." not in e.fqn:
            assert e.fqn.replace(".0.", ".*.") in html
    assert "P('mlp', 'embed') → P('tp', None)" in html
    assert "f32[128@tp,64@dp]" in html or "f32[128@tp,64]" in html
    assert "memory per rank (dp=2, tp=2)" in html and "<table>" in html
    assert "zero_shard(stage=3, axis='dp')" in html and "remat('full')" in html
    assert "cannot run" not in html


def test_plan_html_puts_the_refusal_first(refused):
    html = refused._repr_html_()
    why = refused.not_runnable[0]
    assert "parallelize cannot run this layout" in html
    assert why in html
    assert html.index("cannot run") < html.index("<table>")


def test_plan_html_escapes_markup(tiny):
    p = ml.trace(tiny).replace(not_runnable=("<script>alert(1)</script>",))
    html = p._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_plan_rich_rendering_shows_table_and_refusal(plan, refused):
    text = _rich_text(plan)
    assert "meshlab plan: LlamaForCausalLM" in text and "model.norm.weight" in text
    text = _rich_text(refused)
    assert "parallelize cannot run this layout" in text and "used by no transform" in text


# -- estimates -----------------------------------------------------------------------------

def test_memory_display_uses_binary_units(plan):
    mem = plan.memory()
    text = repr(mem)
    assert text.startswith("MemoryEstimate(per rank on dp=2, tp=2: params ")
    assert UNIT.search(text) and "total" in text and "\n" not in text
    big = MemoryEstimate({"params": {"bfloat16": 3 * 2**30}, "grads": {"bfloat16": 5 * 2**20},
                          "optimizer": {}, "scratch": {"float32": 2**20}}, (("dp", 8),))
    text = repr(big)
    assert "params 3.00 GiB" in text and "grads 5.00 MiB" in text
    assert "scratch 1.00 MiB" in text and "total 3.01 GiB" in text


def test_memory_html_is_a_table_with_the_total(plan):
    mem = plan.memory()
    html = mem._repr_html_()
    assert html.startswith("<table>") and html.endswith("</table>")
    assert "<caption><b>memory per rank (dp=2, tp=2)</b></caption>" in html
    assert html.count("<tr>") == 1 + len(mem.rows())
    assert "<b>total</b>" in html and UNIT.search(html)


def test_memory_rich_and_str_still_render(plan):
    mem = plan.memory()
    for text in (_rich_text(mem), str(mem)):
        assert "memory per rank" in text and "optimizer" in text and "total" in text
        assert UNIT.search(text)


def test_memory_values_unchanged(plan):
    mem = plan.memory()
    assert mem.total == mem.params + mem.grads + mem.optimizer
    assert mem == plan.memory()


def test_comm_display(plan):
    comm = plan.comm(batch=4, seq=64)
    text = repr(comm)
    assert text.startswith("CommEstimate(per rank per step: ") and UNIT.search(text)
    assert "all_reduce/tp" in text and len(text) < 500
    html = comm._repr_html_()
    assert html.startswith("<table>") and "<th>collective</th>" in html and "all_gather" in html
    text = _rich_text(comm)
    assert "communication per rank per step" in text and "reduce_scatter" in text
    # the loss's mean (8 bytes) and ZeRO-3's count of the data ranks that had a gradient
    # of each parameter (one float32 each)
    trainable = sum(e.requires_grad for e in plan.params)
    assert comm.count("all_reduce") >= 1 and \
        comm.bytes("all_reduce", "dp") == 8 + 4 * trainable


def test_comm_display_with_no_collectives_and_no_axis():
    assert repr(CommEstimate({})) == "CommEstimate(per rank per step: no collectives)"
    mixed = CommEstimate({("all_reduce", "dp"): (1, 8), ("broadcast", None): (2, 2048)})
    assert "broadcast/- 2× 2.00 KiB" in repr(mixed)


# -- committed notebooks -------------------------------------------------------------------

def _shows_something(source: str) -> bool:
    """Whether a cell prints or ends in an expression (calls inside definitions aside)."""
    tree = ast.parse(source)
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        return True
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("print", "visualize"):
                    return True
    return False


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_store_their_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for i, cell in enumerate(code, 1):
        source = "".join(cell["source"])
        assert cell["execution_count"] == i, f"cell {i} not executed in order:\n{source}"
        if _shows_something(source):
            assert cell["outputs"], f"cell {i} shows nothing:\n{source}"
        assert "execution" not in cell["metadata"], "timing metadata churns on every run"
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"cell {i} failed:\n{source}"
            text = json.dumps(out)
            assert not re.search(r"/(work|home|root|tmp|Users)/", text), \
                f"cell {i} output names a machine path"


def test_str_plan_in_a_notebook_is_text_not_a_display(plan, monkeypatch):
    """A rich console that detects Jupyter displays instead of writing; ``str`` must not."""
    import rich.console

    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)
    assert "meshlab plan: LlamaForCausalLM" in str(plan)
    assert "memory per rank" in str(plan.memory())


def test_plan_html_without_an_estimate_still_shows_the_table(plan, monkeypatch):
    def refuse(self, **kw):
        raise ml.PlanError("no estimate for this layout")

    monkeypatch.setattr(ml.Plan, "memory", refuse)
    html = plan._repr_html_()
    assert "model.norm.weight" in html and "not estimated (no estimate for this layout)" in html
