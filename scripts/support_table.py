"""Run the family walk on 2 gloo processes and write ``meshlab/policies/support.json``.

    python scripts/support_table.py            # every family with a tp plan
    python scripts/support_table.py llama qwen2

Each family is one parity step at tp=2 (``meshlab.testing.walk.check_family``); a
family that hangs is recorded as an error and the processes are restarted.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(families: list[str], timeout: float = 60) -> dict:
    from meshlab.testing import walk
    from tests._world import World

    out, world = {}, World(2)
    try:
        for i, mt in enumerate(families):
            t = time.perf_counter()
            try:
                res = world.run(walk.check_family, timeout=timeout, model_type=mt)
                o = res[0] if all(r == res[0] for r in res) else {
                    "outcome": "error", "reason": f"ranks disagree: {res}"}
            except Exception as e:
                o = {"outcome": "error", "reason": " ".join(str(e).split())[:300]}
                world.close(force=True)
                world = World(2)
            out[mt] = o
            print(f"[{i + 1}/{len(families)}] {mt}: {o['outcome']} "
                  f"({time.perf_counter() - t:.1f} s) {o.get('reason', '')[:160]}", flush=True)
    finally:
        world.close()
    return out


def main(argv: list[str]) -> None:
    import transformers

    from meshlab.testing import walk

    families = argv or walk.tp_plan_families()
    results = run(families)
    data = walk.load() if argv else {"families": {}}
    data["transformers"] = transformers.__version__
    data["families"] = dict(sorted({**data["families"], **results}.items()))
    walk.SUPPORT.write_text(json.dumps(data, indent=1) + "\n")
    counts: dict = {}
    for o in data["families"].values():
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1:])
