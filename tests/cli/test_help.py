"""``meshlab --help`` lists every command with an example, and ``plan --help`` describes the
command with examples that run as written."""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest

from meshlab import cli


def _help(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(argv)
    return out.getvalue()


def test_top_help_lists_every_command_with_an_example():
    text = _help(["--help"])
    commands = text.split("{", 1)[1].split("}", 1)[0].split(",")
    assert [c for c, _ in cli.EXAMPLES] == commands
    for cmd, example in cli.EXAMPLES:
        assert f"  {cmd:<10} meshlab {cmd}" in text and example in text
    assert "``" not in text                 # no reST markup in a terminal


def test_plan_help_has_a_description_and_examples():
    text = _help(["plan", "--help"])
    assert "meta device" in text and "examples:" in text


@pytest.mark.parametrize("line", [ln.strip() for ln in cli._PLAN_EXAMPLES.splitlines()[1:]]
                         + [cli.EXAMPLES[0][1]])
def test_plan_examples_run(line, capsys, tmp_path, monkeypatch):
    argv = shlex.split(line)
    assert argv[:2] == ["meshlab", "plan"]
    monkeypatch.chdir(tmp_path)            # what an example writes (--json, --pictures)
    if "./config.json" in argv:            # the user's own config: a small Llama's here
        from transformers import LlamaConfig

        LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4).to_json_file("config.json")
    assert cli.main(argv[1:]) == 0
    assert capsys.readouterr().out.strip()
