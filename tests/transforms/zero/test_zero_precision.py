"""ZeRO-2/3 (FSDP2) with a 16-bit compute precision where FSDP2's mixed precision leaves
float32 tensors beside the ones it casts (a BatchNorm's running statistics, which
batch_norm does not take beside 16-bit weights): the data room's BatchNorm forward runs
them, and the plan records it (checked on one process with a fake mesh). The parameters
FSDP2 leaves whole are cast as it casts the others, and plan."""

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
def test_batch_norm_under_fsdp_mixed_precision_plans(stage, prec):
    """A BatchNorm's weights cast to 16 bits beside its float32 running statistics, which
    batch_norm does not take together: its forward is the data room's (statistics in
    float32), recorded in the plan even on one data rank (trained against one process in
    test_batch_statistics_gloo.py)."""
    from meshlab.transforms.zero._batchnorm import BatchStatistics

    for dp in (1, 2):
        p = ml.plan(BatchNormNet(), ml.zero_shard(stage, "dp") | ml.precision(prec),
                    ml.Mesh(dp=dp, fake=True))
        assert p.runnable and p.decision(BatchStatistics) == BatchStatistics(("bn",), ("dp",))
    p = ml.plan(BatchNormNet(), ml.zero_shard(1, "dp") | ml.precision(prec),
                ml.Mesh(dp=1, fake=True))
    assert p.runnable and p.decision(BatchStatistics) is None     # autocast: no cast


def test_a_packed_projection_fsdp_leaves_whole_plans_in_16_bits():
    """GPT-2's c_attn (q|k|v in one Conv1D) under tensor parallelism: FSDP2 cannot shard
    its bias's strided shards again and leaves it whole; in 16 bits it is cast to the
    compute dtype for the forward as FSDP2 casts the weight beside it, and its gradient is
    averaged over the data axes by the backward's reduction (trained against one process:
    test_zero_precision_gloo.py)."""
    from meshlab.transforms.zero import ZeroShard, fsdp_ignored

    tp = ml.shard(ml.policies.auto)
    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    for stage in (2, 3):
        for prec in ("bf16", "fp16"):
            p = ml.plan(M.build("gpt2"), tp | ml.zero_shard(stage, "dp") | ml.precision(prec),
                        mesh)
            assert p.runnable
            whole = fsdp_ignored(p)
            assert whole == {f"transformer.h.{i}.attn.c_attn.bias" for i in range(2)}
            (r,) = p.get(ZeroShard).reductions(p)
            assert r.names == whole and r.axes == ("dp",) and r.average
    # a 2-D spec (FSDP by spec) keeps Qwen2's q/k/v biases whole on the data axis
    p = ml.plan(M.build("qwen2"), M.spec("tp_fsdp_2d") | ml.precision("bf16"), mesh)
    assert p.runnable and len(fsdp_ignored(p)) == 6
