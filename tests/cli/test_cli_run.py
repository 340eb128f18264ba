"""``meshlab run`` and ``meshlab demo``, run as a user runs them: in subprocesses.

Every launch below starts at once in a module fixture (they are independent) and is
collected on first use. Bad input, which exits before anything starts, goes through the
same ``main`` in this process (``_cli.in_process``); hostfile parsing and command
resolution are tested in-process too.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

import pytest

from meshlab.cli.run import (Host, LaunchError, add_commands, parse_hostfile_text,
                              read_hostfile, resolve)

from tests._cli import in_process
from tests import REPO

ROOT = os.fspath(REPO)

SCRIPTS = {
    "ranks.py": "import os, sys\n"
                "print(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} \"\n"
                "      f\"args {sys.argv[1:]}\", flush=True)\n",
    "exit3.py": "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n",
    "tinymod.py": "import os, sys\nprint(f\"module rank {os.environ['RANK']} {sys.argv[1:]}\")\n",
    # A save, then rank 1 still at work while rank 0 has already reached interpreter exit:
    # the moment a group left to teardown aborts ("terminate called without an active
    # exception"). Each rank records when it finished and when its group was destroyed.
    "exit_after_save.py": (
        "import json, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "import meshlab as ml\n"
        "mesh = ml.Mesh(dp=2)\n"
        "rank = dist.get_rank()\n"
        "torch.manual_seed(0)\n"
        "model = ml.parallelize(torch.nn.Linear(4, 4), ml.data_parallel('dp'), mesh)\n"
        "ml.checkpoint.save(sys.argv[1] + '/exit_ckpt', model)\n"
        "def note(**kw):\n"
        "    with open(f'{sys.argv[1]}/exit{rank}.jsonl', 'a') as f:\n"
        "        f.write(json.dumps(kw) + '\\n')\n"
        "destroy = dist.destroy_process_group\n"
        "def recorded(*a, **k):\n"
        "    note(destroy=time.time())\n"
        "    return destroy(*a, **k)\n"
        "dist.destroy_process_group = recorded\n"
        "if rank == 1:\n"
        "    time.sleep(2.0)\n"
        "note(done=time.time())\n"),
    "hosts.txt": "# one local node\nlocalhost slots=2   # two processes\n",
    "bad_hosts.txt": "node-a slots=0\n",
}

# name: (meshlab arguments, working directory is the scripts' folder)
CASES = {
    "ranks": ["run", "--nproc-per-node", "2", "{tmp}/ranks.py", "hello", "--nproc-per-node", "9"],
    "exit3": ["run", "--nproc-per-node", "2", "{tmp}/exit3.py"],
    "module": ["run", "--nproc-per-node", "2", "-m", "tinymod", "x"],
    "hostfile": ["run", "--hostfile", "{tmp}/hosts.txt", "ranks.py"],
    "demo": ["demo", "--nproc-per-node", "4", "--steps", "20"],
    "exit_after_save": ["run", "--nproc-per-node", "2", "{tmp}/exit_after_save.py", "{tmp}"],
}
# bad input: a one-line message and exit code 2, before anything starts (in this process)
BAD = {
    "missing-script": ["run", "--nproc-per-node", "2", "{tmp}/no_such_script.py"],
    "missing-module": ["run", "-m", "no_such_module_here"],
    "no-script": ["run", "--nproc-per-node", "2"],
    "unreadable-hostfile": ["run", "--hostfile", "{tmp}", "ranks.py"],
    "bad-hostfile": ["run", "--hostfile", "{tmp}/bad_hosts.txt", "ranks.py"],
    "nproc-zero": ["run", "--nproc-per-node", "0", "ranks.py"],
    "nnodes-without-rank": ["run", "--nnodes", "2", "--master-addr", "h0", "ranks.py"],
    "demo-mesh-mismatch": ["demo", "--nproc-per-node", "2", "--mesh", "dp=2,tp=2"],
    "demo-bad-mesh": ["demo", "--mesh", "dp=two"],
    "demo-bad-steps": ["demo", "--steps", "0"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cli_run"))
    for name, text in SCRIPTS.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["COLUMNS"] = "200"
    procs = {}
    for name, args in CASES.items():
        argv = [sys.executable, "-m", "meshlab.cli"] + [a.format(tmp=tmp) for a in args]
        procs[name] = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {"tmp": tmp}
    for name, args in BAD.items():
        out[name] = in_process([a.format(tmp=tmp) for a in args], cwd=tmp)
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=300)
            out[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


def test_run_starts_each_rank_with_its_arguments(runs):
    rc, stdout, stderr = runs["ranks"]
    assert rc == 0, stderr
    # flags after the script belong to the script
    for r in (0, 1):
        assert f"rank {r} of 2 args ['hello', '--nproc-per-node', '9']" in stdout
    assert "torchrun --standalone --nproc-per-node 2 " in stdout
    assert stdout.index("torchrun") < stdout.index("rank 0 of 2")


@pytest.mark.slow
def test_a_group_meshlab_started_ends_after_every_rank_is_done(runs):
    """At exit each rank waits for the slowest before its group is destroyed, so no rank
    closes its connections under a peer still using them (the abort seen after saves)."""
    import json

    rc, stdout, stderr = runs["exit_after_save"]
    assert rc == 0, stderr
    assert "terminate called" not in stderr
    notes = {}
    for r in (0, 1):
        with open(os.path.join(runs["tmp"], f"exit{r}.jsonl")) as f:
            for line in f:
                notes.setdefault(r, {}).update(json.loads(line))
    for r in (0, 1):
        assert "destroy" in notes[r], f"rank {r} left its group to interpreter teardown"
    # rank 1 finished 2 s after rank 0; rank 0 destroyed its group only after that
    assert notes[1]["done"] >= notes[0]["done"] + 1.5
    assert notes[0]["destroy"] >= notes[1]["done"]


def test_run_propagates_the_failing_rank_exit_code(runs):
    rc, stdout, stderr = runs["exit3"]
    assert rc == 3, stdout + stderr
    assert "rank 1 (local rank 1" in stderr and "exited with code 3" in stderr
    assert "Traceback" not in stderr


def test_run_module(runs):
    rc, stdout, stderr = runs["module"]
    assert rc == 0, stderr
    assert "-m tinymod x" in stdout
    assert "module rank 0 ['x']" in stdout and "module rank 1 ['x']" in stdout


def test_run_with_a_hostfile_uses_its_slots(runs):
    rc, stdout, stderr = runs["hostfile"]
    assert rc == 0, stderr
    assert f"hostfile {runs['tmp']}/hosts.txt: 1 node(s): localhost (slots=2)" in stdout
    assert "torchrun --standalone --nproc-per-node 2 ranks.py" in stdout
    assert "rank 0 of 2" in stdout and "rank 1 of 2" in stdout


@pytest.mark.slow
def test_demo_trains_and_the_loss_falls(runs):
    rc, stdout, stderr = runs["demo"]
    assert rc == 0, stdout + stderr
    assert "-m meshlab.cli.demo --steps 20" in stdout
    assert "meshlab plan: LlamaForCausalLM  on Mesh(dp=2, tp=2)" in stdout
    assert "memory per rank (dp=2, tp=2)" in stdout
    assert "lm_head.weight" in stdout
    losses = {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss\s+([\d.]+)", stdout)}
    assert sorted(losses) == [0, 10, 19], stdout
    assert 5.0 < losses[0] < 6.0  # about ln(256): bytes start out equally likely
    assert losses[19] < losses[0] - 1.5, losses
    assert "the loss fell" in stdout
    # one rank prints: the plan appears once
    assert stdout.count("meshlab plan:") == 1


@pytest.mark.parametrize("name,needles", [
    ("missing-script", ["no_such_script.py", "not found"]),
    ("missing-module", ["no module named 'no_such_module_here'"]),
    ("no-script", ["no script given"]),
    ("unreadable-hostfile", ["cannot read hostfile"]),
    ("bad-hostfile", ["bad_hosts.txt:1", "slots must be an integer >= 1"]),
    ("nproc-zero", ["--nproc-per-node 0", ">= 1"]),
    ("nnodes-without-rank", ["--node-rank"]),
    ("demo-mesh-mismatch", ["4 positions", "--nproc-per-node is 2"]),
    ("demo-bad-mesh", ["dp=two", "name=size"]),
    ("demo-bad-steps", ["--steps"]),
])
def test_bad_input_exits_2_with_a_message(runs, name, needles):
    rc, stdout, stderr = runs[name]
    assert rc == 2, stdout + stderr
    for n in needles:
        assert n in stderr, stderr
    assert "Traceback" not in stdout + stderr
    assert "torchrun" not in stdout, "nothing may start on bad input"


# -- in-process: hostfiles and command resolution (nothing is launched) ---------------------
def test_parse_hostfile():
    text = ("# cluster\n\nnode-a slots=8\n  node-b   # spare\nnode-c.example.org slots=4 "
            "max_slots=4\n")
    assert parse_hostfile_text(text) == [Host("node-a", 8), Host("node-b", None),
                                         Host("node-c.example.org", 4)]


@pytest.mark.parametrize("text,message", [
    ("", "no hosts"),
    ("# only a comment\n", "no hosts"),
    ("a\nb slots=two\n", "hf:2: 'slots=two'"),
    ("a slots=0\n", "slots must be an integer >= 1"),
    ("a cpus=4\n", "unknown field 'cpus=4'"),
    ("a\na\n", "listed twice"),
])
def test_parse_hostfile_errors(text, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        parse_hostfile_text(text, "hf")


def test_read_hostfile_errors(tmp_path):
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "absent"))
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path))


def _resolve(tmp_path, *argv):
    script = tmp_path / "train.py"
    script.write_text("")
    ap = argparse.ArgumentParser()
    add_commands(ap.add_subparsers(dest="cmd"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        return resolve(ap.parse_args(["run", *argv]))
    finally:
        os.chdir(cwd)


def test_resolve_single_node_is_standalone(tmp_path):
    cmd, notes = _resolve(tmp_path, "--nproc-per-node", "3", "train.py", "--lr", "1")
    assert cmd == ["--standalone", "--nproc-per-node", "3", "train.py", "--lr", "1"]
    assert notes == []


def test_resolve_hostfile_gives_nodes_master_and_slots(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("head slots=4\nworker-1 slots=2\nworker-2 slots=2\n")
    cmd, notes = _resolve(tmp_path, "--hostfile", str(hf), "--node-rank", "1",
                          "--max-restarts", "2", "train.py")
    assert cmd == ["--nnodes", "3", "--node-rank", "1", "--master-addr", "head",
                   "--master-port", "29500", "--nproc-per-node", "2", "--max-restarts", "2",
                   "train.py"]
    assert "3 node(s): head (slots=4), worker-1 (slots=2), worker-2 (slots=2)" in notes[0]
    # an explicit --nproc-per-node wins over slots
    cmd, _ = _resolve(tmp_path, "--hostfile", str(hf), "--node-rank", "0",
                      "--nproc-per-node", "1", "--master-port", "1234", "train.py")
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1"
    assert cmd[cmd.index("--master-port") + 1] == "1234"


def test_resolve_finds_this_node_in_the_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text(f"head-node\n{socket.gethostname()} slots=3\n")
    cmd, _ = _resolve(tmp_path, "--hostfile", str(hf), "train.py")
    assert cmd[:4] == ["--nnodes", "2", "--node-rank", "1"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3"


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2", "train.py"], "--node-rank"),
    (["--nnodes", "2", "--node-rank", "0", "train.py"], "--master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "train.py"], "0..1"),
    (["--nnodes", "0", "train.py"], "--nnodes 0"),
    (["--max-restarts", "-1", "train.py"], "--max-restarts"),
    (["--master-port", "70000", "--nnodes", "1", "--master-addr", "h", "train.py"],
     "1..65535"),
    (["-m", "not a module"], "not a module name"),
])
def test_resolve_errors(tmp_path, argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        _resolve(tmp_path, *argv)


def test_resolve_hostfile_conflicts(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("a\nb\n")
    with pytest.raises(LaunchError, match="disagrees"):
        _resolve(tmp_path, "--hostfile", str(hf), "--nnodes", "3", "train.py")
    with pytest.raises(LaunchError, match="not in"):
        _resolve(tmp_path, "--hostfile", str(hf), "train.py")  # this machine is neither a nor b
