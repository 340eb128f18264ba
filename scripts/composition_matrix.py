"""Measure what ``meshlab.plan`` does with every pair of rows of the composition table.

    python scripts/composition_matrix.py                 # every pair, a summary per pair
    python scripts/composition_matrix.py --json out.json # and every outcome as JSON
    python scripts/composition_matrix.py pipeline lora   # the pairs of these rows only
    python scripts/composition_matrix.py --page          # write docs/composition.md

Each pair of rows is planned on a fake mesh (``tests/transforms/_pairs.py`` spells the
rows: a small Llama, a small Qwen3-MoE where ``expert_route`` is in the pair, each
parallel axis of size 2, ``data_parallel('dp')`` added where it composes), and its outcome
recorded: ``runnable``, ``raises <Error>: <message>`` or ``not runnable: <message>``.
Where ``meshlab.transforms.composition`` holds a table, each outcome is held against the
cell's: a line starting with ``!`` is a pair the table describes wrongly.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def outcome(ctx) -> tuple[str, str]:
    """``('runnable' | 'raises' | 'not runnable', message)`` for one planning context."""
    from meshlab.core.errors import MeshlabError

    try:
        p = ctx.plan()
    except MeshlabError as e:
        return "raises", f"{type(e).__name__}: {e}"
    if p.not_runnable:
        return "not runnable", " | ".join(p.not_runnable)
    return "runnable", ""


def measure(rows: list[str] | None = None) -> list[dict]:
    """Every pair of ``rows`` (default: all), every context of each, with its outcome."""
    from tests.transforms import _pairs

    names = list(_pairs.ROWS)
    pick = set(rows or names)
    out = []
    for a, b in _pairs.pairs(names):
        if a not in pick and b not in pick:
            continue
        for ctx in _pairs.contexts(a, b):
            t = time.perf_counter()
            kind, msg = outcome(ctx)
            exp = ctx.expected()
            out.append({"pair": [a, b], "context": ctx.label, "mesh": ctx.mesh,
                        "family": ctx.family, "rows": list(ctx.rows), "outcome": kind,
                        "message": msg, "table": exp.outcome,
                        "agrees": exp.matches(kind, msg),
                        "seconds": round(time.perf_counter() - t, 2)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", help="measure only the pairs that hold these rows")
    ap.add_argument("--json", help="write every outcome to this file")
    ap.add_argument("--page", action="store_true",
                    help="write docs/composition.md from the table and stop")
    args = ap.parse_args(argv)
    if args.page:
        from meshlab.transforms import composition

        (ROOT / composition.PAGE).write_text(composition.page())
        print(f"wrote {composition.PAGE}")
        return 0
    recs = measure(args.rows or None)
    wrong = 0
    for r in recs:
        mark = " "
        if not r["agrees"]:
            mark, wrong = "!", wrong + 1
        a, b = r["pair"]
        print(f"{mark} {a} x {b} [{r['context']}]: {r['outcome']}"
              + (f" -- {r['message'][:200]}" if r["message"] else "")
              + (f"  (table: {r['table']})" if mark == "!" else ""), flush=True)
    by_pair: dict = {}
    for r in recs:
        by_pair.setdefault(tuple(r["pair"]), []).append(r["outcome"])
    ok = sum(1 for v in by_pair.values() if "runnable" in v)
    print(f"\n{len(by_pair)} pairs of {len({x for p in by_pair for x in p})} rows: {ok} plan "
          f"runnable in some context, {len(by_pair) - ok} refused or not runnable in every "
          f"one" + (f"; {wrong} outcomes differ from the table" if wrong else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(recs, indent=1) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
