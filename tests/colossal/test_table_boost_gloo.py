"""Every argument ``docs/booster.md`` marks implemented is accepted by ``boost``: on 4 gloo
processes, each plugin built with the row's value (the table's probe) boosts a small model
and trains one step with it. A row whose value ``boost`` refused would be a promise the
table does not keep.

Beside it, on the same 4 ranks, the configuration of Colossal-AI's ``test_3d_plugin`` that
runs ZeRO-2 beside tensor parallelism in fp16 (``HybridParallelPlugin(tp_size=2,
pp_size=1, zero_stage=2, precision='fp16', initial_scale=1,
enable_fused_normalization=True)``, dp=2) boosts a tiny GPT-2 LM (head tied to the
embeddings) and trains two steps (SGD) against one process on the whole batches under
fp16 autocast, at fp16's tolerance (``tests/transforms/test_table_parity.py``'s
``_FP16``). FSDP2 leaves GPT-2's packed q|k|v bias whole there (tensor parallelism
already strides it); it was refused in fp16 before, and is now cast for the forward as
FSDP2 casts the rest."""

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


def case_gpt2_tp2_zero2_fp16(rank, world):
    """``test_3d_plugin``'s tp=2, ZeRO-2, fp16 configuration: two steps against one process
    under fp16 autocast, losses and every weight to fp16's tolerance."""
    import torch.distributed as dist
    import transformers as T

    from meshlab.booster import Booster
    from meshlab.booster.plugin import HybridParallelPlugin
    from tests.transforms.test_table_parity import _FP16

    def gpt2():
        torch.manual_seed(0)
        return T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=64, attn_pdrop=0.0,
            embd_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=True,
            attn_implementation="eager"))

    atol, rtol = _FP16
    origin, model = gpt2(), gpt2()
    origin_opt = torch.optim.SGD(origin.parameters(), lr=0.1)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=2, precision="fp16",
                                  initial_scale=1, enable_fused_normalization=True)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert plugin.dp_size == 2 and dist.get_world_size(plugin.tp_group) == 2
    dp_rank = dist.get_rank(plugin.dp_group)
    torch.manual_seed(1)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 128, (4, 16))
        with torch.autocast("cpu", dtype=torch.float16):
            want = origin(input_ids=ids, labels=ids)[0]
        want.backward()
        origin_opt.step()
        origin_opt.zero_grad()
        mine = ids.chunk(2)[dp_rank]
        loss = model(input_ids=mine, labels=mine)[0]
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        got = torch.tensor(float(loss))
        dist.all_reduce(got, group=plugin.dp_group)
        assert abs(got.item() / 2 - want.item()) <= atol + rtol * abs(want.item()), \
            (got.item() / 2, want.item())
        losses.append(got.item() / 2)
    ref = dict(origin.named_parameters())
    for n, p in model.unwrap().named_parameters():
        w = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert w.dtype == torch.float32, n
        torch.testing.assert_close(w.detach(), ref[n].detach(), rtol=0,
                                   atol=atol + rtol * ref[n].abs().max().item(),
                                   msg=lambda m, n=n: f"{n}: {m}")
    return losses


def test_gpt2_under_tp_and_zero2_in_fp16_trains_as_one_process(world4):
    out = world4.run(case_gpt2_tp2_zero2_fp16)
    assert all(o == out[0] for o in out)
