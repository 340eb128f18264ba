"""The README: its example runs as written, on 4 CPU processes, and its loss falls; it stays
short; every path it names exists; and the public API it has named keeps importing."""

from __future__ import annotations

import importlib
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


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md")).read()


def test_readme_is_at_most_1500_words():
    words = len(_readme().split())
    assert words <= 1500, f"README.md has {words} words; move detail into docs/"


# A path under one of these folders, as the README and the docs pages write them (a glob or
# a {a,b} pattern is not a path, and is left out).
_PATH = re.compile(r"(?<![\w/.~-])((?:meshlab|docs|examples)/[\w./-]*)")


def _paths(text: str, folder: str = "") -> set[str]:
    """The repository paths ``text`` names: ``meshlab/...``, ``docs/...`` and
    ``examples/...`` anywhere, and the targets of its relative Markdown links (which are
    relative to ``folder``)."""
    out = set()
    for m in _PATH.finditer(text):
        if text[m.end():m.end() + 1] in ("*", "{", "<"):
            continue
        out.add(m.group(1).rstrip(".,-"))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            out.add(os.path.normpath(os.path.join(folder, target)))
    return out


def test_readme_names_only_paths_that_exist():
    paths = _paths(_readme())
    assert {"meshlab/core/spec.py", "docs/api.md", "examples/train.py"} <= paths, paths
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing


def test_docs_pages_name_only_paths_that_exist():
    docs = os.path.join(ROOT, "docs")
    missing = []
    for page in sorted(os.listdir(docs)):
        if page.endswith(".md"):
            text = open(os.path.join(docs, page)).read()
            missing += [f"docs/{page}: {p}" for p in sorted(_paths(text, "docs"))
                        if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, missing


def test_readme_links_the_docs_pages():
    """The pages the long material lives in, and the hand-written and generated ones."""
    text = _readme()
    pages = ("api.md", "transforms.md", "results.md", "design.md", "policies.md",
             "inference.md", "support.md", "booster.md", "jax.md")
    unlinked = [p for p in pages if f"(docs/{p})" not in text]
    assert not unlinked, unlinked


# The public names earlier READMEs used (the release before the package was grouped by
# layer): each still imports, through the path the README wrote.
PUBLIC = """
meshlab.Mesh meshlab.Mesh.flatten meshlab.P meshlab.PartitionSpec meshlab.Rules
meshlab.advise meshlab.booster meshlab.checkpoint meshlab.data meshlab.data.TextDataset
meshlab.dataloader meshlab.fuse meshlab.inference meshlab.losses meshlab.machine
meshlab.no_sync meshlab.offload meshlab.ops meshlab.optimizer meshlab.parallel
meshlab.parallelize meshlab.pipeline meshlab.plan meshlab.policies meshlab.policies.auto
meshlab.precision meshlab.presets meshlab.presets.build meshlab.remat meshlab.sequence
meshlab.shard meshlab.step meshlab.trace meshlab.zero_shard meshlab.constrain
meshlab.notebook_launcher meshlab.distribute meshlab.shard_map meshlab.visualize
meshlab.typeof meshlab.Machine meshlab.calibrate meshlab.data_parallel
meshlab.expert_route meshlab.lora meshlab.compile_blocks meshlab.step_in_backward
meshlab.save_adapter meshlab.load_adapter meshlab.save_merged meshlab.merge_adapters
meshlab.unmerge_adapters meshlab.Plan meshlab.Plan.memory meshlab.Plan.comm
meshlab.Plan.time meshlab.Plan.diff meshlab.Plan.to_json meshlab.Plan.from_json
meshlab.ConfigError meshlab.PlanError meshlab.BatchError meshlab.RankMismatchError
meshlab.PeerError
meshlab.checkpoint.save meshlab.checkpoint.load meshlab.checkpoint.latest
meshlab.checkpoint.save_pretrained meshlab.checkpoint.load_pretrained
meshlab.losses.cross_entropy meshlab.ops.FusedAdamW meshlab.ops.CPUAdamW
meshlab.parallel.Transform meshlab.parallel.fuse.fuse_model
meshlab.policies.presets meshlab.policies.presets.build
meshlab.inference.InferenceEngine meshlab.inference.InferenceConfig
meshlab.booster.Booster meshlab.booster.launch_from_torch meshlab.booster.GeminiPlugin
meshlab.booster.plugin.HybridParallelPlugin meshlab.booster.plugin.TorchDDPPlugin
meshlab.booster.plugin.TorchFSDPPlugin meshlab.booster.plugin.LowLevelZeroPlugin
meshlab.booster.plugin.GeminiPlugin meshlab.booster.plugin.MoeHybridParallelPlugin
meshlab.booster.optimizer.HybridAdam meshlab.booster.optimizer.CPUAdam
meshlab.booster.optimizer.FusedAdam
meshlab.booster.Booster.boost meshlab.booster.Booster.backward
meshlab.booster.Booster.execute_pipeline meshlab.booster.Booster.no_sync
meshlab.booster.Booster.enable_lora meshlab.booster.Booster.save_model
meshlab.booster.Booster.load_model meshlab.booster.Booster.save_optimizer
meshlab.booster.Booster.load_optimizer meshlab.booster.Booster.save_lr_scheduler
meshlab.booster.Booster.load_lr_scheduler meshlab.booster.Booster.save_lora_as_pretrained
""".split()


def _resolve(name: str):
    """``name`` as the README writes it: the longest prefix that imports as a module, then
    attributes (``meshlab.parallel.fuse`` is the room's module when imported by path)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_the_public_api_the_readme_named_still_imports():
    failed = []
    for name in PUBLIC:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, failed
    from meshlab import booster, presets                      # noqa: F401  (as written)
    from meshlab.booster import GeminiPlugin                  # noqa: F401
    from meshlab.booster.plugin import HybridParallelPlugin   # noqa: F401
    from meshlab.policies import presets as policy_presets

    assert presets is policy_presets and booster.GeminiPlugin is GeminiPlugin
