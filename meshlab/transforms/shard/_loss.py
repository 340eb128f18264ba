"""The model's own loss under a vocabulary-parallel head.

A tensor-parallel head leaves the logits sharded over the vocabulary (a DTensor), which
transformers' losses cannot read. ``model(input_ids=x, labels=y).loss`` must still be
the single-process loss: the labels are taken out of the call (so the model computes no
loss of its own, whether through ``loss_function`` or a ``CrossEntropyLoss`` in its
``forward``), and the loss of the model's kind (``loss_type``: causal or masked LM) is
computed from the sharded logits by ``meshlab.transforms.losses.hf_loss`` and set on the output
(for an encoder-decoder model: the labels unshifted, the decoder inputs built from them
where the call gives none), with the router's load-balancing loss added as a mixture of
experts' forward adds it (``router_aux_loss_coef * aux_loss``).
The labels are checked against the vocabulary once per forward: by the parallelized
model's first pre-hook (``meshlab.transforms.losses.guard_model``) where it ran, else by the loss.
"""

from __future__ import annotations

from torch import nn

from ...core.errors import ConfigError
from ..losses import guard_of_model, hf_loss, mark

_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def install_loss(model: nn.Module) -> None:
    """Route ``labels=`` of ``model``'s forward to the vocabulary-parallel loss."""
    # transformers reads a missing or unknown loss_type as the causal-LM loss (GPT-2's)
    kind = getattr(model, "loss_type", None) or "ForCausalLM"
    # an encoder-decoder model's labels are aligned with its logits (no shift)
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    fn = hf_loss("ForMaskedLM" if seq2seq else kind)
    state: dict = {}

    def pre(mod, args, kwargs):
        labels = kwargs.pop("labels", None)
        if labels is None:
            return None
        if fn is None:
            raise ConfigError(
                f"{type(mod).__name__}(labels=...): the head is split over the vocabulary and "
                f"meshlab computes only causal- and masked-LM losses from split logits (this "
                f"model's loss_type is {kind!r}); compute the loss from out.logits with "
                f"meshlab.transforms.losses.cross_entropy, or replicate the head (spec P())")
        if seq2seq:
            _decoder_inputs(mod, labels, args, kwargs)
        state["labels"] = labels
        state["kw"] = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
        return args, kwargs

    def post(mod, args, kwargs, out):
        labels = state.pop("labels", None)
        if labels is None:
            return out
        kw = state.pop("kw")
        logits = out[0] if isinstance(out, tuple) else out["logits"]   # tuple: return_dict=False
        guard = guard_of_model(mod)
        mark(logits, guard)       # a check the loss makes is agreed as the forward's
        kw["check"] = guard is None or "shift_labels" in kw or not guard.covers(
            labels, logits.shape[-1], kw.get("ignore_index", -100))
        coef = getattr(mod, "router_aux_loss_coef", None)
        if isinstance(out, tuple):
            if coef and _router_logits(mod, kwargs):
                raise ConfigError(
                    f"{type(mod).__name__}(labels=..., return_dict=False, "
                    f"output_router_logits=True): the loss of a vocabulary-parallel head is "
                    f"meshlab's, and it adds the router's load-balancing loss to it from the "
                    f"output's aux_loss, which a tuple does not name; call it with "
                    f"return_dict=True")
            return (fn(logits, labels, **kw),) + out
        loss = fn(logits, labels, **kw)
        aux = out.get("aux_loss") if hasattr(out, "get") else None
        if aux is not None and coef:
            # what the family's forward adds to its own loss (a mixture of experts' router
            # load-balancing term), which taking the labels out of the call left out
            loss = loss + coef * aux.to(loss.device)
        out["loss"] = loss
        if hasattr(out, "move_to_end"):
            # the output had no loss, so setting it appended it last; transformers' own
            # output holds it first, where out[0] and out.to_tuple()[0] read it
            out.move_to_end("loss", last=False)
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


def _router_logits(mod: nn.Module, kwargs: dict) -> bool:
    """Whether this call returns the router's logits (and so its load-balancing loss)."""
    v = kwargs.get("output_router_logits")
    return bool(v if v is not None else
                getattr(getattr(mod, "config", None), "output_router_logits", False))


def _decoder_inputs(mod: nn.Module, labels, args, kwargs: dict) -> None:
    """An encoder-decoder model given labels and no decoder inputs builds them from the
    labels; with the labels taken out of the call, they are built here the model's own
    way (``prepare_decoder_input_ids_from_labels``), or the call is refused."""
    import inspect

    names = list(inspect.signature(mod.forward).parameters)[:len(args)]
    given = dict(zip(names, args)) | kwargs
    if given.get("decoder_input_ids") is not None or \
            given.get("decoder_inputs_embeds") is not None:
        return
    make = getattr(mod, "prepare_decoder_input_ids_from_labels", None)
    if make is None:
        raise ConfigError(
            f"{type(mod).__name__}(labels=...) without decoder_input_ids: the head is split "
            f"over the vocabulary, so meshlab takes the labels out of the call and the model "
            f"cannot build its decoder inputs from them. Pass decoder_input_ids (the labels "
            f"shifted right, starting with config.decoder_start_token_id)")
    kwargs["decoder_input_ids"] = make(labels=labels)


def install_generate(model: nn.Module, *, sequence_parallel: bool) -> None:
    """``model.generate`` (transformers' own) decodes from the whole logits: inside it the
    vocabulary-split head gathers them (``whole_logits``). Under sequence parallelism a
    decoding step's one token cannot be split over tp, so generate is refused there."""
    import functools

    from ._styles import whole_logits

    generate = getattr(model, "generate", None)
    if generate is None:
        return

    @functools.wraps(generate)
    def run(*args, **kwargs):
        if sequence_parallel:
            raise ConfigError(
                f"{type(model).__name__}.generate under sequence parallelism: each decoding "
                f"step feeds one token, which cannot be split over the tensor-parallel axis. "
                f"Generate with a plan without sequence parallelism (the same weights load "
                f"into it), or use meshlab.inference.InferenceEngine")
        with whole_logits():
            return generate(*args, **kwargs)
    model.generate = run
