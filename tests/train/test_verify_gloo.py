"""``meshlab.verify`` on gloo: a layout and its reference side by side.

* A correct layout agrees with one process in float64 (tensor parallelism and data
  parallelism on 4 ranks), and with the same model on a smaller mesh.
* Two bugs planted by rooms written here against the public protocol, as a user's would
  be: one skips the data-parallel reduction of one parameter's gradient (verify names that
  parameter, and no other, at the first step), one replaces one layer's forward with a
  wrong one (verify names that module as the first whose output diverges).
* A layout with LoRA adapters (and with a 4-bit QLoRA base) is checked against one process
  with the same adapters on the same base, not against the model without them (which
  reported every base weight as off and the adapters as "not compared").
* Bad input is refused by name before anything runs.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

import meshlab as ml
from meshlab.transforms import Part, Transform, composes

from tests import _models as M

pytestmark = pytest.mark.timeout(600)

_HERE = "tests/train/test_verify_gloo.py"
SKIPPED = "model.layers.0.mlp.up_proj.weight"
WRONG = "model.layers.1.mlp.down_proj"


class _KeepLocal(Part):
    """Puts back the rank's own gradient of one parameter after the reduction."""

    order = 100

    def __init__(self, p):
        self.p, self.local = p, None

    def keep(self, p) -> None:
        self.local = p.grad.detach().clone()

    def sync_grads(self, params) -> None:
        self.p.grad.copy_(self.local)


@dataclasses.dataclass(frozen=True)
class SkipReduction(Transform):
    """A planted bug: the gradient of ``name`` keeps each rank's own value, as if no
    data-parallel reduction covered it (Qwen3's q_norm under tp was such a case)."""

    kind: ClassVar[str] = "skip_reduction_probe"
    composition: ClassVar = {
        "data_parallel": composes(f"{_HERE}::test_names_the_parameter_left_unreduced")}
    name: str = SKIPPED

    def install(self, ctx):
        p = ctx.model.get_parameter(self.name)
        part = _KeepLocal(p)
        p.register_post_accumulate_grad_hook(part.keep)
        return part


@dataclasses.dataclass(frozen=True)
class WrongForward(Transform):
    """A planted bug: ``module`` computes its linear map and adds 1e-3."""

    kind: ClassVar[str] = "wrong_forward_probe"
    composition: ClassVar = {
        "data_parallel": composes(f"{_HERE}::test_names_the_first_module_that_diverges")}
    module: str = WRONG

    def install(self, ctx):
        m = ctx.model.get_submodule(self.module)
        m.forward = lambda x: torch.nn.functional.linear(x, m.weight, m.bias) + 1e-3


def _batches():
    return [{"input_ids": b} for b in M.batches(2, batch=4, seq=8)]


def verify_case(rank, world, which):
    spec, mesh = {
        "tp": (M.spec("tp"), ml.Mesh(dp=2, tp=2)),
        "skip": (ml.data_parallel("dp") | SkipReduction(), ml.Mesh(dp=4)),
        "wrong": (ml.data_parallel("dp") | WrongForward(), ml.Mesh(dp=4)),
    }[which]
    report = ml.verify(M.build("llama"), spec, mesh, _batches(), dtype=torch.float64)
    s = report.steps[0]
    return dict(ok=report.ok, text=str(report), summary=report.summary(),
                bad_grads=s.bad_grads, start_ok=all(d.ok for d in report.start),
                first=report.first_module, first_step=s.first_module and s.first_module.name,
                loss_ok=[x.loss_ok for x in report.steps], gradient=report.gradient,
                names=[d.name for d in s.grads])


def test_a_correct_layout_agrees_in_float64(world4):
    out = world4.run(verify_case, which="tp")
    r = out[0]
    assert r["ok"], r["text"]
    assert r["first"] is None and r["gradient"] == "gradient"
    assert len(r["names"]) == len(dict(M.build("llama").named_parameters()))
    assert "agrees with float64 one process over 2 steps" in r["summary"]
    assert all(o["text"] == r["text"] for o in out)        # one report, on every rank


def test_names_the_parameter_left_unreduced(world4):
    r = world4.run(verify_case, which="skip")[0]
    assert not r["ok"] and r["start_ok"]
    # exactly that gradient is off at the first step: every other one is exact
    assert r["bad_grads"] == (SKIPPED,), r["text"]
    assert f"gradient off: {SKIPPED}" in r["summary"]


def test_names_the_first_module_that_diverges(world4):
    r = world4.run(verify_case, which="wrong")[0]
    assert not r["ok"] and r["start_ok"] and r["loss_ok"][0] is False
    assert r["first_step"] == WRONG and r["first"] == WRONG, r["text"]
    assert f"first diverging module: {WRONG}" in r["summary"]


def smaller_mesh_case(rank, world):
    """The reference is the same model with tensor parallelism over one tp group (the
    whole batch on 2 ranks, each group alike): what one runs where one process is too
    small for the model."""
    mesh = ml.Mesh(dp=2, tp=2)
    shard = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
    report = ml.verify(M.build("llama"), shard | ml.zero_shard(3, "dp"), mesh, _batches(),
                       dtype=torch.float64, reference=(shard, mesh.sub("tp")))
    return report.ok, str(report), report.reference


def test_against_the_same_model_on_a_smaller_mesh(world4):
    ok, text, ref = world4.run(smaller_mesh_case)[0]
    assert ok, text
    assert "Mesh(tp=2)" in ref


def test_the_report_prints_as_text_and_as_a_rich_table():
    from meshlab.train._verify_report import Diff, StepDiff, VerifyReport

    g = (Diff("w", 1e-3, 1.0, False), Diff("v", 0.0, 1.0, True))
    step = StepDiff(1, 2.5, 2.4, False, g, g, (Diff("m", 1e-3, 1.0, False),),
                    Diff("m", 1e-3, 1.0, False))
    rep = VerifyReport("spec", "one process", 1e-9, 1e-7, "gradient", (), (step,), ("a note",))
    text = str(rep)
    assert "DIVERGES" in text and "step 1: gradient off for 1: w" in text
    assert "note: a note" in text and rep.first_module == "m" and not rep.ok
    rich = pytest.importorskip("rich")
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(rep)
    assert "first diverging module" in console.export_text()
    assert rich is not None


def test_bad_input_is_refused_before_anything_runs():
    model = M.build("llama")
    spec, mesh = ml.data_parallel("dp"), ml.Mesh(dp=1, fake=True)
    with pytest.raises(ml.ConfigError, match="give the global batch"):
        ml.verify(model, spec, mesh)
    with pytest.raises(ml.ConfigError, match="as many batches as steps"):
        ml.verify(model, spec, mesh, _batches(), steps=3)
    with pytest.raises(ml.ConfigError, match=r"reference=.*\(spec, mesh\)"):
        ml.verify(model, spec, mesh, _batches(), reference="tp")
    with pytest.raises(ml.ConfigError, match="torch.float64"):
        ml.verify(model, spec, mesh, _batches(), dtype=torch.int64)
    with pytest.raises(ml.ConfigError, match="an optimizer class"):
        ml.verify(model, spec, mesh, _batches(), optimizer="sgd")


def test_a_reference_too_large_for_one_process_is_refused(monkeypatch):
    from meshlab.train import verify as V

    class _Rt:
        device = torch.device("cpu")

    monkeypatch.setattr(V, "_free_bytes", lambda device: 1024)
    with pytest.raises(ml.ConfigError, match=r"pass reference=\(spec, smaller_mesh\)"):
        V._check_fits(M.build("llama"), _Rt(), torch.optim.SGD, {}, torch.float64)


def adapters_case(rank, world, quantize):
    """``verify`` with its own reference of a spec with adapters: q/v adapters (and the
    base in 4 bits) under data parallelism over 4 ranks, float32 for the 4-bit base
    (bitsandbytes quantizes no float64), float64 otherwise."""
    q = ml.Quantize(compute_dtype="float32") if quantize else None
    spec = ml.lora(r=2, target_modules=["q_proj", "v_proj"], quantize=q) | ml.data_parallel("dp")
    report = ml.verify(M.build("llama"), spec, ml.Mesh(dp=4), _batches(),
                       dtype=torch.float32 if quantize else torch.float64)
    return dict(ok=report.ok, text=str(report), start=[d.name for d in report.start],
                grads=[d.name for d in report.steps[0].grads], notes=report.notes,
                moved=max((d.scale for d in report.steps[-1].weights
                           if ".lora_B." in d.name), default=0.0))


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_a_layout_with_adapters_is_checked_against_the_same_adapters(world4, quantize):
    if quantize:
        pytest.importorskip("bitsandbytes")
    r = world4.run(adapters_case, quantize=quantize)[0]
    assert r["ok"], r["text"]
    assert not any("not compared" in n for n in r["notes"]), r["notes"]
    # the adapters are among the compared tensors, and they trained
    assert any(".lora_A." in n for n in r["start"]) and any(".lora_B." in n for n in r["grads"])
    assert r["moved"] > 0, r["text"]
