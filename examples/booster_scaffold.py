"""Colossal-AI's minimal training scaffold, with its imports changed to meshlab's.

    meshlab run --nproc-per-node 4 examples/booster_scaffold.py

Between the markers is the scaffold as Colossal-AI's guide gives it (tensor parallel 2 x
pipeline 2, ZeRO-1, bf16, 8 microbatches, every fused kernel, HybridAdam); the lines
before the markers build the model and data it leaves to the reader, the lines after it
train a few steps through the pipeline.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshlab.data import TextDataset


def run(steps: int = 3, batch_size: int = 8, seq: int = 16):
    """Train ``steps`` steps; returns (model, loss of each step, the batches read)."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(1024)                  # launch_from_torch's default seed
    model = LlamaForCausalLM(config)
    # -- scaffold:begin
    from meshlab import booster as colossalai
    from meshlab.booster import Booster
    from meshlab.booster.plugin import HybridParallelPlugin
    from meshlab.booster.optimizer import HybridAdam

    colossalai.launch_from_torch()
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="bf16",
                                  num_microbatches=8, enable_all_optimization=True)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-4))
    # -- scaffold:end
    dataloader = plugin.prepare_dataloader(TextDataset(seq), batch_size=batch_size)
    losses, seen = [], []
    for _, batch in zip(range(steps), dataloader):
        batch["labels"] = batch["input_ids"]
        out = booster.execute_pipeline(iter([batch]), model,
                                       lambda outputs, inputs: outputs.loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out["loss"]))
        seen.append(batch["input_ids"])
    return model, losses, seen


if __name__ == "__main__":
    import torch.distributed as dist

    _, losses, _ = run()
    if dist.get_rank() == 0:
        print(" ".join(f"{x:.4f}" for x in losses))
