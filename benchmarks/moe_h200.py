"""Mixture-of-experts on one GPU: the experts block through meshlab's dispatching path
against transformers' own implementations, and a small Mixtral-shaped model's training
throughput against a dense model of the same active parameters.

* block: ``MixtralSparseMoeBlock`` (hidden 2048, expert intermediate 1408, top-2, E=8 and
  E=64) on 2 x 4096 bf16 tokens, forward + backward, with the experts implementation
  ``eager`` (transformers' loop over experts), ``grouped_mm`` (transformers' grouped
  matmul) and ``meshlab_ep`` (``expert_route``'s dispatch at ep=1, whose local experts run
  through ``grouped_mm``);
* model: Mixtral-shaped (hidden 1024, 8 layers, 8 experts of 2816, top-2) against a
  Llama of the same shape whose MLP is 5632 wide (the same active parameters per token),
  bf16 parameters, AdamW(foreach=False) for all, 4 x 2048 tokens per step; transformers'
  grouped_mm path eager and with each decoder layer compiled (``torch.compile``, graph
  breaks allowed), meshlab's ``expert_route`` alone and with ``fuse`` (norms, rotary,
  attention) and ``compile_blocks`` (each block compiled around the expert dispatch);
* ``moe_meshlab_compile_fuse_<op>+<op>`` (``--only`` only): compiled blocks with those
  ops fused (``rms_norm``, ``rotary``, ``attention``), torch's fused AdamW: which of
  meshlab's ops inside a compiled block costs time;
* two rows that take the best apart: ``moe_meshlab_compile`` (``expert_route`` with
  ``compile_blocks`` only, torch's fused AdamW) and ``moe_meshlab_fused_torch_adamw`` (the
  best meshlab model under torch's fused AdamW in a plain loop, without ``ml.step``);
* best of each (``moe_hf_best``, ``moe_meshlab_best``): the two compiled paths above, each
  with its fastest optimizer, torch's ``AdamW(fused=True)`` for transformers, meshlab's
  ``FusedAdamW`` through ``ml.optimizer`` and ``ml.step`` for meshlab (at ep=1 no parameter
  is a DTensor, so both fused kernels take every parameter).

Times: CUDA events, median of 20 (block) / 10 (model) after 3 warm-up runs. Writes
``benchmarks/results/moe_<card>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402


def _time(fn, n: int) -> float:
    from _timing import cuda_times

    for _ in range(3):
        fn()
    return statistics.median(cuda_times(fn, n))


def block(E: int) -> dict:
    import torch.distributed as dist
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from meshlab.transforms.expert._dispatch import IMPL, EPState, EPStats, ep_experts_forward
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPL, ep_experts_forward)
    cfg = transformers.MixtralConfig(hidden_size=2048, intermediate_size=1408,
                                     num_local_experts=E, num_experts_per_tok=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        blk = MixtralSparseMoeBlock(cfg).to(torch.bfloat16)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    blk.experts._meshlab_ep = EPState(dist.group.WORLD, 1, 0, "grouped_mm", None, EPStats())
    out, ref = {}, None
    for impl in ("eager", "grouped_mm", IMPL, IMPL + "_capacity"):
        cfg._experts_implementation = IMPL if impl.startswith(IMPL) else impl
        # the fixed-size exchange (capacity 2x the uniform share): no host synchronization
        blk.experts._meshlab_ep.capacity_factor = 2.0 if impl.endswith("capacity") else None

        def step():
            x.grad = None
            for p in blk.parameters():
                p.grad = None
            y = blk(x)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(g)
            return y

        y = step()
        if ref is None:
            ref = (y.detach().float(), x.grad.float().clone())
        err = float((y.detach().float() - ref[0]).norm() / ref[0].norm())
        blk.experts._meshlab_ep.stats.reset()
        step()
        dropped = blk.experts._meshlab_ep.stats.dropped
        out[impl] = {"ms": _time(step, 20), "rel_err_vs_eager": err, "dropped_pairs": dropped,
                     "grad_rel_err_vs_eager": float((x.grad.float() - ref[1]).norm()
                                                    / ref[1].norm())}
        print(f"E={E} {impl:>11}: {out[impl]['ms']:.2f} ms  err {err:.1e}", flush=True)
    return out


def model(kind: str) -> dict:
    import transformers

    import meshlab as ml

    common = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
                  attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "dense":
        cfg = transformers.LlamaConfig(intermediate_size=5632, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.MixtralConfig(intermediate_size=2816, num_local_experts=8,
                                         num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
    with torch.device("cuda"):
        m = cls(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in m.parameters())
    if kind != "dense":
        m.config._experts_implementation = "grouped_mm"
    if kind == "moe_meshlab":
        m = ml.parallelize(m, ml.expert_route("ep"), ml.Mesh(ep=1), seed=0)
    if kind in ("moe_meshlab_compile", "moe_meshlab_compile_step",
                "moe_meshlab_compile_fusedadamw"):  # blocks compiled, nothing fused
        m = ml.parallelize(m, ml.expert_route("ep") | ml.compile_blocks(), ml.Mesh(ep=1), seed=0)
    if kind.startswith("moe_meshlab_compile_fuse_"):  # compiled blocks, some ops fused
        ops = kind[len("moe_meshlab_compile_fuse_"):].split("+")
        m = ml.parallelize(m, ml.expert_route("ep") | ml.fuse(*ops) | ml.compile_blocks(),
                           ml.Mesh(ep=1), seed=0)
    if kind in ("moe_meshlab_fused", "moe_meshlab_best", "moe_meshlab_fused_torch_adamw"):
        # norms, rotary, attention fused
        spec = ml.expert_route("ep") | ml.fuse("rms_norm", "rotary", "attention") | \
            ml.compile_blocks()          # compiled around the expert dispatch
        m = ml.parallelize(m, spec, ml.Mesh(ep=1), seed=0)
    if kind in ("moe_hf_compile", "moe_hf_best"):  # the peer's best: each layer compiled
        for layer in m.model.layers:
            layer.compile()
    # One optimizer for all three (torch's fused and foreach kernels refuse a list mixing
    # DTensor expert weights and plain dense ones).
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    if kind in ("moe_meshlab_best", "moe_meshlab_compile_step",
                "moe_meshlab_compile_fusedadamw"):
        from meshlab.ops import FusedAdamW

        if kind == "moe_meshlab_compile_step":      # ml.step, torch's fused AdamW
            opt = ml.optimizer(m, torch.optim.AdamW, lr=1e-5, fused=True)
            optimizer = "torch AdamW(fused=True) through ml.step"
        else:
            opt = ml.optimizer(m, FusedAdamW, lr=1e-5)
            optimizer = "meshlab FusedAdamW through ml." + (
                "step" if kind == "moe_meshlab_best" else "optimizer, a plain loop")

        if kind == "moe_meshlab_compile_fusedadamw":
            def step():
                loss = ml.losses.causal_lm_loss(m(input_ids=ids), batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            def step():
                ml.step(m, opt, batch)
    else:
        fused = kind in ("moe_hf_best", "moe_meshlab_fused_torch_adamw",
                         "moe_meshlab_compile") or kind.startswith("moe_meshlab_compile_fuse_")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=False, fused=fused)
        optimizer = f"torch AdamW({'fused=True' if fused else 'foreach=False'})"

        def step():
            loss = ml.losses.causal_lm_loss(m(input_ids=ids), batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def fwd_bwd():
        loss = ml.losses.causal_lm_loss(m(input_ids=ids), {"input_ids": ids, "labels": ids})
        loss.backward()
        opt.zero_grad(set_to_none=True)

    ms = _time(step, 10)
    res = {"params": n_params, "optimizer": optimizer, "ms_per_step": ms,
           "tokens_per_s": ids.numel() / (ms / 1e3),
           "fwd_bwd_ms": _time(fwd_bwd, 10),
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
    print(kind, json.dumps(res), flush=True)
    del m, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return res


def _row(kind: str) -> dict:
    """``model(kind)``, or the error it raised (the other rows still run). Each row starts
    from an empty dynamo cache: the rows' decoder layers share one code object, whose
    recompile limit an earlier row's entries would otherwise use up (a row over it runs
    eager without saying so, or fails under fullgraph)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        return model(kind)
    except Exception as e:
        print(kind, "failed:", traceback.format_exc()[-2000:], flush=True)
        torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


ROWS = ("dense", "moe_hf", "moe_hf_compile", "moe_meshlab", "moe_meshlab_fused",
        "moe_meshlab_compile", "moe_meshlab_compile_step", "moe_meshlab_compile_fusedadamw",
        "moe_meshlab_fused_torch_adamw", "moe_hf_best", "moe_meshlab_best")


def main() -> None:
    """``--only a,b``: those model rows alone (no block rows), for a short run."""
    import torch.distributed as dist
    import transformers

    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    extra = tuple(k for k in only or () if k.startswith("moe_meshlab_compile_fuse_"))

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    dist.init_process_group("nccl", rank=0, world_size=1)
    out = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "CUDA events, median of 20 (block) / 10 (model) after 3 warm-ups; bf16",
           "block": {f"E{E}": block(E) for E in (8, 64)} if not only else {},
           "model": {k: _row(k) for k in ROWS + extra if not only or k in only}}
    best = out["model"]
    if all("tokens_per_s" in best.get(k, {}) for k in ("moe_hf_best", "moe_meshlab_best")):
        out["meshlab_best_vs_hf_best"] = (best["moe_meshlab_best"]["tokens_per_s"]
                                          / best["moe_hf_best"]["tokens_per_s"])
    copy = sys.argv[sys.argv.index("--copy-to") + 1] if "--copy-to" in sys.argv else None
    print(_results.write("moe_rows" if only else "moe", out["card"], out, copy))


if __name__ == "__main__":
    main()
