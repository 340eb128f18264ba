"""Colossal-AI's other optimizers (``colossalai.nn.optimizer``): ``Lars``, ``CAME``,
``Adafactor``, ``GaLoreAdamW`` and the ``Distributed*`` classes its plugins switch to.

Each is built on a maintained library where one has Colossal-AI's update: ``CAME`` on
``came_pytorch.CAME`` (the ``optim`` extra), ``Adafactor`` on ``transformers``' Adafactor,
``GaLoreAdamW`` is ``galore_torch.GaLoreAdamW`` (the ``galore`` extra; Colossal-AI
re-exports that class too). ``Lars`` is written here: torch, torch-optimizer and
transformers have no LARS, and the one on PyPI (``torchlars``) builds a CUDA extension and
computes another update (no gradient clamp, no trust-ratio clamp).

None of them updates elementwise (trust ratios, factored moments, projections of each
matrix), so meshlab never hands them slices: under ZeRO-1 each parameter is stepped whole
by the data rank that owns it (``transforms/zero/_owned.py``), and on DTensor parameters
(tensor parallelism, ZeRO-3) ``Lars`` computes its norms over the whole tensor while the
others, whose libraries create plain state tensors, are stepped on whole plain tensors
(``WHOLE_ON_DTENSORS``, ``train/_whole.py``). The updates are therefore one process's.
"""

from __future__ import annotations

import torch

from ..core.errors import ConfigError
from ..core.log import require


def _unwrapped(fn):
    """A library class's ``step`` itself: torch wraps a class's ``step`` with the step hooks
    once an instance of it exists, and the subclasses' own ``step`` already runs them."""
    return getattr(fn, "__wrapped__", fn)


def _whole_on_dtensors(cls: type) -> type:
    """Step ``cls`` on whole plain tensors where it would get DTensors (its library creates
    plain state tensors beside the parameter, which DTensor refuses to mix)."""
    from ..train.optimizer import WHOLE_ON_DTENSORS

    if cls not in WHOLE_ON_DTENSORS:
        WHOLE_ON_DTENSORS.append(cls)
    return cls


class _Distributed:
    """``setup_distributed``, which Colossal-AI's plugins call on its ``Distributed*``
    optimizers to hand them their tensor- and data-parallel groups and ZeRO's map of
    shards to parameters. meshlab needs none of it: ZeRO-1 steps these optimizers on whole
    parameters, one owner each, and DTensor parameters (tensor parallelism, ZeRO-3) give
    whole-tensor norms or are stepped whole; so this accepts Colossal-AI's arguments and
    does nothing else."""

    def setup_distributed(self, tp_group=None, dp_group=None, shard_to_working_param=None,
                          padding_map=None, use_zero=None, is_zero=None, **kwargs) -> None:
        return None


# -- LARS ------------------------------------------------------------------------------

def _whole_norm(t: torch.Tensor) -> torch.Tensor:
    """The norm of the whole tensor, as a plain tensor (a DTensor's is reduced over its
    mesh, so every rank holding a shard reads the full tensor's)."""
    from torch.distributed.tensor import DTensor

    n = torch.linalg.vector_norm(t)
    return n.full_tensor() if isinstance(n, DTensor) else n


class Lars(torch.optim.Optimizer):
    """Colossal-AI's ``Lars`` (same arguments and defaults). Per tensor: the trust ratio
    ``eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)`` (1 where a norm is 0),
    clamped to ``[0, 50]``, scales the learning rate; the gradient plus ``weight_decay * w``
    is clamped elementwise to ``[-10, 10]``; with ``momentum`` the buffer is
    ``momentum * buf + g`` (the first step's is ``g``); then ``w -= lr * ratio * buf``.

    No maintained library has this update (see the module's docstring), so it is written
    here. The norms are over the whole tensor, also for DTensor parameters."""

    def __init__(self, params, lr=1e-3, momentum=0, eeta=1e-3, weight_decay=0, epsilon=0.0):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if eeta <= 0 or eeta > 1:
            raise ValueError(f"Invalid eeta value: {eeta}")
        if epsilon < 0:
            raise ValueError(f"Invalid epsilon value: {epsilon}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      eeta=eeta, epsilon=epsilon, lars=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, rate = p.grad, lr
                if group["lars"]:
                    w_norm, g_norm = _whole_norm(p), _whole_norm(p.grad)
                    ratio = torch.where((w_norm > 0) & (g_norm > 0),
                                        group["eeta"] * w_norm
                                        / (g_norm + wd * w_norm + group["epsilon"]),
                                        torch.ones_like(w_norm))
                    rate = lr * ratio.clamp_(0.0, 50).item()
                    if wd != 0:
                        g = g.add(p, alpha=wd)
                g = torch.clamp(g, -10.0, 10.0)
                if momentum != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        g = state["momentum_buffer"] = torch.clone(g).detach()
                    else:
                        g = state["momentum_buffer"].mul_(momentum).add_(g)
                p.add_(g, alpha=-rate)
        return loss


# -- CAME ------------------------------------------------------------------------------

def _came():
    return require("came_pytorch", "optim", "CAME (Colossal-AI's CAME optimizer)")


def _came_class():
    lib = _came()

    class CAME(lib.CAME):
        """Colossal-AI's ``CAME`` (same arguments and defaults) on ``came_pytorch.CAME``,
        whose update is Colossal-AI's: Adafactor's factored second moment (full for
        tensors of fewer than 2 dimensions), the update clipped to RMS ``clip_threshold``,
        its moving average, and the confidence-guided factored average of the instability
        ``(update - exp_avg)^2`` scaling it. The library keeps each parameter's RMS in its
        state, which the update never reads; it is dropped after each step, so the state
        holds Colossal-AI's keys. The library's states are created in the gradient's
        dtype; Colossal-AI's in the parameter's (the same tensors in meshlab, where a
        gradient has its parameter's dtype)."""

        def __init__(self, params, lr=None, eps=(1e-30, 1e-16), clip_threshold=1.0,
                     betas=(0.9, 0.999, 0.9999), weight_decay=0.0):
            if lr is None or not lr > 0.0:
                raise ValueError(f"CAME: give a learning rate > 0, got lr={lr}")
            super().__init__(params, lr=lr, eps=tuple(eps), clip_threshold=clip_threshold,
                             betas=tuple(betas), weight_decay=weight_decay)

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            _unwrapped(lib.CAME.step)(self)
            for s in self.state.values():
                s.pop("RMS", None)
            return loss

    return _whole_on_dtensors(CAME)


# -- Adafactor -------------------------------------------------------------------------

def _adafactor_class():
    from transformers.optimization import Adafactor as _Lib

    class Adafactor(_Lib):
        """Colossal-AI's ``Adafactor`` (same arguments and defaults) on ``transformers``'
        ``Adafactor``, whose update it is (factored second moments, RMS clipping, the
        relative step size) except where this class follows Colossal-AI:

        * Colossal-AI never updates the parameter's RMS it keeps in each state (it stays
          0), so with ``scale_parameter`` the step size is scaled by ``eps[1]``, not by
          ``max(eps[1], RMS(w))`` as in the library; so is it here, and the state's
          ``RMS`` stays 0;
        * Colossal-AI ignores ``lr`` (it sets it to None), so with ``relative_step`` (the
          default) a given ``lr`` is ignored here too (the library refuses it); with
          ``relative_step=False`` Colossal-AI fails at the first step for want of a rate,
          and this class takes ``lr`` as the library does.

        Colossal-AI creates the factored row and column moments in float32 whatever the
        parameter's dtype; the library (and this class) in the gradient's dtype, so the
        two differ for float64 parameters only."""

        def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                     decay_rate=-0.8, beta1=None, weight_decay=0.0, scale_parameter=True,
                     relative_step=True, warmup_init=False):
            if relative_step:
                lr = None
            super().__init__(params, lr=lr, eps=tuple(eps), clip_threshold=clip_threshold,
                             decay_rate=decay_rate, beta1=beta1, weight_decay=weight_decay,
                             scale_parameter=scale_parameter, relative_step=relative_step,
                             warmup_init=warmup_init)

        @staticmethod
        def _get_lr(param_group, param_state):
            return _Lib._get_lr(param_group, {**param_state, "RMS": 0})

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            _unwrapped(_Lib.step)(self)
            for s in self.state.values():
                if "RMS" in s:
                    s["RMS"] = 0
            return loss

    return _whole_on_dtensors(Adafactor)


# -- GaLore ----------------------------------------------------------------------------

# The options of a GaLore parameter group (``{'params': ..., 'rank': 4, ...}``), which the
# Booster carries when it rebuilds the optimizer over the parallelized parameters.
_GALORE_GROUP_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def _galore():
    what = "GaLoreAdamW (GaLore's AdamW)"
    require("bitsandbytes", "galore", what)        # galore_torch imports it
    return require("galore_torch", "galore", what)


def _galore_class():
    lib = _galore()

    class GaLoreAdamW(lib.GaLoreAdamW):
        """``galore_torch.GaLoreAdamW`` (the class Colossal-AI re-exports): AdamW, and for
        the parameter groups that give ``rank`` (with ``update_proj_gap``, ``scale``,
        ``proj_type``) each 2-D gradient projected onto its top singular vectors (an SVD
        of the whole gradient, renewed every ``update_proj_gap`` steps), the Adam update
        computed there and projected back. The SVD reads the whole tensor: ZeRO-1 steps
        each parameter on its owner, and DTensor parameters are stepped whole."""

        meshlab_group_keys = _GALORE_GROUP_KEYS

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                     correct_bias=True, no_deprecation_warning=True):
            super().__init__(params, lr=lr, betas=tuple(betas), eps=eps,
                             weight_decay=weight_decay, correct_bias=correct_bias,
                             no_deprecation_warning=no_deprecation_warning)

    return _whole_on_dtensors(GaLoreAdamW)


class _EightBitGaLore:
    """Colossal-AI's 8-bit GaLore AdamW on bitsandbytes' blockwise 8-bit states: refused."""

    def __init__(self, *args, **kwargs):
        raise ConfigError(
            f"{type(self).__name__}: meshlab does not provide Colossal-AI's 8-bit GaLore "
            f"AdamW (bitsandbytes' quantized optimizer states). Use "
            f"meshlab.booster.nn.optimizer.GaLoreAdamW (the same GaLore projection, "
            f"full-precision states; pip install 'meshlab[galore]')")


class GaLoreAdamW8bit(_EightBitGaLore):
    __doc__ = _EightBitGaLore.__doc__


class DistGaloreAwamW(_EightBitGaLore, _Distributed):
    __doc__ = _EightBitGaLore.__doc__


# -- the names -------------------------------------------------------------------------

_BUILT: dict = {}


def _distributed(base: type, name: str, doc: str, init=None) -> type:
    ns = {"__doc__": doc, "__module__": __name__}
    if init is not None:
        ns["__init__"] = init
    return type(name, (base, _Distributed), ns)


def _make(name: str):
    if name == "Lars":
        return Lars
    if name == "CAME":
        return _came_class()
    if name == "Adafactor":
        return _adafactor_class()
    if name == "GaLoreAdamW":
        return _galore_class()
    if name == "GaLoreAdamW8bit":
        return GaLoreAdamW8bit
    if name == "DistGaloreAwamW":
        return DistGaloreAwamW
    if name == "DistributedCAME":
        return _distributed(get("CAME"), name, "Colossal-AI's ``DistributedCAME``: "
                            "meshlab's ``CAME`` (same arguments), with "
                            "``setup_distributed``. " + _Distributed.__doc__)
    if name == "DistributedAdaFactor":
        return _distributed(get("Adafactor"), name, "Colossal-AI's ``DistributedAdaFactor``: "
                            "meshlab's ``Adafactor`` (same arguments), with "
                            "``setup_distributed``. " + _Distributed.__doc__)
    if name == "DistributedLamb":
        from ._lamb import Lamb

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0,
                     bias_correction=True):
            Lamb.__init__(self, params, lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay, bias_correction=bias_correction)
            self.meshlab_class = type(self)
            self.meshlab_kwargs.pop("adam")

        return _distributed(Lamb, name, "Colossal-AI's ``DistributedLamb``: meshlab's "
                            "``Lamb`` with Colossal-AI's arguments for it (no ``adam``; "
                            "``bias_correction`` on by default), and "
                            "``setup_distributed``. " + _Distributed.__doc__, __init__)
    raise AttributeError(name)


NAMES = ("Lars", "CAME", "Adafactor", "GaLoreAdamW", "GaLoreAdamW8bit", "DistributedLamb",
         "DistributedCAME", "DistributedAdaFactor", "DistGaloreAwamW")


def get(name: str) -> type:
    """The class named ``name`` (built once, on first use)."""
    if name not in _BUILT:
        _BUILT[name] = _make(name)
    return _BUILT[name]
