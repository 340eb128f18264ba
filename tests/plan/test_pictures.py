"""The plan's pictures: the memory per rank and the pipeline schedule drawn from a plan
(``MemoryEstimate.plot``, ``pipeline.plot_schedule``, ``meshlab plan --pictures``) are
valid PNG images, and what they draw is the plan's: the bars' bytes are the estimate's
categories, stacked to its peak, and the schedule's boxes are the replayed events, rank by
rank, with the idle share of the text picture."""

from __future__ import annotations

import pytest
import torch

import meshlab as ml
from meshlab.policies import presets

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _plan(pp: bool):
    model = presets.build("llama3-8b", device="meta", dtype=torch.bfloat16, num_hidden_layers=8)
    spec = ml.shard(ml.policies.auto) | ml.zero_shard(1, "dp")
    if pp:
        spec = spec | ml.pipeline("pp", microbatches=8)
    mesh = ml.Mesh(**({"pp": 4} if pp else {}), dp=2, tp=4, fake=True)
    return ml.plan(model, spec, mesh)


def _png(fig, path):
    from PIL import Image

    fig.savefig(path, dpi=80)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
        assert im.size[0] > 100 and im.size[1] > 100


def test_memory_picture_draws_the_estimate(tmp_path):
    mem = _plan(False).memory(batch=2, seq=1024)
    ax = mem.plot(gpu="h100")
    drawn = [(c.get_label(), c[0].meshlab_bytes) for c in ax.containers]
    assert drawn == [(k, b) for k, b in mem.bars() if b > 0]
    assert [k for k, _ in drawn[:3]] == ["params", "grads", "optimizer"]
    assert sum(b for _, b in drawn) == mem.peak
    top = max(r.get_y() + r.get_height() for r in ax.patches)
    assert abs(top - mem.peak / 2 ** 30) < 1e-9
    texts = {t.get_text() for t in ax.texts}
    from meshlab.core.units import fmt_bytes

    assert {f"{k}: {fmt_bytes(b)}" for k, b in drawn} <= texts
    _png(ax.figure, tmp_path / "memory.png")


def test_schedule_picture_draws_the_replayed_events(tmp_path):
    from meshlab.transforms.pipeline import draw_schedule, plot_schedule, simulate

    p = _plan(True)
    ax = plot_schedule(p)
    events = sorted(simulate(p))
    drawn = sorted(e for c in ax.collections for e in c.meshlab_events)
    assert drawn == events
    for c in ax.collections:          # each box at its event's time, on its rank's row
        for path, (r, t0, t1, *_) in zip(c.get_paths(), c.meshlab_events):
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            assert (xs.min(), xs.max()) == pytest.approx((t0, t1))
            assert ys.min() == pytest.approx(r - 0.4) and ys.max() == pytest.approx(r + 0.4)
    idle = draw_schedule(p).rsplit("idle ", 1)[1].rstrip(")")
    assert f"idle {idle}" in ax.get_title()
    _png(ax.figure, tmp_path / "schedule.png")


def test_plan_command_writes_both(tmp_path, capsys):
    from meshlab import cli

    out = tmp_path / "pics"
    assert cli.main(["plan", "--model", "llama3-8b", "--mesh", "pp=2,dp=2,tp=2", "--batch",
                     "2", "--seq", "512", "--pictures", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["memory.png", "schedule.png"]
    assert "picture written to" in capsys.readouterr().out
