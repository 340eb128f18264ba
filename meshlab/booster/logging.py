"""Colossal-AI's ``get_dist_logger``: a ``logging.Logger`` whose calls take
``ranks=[...]`` (log on those ranks only; all ranks without it)."""

from __future__ import annotations

import logging

import torch.distributed as dist


class DistributedLogger:
    """A ``logging.Logger`` (``.logger``) whose level methods take ``ranks=``."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        if not self.logger.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            self.logger.addHandler(h)
            self.logger.setLevel(logging.INFO)

    def _log(self, level: int, message: str, ranks=None) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if ranks is None or rank in ranks:
            self.logger.log(level, message, stacklevel=3)

    def info(self, message: str, ranks=None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks=None) -> None:
        self._log(logging.WARNING, message, ranks)

    def debug(self, message: str, ranks=None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def error(self, message: str, ranks=None) -> None:
        self._log(logging.ERROR, message, ranks)

    def set_level(self, level) -> None:
        self.logger.setLevel(level)


def get_dist_logger(name: str = "colossalai") -> DistributedLogger:
    """The logger of ``name`` (``logging.getLogger(name)`` underneath: one per name)."""
    return DistributedLogger(name)
