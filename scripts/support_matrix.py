"""The support table: each named family under each layout, decided by a parity run.

    python scripts/support_matrix.py            # writes docs/support.md and its JSON
    python scripts/support_matrix.py --resume   # keeps the cells the JSON already has

Every cell trains the family's tiny config 2 SGD steps with ``ml.step`` on 4 gloo
processes and compares the losses and the final weights with the single process
(float64; the fused ops in float32). A cell is ``y`` when they match; a typed refusal
from ``plan``/``parallelize`` gives ``refused`` with meshlab's reason; anything else is
``fails`` with what went wrong. The family walk's outcomes (``support.json``, every
family with a ``base_model_tp_plan``) are summarized below the table.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# family -> (test data module, entry)
ROWS = {
    "bert": "decoder", "llama": "decoder", "t5": "encdec", "gpt2": "decoder",
    "gptj": "decoder", "vit": "vision", "opt": "decoder", "bloom": "decoder",
    "whisper": "encdec", "sam": "vision", "blip-2": "vision", "falcon": "decoder",
    "mistral": "decoder", "qwen2": "decoder", "qwen3": "decoder", "gemma": "decoder",
    "cohere": "decoder",
    "mixtral": "decoder", "deepseek_v3": "decoder",
}
COLUMNS = ("TP", "TP+SP", "PP", "Ulysses", "ring", "ZeRO-3", "fuse")
SAVED = ROOT / "docs" / "support_matrix.json"


def _layout(column: str):
    import meshlab as ml

    from tests import _models as M

    rules = ml.Rules(**M.TP_RULES)
    return {
        "TP": (ml.shard(ml.policies.auto, rules), ml.Mesh(dp=2, tp=2)),
        "TP+SP": (ml.shard(ml.policies.auto, rules | ml.Rules(seq="tp")), ml.Mesh(dp=2, tp=2)),
        "PP": (ml.pipeline("pp", microbatches=2) | ml.data_parallel("dp"), ml.Mesh(dp=2, pp=2)),
        "Ulysses": (ml.sequence("sp", "all_to_all") | ml.data_parallel("dp"),
                    ml.Mesh(dp=2, sp=2)),
        "ring": (ml.sequence("sp", "ring") | ml.data_parallel("dp"), ml.Mesh(dp=2, sp=2)),
        "ZeRO-3": (ml.zero_shard(3, "dp"), ml.Mesh(dp=4)),
    }[column]


def _fused_ops(fam) -> tuple[str, ...]:
    """The ops of ``fuse()`` that route in this family (the loss aside: the cells pass
    the family's loss function), each routed on a meta copy of the model."""
    import meshlab as ml
    from meshlab.transforms.fuse._hf import FUSABLE, fuse as route

    from tests import _families as F

    ok = []
    for op in FUSABLE:
        if op == "loss":
            continue
        try:
            route(F.build(fam), (op,))
            ok.append(op)
        except ml.MeshlabError:
            pass
    return tuple(ok)


def _short(e: BaseException, limit: int = 240) -> str:
    msg = f"{type(e).__name__}: " + " ".join(str(e).split())
    return msg[:limit] + (" ..." if len(msg) > limit else "")


def cell_case(rank, world, module, name, column, steps=2, lr=0.1):
    """One cell in float64 (the fused ops' cells in float32: their kernels are for the
    training dtypes), so a mismatch is a wrong layout, not rounding amplified by Adam."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if column == "fuse" else torch.float64)
    try:
        return _cell(module, name, column, steps, lr)
    finally:
        torch.set_default_dtype(before)


def _cell(module, name, column, steps, lr):
    import torch
    import torch.distributed as dist

    import meshlab as ml

    from tests import _families as F, _models as M

    fam = F.family(module, name)
    data = F._batches(fam, steps, 4)
    ref = ml.init_weights(_build(fam), seed=0)
    state = None
    if fam.post_init is not None:
        with torch.no_grad():
            fam.post_init(ref)
        state = ref_state(fam, ref)     # the parallel model starts from these weights
    opt_r = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_losses = []
    for b in data:
        loss = fam.loss(F._call(ref, fam, b), b)
        loss.backward()
        opt_r.step()
        opt_r.zero_grad()
        ref_losses.append(loss.item())
    if column == "fuse":
        ops = _fused_ops(fam)
        if not ops:
            return {"cell": "refused", "reason": "no op of fuse() routes in this family"}
        spec, mesh = ml.fuse(*ops) | ml.zero_shard(3, "dp"), ml.Mesh(dp=4)
    else:
        spec, mesh = _layout(column)
    try:
        model = ml.parallelize(_build(fam), spec, mesh, seed=0, state_dict=state)
    except ml.MeshlabError as e:
        return {"cell": "refused", "reason": _short(e)}
    try:
        opt = ml.optimizer(model, torch.optim.SGD, lr=lr)
        losses = [_step(model, opt, fam, b) for b in data]
        f32 = column == "fuse"
        # float64 and SGD (Adam would blow a zero gradient's float32 noise, as ring
        # attention's running softmax leaves on a key bias, up to a whole step): 1e-7 on
        # the loss and 1e-6 on weights catch a wrong layout, which moves them by far more
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   atol=1e-5 if f32 else 1e-7, rtol=1e-3 if f32 else 1e-6)
        M.assert_weights_match(model, ref, *((1e-4, 1e-3) if f32 else (1e-6, 1e-5)))
    except ml.MeshlabError as e:
        return {"cell": "refused", "reason": _short(e)}
    except Exception as e:
        return {"cell": "fails", "reason": _short(e)}
    return {"cell": "y", "ops": list(ops)} if column == "fuse" else {"cell": "y"}


def _build(fam):
    """The family's model; experts as their loop of matmuls (torch's grouped_mm, the
    default, takes no float64)."""
    from tests import _families as F

    model = F.build(fam)
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model


def ref_state(fam, ref):
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _step(model, opt, fam, batch) -> float:
    """``ml.step`` for the text families (it passes every key but labels to the model);
    the family's own call for models that take other inputs."""
    import torch
    import torch.distributed as dist

    import meshlab as ml

    from tests import _families as F

    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    local = {k: v.chunk(rt.dp_size)[dp_rank] for k, v in batch.items()}
    if fam.inputs is None:
        return ml.step(model, opt, local, fam.loss)
    loss = fam.loss(F._call(model, fam, local), local)
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = torch.tensor([loss.item()], dtype=torch.float64)
    if rt.dp_group is not None:
        dist.all_reduce(t, group=rt.dp_group)
    return float(t) / rt.dp_size


def run(done: dict) -> dict:
    """Every cell not in ``done``; the fuse cells last (fuse routes modules' attention
    and rotary functions, which the other cells of a process should not meet). Results
    are saved after every cell, so a run picks up where the last one stopped."""
    from tests._world import World

    out, world = {f: dict(c) for f, c in done.items()}, World(4)
    cells = [(f, c) for c in COLUMNS if c != "fuse" for f in ROWS] + \
        [(f, "fuse") for f in ROWS]
    try:
        for fam, col in cells:
            if col in out.get(fam, {}):
                continue
            t = time.perf_counter()
            try:
                res = world.run(cell_case, timeout=300, module=f"tests._fam_{ROWS[fam]}",
                                name=fam, column=col)
                kinds = {r["cell"] for r in res}
                o = res[0] if len(kinds) == 1 else {
                    "cell": "fails", "reason": f"ranks differ: {sorted(kinds)}"}
            except Exception as e:
                o = {"cell": "fails", "reason": _short(e)}
                world.close(force=True)
                world = World(4)
            out.setdefault(fam, {})[col] = o
            SAVED.write_text(json.dumps(out, indent=1) + "\n")
            print(f"{fam:12s} {col:8s} {o['cell']:8s} ({time.perf_counter() - t:.1f} s) "
                  f"{o.get('reason', '')[:120]}", flush=True)
    finally:
        world.close()
    return {f: {c: out[f][c] for c in COLUMNS} for f in ROWS}


def table(matrix: dict) -> str:
    from meshlab.policies import _support

    lines = ["| family | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    notes: list[str] = []
    for fam, cells in matrix.items():
        row = []
        for col in COLUMNS:
            c = cells[col]
            if c["cell"] == "y":
                row.append("y" + (f" ({', '.join(c['ops'])})" if c.get("ops") else ""))
            else:
                notes.append(f"{fam} / {col}: {c['reason']}")
                row.append(f"{c['cell']} [{len(notes)}]")
        lines.append(f"| {fam} | " + " | ".join(row) + " |")
    lines += ["", "Reasons:", ""] + [f"{i + 1}. {n}" for i, n in enumerate(notes)]
    walked = _support.load()
    counts: dict = {}
    for o in walked["families"].values():
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    lines += ["", f"## Every family with a `base_model_tp_plan` (transformers "
              f"{walked['transformers']})", "",
              "One parity step at tp=2 each (`tests/policies/test_family_walk_gloo.py` runs it in CI "
              "and holds it equal to `meshlab/policies/support.json`); `policies.auto` "
              "lets only `trained` through and refuses the rest with the reason shown. "
              + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ".", "",
              "| family | outcome | reason |", "|---|---|---|"]
    for mt, o in walked["families"].items():
        reason = o.get("reason", "").replace("|", "\\|")
        tol = " (float32 tolerance)" if o.get("tolerance") == "float32" else ""
        lines.append(f"| {mt} | {o['outcome']}{tol} | {reason[:160]} |")
    return "\n".join(lines) + "\n"


HEAD = """# Support table

Generated by `python scripts/support_matrix.py` (do not edit): each cell is a parity run of
the family's tiny config on 4 gloo processes (2 SGD steps at lr 0.1, losses and final weights
against the single process; float64 (losses to 1e-7, weights to 1e-6), the fuse column in
float32 at the parity suite's tolerances). `y`: they match. `refused`: meshlab refuses the
layout with a typed error, before any collective (the reason is its message). `fails`:
it ran and did not match, or raised an untyped error.

Layouts: TP = `shard(policies.auto)` on dp=2 x tp=2; TP+SP adds `seq="tp"`; PP =
`pipeline(microbatches=2)` on dp=2 x pp=2; Ulysses and ring = `sequence("sp", ...)` on
dp=2 x sp=2 (with data parallelism over dp); ZeRO-3 on dp=4; fuse = `fuse(ops) |
zero_shard(3)` on dp=4 with the ops of `fuse()` that route in the family (shown; the
fused loss aside).

"""


def main() -> None:
    import torch
    import transformers

    done = json.loads(SAVED.read_text()) if "--resume" in sys.argv and SAVED.exists() else {}
    matrix = run(done)
    out = ROOT / "docs" / "support.md"
    meta = f"torch {torch.__version__}, transformers {transformers.__version__}, " \
           f"{time.strftime('%Y-%m-%d')}\n\n"
    out.write_text(HEAD + meta + table(matrix))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
