"""A data loader's saved position (``MeshDataLoader.state_dict``), one process.

Before, ``load_state_dict`` kept the position only for the next pass: a save made after a
load but before that pass recorded the start of the epoch (a resumed run then read 6 of a
10-sample epoch's samples twice), and a position saved after an epoch's last batch made
the resumed run's first pass an empty one (a loop over epochs trained one fewer)."""

from __future__ import annotations

import torch

from meshlab.train.data import MeshDataLoader


def _loader():
    g = torch.Generator().manual_seed(0)
    return MeshDataLoader(torch.arange(10), batch_size=2, shuffle=True, generator=g)


def test_a_save_before_the_first_batch_after_a_load_keeps_the_position():
    dl = _loader()
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(3)]
    state = dl.state_dict()
    assert state == {"epoch": 0, "served": 3}
    again = _loader()
    again.load_state_dict(state)
    assert again.state_dict() == state           # saved again before reading anything
    third = _loader()
    third.load_state_dict(again.state_dict())
    rest = [b.tolist() for b in third]
    flat = sorted(x for b in seen + rest for x in b)
    assert flat == list(range(10)), (seen, rest)     # each sample of the epoch once


def test_a_position_at_an_epochs_end_resumes_at_the_next_epoch():
    dl = MeshDataLoader(torch.arange(10), batch_size=2)
    first = [b.tolist() for b in dl]
    dl2 = MeshDataLoader(torch.arange(10), batch_size=2)
    dl2.load_state_dict({"epoch": 0, "served": len(first)})
    assert dl2.state_dict() == {"epoch": 1, "served": 0}
    assert [b.tolist() for b in dl2] == first        # a whole pass, not an empty one
    assert dl2.state_dict() == {"epoch": 2, "served": 0}
