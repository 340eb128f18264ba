"""``examples/train.py`` runs as a newcomer would start it, on 2 gloo ranks, and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests import REPO

# Both start Python processes that import torch: the slow tier, whatever the durations say.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_train_example_runs_and_its_loss_falls(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "meshlab.cli", "run", "--nproc-per-node", "2",
                        os.path.join(os.fspath(REPO), "examples", "train.py"),
                        "--max_steps=30", "--log_every=5", f"--out_dir={tmp_path / 'out'}"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 7, r.stdout[-2000:]            # steps 0, 5, ..., 25 and the last
    assert losses[-1] < losses[0] - 1.0, losses
    assert "memory per rank" in r.stdout and "Mesh(dp=1, tp=2)" in r.stdout
    assert (tmp_path / "out" / "step30").is_dir(), os.listdir(tmp_path / "out")
    assert elapsed < 60, f"{elapsed:.1f} s"


def test_train_example_refuses_an_unknown_setting(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(os.fspath(REPO), "examples", "train.py"),
                        "--max_stepz=3"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode != 0 and "--max_stepz=3" in r.stderr and "--max_steps=20" in r.stderr
