"""How long an asynchronous checkpoint keeps the step waiting: copying the state from the
GPU to host memory before ``meshlab.checkpoint.save(async_save=True)`` returns.

A Llama-1B-sized state (bf16 weights, fp32 AdamW moments: 16 tensors of 64 Mi elements
each, 3 GiB), staged three ways: meshlab's per-tensor copy (``t.to('cpu', copy=True)``,
pageable memory, one blocking copy each); pinned buffers allocated once and filled with
non-blocking copies and one synchronization; and DCP's ``DefaultStager`` with pinned
buffers and non-blocking copies (its first call allocates and pins; later calls reuse),
or the error it raises on this torch. Wall-clock milliseconds (the copies end on the
host), median of 5 after 1 warm-up. Writes ``benchmarks/results/stage_<card>.json``.

    python benchmarks/stage_gpu.py [--copy-to DIR]
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402


def _ms(fn, n: int = 5) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    n = 64 * 2 ** 20
    state = {f"w{i}": torch.randn(n, device="cuda", dtype=torch.bfloat16) for i in range(4)}
    state.update({f"m{i}": torch.randn(n, device="cuda") for i in range(12)})
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 2 ** 30

    def old():
        return {k: t.detach().to("cpu", copy=True) for k, t in state.items()}

    old()                                               # warm-up
    old_ms = _ms(old)

    bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}

    def pinned():                  # hand-written: pinned buffers kept, one synchronization
        for k, t in state.items():
            bufs[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return bufs

    pinned()
    assert all(torch.equal(bufs[k], state[k].cpu()) for k in state)
    pinned_ms = _ms(pinned)
    del bufs
    stager_row: dict = {}
    try:
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=False,
                                              use_non_blocking_copy=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = stager.stage(state)
        stager_row["first_ms"] = (time.perf_counter() - t0) * 1e3
        assert all(torch.equal(first[k], state[k].cpu()) for k in state)
        stager_row["reused_ms"] = statistics.median(_ms(lambda: stager.stage(state)))
    except Exception as e:         # recorded: which torch's stager cannot stage this state
        import traceback

        stager_row["error"] = f"{type(e).__name__}: {e}"
        stager_row["traceback"] = traceback.format_exc()[-3000:]
    out = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "wall-clock ms of staging the whole state, median of 5 after 1 warm-up",
           "state_GiB": gib, "tensors": len(state),
           "per_tensor_to_cpu_ms": statistics.median(old_ms),
           "pinned_reused_ms": statistics.median(pinned_ms),
           "default_stager": stager_row,
           "runs": {"per_tensor_to_cpu": old_ms, "pinned_reused": pinned_ms}}
    copy = sys.argv[sys.argv.index("--copy-to") + 1] if "--copy-to" in sys.argv else None
    print({k: v for k, v in out.items() if k != "runs"}, flush=True)
    print(_results.write("stage", out["card"], out, copy))


if __name__ == "__main__":
    main()
