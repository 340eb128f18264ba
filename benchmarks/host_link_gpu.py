"""The host link's bandwidth both ways (pinned host memory, a copy stream of its own), as
``remat(..., offload=k)`` uses it: ``python benchmarks/host_link_gpu.py [GiB]``."""

from __future__ import annotations

import sys

import torch


def main(gib: float = 1.0) -> None:
    n = int(gib * 2 ** 30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    for name, dst, src in (("device to host", host, dev), ("host to device", dev, host)):
        times = []
        for _ in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ms = sorted(times[1:])[len(times[1:]) // 2]
        print(f"{name}: {n / ms / 1e6:.1f} GB/s ({ms:.1f} ms for {gib} GiB, median of 5)")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
