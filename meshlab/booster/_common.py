"""What several plugins share: the ``Stack`` a plugin builds, the argument groups they
have in common (loss scale, clipping, DDP's, Shardformer's switches) and the helpers that
turn those arguments into transforms."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.errors import ConfigError
from ._args import Arg, UnsupportedArgument, With, hint, maps, only

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
def scaler_args(initial: float) -> tuple[Arg, ...]:
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


def clip_args() -> tuple[Arg, ...]:
    return (
        maps("max_norm", 0.0, "meshlab.optimizer(clip_grad_norm=max_norm): clipping by the "
             "global norm over every mesh axis (0: off)", 1.0),
        only("norm_type", 2.0, "only the 2-norm is implemented",
             "meshlab.optimizer(clip_grad_norm=...) (global 2-norm)"),
    )


def ddp_args(prefix: str) -> tuple[Arg, ...]:
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


def shardformer_args() -> tuple[Arg, ...]:
    return (
        maps("enable_all_optimization", False, "fuse('rms_norm', 'rotary', 'attention', "
             "'mlp', absent='leave'): meshlab's fused kernels on the model's norms, rotary "
             "embedding, attention and gated MLP, each where the model has it (as "
             "Colossal-AI's policies apply what a family supports; plan.decision(FuseLeft) "
             "names what was left)", True),
        maps("enable_fused_normalization", False, "fuse('rms_norm', absent='leave'): the "
             "model's RMSNorms (a model with LayerNorm keeps torch's, one kernel already, and "
             "the plan says so)", True),
        maps("enable_flash_attention", False, "fuse('attention', absent='leave') (flash "
             "attention where installed, else SDPA's)", True),
        maps("enable_jit_fused", False, "fuse('rotary', 'mlp', absent='leave') (meshlab's "
             "fused elementwise ops: the rotary embedding and the SwiGLU gate)", True),
    )


def fuse_ops(v: dict) -> tuple[str, ...]:
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


def precision_of(plugin, v: dict, allowed: tuple[str, ...], communication=None):
    """The precision transform of a plugin's ``precision=`` and loss-scale arguments; the
    loss-scale arguments under bf16 or fp32 (Colossal-AI scripts often pass
    ``initial_scale=1`` there) have nothing to scale, and warn when not the defaults;
    ``use_fp8=True`` with bf16 is ``precision('fp8')``."""
    from ..transforms import precision

    owner = type(plugin).__name__
    name = v["precision"]
    if name not in allowed:
        if name in ("fp8",):
            raise UnsupportedArgument(owner, "precision", name, FP8, "precision='bf16', "
                                      "use_fp8=True (meshlab's precision('fp8'))")
        raise ConfigError(f"{owner}(precision={name!r}): use one of {', '.join(allowed)}")
    reduce = "fp32" if communication is None else communication
    if v.get("use_fp8"):
        if name != "bf16":
            raise UnsupportedArgument(owner, "use_fp8", True, "float8 layers run beside bf16 "
                                      "compute only", "precision='bf16' with use_fp8=True "
                                      "(meshlab's precision('fp8'))")
        _no_scale(plugin, v, owner, "bf16")
        return precision("fp8", reduce)
    if name != "fp16":
        _no_scale(plugin, v, owner, name)
        return None if name == "fp32" and reduce == "fp32" else precision(
            "fp32" if name == "fp32" else name, reduce)
    return precision("fp16", reduce, "dynamic", init_scale=float(v["initial_scale"]),
                     growth_interval=v["growth_interval"],
                     growth_factor=float(v["growth_factor"]),
                     backoff_factor=float(v["backoff_factor"]), hysteresis=v["hysteresis"],
                     min_scale=float(v["min_scale"]), max_scale=float(v["max_scale"]))


def _no_scale(plugin, v: dict, owner: str, name: str) -> None:
    """Loss-scale arguments away from their defaults have nothing to scale under ``name``:
    a warning each."""
    import warnings

    from ._args import NoEffectWarning, is_default

    for a in plugin.ARGS:
        if a.name in SCALER and not is_default(a, v[a.name]):
            warnings.warn(f"{owner}({a.name}={v[a.name]!r}) has no effect: the loss "
                          f"scale exists under precision='fp16' only, this is {name!r}",
                          NoEffectWarning, stacklevel=6)


def use_fp8() -> "Arg":
    """Colossal-AI's ``use_fp8``: its float8 linear layers, meshlab's ``precision('fp8')``
    (torchao's); with ``precision='bf16'``."""
    return maps("use_fp8", False, "precision('fp8'): the linear layers in float8 through "
                "torchao (with precision='bf16')", With(True, (("precision", "bf16"),)))


SCALER = tuple(a.name for a in scaler_args(0))


def communication(owner: str, v: dict):
    """``communication_dtype`` as a precision name (None: fp32 reductions)."""
    import torch

    d = v.get("communication_dtype")
    if d is None:
        return None
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if not isinstance(d, torch.dtype) or d not in names:
        raise ConfigError(f"{owner}(communication_dtype={d!r}): use torch.float32, "
                          f"torch.bfloat16 or torch.float16")
    return names[d]


def clip(v: dict) -> float | None:
    m = v["max_norm"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0:
        raise ConfigError(f"max_norm={m!r}: a number >= 0 (0 turns clipping off)")
    return float(m) if m > 0 else None


def positive_int(owner: str, name: str, value, low: int = 1) -> int:
    from ..core.errors import check_int

    return check_int(value, owner, name, low=low)
