"""Decoding on one GPU: meshlab.inference's engine against transformers' ``generate``
(dynamic cache; static cache with its automatic ``torch.compile``), in one run; the engine
eager, with CUDA graphs of its decode steps (``use_cuda_graph=True``), and with graphs and
the norms, rotary and MLP on meshlab's kernels (``use_cuda_kernel=True``, on a copy of the
model, which it routes); ``..._inorder`` reads each decode step's tokens before launching
the next (``engine.launch_ahead = False``), to show what launching ahead buys.

    python benchmarks/inference_gpu.py --shape llama-1b --batches 1,8,64
    python benchmarks/inference_gpu.py --shape llama3-8b --batches 1,64

Random bf16 weights of the named Llama shape, prompts of ``--prompt`` random tokens,
``--new`` tokens generated greedily with EOS disabled, so every path makes the same number
of tokens. Per path and batch: time to first token (a generate of one new token, which is
the prefill and one sampling), the whole generate of ``--new`` tokens, decode tokens/s
= batch x (new - 1) / (whole - first), and the steadier ``step_ms``: (whole - a generate
of new // 2 tokens) / (new - new // 2), the time of a late decode step with prefill and
call overheads cancelled (a slow first token raises the decode tokens/s above, not this);
``step_tokens_per_s`` = batch / step_ms. Each is the median of ``--repeats`` calls after one
warm-up call (which also compiles), timed with CUDA events around the call (host work
included: it is what a user waits for). At batch 1 the HBM bound is weights / bandwidth
per token (H200: 4.8 TB/s). Writes ``results/inference_<shape><tag>_<card>.json``.

``--profile B``: CUDA kernel time by name per decode step of the graphs-and-kernels
engine at batch B. ``--ops B``: the same engine run eagerly under the profiler with input
shapes, its operators by CUDA time (what a graph replay hides), printed and written
beside the JSON when ``--copy-to`` is given.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      tie_word_embeddings=False),
}
HBM_BYTES_PER_S = 4.8e12           # H200


def _timed(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _hf(model, ids, new: int, static: bool):
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    return lambda: model.generate(ids, **kw)


def _engine(model, ids, new: int, graphs: bool = False, kernels: bool = False):
    from meshlab.inference import InferenceConfig, InferenceEngine

    cfg = InferenceConfig(dtype=torch.bfloat16, max_batch_size=ids.shape[0],
                          max_input_len=ids.shape[1], max_output_len=new, ignore_eos=True,
                          use_cuda_graph=graphs, use_cuda_kernel=kernels,
                          max_context_len_to_capture=max(512, ids.shape[1] + new))
    engine = InferenceEngine(model, inference_config=cfg)
    prompts = ids.tolist()
    return engine, lambda n: (lambda: engine.generate(prompts=prompts, max_new_tokens=n))


def run_batch(model, batch: int, args) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device="cuda",
                        generator=g)
    rows = {}
    for name in args.paths:
        model.set_attn_implementation("sdpa")
        try:
            if name.startswith("meshlab_engine"):
                kernels = "kernels" in name           # routes the model it is given: a copy
                engine, make = _engine(copy.deepcopy(model) if kernels else model, ids,
                                       args.new, "graphs" in name, kernels)
                engine.launch_ahead = not name.endswith("_inorder")
                first, half, whole = (_timed(make(n), args.repeats)
                                      for n in (1, args.new // 2, args.new))
                del engine
            else:
                static = name == "hf_static_compile"
                first, half, whole = (_timed(_hf(model, ids, n, static), args.repeats)
                                      for n in (1, args.new // 2, args.new))
            # step_ms: the last new // 2 steps' time over their number (two generates of
            # one prompt, so prefill and call overheads cancel)
            step = (whole - half) / (args.new - args.new // 2)
            rows[name] = dict(ttft_ms=round(first, 2), generate_ms=round(whole, 2),
                              decode_tokens_per_s=round(batch * (args.new - 1) /
                                                        ((whole - first) / 1e3), 1),
                              step_ms=round(step, 3),
                              step_tokens_per_s=round(batch / (step / 1e3), 1))
        except Exception as e:             # a path that fails is reported, not hidden
            rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        gc.collect()
        torch.cuda.empty_cache()
        print(batch, name, rows[name], flush=True)
    return rows


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile(model, batch: int, args) -> dict:
    """Where a decode step's time goes on the graphs-and-kernels engine: CUDA kernel time
    by name over one generate of ``--new`` tokens (torch.profiler), per decode step.
    ``gpu_busy_ms`` sums the kernels' times; with programmatic dependent launch kernels
    overlap and each one's time includes its wait for the one before, so that sum
    overstates, and ``gpu_span_ms`` (the union of their intervals) is the GPU's busy
    time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    g = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device="cuda",
                        generator=g)
    engine, make = _engine(copy.deepcopy(model), ids, args.new, True, True)
    run = make(args.new)
    run()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b)
    kernels: dict[str, list] = {}
    spans = []
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3
            spans.append((e.time_range.start, e.time_range.end))
    steps = args.new - 1
    busy = sum(v[1] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    del engine
    return {"batch": batch, "generate_ms": round(wall, 2), "gpu_busy_ms": round(busy, 2),
            "gpu_span_ms": round(_union_us(spans) / 1e3, 2),
            "kernels_per_step": round(sum(v[0] for v in kernels.values()) / steps, 1),
            "top_per_step": {k: {"launches": round(v[0] / steps, 2), "ms": round(v[1] / steps, 4)}
                             for k, v in top}}


def ops(model, batch: int, args) -> str:
    """The aten operators of the kernels engine's decode steps by CUDA time and input
    shapes, run eagerly (no graphs) so the profiler sees each operator: a table that says
    which copies, casts and products a step spends its time on."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    g = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device="cuda",
                        generator=g)
    engine, make = _engine(copy.deepcopy(model), ids, 9, False, True)
    run = make(9)
    run()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
              record_shapes=True) as p:
        run()
        torch.cuda.synchronize()
    del engine
    table = p.key_averages(group_by_input_shape=True).table(
        sort_by="self_device_time_total", row_limit=40, max_name_column_width=40,
        max_shapes_column_width=90)
    return f"batch {batch}, prefill + 8 decode steps\n{table}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="hf_dynamic,hf_static_compile,meshlab_engine,"
                                        "meshlab_engine_graphs,meshlab_engine_graphs_kernels,"
                                        "meshlab_engine_graphs_kernels_inorder")
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--profile", default="", help="batches to profile (graphs + kernels)")
    ap.add_argument("--ops", default="", help="batches whose eager decode operators to list")
    args = ap.parse_args()
    args.paths = args.paths.split(",")
    import transformers
    import triton

    from meshlab.ops import _triton

    cfg = transformers.LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"card": torch.cuda.get_device_name(), "shape": args.shape,
           "date": datetime.date.today().isoformat(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "triton": triton.__version__},
           "programmatic_dependent_launch": _triton.pdl(torch.device("cuda", 0)),
           "prompt_tokens": args.prompt, "new_tokens": args.new, "repeats": args.repeats,
           "weight_bytes": weights,
           "hbm_bound_tokens_per_s_batch1": round(HBM_BYTES_PER_S / weights, 1),
           "batches": {}}
    for b in (int(x) for x in args.batches.split(",") if x):
        out["batches"][str(b)] = run_batch(model, b, args)
    for b in (int(x) for x in args.profile.split(",") if x):
        out.setdefault("profile", []).append(profile(model, b, args))
        print(out["profile"][-1], flush=True)
    for b in (int(x) for x in args.ops.split(",") if x):
        text = ops(model, b, args)
        print(text, flush=True)
        if args.copy_to:
            Path(args.copy_to, f"ops_{args.shape}_b{b}.txt").write_text(text)
    if out["batches"]:
        print(_results.write(f"inference_{args.shape}{args.tag}", out["card"], out, args.copy_to))


if __name__ == "__main__":
    main()
