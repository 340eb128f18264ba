"""Shared by the multi-GPU benchmarks: NVLink multicast off, the process group, timing,
and the JSON every script writes.

``nvlink_multicast_off()`` must run before ``torch.distributed`` initializes (each script
calls it before importing torch): NCCL reads ``NCCL_NVLS_ENABLE`` when it builds a
communicator, and torch's symmetric memory and NVSHMEM read theirs when first used.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def nvlink_multicast_off() -> None:
    """Set the three variables (overriding any inherited value) and say so on rank 0."""
    os.environ.update(NVLINK_MULTICAST_OFF)
    if os.environ.get("RANK", "0") == "0":
        print("NVLink multicast off: " + " ".join(f"{k}={v}" for k, v in
                                                  NVLINK_MULTICAST_OFF.items()), flush=True)


# -- arguments and the process group ------------------------------------------------------

def parser(description: str):
    import argparse

    import torch

    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: NCCL, one GPU per process; cpu: gloo dry run "
                        "(default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the script)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/<script>_w<world>_<device>.json)")
    p.add_argument("--meshlab-as-is", action="store_true",
                   help="no placement fix-ups: NCCL-only default group and no move of the "
                        "parameters meshlab leaves on the CPU (see README)")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds before a collective that never completes fails")
    return p


class Env:
    """This process's place in the world, its device and a gloo group for bookkeeping."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        if "RANK" not in os.environ:            # a plain `python script.py`: world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.args = args
        self.cuda = args.device == "cuda"
        self.fixups: list[str] = []
        if self.cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda, but torch sees no CUDA device; use --device cpu")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            if args.meshlab_as_is:
                backend = "nccl"                 # what meshlab's Mesh initializes on CUDA
            else:
                # meshlab puts some collectives on CPU tensors (step losses, norms, the
                # ZeRO-1 buffers); a CPU backend next to NCCL lets them run.
                backend = "cpu:gloo,cuda:nccl"
                self.fixups.append("default process group 'cpu:gloo,cuda:nccl' (meshlab "
                                   "runs some collectives on CPU tensors)")
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        self.backend = backend
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
        self.ctrl = dist.new_group(backend="gloo")
        self._meshes: dict = {}

    # meshes are cached by shape: each DeviceMesh builds its own communicators
    def mesh(self, **axes):
        import meshlab as ml

        key = tuple(axes.items())
        if key not in self._meshes:
            self._meshes[key] = ml.Mesh(dict(axes), device_type=self.device.type)
        return self._meshes[key]

    def sync(self) -> None:
        import torch
        import torch.distributed as dist

        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.ctrl)

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (a picklable value), on every rank."""
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu (gloo dry run)"

    def close(self) -> None:
        import torch.distributed as dist

        try:
            dist.barrier(group=self.ctrl)
        finally:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def place_on_device(model, device) -> int:
    """Move the plain (non-DTensor) parameters and buffers that are not on ``device``
    there, in place (the same Parameter objects, so tied weights stay tied). Returns the
    number of tensors moved."""
    import torch
    from torch.distributed.tensor import DTensor

    moved = 0
    with torch.no_grad():
        seen = set()
        for m in model.modules():
            for k, p in m._parameters.items():
                if p is None or id(p) in seen or isinstance(p, DTensor):
                    continue
                seen.add(id(p))
                if p.device != device:
                    p.data = p.data.to(device)
                    moved += 1
            for k, b in m._buffers.items():
                if b is not None and not isinstance(b, DTensor) and b.device != device:
                    m._buffers[k] = b.to(device)
                    moved += 1
    return moved


def describe_error(e: BaseException) -> dict:
    """``unsupported: <message>`` plus where it was raised (innermost frame in meshlab,
    else the innermost frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    where = None
    for fr in reversed(tb):
        if "/meshlab/" in fr.filename.replace("\\", "/"):
            where = f"{os.path.relpath(fr.filename, REPO)}:{fr.lineno}"
            break
    if where is None and tb:
        fr = tb[-1]
        where = f"{fr.filename}:{fr.lineno}"
    msg = " ".join(str(e).split())
    return {"status": f"unsupported: {type(e).__name__}: {msg[:600]}", "raised_at": where,
            "traceback_tail": "".join(traceback.format_exception(e))[-2500:]}


# -- timing ----------------------------------------------------------------------------------

class Timer:
    """Seconds of ``fn()``: CUDA events on GPU, perf_counter on CPU. ``warmup`` untimed
    calls, then ``repeats`` timed blocks of ``iters`` calls each (seconds per call)."""

    def __init__(self, env: Env):
        self.env = env

    def run(self, fn, *, warmup: int, repeats: int, iters: int = 1, sync_ranks: bool = True):
        import torch

        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            if sync_ranks:
                self.env.sync()
            if self.env.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3 / iters)
            else:
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                out.append((time.perf_counter() - t) / iters)
        return out


def median(xs):
    return statistics.median(xs) if xs else None


# -- the JSON --------------------------------------------------------------------------------

def launch_command() -> str:
    """The command that started this process: the launcher's (torchrun) when there is one."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        text = " ".join(parent)
        if "torchrun" in text or "torch.distributed.run" in text:
            if parent and re.search(r"python[0-9.]*$", parent[0]):
                if len(parent) > 1 and parent[1].endswith("torchrun"):
                    parent = parent[1:]
                    parent[0] = "torchrun"
            return " ".join(shlex.quote(a) for a in parent)
    except OSError:
        pass
    return " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)


def metadata(env: Env, script: str) -> dict:
    import torch
    import transformers

    import meshlab

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    d = {
        "script": script,
        "device": env.device_name(),
        "device_type": env.device.type,
        "world_size": env.world,
        "backend": env.backend,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "meshlab": meshlab.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": launch_command(),
        "argv": sys.argv,
        "git_commit": commit,
        "quick": bool(env.args.quick),
        "nvlink_multicast_env": {k: os.environ.get(k) for k in NVLINK_MULTICAST_OFF},
        "meshlab_as_is": bool(env.args.meshlab_as_is),
        "fixups": list(env.fixups),
    }
    if env.cuda:
        d["cuda"] = torch.version.cuda
        try:
            d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            d["nccl"] = None
        d["gpus_per_node"] = torch.cuda.device_count()
    else:
        d["cpu_count"] = os.cpu_count()
    return d


def default_out(env: Env, script: str) -> Path:
    if env.cuda:
        slug = re.sub(r"[^a-z0-9]+", "_", env.device_name().lower()).strip("_")
    else:
        slug = "cpu_dryrun"
    return RESULTS / f"{script}_w{env.world}_{slug}.json"


def write_json(env: Env, script: str, payload: dict) -> Path | None:
    """Rank 0 writes ``metadata + payload``; returns the path (None on other ranks)."""
    if env.rank != 0:
        return None
    path = Path(env.args.out) if env.args.out else default_out(env, script)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**metadata(env, script), **payload}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}", flush=True)
    return path


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)
