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
