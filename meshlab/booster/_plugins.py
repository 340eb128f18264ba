"""The data-parallel plugins: ``TorchDDPPlugin``, ``TorchFSDPPlugin``,
``LowLevelZeroPlugin`` and ``GeminiPlugin``, each a stack of meshlab transforms over a
``dp`` mesh axis (Gemini's optional ``tp`` too).

>>> from meshlab.booster import LowLevelZeroPlugin
>>> LowLevelZeroPlugin(stage=2, precision="bf16", cpu_offload=True).mesh_shape(8)
{'dp': 8}
"""

from __future__ import annotations

from ..core.errors import ConfigError, ConfigTypeError, MeshError
from ._args import UnsupportedArgument, With, hint, maps, only
from ._base import Plugin
from ._common import (FP8, Stack, clip, clip_args, communication, ddp_args, fuse_ops,
                      positive_int, precision_of, scaler_args, shardformer_args, use_fp8)


class TorchDDPPlugin(Plugin):
    """Plain data parallelism over every rank: ``data_parallel('dp')``."""

    controls_precision = False
    ARGS = ddp_args("")[:6] + (
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _build(self, v: dict) -> Stack:
        from ..transforms import data_parallel

        # torch's DDP takes rank 0's parameters and buffers when it is built
        return Stack({}, data_parallel("dp", bucket_mb=float(v["bucket_cap_mb"])), ("dp",),
                     broadcast_buffers=v["broadcast_buffers"], sync_module_states=True)


def _fsdp(name: str):
    """torch's FSDP configuration type ``name`` (what TorchFSDPPlugin users pass)."""
    import torch.distributed.fsdp as fsdp

    return getattr(fsdp, name)


def _enum_name(value) -> str | None:
    return None if value is None else getattr(value, "name", str(value))


class TorchFSDPPlugin(Plugin):
    """FSDP (FSDP2 ``fully_shard`` per block): ``zero_shard(3)`` for FULL_SHARD,
    ``zero_shard(2)`` for SHARD_GRAD_OP, ``data_parallel`` for NO_SHARD."""

    controls_precision = False
    ARGS = (
        only("process_group", None, "meshlab builds its groups from the mesh over every "
             "launched rank", "meshlab.parallelize(model, spec, ml.Mesh(...))"),
        maps("sharding_strategy", None, "None or FULL_SHARD: zero_shard(3); SHARD_GRAD_OP: "
             "zero_shard(2); NO_SHARD: data_parallel(); HYBRID_SHARD (_HYBRID_SHARD_ZERO2): "
             "data_parallel('rep') | zero_shard(3 (2), 'dp'), sharded over the ranks of a "
             "node (LOCAL_WORLD_SIZE) and replicated across nodes",
             With(lambda: _fsdp("ShardingStrategy").SHARD_GRAD_OP)),
        maps("cpu_offload", None, "CPUOffload(offload_params=True): offload(params=1.0, "
             "grads=1.0, optimizer=1.0) (FSDP2's CPUOffloadPolicy, CPU Adam on the host)",
             With(lambda: _fsdp("CPUOffload")(offload_params=True))),
        only("auto_wrap_policy", None, "meshlab's FSDP units are the model's repeated blocks "
             "(plan.model.blocks) and the root", "a policy listing the blocks "
             "(meshlab.policies)"),
        hint("backward_prefetch", None, "FSDP2 prefetches the next block's all-gather before "
             "its backward (BACKWARD_PRE's order)",
             With(lambda: _fsdp("BackwardPrefetch").BACKWARD_POST)),
        maps("mixed_precision", None, "MixedPrecision(param_dtype, reduce_dtype): "
             "precision(param_dtype, reduce_dtype or param_dtype)",
             With(lambda: _fsdp("MixedPrecision")(param_dtype=__import__("torch").bfloat16))),
        only("ignored_modules", None, "every parameter is sharded", "freeze a module "
             "(requires_grad=False) to leave it out of gradients and optimizer state"),
        only("param_init_fn", None, "a model on the meta device is initialized by "
             "parallelize, module by module", "build the model under torch.device('meta'); "
             "meshlab.parallelize(..., seed=) initializes it"),
        maps("sync_module_states", False, "True: where replicas differ, rank 0's "
             "parameters and buffers are broadcast to every rank before the model is "
             "sharded, with a warning (as every other plugin does); False: replicas that "
             "differ raise RankMismatchError", True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _build(self, v: dict) -> Stack:
        from ..transforms import data_parallel, offload, zero_shard

        owner = type(self).__name__
        strategy = _enum_name(v["sharding_strategy"]) or "FULL_SHARD"
        specs = {"FULL_SHARD": zero_shard(3, "dp"), "SHARD_GRAD_OP": zero_shard(2, "dp"),
                 "NO_SHARD": data_parallel("dp"),
                 "HYBRID_SHARD": data_parallel("rep") | zero_shard(3, "dp"),
                 "_HYBRID_SHARD_ZERO2": data_parallel("rep") | zero_shard(2, "dp")}
        if strategy not in specs:
            raise ConfigError(f"{owner}(sharding_strategy={v['sharding_strategy']!r}): use "
                              f"ShardingStrategy.FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
        spec = specs[strategy]
        off = v["cpu_offload"]
        if off is not None:
            if hasattr(off, "offload_params"):
                params = bool(off.offload_params)
            else:
                raise ConfigTypeError(f"{owner}(cpu_offload={off!r}): pass torch's "
                                      f"CPUOffload(offload_params=True) or None")
            if params:
                spec = spec | offload(params=1.0, grads=1.0, optimizer=1.0)
        prec = None
        mp = v["mixed_precision"]
        if mp is not None:
            prec = _fsdp_precision(owner, mp)
        hybrid = strategy.lstrip("_").startswith("HYBRID_SHARD")
        return Stack({}, spec, ("rep", "dp") if hybrid else ("dp",),
                     sync_module_states=v["sync_module_states"], precision=prec)

    def mesh_shape(self, world: int) -> dict:
        """Hybrid sharding: ``rep`` across nodes, ``dp`` over the ranks of a node
        (``LOCAL_WORLD_SIZE``, as torch's FSDP shards within a node); else ``dp``."""
        if "rep" not in self.stack.data_axes:
            return super().mesh_shape(world)
        import os

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise MeshError(f"{type(self).__name__}(sharding_strategy=HYBRID_SHARD): {world} "
                            f"ranks do not divide into nodes of LOCAL_WORLD_SIZE={local}; "
                            f"launch the same number of processes on every node")
        return {"rep": world // local, "dp": local}


def _fsdp_precision(owner: str, mp):
    """torch FSDP's ``MixedPrecision`` (or the probe string) as ``precision(...)``."""
    import torch

    from ..transforms import precision

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", None: None}
    param = getattr(mp, "param_dtype", "missing")
    if param == "missing":
        raise ConfigTypeError(f"{owner}(mixed_precision={mp!r}): pass torch's "
                              f"torch.distributed.fsdp.MixedPrecision(param_dtype=...)")
    reduce = getattr(mp, "reduce_dtype", None)
    buffer = getattr(mp, "buffer_dtype", None)
    if param not in names or reduce not in names or param is None:
        raise ConfigError(f"{owner}(mixed_precision={mp!r}): param_dtype and reduce_dtype "
                          f"are torch.float32, torch.bfloat16 or torch.float16")
    if buffer not in (None, param):
        raise UnsupportedArgument(owner, "mixed_precision.buffer_dtype", buffer, "buffers "
                                  "keep their dtype", "leave buffer_dtype None")
    return precision(names[param], names[reduce or param])


class LowLevelZeroPlugin(Plugin):
    """ZeRO-1/2: ``zero_shard(stage)`` with the plugin's precision (and
    ``offload(optimizer=1.0)`` for ``cpu_offload``)."""

    ARGS = (
        maps("stage", 1, "zero_shard(stage): 1 shards optimizer state (meshlab's sharded "
             "optimizer), 2 also gradients (FSDP2 with resharding after forward off)", 2),
        maps("precision", "fp16", "precision('fp16'|'bf16') (fp32 parameters are the "
             "masters; forward and backward in autocast); 'fp32': no precision transform",
             "bf16"),
    ) + scaler_args(2 ** 32) + clip_args() + (
        hint("reduce_bucket_size_in_m", 12, "stage 1 reduce-scatters one flat bucket per "
             "dtype and tensor-parallel layout; stage 2 one per FSDP unit", 25),
        maps("communication_dtype", None, "precision(reduce=...): the dtype gradients are "
             "reduced in (None: fp32); with stage 2 (FSDP2 reduces in it), refused by plan "
             "with stage 1 (ZeRO-1 reduce-scatters in fp32)",
             With(lambda: __import__("torch").bfloat16, (("stage", 2),))),
        hint("overlap_communication", True, "stage 2's reduce-scatters overlap the backward "
             "(FSDP2); stage 1 reduce-scatters at the step", False),
        hint("overlap_allgather", False, "stage 1 all-gathers the updated slices right after "
             "the step", True),
        maps("cpu_offload", False, "offload(optimizer=1.0): fp32 masters and moments on the "
             "host, CPU AdamW over them", True),
        only("master_weights", True, "meshlab keeps fp32 parameters as the masters",
             "precision('bf16') (autocast over fp32 parameters)"),
        maps("verbose", False, "True: boost prints the plan's table and memory on rank 0",
             True),
        only("cast_inputs", True, "autocast casts every op's inputs", "precision(...)"),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
        use_fp8(),
        only("extra_dp_size", 1, "one data-parallel axis", "HybridParallelPlugin or a "
             "meshlab mesh with the axes you need"),
    )

    def _build(self, v: dict) -> Stack:
        from ..transforms import offload, zero_shard

        owner = type(self).__name__
        stage = v["stage"]
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ConfigError(f"{owner}(stage={stage!r}): 1 or 2 (ZeRO-3 is GeminiPlugin or "
                              f"TorchFSDPPlugin)")
        comm = communication(owner, v)
        prec = precision_of(self, v, ("fp16", "bf16", "fp32"), comm)
        spec = zero_shard(stage, "dp")
        if v["cpu_offload"]:
            spec = spec | offload(optimizer=1.0)
        if prec is not None:
            spec = spec | prec
        # replicas that differ take rank 0's values, as torch's DDP does when it is built
        return Stack({}, spec, ("dp",), clip_grad_norm=clip(v), verbose=v["verbose"],
                     sync_module_states=True)


class GeminiPlugin(Plugin):
    """ZeRO-3 with heterogeneous memory: ``zero_shard(3)`` and ``offload(...)`` of the
    static fractions, or ``offload(policy='auto')``; with ``tp_size`` tensor parallelism."""

    ARGS = (
        hint("chunk_config_dict", None, "FSDP2's units are the model's blocks (no chunks)",
             {}),
        hint("chunk_init_device", None, "parallelize places each shard on this rank's device "
             "as the block is sharded", "cpu"),
        maps("placement_policy", "static", "'static': offload(params=offload_param_frac, "
             "grads=offload_param_frac, optimizer=max(offload_optim_frac, offload_param_frac));"
             " 'auto': offload(policy='auto') (the smallest fractions whose device rows fit the "
             "card; it reads the GPU's free memory, so on a machine without a GPU plan refuses "
             "it)", "auto"),
        hint("enable_gradient_accumulation", False, "gradients always accumulate over "
             "backwards until the optimizer steps (no_sync skips their reduction)", True),
        hint("max_prefetch", 0, "FSDP2 prefetches the next block's all-gather", 2),
        maps("shard_param_frac", 1.0, "1.0: zero_shard(3) (every parameter sharded); 0.0: "
             "zero_shard(2) (parameters gathered for the forward and kept through the "
             "backward; gradients and optimizer state sharded); a fraction f between: "
             "zero_shard(3, reshard=f) (the first f of the blocks freed after their forward, "
             "the others kept gathered to their backward: FSDP2 shards each block whole, so "
             "the share is counted in blocks)", 0.5),
        maps("offload_optim_frac", 0.0, "offload(optimizer=f) (placement_policy='static')",
             0.5),
        maps("offload_param_frac", 0.0, "offload(params=f, grads=f) (placement_policy="
             "'static'; the optimizer state of those parameters goes with them)", 0.5),
        only("warmup_non_model_data_ratio", 0.8, "offload(policy='auto') plans from the "
             "model's rows, not a warm-up trace", "offload(policy='auto', budget=...)"),
        only("steady_cuda_cap_ratio", 0.9, "offload(policy='auto') takes a byte budget",
             "offload(policy='auto', budget=...)"),
        maps("precision", "fp16", "precision('fp16'|'bf16') (FSDP2 mixed precision); 'fp32' "
             "(which Colossal-AI's chunks refuse): no precision transform", "bf16"),
        only("master_weights", True, "meshlab keeps fp32 parameters as the masters",
             "precision('bf16')"),
        maps("pin_memory", False, "offload(pin_memory=...)",
             With(True, (("offload_optim_frac", 0.5),))),
        only("force_outputs_fp32", False, "outputs keep the compute dtype",
             "outputs.logits.float()"),
        only("strict_ddp_mode", False, "GeminiPlugin shards", "TorchDDPPlugin()"),
        hint("search_range_m", 32, "no chunk search: FSDP2's units are the model's blocks",
             64),
        hint("hidden_dim", None, "no chunk search: FSDP2's units are the model's blocks",
             1024),
        hint("min_chunk_size_m", 32, "no chunk search: FSDP2's units are the model's blocks",
             64),
        only("memstats", None, "offload(policy='auto') plans from the model's rows",
             "offload(policy='auto', budget=...)"),
        only("gpu_margin_mem_ratio", 0.0, "offload(policy='auto') takes a byte budget",
             "offload(policy='auto', budget=...)"),
    ) + scaler_args(2 ** 16) + clip_args() + (
        maps("tp_size", 1, "a 'tp' mesh axis of this size and shard(policies.auto)", 2),
        maps("extra_dp_size", 1, "hybrid sharding: data_parallel('rep') | zero_shard(3, 'dp') "
             "(FSDP2 on the 2-D mesh (rep, dp)), replicated over a 'rep' axis of this size and "
             "sharded over the ranks the world leaves, as Colossal-AI shards over "
             "world / (tp_size * extra_dp_size)", 2),
    ) + shardformer_args()[:3] + (
        maps("enable_sequence_parallelism", False, "sequence('tp', 'split_gather') (Megatron "
             "sequence parallelism inside tensor parallelism; needs tp_size > 1)",
             With(True, (("tp_size", 2),))),
    ) + shardformer_args()[3:] + (
        hint("enable_async_reduce", True, "FSDP2's reduce-scatters run asynchronously on "
             "their own stream", False),
        use_fp8(),
        maps("verbose", False, "True: boost prints the plan's table and memory on rank 0",
             True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _sizes(self) -> dict:
        tp, rep = self.arguments["tp_size"], self.arguments["extra_dp_size"]
        return {**({"rep": rep} if rep > 1 else {}), **({"tp": tp} if tp > 1 else {})}

    def _order(self, fixed: dict) -> dict:
        """Hybrid sharding's replicas first in the mesh (``rep``, ``dp``, ``tp``)."""
        if "rep" not in fixed:
            return super()._order(fixed)
        return {"rep": fixed["rep"], "dp": None, **{k: v for k, v in fixed.items()
                                                    if k != "rep"}}

    def _build(self, v: dict) -> Stack:
        from .. import policies
        from ..transforms import Identity, data_parallel, fuse, offload, sequence, shard, \
            zero_shard

        owner = type(self).__name__
        tp = positive_int(owner, "tp_size", v["tp_size"])
        spec = shard(policies.auto) if tp > 1 else Identity()
        if v["enable_sequence_parallelism"]:
            if tp == 1:
                raise ConfigError(f"{owner}(enable_sequence_parallelism=True): sequence "
                                  f"parallelism splits inside tensor parallelism; set "
                                  f"tp_size > 1")
            spec = spec | sequence("tp", "split_gather")
        frac = float(v["shard_param_frac"])
        if not 0.0 <= frac <= 1.0:
            raise ConfigError(f"{owner}(shard_param_frac={frac!r}): the share of the "
                              f"parameters sharded, from 0.0 to 1.0, e.g. 0.5")
        replicas = positive_int(owner, "extra_dp_size", v["extra_dp_size"])
        if replicas > 1:                 # hybrid sharding: replicated over rep
            spec = spec | data_parallel("rep")
        spec = spec | (zero_shard(2, "dp") if frac == 0.0 else
                       zero_shard(3, "dp", reshard=frac))
        policy = v["placement_policy"]
        po, oo = float(v["offload_param_frac"]), float(v["offload_optim_frac"])
        for k, f in (("offload_param_frac", po), ("offload_optim_frac", oo)):
            if not 0.0 <= f <= 1.0:     # max(-1, 0) below would turn -1 into 0
                raise ConfigError(f"{owner}({k}={f!r}): a fraction from 0 to 1 of the "
                                  f"trainable bytes; pass e.g. {k}=0.5")
        if policy == "auto":
            for k, f in (("offload_param_frac", po), ("offload_optim_frac", oo)):
                if f:
                    raise UnsupportedArgument(owner, k, f, "the fractions apply with "
                                              "placement_policy='static'; 'auto' chooses them",
                                              "GeminiPlugin(placement_policy='static', "
                                              f"{k}=...)")
            spec = spec | offload(policy="auto", pin_memory=v["pin_memory"])
        elif policy == "static":
            if po or oo:
                spec = spec | offload(params=po, grads=po, optimizer=max(po, oo),
                                      pin_memory=v["pin_memory"])
        else:
            raise ConfigError(f"{owner}(placement_policy={policy!r}): 'static' or 'auto'")
        ops = fuse_ops(v)
        if ops:                 # as Colossal-AI's policies: where the model has them
            spec = spec | fuse(*ops, absent="leave")
        prec = precision_of(self, v, ("fp16", "bf16", "fp32"))
        if prec is not None:
            spec = spec | prec
        # replicas that differ take rank 0's values, as torch's DDP does when it is built
        return Stack({}, spec, ("rep", "dp") if replicas > 1 else ("dp",),
                     clip_grad_norm=clip(v), verbose=v["verbose"], sync_module_states=True)
