"""Bad input to the command line, the engine's configuration, a model directory and a
machine profile is refused by name, with the fix, before any model loads: a NaN temperature,
a token id that is not a number, a config naming code of its own, a profile missing a rate."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshlab import cli
from meshlab.core.errors import ConfigError


def _generate(tmp_path, *flags):
    return cli.main(["generate", str(tmp_path), "--prompt-ids", "1,2", *flags])


@pytest.mark.parametrize("flags, said", [
    (("--temperature", "nan", "--do-sample"), "--temperature nan: must be a finite number > 0"),
    (("--temperature", "0"), "--temperature 0.0: must be a finite number > 0"),
    (("--top-p", "1.5"), "--top-p 1.5: is a probability in (0, 1]"),
    (("--top-k", "-1"), "--top-k -1: must be an integer >= 0"),
    (("--max-new-tokens", "0"), "--max-new-tokens 0: must be an integer >= 1"),
    (("--max-batch-size", "0"), "--max-batch-size 0"),
])
def test_generate_flags_are_refused_by_name(tmp_path, capsys, flags, said):
    # the directory holds no model: the flags are refused before anything is loaded
    assert _generate(tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert said in err and "pass e.g." in err, err


def test_prompt_ids_must_be_integers(tmp_path, capsys):
    assert cli.main(["generate", str(tmp_path), "--prompt-ids", "1,x,3"]) == 2
    assert "comma-separated token ids" in capsys.readouterr().err


def test_a_model_directory_with_code_of_its_own_is_refused(tmp_path):
    from meshlab.inference._load import load_pretrained

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    with pytest.raises(ConfigError, match="names code of its own"):
        load_pretrained(str(tmp_path), torch.float32)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a Hugging Face config is a JSON object"):
        load_pretrained(str(tmp_path), torch.float32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON config"):
        load_pretrained(str(tmp_path), torch.float32)


@pytest.mark.parametrize("field, value, said", [
    ("temperature", math.nan, "temperature"),
    ("temperature", 0, "temperature=0"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -3, "top_k"),
    ("do_sample", 1, "do_sample"),
    ("max_batch_size", True, "max_batch_size"),
    ("seed", -1, "seed"),
    ("repetition_penalty", math.inf, "repetition_penalty"),
])
def test_inference_config_fields_are_checked(field, value, said):
    from meshlab.inference import InferenceConfig

    with pytest.raises(ConfigError, match=said):
        InferenceConfig(**{field: value})


def test_machine_profiles_are_checked(tmp_path):
    import dataclasses

    from meshlab.estimate.machine import Machine, machine

    good = dataclasses.asdict(machine("h200"))
    path = tmp_path / "m.json"
    path.write_text(json.dumps(good))
    assert machine(str(path)) == Machine(**good)
    for broken, said in ((dict(good, hbm=math.nan), "must be a finite number >= 0"),
                         (dict(good, hbm=-1), "must be a finite number >= 0"),
                         ({k: v for k, v in good.items() if k != "name"}, "missing fields"),
                         ([1, 2], "a JSON object")):
        path.write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match=said):
            machine(str(path))
    path.write_text("{")
    with pytest.raises(ConfigError, match="not a readable JSON profile"):
        machine(str(path))


# -- the rest of the command line, the engine and the adapters' arguments -----------------
@pytest.mark.parametrize("argv, said", [
    (["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--batch", "2", "--seq", "8",
      "--gpu", "{bad"], "machine '{bad'"),
    (["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--json", "{tmp}"], "is a directory"),
    (["check", "--ops", "nope"], "--ops 'nope': 'nope' is not one of meshlab's fused ops"),
    (["calibrate", "--device", "tpu", "--out", "{tmp}/m.json"], "calibrate(device='tpu')"),
])
def test_other_commands_refuse_bad_flags_by_name(tmp_path, capsys, argv, said):
    """A directory for --json (IsADirectoryError) and an unknown op for check (KeyError)
    were tracebacks; --gpu is read before the model is planned."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert said in captured.err and "Traceback" not in captured.err, captured.err
    if argv[0] == "plan":
        assert "planned" not in captured.out


def test_bad_gpu_json_file_is_refused(tmp_path, capsys):
    bad = tmp_path / "h.json"
    bad.write_text("{bad")
    assert cli.main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--batch", "2",
                     "--seq", "8", "--gpu", str(bad)]) == 2
    assert "not a readable JSON profile" in capsys.readouterr().err


def test_generate_on_a_directory_with_only_a_config(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).to_json_file(
        str(tmp_path / "config.json"))
    assert _generate(tmp_path, "--max-new-tokens", "2") == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "safetensors weights" in err and "Traceback" not in err


def test_an_engine_on_a_model_directory_with_code_of_its_own_is_refused(tmp_path):
    """InferenceEngine(path) on such a directory reached transformers' interactive y/N."""
    from meshlab.inference import InferenceEngine

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    with pytest.raises(ConfigError, match="names code of its own"):
        InferenceEngine(str(tmp_path))
    assert cli.main(["generate", str(tmp_path), "--prompt-ids", "1,2"]) == 2


@pytest.mark.parametrize("value", ["x", [1.0], "nan"])
def test_inference_config_refuses_other_kinds(value):
    from meshlab.inference import InferenceConfig

    with pytest.raises(ConfigError, match="temperature"):
        InferenceConfig(temperature=value)


@pytest.mark.parametrize("kw, said", [
    (dict(r=0), "lora(r=0): r must be an integer >= 1"),
    (dict(r=-1), "lora(r=-1)"), (dict(r=1.5), "lora(r=1.5)"), (dict(r=True), "lora(r=True)"),
    (dict(lora_alpha=float("nan")), "lora_alpha"), (dict(lora_dropout=1.0), "lora_dropout"),
])
def test_lora_ranks_and_scales_are_checked(kw, said):
    """peft accepted r of 0, -1 or 1.5 and failed inside its injection."""
    import peft

    import meshlab as ml

    for call in (lambda: ml.lora(target_modules=["q_proj"], **kw),
                 lambda: ml.lora(peft.LoraConfig(target_modules=["q_proj"], **kw))):
        with pytest.raises(ConfigError) as e:
            call()
        assert said in str(e.value)
