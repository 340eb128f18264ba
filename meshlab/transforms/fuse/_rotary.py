"""Fuse's ``rotary`` routing: a Hugging Face modeling file's ``apply_rotary_pos_emb`` on
``meshlab::rotary``.

A routed attention module runs its class's forward over a copy of its modeling file's
globals in which ``apply_rotary_pos_emb`` calls ``meshlab::rotary`` (its instance
forward), so other models in the process are untouched and nothing changes at run time.
An attention module whose forward is not its modeling file's (or is set on the instance)
keeps the older way: the file's function wrapped once by a dispatcher that calls
``meshlab::rotary`` while a routed attention module runs (a pre-hook and hook count them). Each function is probed against the original before it is
wrapped. Queries and keys that are adjacent parts of one tensor (a merged query/key/value
product's row, outside autograd) are rotated in one launch.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types

import torch
from einops import rearrange
from torch import Tensor, nn

from ...core.errors import ConfigError
from ._residual import in_float32, probe_close

_ROUTED = threading.local()         # depth of routed attention modules now running


def _active() -> bool:
    return getattr(_ROUTED, "depth", 0) > 0


def _adjacent(q: Tensor, k: Tensor) -> Tensor | None:
    """q (B, H, S, D) and k (B, Hkv, S, D) as one (B, S, H + Hkv, D) view where k's heads
    follow q's in memory at the same token strides (the parts of a merged query/key/value
    product), outside autograd and tracing; else None."""
    if type(q) is not Tensor or type(k) is not Tensor or q.dtype != k.dtype \
            or q.device != k.device or torch.compiler.is_compiling() \
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return None
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    d = q.shape[-1]
    # Strides of batch or sequence dims of size 1 are arbitrary (a view may set them either
    # way), so only the others must agree.
    if qt.shape[:2] != kt.shape[:2] or kt.shape[-1] != d \
            or any(n > 1 and a != b for n, a, b in zip(qt.shape[:2], qt.stride(), kt.stride())) \
            or qt.stride(-1) != 1 or (q.shape[1] > 1 and qt.stride(2) != d) \
            or (k.shape[1] > 1 and kt.stride(2) != d) \
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() \
            or k.storage_offset() != q.storage_offset() + q.shape[1] * d:
        return None
    return qt.as_strided((*qt.shape[:2], q.shape[1] + k.shape[1], d), (*qt.stride()[:2], d, 1))


def _fused_apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                        unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` on ``meshlab::rotary``: q (B, H, S, D),
    k (B, Hkv, S, D), cos/sin (B or 1, S, D) with equal halves."""
    from ...ops.rotary import rotary

    b, s, d = q.shape[0], q.shape[2], q.shape[-1]
    c, sn = cos[..., : d // 2], sin[..., : d // 2]
    if c.shape[0] == 1:
        c, sn = c[0], sn[0]
        both = _adjacent(q, k)
        if both is not None:        # one launch for the two, as parts of one tensor
            y = rotary(both, c, sn)
            hq = q.shape[1]
            return y[:, :, :hq].transpose(1, 2), y[:, :, hq:].transpose(1, 2)

        def rot(x):
            return rotary(x.transpose(1, 2), c, sn).transpose(1, 2)
    else:
        # Positions per sample: fold batch into sequence, one angle row per token.
        c, sn = c.reshape(b * s, -1), sn.reshape(b * s, -1)

        def rot(x):
            y = rotary(rearrange(x, "b h s d -> 1 (b s) h d"), c, sn)
            return rearrange(y, "1 (b s) h d -> b h s d", b=b)
    return rot(q), rot(k)


def _dispatcher(original, always: bool = False):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not (always or _active()):
            return original(q, k, cos, sin, *args, **kwargs)
        if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1 \
                or q.shape[-1] != cos.shape[-1]:
            raise ConfigError(
                f"{original.__module__}.apply_rotary_pos_emb was called with q "
                f"{tuple(q.shape)}, cos {tuple(cos.shape)} and extra arguments "
                f"{args or sorted(kwargs)}: rotation of part of the head, or another layout, "
                f"is not routed to meshlab::rotary; leave 'rotary' out of fuse(ops=...)")
        return _fused_apply_rotary(q, k, cos, sin)

    apply_rotary_pos_emb._meshlab_original = original
    return apply_rotary_pos_emb


def _enter(module, args, kwargs=None):
    _ROUTED.depth = getattr(_ROUTED, "depth", 0) + 1


def _leave(module, args, output):
    _ROUTED.depth -= 1


def _find_rotary(model: nn.Module) -> list[tuple[str, nn.Module, types.ModuleType]]:
    """``(name, module, modeling module)`` of each attention module whose modeling file has
    an ``apply_rotary_pos_emb``; each such function not dispatched yet is probed once."""
    found, probed = [], set()
    for name, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or not type(m).__name__.endswith("Attention"):
            continue
        if not getattr(m, "_meshlab_rotary", False) and \
                not hasattr(fn, "_meshlab_original") and fn not in probed:
            _probe_rotary(fn, type(m).__name__)
            probed.add(fn)
        found.append((name, m, mod))
    return found


_REBOUND: dict = {}      # (class forward, original function) -> the forward reading ours


def _rebound_forward(forward, original, scope_of):
    """The attention class's ``forward`` whose global ``apply_rotary_pos_emb`` is the
    fused one: the same code over a copy of its modeling module's globals (``scope_of``),
    each decorator around it rebuilt over the new function (its cell that held the old
    one replaced). A routed module takes it as its instance forward, so nothing is counted
    at run time (a counter is a side effect dynamo refuses inside a checkpointed, compiled
    block) and other models of the modeling file keep the original. None where the
    function or a decorator cannot be rebuilt so."""
    key = (forward, original)
    if key not in _REBOUND:
        _REBOUND[key] = _rebuild(forward, _dispatcher(original, always=True), scope_of)
    return _REBOUND[key]


def _copy(fn, scope: dict, closure):
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


def _scope(module_globals: dict, fused) -> dict:
    """A copy of a modeling module's globals whose ``apply_rotary_pos_emb`` is ``fused``,
    as the namespace of a module of its own in ``sys.modules`` (dynamo finds a function's
    globals by their ``__name__`` and guards on that module's attributes)."""
    name = f"{module_globals['__name__']}._meshlab_rotary"
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        sys.modules[name] = mod
    mod.__dict__.update({k: v for k, v in module_globals.items() if k != "__name__"})
    mod.__dict__["apply_rotary_pos_emb"] = fused
    return mod.__dict__


def _rebuild(fn, fused, scope_of):
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:                                  # the function that reads the global
        if not isinstance(fn, types.FunctionType) or fn.__globals__ is not scope_of:
            return None
        return _copy(fn, _scope(fn.__globals__, fused), fn.__closure__)
    new_inner = _rebuild(inner, fused, scope_of)
    if new_inner is None or not isinstance(fn, types.FunctionType):
        return None
    cells, hit = [], False
    for c in fn.__closure__ or ():
        try:
            holds = c.cell_contents is inner
        except ValueError:                             # an empty cell
            holds = False
        hit |= holds
        cells.append(types.CellType(new_inner) if holds else c)
    if not hit:
        return None
    new = _copy(fn, fn.__globals__, tuple(cells))
    new.__wrapped__ = new_inner
    return new


def _route_rotary(model: nn.Module, found) -> list[str]:
    for _, m, mod in found:
        if getattr(m, "_meshlab_rotary", False):                # routed before
            continue
        fn = mod.apply_rotary_pos_emb
        original = getattr(fn, "_meshlab_original", fn)
        rebound = None if "forward" in vars(m) else \
            _rebound_forward(type(m).forward, original, vars(mod))
        if rebound is not None:
            m.forward = types.MethodType(rebound, m)
        else:       # a forward of another module, or one set on the instance: count calls
            if not hasattr(fn, "_meshlab_original"):
                setattr(mod, "apply_rotary_pos_emb", _dispatcher(fn))
            m.register_forward_pre_hook(_enter)
            m.register_forward_hook(_leave, always_call=True)
        m._meshlab_rotary = True
    return [name for name, _, _ in found]


@in_float32
def _probe_rotary(fn, owner: str) -> None:
    params = inspect.signature(fn).parameters
    if list(params)[:4] != ["q", "k", "cos", "sin"]:
        raise ConfigError(f"{fn.__module__}.apply_rotary_pos_emb{inspect.signature(fn)} "
                          f"(used by {owner}) is not (q, k, cos, sin, ...); leave 'rotary' out "
                          f"of fuse(ops=...)")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    ang = torch.randn(2, 5, 4, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        try:
            want = fn(q, k, c, s)
        except Exception as e:          # e.g. a GPU-only kernel patched in by another library
            raise ConfigError(
                f"the apply_rotary_pos_emb that {owner} calls ({fn.__module__}."
                f"{fn.__qualname__}) failed on a CPU probe ({type(e).__name__}: "
                f"{str(e)[:120]}); if another library patched the modeling module, build the "
                f"model in a fresh process, or leave 'rotary' out of fuse(ops=...)") from e
        got = _fused_apply_rotary(q, k, c, s)
        for a, b in zip(got, want):
            probe_close(a, b, f"{fn.__module__}.apply_rotary_pos_emb",
                         "leave 'rotary' out of fuse(ops=...)")
