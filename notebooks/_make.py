"""Writes the tutorial notebooks from the cell lists below (run: python notebooks/_make.py)."""

import sys

import nbformat as nbf


def write(path, cells):
    nb = nbf.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbf.v4.new_markdown_cell(c[3:]) if c.startswith("md:") else nbf.v4.new_code_cell(c)
                for c in cells]
    nbf.write(nb, path)


NB01 = [
    "md:# 01 · Specs, rules and meshes\n\nEverything here runs on a laptop CPU: meshes are *fake* "
    "(a shape, no processes), so we can lay out tensors on 16 ranks or plan a 70B model on 1,024.",
    "import torch\nimport meshlab as ml\nfrom meshlab import P",
    "md:## Meshes name their axes\nA fake mesh plans without processes. Sub-meshes pick axes; "
    "`flatten` merges adjacent ones.",
    "mesh = ml.Mesh(dp=2, tp=2, fake=True)\nbig = ml.Mesh(pp=4, dp=8, tp=8, fake=True)\n"
    "print(mesh, mesh.size)\nprint(big['tp'], big.flatten('pp', 'dp'))",
    "md:## PartitionSpecs: one entry per tensor dimension\n`P('dp', 'tp')` splits rows over "
    "`dp` and columns over `tp`. `visualize` shows which rank holds which block.",
    "ml.visualize((8, 4), P('dp', 'tp'), mesh);",
    "md:Several axes on one dimension split it major-first; trailing dimensions are replicated; "
    "ranks that share a block are listed together.",
    "ml.visualize((8, 4), P(('dp', 'tp')), mesh)\nml.visualize((8, 4), P(None, 'tp'), mesh);",
    "md:Uneven dimensions follow `torch.chunk`: the last shards are smaller (here 7 rows over 4).",
    "view = ml.visualize((7,), P(('dp', 'tp')), mesh)\nview.blocks",
    "md:Bad specs are typed errors that say what to do:",
    "for bad in (\"P('dp', 'dp')\", \"P(('tp', 'dp'))\", \"P('dp', None, 'tp')\"):\n    try:\n"
    "        ml.visualize((8, 4), eval(bad), mesh, show=False)\n"
    "    except ml.SpecError as e:\n        print(type(e).__name__, '->', e)",
    "md:## Logical axes and rules\nModel code speaks logical axes; one `Rules` table maps them to "
    "mesh axes, with ordered fallbacks: the first axis present in the mesh and unused by the "
    "spec wins.",
    "rules = ml.Rules(batch=('dp',), embed=('fsdp', 'tp'), mlp='tp', heads='tp')\n"
    "print(rules.resolve(P('batch', 'embed'), mesh.axis_names))   # no fsdp: embed falls back to tp\n"
    "print(rules.resolve(P('mlp', 'embed'), mesh.axis_names))     # tp taken by mlp: embed replicated\n"
    "print(rules.resolve(P('batch', 'embed'), ('dp', 'fsdp', 'tp')))",
    "try:\n    rules | ml.Rules(mlp='dp')\nexcept ml.RulesError as e:\n    print(e)",
    "md:## Specs for a whole model\nFQN globs, or a pytree mirroring the module tree (the JAX "
    "spelling).",
    "class MLP(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.up = torch.nn.Linear(16, 64)\n        self.down = torch.nn.Linear(64, 16)\n\n"
    "with torch.device('meta'):\n    mlp = MLP()\n"
    "by_glob = ml.shard({'up.weight': P('mlp', 'embed'), 'up.bias': P('mlp'),\n"
    "                    'down.weight': P('embed', 'mlp')}, rules)\n"
    "tree = ml.specs_like(mlp)\ntree['up'] = {'weight': P('mlp', 'embed'), 'bias': P('mlp')}\n"
    "tree['down']['weight'] = P('embed', 'mlp')\nby_tree = ml.shard(tree, rules)\n"
    "a, b = ml.plan(mlp, by_glob, mesh), ml.plan(mlp, by_tree, mesh)\n"
    "print(a)\nassert not a.diff(b), 'both spellings give the same plan'",
    "md:## Planning a 70B model on 1,024 ranks\nThe model is built on the meta device (no "
    "memory), its Hugging Face `base_model_tp_plan` is translated into logical specs by "
    "`policies.auto`, and the plan is bound to a fake mesh.",
    "import time\nfrom meshlab import presets\n\nt0 = time.perf_counter()\n"
    "model = presets.build('llama3-70b', dtype=torch.bfloat16)\n"
    "big = ml.Mesh(fsdp=128, tp=8, fake=True)\n"
    "tp_rules = ml.Rules(batch='fsdp', heads='tp', kv_heads='tp', mlp='tp', vocab='tp', embed='fsdp')\n"
    "plan70 = ml.plan(model, ml.shard(ml.policies.auto, tp_rules), big)\n"
    "print(f'planned in {time.perf_counter() - t0:.2f} s')\nplan70",
    "plan70.memory()",
    "md:Change the topology and compare: a plan diff says what moved.",
    "plan_tp4 = ml.plan(model, ml.shard(ml.policies.auto, tp_rules), ml.Mesh(fsdp=256, tp=4, fake=True))\n"
    "d = plan70.diff(plan_tp4)\nprint(len(d.changed), 'parameters change layout')\n"
    "print('per-rank bytes:', plan70.memory().total / 2**30, '->', plan_tp4.memory().total / 2**30, 'GiB')",
    "md:Plans round-trip through JSON, so they can be saved, reviewed and golden-tested.",
    "assert ml.Plan.from_json(plan70.to_json()) == plan70\nlen(plan70.to_json()) // 1024, 'KiB'",
]

if __name__ == "__main__":
    here = sys.argv[1] if len(sys.argv) > 1 else "notebooks"
    write(f"{here}/01_specs_and_meshes.ipynb", NB01)
