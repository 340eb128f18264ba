"""What the family walk decided, as shipped data: ``support.json`` beside this file.

``{"transformers": version, "torch": version, "families": {model_type: {"outcome": ...,
"reason": ...}}}``, written by ``scripts/support_table.py`` and held equal to a fresh walk
by ``tests/policies/test_family_walk_gloo.py``. ``policies.auto`` reads it.
"""

from __future__ import annotations

import functools
import json
import pathlib

from ..core.errors import PolicyError

PATH = pathlib.Path(__file__).with_name("support.json")


@functools.lru_cache(maxsize=1)
def load() -> dict:
    if not PATH.exists():
        return {"transformers": None, "families": {}}
    return json.loads(PATH.read_text())


def require_trained(model_type: str) -> None:
    """Raise ``PolicyError`` unless the walk trained ``model_type`` to the one-process
    numbers under tensor parallelism."""
    data = load()
    seen = data["families"].get(model_type)
    where = f"transformers {data.get('transformers')}"
    unchecked = (f"To run the translated plan unchecked, pass "
                 f"shard(meshlab.policies.get({model_type!r}), rules); or give specs, or "
                 f"register a policy (docs/policies.md)")
    if seen is None:
        raise PolicyError(
            f"policies.auto: model_type {model_type!r} was not in meshlab's family walk "
            f"({where}), so no parity run shows its tensor-parallel plan trains right. "
            f"{unchecked}")
    if seen["outcome"] != "trained":
        raise PolicyError(
            f"policies.auto refuses model_type {model_type!r}: in meshlab's family walk "
            f"({where}, one step at tp=2 against one process) it was {seen['outcome']}: "
            f"{seen.get('reason', '')}. {unchecked}")
