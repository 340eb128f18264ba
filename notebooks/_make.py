"""Writes the tutorial notebooks from the cell lists below and executes them in place, so
the committed files show their outputs on a code host (CI executes them again with
``pytest --nbmake``).

    .venv/bin/python notebooks/_make.py               # write and execute them all (minutes)
    .venv/bin/python notebooks/_make.py --no-execute  # write the cells only

Executing is what ``jupyter nbconvert --to notebook --execute --inplace`` does, with the
venv's ``python3`` kernel and the notebook's folder as working directory, and then keeps
the files stable between runs: cell ids are numbered, per-cell timing metadata is not
recorded and the kernel's patch version is dropped.
"""

import os
import re
import sys

import nbformat as nbf

_MACHINE_PATH = re.compile(r"/(work|home|root|tmp|Users)/")
# What the executing machine's setup prints, not the notebook: tqdm's notice that
# ipywidgets is missing (it names the machine's site-packages).
# What the environment prints while packages import (tqdm without ipywidgets; transformers
# importing an installed torchao, whose optional CUDA kernels do not load on a CPU machine,
# and its enums registered with torch's pytree): not the notebook's outputs.
_SETUP_NOISE = re.compile(r"^.*TqdmWarning: IProgress not found.*\n(  from .*tqdm.*\n)?"
                          r"|^Failed to load \S*torchao\S*: .*\n"
                          r"|^W\d{4} [^\n]*_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass.*\n",
                          re.M)


def write(path, cells):
    nb = nbf.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbf.v4.new_markdown_cell(c[3:]) if c.startswith("md:") else nbf.v4.new_code_cell(c)
                for c in cells]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"
    nbf.write(nb, path)


def execute(path, timeout=1200):
    """Run every cell of ``path`` in a fresh kernel and store the outputs in the file.

    Raises ``RuntimeError`` if an output names a machine's absolute path (a warning's file
    name, a temporary folder): the committed notebook would differ on every machine."""
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbf.read(path, as_version=4)
    ep = ExecutePreprocessor(timeout=timeout, kernel_name="python3", record_timing=False)
    ep.preprocess(nb, {"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _without_setup_noise(cell.outputs)
        for out in cell.get("outputs", ()):
            if _MACHINE_PATH.search(str(out)):
                raise RuntimeError(f"{path}: an output of cell {cell.id} names a machine "
                                   f"path; change the cell so it does not:\n{out}")
    nbf.write(nb, path)


def _without_setup_noise(outputs):
    kept = []
    for out in outputs:
        if out.output_type == "stream" and out.name == "stderr":
            out.text = _SETUP_NOISE.sub("", out.text)
            if not out.text:
                continue
        kept.append(out)
    return kept


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
    "mesh axes, as flax's `logical_axis_rules`: the rules are tried in order, and each gives "
    "its dimension the first of its axes that the mesh has and no dimension holds yet. "
    "`first(...)` lists fallbacks, `joint(...)` shards one dimension over several axes.",
    "rules = ml.Rules(batch=('dp',), mlp='tp', heads='tp', embed=ml.first('fsdp', 'tp'))\n"
    "print(rules.resolve(P('batch', 'embed'), mesh.axis_names))   # no fsdp: embed falls back to tp\n"
    "print(rules.resolve(P('mlp', 'embed'), mesh.axis_names))     # tp taken by mlp: embed replicated\n"
    "print(rules.resolve(P('batch', 'embed'), ('dp', 'fsdp', 'tp')))",
    "md:A flax or MaxText table of `(logical, mesh)` pairs reads as written: a tuple shards one "
    "dimension jointly, as inside `P`, and a name given again is a fallback. In the keyword form "
    "a bare tuple of several axes could mean either, so it is refused.",
    "maxtext = ml.Rules.from_pairs([('activation_batch', ('dp', 'fsdp')),\n"
    "                               ('embed', 'fsdp'), ('embed', 'tp')])\n"
    "print(maxtext.resolve(P('activation_batch', 'embed'), ('dp', 'fsdp', 'tp')))\n"
    "try:\n    ml.Rules(embed=('fsdp', 'tp'))\nexcept ml.RulesError as e:\n    print(e)",
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
    "`policies.auto`, and the plan is bound to a fake mesh. A plan shows as a table: each "
    "parameter's spec and per-rank shape, the transforms that made it and the memory each rank "
    "keeps (`print(plan)` gives the same table as text).",
    "import time\nfrom meshlab.policies import presets\n\nt0 = time.perf_counter()\n"
    "model = presets.build('llama3-70b', dtype=torch.bfloat16)\n"
    "big = ml.Mesh(fsdp=128, tp=8, fake=True)\n"
    "tp_rules = ml.Rules(batch='fsdp', heads='tp', kv_heads='tp', mlp='tp', vocab='tp', embed='fsdp')\n"
    "plan70 = ml.plan(model, ml.shard(ml.policies.auto, tp_rules), big)\n"
    "seconds = time.perf_counter() - t0\nassert seconds < 60, f'planning took {seconds:.0f} s'\n"
    "n = sum(e.numel for e in plan70 if e.tied_to is None)\n"
    "print(f'planned {n / 1e9:.1f}B parameters on {big.size:,} ranks in under a minute')\n"
    "plan70",
    "plan70.memory()",
    "md:Change the topology and compare: a plan diff says what moved, in the specs "
    "(`d.changed`) and in what each rank holds (`d.local`: per-rank shapes and bytes).",
    "plan_tp4 = ml.plan(model, ml.shard(ml.policies.auto, tp_rules), ml.Mesh(fsdp=256, tp=4, fake=True))\n"
    "d = plan70.diff(plan_tp4)\n"
    "# the same rules map every parameter to the same axes, so no spec changes; each rank\n"
    "# holds a quarter of a tensor-parallel dim instead of an eighth, and half of an fsdp one\n"
    "print(len(d.changed), 'parameters change their spec;', len(d.local), 'change their shape per rank')\n"
    "assert not d.changed and d.local\n"
    "for fqn, before, after, _, _ in d.local[:3]:\n"
    "    print(f'  {fqn}: {before} -> {after}')\n"
    "print(f'per-rank bytes: {plan70.memory().total / 2**20:.1f} MiB -> '\n"
    "      f'{plan_tp4.memory().total / 2**20:.1f} MiB')",
    "md:Plans round-trip through JSON, so they can be saved, reviewed and golden-tested.",
    "assert ml.Plan.from_json(plan70.to_json()) == plan70\nlen(plan70.to_json()) // 1024, 'KiB'",
]

NB02 = [
    "md:# 02 · Compose transforms, plan, train\n\nA layout is a value: transforms composed with "
    "`|`. We compose one, plan two models on a few (fake) topologies to compare their memory, "
    "then train the tiny model on four real CPU processes started from this notebook.",
    "import torch\nimport meshlab as ml\nfrom meshlab.policies import presets\n"
    "from rich.console import Console\nfrom rich.table import Table\n\n"
    "console = Console(width=140)",
    "md:## Composing transforms\n`shard` places parameters (here from the model's own tensor-"
    "parallel plan, `policies.auto`, through a `Rules` table), `zero_shard` splits optimizer "
    "state, gradients and parameters over the data axis, `precision` picks dtypes and `remat` "
    "recomputes activations. Each is a frozen value `Plan -> Plan`; `|` chains them.",
    "rules = ml.Rules(batch='dp', heads='tp', kv_heads='tp', mlp='tp', vocab='tp', embed=None)\n"
    "spec = (ml.shard(ml.policies.auto, rules) | ml.zero_shard(3, 'dp')\n"
    "        | ml.precision('bf16') | ml.remat('full'))\n"
    "for part in spec.parts:\n    print(part)",
    "md:A plan records which transforms made it; its view lists them above the parameter "
    "table and the bytes each rank keeps. A layout `parallelize` would refuse says why there "
    "first.",
    "tiny = presets.build('tiny-llama')          # on the meta device: no memory\n"
    "plan = ml.plan(tiny, spec, ml.Mesh(dp=2, tp=2, fake=True))\n"
    "assert len(plan.transforms) == 4 and plan.runnable\nplan",
    "md:## One model, several topologies\nThe same transforms, planned for 8 ranks in five "
    "ways: replicated data parallelism, ZeRO-1, ZeRO-3 (FSDP style), 2-way data x 4-way tensor "
    "parallelism, and that with ZeRO-3 and bf16 on top. `plan.memory()` counts the bytes each "
    "rank keeps between steps.",
    "big = presets.build('llama3-8b')\nshard = ml.shard(ml.policies.auto, rules)\n"
    "LAYOUTS = {\n"
    "    'dp=8': ('dp=8', ml.data_parallel('dp')),\n"
    "    'dp=8, ZeRO-1': ('dp=8', ml.zero_shard(1, 'dp')),\n"
    "    'dp=8, ZeRO-3': ('dp=8', ml.zero_shard(3, 'dp')),\n"
    "    'dp=2, tp=4': ('dp=2,tp=4', shard),\n"
    "    'dp=2, tp=4, ZeRO-3, bf16': ('dp=2,tp=4', shard | ml.zero_shard(3, 'dp')),\n"
    "}\n\n"
    "def gib(n):\n    return f'{n / 2**30:,.2f} GiB' if n >= 2**30 else f'{n / 2**10:,.1f} KiB'\n\n"
    "plans, table = {}, Table(title='bytes per rank (AdamW)')\n"
    "for col in ('model', 'layout', 'params', 'grads', 'optimizer', 'total'):\n"
    "    table.add_column(col, justify='left' if col in ('model', 'layout') else 'right')\n"
    "weights16 = {'tiny-llama': presets.build('tiny-llama', dtype=torch.bfloat16),\n"
    "             'llama3-8b': presets.build('llama3-8b', dtype=torch.bfloat16)}\n"
    "for name, model in (('tiny-llama', tiny), ('llama3-8b', big)):\n"
    "    for layout, (mesh, transforms) in LAYOUTS.items():\n"
    "        built = weights16[name] if 'bf16' in layout else model   # weights stored in bf16\n"
    "        p = plans[name, layout] = ml.plan(built, transforms, ml.Mesh.parse(mesh))\n"
    "        m = p.memory()\n"
    "        table.add_row(name, layout, *map(gib, (m.params, m.grads, m.optimizer, m.total)))\n"
    "console.print(table)",
    "md:The table reads like the transforms: ZeRO-1 splits the optimizer state over the 8 ranks "
    "and leaves the parameters whole, ZeRO-3 splits everything 8 ways, tensor parallelism splits "
    "what it shards 4 ways, and weights stored in bf16 halve the parameters (`precision` "
    "changes the compute dtype, not what is stored).",
    "m = {layout: plans['llama3-8b', layout].memory() for layout in LAYOUTS}\n"
    "assert m['dp=8, ZeRO-1'].params == m['dp=8'].params\n"
    "assert m['dp=8, ZeRO-1'].optimizer < m['dp=8'].optimizer / 4\n"
    "assert m['dp=8, ZeRO-3'].total * 8 == m['dp=8'].total\n"
    "assert m['dp=2, tp=4'].params < m['dp=8'].params / 3\n"
    "assert m['dp=2, tp=4, ZeRO-3, bf16'].params * 4 == m['dp=2, tp=4'].params\n"
    "# .total: every category plan.memory() counts (parameters, gradients, optimizer state and\n"
    "# any a transform adds); activations are not estimated, so they need room on top.\n"
    "print('llama3-8b state fits in 80 GiB per rank with:',\n"
    "      [k for k, v in m.items() if v.total < 80 * 2**30])",
    "md:## What changes between two plans\nKeep the vocabulary replicated and add ZeRO-3: the "
    "diff lists the parameters whose layout moved and the options that changed.",
    "no_vocab = ml.Rules(batch='dp', heads='tp', kv_heads='tp', mlp='tp', vocab=None, embed=None)\n"
    "mesh = ml.Mesh(dp=2, tp=4, fake=True)\n"
    "plan_a = ml.plan(big, shard, mesh)\n"
    "plan_b = ml.plan(big, ml.shard(ml.policies.auto, no_vocab) | ml.zero_shard(3, 'dp'), mesh)\n"
    "d = plan_a.diff(plan_b)\n"
    "assert {fqn for fqn, _ in d.changed} == {'model.embed_tokens.weight', 'lm_head.weight'}\n"
    "console.print(d)\n"
    "print('bytes per rank:', gib(plan_a.memory().total), '->', gib(plan_b.memory().total))",
    "md:## Training on four CPU processes\n`notebook_launcher` starts `nprocs` local processes "
    "(gloo) and runs a function in each; every rank returns its result. Processes are started "
    "fresh, so a function defined in a notebook must be self-contained: its imports go inside "
    "it, everything else comes through `args` (a function imported from a module works as "
    "is). `ml.Mesh(...)` inside joins the process group the launcher prepared.",
    "def train(mesh_text, steps, zero=0):\n"
    "    import torch\n    import meshlab as ml\n    from meshlab.policies import presets\n"
    "    from meshlab.data import TextDataset\n\n"
    "    torch.set_num_threads(1)\n"
    "    mesh = ml.Mesh(ml.Mesh.parse(mesh_text).shape)\n"
    "    rules = ml.Rules(batch='dp', heads='tp', kv_heads='tp', mlp='tp', vocab='tp', embed=None)\n"
    "    spec = ml.zero_shard(zero, 'dp')                # stage 0: plain data parallelism\n"
    "    if 'tp' in mesh.axis_names:                     # tensor parallelism where there is tp\n"
    "        spec = ml.shard(ml.policies.auto, rules) | spec\n"
    "    model = ml.parallelize(presets.build('tiny-llama'), spec, mesh, seed=0)\n"
    "    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.0, clip_grad_norm=1.0)\n"
    "    loader = ml.dataloader(TextDataset(seq_len=64), mesh, batch_size=8)\n"
    "    losses = []\n"
    "    for _, batch in zip(range(steps), loader):\n"
    "        losses.append(ml.step(model, opt, batch))\n"
    "        if mesh.rank == 0 and len(losses) % 5 == 0:\n"
    "            print(f'{mesh}  step {len(losses):3d}  loss {losses[-1]:.4f}')\n"
    "    return losses",
    "STEPS = 20\nper_rank = ml.notebook_launcher(train, args=('dp=2,tp=2', STEPS), nprocs=4)\n"
    "losses = per_rank[0]\n"
    "assert len(losses) == STEPS and all(r == losses for r in per_rank), 'every rank sees the same loss'\n"
    "for i, loss in enumerate(losses):\n"
    "    print(f'{i:3d} {loss:6.3f} ' + '#' * round(loss * 10))\n"
    "assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, 'the loss fell'",
    "md:The layout changes where the numbers live, not what they are: ZeRO-3 over four data-"
    "parallel ranks trains the same model to the same losses (up to float rounding).",
    "zero3 = ml.notebook_launcher(train, args=('dp=4', STEPS, 3), nprocs=4)[0]\n"
    "worst = max(abs(a - b) for a, b in zip(losses, zero3))\n"
    "print(f'largest loss difference, dp=2,tp=2 vs dp=4 ZeRO-3: {worst:.2e}')\n"
    "assert worst < 1e-3",
]

NB03 = [
    "md:# 03 · Will it fit, and how fast?\n\nBefore buying time on a cluster: plan a model on a "
    "*fake* mesh and ask what one rank holds at the step's peak, whether that fits the card, "
    "and how long a step takes. Nothing here needs a GPU or more than one process: the "
    "model is built on the meta device, and the activations come from a shape-only run of "
    "one block (fake tensors).",
    "import torch\nimport meshlab as ml\nfrom meshlab.policies import presets\n\n"
    "def gib(n):\n    return f'{n / 2**30:,.1f} GiB'\n\n"
    "llama70 = presets.build('llama3-70b', device='meta', dtype=torch.bfloat16)\n"
    "h200 = ml.machine('h200')\nprint(h200)",
    "md:## Llama-3-70B on 64 H200: tp=8 inside a node, ZeRO-3 over the rest\n"
    "`plan.memory(batch=, seq=)` adds the activations the forward saves for the backward and "
    "the step's peak: the other blocks' saved activations, one block's backward, the loss, "
    "ZeRO-3's gathered units.",
    "spec = ml.shard(ml.policies.auto) | ml.zero_shard(3, 'dp')\n"
    "mesh = ml.Mesh(dp=8, tp=8, fake=True)\n"
    "plain = ml.plan(llama70, spec, mesh).memory(batch=2, seq=8192)\n"
    "print(plain)\nprint('fits an H200:', plain.fits('h200'))",
    "md:Without recomputation the saved activations alone are larger than the card. "
    "`remat('full')` keeps only each block's input:",
    "full = ml.plan(llama70, spec | ml.remat('full'), mesh)\nmem = full.memory(batch=2, seq=8192)\n"
    "print(f'saved activations {gib(plain.activations.saved)} -> {gib(mem.activations.saved)}; "
    "peak {gib(plain.peak)} -> {gib(mem.peak)}; fits: {mem.fits(\"h200\")}')\n"
    "assert not plain.fits('h200') and mem.fits('h200')",
    "md:The same estimate as a picture: what one rank holds at the step's peak, stacked by "
    "category, against the card's memory.",
    "mem.plot(gpu='h200');",
    "md:A pipeline instead of ZeRO-3 over the nodes: its schedule drawn from the plan, one row "
    "per stage, each box a microbatch's forward or backward; the gaps are the bubble.",
    "from meshlab.transforms.pipeline import plot_schedule\n"
    "pp = ml.plan(llama70, ml.shard(ml.policies.auto) | ml.pipeline('pp', microbatches=8),\n"
    "             ml.Mesh(pp=4, tp=8, fake=True))\n"
    "plot_schedule(pp);",
    "md:## How fast?\n`plan.time()` prices the profile's work (matmul and attention FLOPs, "
    "the bytes the other ops move, the kernels launched) at the card's measured rates, and "
    "every collective of `plan.comm()` at the link it crosses (NVLink inside a node, the "
    "network across), hiding what each room overlaps.",
    "st = full.time(batch=2, seq=8192, gpu='h200')\nprint(st)\n"
    "flops_per_token = 6 * 70.6e9\n"
    "print(f'MFU {st.mfu(flops_per_token, ranks=64):.1%} per card')",
    "md:## Let the planner search\n`ml.advise` walks meshes (pp x dp x tp), the ZeRO stage, "
    "remat and microbatches, keeps what every room's check accepts and what fits, and ranks "
    "by predicted tokens/s.",
    "advice = ml.advise(llama70, gpus=64, gpu='h200', batch=64, seq=4096)\nadvice",
    "advice.plot();",
    "md:## Llama-3-405B on 16,384 ranks\nThe same search at the scale of a large cluster "
    "(a global batch of 2,048 sequences of 8,192 tokens, 16M tokens per step).",
    "llama405 = presets.build('llama3-405b', device='meta', dtype=torch.bfloat16)\n"
    "big = ml.advise(llama405, gpus=16384, gpu='h200', batch=2048, seq=8192)\n"
    "print(big)\nassert big.best, 'some layout fits'",
    "big.plot();",
    "md:The machine is a small value: presets for H100, H200, A100 and B200, or "
    "`meshlab calibrate` on the machine at hand writes one (`--gpu machine.json`).",
    "for name in ('a100', 'h100', 'h200', 'b200'):\n"
    "    m = ml.machine(name)\n"
    "    st = full.time(batch=2, seq=8192, gpu=m)\n"
    "    print(f'{name}: memory {gib(m.memory)}, step {st.step:.2f} s, {st.tokens_per_s:,.0f} tokens/s')",
]

# The model of notebook 04, built by a function: the processes notebook_launcher starts
# build it again from this source (a class defined in a notebook cannot travel to them).
_TINY_LM = """def tiny_lm(vocab=64, dim=64, n_heads=4, n_layers=2, max_len=32):
    \"\"\"A small decoder in plain PyTorch: learned positions, pre-norm blocks, a head.\"\"\"
    import torch
    import torch.nn.functional as F
    import meshlab as ml
    from meshlab import P

    HEADS = P('batch', 'heads', None, None)               # (B, H, S, hd), split over heads

    def attend(q, k, v, w_out):
        # on this rank's heads; w_out: the columns of the output projection they feed
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, h, S, hd)
        y = y.transpose(1, 2).flatten(2) @ w_out.T                    # (B, S, dim): a part
        return ml.psum(y, 'tp')                           # every head's part, summed over tp

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads, self.hd = n_heads, dim // n_heads
            self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim, bias=False)
                                                for _ in range(4))
            self.core = ml.shard_map(attend, in_specs=(HEADS, HEADS, HEADS, P(None, 'heads')),
                                     out_specs=P('batch', None, None))

        def forward(self, x):                                         # (B, S, dim)
            B, S, _ = x.shape
            q, k, v = (p(x).view(B, S, self.n_heads, self.hd).transpose(1, 2)
                       for p in (self.q, self.k, self.v))             # (B, H, S, hd)
            return self.core(q, k, v, self.out.weight)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = torch.nn.LayerNorm(dim), Attention()
            self.norm2 = torch.nn.LayerNorm(dim)
            self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

        def forward(self, h):
            h = h + self.attn(self.norm1(h))
            return h + self.down(F.gelu(self.up(self.norm2(h))))

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_len, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(n_layers))
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):                                       # (B, S) token ids
            h = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                # the residual stream split over tp along the sequence between blocks
                # (sequence parallelism)
                h = block(ml.constrain(h, P('batch', 'tp', None)))
            h = ml.constrain(h, P('batch', None, None))
            return self.head(self.norm(h))                            # (B, S, vocab)

    return TinyLM()"""

_TRAIN = """def train(model_source, mesh_text, steps):
    \"\"\"Train the model ``model_source`` builds for ``steps`` AdamW steps on a fixed
    stream of batches: on this process as written (``mesh_text=None``), or parallelized on
    the mesh ``mesh_text`` names; returns the loss of every step (of the global batch).\"\"\"
    import torch
    import meshlab as ml
    from meshlab import P

    torch.set_num_threads(1)
    ns = {}
    exec(model_source, ns)                      # defines tiny_lm here
    with torch.device('meta'):
        model = ns['tiny_lm']()
    # sequences that count up by a random stride, modulo the vocabulary: learnable
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (steps, 8, 1), generator=g)
    stride = torch.randint(1, 4, (steps, 8, 1), generator=g)
    batches = (start + stride * torch.arange(32)) % 64                # (steps, 8, 32)

    def loss_fn(logits, ids):                   # next-token cross-entropy
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())

    if mesh_text is None:
        model = ml.init_weights(model, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for ids in batches:
            loss = loss_fn(model(ids), ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    specs = {'embed.weight': P('vocab', 'embed'),
             'blocks.*.attn.[qkv].weight': P('heads', 'embed'),
             'blocks.*.attn.out.weight': P('embed', 'heads'),
             'blocks.*.up.weight': P('mlp', 'embed'), 'blocks.*.up.bias': P('mlp'),
             'blocks.*.down.weight': P('embed', 'mlp'), 'head.weight': P('vocab', 'embed')}
    rules = ml.Rules(batch='dp', heads='tp', mlp='tp', vocab='tp', embed=None)
    mesh = ml.Mesh(ml.Mesh.parse(mesh_text).shape)
    model = ml.parallelize(model, ml.shard(specs, rules), mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=3e-3)
    mine = mesh.coordinate(mesh.rank)['dp']     # this rank's share of every batch
    return [ml.step(model, opt, ids.chunk(mesh.shape['dp'])[mine], loss_fn) for ids in batches]"""

NB04 = [
    "md:# 04 · Your own model\n\nmeshlab works on a model you write yourself: an `nn.Module` "
    "with its own forward, no Hugging Face config, no policy. You say how its parameters "
    "split (specs in logical names and a `Rules` table), where its activations split "
    "(`ml.constrain`), and write per-shard code where you want it (`ml.shard_map`, with "
    "collectives by axis name). The plan, its estimates and training then work as for a "
    "Hugging Face model.",
    "import inspect\nimport torch\nimport meshlab as ml\nfrom meshlab import P",
    "md:## A decoder in plain PyTorch\nAttention runs per head group in `ml.shard_map`: each "
    "rank computes its own heads and their share of the output projection, and "
    "`ml.psum(y, 'tp')` sums the shares over the tensor-parallel axis (Megatron's "
    "row-parallel layer, written by hand). Between blocks `ml.constrain` splits the "
    "residual stream over `tp` along the sequence (sequence parallelism). On one process "
    "both cost nothing: `constrain` is a no-op, `shard_map` runs its function on the whole "
    "tensors and `psum` over an axis of one rank returns its input.\n\n"
    "The model is built by a function so that the processes launched below can build it "
    "again from its source.",
    _TINY_LM,
    "with torch.device('meta'):\n    model = tiny_lm()\n"
    "model = ml.init_weights(model, seed=0)          # one process, as written\n"
    "ids = torch.randint(0, 64, (2, 32))\nprint(model(ids).shape)",
    "md:## Its specs, and the plan\nFQN globs to logical specs, as `shard` takes them; the "
    "rules map the logical names to mesh axes. No policy marks tensor-parallel regions, so "
    "the model runs its own forward on DTensors (DTensor mode) and sharding propagates "
    "through it as in JAX.",
    "SPECS = {'embed.weight': P('vocab', 'embed'),\n"
    "         'blocks.*.attn.[qkv].weight': P('heads', 'embed'),\n"
    "         'blocks.*.attn.out.weight': P('embed', 'heads'),\n"
    "         'blocks.*.up.weight': P('mlp', 'embed'), 'blocks.*.up.bias': P('mlp'),\n"
    "         'blocks.*.down.weight': P('embed', 'mlp'), 'head.weight': P('vocab', 'embed')}\n"
    "rules = ml.Rules(batch='dp', heads='tp', mlp='tp', vocab='tp', embed=None)\n"
    "with torch.device('meta'):\n    meta = tiny_lm()\n"
    "plan = ml.plan(meta, ml.shard(SPECS, rules), ml.Mesh(dp=2, tp=2, fake=True))\nplan",
    "md:## Estimates from an example input\nThe estimates run one training step of the "
    "model on fake tensors (shapes only). A Hugging Face model is called with `input_ids`; "
    "yours says how it is called: `inputs=` builds its arguments for a batch and a "
    "sequence length (a tensor, a tuple of arguments or a dict of keyword arguments). The "
    "loss is the causal-LM loss where the output is logits over token ids among the "
    "inputs, else the sum of the output; `loss=` gives your own. Without `inputs=` the "
    "estimate says so:",
    "try:\n    plan.memory(batch=4, seq=32)\nexcept ml.ConfigError as e:\n    print(e)",
    "tokens = lambda batch, seq: torch.randint(0, 64, (batch, seq))\n"
    "plan.memory(batch=4, seq=32, inputs=tokens)",
    "print(plan.time(batch=4, seq=32, inputs=tokens))\n"
    "plan.comm(batch=4, seq=32, inputs=tokens)",
    "md:`ml.advise` searches layouts for it too, given the specs `shard` would take (rules "
    "with a fallback, `('tp', None)`, where a layout has no such axis). Here the same code "
    "at 6.7B parameters on 16 H100:",
    "with torch.device('meta'):\n"
    "    big = tiny_lm(vocab=32000, dim=4096, n_heads=32, n_layers=32, max_len=4096)\n"
    "loose = ml.Rules(batch=('dp', None), heads=('tp', None), mlp=('tp', None),\n"
    "                 vocab=('tp', None), embed=None)\n"
    "ml.advise(big, gpus=16, gpu='h100', batch=32, seq=4096, specs=SPECS, rules=loose,\n"
    "          inputs=lambda batch, seq: torch.randint(0, 32000, (batch, seq)))",
    "md:## Training on four processes beside one\nThe same function trains the model on "
    "this process as written, and on four processes (`dp=2, tp=2`) parallelized by the "
    "specs: each data-parallel rank gets half of every batch, each tensor-parallel rank "
    "half of the heads, the MLP and the vocabulary.",
    _TRAIN,
    "STEPS = 20\nsource = inspect.getsource(tiny_lm)\n"
    "one = train(source, None, STEPS)\n"
    "four = ml.notebook_launcher(train, args=(source, 'dp=2,tp=2', STEPS), nprocs=4)\n"
    "assert all(r == four[0] for r in four), 'every rank sees the same loss'\n"
    "for i, (a, b) in enumerate(zip(one, four[0])):\n"
    "    print(f'{i:3d}  one process {a:.5f}  four {b:.5f}')\n"
    "worst = max(abs(a - b) for a, b in zip(one, four[0]))\n"
    "print(f'largest difference: {worst:.1e}')\n"
    "assert worst < 1e-4 and one[-1] < one[0] - 1, 'the same losses, and they fell'",
]

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-execute"]
    here = args[0] if args else os.path.dirname(os.path.abspath(__file__))
    for name, cells in (("01_specs_and_meshes.ipynb", NB01), ("02_compose_and_train.ipynb", NB02),
                        ("03_will_it_fit.ipynb", NB03), ("04_your_own_model.ipynb", NB04)):
        write(os.path.join(here, name), cells)
        if "--no-execute" not in sys.argv:
            execute(os.path.join(here, name))
