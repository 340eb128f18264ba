"""Declared blocks in the plan (``pipeline(blocks=...)``): the stages and what the first
and last stage alone hold, recorded once and read by the memory estimate; the layouts
that leave a parameter to no one stage refused by name; and the stage views, which
chained give the whole model's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshlab as ml
from meshlab.transforms.pipeline import PipelineStages, bubble, stages
from tests import _models as M


def _plan(model, **kw):
    return ml.plan(model, ml.pipeline("pp", blocks="layers", **kw), ml.Mesh(pp=2, fake=True))


def test_declared_blocks_are_the_plans_blocks_and_the_ends_are_recorded():
    model = M.build_staged()
    p = _plan(model)
    assert p.model.blocks == ("layers.0", "layers.1", "layers.2", "layers.3")
    d = p.decision(PipelineStages)
    assert d.before == ("embed", "pos") and d.after == ("norm", "head")
    st = stages(p)
    assert [s.blocks for s in st] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    sizes = {n: t.numel() * 4 for n, t in model.named_parameters()}
    first = sum(v for n, v in sizes.items() if n.split(".")[0] in ("embed", "pos") or
                n.startswith(("layers.0.", "layers.1.")))
    assert st[0].param_bytes == st[0].rank_bytes == first
    assert st[0].param_bytes + st[1].param_bytes == sum(sizes.values())
    assert bubble(p) == pytest.approx(1 / 5)
    assert st[0].param_bytes > st[1].param_bytes
    assert p.memory().params == st[0].param_bytes         # the heaviest rank's parameters
    back = ml.Plan.from_json(p.to_json())
    assert back.decision(PipelineStages) == d and back.model.blocks == p.model.blocks
    inter = _plan(model, schedule="interleaved")
    assert [s.rank for s in stages(inter)] == [0, 1, 0, 1]


def test_a_list_of_block_names():
    model = M.build_staged()
    p = ml.plan(model, ml.pipeline("pp", blocks=["layers.0", "layers.1", "layers.2"]),
                ml.Mesh(pp=2, fake=True))
    assert p.model.blocks == ("layers.0", "layers.1", "layers.2")
    with pytest.raises(ml.ConfigError, match=r"'layers.3' \(holding 'layers.3.qkv.weight'\) "
                                             r"is registered between blocks|"
                                             r"neither before the first block"):
        ml.plan(model, ml.pipeline("pp", blocks=["layers.0", "layers.2"]),
                ml.Mesh(pp=2, fake=True))


@pytest.mark.parametrize("blocks,needle", [
    ("nope", "StagedLM has no module 'nope'"),
    ("norm", "has a RMSNorm at 'norm'; name a ModuleList or ModuleDict"),
    (["layers.1", "layers.0"], "in the order the model registers them"),
    (["layers.0", "layers.0.qkv"], "'layers.0.qkv' lies inside block 'layers.0'"),
    (["layers.0", "ghost"], "has no module(s) ['ghost']"),
])
def test_declared_blocks_that_name_no_blocks_are_refused(blocks, needle):
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(M.build_staged(), ml.pipeline("pp", blocks=blocks), ml.Mesh(pp=2, fake=True))
    assert needle in str(e.value)


@pytest.mark.parametrize("value", [3, "", [], ["a", "a"], ["a", 1]])
def test_the_blocks_argument_is_checked(value):
    with pytest.raises(ml.ConfigError, match="blocks='layers'"):
        ml.pipeline("pp", blocks=value)


def test_repr_and_json_keep_the_blocks():
    t = ml.pipeline("pp", blocks=["h.0", "h.1"])
    assert repr(t) == ("pipeline('pp', schedule='1f1b', microbatches=4, virtual_stages=1, "
                       "blocks=('h.0', 'h.1'))")
    assert ml.Transform.from_json(t.to_json()) == t


class _Rooted(nn.Module):
    """A parameter held by the model itself: every stage would run it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_a_parameter_no_one_stage_holds_is_refused():
    with pytest.raises(ml.ConfigError, match=r"parameter 'scale' is held by _Rooted itself.*"
                                             r"move it into a module registered before"):
        ml.plan(_Rooted(), ml.pipeline("pp", blocks="layers"), ml.Mesh(pp=2, fake=True))


def test_a_model_of_ones_own_without_declared_blocks_is_told_to_declare_them():
    with pytest.raises(ml.PlanError, match=r"declare them: pipeline\(\.\.\., blocks='layers'\)"):
        ml.plan(M.build_staged(), ml.pipeline("pp"), ml.Mesh(pp=2, fake=True))
    with pytest.raises(ml.ConfigError, match=r"pipeline\(\.\.\., blocks='blocks'\)"):
        ml.plan(M.build_hand(), ml.pipeline("pp"), ml.Mesh(pp=2, fake=True))


class _ListLM(nn.Module):
    """The contract on a ModuleList: other stages' entries become pass-throughs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.drop = nn.Dropout(0.0)                   # no parameters: on every stage
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        h = self.drop(self.embed(x)) if self.embed is not None else x
        for block in self.layers:
            h = block(h)
        return self.head(h) if self.head is not None else h


@pytest.mark.parametrize("cls,split", [(_ListLM, ((0,), (1, 2), (3,))),
                                       (M.StagedLM, ((0, 1), (2,), (3,)))])
def test_stage_views_chain_to_the_whole_model(cls, split):
    """Each stage's view holds its blocks and ends only (the model is untouched), and the
    views run one after another give the model's output."""
    from meshlab.transforms.pipeline._blocks import OwnStage, Skipped, stage_view

    torch.manual_seed(0)
    model = cls() if cls is _ListLM else cls(**M.STAGED)
    blocks = tuple(f"layers.{i}" for i in range(4))
    before, after = ("embed",) if cls is _ListLM else ("embed", "pos"), ("head",) if \
        cls is _ListLM else ("norm", "head")
    x = torch.randint(0, 16, (2, 5))
    want = model(x)
    h = x
    for k, ids in enumerate(split):
        mine = tuple(f"layers.{i}" for i in ids)
        view, pairs = stage_view(model, blocks, mine, before, after, k == 0,
                                 k == len(split) - 1)
        held = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers") else "")
                for n, _ in view.named_parameters()}
        assert held == set(mine) | (set(before) if k == 0 else set()) | \
            (set(after) if k == len(split) - 1 else set())
        if cls is _ListLM:
            assert len(view.layers) == 4 and sum(isinstance(b, Skipped)
                                                 for b in view.layers) == 4 - len(ids)
        h = OwnStage(model, view, pairs, width=8)(h)
    torch.testing.assert_close(h, want)
    assert len(list(model.layers)) == 4 and model.embed is not None       # untouched


def test_stages_are_balanced_by_compute_not_bytes():
    """Llama-3-8B at pp=4: its embedding is as large as two blocks and a lookup, its head
    as large and a product. Balanced by bytes the first stage got 7 blocks (7/9/9/7); by
    the matmul weights each token meets, the last stage, which runs the head, gets the
    fewest (9/9/9/5), and the schedule replayed at the stages' profiled costs leaves the
    busiest rank less idle."""
    from meshlab import presets
    from meshlab.estimate import pipeline as replay

    model = presets.build("llama3-8b", device="meta")
    p = ml.plan(model, ml.precision("bf16") | ml.pipeline("pp", schedule="1f1b", microbatches=8),
                ml.Mesh(pp=4, fake=True))
    assert [len(s.blocks) for s in stages(p)] == [9, 9, 9, 5]
    even = ml.plan(model, ml.precision("bf16") | ml.pipeline(
        "pp", schedule="1f1b", microbatches=8, layers_per_stage=(7, 9, 9, 7)),
        ml.Mesh(pp=4, fake=True))
    assert replay.bubble(p, batch=8, seq=4096) < replay.bubble(even, batch=8, seq=4096)


def test_a_fused_loss_with_declared_blocks_is_refused():
    """The fused loss runs on a Hugging Face decoder's last stage (its final norm, then the
    head); with declared blocks the last stage ends in the model's own code."""
    with pytest.raises(ml.ConfigError, match=r"fuse\('loss'\) with pipeline\(blocks=\.\.\.\)"):
        ml.plan(M.build("llama", num_hidden_layers=4),
                ml.pipeline("pp", blocks="model.layers") | ml.fuse("loss"),
                ml.Mesh(pp=2, fake=True))
