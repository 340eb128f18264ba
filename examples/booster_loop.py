"""A Colossal-AI Booster training loop in which only the imports are meshlab's.

    meshlab run --nproc-per-node 4 examples/booster_loop.py --plugin hybrid
    torchrun --nproc_per_node 4 examples/booster_loop.py --plugin gemini --steps 20

Everything below the import block is written against Colossal-AI's API (``launch_from_torch``,
a plugin, ``Booster.boost``, ``booster.backward`` or ``booster.execute_pipeline``, the
optimizer step, the scheduler, the checkpoint methods). The model is a small Llama (a
small Mixtral for the MoE plugin) built from a config; the data is the corpus meshlab
ships, as bytes.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

# -- the imports: a Colossal-AI script has `import colossalai`, `colossalai.booster`,
# -- `colossalai.booster.plugin` and `colossalai.nn.optimizer` here --------------------------
from meshlab import booster as colossalai
from meshlab.booster import Booster
from meshlab.booster.optimizer import HybridAdam
from meshlab.booster.plugin import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                    MoeHybridParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin)
from meshlab.data import TextDataset
# ---------------------------------------------------------------------------------------------

SEQ, VOCAB = 16, 256


def make_plugin(name: str):
    """One configuration of each plugin (fp32, so a run equals one process bit for bit but
    for summation order; the guide's scaffold runs bf16)."""
    if name == "ddp":
        return TorchDDPPlugin(bucket_cap_mb=1)
    if name == "fsdp":
        return TorchFSDPPlugin()
    if name == "fsdp_hybrid":     # sharded within a node (LOCAL_WORLD_SIZE), replicated across
        from torch.distributed.fsdp import ShardingStrategy

        return TorchFSDPPlugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=1.0)
    if name == "zero1":
        return LowLevelZeroPlugin(stage=1, precision="fp32")
    if name == "gemini":
        return GeminiPlugin(precision="fp32", offload_optim_frac=0.5, pin_memory=False)
    if name == "gemini_hybrid":     # sharded over 2, replicated over the rest (extra_dp_size)
        return GeminiPlugin(precision="fp32", extra_dp_size=2)
    if name == "hybrid":
        return HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="fp32",
                                    num_microbatches=2)
    if name == "hybrid_offload":    # ZeRO-1's optimizer state in host memory, beside tp and pp
        return HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="fp32",
                                    num_microbatches=2, cpu_offload=True)
    if name == "gemini_tp":         # ZeRO-3 with tensor parallelism, shards partly on the host
        return GeminiPlugin(precision="fp32", tp_size=2, offload_param_frac=0.5,
                            offload_optim_frac=1.0, pin_memory=False)
    if name == "hybrid_sp":         # a pipeline of two stages, Ulysses inside each
        return HybridParallelPlugin(tp_size=1, pp_size=2, sp_size=2, zero_stage=1,
                                    enable_sequence_parallelism=True,
                                    sequence_parallelism_mode="all_to_all", precision="fp32",
                                    num_microbatches=2)
    if name == "hybrid_tp":
        return HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=0, precision="fp32")
    if name == "moe":
        return MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=1,
                                       precision="fp32")
    if name == "moe_sp":            # experts over ep, ring attention over sp
        return MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, sp_size=2,
                                       zero_stage=1, enable_sequence_parallelism=True,
                                       sequence_parallelism_mode="ring_attn", precision="fp32")
    if name == "moe_offload":       # experts over ep, ZeRO-1's optimizer state on the host
        return MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=1,
                                       cpu_offload=True, precision="fp32")
    raise SystemExit(f"--plugin {name!r}: one of ddp, fsdp, fsdp_hybrid, zero1, zero2, gemini, "
                     f"gemini_hybrid, gemini_tp, hybrid, hybrid_offload, hybrid_sp, hybrid_tp, "
                     f"moe, moe_sp, moe_offload")


def make_model(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name.startswith("moe"):
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4,
                                                num_experts_per_tok=2))
    return LlamaForCausalLM(LlamaConfig(**common))


def train(name: str, steps: int = 3, batch_size: int = 2, lr: float = 1e-3, seed: int = 42,
          save: str | None = None, resume: str | None = None, start: int = 0):
    """Train ``steps`` steps (from ``start``, loading ``resume`` first); returns the boosted
    model and this rank's loss of each step."""
    colossalai.launch_from_torch(seed=seed, verbose=False)
    plugin = make_plugin(name)
    booster = Booster(plugin=plugin)

    model = make_model(name)
    optimizer = HybridAdam(model.parameters(), lr=lr, weight_decay=0.01)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    dataloader = plugin.prepare_dataloader(TextDataset(SEQ), batch_size=batch_size,
                                           shuffle=True, seed=seed, drop_last=True)

    def criterion(outputs, inputs):
        return outputs.loss

    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler)
    if resume is not None:
        booster.load_model(model, f"{resume}/model")
        booster.load_optimizer(optimizer, f"{resume}/optimizer")
        booster.load_lr_scheduler(lr_scheduler, f"{resume}/lr_scheduler.json")

    use_pipeline = isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1
    losses = []
    model.train()
    for step, batch in enumerate(dataloader):
        if step < start:
            continue
        if step == start + steps:
            break
        batch["labels"] = batch["input_ids"]
        if use_pipeline:
            out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer,
                                           return_loss=True)
            loss = out["loss"]
        else:
            outputs = model(**batch)
            loss = criterion(outputs, batch)
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        losses.append(loss.item())

    if save is not None:
        booster.save_model(model, f"{save}/model", shard=True, use_safetensors=name == "hybrid")
        booster.save_optimizer(optimizer, f"{save}/optimizer", shard=True)
        booster.save_lr_scheduler(lr_scheduler, f"{save}/lr_scheduler.json")
    return model, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", default="hybrid")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    model, losses = train(args.plugin, steps=args.steps, save=args.save)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(" ".join(f"{x:.4f}" for x in losses))


if __name__ == "__main__":
    main()
