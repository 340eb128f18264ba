"""How the GPU benchmarks time a step: CUDA events around each call, after the caller's
warm-up, with the peak memory counter reset first (METHOD.md of the device tool)."""

from __future__ import annotations


def cuda_times(fn, n: int) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``fn`` (CUDA events; the peak-memory counter
    is reset before the first, so ``max_memory_allocated`` afterwards is theirs)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def median_ms(fn, sets, reps: int, warmup: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (CUDA events), after ``warmup``
    calls; call ``i`` gets the arguments ``sets[i % len(sets)]``, so that inputs rotate
    and no call reads the last one's cache."""
    import statistics

    import torch

    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
