"""Lazy, cached builds of meshlab's kernels, and the record of which path each op took.

Nothing here runs at import. :func:`cpu_extension` compiles a C++ file from ``csrc/`` with
``torch.utils.cpp_extension.load`` the first time an op asks for it, caches the module for
the process (and the shared object on disk), and returns ``None`` with a reason instead of
raising when there is no compiler or the build fails: an op then runs its pure-PyTorch
reference. :func:`triton_kernels` does the same for the Triton kernels used on CUDA.

Environment:

* ``MESHLAB_OPS_NATIVE=0`` turns every native kernel off (the references run).
* ``TORCH_EXTENSIONS_DIR`` moves the build folder; default ``~/.cache/meshlab/extensions``.
* ``MESHLAB_BUILD_WAIT_S`` (default 900): how long a process waits for another one that is
  building the same extension before running the reference. A build that was killed never
  blocks a later one (its leftover lock file is cleared).

>>> from meshlab.ops import _build
>>> with _build.force_reference():
...     _build.native_disabled_reason()
'forced off by meshlab.ops._build.force_reference()'
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_CSRC = Path(__file__).resolve().parents[2] / "csrc"

# One lock per extension: two threads asking for the same one must not run two compilers
# into one folder, while different extensions may build side by side (one core each).
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
_MODULES: dict[str, object] = {}       # name -> loaded module
_FAILED: dict[str, str] = {}           # name -> why it could not be built
_BUILD_SECONDS: dict[str, float] = {}
_FORCED_OFF = 0


@dataclass(frozen=True, slots=True)
class PathTaken:
    """Which implementation an op ran last on one device: ``native`` or ``fallback``."""

    op: str
    device: str
    native: bool
    reason: str


# (op, device type) -> the last path that op took; read by ``meshlab check`` and the tests.
LAST_PATH: dict[tuple[str, str], PathTaken] = {}


def record(op: str, device: str, native: bool, reason: str = "") -> None:
    # Called on every op call: build a new record only when the path changed.
    last = LAST_PATH.get((op, device))
    if last is None or last.native != native or last.reason != reason:
        LAST_PATH[(op, device)] = PathTaken(op, device, native, reason)


@contextlib.contextmanager
def force_reference():
    """Run every op's pure-PyTorch reference inside this block, whatever is built."""
    global _FORCED_OFF
    _FORCED_OFF += 1
    try:
        yield
    finally:
        _FORCED_OFF -= 1


_DISPATCHER_ONLY = 0


@contextlib.contextmanager
def dispatcher_only():
    """Route every call through the ``meshlab::`` custom ops inside this block, as under
    ``torch.compile``, a dispatch mode or DTensor (see :func:`eager`)."""
    global _DISPATCHER_ONLY
    _DISPATCHER_ONLY += 1
    try:
        yield
    finally:
        _DISPATCHER_ONLY -= 1


def eager(*tensors) -> bool:
    """True when an op may run its kernels through a plain ``autograd.Function`` instead of
    its ``meshlab::`` custom op: not compiling, no dispatch or function mode active, and
    every tensor a plain CPU or CUDA ``Tensor``/``Parameter`` (not a DTensor, fake or meta
    tensor). Both paths run the same kernels; the custom op's Python dispatch costs about
    as much host time as a small kernel's whole run, which eager training pays per call."""
    import torch

    if _DISPATCHER_ONLY or torch.compiler.is_compiling() or \
            torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return plain(*tensors)


def plain(*tensors) -> bool:
    """Every tensor a plain CPU or CUDA ``Tensor``/``Parameter`` (not a DTensor, fake or
    meta tensor)."""
    import torch

    for t in tensors:
        if (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter) or \
                t.device.type not in _KERNEL_DTYPES:
            return False
    return True


def native_disabled_reason() -> str | None:
    """Why native kernels are off by request, or ``None`` when they may be used."""
    if _FORCED_OFF:
        return "forced off by meshlab.ops._build.force_reference()"
    if os.environ.get("MESHLAB_OPS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "MESHLAB_OPS_NATIVE=0"
    return None


def _cpu_tag() -> str:
    # -march=native code built on one CPU can fault on another; the folder name carries the
    # CPU model so that a home directory shared between machines never mixes them.
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return hashlib.sha1(model.encode()).hexdigest()[:8]


def build_dir(name: str) -> Path:
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "meshlab" / "extensions"
    tag = f"torch{torch.__version__.split('+')[0]}-{platform.machine()}-{_cpu_tag()}"
    d = base / tag / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compiler_missing() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    import torch.utils.cpp_extension as ce

    try:
        ce.verify_ninja_availability()
    except RuntimeError:
        return "ninja not found (pip install ninja)"
    return None


def _cflags() -> list[str]:
    # -fno-math-errno: lets sqrt and exp vectorize (no kernel reads errno).
    flags = ["-O3", "-fopenmp", "-fno-math-errno"]
    # torch rebuilds an extension when its sources or flags change, not its headers: the
    # shared header's hash in a flag makes an edit to it rebuild every kernel.
    header = _CSRC / "cpu_common.h"
    if header.is_file():
        flags.append(f"-DMESHLAB_CPU_COMMON={hashlib.sha1(header.read_bytes()).hexdigest()[:12]}")
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


# How long a process waits for another one building the same extension before it runs the
# op's reference instead (a cold build of the largest file takes under a minute on 2 cores).
BUILD_WAIT_S = float(os.environ.get("MESHLAB_BUILD_WAIT_S", "900"))


@contextlib.contextmanager
def _folder_lock(folder: Path, name: str):
    """Hold ``folder`` for one building process at a time, by an OS lock the kernel drops
    when its holder dies, and clear a build lock left behind.

    ``cpp_extension.load`` marks a build in progress with a ``lock`` file and makes every
    other process wait, with no limit, until that file goes; a build that was killed
    (Ctrl-C, a job's time limit) leaves the file, and every later process waited forever.
    Under the OS lock no other process of ours is building, so a ``lock`` file found there
    is such a leftover and is removed. Waiting longer than ``BUILD_WAIT_S`` for another
    process's build raises ``TimeoutError`` (the op runs its reference)."""
    try:
        import fcntl
    except ImportError:         # no POSIX locks: torch's own lock file alone
        yield
        return
    with open(folder / "meshlab-build.lock", "a+") as f:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: another process has held its build folder "
                                       f"{folder} for over {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            stale = folder / "lock"
            if stale.exists():
                stale.unlink()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cpu_extension(name: str, sources: tuple[str, ...]):
    """Build (once) and return the C++ extension ``name`` from ``csrc/<sources>``, or ``None``.

    ``None`` means the caller runs its reference; :func:`failure` says why.
    """
    if name in _MODULES:
        return _MODULES[name]
    if name in _FAILED:
        return None
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(name, threading.Lock())
    with lock:
        if name in _MODULES or name in _FAILED:
            return _MODULES.get(name)
        why = _compiler_missing()
        missing = [s for s in sources if not (_CSRC / s).is_file()]
        if missing:
            why = f"sources not found: {', '.join(str(_CSRC / s) for s in missing)}"
        if why is not None:
            _FAILED[name] = why
            return None
        import torch.utils.cpp_extension as ce

        t0 = time.perf_counter()
        folder = build_dir(name)
        try:
            with _folder_lock(folder, name):
                mod = ce.load(name=name, sources=[str(_CSRC / s) for s in sources],
                              extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                              build_directory=str(folder), verbose=False)
        # A failed build surfaces as RuntimeError (compiler errors), OSError (loader) or
        # subprocess.CalledProcessError; the reference keeps the op usable in every case.
        except (RuntimeError, OSError, ImportError, TimeoutError) as e:
            first = str(e).strip().splitlines()
            _FAILED[name] = f"build failed: {first[-1] if first else type(e).__name__}"
            return None
        _BUILD_SECONDS[name] = time.perf_counter() - t0
        _MODULES[name] = mod
        return mod


def cpu_adam_kernels():
    """The built ``adamw_step`` module of ``CPUAdamW``, or ``None`` (see
    ``failure('meshlab_cpu_adam')``)."""
    if native_disabled_reason() is not None:
        return None
    return cpu_extension("meshlab_cpu_adam", ("cpu_adam.cpp",))


def build_all() -> dict[str, bool]:
    """Build every C++ extension at once, in parallel threads; name -> built."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        ops, adam, attn = (pool.submit(ops_cpu), pool.submit(cpu_adam_kernels),
                           pool.submit(attention_cpu))
        return {"meshlab_ops_cpu": ops.result() is not None,
                "meshlab_cpu_adam": adam.result() is not None,
                "meshlab_attention_cpu": attn.result() is not None}


def failure(name: str) -> str | None:
    return _FAILED.get(name)


def build_seconds(name: str) -> float | None:
    return _BUILD_SECONDS.get(name)


def ops_cpu():
    """The C++ CPU kernels of rms_norm, rotary, swiglu and layer_norm (one translation unit)."""
    return cpu_extension("meshlab_ops_cpu", ("ops_cpu.cpp",))


def attention_cpu():
    """The C++ CPU kernels of attention (forward and backward), a translation unit of their own."""
    return cpu_extension("meshlab_attention_cpu", ("attention_cpu.cpp",))


# Ops whose C++ kernels are not in ops_cpu.cpp: op -> (extension name, its builder, source).
_OWN_EXTENSION = {
    "attention": ("meshlab_attention_cpu", attention_cpu, "attention_cpu.cpp"),
    "attention_backward": ("meshlab_attention_cpu", attention_cpu, "attention_cpu.cpp"),
    "paged_attention": ("meshlab_attention_cpu", attention_cpu, "attention_cpu.cpp"),
}


def cpu_kernels(op: str):
    """The built CPU module for ``op``, or ``None``; records which path ``op`` takes."""
    off = native_disabled_reason()
    if off is not None:
        record(op, "cpu", False, off)
        return None
    name, build, source = _OWN_EXTENSION.get(op, ("meshlab_ops_cpu", ops_cpu, "ops_cpu.cpp"))
    mod = build()
    if mod is None:
        record(op, "cpu", False, failure(name) or "not built")
        return None
    record(op, "cpu", True, f"C++ kernel (csrc/{source})")
    return mod


# Ops whose Triton kernels are not in _triton.py: op -> module (mirroring _OWN_EXTENSION).
_OWN_TRITON = {"paged_attention": "_triton_paged", "kv_cache_write": "_triton_paged",
               "decode_linear": "_triton_gemv", "argmax": "_triton_argmax"}
_TRITON: dict[str, object] = {}
_TRITON_WHY: dict[str, str] = {}


def triton_kernels(op: str):
    """The Triton kernel module for CUDA tensors, or ``None``; records the path ``op`` takes."""
    off = native_disabled_reason()
    if off is not None:
        record(op, "cuda", False, off)
        return None
    name = _OWN_TRITON.get(op, "_triton")
    if name not in _TRITON and name not in _TRITON_WHY:
        try:
            _TRITON[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError as e:
            _TRITON_WHY[name] = f"triton unavailable: {e}"
    if name not in _TRITON:
        record(op, "cuda", False, _TRITON_WHY.get(name, "triton unavailable"))
        return None
    record(op, "cuda", True, f"Triton kernel (meshlab/ops/{name}.py)")
    return _TRITON[name]


_KERNEL_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}


def kernels(op: str, x):
    """The kernel module that should run ``op`` on tensor ``x`` (C++ on CPU, Triton on CUDA).

    Returns ``None`` when the reference must run instead, and records why: no kernel for the
    device or dtype, kernels switched off, or the build failed. Both modules expose the same
    function names (``rms_norm_fwd``, ``swiglu_bwd``, ...), so ops call either the same way.
    """
    dev = x.device.type
    if dev not in _KERNEL_DTYPES:
        record(op, dev, False, f"no kernel for device {dev!r}")
        return None
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype not in _KERNEL_DTYPES[dev]:
        record(op, dev, False, f"no {dev} kernel for {dtype}")
        return None
    return cpu_kernels(op) if dev == "cpu" else triton_kernels(op)


def hopper_package(module: str, dist: str, name: str, without: str):
    """``(module.name, dist's version)`` where ``module`` is installed and this is a Hopper
    card (the CuTe-DSL kernels of flash-attn-4 and quack-kernels), else None. One that is
    installed but fails to import raises, naming ``without`` (what runs in its place):
    it would otherwise be skipped without a word."""
    import importlib
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    import torch

    if importlib.util.find_spec(module.split(".")[0]) is None or \
            not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None
    try:                      # (finding a submodule imports its package)
        if importlib.util.find_spec(module) is None:
            return None       # another distribution of the package (flash-attn 2's)
        found = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ImportError(f"{dist} is installed but cannot be imported ({e}); install its "
                          f"CuTe DSL libraries (nvidia-cutlass-dsl), or uninstall {dist} "
                          f"({without})") from e
    try:
        return found, version(dist)
    except PackageNotFoundError:
        return found, "?"


def stat_dtype(x):
    """The dtype of the per-row statistics a norm keeps for its backward: float32, float64
    for float64 inputs (which only the PyTorch reference math takes)."""
    import torch

    return torch.promote_types(x.dtype, torch.float32)


def upcast(t):
    """``t`` in float32, or float64 if it already is: references compute at least in float32,
    and in float64 when handed float64 (so tests can compare against a higher precision)."""
    import torch

    return t.to(torch.promote_types(t.dtype, torch.float32))


def contiguous(t):
    """``t`` contiguous with the strides ``torch.empty(t.shape)`` has, what every op's fake
    kernel returns. ``t.contiguous()`` alone keeps the strides of size-1 dims as they are:
    an output computed from a (B, H, 1, D) view of (B, 1, H, D) memory, a decoding step's
    query, would come back with stride H * D on its size-1 dim where the fake says D. The
    flatten and view that fix it copy nothing."""
    t = t.contiguous()
    return t.view(-1).view(t.shape)


def sharding_available() -> bool:
    import torch

    return torch.distributed.is_available()


def like(t, ref):
    """``t`` laid out as ``torch.empty_like(ref)`` is (``ref``'s strides where it is dense,
    else contiguous): returned as it is when it already is, else copied once. An op whose
    fake kernel promises ``empty_like(ref)`` returns this, so a kernel that writes in its
    input's layout (cuDNN's attention: heads-and-sequence transposed as Hugging Face's
    projections leave them) is passed through without a copy."""
    import torch

    want = torch.empty_like(ref, dtype=t.dtype)
    if t.shape == want.shape and t.stride() == want.stride():
        return t
    return want.copy_(t)
