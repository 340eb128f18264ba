"""BERT sequence classification fine-tuning as Colossal-AI's
``examples/tutorial/new_api/glue_bert/finetune.py`` writes it: ``launch_from_torch``, a
plugin from the command line (torch DDP, Gemini, low-level ZeRO), ``HybridAdam`` over the
no-weight-decay groups, transformers' linear warm-up schedule, the training loop with
``booster.backward``, and the model saved at the end. The data is a small random
GLUE-like task (the original downloads GLUE).

    meshlab run --nproc-per-node 2 examples/colossal/bert_glue_finetune.py --plugin gemini
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import TensorDataset
from transformers import BertConfig, BertForSequenceClassification, \
    get_linear_schedule_with_warmup

from meshlab import booster as colossalai
from meshlab.booster import Booster
from meshlab.booster.accelerator import get_accelerator
from meshlab.booster.cluster import DistCoordinator
from meshlab.booster.nn.optimizer import HybridAdam
from meshlab.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("-p", "--plugin", default="torch_ddp",
                   choices=["torch_ddp", "gemini", "low_level_zero"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save", default=None, help="directory for the fine-tuned model")
    args = p.parse_args(argv)

    colossalai.launch_from_torch(seed=42, verbose=False)
    coordinator = DistCoordinator()
    plugin = {"torch_ddp": lambda: TorchDDPPlugin(),
              "gemini": lambda: GeminiPlugin(precision="fp32", initial_scale=2 ** 5),
              "low_level_zero": lambda: LowLevelZeroPlugin(precision="fp32",
                                                           initial_scale=2 ** 5)}[args.plugin]()
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    n = args.batch_size * args.steps * plugin.dp_size
    ids = torch.randint(1, 64, (n, 10))
    data = TensorDataset(ids, torch.ones_like(ids), (ids[:, 1] > 32).long())
    train = plugin.prepare_dataloader(data, batch_size=args.batch_size, shuffle=True,
                                      drop_last=True)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters()
                          if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = HybridAdam(groups, lr=2e-3)
    total = args.epochs * len(train)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                                num_training_steps=total)
    model, optimizer, _, train, scheduler = booster.boost(model, optimizer, dataloader=train,
                                                          lr_scheduler=scheduler)
    device = get_accelerator().get_current_device()
    losses = []
    for _ in range(args.epochs):
        model.train()
        for input_ids, mask, labels in train:
            out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                        labels=labels.to(device))
            booster.backward(out.loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(float(out.loss))
    save = args.save or os.path.join(tempfile.gettempdir(), "meshlab_bert_glue")
    booster.save_model(model, save, use_safetensors=True)
    coordinator.print_on_master(f"{args.plugin}: losses {['%.4f' % x for x in losses]}; "
                                f"saved to {save}")
    return {"losses": losses, "saved": save}


if __name__ == "__main__":
    main()
