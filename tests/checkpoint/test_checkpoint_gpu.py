"""An asynchronous save from a CUDA device: the state is staged into pinned host buffers
before ``save`` returns (later updates do not reach the file), the next save reuses the
same buffers, and both checkpoints load back exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshlab as ml

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_async_saves_stage_into_pinned_buffers_they_reuse(tmp_path):
    from meshlab.checkpoint import _dcp

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 64, device="cuda")).sum().backward()
    opt.step()
    before = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    ml.checkpoint.save(tmp_path / "a", m, opt, async_save=True)
    buffers = {k: v.data_ptr() for k, v in _dcp._PINNED.items()}
    assert buffers and all(v.is_pinned() for v in _dcp._PINNED.values())
    with torch.no_grad():                      # later updates must not reach the file
        for p in m.parameters():
            p.add_(100.0)
    ml.checkpoint.save(tmp_path / "b", m, opt, async_save=True)   # waits for "a" first
    assert {k: v.data_ptr() for k, v in _dcp._PINNED.items()} == buffers
    ml.checkpoint.wait()
    after = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    other = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).cuda()
    ml.checkpoint.load(tmp_path / "a", other)
    assert all(torch.equal(before[k], v.cpu()) for k, v in other.state_dict().items())
    ml.checkpoint.load(tmp_path / "b", other)
    assert all(torch.equal(after[k], v.cpu()) for k, v in other.state_dict().items())
