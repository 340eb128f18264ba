"""``clear_layout_converter``: Colossal-AI empties its cache of layout conversions between
tests. meshlab's layouts are torch DTensor placements, converted by DTensor's
``redistribute`` with no cache of meshlab's, so there is nothing to clear."""

from __future__ import annotations


def clear_layout_converter() -> None:
    """Nothing to clear (meshlab keeps no layout-conversion cache)."""
