"""``offload``'s share of ``plan.memory()``, and its predicted cost per optimizer step.

Memory, per offloaded FQN (the rows ``zero_shard`` left):

* optimizer state: the moments go to the host; so does an fp32 master copy, except under
  ZeRO-1 (whose fp32 slice already is one, and moves with its moments together with
  its reduced gradient slice) and for parameters FSDP2 keeps on the host (the shard is
  the master);
* a device copy kept in the compute dtype (``cast``): the parameter and gradient rows
  change dtype;
* gradients: the row goes to the host (it leaves the device in the backward); those that
  stay on the device pass through two pinned staging slots of one chunk each in the step
  (the ``staging`` row), as do the bf16 copies going back;
* parameters (ZeRO-3): the shard row goes to the host.

Time: per step the offloaded gradients cross to the host, the CPU AdamW updates the
offloaded elements, and the updated parameters cross back; the three run as a pipeline
over tensors, but on the host they share memory bandwidth and were measured to hardly
overlap, so the step costs about their sum. Parameters FSDP2 keeps on the
host cross to the device in every forward (and backward, at ZeRO-3) instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from ...core.units import dtype_bytes
from ...planning.rows import MemRow

# Measured host<->device copy bandwidth and CPU AdamW throughput of one machine: what
# ``predict`` uses when given no profile. ``measure_profile()`` measures the machine it
# runs on; ``benchmarks/offload_h200.py`` wrote this one.
PROFILE_FILE = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / \
    "offload_profile_h200.json"


def _master(dtype: str) -> str:
    """The host master's dtype for a parameter of ``dtype``: float32, float64 kept."""
    return "float64" if dtype == "float64" else "float32"


def offload_memory(choice, cast: frozenset, compute: str, zero1: bool, rows: list,
                   chunk: int) -> list:
    out, seen_grad = [], set()
    staged: list[tuple[int, int, int]] = []      # (elements, gradient bytes in, bf16 bytes out)
    for r in rows:
        f = r.fqn
        if f not in choice.optimizer:
            out.append(r)
            continue
        if r.category == "optimizer":    # moments of the fp32 master (ZeRO-1: already)
            out.append(dataclasses.replace(r, where="host", dtype=_master(r.dtype)))
        elif r.category == "grads":
            first = f not in seen_grad
            seen_grad.add(f)
            if zero1 and f not in choice.params:     # the whole gradient stays; ZeRO-1's
                out.append(r if first else dataclasses.replace(r, where="host"))  # slice moves
            elif f in choice.grads or f in choice.params:
                out.append(dataclasses.replace(r, where="host"))
            else:                # stays on the device; the step stages it chunk by chunk
                dev = dataclasses.replace(r, dtype=compute) if f in cast else r
                out.append(dev)
                n = math.prod(r.shape)
                staged.append((n, dev.bytes, 2 * n if dev.dtype == "bfloat16" else 0))
        elif r.category == "params":
            if f in choice.params:
                out.append(dataclasses.replace(r, where="host"))
                continue
            out.append(dataclasses.replace(r, dtype=compute) if f in cast else r)
            if not zero1:
                out.append(dataclasses.replace(r, category="optimizer",
                                               dtype=_master(r.dtype), where="host"))
        else:
            out.append(r)
    if staged and not zero1:
        out.append(MemRow("(staging)", "staging", "uint8", (_staging(staged, chunk),), "host"))
    return out


def _staging(staged: list[tuple[int, int, int]], chunk: int) -> int:
    """Bytes of the step's two pinned staging slots (``_install._Slot``)."""
    from ._install import _aligned, chunk_indices

    groups = chunk_indices([n for n, _, _ in staged], chunk)
    g = max(sum(_aligned(staged[i][1]) for i in c) for c in groups)
    o = max(sum(_aligned(staged[i][2]) for i in c) for c in groups)
    return 2 * (max(g, 1) + max(o, 1))


@dataclasses.dataclass(frozen=True)
class Profile:
    """Host->device and device->host copy bandwidth (bytes/s, pinned memory) and CPU
    AdamW throughput (parameters/s) of one machine."""

    h2d: float
    d2h: float
    cpu_adam: float
    source: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def default_profile() -> Profile | None:
    """The profile measured on the H200 machine (``benchmarks/results``), if shipped."""
    try:
        d = json.loads(PROFILE_FILE.read_text())["profile"]
    except (OSError, KeyError, ValueError):
        return None
    return Profile(d["h2d"], d["d2h"], d["cpu_adam"], d.get("source", PROFILE_FILE.name))


def measure_profile(nbytes: int = 1 << 28, repeats: int = 5) -> Profile:
    """Measure this machine: pinned copies of ``nbytes`` each way on the current CUDA
    device (medians of ``repeats``), and the CPU AdamW over ``nbytes / 4`` parameters."""
    import torch

    from ...ops.cpu_adam import CPUAdamW

    n = nbytes // 4
    if torch.cuda.is_available():
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(n, dtype=torch.float32, device="cuda")
        h2d, d2h = [], []
        for _ in range(repeats + 1):
            for dst, src, out in ((dev, host, h2d), (host, dev, d2h)):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                out.append(nbytes / (a.elapsed_time(b) / 1e3))
        h2d_bw, d2h_bw = _median(h2d[1:]), _median(d2h[1:])
    else:
        h2d_bw = d2h_bw = math.inf            # one memory: nothing crosses
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.zeros(n)
    opt = CPUAdamW([p])
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return Profile(h2d_bw, d2h_bw, n / _median(times), source="measure_profile()")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What offload adds to one optimizer step, per rank."""

    d2h_bytes: int
    h2d_bytes: int
    host_elements: int
    unit_h2d_bytes: int          # parameters FSDP2 keeps on the host, per forward+backward
    profile: Profile | None

    @property
    def seconds(self) -> float | None:
        """Predicted seconds the step's offload work takes: the copies each way and the
        CPU AdamW one after another (measured on the H200's host they hardly overlap:
        they share its memory bandwidth), plus the per-step copies of host-resident
        parameters. None without a profile."""
        p = self.profile
        if p is None:
            return None
        stream = self.d2h_bytes / p.d2h + self.h2d_bytes / p.h2d + \
            self.host_elements / p.cpu_adam
        return stream + self.unit_h2d_bytes / p.h2d

    def rows(self) -> list[tuple[str, str]]:
        from ...core.units import fmt_bytes

        out = [("gradients to host per step", fmt_bytes(self.d2h_bytes)),
               ("parameters to device per step", fmt_bytes(self.h2d_bytes)),
               ("host-resident parameter copies per step", fmt_bytes(self.unit_h2d_bytes)),
               ("elements the CPU AdamW updates", f"{self.host_elements:,}")]
        p = self.profile
        if p is not None:
            out += [("profile", f"h2d {p.h2d / 1e9:.1f} GB/s, d2h {p.d2h / 1e9:.1f} GB/s, "
                                f"CPU AdamW {p.cpu_adam / 1e9:.2f} G params/s ({p.source})"),
                    ("predicted offload time per step", f"{self.seconds:.3f} s")]
        else:
            out.append(("predicted offload time per step",
                        "no profile: pass profile=measure_profile()"))
        return out

    def __str__(self) -> str:
        w = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{w}}  {v}" for k, v in self.rows())


def step_cost(plan, choice, cast: frozenset, compute: str, zero_stage: int,
              profile: Profile | None) -> StepCost:
    from ...core.placement import local_shape

    sizes = plan.mesh_shape
    dp = 1
    z = plan.roles.dp if plan.roles else ()
    for a in z:
        dp *= sizes[a]
    d2h = h2d = elems = unit = 0
    for e in plan.params:
        if e.fqn not in choice.optimizer:
            continue
        n = math.prod(local_shape(e.shape, e.mesh_spec, sizes))
        shard = -(-n // dp) if zero_stage >= 1 else n
        dev = compute if e.fqn in cast else e.dtype
        elems += shard
        if e.fqn in choice.params:
            passes = 2 if zero_stage == 3 else 1
            unit += passes * n * dtype_bytes(compute)
            continue
        d2h += shard * (4 if zero_stage == 1 else dtype_bytes(dev))
        h2d += shard * (4 if zero_stage == 1 else dtype_bytes(dev))
    return StepCost(d2h, h2d, elems, unit, profile)
