"""Rank agreement: before a collective section, every rank says what it is about to run.

A rank that disagrees with its peers (another spec, mesh, model config, batch shape; or an
error raised on it alone) would otherwise hang the others inside a collective, or feed
them mismatched data. ``agree`` is the one exchange that prevents both: each rank
contributes the section it is entering (``what``), a digest and a short readable value of
every field, and the error it hit (if any), over the gloo control group; then every rank
runs the same test on the same table and either all continue or all raise:

* ``PeerError`` on every rank when one rank failed (the failed rank re-raises its own
  error, the others name it and its message);
* ``RankMismatchError`` when ranks are in different sections (one saving while the others
  step) or a field differs, naming the field and which ranks hold which value.

Some values must be equal only among certain ranks: the batch among the tensor-parallel,
sequence and pipeline peers that read it together (not along the data axes), a
parameter's shard among its replicas. ``peers`` carries them: each name with a key and a
value (and, optionally, what to do when they differ), compared among the ranks that give
the same key; a rank without the name is not compared.

An error raised here is marked (``agreed``): every rank that took part raised at the same
exchange, so a caller that catches it need not tell the others again.

The exchange is JSON bytes in tensors (two all-gathers; nothing is unpickled), bounded by
the group's timeout.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import PeerError, RankMismatchError

_SHORT = 120          # characters of a field's readable value carried for messages


def digest(value: Any) -> str:
    """A stable 16-hex digest of a JSON-able value (or of its ``repr``)."""
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _entry(what: str, fields: Mapping[str, Any], error: BaseException | None,
           peers: Mapping[str, tuple[Any, Any]], shared: Any = None) -> bytes:
    out = {"what": what, "shared": shared,
           "fields": {k: [digest(v), _short(v)] for k, v in fields.items()},
           "peers": {k: [digest(p[0]), _short(p[0]), digest(p[1]), _short(p[1])]
                     for k, p in peers.items()},
           "error": None if error is None else f"{type(error).__name__}: {error}"[:600]}
    return json.dumps(out).encode()


def _short(v: Any) -> str:
    s = v if isinstance(v, str) else repr(v)
    return s if len(s) <= _SHORT else s[:_SHORT - 3] + "..."


_ACTIVE = [0]         # > 0 while an exchange runs


def active() -> bool:
    """Whether the collective now running is an agreement exchange (control traffic, run
    with dispatch modes off: only a counter installed below them sees it)."""
    return _ACTIVE[0] > 0


def _exchange(payload: bytes, group, timeout: float | None) -> list[dict]:
    from torch.utils._python_dispatch import _disable_current_modes

    _ACTIVE[0] += 1
    try:
        # Control traffic on the host beside the model's: a dispatch mode counting what
        # a forward communicates or reads back (CommDebugMode) does not see it.
        with _disable_current_modes():
            return _gather_json(payload, group, timeout)
    finally:
        _ACTIVE[0] -= 1


def _gather_json(payload: bytes, group, timeout: float | None) -> list[dict]:
    import datetime

    n = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    work = dist.all_gather(sizes, size, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:        # the first exchange bounds how long a missing rank is waited for
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    width = int(max(int(s) for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[:int(s)].tolist()).decode()) for b, s in zip(bufs, sizes)]


def agreed(error: BaseException) -> bool:
    """Whether ``error`` was raised by an agreement (on every rank that took part)."""
    return getattr(error, "_meshlab_agreed", False)


def _mark(error: BaseException) -> BaseException:
    error._meshlab_agreed = True
    return error


def alone(group) -> bool:
    """Whether an agreement over ``group`` exchanges nothing (no group, one rank, or
    torch's fake backend, which dry-runs large meshes without processes)."""
    return group is None or not dist.is_initialized() or dist.get_world_size(group) == 1 \
        or dist.get_backend(group) == "fake"


def agree(group, what: str, fields: Mapping[str, Any] | None = None,
          error: BaseException | None = None, *, timeout: float | None = None,
          peers: Mapping[str, tuple] | None = None, shared: Any = None) -> list:
    """Every rank of ``group`` enters section ``what`` with equal ``fields``, and none
    failed (``error``): or every rank raises (see the module doc). ``peers``: name ->
    (key, value) or (key, value, fix), equal among the ranks that give the same key (the
    message names the first that differs and ends with ``fix``). ``timeout`` bounds the
    wait for the other ranks (default: the group's own timeout). ``shared``: a JSON value
    each rank hands the others, not compared; returned, every rank's in rank order (this
    rank's alone where nothing is exchanged)."""
    if alone(group):
        if error is not None:
            raise error
        return [shared]
    try:
        table = _exchange(_entry(what, fields or {}, error, peers or {}, shared), group,
                          timeout)
    except RuntimeError as e:        # gloo's timeout or a peer that exited
        within = f"within {timeout:g} s" if timeout is not None else \
            "within the control group's timeout"
        raise _mark(PeerError(
            f"{what} is collective: every rank must call it, but not every rank entered it "
            f"{within} (a rank stopped, or is elsewhere): {e}")) from None
    ranks = dist.get_process_group_ranks(group)
    try:
        _raise_failed(table, ranks, what, error)
        _raise_sections(table, ranks)
        _raise_fields(table, ranks, what)
        _raise_peers(table, ranks, what, peers or {})
    except BaseException as e:       # marked, then raised as it is
        raise _mark(e)
    return [e.get("shared") for e in table]


def _raise_failed(table, ranks, what, error) -> None:
    bad = [(r, e["error"]) for r, e in zip(ranks, table) if e["error"]]
    if not bad:
        return
    if error is not None:
        raise error
    r, msg = bad[0]
    others = f" (and ranks {[b for b, _ in bad[1:]]})" if len(bad) > 1 else ""
    raise PeerError(f"{what}: rank {r}{others} failed, so every rank stops here instead of "
                    f"waiting for it in a collective: {msg}")


def _raise_sections(table, ranks) -> None:
    whats: dict = {}
    for r, e in zip(ranks, table):
        whats.setdefault(e["what"], []).append(r)
    if len(whats) > 1:
        parts = "; ".join(f"ranks {rs} in {w}" for w, rs in whats.items())
        raise RankMismatchError(
            f"the ranks are in different collective calls ({parts}); every rank must make "
            f"the same meshlab calls in the same order (a rank whose data ran out must stop "
            f"with the others, e.g. give every rank the same number of batches)")


def _raise_fields(table, ranks, what) -> None:
    for name in table[0]["fields"]:
        held: dict = {}
        for r, e in zip(ranks, table):
            d, short = e["fields"].get(name, ["<missing>", "<missing>"])
            held.setdefault(d, (short, []))[1].append(r)
        if len(held) > 1:
            parts = "; ".join(f"ranks {rs}: {short}" for short, rs in held.values())
            raise RankMismatchError(
                f"{what}: the ranks disagree on {name} ({parts}); every rank must run the "
                f"same program on the same kind of input")


def _raise_peers(table, ranks, what, mine: Mapping[str, tuple]) -> None:
    names = list(dict.fromkeys(n for e in table for n in e.get("peers", {})))
    for name in names:
        scopes: dict = {}          # key digest -> (key, {value digest: (short, ranks)})
        for r, e in zip(ranks, table):
            got = e.get("peers", {}).get(name)
            if got is None:
                continue
            kd, key, vd, short = got
            scopes.setdefault(kd, (key, {}))[1].setdefault(vd, (short, []))[1].append(r)
        # every rank runs the same code: the fix is this rank's own (not sent)
        own = mine.get(name, ())
        fix = own[2] if len(own) > 2 else ""
        for key, held in scopes.values():
            if len(held) > 1:
                parts = "; ".join(f"ranks {rs}: {short}" for short, rs in held.values())
                raise RankMismatchError(
                    f"{what}: {name} differs among ranks that must hold the same ({key}: "
                    f"{parts}); {fix or 'every rank must run the same program on the same data'}")
