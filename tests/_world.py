"""A pool of real gloo processes that lives for a test module and runs many cases.

Importing torch costs seconds per process, so each module starts its world once
(``World(4)``) and sends it cases: importable functions ``fn(rank, world, **kw)`` that
run on every rank. A case that raises on any rank fails with every rank's traceback; a
case that does not finish within its timeout fails as a hang and the world is torn down.

Workers are forked from one forkserver per test session that has imported torch,
transformers' model classes and meshlab already (:data:`PRELOAD`), so a world starts in
well under a second instead of each process importing them again. The server runs no
torch op, so no thread pool exists when a worker is forked; each worker sets its own
environment and ``sys.path``.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, paths: list, inq, outq, env: dict) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    # a rank that hangs prints where each of its threads stands when the harness asks
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    while True:
        msg = inq.get()
        if msg is None:
            break
        mod, name, kw = msg
        try:
            fn = getattr(importlib.import_module(mod), name)
            out = fn(rank, world, **kw)
            outq.put((rank, True, out))
        except BaseException:  # report everything, the harness decides
            outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# Imported once by the forkserver, before any worker is forked from it (a name that fails
# to import is skipped by multiprocessing, and then imported by each worker as before).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers",
           "meshlab", "tests._models"] + [
    f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "mistral", "gpt2",
                                                     "bert")]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class World:
    """``n`` gloo processes; ``run(fn, **kw)`` returns the per-rank results."""

    def __init__(self, n: int, env: dict | None = None) -> None:
        self.n = n
        ctx = _context()
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(n)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, n, port, list(sys.path), self.inqs[r],
                                              self.outq, dict(env or {})), daemon=True)
            for r in range(n)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, timeout: float = 240, **kw) -> list:
        if not all(p.is_alive() for p in self.procs):
            raise RuntimeError("a worker of this world died earlier; see the failures above")
        for q in self.inqs:
            q.put((fn.__module__, fn.__name__, kw))
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.n:
            try:
                rank, ok, out = self.outq.get(timeout=min(1.0, max(0.0, deadline -
                                                                     time.monotonic())))
                results[rank] = (ok, out)
                continue
            except queue.Empty:
                pass
            missing = sorted(set(range(self.n)) - set(results))
            dead = [r for r in missing if not self.procs[r].is_alive()]
            if dead and len(dead) == len(missing):     # every rank left has reported
                self.close(force=True)
                raise AssertionError(f"{fn.__name__}: ranks {dead} died (the others "
                                     f"reported); world torn down")
            if time.monotonic() >= deadline:
                self._dump_stacks(missing)
                self.close(force=True)
                raise AssertionError(f"{fn.__name__}: ranks {missing} did not finish within "
                                     f"{timeout}s (hang; their stacks are in the captured "
                                     f"stderr); world torn down")
        bad = {r: out for r, (ok, out) in results.items() if not ok}
        if bad:
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(bad)}:\n" +
                                 "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(bad.items())))
        return [results[r][1] for r in range(self.n)]

    def _dump_stacks(self, ranks: list) -> None:
        """Ask each hung rank for its threads' stacks (faulthandler, on its stderr)."""
        import signal

        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(2.0)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.inqs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
