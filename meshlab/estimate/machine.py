"""The machine a plan runs on, as a small value: what the step-time estimate needs.

``Machine`` holds one card's memory, its dense bf16 matmul rate and memory bandwidth as
measured (not the datasheet's), the launch cost of one kernel, and the bus bandwidths of
collectives inside a node (NVLink) and across nodes (the network), the host link, and
``gpus_per_node``. Presets for H100, H200, A100 and B200 carry the datasheet figures
scaled by what one such card reaches here; ``meshlab calibrate`` measures the card at
hand and writes a JSON file ``machine('path.json')`` reads back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..core.errors import ConfigError

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Machine:
    """One kind of card and its links. Rates in FLOP/s and bytes/s; ``launch`` in s."""

    name: str
    memory: int                    # bytes the framework can allocate on one card
    matmul: float                  # dense bf16 matmul FLOP/s reached (large GEMMs)
    hbm: float                     # device memory bandwidth reached (bytes/s, read+write)
    launch: float = 2.5e-6         # device seconds per kernel beyond its work (queued)
    host_op: float = 35e-6         # host seconds per op of an eager training step
    intra: float = 370e9           # collective bus bandwidth inside a node (bytes/s)
    inter: float = 45e9            # collective bus bandwidth across nodes, per card
    latency: float = 15e-6         # seconds per collective (start-up)
    host: float = 50e9             # host <-> device copy bandwidth (pinned, one way)
    gpus_per_node: int = 8
    attention: float = 0.0         # FLOP/s of fused attention at long sequences (0: matmul
    attention_narrow: float = 0.0  # * 0.66); the same at head dim 64 (0: attention * 0.73)
    attention_knee: float = 0.0    # kv length at which fused attention runs at half that rate
    attention_knee_narrow: float = 0.0  # (its per-row work); the same at head dim 64
    elementwise: float = 0.0       # bytes/s eager elementwise ops reach (0: hbm * 0.72)
    host_hook: float = 40e-6       # host seconds per op under a Python dispatch mode
    host_fused: float = 250e-6     # host seconds per call of a meshlab fused op (H200 host)
    host_hook_fused: float = 390e-6  # host_hook's counterpart for a fused op (H200 host)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Machine":
        import math

        if not isinstance(d, dict):
            raise ConfigError(f"machine profile: a JSON object of fields (as `meshlab "
                              f"calibrate` writes), got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"machine profile: unknown fields {bad}; known {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d and
                         f.default is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"machine profile: missing fields {missing}; write it with "
                              f"`meshlab calibrate`")
        for k, v in d.items():          # every rate and size a finite number >= 0
            if k != "name" and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                                not math.isfinite(v) or v < 0):
                raise ConfigError(f"machine profile: {k}={v!r} must be a finite number >= 0")
        if not isinstance(d["name"], str):
            raise ConfigError(f"machine profile: name={d['name']!r} must be a string")
        return cls(**d)

    def replace(self, **kw) -> "Machine":
        return dataclasses.replace(self, **kw)


# H200: what ``calibrate`` measured on one H200 SXM (benchmarks/results/plan_accuracy_*; the
# presets take the committed sweep's run): bf16 matmul 680-800 TFLOP/s by shape and run,
# x*y 3.5-4.0 TB/s, an eager elementwise chain 2.54 TB/s, cuDNN attention forward and
# backward at head dim 128 350 TFLOP/s at kv 2048 and 450 at 4096 (a long-sequence rate of
# 610-630, knee 1460-1600), at head dim 64 275-285 and 350-360 (460-490, knee 1250-1490),
# 1.8 us per queued tiny kernel; on its hosts, per op of an eager bf16 step 19-29 us, 29-37
# us more under selective checkpointing, 170-250 us per call of a fused op and 170-390 us
# more for one under selective checkpointing; pinned copies 55 GB/s; NVLink ring busBw
# ~370 GB/s with NVLS off. The others: datasheet peaks scaled by the fractions the H200
# reaches of its own.
PRESETS: dict[str, Machine] = {
    "h200": Machine("h200", memory=int(139.8 * GiB), matmul=730e12, hbm=3.9e12,
                    attention=610e12, attention_knee=1460.0, attention_narrow=460e12,
                    attention_knee_narrow=1250.0, elementwise=2.54e12, launch=1.8e-6,
                    host_op=29e-6, host_hook=33e-6, host_fused=250e-6,
                    host_hook_fused=390e-6, host=55e9),
    "h100": Machine("h100", memory=int(79.2 * GiB), matmul=730e12, hbm=2.5e12,
                    attention=610e12, attention_knee=1460.0, attention_narrow=460e12,
                    attention_knee_narrow=1250.0, elementwise=1.76e12, launch=1.8e-6,
                    host_op=29e-6, host_hook=33e-6, host_fused=250e-6,
                    host_hook_fused=390e-6, host=55e9),
    "a100": Machine("a100", memory=int(79.2 * GiB), matmul=230e12, hbm=1.5e12,
                    attention=150e12, intra=230e9, inter=22e9, host=24e9),
    "b200": Machine("b200", memory=int(178 * GiB), matmul=1640e12, hbm=6.0e12,
                    attention=1000e12, intra=740e9, inter=90e9, host=55e9),
}


def machine(spec) -> Machine:
    """A ``Machine`` from a preset name (``'h200'``), a JSON file or a Machine."""
    if isinstance(spec, Machine):
        return spec
    if isinstance(spec, str):
        if spec.lower() in PRESETS:
            return PRESETS[spec.lower()]
        path = Path(spec)
        if path.suffix == ".json" and path.is_file():
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"machine {spec!r}: not a readable JSON profile ({e}); "
                                  f"write it with `meshlab calibrate --out {spec}`") from None
            try:
                return Machine.from_json(d)
            except ConfigError as e:
                raise ConfigError(f"machine {spec!r}: {e}") from None
    raise ConfigError(f"machine {spec!r}: name one of {sorted(PRESETS)} or a JSON file written "
                      f"by `meshlab calibrate`")


def parse_memory(text: str) -> int:
    """``'141GB'``, ``'80GiB'``, ``'120e9'`` -> bytes."""
    t = str(text).strip()
    units = {"TIB": 2 ** 40, "GIB": GiB, "MIB": 2 ** 20, "TB": 1e12, "GB": 1e9, "MB": 1e6,
             "B": 1}
    for u, k in units.items():
        if t.upper().endswith(u):
            try:
                return int(float(t[:-len(u)]) * k)
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise ConfigError(f"memory {text!r}: write it as 141GB, 80GiB or a number of bytes")


def _timer(cuda: bool, reps: int, best: bool = False):
    """``timed(fn)``: the median seconds of ``reps`` calls after two warm-ups (CUDA
    events on a GPU, ``perf_counter`` on a CPU); ``best``: the fastest call (for host
    work, which interruptions only ever slow)."""
    import statistics
    import time

    import torch

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        out = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return min(out) if best else statistics.median(out)

    return timed


def _compute_rates(dev: str, cuda: bool, timed, progress) -> dict:
    """Matmul (a 2048-wide block's shapes and a large square), elementwise, attention,
    launch."""
    import statistics

    import torch

    dt = torch.bfloat16 if cuda else torch.float32
    scale = 1 if cuda else 8          # smaller problems on a CPU
    rates = []
    for m, k, n in ((16384 // scale, 2048 // scale, 5632 // scale),
                    (16384 // scale, 5632 // scale, 2048 // scale),
                    (8192 // scale, 8192 // scale, 8192 // scale)):
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt)
        for _ in range(20 if cuda else 1):   # the card at its working clocks first
            a @ b
        rates.append(2 * m * k * n / timed(lambda: a @ b))
        progress(f"matmul {m}x{k}x{n}: {rates[-1] / 1e12:.1f} TFLOP/s")
    x = torch.randn(64 * 2 ** 20 // scale, device=dev, dtype=dt)
    y = torch.randn_like(x)
    hbm = 3 * x.numel() * x.element_size() / timed(lambda: x * y)
    progress(f"elementwise x*y: {hbm / 1e9:.0f} GB/s")
    attention = _attention_rates(dev, dt, cuda, timed, progress)
    elementwise = _elementwise_rate(dev, dt, scale, timed)
    progress(f"eager elementwise chain: {elementwise / 1e9:.0f} GB/s")
    launch = _queued_launch(dev, cuda, timed)
    progress(f"launch: {launch * 1e6:.1f} us per queued tiny op")
    return dict(matmul=statistics.median(rates), hbm=hbm, elementwise=elementwise,
                launch=launch, **attention)


def _attention_rates(dev: str, dt, cuda: bool, timed, progress) -> dict:
    """Fused causal attention forward and backward at head dims 128 and 64 (CPU: 64 and
    32), each at two kv lengths with the same tokens: per FLOP it takes ``(1 + knee / kv) /
    rate``, solved from the two for ``rate`` and ``knee`` (0 when the longer is no faster)."""
    import torch
    import torch.nn.functional as F

    out = {}
    for key, d, heads in (("", 128, 16), ("_narrow", 64, 32)):
        d, heads = (d, heads) if cuda else (d // 2, 4)
        per_flop = []
        for b_, s in (((8, 2048), (4, 4096)) if cuda else ((2, 256), (1, 512))):
            q, kk, v = (torch.randn(b_, heads, s, d, device=dev, dtype=dt, requires_grad=True)
                        for _ in range(3))

            def attn():
                F.scaled_dot_product_attention(q, kk, v, is_causal=True).sum().backward()

            flops = 3.5 * 4 * b_ * heads * s * s * d * 0.5
            per_flop.append((s, timed(attn) / flops))
            progress(f"attention fwd+bwd, head dim {d}, kv {s}: "
                     f"{1 / per_flop[-1][1] / 1e12:.1f} TFLOP/s")
        (s1, p1), (s2, p2) = per_flop
        slope = max(p1 - p2, 0.0) / (1 / s1 - 1 / s2)      # seconds per FLOP x kv length
        inv_rate = p2 - slope / s2
        if inv_rate <= 0:
            slope, inv_rate = 0.0, p2
        out["attention" + key] = 1 / inv_rate
        out["attention_knee" + key] = slope / inv_rate
    return out


def _elementwise_rate(dev: str, dt, scale: int, timed) -> float:
    """Bytes/s of an eager block's elementwise work (an unfused RMSNorm, rotary halves,
    SiLU-gate, residual add; forward and backward), its bytes counted by the rule the
    step profile counts them (``meshlab.estimate.profile.count_work``)."""
    import torch
    import torch.nn.functional as F

    from .profile import count_work

    t, hid, inter = 16384 // scale, 2048 // scale, 5632 // scale
    x = torch.randn(t, hid, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(hid, device=dev, dtype=dt, requires_grad=True)
    a, b = (torch.randn(t, inter, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    cos = torch.randn(t, hid, device=dev, dtype=dt)

    def chain():
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        n = w * h.to(dt)
        x1, x2 = n[..., :hid // 2], n[..., hid // 2:]
        r = n * cos + torch.cat((-x2, x1), dim=-1) * cos
        y = F.silu(a) * b
        (r + x).sum().backward(retain_graph=False)
        y.sum().backward()

    moved = count_work(chain).bytes
    return moved / timed(chain)


def _queued_launch(dev: str, cuda: bool, timed) -> float:
    """Device seconds per tiny kernel when the queue is full (issued behind a long
    matmul, so the host's dispatch is hidden)."""
    import torch

    tiny = torch.ones(8, device=dev)
    if not cuda:
        def launches():
            for _ in range(100):
                tiny.add_(1)

        return timed(launches) / 100
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    out = []
    for _ in range(5):
        big @ big
        big @ big
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200):
            tiny.add_(1)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / 200)
    return sorted(out)[len(out) // 2]


def _host_per_op(dev: str, timed) -> dict:
    """Host seconds per op of an eager training step, from a tiny Llama's steps (whose
    device work is negligible) over the ops the step profile counts (``count_work``):
    ``host_op`` per op of the plain model, ``host_fused`` per call of a fused op (the
    model with meshlab's ops routed in), and the extra per op selective checkpointing's
    dispatch mode sees, ``host_hook`` (plain) and ``host_hook_fused`` (a fused op).
    Each is the whole step over its ops: on the H200's host that matched a 1B model's
    host-bound steps better than the difference between a 4- and a 2-layer model's."""
    import torch

    from ..policies import presets
    from ..transforms.remat._forward import remat_forward
    from .profile import count_work
    from ..transforms.fuse._hf import fuse

    ids = torch.randint(0, 256, (1, 16), device=dev)
    # On a GPU the dtype and head dim a block trains in: a fused op's float32 path (the
    # memory-efficient attention with its copies) costs the host more than its bf16 one.
    cuda = dev.startswith("cuda")
    shape = dict(hidden_size=256, intermediate_size=512) if cuda else {}

    def measured(fused: bool, selective: bool):
        """(seconds of one step, the profile's count of its forward and backward, the ops
        selective checkpointing saw and of them the fused ones)."""
        model = presets.build("tiny-llama", device=dev,
                              dtype=torch.bfloat16 if cuda else torch.float32, **shape)
        model.config.use_cache = False  # a cache would change between forward and recompute
        if fused:
            fuse(model)
        seen = [0, 0]
        if selective:
            for layer in model.model.layers:
                layer.forward = remat_forward(layer.forward, "selective", seen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def fwd_bwd():
            model(input_ids=ids, labels=ids).loss.backward()

        def step():
            fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = timed(step)
        seen[:] = [0, 0]
        fwd_bwd()
        model.zero_grad(set_to_none=True)
        saw = tuple(seen)
        return seconds, count_work(fwd_bwd), saw

    plain, w, _ = measured(False, False)
    per_op = plain / max(w.ops + 8, 1)         # + the optimizer's few fused launches
    hooked, _, (n, _) = measured(False, True)
    hook = max(hooked - plain, 0.0) / max(n, 1)
    fused, w, _ = measured(True, False)
    per_fused = max(fused - (w.ops - w.fused + 8) * per_op, 0.0) / max(w.fused, 1)
    both, _, (n, nf) = measured(True, True)
    hook_fused = max(both - fused - (n - nf) * hook, 0.0) / max(nf, 1)
    return dict(host_op=per_op, host_fused=per_fused, host_hook=hook,
                host_hook_fused=hook_fused)


def calibrate(device: str | None = None, *, name: str | None = None, quick: bool = False,
              progress=print) -> Machine:
    """Measure the card at hand (CUDA if present, else the CPU): a bf16 matmul of the
    shape a 2048-wide block runs and a large one, a memory-bound elementwise op, fused
    attention forward and backward, the launch cost of a tiny op, pinned host copies.
    Timed with CUDA events (CPU: ``perf_counter``), after warm-up, the median of the
    repeats; the launch gap from a loop of tiny ops; the host costs (per op, per fused op
    call, and under selective checkpointing) from a tiny model's eager steps, the fastest
    of the repeats. Links between cards keep the preset's figures."""
    import os

    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(dev, str) or dev.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"calibrate(device={device!r}): 'cpu' or 'cuda' (or 'cuda:N'); "
                          f"it measures the card or host it runs on")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"calibrate(device={device!r}): no CUDA device here; pass "
                          f"device='cpu'")
    cuda = dev.startswith("cuda")
    timed = _timer(cuda, 3 if quick else 10)
    rates = _compute_rates(dev, cuda, timed, progress)
    host_rates = _host_per_op(dev, _timer(cuda, 3 if quick else 20, best=True))
    progress(f"host: {host_rates['host_op'] * 1e6:.1f} us per op of an eager training step, "
             f"{host_rates['host_fused'] * 1e6:.1f} us per call of a fused op; under "
             f"selective checkpointing {host_rates['host_hook'] * 1e6:.1f} us more per op, "
             f"{host_rates['host_hook_fused'] * 1e6:.1f} us more per fused op")
    base = PRESETS["h200"]
    host, memory = base.host, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cuda:
        pinned = torch.empty(256 * 2 ** 20, dtype=torch.uint8, pin_memory=True)
        on_dev = torch.empty_like(pinned, device=dev)
        host = pinned.numel() / timed(lambda: on_dev.copy_(pinned, non_blocking=True))
        progress(f"host to device: {host / 1e9:.1f} GB/s")
        memory = torch.cuda.get_device_properties(dev).total_memory
    label = name or (torch.cuda.get_device_name(dev) if cuda else "cpu")
    return base.replace(name=label, memory=int(memory), host=host, **rates, **host_rates)
