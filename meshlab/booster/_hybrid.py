"""``HybridParallelPlugin`` and ``MoeHybridParallelPlugin``: tensor, pipeline, sequence,
expert and data parallelism with ZeRO, on a mesh ``dp x pp x [sp x] [ep x] tp``.

>>> from meshlab.booster import HybridParallelPlugin
>>> HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision='bf16',
...                      num_microbatches=4).mesh_shape(8)
{'dp': 2, 'pp': 2, 'tp': 2}
"""

from __future__ import annotations

from ..core.errors import ConfigError
from ._args import REQUIRED, Arg, UnsupportedArgument, With, hint, maps, only
from ._base import Plugin
from ._common import (FP8, Stack, clip, communication, ddp_args, fuse_ops, positive_int,
                      precision_of, scaler_args, shardformer_args, use_fp8)


def _hybrid_args(overlap_default: bool) -> tuple[Arg, ...]:
    return (
        maps("tp_size", REQUIRED, "a 'tp' mesh axis of this size and shard(policies.auto) (or "
             "shard(custom_policy))", 4),
        maps("pp_size", REQUIRED, "a 'pp' mesh axis of this size and pipeline('pp', ...)", 4),
        maps("sp_size", None, "the 'sp' mesh axis of sequence_parallelism_mode 'all_to_all' "
             "or 'ring_attn'", With(2, (("enable_sequence_parallelism", True),
                                        ("sequence_parallelism_mode", "all_to_all")))),
        maps("precision", "fp16", "precision('fp16'|'bf16'); 'fp32': no precision transform",
             "bf16"),
        maps("zero_stage", 0, "0: data_parallel('dp'); 1, 2: zero_shard(stage, 'dp')", 1),
    ) + shardformer_args() + (
        maps("enable_sequence_parallelism", False, "sequence(...) in the mode of "
             "sequence_parallelism_mode (default 'split_gather')", True),
        maps("sequence_parallelism_mode", None, "'split_gather' and 'ring': sequence('tp', "
             "'split_gather') (Megatron SP; 'ring' is the same math, gathered in one "
             "collective); 'all_to_all': sequence('sp', 'all_to_all') (Ulysses); 'ring_attn': "
             "sequence('sp', 'ring') (ring attention)",
             With("all_to_all", (("enable_sequence_parallelism", True), ("sp_size", 2)))),
        hint("parallel_output", True, "the vocabulary-parallel head's logits are whole on "
             "every rank and the loss is the single process's", False),
        maps("num_microbatches", None, "pipeline(microbatches=...) (with pp_size > 1; "
             "without a pipeline it has nothing to split and warns, as scripts pass it "
             "unconditionally)", With(8, (("pp_size", 2),))),
        maps("microbatch_size", None, "pipeline(microbatches=per-rank batch // "
             "microbatch_size) with the dataloader given to boost, else "
             "pipeline(microbatch_size=...): each batch cut into microbatches of that many "
             "rows as it comes (with pp_size 1 it warns and does nothing)",
             With(1, (("num_microbatches", None), ("pp_size", 2)))),
    ) + scaler_args(2 ** 16) + (
        maps("max_norm", 0, "meshlab.optimizer(clip_grad_norm=max_norm): clipping by the "
             "global norm over every mesh axis (0: off)", 1.0),
    ) + ddp_args("ddp_") + (
        hint("zero_bucket_size_in_m", 12, "stage 1 reduce-scatters one flat bucket per dtype "
             "and tensor-parallel layout; stage 2 one per FSDP unit", 25),
        maps("cpu_offload", False, "offload(optimizer=1.0) (with zero_stage 1 or 2)",
             With(True, (("zero_stage", 1),))),
        maps("communication_dtype", None, "precision(reduce=...): the dtype gradients are "
             "reduced in (None: fp32); with zero_stage 2 (FSDP2 reduces in it), refused by "
             "plan with zero_stage 0 or 1 (their reductions are fp32)",
             With(lambda: __import__("torch").bfloat16, (("zero_stage", 2),))),
        hint("overlap_communication", overlap_default, "the backward's all-reduces (stage 0) "
             "and reduce-scatters (stage 2) always overlap it; stage 1 reduce-scatters at the "
             "step", not overlap_default),
        maps("custom_policy", None, "shard(custom_policy): a meshlab Policy or a mapping of "
             "parameter globs to specs (with tp_size > 1)",
             With(lambda: __import__("meshlab").policies.DECODER, (("tp_size", 2),))),
        maps("pp_style", "1f1b", "pipeline(schedule=...): '1f1b', 'interleaved' "
             "(pipeline(schedule='interleaved', virtual_stages=num_model_chunks), "
             "num_model_chunks > 1), 'zbv' (with pp_size 1 it warns and does nothing)",
             With("interleaved", (("num_model_chunks", 2),))),
        maps("num_model_chunks", 1, "pipeline(virtual_stages=...) (pp_style 'interleaved' or "
             "'zbv'; with pp_size 1 it warns and does nothing)",
             With(2, (("pp_style", "interleaved"),))),
        only("scheduler_nodes", None, "meshlab's schedules are torch.distributed.pipelining's",
             "pipeline(schedule='zbv')"),
        maps("num_layers_per_stage", None, "pipeline(layers_per_stage=...) (with pp_size 1 "
             "it warns and does nothing)", [1, 1]),
        maps("gradient_checkpoint_config", None, "remat('full') for a config whose "
             "gradient_checkpointing_ratio is 1.0 (or a meshlab remat(...) value); other ratios "
             "are refused",
             With(lambda: __import__("types").SimpleNamespace(gradient_checkpointing_ratio=1.0))),
        hint("enable_metadata_cache", True, "torch's pipeline stages infer their shapes once",
             False),
        hint("make_vocab_size_divisible_by", 64, "meshlab never pads the vocabulary: a "
             "vocabulary tp does not divide is split unevenly or refused by plan with the fix",
             128),
    )


def _hybrid_tail(fp8: Arg | None = None) -> tuple[Arg, ...]:
    """The arguments both hybrid plugins end with (``fp8``: the plugin's ``use_fp8``)."""
    return (
        hint("overlap_p2p", True, "torch.distributed.pipelining's schedules post sends and "
             "receives asynchronously", False),
        hint("overlap_allgather", False, "stage 1 all-gathers the updated slices right after "
             "the step", True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
        fp8 or use_fp8(),
    )


class HybridParallelPlugin(Plugin):
    """Tensor, pipeline, sequence and data parallelism with ZeRO: a mesh
    ``dp x pp x [sp x] tp`` and ``shard | sequence | zero | pipeline | remat | fuse |
    precision``."""

    POSITIONAL = 2
    supports_pipeline = True
    ARGS = _hybrid_args(True) + (
        maps("dp_outside", True, "the mesh's axis order: dp, pp, [sp,] tp (True) or pp, dp, "
             "[sp,] tp (False)", False),
    ) + _hybrid_tail() + (
        only("inner_ring_size", None, "ring attention runs one ring over the 'sp' axis",
             "sequence('sp', 'ring')"),
    )

    def _sizes(self) -> dict:
        v = self.arguments
        out = {"pp": v["pp_size"]} if v["pp_size"] > 1 else {}
        if v.get("sp_size") and v["sp_size"] > 1:
            out["sp"] = v["sp_size"]
        if v.get("ep_size") and v["ep_size"] > 1:
            out["ep"] = v["ep_size"]
        if v["tp_size"] > 1:
            out["tp"] = v["tp_size"]
        return out

    def _order(self, fixed: dict) -> dict:
        if self.arguments["dp_outside"] or "pp" not in fixed:
            return {"dp": None, **fixed}
        return {"pp": fixed["pp"], "dp": None, **{k: s for k, s in fixed.items() if k != "pp"}}

    def _build(self, v: dict) -> Stack:
        from ..transforms import Identity, data_parallel, fuse, offload, shard, zero_shard

        owner = type(self).__name__
        tp = positive_int(owner, "tp_size", v["tp_size"])
        pp = positive_int(owner, "pp_size", v["pp_size"])
        sp = 1 if v["sp_size"] is None else positive_int(owner, "sp_size", v["sp_size"])
        ep = v.get("ep_size", 1)
        spec = Identity()
        if tp > 1:
            spec = shard(_policy(owner, v["custom_policy"]))
        elif v["custom_policy"] is not None:
            raise ConfigError(f"{owner}(custom_policy=...): a policy says how tensor "
                              f"parallelism splits the model; set tp_size > 1")
        spec = spec | _sequence(owner, v, tp, sp)
        if ep > 1:
            from ..transforms import expert_route

            spec = spec | expert_route("ep")
        stage = v["zero_stage"]
        if stage not in (0, 1, 2) or isinstance(stage, bool):
            raise ConfigError(f"{owner}(zero_stage={stage!r}): 0, 1 or 2")
        spec = spec | (data_parallel("dp", bucket_mb=float(v["ddp_bucket_cap_mb"]))
                       if stage == 0 else zero_shard(stage, "dp"))
        mbs = None
        if pp > 1:
            spec, mbs = _pipeline(owner, v, spec, pp)
        else:
            _no_pipeline(owner, v)
        remat = _remat(owner, v["gradient_checkpoint_config"])
        if remat is not None:
            spec = spec | remat
        ops = fuse_ops(v)
        if ops:                 # as Colossal-AI's policies: where the model has them
            spec = spec | fuse(*ops, absent="leave")
        if v["cpu_offload"]:
            if stage == 0:
                raise ConfigError(f"{owner}(cpu_offload=True): offloading the optimizer "
                                  f"state needs zero_stage 1 or 2")
            spec = spec | offload(optimizer=1.0)
        prec = precision_of(self, v, ("fp16", "bf16", "fp32"), communication(owner, v))
        if prec is not None:
            spec = spec | prec
        data = ("dp", "ep") if ep > 1 else ("dp",)
        # Replicas that differ take rank 0's parameters and buffers (with a warning), as
        # torch's DDP does when it is built, under every configuration: the whole model is
        # compared and broadcast before it is split into stages or sliced (where
        # Colossal-AI runs ZeRO or a pipeline, it keeps each rank's own values instead)
        return Stack({}, spec, data, clip_grad_norm=clip(v),
                     broadcast_buffers=v["broadcast_buffers"] and stage == 0,
                     sync_module_states=True, microbatch_size=mbs)


def _P():
    from ..core.spec import P

    return P


def _policy(owner: str, custom):
    from .. import policies
    from ..policies._policy import Policy

    if custom is None:
        return policies.auto
    if isinstance(custom, Policy) or isinstance(custom, dict):
        return custom
    raise UnsupportedArgument(owner, "custom_policy", type(custom).__name__, "Colossal-AI's "
                              "Shardformer policies replace model code", "a meshlab Policy "
                              "(meshlab.policies) or a dict of parameter globs to P specs")


def _sequence(owner: str, v: dict, tp: int, sp: int):
    from ..transforms import Identity, sequence

    mode = v["sequence_parallelism_mode"]
    on = v["enable_sequence_parallelism"]
    if not on:
        if sp > 1:
            raise ConfigError(f"{owner}(sp_size={sp}): set enable_sequence_parallelism=True "
                              f"to split the sequence over it")
        if mode is not None:
            import warnings

            from ._args import NoEffectWarning

            warnings.warn(f"{owner}(sequence_parallelism_mode={mode!r}) has no effect without "
                          f"enable_sequence_parallelism=True", NoEffectWarning, stacklevel=5)
        return Identity()
    mode = mode or "split_gather"
    if mode in ("split_gather", "ring"):
        if tp == 1 or sp > 1:
            raise ConfigError(f"{owner}(sequence_parallelism_mode={mode!r}): splits the "
                              f"sequence inside tensor parallelism; set tp_size > 1 and leave "
                              f"sp_size unset")
        return sequence("tp", "split_gather")
    if mode in ("all_to_all", "ring_attn"):
        if sp == 1:
            raise ConfigError(f"{owner}(sequence_parallelism_mode={mode!r}): give sp_size > 1 "
                              f"(the ranks the sequence is split over)")
        return sequence("sp", "all_to_all" if mode == "all_to_all" else "ring")
    raise ConfigError(f"{owner}(sequence_parallelism_mode={mode!r}): one of 'split_gather', "
                      f"'ring', 'all_to_all', 'ring_attn'")


def _no_pipeline(owner: str, v: dict) -> None:
    """The pipeline's options given with pp_size=1 (Colossal-AI scripts pass them whatever
    pp_size is): without a pipeline they do nothing, which is said, not silently ignored."""
    import warnings

    from ._args import NoEffectWarning

    given = {k: v[k] for k, default in (("num_microbatches", None), ("microbatch_size", None),
                                        ("pp_style", "1f1b"), ("num_model_chunks", 1),
                                        ("num_layers_per_stage", None)) if v[k] != default}
    if given:
        what = ", ".join(f"{k}={x!r}" for k, x in given.items())
        warnings.warn(f"{owner}({what}) has no effect with pp_size=1: these are the "
                      f"pipeline's (microbatches: accumulate with booster.no_sync)",
                      NoEffectWarning, stacklevel=5)


def _pipeline(owner: str, v: dict, spec, pp: int):
    from ..transforms import pipeline

    n, size = v["num_microbatches"], v["microbatch_size"]
    if (n is None) == (size is None):
        raise ConfigError(f"{owner}(pp_size={pp}): give one of num_microbatches or "
                          f"microbatch_size")
    style = v["pp_style"]
    schedule = {"1f1b": "1f1b", "interleaved": "interleaved", "zbv": "zbv"}.get(style)
    if schedule is None:
        raise ConfigError(f"{owner}(pp_style={style!r}): '1f1b', 'interleaved' or 'zbv'")
    chunks = v["num_model_chunks"]
    if schedule == "interleaved" and chunks < 2:
        raise ConfigError(f"{owner}(pp_style='interleaved', num_model_chunks={chunks}): an "
                          f"interleaved schedule runs several chunks per stage; give "
                          f"num_model_chunks > 1, or pp_style='1f1b'")
    if schedule == "1f1b" and chunks != 1:
        raise ConfigError(f"{owner}(num_model_chunks={chunks}): several chunks per stage "
                          f"need pp_style='interleaved' or 'zbv'")
    layers = v["num_layers_per_stage"]
    kw = dict(schedule=schedule, microbatches=n if n is not None else 1,
              virtual_stages=chunks if schedule != "1f1b" else None,
              layers_per_stage=tuple(layers) if layers is not None else None)
    return spec | pipeline("pp", **kw), size


def _remat(owner: str, cfg):
    from ..transforms import Remat, remat

    if cfg is None or isinstance(cfg, Remat):
        return cfg
    ratio = getattr(cfg, "gradient_checkpointing_ratio", None)
    if ratio is not None and float(ratio) == 1.0:
        return remat("full")
    raise UnsupportedArgument(owner, "gradient_checkpoint_config", cfg, "only a ratio of 1.0 "
                              "(every block) is implemented", "remat('full') or "
                              "remat('selective')")


def _moe_args() -> tuple[Arg, ...]:
    """The hybrid arguments with those a mixture-of-experts model has no use for refused,
    each saying why: its experts are expert_route's, not the fused MLP's. Sequence
    parallelism and cpu_offload compose as the composition table says
    (``docs/composition.md``): Ulysses and ring attention beside the experts, Megatron's
    split_gather refused by the table with its reason."""
    fused = ("fuse('mlp') routes dense gated MLPs, and a MoE model's experts are "
             "expert_route's")
    refused = {
        "enable_all_optimization": only("enable_all_optimization", False, fused,
                                        "enable_fused_normalization=True, "
                                        "enable_flash_attention=True"),
        "enable_jit_fused": only("enable_jit_fused", False, fused,
                                 "enable_fused_normalization=True"),
    }
    return tuple(refused.get(a.name, a) for a in _hybrid_args(False))


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """``HybridParallelPlugin`` with expert parallelism: an ``ep`` mesh axis of
    ``ep_size`` and ``expert_route('ep')``; the dense parameters' data axes are
    ``dp x ep`` (Colossal-AI's dp size includes ep)."""

    POSITIONAL = 3
    ARGS = _moe_args()[:2] + (
        maps("ep_size", REQUIRED, "an 'ep' mesh axis of this size and expert_route('ep')", 4),
    ) + _moe_args()[2:] + (
        only("moe_dp_outside", True, "the dense parameters' data axes dp x ep are flattened "
             "as one, which a mesh ordered ep, dp cannot do (DeviceMesh flattens axes in mesh "
             "order)", "the default order dp, ep, pp, tp"),
    ) + _hybrid_tail()

    def _order(self, fixed: dict) -> dict:
        if "ep" not in fixed:
            return {"dp": None, **fixed}
        rest = {k: s for k, s in fixed.items() if k != "ep"}
        return {"dp": None, "ep": fixed["ep"], **rest}     # moe_dp_outside=True, the only one

    def _build(self, v: dict) -> Stack:
        positive_int(type(self).__name__, "ep_size", v["ep_size"])
        return super()._build(v)
