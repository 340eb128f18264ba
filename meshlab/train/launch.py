"""``notebook_launcher``: run a function on N local CPU processes (gloo) from a notebook.

>>> def train(steps):                         # doctest: +SKIP
...     import meshlab as ml                  # imports inside: it runs in fresh processes
...     mesh = ml.Mesh(dp=2, tp=2)
...     return mesh.rank
>>> notebook_launcher(train, args=(20,), nprocs=4)   # doctest: +SKIP
[0, 1, 2, 3]

The processes are started with the ``spawn`` method (a fresh interpreter each, safe
with torch's threads), so ``fn`` reaches them one of two ways:

* a function of an importable module (``from mytrain import train``) travels by
  reference, the usual pickling;
* a function defined in a notebook cell (or any interactive ``__main__``) cannot be
  imported by a fresh process, so its *source* travels and is defined again there. It
  must then be self-contained: do the imports it needs inside its body, and pass every
  other value through ``args``. A lambda or a function nested in another cannot travel.

``args`` and the return values are pickled. Each process has ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``OMP_NUM_THREADS=1`` set, so ``meshlab.Mesh(...)`` (or ``init_process_group('gloo')``)
joins the group without further arguments. What the processes print to
``sys.stdout``/``sys.stderr`` is shown by the caller (in the notebook).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import queue
import socket
import sys
import textwrap
import time
import traceback

from ..core.errors import ConfigTypeError, check_int, check_number

__all__ = ["notebook_launcher", "RankFailedError"]


class RankFailedError(RuntimeError):
    """A launched process raised (or died); ``rank`` and its ``traceback`` are attached,
    and ``__cause__`` is the original exception when it could be sent back."""

    def __init__(self, message: str, rank: int, tb: str) -> None:
        super().__init__(message)
        self.rank, self.traceback = rank, tb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interactive_main(fn) -> bool:
    main = sys.modules.get("__main__")
    return fn.__module__ == "__main__" and not getattr(main, "__file__", None)


def _payload(fn):
    """('ref', fn) for an importable function, ('src', name, source) for a notebook one."""
    if isinstance(fn, str) or not callable(fn):
        raise ConfigTypeError(f"notebook_launcher: fn must be a function, got "
                              f"{type(fn).__name__}; pass the function itself, e.g. "
                              f"notebook_launcher(train, args=(20,))")
    if not _interactive_main(fn):
        return ("ref", fn)
    if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
        raise ConfigTypeError("notebook_launcher: a lambda or callable object defined in the "
                              "notebook cannot reach fresh processes; define it with `def` "
                              "(imports inside its body) or import it from a module")
    if fn.__code__.co_freevars:
        raise ConfigTypeError(f"notebook_launcher: {fn.__name__} uses variables of an "
                              f"enclosing function ({', '.join(fn.__code__.co_freevars)}); "
                              f"define it at the top level of a cell and pass them through args")
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise ConfigTypeError(f"notebook_launcher: the source of {fn.__name__} is not "
                              f"available ({e}); put it in a module and import it") from None
    return ("src", fn.__name__, src)


def _resolve(payload):
    if payload[0] == "ref":
        return payload[1]
    _, name, src = payload
    filename = f"<notebook function {name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"__name__": "__notebook__", "__builtins__": __builtins__}
    exec(compile(src, filename, "exec"), ns)
    return ns[name]


class _Relay:
    """A text stream that sends what is written to the parent, chunk by chunk."""

    def __init__(self, q, rank: int, name: str) -> None:
        self.q, self.rank, self.name, self.buf = q, rank, name, ""

    def write(self, text: str) -> int:
        self.buf += text
        if "\n" in text or "\r" in text or len(self.buf) > 4096:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self.buf:
            self.q.put(("io", self.rank, self.name, self.buf))
            self.buf = ""

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def _child(rank: int, payload, args: tuple, q, paths: list) -> None:
    import pickle

    sys.path[:0] = [p for p in paths if p not in sys.path]
    sys.stdout, sys.stderr = _Relay(q, rank, "stdout"), _Relay(q, rank, "stderr")
    ok = False
    try:
        msg = ("done", rank, True, _resolve(payload)(*args), None)
        pickle.dumps(msg)  # an unpicklable result is this rank's failure, said here
        ok = True
    except BaseException as e:  # everything goes back to the caller
        tb = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            e = None
        msg = ("done", rank, False, tb, e)
    sys.stdout.flush()
    sys.stderr.flush()
    q.put(msg)
    if ok:  # the result is out; tear down a group fn left behind (best effort)
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
        except Exception:
            pass


@contextlib.contextmanager
def _environ(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop(procs, grace: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def notebook_launcher(fn, args: tuple = (), nprocs: int = 4, *, timeout: float = 600,
                      env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ``nprocs`` local processes; returns each rank's result.

    A process that raises (or dies) stops all of them and raises ``RankFailedError``
    with that rank's traceback; after ``timeout`` seconds every process is killed and
    ``TimeoutError`` raised. ``env`` adds environment variables to every process. See
    the module documentation for which functions can travel to the processes.
    """
    import multiprocessing as mp

    _check_launch_args(args, nprocs, timeout, env)
    payload = _payload(fn)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = []
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        for rank in range(nprocs):
            p = ctx.Process(target=_child, args=(rank, payload, tuple(args), q, list(sys.path)),
                            name=f"meshlab-rank-{rank}", daemon=True)
            with _environ({**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}):
                p.start()
            procs.append(p)
        return _collect(procs, q, nprocs, timeout, payload[0] == "src")
    finally:
        _stop(procs)
        q.close()


def _check_launch_args(args, nprocs, timeout, env) -> None:
    """``notebook_launcher``'s arguments, refused by name before any process starts."""
    check_int(nprocs, "notebook_launcher", "nprocs", example=4)
    if not isinstance(args, (tuple, list)):
        raise ConfigTypeError(f"notebook_launcher(args={args!r}): args is a tuple of the "
                              f"positional arguments fn takes, e.g. args=(20,)")
    check_number(timeout, "notebook_launcher", "timeout", example=600)
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ConfigTypeError(f"notebook_launcher(env={env!r}): env maps variable names to "
                              f"string values, e.g. env={{'OMP_NUM_THREADS': '2'}}")


def _collect(procs, q, nprocs: int, timeout: float, from_source: bool) -> list:
    results: dict[int, object] = {}
    failures: dict[int, tuple] = {}
    start = time.monotonic()
    first_failure_at = None
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    while len(results) + len(failures) < nprocs:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > 5:
            break  # the others are most likely waiting on the failed rank
        if now - start > timeout:
            raise TimeoutError(f"notebook_launcher: ranks "
                               f"{sorted(set(range(nprocs)) - set(results) - set(failures))} "
                               f"did not finish within {timeout:g} s; all processes killed")
        try:
            msg = q.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in results and r not in failures and p.exitcode is not None:
                    # it may have reported just before exiting: drain once more
                    time.sleep(0.2)
                    if q.empty():
                        failures[r] = (f"process exited with code {p.exitcode} without a "
                                       f"result\n", None)
                        first_failure_at = first_failure_at or time.monotonic()
                    break
            continue
        if msg[0] == "io":
            _, rank, name, text = msg
            streams[name].write(text)
            streams[name].flush()
            continue
        _, rank, ok, value, exc = msg
        if ok:
            results[rank] = value
        else:
            failures[rank] = (value, exc)
            first_failure_at = first_failure_at or time.monotonic()
    if failures:
        rank = next(iter(failures))  # the first to fail; the others may have followed it
        tb, exc = failures[rank]
        others = sorted(set(failures) - {rank})
        hint = ""
        if from_source and "NameError" in tb:
            hint = ("\n(the function runs in fresh processes: do the imports it needs inside "
                    "its body and pass other values through args)")
        err = RankFailedError(
            f"rank {rank} of {nprocs} failed"
            + (f" (ranks {others} failed too)" if others else "") + f":\n{tb.rstrip()}{hint}",
            rank, tb)
        raise err from exc
    return [results[r] for r in range(nprocs)]
