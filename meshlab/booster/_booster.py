"""``Booster``: Colossal-AI's training surface over ``meshlab.parallelize``.

``boost`` is one ``parallelize(model, plugin.spec [| precision] [| lora], plugin.mesh)``
and one ``meshlab.optimizer(...)``; everything after it is meshlab's own step machinery
(gradient sync from the backward, ZeRO, the pipeline schedule, checkpoints). The
Booster holds no state of its own beyond which optimizer belongs to which model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ConfigError, ConfigTypeError
from ..transforms._install import runtime_of, runtime_or_none
from ._args import UnsupportedArgument
from ._base import Plugin
from ._common import Stack
from ._plugins import TorchDDPPlugin

_MIXED = {"fp16": "fp16", "bf16": "bf16", "fp32": None, None: None}


def launch_from_torch(backend: str | None = None, seed: int = 1024, verbose: bool = True):
    """Join the process group torchrun (or ``meshlab run``) described in the environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), pick this rank's GPU
    from ``LOCAL_RANK``, and seed Python's, NumPy's and torch's generators with ``seed`` on
    every rank alike (so a model built after it holds the same weights everywhere).
    ``backend`` defaults to NCCL with GPUs, gloo without. A process group that already
    exists is used as it is."""
    import os

    from ..core.errors import check_int

    check_int(seed, "launch_from_torch", "seed", low=0, example=1024)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise ConfigError(f"launch_from_torch: {', '.join(missing)} not set; start the "
                              f"script with torchrun --nproc_per_node N (or meshlab run --nproc-per-node N)")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    from .utils import set_seed

    set_seed(seed)
    if verbose:         # rank 0's, at MESHLAB_LOG_LEVEL=INFO
        from ..core.log import get_logger

        get_logger("meshlab.booster").info("%d processes (%s), seed %d",
                                           dist.get_world_size(), dist.get_backend(), seed)


@dataclasses.dataclass
class _Lora:
    config: Any
    pretrained_dir: str | None
    quantize: Any = None          # a meshlab Quantize: the base in 4 bits (QLoRA)


class Booster:
    """``Booster(plugin=..., mixed_precision=...)``: ``boost`` parallelizes a model as the
    plugin's transforms say; ``backward``, ``execute_pipeline``, ``no_sync``,
    ``enable_lora`` and the checkpoint methods run on what it built.

    ``mixed_precision`` ('fp16', 'bf16', or a ``meshlab.precision(...)`` value) is for the
    plugins that leave precision to the Booster (``TorchDDPPlugin``, ``TorchFSDPPlugin``);
    the others take ``precision=`` themselves, and a Booster precision that disagrees with
    theirs is refused rather than ignored.
    """

    def __init__(self, device: str | None = None, mixed_precision=None,
                 plugin: Plugin | None = None) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise ConfigTypeError(f"Booster(plugin={plugin!r}): a meshlab.booster plugin such "
                                  f"as TorchDDPPlugin() or HybridParallelPlugin(tp_size=2, "
                                  f"pp_size=1)")
        if plugin is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if world > 1:
                raise ConfigError(f"Booster(plugin=None) on {world} processes would train "
                                  f"{world} unrelated copies; pass a plugin, e.g. "
                                  f"TorchDDPPlugin()")
            plugin = TorchDDPPlugin()
        self.plugin = plugin
        self.device = _device(device)
        self._precision = self._mixed(mixed_precision)
        self._owner: dict[int, weakref.ref] = {}      # id(optimizer) -> its model
        self._optimizers: dict[int, weakref.ref] = {}  # id(model) -> its optimizer
        # id(model) -> (its optimizer's step count then, {part: (step, path) loaded})
        self._resume: dict[int, tuple] = {}
        self._criteria: dict[tuple, Callable] = {}

    def _mixed(self, mixed):
        from ..transforms import Precision, precision

        from ._amp import PrecisionValue

        if isinstance(mixed, PrecisionValue):      # FP16TorchMixedPrecision(), ...
            mixed = mixed.precision
        if mixed is None:
            mine = None
        elif isinstance(mixed, Precision):
            mine = mixed
        elif isinstance(mixed, str) and mixed in _MIXED:
            mine = precision(_MIXED[mixed]) if _MIXED[mixed] else None
        elif isinstance(mixed, str) and mixed in ("fp16_apex", "fp16_naive", "fp8"):
            raise UnsupportedArgument("Booster", "mixed_precision", mixed, "apex, naive fp16 "
                                      "and fp8 amp are not implemented",
                                      "mixed_precision='fp16' (autocast and dynamic loss "
                                      "scaling) or 'bf16'")
        else:
            raise ConfigError(f"Booster(mixed_precision={mixed!r}): 'fp16', 'bf16', 'fp32', "
                              f"None, or a meshlab.precision(...) value")
        own = self.plugin.stack.precision
        if self.plugin.control_precision():
            if mine is not None:
                have = _stack_precision(self.plugin.stack)
                if repr(have) != repr(mine):
                    raise ConfigError(f"Booster(mixed_precision={mixed!r}) with "
                                      f"{self.plugin!r}: this plugin sets the precision itself "
                                      f"({have!r}); pass precision=... to the plugin and drop "
                                      f"mixed_precision")
            return None
        if own is not None and mine is not None and repr(own) != repr(mine):
            raise ConfigError(f"Booster(mixed_precision={mixed!r}) and {self.plugin!r} "
                              f"(mixed_precision={own!r}) disagree; give one")
        return mine if mine is not None else own

    @property
    def checkpoint_io(self):
        """The checkpoint methods as Colossal-AI's ``CheckpointIO`` (``_sync_io`` waits
        for a background save)."""
        from .checkpoint_io import BoosterIO

        return BoosterIO(self)

    # -- the plan ---------------------------------------------------------------------
    def stack(self, model: nn.Module | None = None, dataloader=None) -> Stack:
        """The plugin's stack with the Booster's precision, the model's LoRA, and the
        pipeline's microbatches from the dataloader's batch size (``microbatch_size``)."""
        st = self.plugin.stack
        parts = list(getattr(st.spec, "parts", (st.spec,)))
        parts = [t for t in parts if getattr(t, "kind", None) != "identity"]
        lo = getattr(model, "_meshlab_booster_lora", None) if model is not None else None
        if lo is not None:
            from ..transforms import lora

            at = next((i + 1 for i, t in enumerate(parts) if t.kind == "shard"), 0)
            parts.insert(at, lora(lo.config, quantize=lo.quantize))
        if st.microbatch_size is not None:
            parts = [_microbatches(t, st.microbatch_size, dataloader) if t.kind == "pipeline"
                     else t for t in parts]
        if self._precision is not None:
            parts.append(self._precision)
        spec = parts[0] if len(parts) == 1 else _compose(parts)
        return dataclasses.replace(st, spec=spec)

    @property
    def spec(self):
        """The transforms ``boost`` runs (the plugin's and the Booster's precision)."""
        return self.stack().spec

    def plan(self, model: nn.Module, world_size: int | None = None):
        """What ``boost(model)`` runs, as a bound plan (``plan.table()``, ``.memory()``,
        ``.comm()``); a boosted model's own plan. ``world_size`` plans on a fake mesh."""
        from ..apply.plan import plan as make_plan
        from ..core.mesh import Mesh

        rt = runtime_or_none(model)
        if rt is not None:
            return rt.plan
        mesh = (self.plugin.mesh if world_size is None
                else Mesh(self.plugin.mesh_shape(world_size), fake=True))
        return make_plan(model, self.stack(model).spec, mesh)

    # -- boost ------------------------------------------------------------------------
    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              criterion: Callable | None = None, dataloader=None, lr_scheduler=None) -> list:
        """Parallelize ``model`` as the plugin says; returns ``[model, optimizer,
        criterion, dataloader, lr_scheduler]``. The optimizer is rebuilt over the sharded
        parameters (same class and hyper-parameters, ``meshlab.optimizer`` around it, with
        the plugin's clipping); a scheduler built on it is pointed at the new one."""
        from ..apply.parallelize import parallelize
        from ._optim import groups, rebind_scheduler, recipe, trained_groups
        from .interface import OptimizerWrapper, wrap_model
        from .lazy.lazy_init import pretrained_source

        if not isinstance(model, nn.Module):
            raise ConfigTypeError(f"boost(model=...): an nn.Module, got {type(model).__name__}")
        if runtime_or_none(model) is not None:
            raise ConfigError("boost: this model was boosted (or parallelized) already; build "
                              "a fresh model to boost again")
        if lr_scheduler is not None and optimizer is None:
            raise ConfigError("boost(lr_scheduler=...) needs the optimizer it was built on")
        st = self.stack(model, dataloader)
        made = None
        if optimizer is not None:       # read before parallelize renews the parameters
            cls, kwargs = recipe(optimizer, model)
            by_name, kept = groups(optimizer, model, kwargs), trained_groups(optimizer) or [0]
            # the old groups the new ones are built from (one: recipe's first trained one)
            made = cls, kwargs, by_name, kept if by_name is not None else kept[:1]
        lo = getattr(model, "_meshlab_booster_lora", None)
        pretrained = pretrained_source(model)
        model = wrap_model(parallelize(model, st.spec, self.plugin.mesh,
                                       sync_module_states=st.sync_module_states))
        if pretrained is not None:      # from_pretrained inside LazyInitContext
            from ..checkpoint import load_pretrained

            load_pretrained(pretrained, model)
        if lo is not None and lo.pretrained_dir is not None:
            from ..checkpoint.adapters import load_adapter

            load_adapter(lo.pretrained_dir, model)
        if st.broadcast_buffers:
            _buffer_broadcast(model)
        new_opt = None
        if made is not None:
            cls, kwargs, by_name, kept = made
            new_opt = OptimizerWrapper(model, cls, clip_grad_norm=st.clip_grad_norm,
                                       param_groups=by_name, **kwargs)
            self._owner[id(new_opt)] = weakref.ref(model)
            self._optimizers[id(model)] = weakref.ref(new_opt)
            if lr_scheduler is not None:
                rebind_scheduler(lr_scheduler, optimizer, new_opt, kept)
        if st.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
            from rich.console import Console

            c = Console()
            c.print(runtime_of(model).plan.table())
            c.print(runtime_of(model).plan.memory())
        return [model, new_opt, criterion, dataloader, lr_scheduler]

    # -- the step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """``loss.backward()``, scaled by the optimizer's loss scale under fp16 (its step
        unscales, and skips the step on every rank if any gradient overflowed)."""
        self._model_of(optimizer, "backward")
        (optimizer.scale(loss) if hasattr(optimizer, "scale") else loss).backward()

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion: Callable,
                         optimizer: torch.optim.Optimizer | None = None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """Forward and backward of the next batch of ``data_iter`` through the pipeline
        schedule, in the plugin's microbatches; then call ``optimizer.step()`` yourself.
        Without ``optimizer``, the schedule's forward only (evaluation: no backward, no
        gradient touched).

        ``criterion(outputs, inputs)`` runs on the last stage for each microbatch, with
        ``inputs`` the microbatch: every key of the batch (``labels``, masks, ...). For a
        Hugging Face model ``outputs`` is its output (``.logits``, and ``.loss`` — the
        model's own loss of the labels); for a model with declared blocks
        (``pipeline(blocks=...)``) it is what the model's forward returns. Returns
        ``{'loss': the loss averaged over microbatches and data ranks (on every rank),
        'outputs': the last stage's outputs (there; None elsewhere)}``, a Hugging Face
        model's in its own output (``outputs['logits']``; a sequence classifier's pooled)."""
        from ..transforms.pipeline._runtime import PipelinePart

        rt = runtime_or_none(model)
        part = rt.part(PipelinePart) if rt is not None else None
        if part is None:
            raise ConfigError(f"execute_pipeline: this model runs no pipeline ({self.plugin!r});"
                              f" call model(**batch), booster.backward(loss, optimizer)")
        if optimizer is not None:
            self._model_of(optimizer, "execute_pipeline")
        if not hasattr(data_iter, "__next__"):
            raise ConfigError(f"execute_pipeline(data_iter=...): got a "
                              f"{type(data_iter).__name__}, which is not an iterator; pass "
                              f"iter(dataloader) (or iter([batch])), as Colossal-AI takes it")
        batch = next(data_iter)
        loss_fn = self._criterion(model, criterion)
        if optimizer is None:
            loss, out = part.forward_only(rt, batch, loss_fn, return_outputs=return_outputs)
        else:
            scale = optimizer.loss_scale() if hasattr(optimizer, "loss_scale") else 1.0
            loss, out = part.forward_backward(rt, batch, loss_fn, return_outputs=return_outputs,
                                              scale=scale)
        # float64 holds the schedule's loss as it was summed (a Python float): a float64
        # model's loss keeps its digits, as one process's does
        return {"loss": torch.tensor(loss, dtype=torch.float64) if return_loss else None,
                "outputs": _hf_outputs(model, out) if return_outputs else None}

    def _criterion(self, model: nn.Module, criterion: Callable) -> Callable:
        """``criterion(outputs, inputs)`` as the schedule's ``loss_fn(output, microbatch)``
        (one adapter per criterion: the schedule is built once per loss function). A
        Hugging Face model's logits are wrapped in its output with its own loss of the
        labels (the ids where the batch has none; a sequence classifier's pooled logits
        with its loss of the batch's labels, none without them); any other model's output
        is passed as its forward returned it."""
        key = (id(model), id(criterion))    # two models' adapters of one criterion differ
        if len(self._criteria) > 8:      # a new lambda each step: keep the latest few
            self._criteria.pop(next(iter(self._criteria)))
        if key not in self._criteria:
            if not _hugging_face(model):
                self._criteria[key] = criterion
                return criterion
            from transformers.modeling_outputs import CausalLMOutputWithPast

            from ..transforms.pipeline._stage import pools

            vocab = model.config.vocab_size
            if pools(model):
                self._criteria[key] = _classifier_criterion(model, criterion)
                return self._criteria[key]

            def loss_fn(logits, batch):
                from torch.distributed.tensor import DTensor

                labels = batch.get("labels", batch.get("input_ids"))
                if isinstance(logits, DTensor):
                    logits = logits.full_tensor()
                own = model.loss_function(logits=logits, labels=labels, vocab_size=vocab)
                return criterion(CausalLMOutputWithPast(loss=own, logits=logits),
                                 {**batch, "labels": labels})

            self._criteria[key] = loss_fn
        return self._criteria[key]

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer=None):
        """Backwards inside accumulate gradients without communicating; the first
        backward after it reduces the sums (meshlab.no_sync)."""
        from ..train.step import no_sync

        if model is None and optimizer is not None:
            model = self._model_of(optimizer, "no_sync")
        if model is None:
            raise ConfigError("booster.no_sync(model=...): pass the boosted model")
        with no_sync(model):
            yield

    def enable_lora(self, model: nn.Module, pretrained_dir: str | None = None,
                    lora_config=None, bnb_quantization_config=None, quantize: bool = False):
        """Mark ``model`` for LoRA: ``boost`` adds ``meshlab.lora(lora_config)`` after the
        plugin's ``shard`` and loads ``pretrained_dir``'s adapter into the sharded model.
        ``quantize=True`` (or a ``bnb_quantization_config``) holds the base's Linear layers
        but the head in 4 bits (``lora(config, quantize=...)``; Colossal-AI's defaults:
        nf4, double quantization, bf16 products), on the plugins that keep it replicated
        (TorchDDPPlugin, LowLevelZeroPlugin, HybridParallelPlugin without tensor or
        pipeline parallelism). Returns the model."""
        q = None
        if quantize or bnb_quantization_config is not None:
            q = self._quantize(quantize, bnb_quantization_config)
        if runtime_or_none(model) is not None:
            raise ConfigError("enable_lora: call it before boost (the adapters are part of "
                              "the plan boost runs)")
        if not self.plugin.support_lora():
            raise ConfigError(f"enable_lora: {self.plugin!r} does not run LoRA")
        if q is not None:
            from .lazy.lazy_init import pretrained_source

            if pretrained_source(model) is not None:
                raise ConfigError("enable_lora(quantize=True): this model's weights are read "
                                  "after boost (from_pretrained inside LazyInitContext), "
                                  "but the base is quantized from its values at boost; load "
                                  "it outside LazyInitContext (from_pretrained as usual)")
        if lora_config is None:
            if pretrained_dir is None:
                raise ConfigError("enable_lora: give lora_config (peft.LoraConfig) or "
                                  "pretrained_dir (a saved adapter)")
            from peft import LoraConfig

            lora_config = LoraConfig.from_pretrained(pretrained_dir)
        model._meshlab_booster_lora = _Lora(lora_config, pretrained_dir, q)
        return model

    def _quantize(self, quantize, config):
        """``enable_lora``'s quantization as a meshlab ``Quantize``: Colossal-AI's defaults
        for ``quantize=True``, else the configuration's fields; the plugins whose layouts
        split the base refuse it by name."""
        from ..core.errors import check_bool
        from ..transforms.lora._quant import Quantize, quantization
        from .plugin import (HybridParallelPlugin, LowLevelZeroPlugin, MoeHybridParallelPlugin,
                             TorchDDPPlugin)

        check_bool(quantize, "enable_lora", "quantize")
        if not isinstance(self.plugin, (TorchDDPPlugin, LowLevelZeroPlugin,
                                        HybridParallelPlugin)) or \
                isinstance(self.plugin, MoeHybridParallelPlugin):
            raise UnsupportedArgument(
                "enable_lora", "quantize", True, f"{type(self.plugin).__name__} shards or "
                f"moves the base, and a 4-bit base runs replicated and frozen",
                "TorchDDPPlugin() or LowLevelZeroPlugin() with quantize=True, or LoRA on a "
                "full-precision base (quantize=False)")
        q = Quantize() if config is None else quantization(config)
        from ..transforms.lora._quant import bnb_module

        bnb_module()
        return q

    def _optimizer_of(self, model: nn.Module):
        """The optimizer ``boost`` built for ``model`` (None if it built none)."""
        ref = self._optimizers.get(id(model))
        opt = ref() if ref is not None else None
        owner = self._owner.get(id(opt)) if opt is not None else None
        return opt if owner is not None and owner() is model else None

    def _model_of(self, optimizer, call: str) -> nn.Module:
        ref = self._owner.get(id(optimizer))
        model = ref() if ref is not None else None
        if model is None:
            raise ConfigError(f"booster.{call}: this optimizer was not returned by this "
                              f"booster's boost; use the one boost returned")
        return model

    # -- checkpoints ------------------------------------------------------------------
    from ._ckpt import (save_model, load_model, save_optimizer, load_optimizer,  # noqa: E402
                        save_lr_scheduler, load_lr_scheduler, save_lora_as_pretrained)

    def __repr__(self) -> str:
        return f"Booster(plugin={self.plugin!r})"


def _compose(parts: list):
    out = parts[0]
    for t in parts[1:]:
        out = out | t
    return out


def _stack_precision(st: Stack):
    from ..transforms import Precision, precision

    parts = getattr(st.spec, "parts", (st.spec,))
    have = next((t for t in parts if isinstance(t, Precision)), None)
    return have if have is not None else precision("fp32")


def _device(device):
    if device is None:
        return None
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu"):
        raise ConfigError(f"Booster(device={device!r}): 'cuda' or 'cpu' (the mesh's device); "
                          f"or leave it None")
    want = device.split(":")[0]
    have = "cuda" if torch.cuda.is_available() else "cpu"
    if want != have:
        raise ConfigError(f"Booster(device={device!r}): this machine's ranks run on {have}; "
                          f"leave device None")
    return want


def _microbatches(t, size: int, dataloader):
    """``pipeline(microbatches=...)`` from ``microbatch_size`` and the per-rank batch of
    ``dataloader``; without one, each batch is cut into microbatches of ``size`` rows as
    it comes (``pipeline(microbatch_size=...)``), as Colossal-AI's schedule does."""
    bs = getattr(dataloader, "batch_size", None)
    if not isinstance(bs, int):
        return dataclasses.replace(t, microbatch_size=size)
    if bs % size:
        raise ConfigError(f"microbatch_size={size} does not divide the per-rank batch {bs}; "
                          f"use a divisor of {bs}")
    return dataclasses.replace(t, microbatches=bs // size)


def _buffer_broadcast(model: nn.Module) -> None:
    """Before each forward, every buffer from data-parallel rank 0 of this rank's group
    (DDP's ``broadcast_buffers``)."""
    rt = runtime_of(model)
    group = rt.dp_group
    if group is None or rt.dp_size == 1:
        return
    from torch.distributed.tensor import DTensor

    bufs = [b for b in model.buffers() if not isinstance(b, DTensor) and b.numel()]
    if not bufs:
        return
    src = dist.get_global_rank(group, 0)

    def hook(_module, _args):
        with torch.no_grad():
            for b in bufs:
                dist.broadcast(b, src=src, group=group)

    model.register_forward_pre_hook(hook)


def _hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose own loss and output the pipeline's
    criterion and outputs take (a config and a ``loss_function``)."""
    return getattr(model, "config", None) is not None and \
        callable(getattr(model, "loss_function", None))


def _hf_outputs(model: nn.Module, out):
    """The last stage's logits of the whole batch in a Hugging Face model's own output
    (``['logits']``, ``.logits``), as Colossal-AI hands them back; anything else as it is."""
    if not isinstance(out, torch.Tensor) or not _hugging_face(model):
        return out
    from transformers.modeling_outputs import (CausalLMOutputWithPast,
                                               SequenceClassifierOutputWithPast)

    from ..transforms.pipeline._stage import pools

    kind = SequenceClassifierOutputWithPast if pools(model) else CausalLMOutputWithPast
    return kind(logits=out)


def _classifier_criterion(model: nn.Module, criterion: Callable) -> Callable:
    """A sequence classifier's ``criterion`` on the last stage: its pooled logits (the
    stage pooled them as the model's forward does) in its own output, with the model's
    own loss of ``labels`` (regression, single- or multi-label by its config)."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    def loss_fn(logits, batch):
        labels = batch.get("labels")
        own = None if labels is None else model.loss_function(
            labels=labels, pooled_logits=logits, config=model.config)
        return criterion(SequenceClassifierOutputWithPast(loss=own, logits=logits), batch)

    return loss_fn
