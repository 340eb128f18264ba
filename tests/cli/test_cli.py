"""The ``meshlab plan`` command: a 70B plan run as a user runs it, in a subprocess; the
other invocations through the same ``main`` in this process (each would otherwise spend
seconds importing torch only to print one line)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import meshlab as ml
from meshlab import P

from tests._cli import in_process
from tests import REPO

ROOT = os.fspath(REPO)

# The subprocess, started first and collected on first use.
SUBPROCESS = {
    "llama3-70b": ["--model", "llama3-70b", "--mesh", "pp=8,dp=16,tp=8", "--json", "{tmp}/p.json"],
}
# In this process, through meshlab.cli.main.
CASES = {
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
    for name, args in SUBPROCESS.items():
        argv = [sys.executable, "-m", "meshlab.cli", "plan"] + [a.format(tmp=tmp) for a in args]
        procs[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {name: in_process(["plan"] + [a.format(tmp=tmp) for a in args])
           for name, args in CASES.items()}
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
    from meshlab.transforms.pipeline import stages

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
    from meshlab.policies.presets import PRESETS

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
        batch=ml.first("dp", "fsdp"), heads=("tp", None), embed=None)
    # '+' joins axes that shard one dimension together, as a tuple inside P
    assert _rules_arg("batch=dp+fsdp|dp|None,mlp=tp") == ml.Rules(
        batch=ml.first(ml.joint("dp", "fsdp"), "dp", None), mlp="tp")
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


def _family_configs():
    """Tiny T5 (seq2seq), ViT (image classification) and Whisper (speech seq2seq), their
    widths divisible by tp=2."""
    from transformers import AutoConfig

    return {
        "t5": AutoConfig.for_model("t5", d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                   num_heads=4, vocab_size=64),
        "vit": AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64,
                                    image_size=32, patch_size=8),
        "whisper": AutoConfig.for_model(
            "whisper", d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, vocab_size=128, num_mel_bins=16, max_source_positions=32,
            max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=3),
    }


def _rows(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if f" {name} " in line]


def test_plan_builds_any_family_from_its_config(tmp_path, capsys):
    """Encoder-decoder, vision and speech configs build whole with their task's auto class
    (not the decoder alone, not transformers' list of causal-LM classes) and plan under
    their policies on dp=2 x tp=2."""
    from meshlab.policies import presets
    from meshlab.cli import main

    dirs = {k: _saved_config(tmp_path, k, c) for k, c in _family_configs().items()}
    classes = {"t5": "T5ForConditionalGeneration", "vit": "ViTForImageClassification",
               "whisper": "WhisperForConditionalGeneration"}
    # a tp-sharded weight of each, so the policy (not a replicated fallback) laid it out
    sharded = {"t5": "encoder.block.*.layer.0.SelfAttention.q.weight",
               "vit": "vit.layers.*.attention.q_proj.weight",
               "whisper": "model.encoder.layers.*.self_attn.q_proj.weight"}
    for k, d in dirs.items():
        assert type(presets.build(d)).__name__ == classes[k]
        assert main(["plan", "--model", d, "--mesh", "dp=2,tp=2"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"meshlab plan: {classes[k]}" in out
        assert "shard(policies.auto)" in out and "memory per rank (dp=2, tp=2)" in out
        row = _rows(out, sharded[k])
        assert row and "→ P('tp', None)" in row[0], out
        assert "on 4 ranks" in out
    # --no-policy: the file's specs alone
    specs = tmp_path / "specs.json"
    specs.write_text('{"shared.weight": ["vocab", null]}')
    assert main(["plan", "--model", dirs["t5"], "--mesh", "dp=2", "--specs", str(specs),
                 "--no-policy", "--rules", "vocab=dp"]) == 0
    out = capsys.readouterr().out
    assert "policies.auto" not in out
    assert "shard({'shared.weight': P('vocab', None)}, Rules(vocab='dp'))" in out
    # a pipeline over an encoder-decoder is refused at plan time, naming why
    plain = tmp_path / "plain.json"
    plain.write_text('{"proj_out.weight": [null, null]}')
    assert main(["plan", "--model", dirs["whisper"], "--mesh", "pp=2", "--specs", str(plain),
                 "--no-policy"]) == 2
    assert "encoder-decoder" in capsys.readouterr().err


def test_auto_class_covers_tasks_and_sub_configs():
    """One picker for every config: the task's auto class, an encoder-decoder whole, a
    sub-config no auto mapping lists by its own module's class, and a typed refusal."""
    import transformers
    from transformers import AutoConfig

    from meshlab.policies.models import auto_class

    want = {"llama": "AutoModelForCausalLM", "t5": "AutoModelForSeq2SeqLM",
            "bart": "AutoModelForSeq2SeqLM",        # also a causal LM: the decoder alone
            "whisper": "AutoModelForSpeechSeq2Seq", "vit": "AutoModelForImageClassification",
            "qwen3_vl_text": "AutoModel",
            # listed by no auto mapping: the class of their own modeling module
            "emu3_text_model": "Emu3ForCausalLM",               # ForCausalLM over Model
            "qwen3_omni_moe_text": "Qwen3OmniMoeThinkerTextModel"}
    got = {mt: auto_class(AutoConfig.for_model(mt)).__name__ for mt in want}
    assert got == want
    assert auto_class(AutoConfig.for_model("vit")) is transformers.AutoModelForImageClassification
    with pytest.raises(ml.ConfigError, match=r"'sam2_mask_decoder'.*meshlab\.plan\(model"):
        auto_class(AutoConfig.for_model("sam2_mask_decoder"))


def test_unknown_or_unreadable_config_is_a_typed_error(tmp_path, capsys):
    from transformers import AutoConfig

    from meshlab.cli import main

    bad = {"unknown.json": '{"model_type": "no_such_family", "hidden_size": 8}',
           "junk.json": "{not json", "untyped.json": '{"hidden_size": 8}'}
    needles = {"unknown.json": ("'no_such_family'", "meshlab.plan(model, spec, mesh)"),
               "junk.json": ("cannot read it as a JSON config",),
               "untyped.json": ('no "model_type"',)}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        assert main(["plan", "--model", str(tmp_path / name), "--mesh", "dp=2,tp=2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("meshlab plan: error: ConfigError: ") and name in err, err
        for n in needles[name]:
            assert n in err, err
    # a known config that no transformers class builds
    d = _saved_config(tmp_path, "decoder", AutoConfig.for_model("sam2_mask_decoder"))
    assert main(["plan", "--model", d, "--mesh", "dp=2,tp=2"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "'sam2_mask_decoder'" in err and "Unrecognized" not in err
    assert "meshlab.plan(model, spec, mesh)" in err


def _llama_classifier(tmp_path):
    """Tiny llama with a sequence-classification head: ``score.weight`` is a parameter
    the llama policy leaves whole."""
    from meshlab.policies import presets

    cfg = presets.config("tiny-llama")
    cfg.architectures, cfg.num_labels = ["LlamaForSequenceClassification"], 4
    return _saved_config(tmp_path, "llama-cls", cfg)


def test_specs_file_adds_to_the_policy(tmp_path, capsys):
    from meshlab.cli import main

    model = _llama_classifier(tmp_path)
    argv = ["plan", "--model", model, "--mesh", "dp=2,tp=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "│ P() " in _rows(out, "score.weight")[0], out
    for name, text in (("specs.json", '{"score.weight": ["heads", null]}'),
                       ("specs.yaml", "score.weight: [heads, null]\n")):
        (tmp_path / name).write_text(text)
        assert main(argv + ["--specs", str(tmp_path / name)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        row = _rows(out, "score.weight")[0]
        assert "P('heads', None) → P('tp', None)" in row and "(2, 64)" in row, out
        # the policy still lays out the rest
        assert "P('mlp', 'embed') → P('tp', None)" in _rows(out, "model.layers.*.mlp.up_proj.weight")[0]
        assert "shard(policies.auto)" in out and "shard({'score.weight'" in out
    # a parameter the policy already lays out differently: refused, naming the way out
    (tmp_path / "clash.json").write_text('{"model.norm.weight": [null]}')
    assert main(argv + ["--specs", str(tmp_path / "clash.json")]) == 2
    err = capsys.readouterr().err
    assert "PlanError" in err and "model.norm.weight" in err and "--no-policy" in err
    assert "clash.json" in err


def test_specs_file_alone_for_a_family_without_policy(tmp_path, capsys):
    """ViT-MSN has no policy and no tensor-parallel plan: policies.auto refuses it, naming
    --no-policy, which lays it out by the file alone."""
    from transformers import AutoConfig

    from meshlab.cli import main

    model = _saved_config(tmp_path, "msn", AutoConfig.for_model(
        "vit_msn", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, image_size=32, patch_size=8))
    specs = tmp_path / "msn.json"
    specs.write_text('{"vit.layers.*.mlp.fc1.weight": ["mlp", null]}')
    argv = ["plan", "--model", model, "--mesh", "dp=2,tp=2", "--specs", str(specs)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "PolicyError" in err and "'vit_msn'" in err
    assert f"add --no-policy to lay it out by --specs {str(specs)!r} alone" in err
    assert main(argv + ["--no-policy"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "meshlab plan: ViTMSNForImageClassification" in out
    assert "P('mlp', None) → P('tp', None)" in _rows(out, "vit.layers.*.mlp.fc1.weight")[0]
    assert "P()" in _rows(out, "vit.layers.*.mlp.fc2.weight")[0]


def test_malformed_specs_file_is_a_typed_error(tmp_path, capsys):
    from meshlab.cli import main

    model = _llama_classifier(tmp_path)
    cases = {"notjson.json": ("{oops", "cannot read it"),
             "list.json": ("[1, 2]", "FQN globs"),
             "scalar.json": ('{"score.weight": "heads"}', "entry 'score.weight'"),
             "int-dim.json": ('{"model.norm.weight": [null], "score.weight": [null, 3]}',
                              "entry 'score.weight': [None, 3]"),
             "twice.json": ('{"score.weight": ["heads", "heads"]}', "uses axis 'heads' twice"),
             "bad.yaml": ("score.weight: [heads\n", "cannot read it")}
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["plan", "--model", model, "--mesh", "dp=2,tp=2", "--specs",
                     str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("meshlab plan: error: ConfigError: --specs ") and name in err, err
        assert needle in err, err
    # --no-policy without a file to lay out by
    assert main(["plan", "--model", model, "--mesh", "dp=2", "--no-policy"]) == 2
    assert "give --specs FILE" in capsys.readouterr().err
