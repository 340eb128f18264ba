"""The example step the estimates run: what the model is called with, and the loss.

The profile (``meshlab.estimate.profile``) runs one forward, loss and backward of the
model on fake tensors. A Hugging Face causal LM is called as the training step calls it,
``model(input_ids=ids, use_cache=False)``, and its loss is the causal-LM cross-entropy.
A model of your own says how it is called with an input builder, ``inputs(batch, seq)``,
run inside the profile's fake mode (the tensors it makes are fake, on the device the
profile runs on), which returns the forward's arguments:

* a tensor: ``model(x)``;
* a tuple: ``model(*args)``;
* a dict: ``model(**kwargs)``.

The loss is ``loss(output, args)`` where given; else the causal-LM loss where the output
is logits (``output.logits``, ``output['logits']``, or a tensor ``(batch, seq, vocab)``) over token ids among
the arguments (an integer ``(batch, seq)`` tensor: ``input_ids`` first), else the sum of
the output's floating tensors, which runs the backward through everything the forward
did: enough to count activation memory and time.

>>> step = example_step(model, inputs=lambda b, s: torch.randint(0, 96, (b, s)))  # doctest: +SKIP
>>> args = step.build(2, 16); loss = step.run(args)                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError

HINT = ("give the estimate an input builder, e.g. plan.memory(batch=, seq=, inputs=lambda "
        "batch, seq: torch.randint(0, vocab, (batch, seq))), returning the forward's "
        "arguments (a tensor, a tuple of positional arguments, or a dict of keyword "
        "arguments); the same inputs= goes to plan.time, plan.comm and meshlab.advise")


@dataclasses.dataclass(frozen=True)
class ExampleStep:
    """How the profile calls the model: ``build(batch, seq)`` makes the arguments (inside
    the fake mode, before anything is counted), ``run(args)`` the step's loss."""

    build: Callable[[int, int], Any]
    run: Callable[[Any], torch.Tensor]


def check_example(what: str, inputs, loss, batch) -> None:
    """``inputs`` and ``loss`` are callables (or None), given with a batch: the estimates
    that run the model are the ones that read them."""
    for name, fn in (("inputs", inputs), ("loss", loss)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{what}({name}={fn!r}): a function; inputs is (batch, seq) -> "
                              f"the forward's arguments, loss is (output, args) -> a scalar")
    if batch is None and (inputs is not None or loss is not None):
        raise ConfigError(f"{what}(inputs=, loss=): they describe the example step the "
                          f"activations are counted on; give batch= and seq= with them")


def example_step(model: nn.Module, inputs=None, loss=None, room_loss=None) -> ExampleStep:
    """The example step of ``model`` (module docstring); ``room_loss(forward, batch)`` is
    a room's own loss of a causal LM called with ``input_ids`` (``fuse('loss')``)."""
    if room_loss is not None and (inputs is not None or loss is not None):
        raise ConfigError("fuse('loss') computes the step's loss itself (the fused head and "
                          "cross-entropy of a model called with input_ids), so the estimate "
                          "takes neither inputs= nor loss= with it; leave them out, or leave "
                          "'loss' out of fuse()")
    if inputs is not None:
        return ExampleStep(lambda b, s: inputs(b, s),
                           lambda args: _loss(loss or default_loss, _call(model, args), args))
    if not _takes(model, "input_ids"):
        raise ConfigError(f"{type(model).__name__}.forward takes no input_ids, so the "
                          f"estimates cannot call it with token ids: {HINT}")
    cache = {"use_cache": False} if _takes(model, "use_cache") else {}
    if room_loss is not None:
        return ExampleStep(_token_batch,
                           lambda batch: room_loss(lambda **kw: model(**kw), batch))
    if loss is None:
        return ExampleStep(_token_batch, lambda batch: hf_loss(lambda **kw: model(**kw), batch,
                                                              cache))
    return ExampleStep(lambda b, s: {"input_ids": torch.zeros(b, s, dtype=torch.long)},
                       lambda args: _loss(loss, model(**args, **cache), args))


def _token_batch(batch: int, seq: int) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def hf_loss(forward, batch, cache=None):
    """The training step's default loss (``meshlab.transforms.losses.causal_lm_loss``) of
    a causal LM called with ``input_ids``."""
    from ..transforms.losses import cross_entropy

    out = forward(input_ids=batch["input_ids"], **({"use_cache": False} if cache is None
                                                    else cache))
    logits = out.logits if hasattr(out, "logits") else out
    return cross_entropy(logits[:, :-1], batch["labels"][:, 1:], check=False)


def default_loss(output, args) -> torch.Tensor:
    """The causal-LM loss of logits over the token ids among ``args``, else the sum of the
    output (module docstring)."""
    from ..transforms.losses import cross_entropy

    logits = output.get("logits") if isinstance(output, dict) else \
        getattr(output, "logits", output)
    ids = _token_ids(args)
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and ids is not None \
            and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape):
        return cross_entropy(logits[:, :-1], ids[:, 1:], check=False)
    parts = [t.float().sum() for t in pytree.tree_leaves(_plain(output))
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ConfigError(f"the model's output ({type(output).__name__}) holds no floating "
                          f"tensor that needs a gradient, so the default loss (its sum) has "
                          f"no backward; give the estimate loss=lambda output, args: ...")
    return sum(parts[1:], parts[0])


def _plain(output):
    """Model outputs as a pytree: a ``ModelOutput`` (a dict) or a dataclass as its values."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [getattr(output, f.name) for f in dataclasses.fields(output)]
    return output


def _token_ids(args) -> torch.Tensor | None:
    """The integer ``(batch, seq)`` tensor among the forward's arguments (``input_ids``
    first), or None."""
    if isinstance(args, dict) and _is_ids(args.get("input_ids")):
        return args["input_ids"]
    return next((t for t in pytree.tree_leaves(args) if _is_ids(t)), None)


def _is_ids(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() \
        and not t.is_complex() and t.dtype != torch.bool


def _call(model: nn.Module, args):
    """``model`` called with what an input builder returned."""
    if isinstance(args, torch.Tensor):
        return model(args)
    if isinstance(args, tuple):
        return model(*args)
    if isinstance(args, dict):
        return model(**args)
    raise ConfigError(f"inputs= returned a {type(args).__name__}; return the forward's "
                      f"arguments: a tensor, a tuple of positional arguments or a dict of "
                      f"keyword arguments")


def _loss(fn, output, args) -> torch.Tensor:
    out = fn(output, args)
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) \
            else f"a {type(out).__name__}"
        raise ConfigError(f"loss= returned {got}; return the step's loss, a scalar tensor")
    return out


def _takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` accepts the keyword ``name`` (or any keyword)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):       # a builtin forward: no signature to read
        return False
    return any(p.name == name and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD
               for p in params)
