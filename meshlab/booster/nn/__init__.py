"""``...nn.optimizer`` and ``...nn.lr_scheduler``, where Colossal-AI scripts import them."""

from . import lr_scheduler, optimizer  # noqa: F401
