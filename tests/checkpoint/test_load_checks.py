"""Loads that would otherwise go silently wrong, in one process: an optimizer given the
state the checkpoint holds, a whole load checked before anything is written, a marker
and an export that checksum themselves, ``latest`` passing over a diverged step, and a
base model's weights met with peft's names."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from torch import nn

import meshlab as ml
from meshlab.checkpoint import CheckpointError, CheckpointNamingError
from meshlab.checkpoint._files import seal

pytestmark = pytest.mark.timeout(120)


def _model(seed=0, hidden=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def _steps(m, opt, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        m(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _edit_marker(path, edit):
    """Change the marker as a crafted checkpoint would, its checksum made again: only the
    checks of its content remain."""
    marker = json.loads((path / "meshlab.json").read_text())
    edit(marker)
    (path / "meshlab.json").write_text(json.dumps(seal(marker)))


# -- the optimizer gets what the checkpoint holds ---------------------------------------------
def test_an_sgd_without_momentum_takes_the_saved_momentum_buffers(tmp_path):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    _steps(m, opt)
    ml.checkpoint.save(tmp_path / "s", m, opt)
    m2 = _model(seed=3)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)          # built without momentum
    ml.checkpoint.load(tmp_path / "s", m2, opt2)
    assert opt2.param_groups[0]["momentum"] == 0.5
    buffers = [opt2.state[q].get("momentum_buffer") for q in m2.parameters()]
    assert all(b is not None for b in buffers), "momentum loaded without its buffers"
    for p, b in zip(m.parameters(), buffers):
        assert torch.equal(opt.state[p]["momentum_buffer"], b)
    _steps(m, opt, 1, seed=5)                                # and they train on alike
    _steps(m2, opt2, 1, seed=5)
    assert _same(_state(m), _state(m2))


def test_the_optimizer_state_replaces_what_the_optimizer_held(tmp_path):
    """A checkpoint saved before the first step has no state: an optimizer with state of
    its own starts afresh; one saved later replaces it whole (torch's load_state_dict)."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ml.checkpoint.save(tmp_path / "before", m, opt)
    _steps(m, opt, 3)
    ml.checkpoint.save(tmp_path / "after", m, opt)
    m2 = _model(seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    _steps(m2, opt2, 1)
    ml.checkpoint.load(tmp_path / "after", m2, opt2)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert opt2.state[q]["step"].item() == 3.0
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    ml.checkpoint.load(tmp_path / "before", m2, opt2)
    assert not opt2.state


def test_optimizer_state_of_another_shape_is_named(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _steps(m, opt)
    ml.checkpoint.save(tmp_path / "s", m, opt)
    m2 = _model(hidden=16)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"optim\.0\.weight\.exp_avg: saved \(8, 4\)"):
        ml.checkpoint.load(tmp_path / "s", m2, opt2)
    assert not opt2.state


# -- the whole load is checked before anything is written -------------------------------------
def _saved_with_everything(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3.3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _steps(m, opt)
    sched.step()
    dl = ml.dataloader(torch.utils.data.TensorDataset(torch.arange(20)),
                       ml.Mesh(dp=1, fake=True), batch_size=2, axes=())
    next(iter(dl))
    ml.checkpoint.save(tmp_path / "s", m, opt, sched, dataloader=dl)
    return dl


def _fresh():
    m = _model(seed=9)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _steps(m, opt, 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dl = ml.dataloader(torch.utils.data.TensorDataset(torch.arange(20)),
                       ml.Mesh(dp=1, fake=True), batch_size=2, axes=())
    return m, opt, sched, dl


_STEP = torch.optim.lr_scheduler.StepLR(
    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), 1).state_dict()


@pytest.mark.parametrize("entry, value, named", [
    ("scheduler", {"last_epoch": "three"}, "scheduler state has the keys"),
    ("scheduler", {**torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), 1).state_dict(),
        "last_epoch": "three"}, r"scheduler state\['last_epoch'\] is a str"),
    *[("scheduler", {**_STEP, key: value}, named) for key, value, named in [
        ("_get_lr_called_within_step", "yes", r"\['_get_lr_called_within_step'\] is a str"),
        ("_get_lr_called_within_step", True, r"\['_get_lr_called_within_step'\] is True"),
        ("base_lrs", [0.1, 0.1], r"scheduler state\['base_lrs'\] holds 2 values, this one 1"),
        ("base_lrs", [-0.1], r"\['base_lrs'\]\[0\] is -0.1, below 0"),
        ("last_epoch", 1.5, r"\['last_epoch'\] is 1.5, not a whole number >= -1"),
        ("last_epoch", -7, r"\['last_epoch'\] is -7, not a whole number >= -1"),
        ("_step_count", math.nan, r"\['_step_count'\] is nan, not a finite number"),
        ("gamma", math.inf, r"\['gamma'\] is inf, not a finite number"),
        ("lr_lambda", None, r"has the keys .*'lr_lambda'"),
    ]],
    ("scheduler", None, "scheduler state is a NoneType where this one holds a object"),
    ("dataloader", None, "dataloader"),
    ("dataloader", {"epoch": 0, "served": None}, r"dataloader state\['served'\] is a NoneType"),
    ("dataloader", [1, 2], "dataloader is a list, not an object"),
])
def test_a_bad_scheduler_or_data_entry_is_refused_before_the_weights(tmp_path, entry, value,
                                                                      named):
    _saved_with_everything(tmp_path)
    _edit_marker(tmp_path / "s", lambda mk: mk.__setitem__(entry, value))
    m, opt, sched, dl = _fresh()
    before, before_opt = _state(m), {k: dict(v) for k, v in opt.state.items()}
    lr, sched_before = opt.param_groups[0]["lr"], sched.state_dict()
    with pytest.raises(CheckpointError, match=named):
        ml.checkpoint.load(tmp_path / "s", m, opt, sched, dataloader=dl)
    assert _same(before, _state(m)), "the weights were written before the refusal"
    for p, st in before_opt.items():
        assert all(opt.state[p][k] is v for k, v in st.items())
    assert opt.param_groups[0]["lr"] == lr and sched.state_dict() == sched_before


class _Decay:
    """A scheduler's function with state of its own (LambdaLR saves its ``__dict__``)."""

    def __init__(self):
        self.rate = 0.9

    def __call__(self, epoch):
        return self.rate ** epoch


_SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e),
    "lambda_object": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _Decay()),
    "multistep": lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [1, 3], 0.5),
    "plateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=10),
}


def _step(sched):
    sched.step(1.0) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else \
        sched.step()


def _with(kind, seed=0):
    m = _model(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return m, opt, _SCHEDULERS[kind](opt)


@pytest.mark.parametrize("kind, edit, named", [
    # a function's entry where this scheduler holds a lambda (saved as None), and back
    ("lambda", lambda s: s.__setitem__("lr_lambdas", [{"rate": 0.5}]),
     r"\['lr_lambdas'\]\[0\] is a object where this one holds a NoneType"),
    ("lambda_object", lambda s: s.__setitem__("lr_lambdas", [None]),
     r"\['lr_lambdas'\]\[0\] is a NoneType"),
    ("lambda_object", lambda s: s["lr_lambdas"][0].__setitem__("__call__", "os.system"),
     r"\['lr_lambdas'\]\[0\] has the keys"),
    ("lambda_object", lambda s: s["lr_lambdas"][0].__setitem__("rate", math.nan),
     r"\['lr_lambdas'\]\[0\]\['rate'\] is nan"),
    ("multistep", lambda s: s.__setitem__("milestones", {"1": 1, "x": 1}),
     r"\['milestones'\] has the keys"),
    ("plateau", lambda s: s.__setitem__("mode", "sideways"),
     r"\['mode'\] is 'sideways' where this scheduler holds 'min'"),
    ("plateau", lambda s: s.__setitem__("best", math.nan), r"\['best'\] is nan"),
    ("onecycle", lambda s: s.__setitem__("_anneal_func_type", "sine"),
     r"\['_anneal_func_type'\] is 'sine'"),
    ("onecycle", lambda s: s["_schedule_phases"][0].__setitem__("end_lr", "lr2"),
     r"\['_schedule_phases'\]\[0\]\['end_lr'\] is 'lr2'"),
    ("onecycle", lambda s: s.__setitem__("use_beta1", True), r"\['use_beta1'\] is True"),
    ("onecycle", lambda s: s.__setitem__("total_steps", 2.5), r"\['total_steps'\] is 2.5"),
])
def test_an_injected_scheduler_entry_is_named_before_anything_is_written(tmp_path, kind, edit,
                                                                        named):
    m, opt, sched = _with(kind)
    _steps(m, opt, 1)
    _step(sched)
    ml.checkpoint.save(tmp_path / "s", m, opt, sched)
    _edit_marker(tmp_path / "s", lambda mk: edit(mk["scheduler"]))
    m2, opt2, sched2 = _with(kind, seed=3)
    before, lr, sched_before = _state(m2), opt2.param_groups[0]["lr"], sched2.state_dict()
    with pytest.raises(CheckpointError, match=named):
        ml.checkpoint.load(tmp_path / "s", m2, opt2, sched2)
    assert _same(before, _state(m2)) and opt2.param_groups[0]["lr"] == lr
    assert str(sched2.state_dict()) == str(sched_before)


def test_a_multistep_scheduler_resumes_its_milestones(tmp_path):
    """JSON writes MultiStepLR's milestones (a Counter of ints) with string keys: the load
    refused the scheduler's own checkpoint, and would have left milestones no step meets."""
    m, opt, sched = _with("multistep")
    ml.checkpoint.save(tmp_path / "s", m, opt, sched)
    m2, opt2, sched2 = _with("multistep", seed=3)
    ml.checkpoint.load(tmp_path / "s", m2, opt2, sched2)
    assert sched2.milestones == sched.milestones and type(sched2.milestones) is \
        type(sched.milestones)
    for _ in range(4):
        for s in (sched, sched2):
            s.optimizer.step()
            s.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
    assert sched2.get_last_lr()[0] == pytest.approx(0.1 * 0.25)


def test_damaged_param_groups_are_refused_before_the_weights(tmp_path):
    _saved_with_everything(tmp_path)
    _edit_marker(tmp_path / "s", lambda mk: mk["optimizer"]["param_groups"][0].__setitem__(
        "lr", "fast"))
    m, opt, sched, dl = _fresh()
    before = _state(m)
    with pytest.raises(CheckpointError, match=r"param_groups\['lr'\] is a str"):
        ml.checkpoint.load(tmp_path / "s", m, opt, sched, dataloader=dl)
    assert _same(before, _state(m))


def test_a_scheduler_the_checkpoint_lacks_is_missing(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ml.checkpoint.save(tmp_path / "s", m, opt)
    m2, opt2, sched2, _ = _fresh()
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['scheduler'\]"):
        ml.checkpoint.load(tmp_path / "s", m2, opt2, sched2)


# -- the marker checksums itself ------------------------------------------------------------------
def test_an_edited_marker_is_refused(tmp_path):
    _saved_with_everything(tmp_path)
    marker = tmp_path / "s" / "meshlab.json"
    text = marker.read_text()
    assert '"initial_lr": 0.0033' in text
    marker.write_text(text.replace('"initial_lr": 0.0033', '"initial_lr": 0.9'))
    m, opt, sched, dl = _fresh()
    before = _state(m)
    with pytest.raises(CheckpointError, match="meshlab.json is damaged: its content differs"):
        ml.checkpoint.load(tmp_path / "s", m, opt, sched, dataloader=dl)
    assert _same(before, _state(m)) and opt.param_groups[0]["lr"] == 1e-2
    with pytest.warns(UserWarning, match="skipping"):
        assert ml.checkpoint.latest(tmp_path) is None
    del_digest = json.loads(text)
    del del_digest["digest"]
    marker.write_text(json.dumps(del_digest))
    with pytest.raises(CheckpointError, match="carries no checksum"):
        ml.checkpoint.load(tmp_path / "s", m)


# -- latest passes over a diverged step -----------------------------------------------------------
def test_latest_passes_over_a_step_whose_loss_or_norm_is_not_finite(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step, loss in ((5, 1.0), (7, 0.9), (8, math.nan), (6, 0.95)):
        ml.checkpoint.save(tmp_path / f"step-{step}", m, opt, extra={"step": step, "loss": loss})
    with pytest.warns(UserWarning, match=r"skipping .*step-8: its recorded loss is nan"):
        assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-7")
    opt.last_grad_norm = math.inf                  # as meshlab.optimizer records it
    ml.checkpoint.save(tmp_path / "step-9", m, opt, extra={"step": 9})
    ml.checkpoint.save(tmp_path / "step-nan", m, opt, extra={"step": math.nan})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-7")
    text = "\n".join(str(w.message) for w in caught)
    assert "step-9: its recorded grad norm is inf" in text, text
    alone = tmp_path / "alone"                  # a step of nan orders as no step at all
    ml.checkpoint.save(alone / "step-nan", m, opt, extra={"step": math.nan})
    with pytest.warns(UserWarning, match=r"step-nan: its extra\['step'\] is nan"):
        assert ml.checkpoint.latest(alone) is None
    health = json.loads((tmp_path / "step-9" / "meshlab.json").read_text())["health"]
    assert health == {"loss": None, "grad_norm": math.inf}
    ml.checkpoint.load(tmp_path / "step-8", _model())          # by name it still loads
    # keep_last never deletes the newest checkpoint training can resume from
    del opt.last_grad_norm
    ml.checkpoint.save(tmp_path / "step-10", m, opt, extra={"step": 10, "loss": math.inf},
                       keep_last=1)
    with pytest.warns(UserWarning, match="step-10: its recorded loss is inf"):
        assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-7")


# -- Hugging Face exports checksum their files --------------------------------------------------
def _flip_in(path, offset_from_end=5):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x08
    path.write_bytes(bytes(data))


def test_a_bit_flip_in_an_export_is_named(tmp_path):
    m = _model()
    ml.checkpoint.save_pretrained(tmp_path / "hf", m)
    _flip_in(tmp_path / "hf" / "model.safetensors")
    fresh = _model(seed=4)
    before = _state(fresh)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is damaged: its SHA-256"):
        ml.checkpoint.load_pretrained(tmp_path / "hf", fresh)
    assert _same(before, _state(fresh))


def test_an_export_records_its_extra_in_its_manifest(tmp_path):
    ml.checkpoint.save_pretrained(tmp_path / "hf", _model(), extra={"step": 3})
    assert os.path.isfile(tmp_path / "hf" / "meshlab.manifest.json")
    assert ml.checkpoint._hf.exported_extra(tmp_path / "hf") == {"step": 3}
    with pytest.raises((CheckpointError, ml.ConfigError), match="extra"):
        ml.checkpoint.save_pretrained(tmp_path / "bad", _model(), extra=[3])


def test_an_export_without_a_manifest_loads_as_transformers_reads_it(tmp_path):
    m = _model()
    ml.checkpoint.save_pretrained(tmp_path / "hf", m)
    os.remove(tmp_path / "hf" / "meshlab.manifest.json")     # as transformers writes one
    fresh = _model(seed=4)
    assert ml.checkpoint.load_pretrained(tmp_path / "hf", fresh).ok
    assert _same(_state(m), _state(fresh))


def test_a_file_added_to_an_export_is_refused(tmp_path):
    from safetensors.torch import save_file

    m = _model(hidden=64)
    ml.checkpoint.save_pretrained(tmp_path / "hf", m, max_shard_size=600)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_file(_model(seed=2, hidden=64).state_dict(), tmp_path / "hf" / "extra.safetensors")
    index["weight_map"] = {k: "extra.safetensors" for k in index["weight_map"]}
    manifest = json.loads((tmp_path / "hf" / "meshlab.manifest.json").read_text())
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    manifest["files"]["model.safetensors.index.json"] = ml.checkpoint._files.entry(
        str(tmp_path / "hf" / "model.safetensors.index.json"))
    (tmp_path / "hf" / "meshlab.manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointError, match="extra.safetensors is not one of the files"):
        ml.checkpoint.load_pretrained(tmp_path / "hf", _model(hidden=64))


# -- names: peft's renaming is met, a mismatch never loads nothing --------------------------------
class _Tiny(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.q_proj, self.k_proj, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.q_proj(x) + self.k_proj(x))


def _with_lora(seed=1, save=None):
    from peft import LoraConfig, inject_adapter_in_model

    m = _Tiny(seed)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                       modules_to_save=save), m)
    return m


@pytest.mark.parametrize("how", ["pretrained", "dcp"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_base_checkpoint_loads_into_a_lora_model_through_peft_names(tmp_path, how, strict):
    pytest.importorskip("peft")
    base = _Tiny(0)
    if how == "pretrained":
        ml.checkpoint.save_pretrained(tmp_path / "b", base)
    else:
        ml.checkpoint.save(tmp_path / "b", base)
    lora = _with_lora(save=["head"])
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    if how == "pretrained":
        report = ml.checkpoint.load_pretrained(tmp_path / "b", lora, strict=strict)
    else:
        _, report = ml.checkpoint.load(tmp_path / "b", lora, strict=strict)
    assert report.ok, str(report)
    want = dict(base.named_parameters())
    for n, p in lora.named_parameters():
        if ".lora_" in n:                               # the adapters keep their values
            assert torch.equal(p, before[n]), n
            continue
        key = n.replace(".base_layer.", ".").replace(".original_module.", ".")
        key = key.replace(".modules_to_save.default.", ".")
        assert torch.equal(p, want[key]), n             # base weights, both copies of head


@pytest.mark.parametrize("how", ["pretrained", "dcp"])
def test_a_load_matching_none_of_the_weights_raises_even_when_not_strict(tmp_path, how):
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = _Tiny(0)

    src = Wrapped()
    if how == "pretrained":
        ml.checkpoint.save_pretrained(tmp_path / "w", src)
    else:
        ml.checkpoint.save(tmp_path / "w", src)
    plain = _Tiny(5)
    before = _state(plain)
    with pytest.raises(CheckpointNamingError, match=r"none of the model's 6 weights .*"
                       r"the file's names carry the prefix 'model\.'"):
        if how == "pretrained":
            ml.checkpoint.load_pretrained(tmp_path / "w", plain, strict=False)
        else:
            ml.checkpoint.load(tmp_path / "w", plain, strict=False)
    assert _same(before, _state(plain))


def test_a_partial_load_that_hides_a_renamed_weight_is_refused(tmp_path):
    """strict=False leaves out what the file lacks; not what it holds under another name."""
    from safetensors.torch import save_file

    sd = {k: v.clone() for k, v in _Tiny(0).state_dict().items()}
    sd["extra.head.weight"] = sd.pop("head.weight")
    os.makedirs(tmp_path / "r")
    save_file(sd, tmp_path / "r" / "model.safetensors")
    plain = _Tiny(5)
    with pytest.raises(CheckpointNamingError, match=r"the model's 'head.weight' is the file's "
                       r"'extra.head.weight'"):
        ml.checkpoint.load_pretrained(tmp_path / "r", plain, strict=False)


def test_a_schedulers_per_group_lists_follow_the_groups():
    """A saved scheduler's per-group lists are put in the loading optimizer's group order,
    chained schedulers' too; one of one entry a group under a name not known to be per
    group is refused when the order differs (it could not be put in order)."""
    from meshlab.checkpoint import _state

    saved = {"base_lrs": [0.1, 0.2], "_last_lr": [0.05, 0.1], "last_epoch": 3,
             "_schedulers": [{"base_lrs": [1, 2], "lr_lambdas": [None, {"k": 1}]}]}
    assert _state.scheduler_by_groups(saved, [0, 1], "ck") is saved
    assert _state.scheduler_by_groups(saved, None, "ck") is saved
    got = _state.scheduler_by_groups(saved, [1, 0], "ck")
    assert got == {"base_lrs": [0.2, 0.1], "_last_lr": [0.1, 0.05], "last_epoch": 3,
                   "_schedulers": [{"base_lrs": [2, 1], "lr_lambdas": [{"k": 1}, None]}]}
    with pytest.raises(CheckpointError, match="'my_rates' has one entry a param group"):
        _state.scheduler_by_groups({"my_rates": [1, 2]}, [1, 0], "ck")
