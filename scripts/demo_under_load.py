"""Run ``meshlab demo`` ``--runs`` times while ``--hogs`` processes keep every core busy,
and report each run's exit status and seconds: the demo's processes must start, train
and exit 0 every time under load (a slow rank must not turn into a timeout or a hang).

    python scripts/demo_under_load.py --runs 10 --hogs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path


def _hog(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x ^= i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    meshlab = Path(sys.executable).with_name("meshlab")
    stop = mp.Event()
    hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    runs = []
    try:
        for i in range(args.runs):
            t = time.monotonic()
            p = subprocess.run([str(meshlab), "demo", "--steps", str(args.steps)],
                               capture_output=True, text=True)
            runs.append({"run": i, "rc": p.returncode, "s": round(time.monotonic() - t, 1),
                         "tail": p.stderr[-300:] if p.returncode else ""})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    ok = sum(r["rc"] == 0 for r in runs)
    print(f"{ok} of {len(runs)} runs exited 0 under {args.hogs} busy processes")
    sys.exit(0 if ok == len(runs) else 1)


if __name__ == "__main__":
    main()
