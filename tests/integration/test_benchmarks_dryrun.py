"""The multi-GPU benchmark scripts, dry-run on 2 gloo processes in --quick mode: they exit
cleanly, write the JSON the GPU runs will write, and fp32 parity holds for every layout
that fits a world of 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

REPO = REPO
SCRIPTS = REPO / "benchmarks" / "multi_gpu"
pytestmark = pytest.mark.timeout(600)

COMMON_KEYS = {"script", "device", "device_type", "world_size", "torch", "transformers",
               "meshlab", "date", "command", "argv", "nvlink_multicast_env", "fixups",
               "results"}
FIT_WORLD_2 = {"dp", "zero1", "zero2", "zero3", "tp", "tp_sp", "pp_1f1b", "pp_interleaved",
               "pp_zero_bubble"}


def dry_run(script: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPTS / script), "--device", "cpu", "--quick", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{script} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "NVLink multicast off" in p.stdout
    data = json.loads(out.read_text())
    missing = COMMON_KEYS - set(data)
    assert not missing, missing
    assert data["device"] == "cpu (gloo dry run)" and data["world_size"] == 2
    assert data["nvlink_multicast_env"] == {"NCCL_NVLS_ENABLE": "0",
                                            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                            "NVSHMEM_DISABLE_NVLS": "1"}
    assert "torch.distributed.run" in data["command"] and script in data["command"]
    return data


def test_parity_dry_run(tmp_path):
    data = dry_run("parity.py", tmp_path / "parity.json")
    res = data["results"]
    assert {"summary", "tolerances", "model", "data"} <= set(data)
    fp32 = {r["layout"]: r for r in res.values() if r["precision"] == "fp32"}
    fits = {n for n, r in fp32.items() if not r["status"].startswith("skipped")}
    assert fits == FIT_WORLD_2, fp32
    steps = data["data"]["steps"]
    for name in sorted(fits):
        r = fp32[name]
        assert r["status"] == "pass", (name, r["status"])
        assert len(r["loss_abs_diff"]) == steps and max(r["loss_abs_diff"]) <= 1e-5 + 1e-3 * max(
            abs(x) for x in r["loss_reference"])
        assert r["weights_pass"] and r["ranks_agree_on_losses"] and not r["params_missing"]
    assert "world 8" in fp32["pp2_dp2_tp2_zero1"]["status"]
    bf16 = [r for r in res.values() if r["precision"] == "bf16"]
    assert len(bf16) == len(fp32) and all(r["status"] for r in bf16)


def test_collectives_dry_run(tmp_path):
    data = dry_run("collectives.py", tmp_path / "collectives.json")
    rows = data["results"]
    assert {"conventions", "target", "flagged", "all_correct"} <= set(data)
    assert {(r["op"], r["bytes"]) for r in rows} == {
        (op, s) for op in ("all_reduce", "reduce_scatter", "all_gather")
        for s in (16 << 10, 64 << 10, 256 << 10, 1 << 20)}
    for r in rows:
        assert r["correct"] is True, r
        for k in ("meshlab_algbw_GBps", "raw_algbw_GBps", "meshlab_busbw_GBps",
                  "raw_busbw_GBps", "ratio_meshlab_over_raw"):
            assert r[k] > 0, (k, r)
        factor = 1.0 if r["op"] == "all_reduce" else 0.5            # 2(n-1)/n, (n-1)/n at n=2
        assert r["raw_busbw_GBps"] == pytest.approx(r["raw_algbw_GBps"] * factor)
        assert r["flag"] is False                                   # all below 64 MiB
    assert data["flagged"] == [] and data["all_correct"] is True
