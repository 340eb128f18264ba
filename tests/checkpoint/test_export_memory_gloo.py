"""Exports stream: rank 0 holds one parameter at a time while a Hugging Face export or a
merged-LoRA export of a sharded model is written (peak resident memory the export adds on
rank 0, VmHWM after /proc/self/clear_refs, under twice the largest parameter plus 64 MiB on
a model over 100 times its largest parameter), and what is written loads back exactly."""

from __future__ import annotations

import ctypes

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
_LIBC = ctypes.CDLL("libc.so.6")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _model():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=24, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=1024)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def export_case(rank, world, directory, merged):
    import gc

    import meshlab as ml
    from meshlab import checkpoint

    spec = ml.zero_shard(3, "dp")
    if merged:
        spec = ml.lora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) | spec
    model = ml.parallelize(_model(), spec, ml.Mesh(dp=world), seed=0)
    with torch.no_grad():          # adapters that change the weights when merged
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.add_(0.01)
    sizes = [p.numel() * p.element_size() for p in _model().parameters()]
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS")
    if merged:
        ml.save_merged(directory, model)
    else:
        checkpoint.save_pretrained(directory, model, max_shard_size="50MB")
    added = (_kib("VmHWM") - base) * 1024
    return added, max(sizes), sum(sizes)


@pytest.mark.parametrize("merged", [False, True], ids=["save_pretrained", "save_merged"])
def test_rank_zero_holds_one_parameter_at_a_time(world2, tmp_path, merged):
    import transformers

    out = world2.run(export_case, directory=str(tmp_path / "export"), merged=merged)
    added, largest, total = out[0]
    assert total > 100 * largest
    assert added < 2 * largest + 64 * 2**20, (added / 2**20, largest / 2**20, total / 2**20)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert sum(p.numel() for p in back.parameters()) * 4 == total
