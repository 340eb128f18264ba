"""``meshlab check``: build every kernel, validate every op, say what runs natively and why not.

For each op and device (the CPU, and CUDA when present) it runs the op once to see which
path it takes (native kernel or the PyTorch reference, with the reason), runs
``torch.library.opcheck`` on its custom ops, and compares forward and gradients with the
op's pure-PyTorch reference in float32 and bfloat16. The exit code is 0 when every check
that could run passed; a fallback is reported, not failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Relative error ||out - ref|| / ||ref|| allowed per dtype: float32 differs from the reference
# only by summation order; bfloat16 by at most one rounding of each output.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclass(slots=True)
class Row:
    op: str
    device: str
    native: bool = False
    reason: str = ""
    opcheck: str = "-"
    errors: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cases(op: str, dtype, device, small: bool = False):
    """Inputs for ``op``: (custom-op overloads with their args, public args, grad-able indices).

    Public args are tensors, or flags passed positionally after them (attention's ``causal``).

    Shapes are deliberately not multiples of a SIMD width, so tails are exercised.
    """
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    b, s, h = (2, 5, 67) if small else (3, 17, 300)
    if op == "rms_norm":
        x, w = r(b, s, h), r(h, dt=torch.float32)
        y, rstd = torch.ops.meshlab.rms_norm(x, w, 1e-6)
        return [(torch.ops.meshlab.rms_norm.default, (x, w, 1e-6)),
                (torch.ops.meshlab.rms_norm_backward.default, (torch.randn_like(y), x, w, rstd))
                ], (x, w), (0, 1)
    if op == "layer_norm":
        x, w, bias = r(b, s, h), r(h, dt=torch.float32), r(h, dt=torch.float32)
        y, mean, rstd = torch.ops.meshlab.layer_norm(x, w, bias, 1e-5)
        return [(torch.ops.meshlab.layer_norm.default, (x, w, bias, 1e-5)),
                (torch.ops.meshlab.layer_norm_backward.default,
                 (torch.randn_like(y), x, w, mean, rstd))], (x, w, bias), (0, 1, 2)
    if op in ("swiglu", "geglu"):
        a, bb = r(b, s, h), r(b, s, h)
        ops = getattr(torch.ops.meshlab, op), getattr(torch.ops.meshlab, f"{op}_backward")
        return [(ops[0].default, (a, bb)), (ops[1].default, (r(b, s, h), a, bb))], (a, bb), (0, 1)
    if op == "rotary":
        x = r(b, s, 3, 2 * (h // 10))
        angle = r(s, h // 10, dt=torch.float32)
        return [(torch.ops.meshlab.rotary.default, (x, angle.cos(), angle.sin()))], \
            (x, angle.cos(), angle.sin()), (0, 1, 2)
    if op == "linear_cross_entropy":
        hid, w = r(b * s, h // 10), r(h + 11, h // 10)
        t = torch.randint(0, h + 11, (b * s,), generator=g).to(device)
        t[::7] = -100                                   # some tokens not counted
        return [(torch.ops.meshlab.linear_cross_entropy.default, (hid, w, t, -100, 8, True))], \
            (hid, w, t), (0, 1)
    if op == "attention":
        # Grouped-query (4 query heads on 2 kv heads), causal, S not a multiple of the tiles;
        # opcheck also sees a non-causal call with Skv != S and an explicit scale.
        hq, hkv, sq, d = 4, 2, (19 if small else 37), 24
        q, k, v = r(b, hq, sq, d), r(b, hkv, sq, d), r(b, hkv, sq, d)
        k2, v2 = r(b, hkv, sq + 6, d), r(b, hkv, sq + 6, d)
        out, lse = torch.ops.meshlab.attention(q, k, v, True, d ** -0.5)
        return [(torch.ops.meshlab.attention.default, (q, k, v, True, d ** -0.5)),
                (torch.ops.meshlab.attention.default, (q, k2, v2, False, 0.3)),
                (torch.ops.meshlab.attention_backward.default,
                 (torch.randn_like(out), q, k, v, out, lse, True, d ** -0.5))], \
            (q, k, v, True), (0, 1, 2)
    raise KeyError(op)


def check_op(op: str, device: str, dtypes=("float32", "bfloat16"), run_opcheck: bool = True,
             small: bool = False) -> Row:
    import torch

    from . import OPS, _build

    fn, ref = OPS[op]
    row = Row(op, device)
    for dname in dtypes:
        dtype = getattr(torch, dname)
        calls, args, grad_idx = cases(op, dtype, device, small)
        if run_opcheck:
            for overload, oargs in calls:
                targs = tuple(a.detach().requires_grad_(a.is_floating_point() and
                                                        overload.name().endswith(op) and
                                                        i in grad_idx)
                              if isinstance(a, torch.Tensor) else a
                              for i, a in enumerate(oargs))
                try:
                    torch.library.opcheck(overload, targs)
                except Exception as e:  # opcheck raises many types; each is a failed check
                    row.failures.append(f"opcheck {overload.name()} {dname}: "
                                        f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        leaves = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(args)]           # non-tensors (flags) pass as they are
        out, want = fn(*leaves), ref(*leaves)
        path = _build.LAST_PATH.get((op, device))
        if dname == dtypes[0] and path is not None:   # the path the public op just took
            row.native, row.reason = path.native, path.reason
        gout = torch.randn_like(out)
        got_g = torch.autograd.grad(out, [leaves[i] for i in grad_idx], gout)
        want_g = torch.autograd.grad(want, [leaves[i] for i in grad_idx], gout)
        err = max([_rel(out, want)] + [_rel(a, b) for a, b in zip(got_g, want_g)])
        row.errors[dname] = err
        if not err <= TOLERANCE[dname]:       # also catches NaN
            row.failures.append(f"{dname}: relative error {err:.2e} > {TOLERANCE[dname]:.0e}")
    row.opcheck = "fail" if any(f.startswith("opcheck") for f in row.failures) else (
        "pass" if run_opcheck else "-")
    return row


def check_fused_adamw(device: str) -> Row:
    """FusedAdamW against torch.optim.AdamW over 3 steps of float32 parameters on ``device``."""
    import torch

    from . import FusedAdamW, _build

    row = Row("fused_adamw", device)
    g = torch.Generator().manual_seed(0)
    shapes = [(67, 3), (1000,), (5,), ()]
    a = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = FusedAdamW(a, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(b, lr=1e-2,
                                                                         weight_decay=0.1)
    for _ in range(3):
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, generator=g).to(device)
            pb.grad = pa.grad.clone()
        oa.step()
        ob.step()
    path = _build.LAST_PATH.get(("fused_adamw", device))
    row.native, row.reason = oa.native, (path.reason if path else oa.fallback_reason or "")
    err = max(_rel(x, y) for x, y in zip(a, b))
    row.errors["float32"] = err
    if not err <= TOLERANCE["float32"]:
        row.failures.append(f"float32: relative error {err:.2e} against torch.optim.AdamW")
    return row


def run(ops=None, devices=None, run_opcheck: bool = True, console=None) -> int:
    """Check ``ops`` (default: all) on ``devices`` (default: cpu, and cuda when present)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import OPS, _build
    from .cpu_adam import cpu_adam_kernels

    import sys

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    devices = devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    t0 = time.perf_counter()
    adam = None
    if _build.native_disabled_reason() is None and "cpu" in devices:
        with console.status("building kernels"):
            _build.build_all()
            adam = cpu_adam_kernels()
    # The extensions build side by side: the slowest one is the wall time.
    built = max((t for t in map(_build.build_seconds, ("meshlab_ops_cpu", "meshlab_attention_cpu"))
                 if t is not None), default=None)
    rows = [check_op(op, dev, run_opcheck=run_opcheck) for dev in devices for op in (ops or OPS)]
    rows += [check_fused_adamw(dev) for dev in devices]

    table = Table(title="meshlab fused ops")
    for col in ("op", "device", "path", "opcheck", "fp32 err", "bf16 err", "result", "reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.op, r.device, "native" if r.native else "[yellow]fallback[/]", r.opcheck,
                      *(f"{r.errors[d]:.1e}" if d in r.errors else "-"
                        for d in ("float32", "bfloat16")),
                      "[red]FAIL[/]" if r.failures else "[green]ok[/]", r.reason)
    if "cpu" in devices:
        table.add_row("cpu_adamw", "cpu", "native" if adam is not None else "[yellow]fallback[/]",
                      "-", "", "", "-", "C++ kernel (csrc/cpu_adam.cpp)" if adam is not None else
                      (_build.native_disabled_reason() or _build.failure("meshlab_cpu_adam") or ""))
    console.print(table)
    for r in rows:
        for f in r.failures:
            console.print(f"[red]{r.op} on {r.device}:[/] {f}")
    note = f"; C++ kernels built or loaded in {built:.1f} s" if built is not None else ""
    failed = sum(bool(r.failures) for r in rows)
    console.print(f"{len(rows) - failed}/{len(rows)} checks passed in "
                  f"{time.perf_counter() - t0:.1f} s{note}")
    return 1 if failed else 0
