"""``step(reduction=)`` reaches a room that runs the whole step itself (the pipeline's
schedule, which weighs each microbatch's loss by it), and only that room: a part with a
``run_step`` hook that leaves the step to ``step`` gets the loss alone."""

from __future__ import annotations

import types

import pytest

import meshlab as ml
from meshlab.train.step import _check_reduction, _default_loss, _default_sum, _Reduce
from meshlab.transforms.compile import GraphSteps


def test_a_room_running_the_step_gets_the_reduction():
    from meshlab.transforms.pipeline._runtime import PipelinePart

    graphs = types.SimpleNamespace(parts=(GraphSteps(),), dp_size=1)
    piped = types.SimpleNamespace(parts=(PipelinePart.__new__(PipelinePart),), dp_size=1)
    for rt in (graphs, piped):
        for reduction in ("mean", "sum", "tokens"):
            _check_reduction(reduction, None, rt)
    with pytest.raises(ml.ConfigError, match="reduction="):
        _check_reduction("median", None, graphs)
    red = _Reduce("sum", None, piped, [None])
    mine = lambda out, batch: out          # noqa: E731
    assert red.room_args(GraphSteps(), None) == (_default_loss,)
    assert red.room_args(GraphSteps(), mine) == (mine,)
    assert red.room_args(piped.parts[0], None) == (_default_sum, red)
    assert red.room_args(piped.parts[0], mine) == (mine, red)
    assert _Reduce("mean", None, piped, [None]).room_args(piped.parts[0], None)[0] \
        is _default_loss
