"""ZeRO-2/3 (FSDP2) with a 16-bit compute precision where FSDP2's mixed precision would
leave float32 tensors beside the ones it casts, and torch would raise inside the forward:
refused by name at plan, with the layouts that run (checked on one process with a fake
mesh; the layouts the messages name train in tests elsewhere)."""

from __future__ import annotations

import pytest
from torch import nn

import meshlab as ml
from tests import _models as M


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_batch_norm_under_fsdp_mixed_precision_is_refused_by_name(stage, prec):
    with pytest.raises(ml.ConfigError, match="bn \\(BatchNorm1d\\) keeps float32 running "
                                             "statistics.*zero_shard\\(1\\) or data_parallel"):
        ml.plan(BatchNormNet(), ml.zero_shard(stage, "dp") | ml.precision(prec),
                ml.Mesh(dp=2, fake=True))
    for spec in (ml.zero_shard(1, "dp") | ml.precision(prec), ml.zero_shard(stage, "dp")):
        assert ml.plan(BatchNormNet(), spec, ml.Mesh(dp=2, fake=True)).runnable


def test_a_packed_projection_fsdp_leaves_whole_is_refused_in_16_bits():
    """GPT-2's c_attn (q|k|v in one Conv1D) under tensor parallelism: FSDP2 cannot shard
    its strided shards again and leaves them whole and float32, beside a bf16 weight."""
    tp = ml.shard(ml.policies.auto)
    mesh = ml.Mesh(dp=1, tp=2, fake=True)
    with pytest.raises(ml.ConfigError, match="c_attn.*stays float32.*zero_shard\\(1\\)"):
        ml.plan(M.build("gpt2"), tp | ml.zero_shard(2, "dp") | ml.precision("bf16"), mesh)
    assert ml.plan(M.build("gpt2"), tp | ml.zero_shard(2, "dp"), mesh).runnable
    assert ml.plan(M.build("gpt2"), tp | ml.zero_shard(1, "dp") | ml.precision("bf16"),
                   mesh).runnable
