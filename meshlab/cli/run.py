"""``meshlab run`` (a thin launcher over ``torch.distributed.run``) and ``meshlab demo``.

``meshlab run`` resolves a torchrun command line, prints it, and runs it with the same
Python; the exit code of the first failing rank becomes the exit code of the command.
Multi-node jobs take their node count and master address from ``--nnodes`` and
``--master-addr`` or from a hostfile::

    # hosts.txt: one host a line, optional slots (processes on that host)
    node-a slots=8
    node-b slots=8

    meshlab run --hostfile hosts.txt train.py --lr 3e-4     # on every node

Bad input (a missing script, an unreadable hostfile, ``--nproc-per-node 0``) is reported
in one line with exit code 2 before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import subprocess
import sys

DEFAULT_MASTER_PORT = 29500
EXIT_USAGE = 2


class LaunchError(ValueError):
    """Bad launcher input; reported as ``meshlab <cmd>: error: ...`` with exit code 2."""


# -- hostfiles -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int | None = None


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Hosts of a hostfile: ``name [slots=N]`` a line; ``#`` starts a comment."""
    hosts: list[Host] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *opts = line.split()
        slots = None
        for opt in opts:
            key, eq, value = opt.partition("=")
            if key not in ("slots", "max_slots") or not eq:
                raise LaunchError(f"{source}:{n}: unknown field {opt!r}; expected 'HOST' or "
                                  f"'HOST slots=N'")
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise LaunchError(f"{source}:{n}: {opt!r}: slots must be an integer >= 1")
            if key == "slots":
                slots = int(value)
        if any(h.name == name for h in hosts):
            raise LaunchError(f"{source}:{n}: host {name!r} is listed twice; give it slots=N "
                              f"on one line instead")
        hosts.append(Host(name, slots))
    if not hosts:
        raise LaunchError(f"{source}: no hosts (one hostname a line, '#' for comments)")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchError(f"cannot read hostfile {path!r}: {getattr(e, 'strerror', None) or e}")
    return parse_hostfile_text(text, path)


def _this_node(hosts: list[Host]) -> int | None:
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {n.split(".")[0] for n in names}
    for i, h in enumerate(hosts):
        if h.name in names or h.name.split(".")[0] in names:
            return i
    if len(hosts) == 1 and hosts[0].name in ("localhost", "127.0.0.1"):
        return 0
    return None


# -- resolving the torchrun command ---------------------------------------------------------
def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _check_target(target: str, module: bool) -> None:
    if not module:
        if not os.path.isfile(target):
            raise LaunchError(f"script {target!r} not found (cwd {os.getcwd()}); pass a path "
                              f"to a Python file, or -m MODULE")
        return
    import importlib.machinery
    import importlib.util

    parts = target.split(".")
    if not all(p.isidentifier() for p in parts):
        raise LaunchError(f"-m {target!r} is not a module name")
    # Walk the package path without importing (and running) any of it.
    path = [os.getcwd()] + sys.path
    spec = importlib.machinery.PathFinder.find_spec(parts[0], path) \
        or importlib.util.find_spec(parts[0])
    for part in parts[1:]:
        if spec is None or not spec.submodule_search_locations:
            break
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    if spec is None:
        raise LaunchError(f"no module named {target!r} (searched the current directory and "
                          f"sys.path)")


def resolve(args) -> tuple[list[str], list[str]]:
    """(torchrun arguments, lines to print) for parsed ``meshlab run`` arguments."""
    if not args.command:
        raise LaunchError("no script given; usage: meshlab run [OPTIONS] script.py [ARGS ...] "
                          "or meshlab run [OPTIONS] -m module [ARGS ...]")
    script, script_args = args.command[0], args.command[1:]
    notes: list[str] = []
    hosts = None
    if args.hostfile:
        hosts = read_hostfile(args.hostfile)
        notes.append(f"hostfile {os.path.abspath(args.hostfile)}: {len(hosts)} node(s): "
                     + ", ".join(h.name + (f" (slots={h.slots})" if h.slots else "")
                                 for h in hosts))
    nnodes = args.nnodes
    if hosts is not None:
        if nnodes is not None and nnodes != len(hosts):
            raise LaunchError(f"--nnodes {nnodes} disagrees with the {len(hosts)} hosts of "
                              f"{args.hostfile}")
        nnodes = len(hosts)
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes}: must be >= 1")
    node_rank = args.node_rank
    if node_rank is None and nnodes > 1 and hosts is not None:
        node_rank = _this_node(hosts)
        if node_rank is None:
            raise LaunchError(f"this machine ({socket.gethostname()}) is not in {args.hostfile}; "
                              f"pass --node-rank")
    if node_rank is None:
        if nnodes > 1:
            raise LaunchError(f"--nnodes {nnodes} needs --node-rank (0..{nnodes - 1}) on each "
                              f"node, or a --hostfile that lists this machine")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank}: must be in 0..{nnodes - 1}")
    nproc = args.nproc_per_node
    if nproc is None and hosts is not None and hosts[node_rank].slots:
        nproc = hosts[node_rank].slots
    nproc = _default_nproc() if nproc is None else nproc
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node {nproc}: must be >= 1")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: must be >= 0")
    master = args.master_addr or (hosts[0].name if hosts is not None and nnodes > 1 else None)
    if nnodes > 1 and master is None:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr (the host of node 0) or a "
                          f"--hostfile")
    if not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master-port {args.master_port}: must be in 1..65535")
    _check_target(script, args.module)

    cmd = []
    if nnodes == 1 and master is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", master, "--master-port", str(args.master_port)]
    cmd += ["--nproc-per-node", str(nproc)]
    if args.max_restarts:
        cmd += ["--max-restarts", str(args.max_restarts)]
    cmd += (["-m"] if args.module else []) + [script] + script_args
    return cmd, notes


def launch(torchrun_args: list[str], notes: list[str] = (), env: dict | None = None) -> int:
    """Print the command, run it with this Python, return the first failing rank's code."""
    for line in notes:
        print(f"meshlab run: {line}")
    print(f"meshlab run: torchrun {shlex.join(torchrun_args)}", flush=True)
    argv = [sys.executable, "-m", "meshlab.cli.run"] + torchrun_args
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})})
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the workers got the signal too; let torchrun stop them
        try:
            return proc.wait(timeout=30)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            return 130


# -- the commands -------------------------------------------------------------------------
def _fail(cmd: str, e: Exception) -> int:
    print(f"meshlab {cmd}: error: {e}", file=sys.stderr)
    return EXIT_USAGE


def cmd_run(args) -> int:
    try:
        cmd, notes = resolve(args)
    except LaunchError as e:
        return _fail("run", e)
    return launch(cmd, notes)


def cmd_demo(args) -> int:
    from ..core.errors import MeshlabError
    from ..core.mesh import Mesh
    from .demo import add_arguments, check

    nproc = args.nproc_per_node
    try:
        if nproc < 1:
            raise LaunchError(f"--nproc-per-node {nproc}: must be >= 1")
        size = Mesh.parse(args.mesh).size
        if size != nproc:
            raise LaunchError(f"--mesh {args.mesh} has {size} positions but --nproc-per-node is "
                              f"{nproc}; they must be equal (e.g. --nproc-per-node {size})")
        problem = check(args)
        if problem:
            raise LaunchError(problem)
    except (LaunchError, MeshlabError) as e:
        return _fail("demo", e)
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    demo_argv: list[str] = []
    for a in probe._actions:
        value = getattr(args, a.dest)
        if a.nargs == 0:
            demo_argv += [a.option_strings[-1]] if value else []
        elif value != a.default:
            demo_argv += [a.option_strings[-1], str(value)]
    return launch(["--standalone", "--nproc-per-node", str(nproc), "-m", "meshlab.cli.demo"]
                  + demo_argv, env={"OMP_NUM_THREADS": "1"})


def add_commands(sub) -> None:
    r = sub.add_parser(
        "run", help="start a script on N processes per node (a thin torchrun launcher)",
        usage="meshlab run [OPTIONS] SCRIPT [ARGS ...]\n"
              "       meshlab run [OPTIONS] -m MODULE [ARGS ...]",
        description="Start SCRIPT (or -m MODULE) on --nproc-per-node processes per node with "
                    "torch.distributed.run; the resolved torchrun command is printed first.")
    r.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: the GPU count, 1 on CPU, or the "
                        "hostfile's slots=)")
    r.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1)")
    r.add_argument("--node-rank", type=int, default=None,
                   help="this node's index (default: its position in --hostfile)")
    r.add_argument("--master-addr", default=None, help="host of node 0 (multi-node)")
    r.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                   help=f"port on the master host (default {DEFAULT_MASTER_PORT})")
    r.add_argument("--hostfile", default=None,
                   help="one host a line ('HOST [slots=N]', '#' comments): gives --nnodes, "
                        "the master address (the first host) and this node's rank")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="restart the workers up to K times after a failure (default 0)")
    r.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module, like python -m")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                   help="the Python file (or, with -m, the module) to run, and its arguments")
    r.set_defaults(fn=cmd_run)

    from .demo import add_arguments

    d = sub.add_parser(
        "demo", help="train a tiny Llama on 4 CPU processes (dp=2, tp=2) and show the loss fall",
        description="Launch meshlab.cli.demo on --nproc-per-node local processes (gloo on CPU).")
    d.add_argument("--nproc-per-node", type=int, default=4,
                   help="local processes (default 4; must equal the mesh size)")
    add_arguments(d)
    d.set_defaults(fn=cmd_demo)


# -- the process torchrun runs in (``python -m meshlab.cli.run TORCHRUN_ARGS``) -----------
def _torchrun(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        host = socket.gethostname()
        for r, f in sorted(e.failures.items()):
            how = (f"was stopped by {f.signal_name()}" if f.exitcode < 0
                   else f"exited with code {f.exitcode}")
            print(f"meshlab run: rank {r} (local rank {f.local_rank} on {host}) {how}"
                  + (" (first failure)" if r == rank else ""), file=sys.stderr)
        code = first.exitcode
        return 128 - code if code < 0 else (code if 0 < code < 256 else 1)
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
