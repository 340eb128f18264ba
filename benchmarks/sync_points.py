"""Where a training step makes the host wait for the GPU: each synchronizing call of one
step of rows of ``single_gpu.py``, with the Python frames that made it.

torch's CUDA sync debug mode (``torch.cuda.set_sync_debug_mode('warn')``) warns at every
call that synchronizes the host with the device (``.item()``, a device-to-host copy, a
nonzero, ...). For each row: the warm-up steps, then one step with the mode on; each
warning is kept with the innermost frames of meshlab, transformers and this script's
rows (torch's own frames left out), counted by where it came from. A compiled step's
idle gaps that eager's does not have show up as sync points only one row has.
Writes ``benchmarks/results/sync_points_<shape><tag>_<card>.json``.

    python benchmarks/sync_points.py --rows meshlab_step,meshlab_blocks
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import single_gpu  # noqa: E402

_OWN = ("/meshlab/", "/transformers/", "/benchmarks/")


def _where(stack) -> str:
    """The innermost frames of meshlab, transformers or the benchmarks, innermost first."""
    frames = [f for f in reversed(stack) if any(s in f.filename for s in _OWN)]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[:4]) \
        or "(torch only)"


def sync_points(step) -> dict:
    """{where: count} of the synchronizing calls of one call of ``step``."""
    seen: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def keep(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):
            seen[f"{str(message).splitlines()[0][:80]} @ {_where(traceback.extract_stack())}"] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return dict(seen.most_common())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(single_gpu.SHAPES), default="tinyllama")
    ap.add_argument("--rows", default="meshlab_step,meshlab_blocks")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    shape = dict(single_gpu.SHAPES[args.shape])
    base, batch = single_gpu.build(shape)
    out = {}
    for name in args.rows.split(","):
        step = single_gpu._row(name, base, batch, shape)[0]
        for _ in range(args.warmup):
            step()
        points = sync_points(step)
        out[name] = {"syncs": sum(points.values()), "where": points}
        print(f"{name}: {out[name]['syncs']} synchronizing calls a step", flush=True)
        for where, n in points.items():
            print(f"  {n:3d}  {where}", flush=True)
        step = None
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_properties(0)
    result = {"card": dev.name, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "shape": args.shape, "method": f"one step after {args.warmup} warm-up steps "
              f"under torch.cuda.set_sync_debug_mode('warn')", "rows": out}
    print(f"wrote {_results.write(f'sync_points_{args.shape}{args.tag}', dev.name, result, args.copy_to)}")


if __name__ == "__main__":
    main()
