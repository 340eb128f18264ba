"""Where the single-GPU benchmarks write their JSON: ``benchmarks/results/<prefix>_<card>.json``,
and a copy in ``--copy-to`` when given (the device tool brings files back from there)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def card_slug(name: str) -> str:
    """``h200`` for any H200, else the device name in lower snake case."""
    return "h200" if "H200" in name else name.replace(" ", "_").lower()


def write(prefix: str, card: str, out: dict, copy_to: str | None = None) -> Path:
    """Write ``out`` as ``results/<prefix>_<card_slug(card)>.json`` (and into ``copy_to``)."""
    name = f"{prefix}_{card_slug(card)}.json"
    text = json.dumps(out, indent=1)
    path = RESULTS / name
    path.write_text(text)
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        Path(copy_to, name).write_text(text)
    return path


def cpu_model() -> str:
    """This machine's CPU model, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_run(script: str, **fields) -> dict:
    """The head of a CPU benchmark's JSON: which script, on which CPU and host, with which
    versions, when and how it was called; then ``fields``."""
    import datetime
    import socket
    import sys

    import torch

    return {"script": script, "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "host": socket.gethostname(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), **fields}


def write_cpu(prefix: str, tag: str, out: dict) -> Path:
    """Write ``out`` as ``results/<prefix>_<tag>.json``."""
    path = RESULTS / f"{prefix}_{tag}.json"
    path.write_text(json.dumps(out, indent=1))
    return path


def two_ranks(worker, *args, timeout: float = 1800):
    """Run ``worker(rank, port, *args, queue)`` in two spawned processes (a gloo job on
    this host, at a free port) and return what rank 0 puts on the queue."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return out
