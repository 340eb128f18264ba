"""``precision('fp16')``'s loss-scale bounds hold from the first step: an ``init_scale``
above ``max_scale`` (or below ``min_scale``) stayed outside its bounds, halving on
overflows, until a growth step first clamped it; it now starts at the bound (Colossal-AI's
LowLevelZeroPlugin starts at 2**32, and a script that sets max_scale lower means it)."""

from __future__ import annotations

import pytest

import meshlab as ml
from meshlab.transforms.precision import PrecisionPart


@pytest.mark.parametrize("kw,start", [(dict(init_scale=2.0 ** 20, max_scale=2.0 ** 10), 2.0 ** 10),
                                      (dict(init_scale=2.0, min_scale=16.0), 16.0),
                                      (dict(init_scale=2.0 ** 12, min_scale=1.0,
                                            max_scale=2.0 ** 20), 2.0 ** 12)])
def test_the_scale_starts_within_its_bounds(kw, start):
    scaler = PrecisionPart(ml.precision("fp16", **kw), None, "cpu").scaler()
    assert scaler.scale == start
    scaler.update(True)                    # an overflow halves it, within the bounds still
    assert scaler.scale == max(start / 2, kw.get("min_scale", 0.0))
