"""``meshlab.parallel``: the transforms under the path earlier releases used.

The rooms live in ``meshlab.transforms``; ``meshlab.parallel.<room>`` is the same module
object as ``meshlab.transforms.<room>`` (no second copy is imported).
"""

import importlib as _importlib
import sys as _sys

from .. import transforms as _transforms

globals().update({k: v for k, v in vars(_transforms).items() if not k.startswith("_")})

ROOMS = ("shard", "zero", "precision", "remat", "pipeline", "sequence", "fuse", "offload",
         "expert", "lora", "compile", "step_in_backward")
for _room in ROOMS:
    _mod = _importlib.import_module(f"meshlab.transforms.{_room}")
    _sys.modules[f"{__name__}.{_room}"] = _mod
    globals().setdefault(_room, _mod)   # where a room's function has its name, it wins
del _room, _mod
