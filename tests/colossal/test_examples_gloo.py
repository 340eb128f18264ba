"""The four scripts of ``examples/colossal/`` on 2 gloo processes, each as the
Colossal-AI example it follows says (see each script's docstring): they train (the loss
is finite and the weights move), and what they save loads back."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from tests import REPO

pytestmark = pytest.mark.timeout(600)
if os.fspath(REPO) not in sys.path:
    sys.path.insert(0, os.fspath(REPO))


def case_llama(rank, world, argv):
    from examples.colossal import llama_benchmark

    out = llama_benchmark.main(argv)
    assert len(out["losses"]) == 3 and all(math.isfinite(x) for x in out["losses"])


def case_gpt(rank, world, argv):
    from examples.colossal import gpt_finetune

    out = gpt_finetune.main(argv)
    assert all(math.isfinite(x) for x in out["losses"])
    assert [g["weight_decay"] for g in out["optimizer"].param_groups] == [0.01, 0.0]


def case_bert(rank, world, argv, save):
    from transformers import BertForSequenceClassification

    from examples.colossal import bert_glue_finetune

    out = bert_glue_finetune.main(argv + ["--save", save])
    assert all(math.isfinite(x) for x in out["losses"])
    again = BertForSequenceClassification.from_pretrained(save)
    assert again.config.num_labels == 2


def case_lora(rank, world, argv, save):
    from examples.colossal import lora_finetune

    out = lora_finetune.main(argv + ["--save_dir", save])
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    # save_lora_as_pretrained's default, as Colossal-AI and peft write it
    assert os.path.isfile(os.path.join(save, "adapter_model.bin"))
    trainable = [n for n, p in out["model"].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("argv", [["--plugin", "gemini"], ["--plugin", "3d", "--pp", "2"],
                                  ["--plugin", "fsdp"]])
def test_llama_benchmark(world2, argv):
    world2.run(case_llama, argv=argv)


@pytest.mark.parametrize("plugin", ["torch_ddp", "low_level_zero", "hybrid_parallel"])
def test_gpt_finetune(world2, plugin):
    world2.run(case_gpt, argv=["--plugin", plugin])


@pytest.mark.parametrize("plugin", ["torch_ddp", "gemini"])
def test_bert_glue_finetune(world2, tmp_path_factory, plugin):
    world2.run(case_bert, argv=["--plugin", plugin],
               save=os.fspath(tmp_path_factory.mktemp("bert")))


@pytest.mark.parametrize("plugin", ["ddp", "zero2"])
def test_lora_finetune(world2, tmp_path_factory, plugin):
    world2.run(case_lora, argv=["--plugin", plugin],
               save=os.fspath(tmp_path_factory.mktemp("lora")))
