"""``expert_route`` at plan time: the expert layout found, per-rank expert bytes in
``plan.memory()``, the traffic in ``plan.comm()``, and the expected load per rank."""

from __future__ import annotations

import pytest

import meshlab as ml

from tests import _models as M


def _plan(mesh, spec=None, family="mixtral"):
    return ml.plan(M.build(family), spec or ml.expert_route("ep"), ml.Mesh(**mesh, fake=True))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_the_experts_are_found_and_split(family):
    p = _plan(dict(ep=4), family=family)
    layouts = ml.parallel.expert.experts_of(p)
    assert layouts and all(x.num_experts == 4 and len(x.params) == 2 for x in layouts)
    one = _plan(dict(ep=1), family=family).memory()
    four = p.memory()
    held = sum(p[f].numel * 4 for x in layouts for f in x.params)      # fp32
    assert one.params - four.params == pytest.approx(held * 3 / 4)


def test_load_and_traffic_for_a_uniform_router():
    p = _plan(dict(ep=4))
    load = p.get(ml.parallel.ExpertRoute).load(p, batch=2, seq=16)
    assert (load.layers, load.experts, load.per_rank) == (2, 4, 1)
    assert load.pairs == 2 * 16 * 2 and load.away == load.pairs * 3 // 4
    hidden = M.TINY["mixtral"]["hidden_size"]
    assert load.all_to_all_bytes == 4 * 2 * load.away * hidden * 4
    comm = p.comm(batch=2, seq=16).ops[("all_to_all", "ep")]
    assert comm[0] == 5 * 2 and comm[1] == load.all_to_all_bytes + 2 * 8 * 4
    assert "all-to-all bytes per step" in str(load)


def test_refusals_name_the_fix():
    with pytest.raises(ml.ConfigError, match="no experts module"):
        ml.plan(M.build("llama"), ml.expert_route("ep"), ml.Mesh(ep=2, fake=True))
    with pytest.raises(ml.MeshlabError, match="6 % 4"):
        ml.plan(M.build("mixtral", num_local_experts=6), ml.expert_route("ep"),
                ml.Mesh(ep=4, fake=True))
    with pytest.raises(ml.ConfigError, match="capacity_factor"):
        ml.expert_route("ep", capacity_factor=0)
    # under Megatron sequence parallelism each tp rank routes its own part of every
    # sequence: a module the plan replicates over tp that is not one the MoE policy sums
    # over tp (Qwen2-MoE's shared expert) is refused by the tensor-parallel scan
    with pytest.raises(ml.ConfigError, match="shared_expert.*sequence parallelism"):
        ml.plan(M.build("qwen2_moe"), ml.shard(ml.policies.auto, ml.Rules(
            **{**M.TP_RULES, "seq": "tp"})) | ml.expert_route("ep"),
                ml.Mesh(ep=2, tp=2, fake=True))


def test_families_not_yet_shown_are_refused_by_name():
    p = ml.plan(M.build("phimoe"), ml.expert_route("ep"), ml.Mesh(ep=2, fake=True))
    assert any("'phimoe'" in why and "not yet shown" in why for why in p.not_runnable)


def test_cli_plans_expert_parallelism_on_an_ep_axis(capsys):
    from meshlab.cli import main

    assert main(["plan", "--model", "mixtral-8x7b", "--mesh", "dp=2,ep=4", "--batch", "1",
                 "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "experts per layer / per rank" in out and "8 / 2" in out and "all_to_all" in out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_memory_and_time_of_a_float32_moe(family):
    """transformers runs these experts through torch._grouped_mm, whose fake kernel takes
    bfloat16 alone: plan.memory(batch=, seq=) and plan.time() on the float32 model raised
    "Expected inputs of BF16 type"."""
    for spec in (ml.expert_route("ep"), ml.data_parallel("ep")):
        p = ml.plan(M.build(family), spec, ml.Mesh(ep=2, fake=True))
        assert p.memory(batch=2, seq=16).peak > p.memory().params
        assert p.time(batch=2, seq=16).compute > 0
