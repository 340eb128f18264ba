"""meshlab's one logger, ``logging.getLogger("meshlab")``, aware of ranks.

Every module logs through :func:`get_logger` (a child: ``meshlab.<module>``). Under
``torch.distributed`` only rank 0's records pass by default, so a message is said once per
job rather than once per process; ``MESHLAB_LOG_RANKS=all`` lets every rank's through,
each prefixed with its rank. The level comes from ``MESHLAB_LOG_LEVEL`` (a name such as
``DEBUG`` or ``INFO``; default ``WARNING``). meshlab adds one stderr handler to its logger
only where the application configured none (``logging.basicConfig`` or a handler of its
own on the root logger take over, as the ``logging`` module intends).

Progress bars are not log records. They show on rank 0 only: a checkpoint's save, load
and exports where stderr is a terminal, ``advise``'s where ``progress=True`` asks;
``MESHLAB_PROGRESS=1`` shows the checkpoint's wherever stderr goes (a log file),
``MESHLAB_PROGRESS=0`` hides every bar (``meshlab.core.progress``).

>>> import logging
>>> from meshlab.core.log import get_logger
>>> get_logger("meshlab.apply").name
'meshlab.apply'
>>> get_logger("meshlab.apply").parent is logging.getLogger("meshlab")
True
"""

from __future__ import annotations

import logging
import os

from .errors import ConfigError

ROOT = "meshlab"
_CONFIGURED = False


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):
        pass
    r = os.environ.get("RANK")
    return int(r) if r is not None and r.isdigit() else None


class RankFilter(logging.Filter):
    """Passes rank 0's records (and every record outside a distributed job) unless
    ``MESHLAB_LOG_RANKS=all``; stamps each record with ``rank``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = "-" if rank is None else rank
        every = os.environ.get("MESHLAB_LOG_RANKS", "0").strip().lower() == "all"
        return every or rank in (None, 0)


def _level() -> int:
    name = os.environ.get("MESHLAB_LOG_LEVEL", "WARNING").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ConfigError(f"MESHLAB_LOG_LEVEL={name!r}: one of DEBUG, INFO, WARNING, ERROR, "
                          f"CRITICAL")
    return level


def _configure() -> None:
    global _CONFIGURED
    if _CONFIGURED:
        return
    _CONFIGURED = True
    root = logging.getLogger(ROOT)
    root.setLevel(_level())
    if not logging.getLogger().handlers and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s rank %(rank)s] %(levelname)s: "
                                               "%(message)s"))
        root.addHandler(handler)
        root.propagate = False


def get_logger(name: str = ROOT) -> logging.Logger:
    """The logger ``name`` under ``meshlab`` (configured on first use: level, rank filter)."""
    _configure()
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    logger = logging.getLogger(name)
    # A logger's filters see only the records logged on it (not its children's), so each
    # of meshlab's loggers carries one.
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
    return logger


def require(module: str, extra: str, what: str):
    """Import ``module`` for ``what``, or raise ``ImportError`` naming the extra that
    installs it (``pip install 'meshlab[extra]'``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise
        raise MissingExtraError(f"{what} needs {module.split('.')[0]}, which meshlab installs "
                                f"as an extra: pip install 'meshlab[{extra}]'") from None


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra."""
