"""What a logger recorded while a block ran."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def logged(name: str = "meshlab.apply", level: int = logging.WARNING):
    """The messages logger ``name`` emits at ``level`` and above inside the block, as a
    list filled while it runs (meshlab's loggers pass only rank 0's records)."""
    records: list = []
    handler = logging.Handler(level)
    handler.emit = records.append
    log = logging.getLogger(name)
    log.addHandler(handler)
    messages: list[str] = []
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        messages.extend(r.getMessage() for r in records)
