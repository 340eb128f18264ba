"""Colossal-AI's six plugins, each a mesh shape plus a stack of meshlab transforms.

A plugin reads its constructor arguments through its ``ARGS`` table (``_args``): every
argument Colossal-AI's plugin takes is listed with its default and what it becomes. A
plugin builds nothing but a ``Stack`` — the mesh axes, the transforms, and the few
settings that live outside the transforms (gradient clipping in the optimizer, buffer
broadcasts, the data axes) — which ``Booster.boost`` hands to ``meshlab.parallelize``.

>>> from meshlab.booster import HybridParallelPlugin
>>> HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision='bf16',
...                      num_microbatches=4).mesh_shape(8)
{'dp': 2, 'pp': 2, 'tp': 2}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from .._errors import ConfigError, ConfigTypeError, MeshError
from ._args import (REQUIRED, Arg, UnsupportedArgument, With, bind, hint, maps, only,
                    signature)

FP8 = "FP8 compute and communication are not implemented"


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a plugin (with the Booster's precision) runs: the mesh axes, major first, the
    transforms, and the settings the transforms do not hold."""

    mesh: dict
    spec: Any
    data_axes: tuple[str, ...]
    clip_grad_norm: float | None = None
    broadcast_buffers: bool = False
    sync_module_states: bool = False
    verbose: bool = False
    microbatch_size: int | None = None
    precision: Any = None


# -- argument groups several plugins share ------------------------------------------------
def _scaler_args(initial: float) -> tuple[Arg, ...]:
    sc = "precision('fp16', {}=...) (the dynamic loss scale; fp16 only)"
    return (
        maps("initial_scale", initial, sc.format("init_scale"), 2.0 ** 10),
        maps("min_scale", 1, sc.format("min_scale"), 2.0),
        maps("growth_factor", 2, sc.format("growth_factor"), 4.0),
        maps("backoff_factor", 0.5, sc.format("backoff_factor"), 0.25),
        maps("growth_interval", 1000, sc.format("growth_interval"), 50),
        maps("hysteresis", 2, sc.format("hysteresis"), 3),
        maps("max_scale", 2 ** 32, sc.format("max_scale"), 2.0 ** 20),
    )


def _clip_args() -> tuple[Arg, ...]:
    return (
        maps("max_norm", 0.0, "meshlab.optimizer(clip_grad_norm=max_norm): clipping by the "
             "global norm over every mesh axis (0: off)", 1.0),
        only("norm_type", 2.0, "only the 2-norm is implemented",
             "meshlab.optimizer(clip_grad_norm=...) (global 2-norm)"),
    )


def _ddp_args(prefix: str) -> tuple[Arg, ...]:
    return (
        maps("broadcast_buffers", True, "True: every buffer is broadcast from data-parallel "
             "rank 0 before each forward (as DDP does); False: not", False),
        maps(f"{prefix}bucket_cap_mb", 25, "data_parallel(bucket_mb=...): the size of the "
             "gradient all-reduce buckets", 50),
        hint("find_unused_parameters", False, "meshlab's reducer always handles parameters "
             "a forward did not use (one 'has a gradient' flag per parameter, reduced with the "
             "bucket)", True),
        hint("check_reduction", False, "deprecated and ignored by torch's DDP itself; "
             "plan.comm() lists every reduction a step sends", True),
        only("gradient_as_bucket_view", False, "meshlab's buckets copy the reduced values "
             "into .grad", "zero_shard(2) (LowLevelZeroPlugin(stage=2)) to save gradient "
             "memory"),
        hint("static_graph", False, "meshlab's reducer needs no static-graph hint (its "
             "buckets are fixed from the plan)", True),
    )


def _shardformer_args() -> tuple[Arg, ...]:
    return (
        maps("enable_all_optimization", False, "fuse('rms_norm', 'rotary', 'attention', "
             "'mlp'): meshlab's fused kernels on the model's norms, rotary embedding, attention "
             "and gated MLP", True),
        maps("enable_fused_normalization", False, "fuse('rms_norm')", True),
        maps("enable_flash_attention", False, "fuse('attention') (flash attention where "
             "installed, else SDPA's)", True),
        maps("enable_jit_fused", False, "fuse('rotary', 'mlp') (meshlab's fused elementwise "
             "ops: the rotary embedding and the SwiGLU gate)", True),
    )


def _fuse_ops(v: dict) -> tuple[str, ...]:
    ops: list[str] = []
    if v.get("enable_all_optimization"):
        ops += ["rms_norm", "rotary", "attention", "mlp"]
    if v.get("enable_fused_normalization"):
        ops.append("rms_norm")
    if v.get("enable_jit_fused"):
        ops += ["rotary", "mlp"]
    if v.get("enable_flash_attention"):
        ops.append("attention")
    return tuple(dict.fromkeys(ops))


_PRECISIONS = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


def _precision(plugin: "Plugin", v: dict, allowed: tuple[str, ...], communication=None):
    """The precision transform of a plugin's ``precision=`` and loss-scale arguments; the
    loss-scale arguments under bf16 or fp32 (Colossal-AI scripts often pass
    ``initial_scale=1`` there) have nothing to scale, and warn when not the defaults."""
    import warnings

    from ..parallel import precision
    from ._args import NoEffectWarning, is_default

    owner = type(plugin).__name__
    name = v["precision"]
    if name not in allowed:
        if name in ("fp8",):
            raise UnsupportedArgument(owner, "precision", name, FP8, "precision('bf16')")
        raise ConfigError(f"{owner}(precision={name!r}): use one of {', '.join(allowed)}")
    reduce = "fp32" if communication is None else communication
    if name != "fp16":
        for a in plugin.ARGS:
            if a.name in _SCALER and not is_default(a, v[a.name]):
                warnings.warn(f"{owner}({a.name}={v[a.name]!r}) has no effect: the loss "
                              f"scale exists under precision='fp16' only, this is {name!r}",
                              NoEffectWarning, stacklevel=5)
        return None if name == "fp32" and reduce == "fp32" else precision(
            "fp32" if name == "fp32" else name, reduce)
    return precision("fp16", reduce, "dynamic", init_scale=float(v["initial_scale"]),
                     growth_interval=v["growth_interval"],
                     growth_factor=float(v["growth_factor"]),
                     backoff_factor=float(v["backoff_factor"]), hysteresis=v["hysteresis"],
                     min_scale=float(v["min_scale"]), max_scale=float(v["max_scale"]))


_SCALER = ("initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval",
           "hysteresis", "max_scale")


def _communication(owner: str, v: dict):
    """``communication_dtype`` as a precision name (None: fp32 reductions)."""
    import torch

    d = v.get("communication_dtype")
    if d is None:
        return None
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if d not in names:
        raise ConfigError(f"{owner}(communication_dtype={d!r}): use torch.float32, "
                          f"torch.bfloat16 or torch.float16")
    return names[d]


def _clip(v: dict) -> float | None:
    m = v["max_norm"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0:
        raise ConfigError(f"max_norm={m!r}: a number >= 0 (0 turns clipping off)")
    return float(m) if m > 0 else None


def _positive_int(owner: str, name: str, value, low: int = 1) -> int:
    from .._errors import check_int

    return check_int(value, owner, name, low=low)


def _clean(spec):
    """``spec`` without its ``identity()`` parts (the neutral start of a stack)."""
    from ..parallel import Identity

    parts = [t for t in getattr(spec, "parts", (spec,)) if not isinstance(t, Identity)]
    if not parts:
        return Identity()
    out = parts[0]
    for t in parts[1:]:
        out = out | t
    return out


class Plugin:
    """A Colossal-AI plugin: a mesh shape plus a stack of meshlab transforms.

    ``plugin.spec`` is the transform stack; ``plugin.mesh_shape(world)`` the axes;
    ``plugin.mesh`` the mesh over the launched ranks; ``plugin.plan(model)`` what
    ``Booster.boost`` will run (a fake mesh of ``world_size`` ranks plans without
    processes); ``plugin.arguments`` every argument's value.
    """

    ARGS: ClassVar[tuple[Arg, ...]] = ()
    POSITIONAL: ClassVar[int] = 0
    controls_precision: ClassVar[bool] = True
    supports_pipeline: ClassVar[bool] = False

    def __init__(self, *args, **kwargs) -> None:
        name = type(self).__name__
        self.arguments: dict = bind(name, self.ARGS, self.POSITIONAL, args, kwargs)
        self._mesh = None
        st = self._build(self.arguments)              # every check runs here
        self._stack = dataclasses.replace(st, spec=_clean(st.spec))

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.__signature__ = signature(cls.ARGS, cls.POSITIONAL)

    # -- what a plugin is --------------------------------------------------------------
    def _build(self, v: dict) -> Stack:
        raise NotImplementedError

    def _sizes(self) -> dict:
        """The fixed axis sizes (``dp`` is what the world leaves)."""
        return {}

    @property
    def stack(self) -> Stack:
        return self._stack

    @property
    def spec(self):
        """The transforms this plugin runs (the Booster adds its ``mixed_precision``)."""
        return self._stack.spec

    def mesh_shape(self, world: int) -> dict:
        """``{axis: size}`` on ``world`` ranks, in this plugin's axis order."""
        fixed = self._sizes()
        rest = math.prod(s for s in fixed.values())
        if world % rest:
            raise MeshError(f"{type(self).__name__}: {world} ranks do not divide into "
                            f"{' x '.join(f'{k}={s}' for k, s in fixed.items())}; launch a "
                            f"multiple of {rest} processes")
        return {a: (world // rest if a == "dp" else s) for a, s in self._order(fixed).items()}

    def _order(self, fixed: dict) -> dict:
        return {"dp": None, **fixed}

    @property
    def mesh(self):
        """The mesh over the launched ranks (``launch_from_torch`` first)."""
        import torch.distributed as dist

        from .._mesh import Mesh

        if self._mesh is None:
            if not dist.is_initialized():
                raise MeshError(f"{type(self).__name__}.mesh: no process group; call "
                                f"meshlab.booster.launch_from_torch() first (or plan with "
                                f"plugin.plan(model, world_size=N))")
            self._mesh = Mesh(self.mesh_shape(dist.get_world_size()))
        return self._mesh

    def plan(self, model, world_size: int | None = None, precision=None):
        """The bound plan ``Booster.boost(model)`` runs (on a fake mesh of ``world_size``
        ranks when given: planning needs no processes)."""
        from .._api import plan as make_plan
        from .._mesh import Mesh

        mesh = self.mesh if world_size is None else Mesh(self.mesh_shape(world_size), fake=True)
        spec = self.spec if precision is None else self.spec | precision
        return make_plan(model, spec, mesh)

    # -- Colossal-AI's plugin API ------------------------------------------------------
    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, distributed_sampler_cls=None, **kwargs):
        """A DataLoader of ``batch_size`` samples per data-parallel rank (Colossal-AI's
        convention; ``meshlab.dataloader`` takes the global batch): data-parallel ranks
        get distinct samples, tensor/pipeline/sequence peers the same ones."""
        from .._data import dataloader
        from .._errors import check_int

        check_int(batch_size, "prepare_dataloader", "batch_size", example=8)
        if distributed_sampler_cls is not None:
            raise UnsupportedArgument("prepare_dataloader", "distributed_sampler_cls",
                                      distributed_sampler_cls, "meshlab's sampler splits by "
                                      "the data axes of the mesh", "meshlab.dataloader(...)")
        dp = math.prod(self.mesh.axis_size(a) for a in self._stack.data_axes)
        return dataloader(dataset, self.mesh, batch_size * dp, axes=self._stack.data_axes,
                          shuffle=shuffle, seed=seed, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)

    def support_no_sync(self) -> bool:
        return True

    def support_lora(self) -> bool:
        return True

    def control_precision(self) -> bool:
        return self.controls_precision

    def __getattr__(self, name: str):
        """Colossal-AI's plugin attributes: every argument (``plugin.pp_size``) and
        ``dp_size`` (the data-parallel ranks of the launched world)."""
        args = self.__dict__.get("arguments")
        if args is not None and name in args:
            return args[name]
        if name == "dp_size" and args is not None:
            return math.prod(self.mesh.axis_size(a) for a in self._stack.data_axes)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        given = [f"{a.name}={self.arguments[a.name]!r}" for a in self.ARGS
                 if self.arguments[a.name] is not a.default
                 and self.arguments[a.name] != a.default]
        return f"{type(self).__name__}({', '.join(given)})"


class TorchDDPPlugin(Plugin):
    """Plain data parallelism over every rank: ``data_parallel('dp')``."""

    controls_precision = False
    ARGS = _ddp_args("")[:6] + (
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _build(self, v: dict) -> Stack:
        from ..parallel import data_parallel

        return Stack({}, data_parallel("dp", bucket_mb=float(v["bucket_cap_mb"])), ("dp",),
                     broadcast_buffers=v["broadcast_buffers"])


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
             "zero_shard(2); NO_SHARD: data_parallel(); HYBRID_SHARD is refused (not yet "
             "shown)", With(lambda: _fsdp("ShardingStrategy").SHARD_GRAD_OP)),
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
        maps("sync_module_states", False, "True: rank 0's parameters and buffers are "
             "broadcast to every rank before the model is sharded", True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _build(self, v: dict) -> Stack:
        from ..parallel import data_parallel, offload, precision, zero_shard

        owner = type(self).__name__
        strategy = _enum_name(v["sharding_strategy"]) or "FULL_SHARD"
        specs = {"FULL_SHARD": zero_shard(3, "dp"), "SHARD_GRAD_OP": zero_shard(2, "dp"),
                 "NO_SHARD": data_parallel("dp")}
        if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            raise UnsupportedArgument(owner, "sharding_strategy", strategy,
                                      "hybrid sharding (replicate x shard) is not yet shown "
                                      "against one process", "zero_shard(3, 'dp')")
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
        return Stack({}, spec, ("dp",), sync_module_states=v["sync_module_states"],
                     precision=prec)


def _fsdp_precision(owner: str, mp):
    """torch FSDP's ``MixedPrecision`` (or the probe string) as ``precision(...)``."""
    import torch

    from ..parallel import precision

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
    ) + _scaler_args(2 ** 32) + _clip_args() + (
        hint("reduce_bucket_size_in_m", 12, "stage 1 reduce-scatters one flat bucket per "
             "dtype and tensor-parallel layout; stage 2 one per FSDP unit", 25),
        maps("communication_dtype", None, "precision(reduce=...): the dtype gradients are "
             "reduced in (None: fp32)",
             With(lambda: __import__("torch").bfloat16)),
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
        only("use_fp8", False, FP8, "precision('bf16')"),
        only("extra_dp_size", 1, "one data-parallel axis", "HybridParallelPlugin or a "
             "meshlab mesh with the axes you need"),
    )

    def _build(self, v: dict) -> Stack:
        from ..parallel import offload, zero_shard

        owner = type(self).__name__
        stage = v["stage"]
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ConfigError(f"{owner}(stage={stage!r}): 1 or 2 (ZeRO-3 is GeminiPlugin or "
                              f"TorchFSDPPlugin)")
        comm = _communication(owner, v)
        prec = _precision(self, v, ("fp16", "bf16", "fp32"), comm)
        spec = zero_shard(stage, "dp")
        if v["cpu_offload"]:
            spec = spec | offload(optimizer=1.0)
        if prec is not None:
            spec = spec | prec
        return Stack({}, spec, ("dp",), clip_grad_norm=_clip(v), verbose=v["verbose"])


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
             "card)", "auto"),
        hint("enable_gradient_accumulation", False, "gradients always accumulate over "
             "backwards until the optimizer steps (no_sync skips their reduction)", True),
        hint("max_prefetch", 0, "FSDP2 prefetches the next block's all-gather", 2),
        only("shard_param_frac", 1.0, "ZeRO-3 shards every parameter",
             "zero_shard(3) (all) or zero_shard(2) (none)"),
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
    ) + _scaler_args(2 ** 16) + _clip_args() + (
        maps("tp_size", 1, "a 'tp' mesh axis of this size and shard(policies.auto)", 2),
        only("extra_dp_size", 1, "one data-parallel axis", "a meshlab mesh with the axes "
             "you need"),
    ) + _shardformer_args()[:3] + (
        maps("enable_sequence_parallelism", False, "sequence('tp', 'split_gather') (Megatron "
             "sequence parallelism inside tensor parallelism; needs tp_size > 1)",
             With(True, (("tp_size", 2),))),
    ) + _shardformer_args()[3:] + (
        hint("enable_async_reduce", True, "FSDP2's reduce-scatters run asynchronously on "
             "their own stream", False),
        only("use_fp8", False, FP8, "precision('bf16')"),
        maps("verbose", False, "True: boost prints the plan's table and memory on rank 0",
             True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
    )

    def _sizes(self) -> dict:
        tp = self.arguments["tp_size"]
        return {"tp": tp} if tp > 1 else {}

    def _build(self, v: dict) -> Stack:
        from .. import policies
        from ..parallel import Identity, fuse, offload, sequence, shard, zero_shard

        owner = type(self).__name__
        tp = _positive_int(owner, "tp_size", v["tp_size"])
        spec = shard(policies.auto) if tp > 1 else Identity()
        if v["enable_sequence_parallelism"]:
            if tp == 1:
                raise ConfigError(f"{owner}(enable_sequence_parallelism=True): sequence "
                                  f"parallelism splits inside tensor parallelism; set "
                                  f"tp_size > 1")
            spec = spec | sequence("tp", "split_gather")
        spec = spec | zero_shard(3, "dp")
        policy = v["placement_policy"]
        po, oo = float(v["offload_param_frac"]), float(v["offload_optim_frac"])
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
        ops = _fuse_ops(v)
        if ops:
            spec = spec | fuse(*ops)
        prec = _precision(self, v, ("fp16", "bf16", "fp32"))
        if prec is not None:
            spec = spec | prec
        return Stack({}, spec, ("dp",), clip_grad_norm=_clip(v), verbose=v["verbose"])


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
    ) + _shardformer_args() + (
        maps("enable_sequence_parallelism", False, "sequence(...) in the mode of "
             "sequence_parallelism_mode (default 'split_gather')", True),
        maps("sequence_parallelism_mode", None, "'split_gather' and 'ring': sequence('tp', "
             "'split_gather') (Megatron SP; 'ring' is the same math, gathered in one "
             "collective); 'all_to_all': sequence('sp', 'all_to_all') (Ulysses); 'ring_attn': "
             "sequence('sp', 'ring') (ring attention)",
             With("all_to_all", (("enable_sequence_parallelism", True), ("sp_size", 2)))),
        hint("parallel_output", True, "the vocabulary-parallel head's logits are whole on "
             "every rank and the loss is the single process's", False),
        maps("num_microbatches", None, "pipeline(microbatches=...)", 8),
        maps("microbatch_size", None, "pipeline(microbatches=per-rank batch // "
             "microbatch_size) (the batch size comes from the dataloader given to boost)",
             With(1, (("num_microbatches", None),))),
    ) + _scaler_args(2 ** 16) + (
        maps("max_norm", 0, "meshlab.optimizer(clip_grad_norm=max_norm): clipping by the "
             "global norm over every mesh axis (0: off)", 1.0),
    ) + _ddp_args("ddp_") + (
        hint("zero_bucket_size_in_m", 12, "stage 1 reduce-scatters one flat bucket per dtype "
             "and tensor-parallel layout; stage 2 one per FSDP unit", 25),
        maps("cpu_offload", False, "offload(optimizer=1.0) (with zero_stage 1 or 2)",
             With(True, (("zero_stage", 1),))),
        maps("communication_dtype", None, "precision(reduce=...): the dtype gradients are "
             "reduced in (None: fp32)",
             With(lambda: __import__("torch").bfloat16)),
        hint("overlap_communication", overlap_default, "the backward's all-reduces (stage 0) "
             "and reduce-scatters (stage 2) always overlap it; stage 1 reduce-scatters at the "
             "step", not overlap_default),
        maps("custom_policy", None, "shard(custom_policy): a meshlab Policy or a mapping of "
             "parameter globs to specs", With(lambda: {"lm_head.weight": _P()("tp", None)})),
        maps("pp_style", "1f1b", "pipeline(schedule=...): '1f1b', 'interleaved' "
             "(pipeline(schedule='interleaved', virtual_stages=num_model_chunks)), 'zbv'",
             With("interleaved", (("num_model_chunks", 2),))),
        maps("num_model_chunks", 1, "pipeline(virtual_stages=...) (pp_style 'interleaved' or "
             "'zbv')", With(2, (("pp_style", "interleaved"),))),
        only("scheduler_nodes", None, "meshlab's schedules are torch.distributed.pipelining's",
             "pipeline(schedule='zbv')"),
        maps("num_layers_per_stage", None, "pipeline(layers_per_stage=...)", [1, 1]),
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


def _hybrid_tail() -> tuple[Arg, ...]:
    return (
        hint("overlap_p2p", True, "torch.distributed.pipelining's schedules post sends and "
             "receives asynchronously", False),
        hint("overlap_allgather", False, "stage 1 all-gathers the updated slices right after "
             "the step", True),
        only("fp8_communication", False, FP8, "precision('bf16', reduce='bf16')"),
        only("use_fp8", False, FP8, "precision('bf16')"),
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
        from .. import policies
        from ..parallel import (Identity, data_parallel, fuse, offload, pipeline, sequence,
                                shard, zero_shard)

        owner = type(self).__name__
        tp = _positive_int(owner, "tp_size", v["tp_size"])
        pp = _positive_int(owner, "pp_size", v["pp_size"])
        sp = 1 if v["sp_size"] is None else _positive_int(owner, "sp_size", v["sp_size"])
        ep = v.get("ep_size", 1)
        spec = Identity()
        if tp > 1:
            spec = shard(_policy(owner, v["custom_policy"]))
        elif v["custom_policy"] is not None:
            raise ConfigError(f"{owner}(custom_policy=...): a policy says how tensor "
                              f"parallelism splits the model; set tp_size > 1")
        spec = spec | _sequence(owner, v, tp, sp)
        if ep > 1:
            from ..parallel import expert_route

            spec = spec | expert_route("ep")
        stage = v["zero_stage"]
        if stage not in (0, 1, 2) or isinstance(stage, bool):
            raise ConfigError(f"{owner}(zero_stage={stage!r}): 0, 1 or 2")
        spec = spec | (data_parallel("dp", bucket_mb=float(v["ddp_bucket_cap_mb"]))
                       if stage == 0 else zero_shard(stage, "dp"))
        mbs = None
        if pp > 1:
            spec, mbs = _pipeline(owner, v, spec, pp)
        elif v["num_microbatches"] is not None or v["microbatch_size"] is not None:
            raise ConfigError(f"{owner}(num_microbatches/microbatch_size): microbatches are "
                              f"the pipeline's; set pp_size > 1, or accumulate with "
                              f"booster.no_sync")
        remat = _remat(owner, v["gradient_checkpoint_config"])
        if remat is not None:
            spec = spec | remat
        ops = _fuse_ops(v)
        if ops:
            spec = spec | fuse(*ops)
        if v["cpu_offload"]:
            if stage == 0:
                raise ConfigError(f"{owner}(cpu_offload=True): offloading the optimizer "
                                  f"state needs zero_stage 1 or 2")
            spec = spec | offload(optimizer=1.0)
        prec = _precision(self, v, ("fp16", "bf16", "fp32"), _communication(owner, v))
        if prec is not None:
            spec = spec | prec
        data = ("dp", "ep") if ep > 1 else ("dp",)
        return Stack({}, spec, data, clip_grad_norm=_clip(v),
                     broadcast_buffers=v["broadcast_buffers"] and stage == 0,
                     microbatch_size=mbs)


def _P():
    from .._spec import P

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
    from ..parallel import Identity, sequence

    mode = v["sequence_parallelism_mode"]
    on = v["enable_sequence_parallelism"]
    if not on:
        if mode is not None or sp > 1:
            raise ConfigError(f"{owner}(sequence_parallelism_mode={mode!r}, sp_size={sp}): "
                              f"set enable_sequence_parallelism=True to split the sequence")
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


def _pipeline(owner: str, v: dict, spec, pp: int):
    from ..parallel import pipeline

    n, size = v["num_microbatches"], v["microbatch_size"]
    if (n is None) == (size is None):
        raise ConfigError(f"{owner}(pp_size={pp}): give one of num_microbatches or "
                          f"microbatch_size")
    style = v["pp_style"]
    schedule = {"1f1b": "1f1b", "interleaved": "interleaved", "zbv": "zbv"}.get(style)
    if schedule is None:
        raise ConfigError(f"{owner}(pp_style={style!r}): '1f1b', 'interleaved' or 'zbv'")
    chunks = v["num_model_chunks"]
    if schedule == "1f1b" and chunks != 1:
        raise ConfigError(f"{owner}(num_model_chunks={chunks}): several chunks per stage "
                          f"need pp_style='interleaved' or 'zbv'")
    layers = v["num_layers_per_stage"]
    kw = dict(schedule=schedule, microbatches=n if n is not None else 1,
              virtual_stages=chunks if schedule != "1f1b" else None,
              layers_per_stage=tuple(layers) if layers is not None else None)
    return spec | pipeline("pp", **kw), size


def _remat(owner: str, cfg):
    from ..parallel import Remat, remat

    if cfg is None or isinstance(cfg, Remat):
        return cfg
    ratio = getattr(cfg, "gradient_checkpointing_ratio", None)
    if ratio is not None and float(ratio) == 1.0:
        return remat("full")
    raise UnsupportedArgument(owner, "gradient_checkpoint_config", cfg, "only a ratio of 1.0 "
                              "(every block) is implemented", "remat('full') or "
                              "remat('selective')")


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """``HybridParallelPlugin`` with expert parallelism: an ``ep`` mesh axis of
    ``ep_size`` and ``expert_route('ep')``; the dense parameters' data axes are
    ``dp x ep`` (Colossal-AI's dp size includes ep)."""

    POSITIONAL = 3
    ARGS = _hybrid_args(False)[:2] + (
        maps("ep_size", REQUIRED, "an 'ep' mesh axis of this size and expert_route('ep')", 4),
    ) + _hybrid_args(False)[2:] + (
        maps("moe_dp_outside", True, "the mesh's axis order: dp, ep, pp, tp (True) or ep, dp, "
             "pp, tp (False)", False),
    ) + _hybrid_tail()

    def _order(self, fixed: dict) -> dict:
        out = {"dp": None, **fixed}
        if "ep" in fixed:
            rest = {k: s for k, s in fixed.items() if k != "ep"}
            out = ({"dp": None, "ep": fixed["ep"], **rest} if self.arguments["moe_dp_outside"]
                   else {"ep": fixed["ep"], "dp": None, **rest})
        return out

    def _build(self, v: dict) -> Stack:
        _positive_int(type(self).__name__, "ep_size", v["ep_size"])
        return super()._build(v)


PLUGINS = (TorchDDPPlugin, TorchFSDPPlugin, LowLevelZeroPlugin, GeminiPlugin,
           HybridParallelPlugin, MoeHybridParallelPlugin)
