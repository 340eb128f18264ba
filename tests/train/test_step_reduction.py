"""``step(reduction=)``'s refusal is for a room that runs the whole step itself (the
pipeline's schedule), not for every part that has a ``run_step`` hook."""

from __future__ import annotations

import types

import pytest

import meshlab as ml
from meshlab.train.step import _check_reduction
from meshlab.transforms.compile import GraphSteps


def test_only_a_room_running_the_step_refuses_a_reduction():
    from meshlab.transforms.pipeline._runtime import PipelinePart

    graphs = types.SimpleNamespace(parts=(GraphSteps(),))
    _check_reduction("sum", None, graphs)                 # CUDA graphs: the step is ours
    piped = types.SimpleNamespace(parts=(PipelinePart.__new__(PipelinePart),))
    with pytest.raises(ml.ConfigError, match="pipeline"):
        _check_reduction("tokens", None, piped)
    _check_reduction("mean", None, piped)
    with pytest.raises(ml.ConfigError, match="reduction="):
        _check_reduction("median", None, graphs)
