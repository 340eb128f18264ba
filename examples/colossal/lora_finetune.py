"""LoRA fine-tuning of a causal language model as ColossalChat's
``examples/training_scripts/lora_finetune.py`` writes it: ``launch_from_torch``, a plugin
from the command line, the model built under ``LazyInitContext``, ``enable_lora`` with a
``LoraConfig``, ``HybridAdam``, ``CosineAnnealingWarmupLR``, gradient accumulation under
``booster.no_sync``, and ``save_lora_as_pretrained`` at the end. The data is random
tokens (the original reads a tokenized chat dataset).

    meshlab run --nproc-per-node 2 examples/colossal/lora_finetune.py --plugin zero2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

import torch
from peft import LoraConfig
from torch.utils.data import TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from meshlab import booster as colossalai
from meshlab.booster import Booster
from meshlab.booster.cluster import DistCoordinator
from meshlab.booster.lazy import LazyInitContext
from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR
from meshlab.booster.nn.optimizer import HybridAdam
from meshlab.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin
from meshlab.booster.utils import get_current_device


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--plugin", default="zero2", choices=["ddp", "zero2"])
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--accumulation_steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lora_rank", type=int, default=4)
    p.add_argument("--save_dir", default=None)
    args = p.parse_args(argv)

    colossalai.launch_from_torch(verbose=False)
    coordinator = DistCoordinator()
    plugin = (TorchDDPPlugin() if args.plugin == "ddp"
              else LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=1.0))
    booster = Booster(plugin=plugin)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with LazyInitContext():
        model = LlamaForCausalLM(config)
    lora_config = LoraConfig(task_type="CAUSAL_LM", r=args.lora_rank, lora_alpha=8,
                             lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = booster.enable_lora(model, lora_config=lora_config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.0)
    n = args.batch_size * args.accumulation_steps * args.steps * plugin.dp_size
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, config.vocab_size, (n, 12)))
    dataloader = plugin.prepare_dataloader(data, batch_size=args.batch_size, shuffle=True,
                                           drop_last=True)
    scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=args.steps, warmup_steps=1)
    model, optimizer, _, dataloader, scheduler = booster.boost(
        model, optimizer, dataloader=dataloader, lr_scheduler=scheduler)
    device = get_current_device()
    losses = []
    for i, (ids,) in enumerate(dataloader):
        ids = ids.to(device)
        last = (i + 1) % args.accumulation_steps == 0
        # Accumulate without communication, and reduce on the last micro-step.
        with contextlib.nullcontext() if last else booster.no_sync(model):
            loss = model(input_ids=ids, labels=ids).loss / args.accumulation_steps
            booster.backward(loss, optimizer)
        if last:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(float(loss) * args.accumulation_steps)
    save = args.save_dir or os.path.join(tempfile.gettempdir(), "meshlab_lora")
    booster.save_lora_as_pretrained(model, save)
    coordinator.print_on_master(f"{args.plugin}: losses {['%.4f' % x for x in losses]}; "
                                f"adapter in {save}")
    return {"losses": losses, "saved": save, "model": model}


if __name__ == "__main__":
    main()
