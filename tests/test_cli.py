"""The ``meshlab plan`` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import meshlab as ml
from meshlab import P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every invocation, started at once (they are independent) and collected on first use.
CASES = {
    "llama3-70b": ["--model", "llama3-70b", "--mesh", "pp=8,dp=16,tp=8", "--json", "{tmp}/p.json"],
    "bad-mesh": ["--model", "tiny-llama", "--mesh", "dp=x"],
    "unknown-model": ["--model", "no-such-model", "--mesh", "dp=2"],
    "bad-dtype": ["--model", "tiny-llama", "--mesh", "dp=2", "--dtype", "float99"],
    # tiny-llama's hidden size 64 does not divide over fsdp=3 (embed maps to fsdp)
    "non-divisible": ["--model", "tiny-llama", "--mesh", "fsdp=3,tp=2"],
    "uneven": ["--model", "tiny-llama", "--mesh", "fsdp=3,tp=2", "--uneven"],
    "bad-rules": ["--model", "tiny-llama", "--mesh", "dp=2", "--rules", "heads"],
    "typo-rule": ["--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--rules", "batch=dp,heads=tpp"],
    "typo-mesh": ["--model", "tiny-llama", "--mesh", "dp=16,tq=8"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cli"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["COLUMNS"] = "200"
    procs = {}
    for name, args in CASES.items():
        argv = [sys.executable, "-m", "meshlab.cli", "plan"] + [a.format(tmp=tmp) for a in args]
        procs[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    out["tmp"] = tmp
    return out


def test_plan_llama3_70b(runs):
    rc, stdout, stderr = runs["llama3-70b"]
    assert rc == 0, stderr
    assert "memory per rank" in stdout
    assert "lm_head" in stdout
    assert "model.layers.*.mlp.down_proj.weight" in stdout
    assert "Mesh(pp=8, dp=16, tp=8)" in stdout
    path = os.path.join(runs["tmp"], "p.json")
    assert f"plan written to {path}" in stdout
    with open(path) as f:
        plan = ml.Plan.from_json(f.read())
    assert plan.mesh_shape == {"pp": 8, "dp": 16, "tp": 8}
    assert len(plan) == 2 + 80 * 9 + 1
    assert plan["lm_head.weight"].shape == (128256, 8192)
    assert plan["lm_head.weight"].dtype == "bfloat16"
    assert plan["lm_head.weight"].mesh_spec == P("tp")
    assert plan["model.layers.79.self_attn.o_proj.weight"].mesh_spec == P(None, "tp")
    assert plan.model.model_type == "llama"
    # the JSON is the same plan the library computes; its memory matches too
    assert ml.Plan.from_json(plan.to_json()) == plan
    # bf16, tp=8: the whole model's tp-local bytes; each pp rank holds its stages' share
    # (the plan counts the heaviest rank: 10 of the 80 layers, or fewer plus the embedding
    # or the head)
    whole = 2 * (80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672) // 8
                 + 2 * 128256 * 8192 // 8 + (2 * 80 + 1) * 8192)
    from meshlab.parallel.pipeline import stages

    heaviest = max(sum(s.param_bytes for s in stages(plan) if s.rank == r) for r in range(8))
    assert whole / 10 < plan.memory().params <= whole / 6
    # stages count whole tensors; tp=8 splits all but the norms
    assert abs(plan.memory().params - heaviest / 8) <= 0.02 * heaviest / 8


def test_uneven_flag(runs):
    rc, stdout, stderr = runs["uneven"]
    assert rc == 0, stderr
    assert "memory per rank" in stdout
    # embed_tokens (256, 64) as P('tp', 'fsdp'): 256 / 2 rows, ceil(64 / 3) = 22 columns
    assert "(128, 22)" in stdout


def _assert_clean_failure(run, *needles):
    rc, stdout, stderr = run
    assert rc != 0
    text = stdout + stderr
    for n in needles:
        assert n in text, text
    # a user error is reported as a message, not as a Python traceback
    assert "Traceback" not in text, text


def test_bad_rules_fail_cleanly(runs):
    _assert_clean_failure(runs["bad-rules"], "--rules", "heads")


def test_invalid_mesh_fails_with_message(runs):
    _assert_clean_failure(runs["bad-mesh"], "dp=x", "name=size")


def test_unknown_model_names_the_presets(runs):
    from meshlab.presets import PRESETS

    _assert_clean_failure(runs["unknown-model"], "no-such-model", *sorted(PRESETS))


def test_bad_dtype_fails_with_message(runs):
    _assert_clean_failure(runs["bad-dtype"], "float99")


def test_non_divisible_mesh_fails_with_message(runs):
    _assert_clean_failure(runs["non-divisible"], "64 % 3", "uneven")


def test_misspelled_rule_axis_names_the_nearest(runs):
    _assert_clean_failure(runs["typo-rule"], "RulesError", "heads='tpp'", "did you mean 'tp'",
                          "('tpp', None)")
    assert runs["typo-rule"][0] == 2


def test_misspelled_mesh_axis_is_refused(runs):
    rc, stdout, stderr = runs["typo-mesh"]
    _assert_clean_failure(runs["typo-mesh"], "'tq'", "used by no transform",
                          "did you mean 'tp'")
    assert rc == 2
    assert "memory per rank" not in stdout      # refused: no plan is printed as if it ran


def test_rules_flag_spells_fallbacks_and_none():
    from meshlab.cli import _rules_arg

    assert _rules_arg("batch=dp|fsdp,heads=tp|None,embed=None") == ml.Rules(
        batch=("dp", "fsdp"), heads=("tp", None), embed=None)
    assert _rules_arg(None) is None           # no --rules: shard's defaults apply


def test_default_rules_shard_over_tp_and_show(runs):
    rc, stdout, stderr = runs["llama3-70b"]      # no --rules
    assert rc == 0, stderr
    assert "with default Rules(batch=" in stdout
    assert "P('mlp', 'embed') → P('tp', None)" in stdout


def _saved_config(tmp_path, name, cfg):
    d = tmp_path / name
    cfg.save_pretrained(d)
    return str(d)


def test_plan_builds_any_family_from_its_config(tmp_path, capsys):
    """Encoder-decoder, vision and speech configs build with their own class; a family
    without a policy is refused by name (not transformers' list of causal-LM classes)."""
    import transformers

    from meshlab import presets
    from meshlab.cli import main

    cfgs = {"t5": transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4,
                                        vocab_size=64),
            "vit": transformers.ViTConfig(hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64),
            "whisper": transformers.WhisperConfig(d_model=32, encoder_layers=1,
                                                  decoder_layers=1, encoder_attention_heads=4,
                                                  decoder_attention_heads=4)}
    built = {k: type(presets.build(_saved_config(tmp_path, k, c))).__name__
             for k, c in cfgs.items()}
    assert built == {"t5": "T5ForConditionalGeneration", "vit": "ViTForImageClassification",
                     "whisper": "WhisperForConditionalGeneration"}
    assert main(["plan", "--model", str(tmp_path / "t5"), "--mesh", "dp=2"]) == 2
    err = capsys.readouterr().err
    assert "PolicyError" in err and "'t5'" in err and "Unrecognized" not in err
    # --specs: the user's own specs instead of the policy (here: FSDP-style rows only)
    specs = tmp_path / "specs.json"
    specs.write_text('{"shared.weight": ["vocab", null]}')
    assert main(["plan", "--model", str(tmp_path / "t5"), "--mesh", "dp=2", "--specs",
                 str(specs), "--rules", "vocab=dp"]) == 0
    assert "shared.weight" in capsys.readouterr().out
    # a pipeline over an encoder-decoder is refused at plan time, naming why
    plain = tmp_path / "plain.json"
    plain.write_text('{"proj_out.weight": [null, null]}')
    assert main(["plan", "--model", str(tmp_path / "whisper"), "--mesh", "pp=2", "--specs",
                 str(plain)]) == 2
    assert "encoder-decoder" in capsys.readouterr().err
    specs.write_text("[1, 2]")
    assert main(["plan", "--model", str(tmp_path / "t5"), "--mesh", "dp=2", "--specs",
                 str(specs)]) == 2
    assert "FQN globs" in capsys.readouterr().err
