"""meshlab's tests, by layer (``core``, ``plan``, ``transforms/<room>``, ``train``, ...), with
the helpers they share at this level."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]     # the repository root
