"""Progress bars for long work (a checkpoint's save, load and export; advise's search),
shown once per job and never in logs.

A bar shows on rank 0 only (every process outside a distributed job counts as rank 0), and
there only where stderr is a terminal, unless ``MESHLAB_PROGRESS`` says otherwise: ``1``
shows it wherever stderr goes (a log file, a notebook's captured output), ``0`` never. A
caller that takes its own switch (``advise(progress=True)``) passes it as ``on``, which
replaces the terminal test; ``MESHLAB_PROGRESS=0`` still turns every bar off.

:func:`bar` is a context manager around ``tqdm``: whatever the loop does, the bar is
closed on the way out, so a failing loop leaves no half-drawn line behind.

>>> from meshlab.core.progress import bar
>>> with bar(3, "export", unit="tensor", on=False) as b:
...     for _ in range(3):
...         b.update(1)
"""

from __future__ import annotations

import contextlib
import os
import sys

from .errors import ConfigError
from .log import _rank

ENV = "MESHLAB_PROGRESS"
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


def _env() -> bool | None:
    """``MESHLAB_PROGRESS`` as a switch: True, False, or None where it is unset or empty."""
    raw = os.environ.get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ConfigError(f"{ENV}={raw!r}: 1 shows progress bars (on rank 0), 0 hides them; "
                      f"unset, they show where stderr is a terminal")


def _terminal() -> bool:
    err = sys.stderr
    try:
        return err is not None and err.isatty()
    except (AttributeError, ValueError):      # a closed or a file-like stream
        return False


def shown(on: bool | None = None) -> bool:
    """Whether a progress bar shows in this process: ``MESHLAB_PROGRESS=0`` hides every bar;
    else only rank 0's shows, when ``on`` (the caller's own switch) is true, or, where the
    caller left it to the user (``None``), when ``MESHLAB_PROGRESS=1`` or stderr is a
    terminal. The variable is read (and checked) on every rank alike."""
    env = _env()
    if env is False or on is False:
        return False
    if _rank() not in (None, 0):
        return False
    if on is True or env is True:
        return True
    return _terminal()


@contextlib.contextmanager
def bar(total: int | None, desc: str, *, unit: str = "it", on: bool | None = None, **kw):
    """A ``tqdm`` bar over ``total`` units (``b.update(n)`` advances it; ``b.total`` may be
    set later, where the loop learns it once planned), disabled where :func:`shown` says
    so and closed however the block ends. ``kw`` goes to ``tqdm`` (``leave``,
    ``unit_scale`` for bytes, ...)."""
    from tqdm.auto import tqdm

    b = tqdm(total=total, desc=desc, unit=unit, disable=not shown(on), **kw)
    try:
        yield b
    finally:
        b.close()


def byte_bar(total: int, desc: str, *, on: bool | None = None, **kw):
    """:func:`bar` over ``total`` bytes, shown in KiB, MiB, GiB."""
    return bar(total, desc, unit="B", on=on, unit_scale=True, unit_divisor=1024, **kw)
