"""The ``HostActivations`` a test's ``parallelize`` builds, for its counters."""

from __future__ import annotations

import pytest

from meshlab.transforms.remat import _offload


@pytest.fixture
def made(monkeypatch):
    """Every ``HostActivations`` built while the test runs, in order."""
    out = []
    init = _offload.HostActivations.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        out.append(self)

    monkeypatch.setattr(_offload.HostActivations, "__init__", record)
    return out
