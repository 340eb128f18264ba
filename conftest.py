"""Collection settings for the docstring examples (``pytest --doctest-modules meshlab``)."""

import importlib.util
import os
from pathlib import Path

# The side-by-side suites against JAX (tests/core/test_jax_conformance*.py) run JAX on 4
# host devices in this process; XLA reads the flag once, when jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

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
    for t in _BUILDS:       # a build runs the reference after BUILD_WAIT_S; never wait forever
        t.join(timeout=60)
    if session.config.getoption("--record-durations", default=False):
        _write_durations()


# -- the suite's durations and its fast tier ------------------------------------------
# tests/durations.json holds the seconds each test took in the last full run (setup, call
# and teardown), refreshed by `make durations` when tests are added. The fast tier
# (`make test-fast`, `-m "not slow"`) leaves out every test recorded at FAST_LIMIT seconds
# or more and every test that starts gloo processes; a test not recorded yet counts as fast.
DURATIONS = Path(__file__).parent / "tests" / "durations.json"
FAST_LIMIT = 0.5
_TIMES: dict = {}


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write each test's seconds into tests/durations.json")


def _recorded() -> dict:
    import json

    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_collection_modifyitems(config, items):
    import pytest

    recorded = _recorded()
    for item in items:
        t = recorded.get(item.nodeid)
        if (t is not None and t >= FAST_LIMIT) or {"world2", "world4"} & set(
                getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report):
    _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration


def _write_durations() -> None:
    import json

    merged = {**_recorded(), **{k: round(v, 2) for k, v in _TIMES.items()}}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
