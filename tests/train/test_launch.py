"""notebook_launcher: real local processes, per-rank results, failures and timeouts."""

from __future__ import annotations

import os
import sys
import time

import pytest

import meshlab as ml
from meshlab.train.launch import RankFailedError, notebook_launcher


# -- functions the processes run (importable, so they travel by reference) ------------------
def all_reduce_rank(tag):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tag": tag,
            "sum": float(t), "local_rank": int(os.environ["LOCAL_RANK"]),
            "omp": os.environ["OMP_NUM_THREADS"], "extra": os.environ.get("MESHLAB_TEST_VAR")}


def fail_on_rank_1():
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def fail_while_others_wait():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise KeyError("rank 1 gave up")
    dist.barrier()  # never completes: rank 1 is gone
    return "unreachable"


def sleep_forever(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(600)


def exit_hard():
    if os.environ["RANK"] == "0":
        os._exit(7)
    return 1


def test_exported():
    assert ml.notebook_launcher is notebook_launcher


def test_results_in_rank_order(capsys):
    out = notebook_launcher(all_reduce_rank, args=("t",), nprocs=2,
                            env={"MESHLAB_TEST_VAR": "yes"})
    assert [r["rank"] for r in out] == [0, 1]
    assert [r["local_rank"] for r in out] == [0, 1]
    assert all(r["world"] == 2 and r["tag"] == "t" and r["extra"] == "yes" for r in out)
    assert [r["sum"] for r in out] == [3.0, 3.0]  # 1 + 2: the processes talked
    assert {r["omp"] for r in out} == {"1"}
    printed = capsys.readouterr().out
    assert "hello from rank 0" in printed and "hello from rank 1" in printed
    assert "MESHLAB_TEST_VAR" not in os.environ and os.environ.get("RANK") != "1"


def test_failure_carries_the_rank_and_its_traceback():
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(fail_on_rank_1, nprocs=2)
    e = info.value
    assert e.rank == 1
    assert "rank 1 of 2 failed" in str(e)
    assert "ValueError: boom on rank 1" in str(e) and "fail_on_rank_1" in e.traceback
    assert isinstance(e.__cause__, ValueError)


def test_failure_stops_ranks_stuck_in_a_collective():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        notebook_launcher(fail_while_others_wait, nprocs=3, timeout=120)
    assert info.value.rank == 1
    assert "KeyError: 'rank 1 gave up'" in str(info.value)
    assert time.monotonic() - t0 < 60


def test_a_process_that_dies_without_a_result():
    with pytest.raises(RankFailedError, match="exited with code 7") as info:
        notebook_launcher(exit_hard, nprocs=2)
    assert info.value.rank == 0


def test_timeout_kills_every_process(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        notebook_launcher(sleep_forever, args=(str(tmp_path),), nprocs=2, timeout=8)
    assert time.monotonic() - t0 < 60
    pids = [int(p) for p in os.listdir(tmp_path)]
    assert len(pids) == 2, "both processes should have started within the timeout"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- functions defined interactively (a notebook's __main__ has no file) --------------------
NOTEBOOK_CELL = '''
def scaled_sum(k):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return k * float(t)


def uses_a_notebook_global():
    return HELPER + 1
'''


@pytest.fixture
def interactive_main(monkeypatch, tmp_path):
    """Functions compiled as IPython does: module ``__main__``, source in a cell file."""
    main = sys.modules["__main__"]
    monkeypatch.delattr(main, "__file__", raising=False)
    cell = tmp_path / "cell_1.py"
    cell.write_text(NOTEBOOK_CELL)
    ns = {"__name__": "__main__", "HELPER": 41}
    exec(compile(NOTEBOOK_CELL, str(cell), "exec"), ns)
    return ns


def test_notebook_function_travels_as_source(interactive_main):
    fn = interactive_main["scaled_sum"]
    assert fn.__module__ == "__main__"
    assert notebook_launcher(fn, args=(10,), nprocs=3) == [30.0, 30.0, 30.0]  # 10 * (0+1+2)


def test_notebook_function_using_a_global_gets_a_hint(interactive_main):
    with pytest.raises(RankFailedError, match="inside its body") as info:
        notebook_launcher(interactive_main["uses_a_notebook_global"], nprocs=1)
    assert "NameError" in str(info.value) and "HELPER" in str(info.value)


def test_functions_that_cannot_travel_are_refused_before_starting(interactive_main):
    ns = {"__name__": "__main__"}
    exec("f = lambda: 1\ndef outer():\n    x = 1\n    def inner():\n        return x\n"
         "    return inner\n", ns)
    with pytest.raises(TypeError, match="lambda"):
        notebook_launcher(ns["f"], nprocs=1)
    with pytest.raises(TypeError, match="enclosing function"):
        notebook_launcher(ns["outer"](), nprocs=1)
    with pytest.raises(TypeError, match="must be a function"):
        notebook_launcher("print(1)", nprocs=1)
    with pytest.raises(ValueError, match="nprocs"):
        notebook_launcher(fail_on_rank_1, nprocs=0)
