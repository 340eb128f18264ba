"""A Llama training step on one GPU with and without ``fuse()``: tokens/s and peak memory.

The same model (Llama-3 shape scaled to ``--layers`` layers of hidden 2048, vocabulary
128,256, bf16 parameters, AdamW(fused=True)) runs forward, backward and an optimizer step
on ``--batch`` x ``--seq`` tokens, as

* ``hf_sdpa``  -- transformers as shipped, ``attn_implementation="sdpa"``;
* ``meshlab``  -- the same model after ``meshlab.transforms.fuse.fuse_model(model)`` (RMSNorm, rotary,
  attention and the loss on meshlab's ops; the logits never exist).

Both start from the same weights; the first step's losses are compared. Time: CUDA events
around ``--steps`` steps after 3 warm-up steps, median step; peak memory is
``max_memory_allocated`` over the timed steps. Writes ``benchmarks/results/fuse_gpu_<card>.json``.

    python benchmarks/fuse_gpu.py [--layers 8] [--batch 2] [--seq 4096] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _timing import cuda_times  # noqa: E402

import meshlab as ml  # noqa: E402
from meshlab.transforms.fuse import causal_lm_loss, fuse_model as fuse  # noqa: E402


def run(model, batch, steps: int, fused: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        if fused:
            loss = causal_lm_loss(model, batch)
        else:
            loss = ml.losses.causal_lm_loss(model(input_ids=batch["input_ids"]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step())
    for _ in range(2):
        step()
    times = cuda_times(step, steps)
    ms = statistics.median(times)
    tokens = batch["input_ids"].numel()
    return {"first_loss": first, "ms_per_step": ms, "tokens_per_s": tokens / (ms * 1e-3),
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30, "step_ms": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
        max_position_embeddings=args.seq, rope_theta=500000.0, tie_word_embeddings=False,
        attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
    batch = {"input_ids": ids}
    results = {}
    for name in ("hf_sdpa", "meshlab"):
        model = copy.deepcopy(base)
        report = None
        if name == "meshlab":
            report = fuse(model).counts()
        torch.cuda.empty_cache()
        results[name] = run(model, batch, args.steps, fused=name == "meshlab")
        results[name]["routed"] = report
        del model
        torch.cuda.empty_cache()
        print(f"{name:>8}: {results[name]['ms_per_step']:.1f} ms/step, "
              f"{results[name]['tokens_per_s']:.0f} tokens/s, peak {results[name]['peak_GiB']:.1f} GiB, "
              f"first loss {results[name]['first_loss']:.4f}")
    from meshlab.ops import _build

    dev = torch.cuda.get_device_properties(0)
    out = {"card": dev.name, "torch": torch.__version__, "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": {"layers": args.layers, "hidden": 2048, "vocab": 128256, "heads": 16,
                     "kv_heads": 8, "params": sum(p.numel() for p in base.parameters())},
           "batch": args.batch, "seq": args.seq,
           "method": f"median of {args.steps} steps (CUDA events) after 3 warm-up steps; bf16 "
                     "parameters, AdamW(fused=True); peak = max_memory_allocated over the timed steps",
           "paths": {f"{op}/{dev_}": p.reason for (op, dev_), p in _build.LAST_PATH.items()},
           "speedup": results["hf_sdpa"]["ms_per_step"] / results["meshlab"]["ms_per_step"],
           "results": results}
    path = _results.write("fuse_gpu", dev.name, out, args.copy_to)
    print(f"speedup {out['speedup']:.3f}x; wrote {path}")


if __name__ == "__main__":
    main()
