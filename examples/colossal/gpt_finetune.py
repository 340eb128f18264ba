"""GPT-2 sequence classification fine-tuning as Colossal-AI's
``examples/language/gpt/hybridparallelism/finetune.py`` writes it: a plugin chosen on
the command line, AdamW over two groups (no weight decay for biases and LayerNorm
weights), a linear warm-up schedule from transformers, ``booster.backward`` (or
``execute_pipeline`` with a pipeline), and an evaluation of the accuracy. The data is a
small random GLUE-like task (the original downloads GLUE).

    meshlab run --nproc-per-node 2 examples/colossal/gpt_finetune.py --plugin hybrid_parallel
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2ForSequenceClassification, \
    get_linear_schedule_with_warmup

from meshlab import booster as colossalai
from meshlab.booster import Booster
from meshlab.booster.accelerator import get_accelerator
from meshlab.booster.cluster import DistCoordinator
from meshlab.booster.nn.optimizer import HybridAdam
from meshlab.booster.plugin import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                    TorchDDPPlugin)


def make_plugin(name: str):
    if name == "torch_ddp":
        return TorchDDPPlugin()
    if name == "gemini":
        return GeminiPlugin(precision="fp32", initial_scale=2 ** 5)
    if name == "low_level_zero":
        return LowLevelZeroPlugin(precision="fp32", initial_scale=2 ** 5)
    return HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, precision="fp32",
                                initial_scale=1)


def grouped_params(model, weight_decay: float):
    """The fine-tuning examples' two groups: no decay for biases and LayerNorm weights."""
    no_decay = ("bias", "ln_")
    return [{"params": [p for n, p in model.named_parameters()
                        if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters()
                        if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("-p", "--plugin", default="torch_ddp",
                   choices=["torch_ddp", "gemini", "low_level_zero", "hybrid_parallel"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=4)
    args = p.parse_args(argv)

    colossalai.launch_from_torch(seed=42, verbose=False)
    coordinator = DistCoordinator()
    plugin = make_plugin(args.plugin)
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    n = args.batch_size * args.steps * plugin.dp_size
    ids = torch.randint(0, 96, (n, 12))
    labels = (ids[:, 0] % 2).long()                     # learnable from the first token
    train = plugin.prepare_dataloader(TensorDataset(ids, labels), batch_size=args.batch_size,
                                      shuffle=True, drop_last=True)
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                        num_labels=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2ForSequenceClassification(config)
    optimizer = HybridAdam(grouped_params(model, 0.01), lr=2e-3, eps=1e-8)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                                num_training_steps=args.steps)
    model, optimizer, _, train, scheduler = booster.boost(model, optimizer, dataloader=train,
                                                          lr_scheduler=scheduler)
    device = get_accelerator().get_current_device()
    losses = []
    for input_ids, y in train:
        out = model(input_ids=input_ids.to(device), labels=y.to(device))
        booster.backward(out.loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(out.loss))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:16].to(device)).logits
    accuracy = float((logits.argmax(-1).cpu() == labels[:16]).float().mean())
    coordinator.print_on_master(f"{args.plugin}: losses {['%.4f' % x for x in losses]}, "
                                f"accuracy {accuracy:.2f}")
    return {"losses": losses, "optimizer": optimizer, "accuracy": accuracy}


if __name__ == "__main__":
    main()
