"""Every argument ``docs/booster.md`` marks implemented is accepted by ``boost``: on 4 gloo
processes, each plugin built with the row's value (the table's probe) boosts a small model
and trains one step with it. A row whose value ``boost`` refused would be a promise the
table does not keep."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytestmark = pytest.mark.timeout(900)

WORLD = 4
# Rows the table says need a GPU (offload(policy='auto') reads its free memory).
NEEDS_GPU = {"GeminiPlugin.placement_policy"}


def _rows():
    from meshlab.booster.plugin import PLUGINS

    for cls in PLUGINS:
        for a in cls.ARGS:
            if a.kind == "maps" and (torch.cuda.is_available() or
                                     f"{cls.__name__}.{a.name}" not in NEEDS_GPU):
                yield cls.__name__, a.name


def _base(cls_name: str, kw: dict) -> dict:
    """The other arguments a row's value needs on 4 ranks (the required sizes, and the
    pipeline's microbatches)."""
    if cls_name not in ("HybridParallelPlugin", "MoeHybridParallelPlugin"):
        return kw
    out = {"tp_size": 1, "pp_size": 1, **kw}
    if cls_name == "MoeHybridParallelPlugin":
        out.setdefault("ep_size", 2 if out["tp_size"] * out["pp_size"] <= 2 else 1)
    if out["pp_size"] > 1 and "microbatch_size" not in kw:
        out.setdefault("num_microbatches", 2)
    if out["tp_size"] * out["pp_size"] * out.get("ep_size", 1) > WORLD:
        out["pp_size"] = 1          # tp_size=4 and the like: the rest of the mesh is dp
        out.pop("num_microbatches", None)
    if out.get("num_model_chunks", 1) > 1 and out["pp_size"] == 1:
        out["pp_size"] = 2
        out.setdefault("num_microbatches", 2)
    if "microbatch_size" in kw and out["pp_size"] == 1:
        out["pp_size"] = 2
    if out.get("enable_sequence_parallelism") and out.get("sequence_parallelism_mode") in (
            None, "split_gather", "ring") and out["tp_size"] == 1:
        out["tp_size"] = 2
    return out


def _model(cls_name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if cls_name == "MoeHybridParallelPlugin":
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
            num_experts_per_tok=2))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=4))


def case_rows(rank, world, rows):
    from meshlab.booster import Booster
    from meshlab.booster._args import probe_kwargs
    from meshlab.booster.plugin import PLUGINS

    by_name = {c.__name__: c for c in PLUGINS}
    refused = {}
    for cls_name, arg_name in rows:
        cls = by_name[cls_name]
        arg = next(a for a in cls.ARGS if a.name == arg_name)
        kw = _base(cls_name, probe_kwargs(arg))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plugin = cls(**kw)
                booster = Booster(plugin=plugin)
                model = _model(cls_name)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                dl = torch.utils.data.DataLoader(list(range(4)), batch_size=4)
                model, opt, _, _, _ = booster.boost(model, opt, dataloader=dl)
                ids = torch.randint(0, 64, (8, 8))     # 8 rows: any probe's microbatches
                batch = {"input_ids": ids, "labels": ids}
                if plugin.stage_manager is not None:
                    loss = booster.execute_pipeline(iter([batch]), model,
                                                    lambda out, inp: out.loss, opt)["loss"]
                else:
                    loss = model(**batch).loss
                    booster.backward(loss, opt)
                opt.step()
                assert math.isfinite(float(loss))
        except Exception as e:      # collected per row: the test names every refused row
            refused[f"{cls_name}.{arg_name}"] = f"{type(e).__name__}: {str(e)[:300]}"
    return refused


def test_every_implemented_row_boosts_and_trains(world4):
    rows = list(_rows())
    out = world4.run(case_rows, timeout=800, rows=rows)
    refused = out[0]
    assert not refused, "\n".join(f"{k}: {v}" for k, v in refused.items())
