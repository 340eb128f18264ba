"""The family walk: which Hugging Face families train right under tensor parallelism.

A family "plans" once its ``base_model_tp_plan`` translates; it is *supported* only once
a parity run shows it trains to the single-process numbers. ``check_family`` is that run
for one family on a tiny config, on every rank of a tp=2 process group: one AdamW step of
the single-process model and of ``parallelize(model, shard(policy), Mesh(tp=2))``, the
loss, every gradient and every updated weight compared (float64). Its outcome is one of

- ``trained``: the numbers match;
- ``refused``: meshlab refused the layout with a typed error (the reason is its message);
- ``mismatch``: it ran and trained differently (the worst parameter is named);
- ``error``: an untyped exception inside the parallel run;
- ``unbuilt``: the walk could not build or run the tiny model on one process.

``support.json`` (next to this file) holds the outcome of every family, as the walk over
the installed transformers decided it (``tests/policies/test_family_walk_gloo.py`` runs it and
compares); ``policies.auto`` lets only ``trained`` families through.
"""

from __future__ import annotations

import pathlib

import torch

from ..core.errors import MeshlabError
from ..policies import _support
from . import tiny as _tiny

SUPPORT = _support.PATH
# (atol, rtol) in float64, where a different reduction order moves the 15th digit: a
# missing or doubled reduction, or a wrong slice, is off by far more
TOLS = dict(loss=(1e-9, 1e-7), grad=(1e-9, 1e-7), weight=(1e-9, 1e-7))
# A family whose forward casts to float32 on its own (a router's softmax in float32):
# the parallel run sums those float32 partials in another order, which moves the 8th
# digit. Float32 tolerances there, still far below a missing or doubled reduction. Adam's
# first step is lr·g/(|g|+eps): where |g| is within the gradient tolerance of zero, that
# rounding may flip the update's sign (moves it by up to 2·lr), so such elements are
# judged by their gradient alone; elsewhere the update moves by lr·|dg|/|g| <= 1e-5,
# far below the lr (1e-3) a wrong update moves it by, so weights get 1e-4.
TOLS_FP32 = dict(loss=(1e-7, 1e-5), grad=(1e-7, 1e-5), weight=(1e-4, 1e-5), settled=1e-5)


def tp_plan_families() -> list[str]:
    """Every model_type of the installed transformers whose config has a tp plan."""
    from transformers import CONFIG_MAPPING

    out = []
    for mt in CONFIG_MAPPING.keys():
        try:
            plan = getattr(CONFIG_MAPPING[mt](), "base_model_tp_plan", None)
        except Exception:               # a config that cannot be built with defaults
            continue
        if plan:
            out.append(mt)
    return sorted(out)


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    if not isinstance(e, (MeshlabError, _tiny.TinyConfigError)):   # where it came from
        import traceback

        last = traceback.extract_tb(e.__traceback__)[-1:]
        for f in last:
            msg += f" (at {pathlib.Path(f.filename).name}:{f.lineno} in {f.name})"
    return (msg[:limit] + " ...") if len(msg) > limit else msg


def _one_step(model, ids, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = _tiny.loss(model, model(input_ids=ids), ids)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    opt.step()
    return loss.detach(), grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _float32_inside(model, ids) -> bool:
    """Whether the float64 model's forward computes any float32 tensor itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    Watch.seen = True
            return out

    with torch.no_grad(), Watch():
        model(input_ids=ids)
    return Watch.seen


def _compare(loss, grads, model, ref_loss, ref_grads, ref, tols=TOLS) -> str | None:
    """The first disagreement with the single process, or None."""
    if not torch.allclose(loss, ref_loss, *tols["loss"][::-1]):
        return f"loss {loss.item():.6g} vs {ref_loss.item():.6g} on one process"
    refp = dict(ref.named_parameters())
    for n, g in ref_grads.items():
        if n not in grads:
            return f"no gradient for {n}"
        if not torch.allclose(grads[n], g, *tols["grad"][::-1]):
            return f"gradient of {n} off by {(grads[n] - g).abs().max().item():.3g}"
    for n, p in model.named_parameters():
        w, r = _full(p.detach()), refp[n].detach()
        if "settled" in tols and n in ref_grads:     # elements whose update is defined
            keep = ref_grads[n].abs() > tols["settled"]
            w, r = w[keep], r[keep]
        if not torch.allclose(w, r, *tols["weight"][::-1]):
            return f"weight {n} off by {(w - r).abs().max().item():.3g} after one step"
    return None


def check_family(rank: int, world: int, model_type: str) -> dict:
    """One parity step of ``model_type`` at tp=``world`` in float64; see the module
    docstring."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _check(model_type, world)
    finally:
        torch.set_default_dtype(before)


def _check(model_type: str, world: int) -> dict:
    from ..apply.materialize import init_weights
    from ..apply.parallelize import parallelize
    from ..core.errors import MeshlabError
    from ..core.mesh import Mesh
    from ..core.rules import Rules
    from ..policies._registry import get
    from ..transforms.shard import shard

    ids = _tiny.batch()
    try:
        ref = init_weights(_tiny.build(model_type), seed=0)
        torch.manual_seed(1)             # the same draws where the forward samples
        ref_loss, ref_grads = _one_step(ref, ids)
    except Exception as e:
        return {"outcome": "unbuilt", "reason": _short(e)}
    rules = Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
    try:
        meta = _tiny.build(model_type)
        policy = get(model_type, dict(getattr(meta.config, "base_model_tp_plan", None) or {}))
        model = parallelize(meta, shard(policy, rules), Mesh(tp=world), seed=0)
    except MeshlabError as e:
        return {"outcome": "refused", "reason": f"{type(e).__name__}: {_short(e)}"}
    except Exception as e:
        return {"outcome": "error", "reason": f"{type(e).__name__}: {_short(e)}"}
    try:
        torch.manual_seed(1)
        loss, grads = _one_step(model, ids)
    except MeshlabError as e:
        return {"outcome": "refused", "reason": f"{type(e).__name__}: {_short(e)}"}
    except Exception as e:
        return {"outcome": "error", "reason": f"{type(e).__name__}: {_short(e)}"}
    bad = _compare(loss, grads, model, ref_loss, ref_grads, ref)
    if bad is None:
        return {"outcome": "trained"}
    if _float32_inside(ref, ids) and _compare(loss, grads, model, ref_loss, ref_grads, ref, TOLS_FP32) is None:
        return {"outcome": "trained", "tolerance": "float32",
                "reason": f"float64 tolerance missed ({bad}); the forward computes in "
                          f"float32 itself"}
    return {"outcome": "mismatch", "reason": bad}


def load() -> dict:
    """The recorded walk: ``{"transformers": version, "families": {type: outcome}}``."""
    return _support.load()
