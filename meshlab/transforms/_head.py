"""What the pipeline, ``shard`` and ``fuse('loss')`` tell each other about a model's output head.

A pipeline rank without the last stage holds stand-ins for the parts other stages run
(``elsewhere``): ``fuse('loss')`` leaves those be. A model whose head returns the causal-LM
loss (``fuse('loss')`` routed it) is marked so (``mark_fused_loss``): the step then takes
the fused loss's path on every rank, and a pipeline's last stage ends at the final norm,
handing its hidden states to that loss. A head ``shard`` splits over the vocabulary
(its hooks swap in this rank's rows for the forward) says so (``mark_vocab_split``): the
fused loss then takes the split loss over the tensor-parallel group. The rooms read the
marks through these functions.
"""

from __future__ import annotations

from torch import nn


class Elsewhere(nn.Module):
    """A stand-in for a part of the model another pipeline stage runs: called (the
    model's own forward run by hand), it says how a pipelined model is run."""

    _meshlab_elsewhere = True

    def forward(self, *args, **kwargs):
        from ..core.errors import ConfigError

        raise ConfigError("this model is split into pipeline stages and this rank holds "
                          "only its own: run it through its schedule, with "
                          "ml.step(model, opt, batch) (train=False to evaluate) or "
                          "booster.execute_pipeline(...), not model(...)")


def elsewhere() -> nn.Module:
    """A stand-in for a part of the model another pipeline stage runs."""
    return Elsewhere()


def is_elsewhere(module) -> bool:
    """Whether ``module`` stands in for a part another pipeline stage runs."""
    return getattr(module, "_meshlab_elsewhere", False)


def mark_fused_loss(model: nn.Module) -> None:
    """``model``'s head returns the causal-LM loss (where this rank holds it)."""
    model._meshlab_fused_loss = True


def fused_loss_of(model: nn.Module) -> bool:
    """Whether ``model``'s head returns the causal-LM loss (``fuse('loss')`` routed it)."""
    return getattr(model, "_meshlab_fused_loss", False)


def mark_vocab_split(head: nn.Module, group, start: int, vocab: int) -> None:
    """``head``'s forward runs on rows ``[start, ...)`` of a vocabulary of ``vocab`` split
    over ``group`` (``shard``'s vocabulary-parallel head)."""
    head._meshlab_vocab_split = (group, int(start), int(vocab))


def vocab_split_of(head: nn.Module):
    """``(group, start, vocab)`` of a head split over the vocabulary, or None."""
    return getattr(head, "_meshlab_vocab_split", None)


# Config attributes with which a Hugging Face model's forward transforms the logits after
# its head, each with the value at which it does nothing: the fused loss (which takes the
# hidden states and the head's weight) and a pipeline's last stage (which runs the head
# module) would skip them.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                    "output_multiplier_scale": 1.0}


def set_extras(config, table: dict) -> list[tuple[str, object]]:
    """The attributes of ``table`` (attribute -> neutral value) ``config`` sets to
    something else, with their values."""
    out = []
    for attr, neutral in table.items():
        v = getattr(config, attr, neutral)
        if v is not None and v != neutral:
            out.append((attr, v))
    return out
