"""Where one training step's GPU time goes: a ``torch.profiler`` trace of rows of
``single_gpu.py``, kernel time summed by kind.

For each row: two profiled steps after the warm-up; the CUDA kernels' total time grouped into
matmul, attention, meshlab's Triton kernels, other elementwise/reduction kernels, copies and
the optimizer, the top kernels by time, and the step's wall time (so busy / wall shows how
much of the step the GPU waits on the host). Writes
``benchmarks/results/profile_step_<shape>_<card>.json``.

    python benchmarks/profile_step.py --shape tinyllama --rows meshlab_fuse,hf_liger
    python benchmarks/profile_step.py --rows meshlab_fuse --ops --tag _ops   # + operators
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import single_gpu  # noqa: E402

KINDS = (  # first match wins; lower-case substrings of the kernel name
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "memcpy", "cat", "fill", "memset")),
    ("meshlab_triton", ("_rms_norm", "_rotary", "_swiglu", "_ce_grad", "_layer_norm")),
)


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(s in low for s in keys):
            return k
    return "other"


def _annotation(name: str) -> bool:
    """A user range the profiler mirrors on the GPU timeline (the optimizer's step), not a
    kernel: counting it would count its kernels twice."""
    return name.startswith("Optimizer.") or name.startswith("ProfilerStep")


def idle_gaps(prof, steps: int, top: int = 12) -> dict:
    """The GPU's idle time between consecutive kernels (over 5 us), per step, with the
    longest gaps and the kernels on either side, and the host's synchronizing calls."""
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not _annotation(e.name)),
                key=lambda e: e.time_range.start)
    gaps = []
    for a, b in zip(ks, ks[1:]):
        g = b.time_range.start - a.time_range.end
        if g > 5:
            gaps.append((g, a.name, b.name))
    syncs = collections.Counter(e.name for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CPU and
                                ("Synchronize" in e.name or e.name == "aten::_local_scalar_dense"
                                 or e.name == "aten::item"))
    gaps.sort(key=lambda t: -t[0])
    return {"idle_ms": sum(g for g, _, _ in gaps) / 1e3 / steps, "gaps": len(gaps) / steps,
            "syncs": dict(syncs),
            "longest": [{"us": g, "after": a[:90], "before": b[:90]} for g, a, b in gaps[:top]]}


def op_table(prof, steps: int, top: int = 30) -> list[dict]:
    """The operators whose own kernels took the most GPU time per step, by name and input
    shapes (which add, which copy): what the kernel list cannot say."""
    rows = [a for a in prof.key_averages(group_by_input_shape=True)
            if a.key.startswith("aten::") and a.self_device_time_total > 0]
    rows.sort(key=lambda a: -a.self_device_time_total)
    return [{"op": a.key, "shapes": str(a.input_shapes)[:120],
             "ms": a.self_device_time_total / 1e3 / steps, "calls": a.count / steps}
            for a in rows[:top]]


def profile_row(name: str, base, batch, steps: int, warmup: int, checkpointing: bool,
                ops: bool = False) -> dict:
    import copy

    from torch.profiler import ProfilerActivity, profile

    model = copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable()
    step = single_gpu._step_fn(name, model, batch)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                 record_shapes=ops) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    per_kernel: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not _annotation(e.name):
            per_kernel[e.name][0] += e.device_time_total / 1e3 / steps
            per_kernel[e.name][1] += 1
    gaps = idle_gaps(prof, steps)
    by_kind: dict[str, float] = collections.defaultdict(float)
    for k, (ms, _) in per_kernel.items():
        by_kind[kind(k)] += ms
    busy = sum(by_kind.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:40]
    del model, step
    return {**({"ops": op_table(prof, steps)} if ops else {}),
            "wall_ms": wall * 1e3, "gpu_busy_ms": busy, "by_kind_ms": dict(by_kind),
            "kernels_per_step": sum(c for _, c in per_kernel.values()) / steps,
            "idle": gaps,
            "top": [{"kernel": k[:160], "ms": ms, "calls": c / steps, "kind": kind(k)}
                    for k, (ms, c) in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(single_gpu.SHAPES), default="tinyllama")
    ap.add_argument("--rows", default="meshlab_fuse,hf_liger")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--ops", action="store_true",
                    help="also list operators by input shapes (slows the profiled steps)")
    args = ap.parse_args()
    import transformers

    shape = single_gpu.SHAPES[args.shape]
    base, batch = single_gpu.build(shape)
    out = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": args.shape, "method": f"torch.profiler, {args.steps} steps after "
           f"{args.warmup} warm-up; CUDA kernel time per step summed by kind", "rows": {}}
    for name in args.rows.split(","):
        r = profile_row(name, base, batch, args.steps, args.warmup, shape["checkpointing"],
                        args.ops)
        out["rows"][name] = r
        print(f"{name}: wall {r['wall_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms, "
              f"{r['kernels_per_step']:.0f} kernels; "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["by_kind_ms"].items())), flush=True)
        print(f"   idle {r['idle']['idle_ms']:.1f} ms in {r['idle']['gaps']:.0f} gaps; syncs "
              f"{r['idle']['syncs']}")
        for g in r["idle"]["longest"]:
            print(f"   gap {g['us']:8.0f} us after {g['after'][:50]} before {g['before'][:50]}")
        for t in r["top"][:25]:
            print(f"   {t['ms']:8.2f} ms {t['calls']:6.0f}x {t['kind']:>14}  {t['kernel'][:100]}")
        for t in r.get("ops", []):
            print(f"   {t['ms']:8.2f} ms {t['calls']:6.0f}x {t['op']:>24}  {t['shapes']}")
        gc.collect()
        torch.cuda.empty_cache()
    path = _results.write(f"profile_step_{args.shape}{args.tag}", out["card"], out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
