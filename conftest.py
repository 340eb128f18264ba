"""Collection settings for the docstring examples (``pytest --doctest-modules meshlab``)."""

import importlib.util
from pathlib import Path

# The Triton kernel files import triton at the top; they are loaded only for CUDA tensors,
# and a CPU-only machine has no triton to import them with.
collect_ignore = [] if importlib.util.find_spec("triton") else sorted(
    str(p.relative_to(Path(__file__).parent))
    for p in Path(__file__).parent.glob("meshlab/ops/_triton*.py"))


# The C++ kernels build on first use, one after another as the examples and tests reach
# them; the whole suite starts all three at once, side by side in the background, and
# waits for them at its end (a build cut off would leave its folder locked).
_BUILDS = []


def pytest_sessionstart(session):
    import os
    import threading

    if os.environ.get("MESHLAB_OPS_NATIVE", "1") != "0":
        from meshlab.ops import _build

        _BUILDS.append(threading.Thread(target=_build.build_all, daemon=True))
        _BUILDS[0].start()


def pytest_sessionfinish(session, exitstatus):
    for t in _BUILDS:
        t.join()
