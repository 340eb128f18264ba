"""A Llama training benchmark as Colossal-AI's ``examples/language/llama/benchmark.py``
writes it: a plugin chosen on the command line (Gemini, a 3D hybrid, torch FSDP), the
model built under ``LazyInitContext``, ``HybridAdam``, ``DistCoordinator`` printing on
the master, ``execute_pipeline`` under pipeline parallelism and ``booster.backward``
otherwise, and the throughput of the steps after the warm-up.

    meshlab run --nproc-per-node 2 examples/colossal/llama_benchmark.py --plugin 3d --pp 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from meshlab import booster as colossalai
from meshlab.booster import Booster
from meshlab.booster.accelerator import get_accelerator
from meshlab.booster.cluster import DistCoordinator
from meshlab.booster.lazy import LazyInitContext
from meshlab.booster.nn.optimizer import HybridAdam
from meshlab.booster.plugin import GeminiPlugin, HybridParallelPlugin, TorchFSDPPlugin


class RandomDataset(Dataset):
    """Random token ids, as the benchmark's ``data_utils.RandomDataset``."""

    def __init__(self, num_samples: int, max_length: int, vocab_size: int):
        self.ids = torch.randint(0, vocab_size, (num_samples, max_length))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.ids[i]}


def make_plugin(args):
    if args.plugin == "gemini":
        return GeminiPlugin(precision="fp32", max_norm=1.0, tp_size=args.tp)
    if args.plugin == "fsdp":
        return TorchFSDPPlugin()
    # Microbatches only with a pipeline (the benchmark passes them unconditionally).
    extra = dict(num_microbatches=args.mbs_count) if args.pp > 1 else {}
    return HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero,
                                precision="fp32", max_norm=1.0, **extra)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("-p", "--plugin", choices=["gemini", "3d", "fsdp"], default="gemini")
    p.add_argument("-b", "--batch_size", type=int, default=2)
    p.add_argument("-s", "--num_steps", type=int, default=3)
    p.add_argument("-i", "--ignore_steps", type=int, default=1)
    p.add_argument("-l", "--max_length", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--mbs_count", type=int, default=2)
    args = p.parse_args(argv)

    colossalai.launch_from_torch(seed=42, verbose=False)
    coordinator = DistCoordinator()
    plugin = make_plugin(args)
    booster = Booster(plugin=plugin)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    dp = plugin.dp_size
    dataset = RandomDataset(args.batch_size * args.num_steps * dp, args.max_length,
                            config.vocab_size)
    dataloader = plugin.prepare_dataloader(dataset, batch_size=args.batch_size, shuffle=True,
                                           drop_last=True, seed=42)
    with LazyInitContext():
        model = LlamaForCausalLM(config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    model, optimizer, _, dataloader, _ = booster.boost(model, optimizer, dataloader=dataloader)
    coordinator.print_on_master(f"{args.plugin}: {plugin.spec}")

    device = get_accelerator().get_current_device()
    losses, start = [], None
    for step, batch in enumerate(dataloader):
        if step == args.ignore_steps:
            start = time.perf_counter()
        batch = {k: v.to(device) for k, v in batch.items()}
        if plugin.stage_manager is not None:
            out = booster.execute_pipeline(iter([batch]), model,
                                           lambda outputs, inputs: outputs.loss, optimizer)
            loss = out["loss"]
        else:
            loss = model(**batch).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    seconds = time.perf_counter() - start if start is not None else float("nan")
    tokens = (len(losses) - args.ignore_steps) * args.batch_size * dp * args.max_length
    coordinator.print_on_master(f"losses {['%.4f' % x for x in losses]}, "
                                f"{tokens / seconds:.0f} tokens/s")
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
