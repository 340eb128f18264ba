"""The README's example runs as written, on 4 CPU processes, and its loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.timeout(600)
ROOT = os.fspath(REPO)


def test_readme_example_trains(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    code = re.search(r"## In twenty lines\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 24
    script = tmp_path / "train.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "meshlab.cli", "run", "--nproc-per-node", "4",
                        str(script)], capture_output=True, text=True, timeout=540, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", r.stdout)]
    assert len(losses) >= 5, r.stdout[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert "memory per rank" in r.stdout and "communication per rank per step" in r.stdout
