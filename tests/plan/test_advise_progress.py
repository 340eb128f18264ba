"""advise's progress bar counts every layout it tries, planned or refused, reaches its
total and closes."""

from __future__ import annotations

import torch

import meshlab as ml
from meshlab.policies import presets


def test_the_bar_reaches_its_total_and_closes(monkeypatch):
    import tqdm.auto

    bars, closed = [], []

    class _Bar(tqdm.auto.tqdm):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "disable": False})
            bars.append(self)

        def close(self):
            closed.append(self.n)
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    model = presets.build("llama3-8b", device="meta", dtype=torch.bfloat16, num_hidden_layers=4,
                          hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                          num_key_value_heads=6, vocab_size=4096)   # tp=4, 8 refused
    advice = ml.advise(model, gpus=16, batch=16, seq=2048, progress=True)
    assert advice.tried and len(bars) == 1
    bar = bars[0]
    assert bar.n == bar.total, (bar.n, bar.total)
    assert bar.total == len(advice.tried) + advice.refused
    assert closed and closed[0] == bar.total
