"""The ``meshlab`` command: plan a layout before anything runs, launch and train, serve, and
check what this machine builds. ``meshlab --help`` lists every command with an example;
``meshlab COMMAND --help`` says the rest."""

from __future__ import annotations

import argparse
import sys


_NONE = ("None", "none")

# One example per command, in the order `meshlab --help` lists them.
EXAMPLES = (
    ("plan", "meshlab plan --model llama3-8b --mesh dp=8,tp=8 --zero 3 --batch 4"),
    ("calibrate", "meshlab calibrate --out h200.json   (then: meshlab plan --gpu h200.json)"),
    ("env", "meshlab env"),
    ("check", "meshlab check --ops rms_norm,attention"),
    ("build", "meshlab build"),
    ("run", "meshlab run --nproc-per-node 4 train.py --lr 3e-4"),
    ("demo", "meshlab demo"),
    ("generate", "meshlab generate ./my-llama --prompt 'Hello' --max-new-tokens 32"),
)

_TOP = """commands, one example each:
""" + "\n".join(f"  {cmd:<10} {ex}" for cmd, ex in EXAMPLES)

_PLAN = """Build the model on the meta device (no weights), lay it out on a mesh that need not
exist (any number of cards), and print the parameter table, memory per rank and, with
--batch, activations, communication and the step time on --gpu. Nothing is allocated
and no process is started; the same plan object is what parallelize() runs."""

_PLAN_EXAMPLES = """examples:
  meshlab plan --model llama3-8b --mesh dp=8,tp=8
  meshlab plan --model llama3-70b --mesh pp=4,dp=4,tp=8 --zero 1 --batch 8 --seq 4096 --pictures pics
  meshlab plan --model ./config.json --mesh fsdp=16 --zero 3 --zero-axis fsdp --remat full --json plan.json
  meshlab plan --model mixtral-8x7b --mesh dp=2,ep=8 --batch 2
  meshlab plan --model llama3-8b --advise --gpus 16 --batch 64 --gpu h100"""


def _rules_arg(text: str | None):
    """``--rules 'batch=dp+fsdp|dp,heads=tp,embed=fsdp|None'`` as ``Rules`` (None: not given).

    ``|`` separates fallbacks, tried in order (``first``); ``+`` joins mesh axes that shard
    the dimension together (``joint``, a tuple inside ``P``); ``None`` alone replicates,
    and as the last fallback means "replicate on meshes without the others" (``Rules``'
    module doc). The rules keep the order they are given in, which decides between two
    dimensions that want one axis."""
    from ..core.errors import RulesError
    from ..core.rules import Rules, first, joint

    if not text:
        return None
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq:
            raise RulesError(f"--rules {text!r}: expected logical=axis pairs, e.g. "
                             f"heads=tp,embed=fsdp,batch=dp+fsdp|dp")
        alts = tuple(None if v in _NONE else joint(*v.split("+")) if "+" in v else v
                     for v in value.split("|") if v)
        pairs.append((name, None if not alts or alts == (None,) else
                      (alts[0] if len(alts) == 1 else first(*alts))))
    return Rules(pairs)


DEFAULT_RULES_HELP = ("Rules.default(): heads, kv_heads, mlp, vocab -> tp; batch -> dp and "
                      "fsdp; embed -> fsdp where present, else replicated")


def _refusal(p, mesh_text: str) -> str:
    """Why ``parallelize`` would refuse plan ``p``, with the likely axis for a misspelled
    mesh axis that nothing uses (``tq`` -> ``tp``)."""
    from ..core.rules import KNOWN_AXES, nearest_axis

    lines = [f"meshlab plan: error: parallelize cannot run this layout on --mesh {mesh_text}:"]
    lines += [f"  {why}" for why in p.not_runnable]
    for a in p.unused_axes():
        near = nearest_axis(a, KNOWN_AXES)
        if near is not None:
            lines.append(f"  did you mean {near!r} for the --mesh axis {a!r}? (meshlab's "
                         f"default rules and transforms use {', '.join(KNOWN_AXES)})")
    return "\n".join(lines)


_DTYPES = ("bfloat16", "float16", "float32")


def _check_plan_flags(args) -> None:
    """``meshlab plan``'s numeric and path flags, refused by name before anything is built
    (exit code 2, one line)."""
    import os

    from ..core.errors import ConfigError

    if args.dtype not in _DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r}: parameters are planned in one of "
                          f"{', '.join(_DTYPES)}; pass e.g. --dtype bfloat16")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq),
                        ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be an integer >= 1")
    where = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if where is not None and not os.path.isdir(where):
        raise ConfigError(f"--json {args.json!r}: the directory {where!r} does not exist; "
                          f"create it or write the plan elsewhere")
    if args.json and os.path.isdir(args.json):
        raise ConfigError(f"--json {args.json!r}: is a directory; --json takes the path of "
                          f"the file to write, e.g. --json "
                          f"{os.path.join(args.json, 'plan.json')}")
    if args.batch is not None and getattr(args, "gpu", None) is not None:
        from ..estimate.machine import machine

        machine(args.gpu)           # a preset name or a readable profile, before planning


_SPECS_EXAMPLE = '{"model.layers.*.mlp.up_proj.weight": ["mlp", "embed"], "score.weight": []}'


def _specs_arg(path: str) -> dict:
    """``--specs FILE``: an object of FQN globs -> one entry per dimension (a logical axis,
    null for an unsharded dim, or a list of axes), as ``P``'s; JSON, or YAML (``.yaml``,
    ``.yml``) with pyyaml installed. A malformed file or entry raises ``ConfigError`` naming
    the file and the entry."""
    from ..core.errors import ConfigError, SpecError
    from ..core.spec import P
    from ..core.specs_tree import glob_match

    raw = _read_specs(path)
    out = {}
    for glob, dims in raw.items():
        where = f"--specs {path!r}, entry {glob!r}: {dims!r}"
        if not isinstance(glob, str) or not glob:
            raise ConfigError(f"{where}: keys are FQN globs (strings), e.g. {_SPECS_EXAMPLE}")
        if not isinstance(dims, list) or not all(
                d is None or isinstance(d, str) or (isinstance(d, list) and d and all(
                    isinstance(x, str) for x in d)) for d in dims):
            raise ConfigError(f"{where}: a spec is a list with one entry per dimension: an "
                              f"axis name, null (not sharded) or a list of axis names, e.g. "
                              f'["mlp", null] or [["dp", "fsdp"], null]')
        try:
            glob_match(glob, "")                # a glob that is no glob raises here
            out[glob] = P(*(tuple(d) if isinstance(d, list) else d for d in dims))
        except SpecError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out


def _read_specs(path: str) -> dict:
    """The object in ``--specs`` FILE (JSON; YAML by its suffix)."""
    import json

    from ..core.errors import ConfigError

    yaml_file = path.endswith((".yaml", ".yml"))
    unreadable: tuple = (OSError, ValueError)
    if yaml_file:
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"--specs {path!r}: a YAML file needs pyyaml, which meshlab "
                              f"installs as an extra (pip install 'meshlab[yaml]'); or write "
                              f"the same specs as JSON") from None
        unreadable += (yaml.YAMLError,)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) if yaml_file else json.load(f)
    except unreadable as e:
        raise ConfigError(f"--specs {path!r}: cannot read it ({e}); write e.g. "
                          f"{_SPECS_EXAMPLE}") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"--specs {path!r}: expected a non-empty object of FQN globs to "
                          f"spec lists, e.g. {_SPECS_EXAMPLE}")
    return raw


def _layout(args):
    """The sharding: the policy of the model's family (``policies.auto``) with the
    ``--specs`` file's specs added for the parameters it leaves whole; with
    ``--no-policy``, the file's specs alone."""
    from .. import policies
    from ..core.errors import ConfigError
    from ..transforms import shard

    rules = _rules_arg(args.rules)
    specs = _specs_arg(args.specs) if args.specs else None
    if args.no_policy:
        if specs is None:
            raise ConfigError("--no-policy lays the model out by --specs alone; give "
                              "--specs FILE too")
        return shard(specs, rules)
    spec = shard(policies.auto, rules)
    return spec | shard(specs) if specs is not None else spec


def _planned(model, spec, mesh, args):
    """``meshlab.plan``, its policy and layout errors told how the flags change them."""
    from ..apply.plan import plan as make_plan
    from ..core.errors import PlanError, PolicyError

    try:
        return make_plan(model, spec, mesh, uneven=args.uneven)
    except PolicyError as e:
        how = (f"add --no-policy to lay it out by --specs {args.specs!r} alone" if args.specs
               else "--specs FILE --no-policy lays the model out by your own specs")
        raise PolicyError(f"{e}. On the command line: {how}") from None
    except PlanError as e:
        if not args.specs or "shard specs" not in str(e):
            raise
        hint = "" if args.no_policy or "already laid out" not in str(e) else (
            "; they add to the policy of the model's family, and --no-policy lays the model "
            "out by the file alone")
        raise PlanError(f"{e} (shard specs: the entries of --specs {args.specs!r}{hint})") \
            from None


def _offload_arg(text: str):
    """``--offload optimizer=1.0,grads=0.5`` or ``--offload auto=120GiB``."""
    from ..core.errors import ConfigError
    from ..transforms import offload

    kw: dict = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in ("params", "grads", "optimizer", "auto"):
            raise ConfigError(f"--offload {text!r}: write kind=fraction pairs of params, grads, "
                              f"optimizer (e.g. optimizer=1.0,grads=0.5) or auto=<budget> "
                              f"(e.g. auto=120GiB)")
        if k == "auto":
            kw.update(policy="auto", budget=v.strip())
            continue
        try:
            kw[k] = float(v)
        except ValueError:
            raise ConfigError(f"--offload {k}={v!r}: a fraction from 0 to 1, e.g. "
                              f"{k}=0.5") from None
    return offload(**kw)


def cmd_plan(args) -> int:
    import time

    import torch
    from rich.console import Console

    from ..policies import presets
    from ..core.mesh import Mesh

    console = Console(width=None if sys.stdout.isatty() else 160)
    t0 = time.perf_counter()
    _check_plan_flags(args)
    dtype = getattr(torch, args.dtype)
    model = presets.build(args.model, device="meta", dtype=dtype)
    mesh = Mesh.parse(args.mesh, fake=True)
    spec = _layout(args)                    # no --rules: Rules.default()
    if args.advise:
        return _advise(console, model, args)
    if args.remat:
        from ..transforms import remat

        spec = spec | remat(args.remat)
    if args.fuse:
        from ..transforms import fuse

        spec = spec | fuse()
    if args.zero is not None:
        from ..transforms import zero_shard

        spec = spec | zero_shard(args.zero, args.zero_axis)
    if args.offload:
        spec = spec | _offload_arg(args.offload)
    if "ep" in mesh.axis_names:
        from ..transforms import expert_route

        spec = spec | expert_route("ep")
    if "pp" in mesh.axis_names:
        from ..transforms import pipeline

        spec = spec | pipeline("pp", schedule=args.schedule, microbatches=args.microbatches)
    p = _planned(model, spec, mesh, args)
    if p.not_runnable:
        print(_refusal(p, args.mesh), file=sys.stderr)
        return 2
    console.print(p.table(collapse=not args.full))
    if args.batch is None:
        console.print(p.memory())
    else:
        _print_costs(console, p, args)
    from ..transforms.pipeline import Pipeline, stage_table

    if p.get(Pipeline) is not None:
        console.print(stage_table(p))
    from ..transforms import ExpertRoute

    if p.get(ExpertRoute) is not None and args.batch is not None:
        console.print(str(p.get(ExpertRoute).load(p, batch=args.batch, seq=args.seq)))
    if args.offload:
        from ..transforms import Offload
        from ..transforms.offload import Choice

        console.print(p.decision(Choice).describe())       # what bind selected
        console.print(str(p.get(Offload).step_cost(p)))
    if args.json:
        with open(args.json, "w") as f:
            f.write(p.to_json(indent=1))
        console.print(f"plan written to {args.json}")
    if args.pictures:
        for path in _pictures(p, args):
            console.print(f"picture written to {path}")
    console.print(f"planned {len(p)} parameters ({sum(e.numel for e in p if not e.tied_to):,} "
                  f"elements) on {mesh.size:,} ranks in {time.perf_counter() - t0:.2f} s")
    return 0


def _card(args):
    """``--gpu`` (a preset or a calibrate JSON) with ``--memory`` overriding its bytes."""
    from ..estimate.machine import machine, parse_memory

    card = machine(args.gpu)
    return card.replace(memory=parse_memory(args.memory)) if args.memory else card


def _print_costs(console, p, args) -> None:
    """Memory with activations and the peak, communication, and the step time."""
    card = _card(args)
    mem = p.memory(batch=args.batch, seq=args.seq)
    console.print(mem)
    console.print(p.comm(batch=args.batch, seq=args.seq))
    fits = mem.peak <= card.memory
    from ..core.units import fmt_bytes

    console.print(f"peak {fmt_bytes(mem.peak)} per rank: "
                  f"{'fits' if fits else 'does NOT fit'} {card.name} "
                  f"({fmt_bytes(card.memory)})")
    console.print(f"predicted step on {card.name}: {p.time(batch=args.batch, seq=args.seq, gpu=card)!r}")


def _advise(console, model, args) -> int:
    from ..estimate.advise import advise
    from ..core.errors import ConfigError

    if args.gpus is None:
        raise ConfigError("--advise needs --gpus N, the number of cards to lay the model out on")
    card = _card(args)
    a = advise(model, gpus=args.gpus, gpu=card, batch=args.batch, seq=args.seq,
               memory=card.memory, progress=sys.stderr.isatty())
    console.print(a)
    return 0 if a.best else 1


def cmd_calibrate(args) -> int:
    import json

    from ..estimate.machine import calibrate

    m = calibrate(args.device, quick=args.quick)
    with open(args.out, "w") as f:
        json.dump(m.to_json(), f, indent=1)
    print(f"{m!r}\nwritten to {args.out}; use it as meshlab plan --gpu {args.out}")
    return 0


def cmd_env(args) -> int:
    import platform

    import torch

    from .. import __version__

    print(f"meshlab {__version__}")
    print(f"python {platform.python_version()} on {platform.platform()}")
    print(f"torch {torch.__version__} (cuda: {torch.cuda.is_available()}, "
          f"devices: {torch.cuda.device_count()})")
    for mod in ("transformers", "optree", "safetensors", "einops", "peft"):
        try:
            m = __import__(mod)
            print(f"{mod} {getattr(m, '__version__', '?')}")
        except ImportError:
            print(f"{mod} not installed")
    return 0


def cmd_check(args) -> int:
    from ..ops import check as _check

    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    if ops is not None:
        from ..core.errors import ConfigError
        from ..ops import OPS

        unknown = [o for o in ops if o not in OPS]
        if unknown or not ops:
            raise ConfigError(f"--ops {args.ops!r}: {', '.join(map(repr, unknown)) or 'no op'}"
                              f" is not one of meshlab's fused ops ({', '.join(sorted(OPS))}); "
                              f"pass e.g. --ops {sorted(OPS)[0]}")
    return _check.run(ops=ops, devices=[args.device] if args.device else None,
                      run_opcheck=not args.no_opcheck)


def cmd_build(args) -> int:
    """Compile the C++ kernels now (they are otherwise built the first time an op runs)."""
    import time

    from ..ops import _build

    off = _build.native_disabled_reason()
    if off is not None:
        print(f"meshlab build: native kernels are off ({off}); nothing to build", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    built = _build.build_all()
    for name, ok in built.items():
        where = _build.build_dir(name)
        print(f"{name:<24} {'built' if ok else 'FAILED'}  "
              f"{where if ok else _build.failure(name)}")
    print(f"{sum(built.values())} of {len(built)} extensions ready in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0 if all(built.values()) else 1


def _pictures(p, args) -> list[str]:
    """``--pictures DIR``: the memory per rank (with --batch, its activations and peak) and,
    with a pipeline, the schedule, as PNG files in DIR."""
    import os

    from ..core.log import require

    plt = require("matplotlib", "plot", "meshlab plan --pictures")
    plt.use("Agg")
    import matplotlib.pyplot as pyplot

    from ..transforms.pipeline import Pipeline, plot_schedule

    os.makedirs(args.pictures, exist_ok=True)
    kw = {} if args.batch is None else dict(batch=args.batch, seq=args.seq)
    out = []
    ax = p.memory(**kw).plot(gpu=args.gpu if args.batch is not None else None)
    out.append(os.path.join(args.pictures, "memory.png"))
    ax.figure.savefig(out[-1], dpi=120, bbox_inches="tight")
    pyplot.close(ax.figure)
    if p.get(Pipeline) is not None:
        ax = plot_schedule(p)
        out.append(os.path.join(args.pictures, "schedule.png"))
        ax.figure.savefig(out[-1], dpi=120, bbox_inches="tight")
        pyplot.close(ax.figure)
    return out


def _plan_parser(sub) -> None:
    """``meshlab plan``'s arguments."""
    p = sub.add_parser("plan", help="plan a model on a fake mesh and print its layout and memory",
                       description=_PLAN, epilog=_PLAN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b",
                   help="a preset name (see meshlab.policies.presets) or a Hugging Face config.json "
                        "(or its directory) of any family, built on the meta device without "
                        "weights: with its architectures' class, else the first auto class "
                        "that maps it (causal LM; seq2seq first for encoder-decoders; image "
                        "classification; masked LM; the base model), else the model class of "
                        "the config's own transformers module")
    p.add_argument("--mesh", default="dp=8,tp=8",
                   help="axis=size pairs, e.g. pp=8,dp=16,tp=8 (an 'ep' axis adds expert_route)")
    p.add_argument("--rules", default=None,
                   help=f"logical=axis[|fallback][|None] pairs in priority order; '+' "
                        f"joins axes sharding one dimension together, e.g. "
                        f"batch=dp+fsdp|dp,heads=tp|None (default: {DEFAULT_RULES_HELP})")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--uneven", action="store_true", help="allow dims not divisible by their shards")
    p.add_argument("--full", action="store_true", help="one row per parameter (no collapsing)")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    p.add_argument("--pictures", default=None, metavar="DIR",
                   help="also draw the memory per rank (memory.png) and, with a pipeline, its "
                        "schedule (schedule.png) into DIR (needs meshlab[plot])")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                   help="add zero_shard(stage) over --zero-axis")
    p.add_argument("--zero-axis", default="dp", help="the ZeRO axis (default dp)")
    p.add_argument("--batch", type=int, default=None,
                   help="per-data-parallel-rank batch (with --advise: the global batch): also "
                        "print activations, the peak per rank, communication and step time")
    p.add_argument("--seq", type=int, default=2048, help="sequence length for --batch")
    p.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule when the mesh has a 'pp' axis (gpipe, 1f1b, "
                        "interleaved, zero_bubble, zbv)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches")
    p.add_argument("--offload", default=None,
                   help="add offload(): kind=fraction pairs (optimizer=1.0,grads=0.5,params=0) "
                        "or auto=<device budget per rank> (auto=120GiB); prints host and device "
                        "bytes and the predicted step cost")
    p.add_argument("--specs", default=None,
                   help="a JSON (or, with pyyaml, YAML) file of parameter FQN globs -> spec "
                        "lists, one entry per dim: an axis name, null (not sharded) or a "
                        "list of axes, e.g. {\"model.layers.*.mlp.up_proj.weight\": "
                        "[\"mlp\", \"embed\"], \"score.weight\": []}. Added to the "
                        "family's policy, for the parameters it leaves whole (a parameter "
                        "both lay out differently is refused)")
    p.add_argument("--no-policy", action="store_true",
                   help="lay the model out by --specs alone, without the family's policy "
                        "(a family no policy covers, or to replace the policy's layout)")
    p.add_argument("--remat", default=None, choices=("none", "full", "selective"),
                   help="add remat(policy)")
    p.add_argument("--fuse", action="store_true", help="add fuse() (meshlab's fused ops)")
    p.add_argument("--gpu", default="h200",
                   help="the card: h100, h200, a100, b200 or a JSON from meshlab calibrate")
    p.add_argument("--memory", default=None,
                   help="the card's memory, overriding --gpu's (e.g. 141GB, 80GiB)")
    p.add_argument("--advise", action="store_true",
                   help="search meshes x ZeRO stage x remat x microbatches over --gpus cards "
                        "and print the fastest layouts that fit")
    p.add_argument("--gpus", type=int, default=None, help="cards for --advise")
    p.set_defaults(fn=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshlab", description=__doc__.split("``meshlab --help``")[0]
                                 .replace("``", "").strip(), epilog=_TOP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    _plan_parser(sub)

    k = sub.add_parser("calibrate", help="measure this machine's matmul, memory, attention, "
                                         "launch and host-copy rates for plan --gpu")
    k.add_argument("--out", default="machine.json", help="where to write the profile")
    k.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    k.add_argument("--quick", action="store_true", help="fewer repeats")
    k.set_defaults(fn=cmd_calibrate)

    e = sub.add_parser("env", help="versions of meshlab and what it runs on (for bug reports)")
    e.set_defaults(fn=cmd_env)

    c = sub.add_parser("check", help="build the fused-op kernels and check each against its "
                                     "reference; says what fell back and why")
    c.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    c.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="one device (default: cpu, and cuda when present)")
    c.add_argument("--no-opcheck", action="store_true", help="skip torch.library.opcheck")
    c.set_defaults(fn=cmd_check)

    b = sub.add_parser("build", help="compile the C++ kernels now, into the cache every later "
                                     "process loads them from (opt-in; otherwise lazy)")
    b.set_defaults(fn=cmd_build)

    from . import generate as _cli_generate
    from . import run as _cli_run

    _cli_run.add_commands(sub)
    _cli_generate.add_command(sub)
    args = ap.parse_args(argv)
    from ..core.errors import MeshlabError

    try:
        return args.fn(args)
    except MeshlabError as e:
        print(f"meshlab {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
