"""Run a Hugging Face model's RMSNorm, rotary embedding, attention and loss on meshlab's ops.

No ``forward`` of the model is copied or rewritten; each op is routed at the seam
transformers already has, and every routing is proven on the spot against what it
replaces (a small random probe through the original and the fused path, compared to
float32 rounding) before it is installed, so a family whose module does something else
fails loudly instead of training on different math. Each op first finds (and probes) what
it would route without changing the model, then installs it: :func:`check` runs the
finding alone and raises what :func:`fuse` would, so ``meshlab.plan`` refuses it too:

* ``rms_norm``: each RMSNorm module (the class names in :data:`NORMS`, or any ``*RMSNorm``
  with ``weight`` and ``variance_epsilon``) gets an instance ``forward`` that calls
  ``meshlab::rms_norm`` with the module's own weight and epsilon. A pre-norm decoder
  layer (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``: Llama's,
  Mistral's, Qwen's, ...) whose class passes a probe of its whole forward also gets an
  instance ``forward`` that runs its middle residual add and the norm after it as one
  ``meshlab::add_rms_norm``, adds the residual stream's gradient inside the first norm's
  backward and sums the query/key/value products' input gradient inside them (``_residual``;
  reported as ``residual_add``, classes left as they are, and why, in
  ``FuseReport.unfused``).
* ``rotary`` (``_rotary``): the modeling file's ``apply_rotary_pos_emb`` is wrapped once
  by a dispatcher that calls ``meshlab::rotary`` while a routed model's attention module
  is running and the original function otherwise, so other models in the process are
  untouched.
* ``attention``: ``meshlab::attention`` is registered in transformers'
  ``AttentionInterface`` as ``"meshlab"`` and the model switched to it.
* ``mlp``: each gated MLP with ``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU
  ``act_fn`` (Llama's, Mistral's, Qwen's, ...) or a tanh-GELU one (Gemma's) gets an
  instance ``forward`` computing ``down_proj(meshlab::swiglu(gate_proj(x), up_proj(x)))``
  (``meshlab::geglu`` for GELU), the gate one kernel; one with a single ``gate_up_proj``
  (Phi-3's, GLM's) gates the two halves of its output in place. Where the
  three projections are bare ``nn.Linear`` (no bias, hooks or subclass; plain weights, no
  autocast, no saved-tensor hooks such as eager checkpointing's) the whole MLP
  is :func:`meshlab.ops.swiglu_mlp`: the backward keeps the gate and up projections'
  outputs only and rebuilds their product in its swiglu pass
  (2 x intermediate values per token, where the module with the fused gate keeps 3 and
  the unfused module 4). Otherwise the projections stay the module's own, hooks and
  sharding included, and the product is kept.
* ``loss``: the output head gets an instance ``forward`` that, inside
  :func:`fused_labels`, returns the causal-LM loss from ``meshlab::linear_cross_entropy``
  (the logits never exist), and the plain projection otherwise. :func:`causal_lm_loss`
  runs the model that way; ``meshlab.step`` does it for a model routed here.

>>> import torch, transformers
>>> from meshlab.transforms.fuse import fuse_model as fuse
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...                                num_hidden_layers=1, num_attention_heads=4)
>>> model = transformers.LlamaForCausalLM(cfg)
>>> fuse(model, ops=("rms_norm", "loss")).counts()
{'rms_norm': 3, 'loss': 1, 'residual_add': 1}
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import types

import torch
from torch import Tensor, nn

from ...core.errors import ConfigError
from .._head import (LOGIT_TRANSFORMS, fused_loss_of as fused_loss_of, is_elsewhere,
                     mark_fused_loss, set_extras, vocab_split_of)
from ._residual import (_bare_linear, _is_dtensor, in_float32, norm_eps, norm_rule, probe_close,
                        route_layers, set_norm_rule)
from ._rotary import _find_rotary, _route_rotary

FUSABLE = ("rms_norm", "rotary", "attention", "mlp", "loss")


@dataclasses.dataclass(frozen=True)
class Norm:
    """How an RMSNorm class maps onto ``meshlab::rms_norm``: the attribute holding epsilon,
    and ``offset`` added to the weight (Gemma scales by ``1 + weight``)."""

    eps: str = "variance_epsilon"
    offset: float = 0.0


# Classes whose RMSNorm differs from Llama's attribute names or math. Others named
# ``*RMSNorm`` with ``weight`` and ``variance_epsilon`` take the default; all are probed.
NORMS: dict[str, Norm] = {
    "GemmaRMSNorm": Norm("eps", 1.0),
    "Gemma2RMSNorm": Norm("eps", 1.0),
    "Gemma3RMSNorm": Norm("eps", 1.0),
    "T5LayerNorm": Norm("variance_epsilon"),
}



@dataclasses.dataclass
class FuseReport:
    """Which modules (FQNs) or functions were routed to which op."""

    routed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    unfused: dict[str, str] = dataclasses.field(default_factory=dict)   # class -> why

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.routed.items()}

    def __repr__(self) -> str:
        extra = f", unfused={self.unfused}" if self.unfused else ""
        return f"FuseReport({self.counts()}{extra})"


# ------------------------------------------------------------------------ rms_norm

def _norm_rule(m: nn.Module) -> Norm | None:
    name = type(m).__name__
    if name in NORMS:
        return NORMS[name]
    w = getattr(m, "weight", None)
    if name.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.ndim == 1 and \
            hasattr(m, "variance_epsilon"):
        return Norm()
    return None


def _fused_norm_forward(self, hidden_states: Tensor) -> Tensor:
    from ...ops.rms_norm import rms_norm

    rule: Norm = norm_rule(self)
    w = self.weight
    if rule.offset:
        w = w.float() + rule.offset
    return rms_norm(hidden_states, w, norm_eps(self))


@in_float32
def _probe_norm(m: nn.Module, rule: Norm) -> None:
    # A CPU float32 copy with a random weight (the module itself may be on meta or sharded),
    # seeded: the same probe, and the same refusal, wherever it runs.
    clone = copy.deepcopy(m)
    h = m.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    clone.weight = nn.Parameter(torch.randn(h, generator=g) * 0.1 +
                                (0.0 if rule.offset else 1.0))
    x = torch.randn(3, h, generator=g)
    want = type(m).forward(clone, x)
    set_norm_rule(clone, rule)
    got = _fused_norm_forward(clone, x)
    probe_close(got, want, type(m).__name__, "leave 'rms_norm' out of fuse(ops=...) "
                 "or add the class to meshlab.transforms.fuse.NORMS with its epsilon attribute")


def _find_norms(model: nn.Module) -> list[tuple[str, nn.Module, Norm | None]]:
    """``(name, module, rule)`` of each RMSNorm, the rule None where it was routed before;
    each class not routed before is probed once."""
    found, probed = [], set()
    for name, m in model.named_modules():
        rule = _norm_rule(m)
        if rule is None:
            continue
        if norm_rule(m) is not None:                           # routed before
            found.append((name, m, None))
            continue
        if type(m) not in probed:
            _probe_norm(m, rule)
            probed.add(type(m))
        found.append((name, m, rule))
    return found


def _route_norms(model: nn.Module, found) -> list[str]:
    for _, m, rule in found:
        if rule is not None:
            set_norm_rule(m, rule)
            m.forward = types.MethodType(_fused_norm_forward, m)
    return [name for name, _, _ in found]


# ------------------------------------------------------------------------ mlp

_SILU = ("SiLU", "SiLUActivation")
# GELU with the tanh approximation, as transformers' activations name it (probed like all).
_GELU_TANH = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")


def _has(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Module) for a in names)


def _gate_kind(m: nn.Module) -> str | None:
    """``"swiglu"`` or ``"geglu"`` for a gated MLP, else None: ``gate_proj``, ``up_proj``,
    ``down_proj`` and a SiLU or tanh-GELU ``act_fn`` (Llama's, Gemma's layout), or one
    ``gate_up_proj`` whose output's halves are the gate and the up projection, ``down_proj``
    and ``activation_fn`` (Phi-3's, GLM's)."""
    if _has(m, "gate_proj", "up_proj", "down_proj"):
        act = type(getattr(m, "act_fn", None)).__name__
    elif _has(m, "gate_up_proj", "down_proj"):
        act = type(getattr(m, "activation_fn", None)).__name__
    else:
        return None
    return "swiglu" if act in _SILU else "geglu" if act in _GELU_TANH else None


def _saved_tensors_hooked() -> bool:
    """Saved-tensor hooks decide what autograd keeps (checkpointing, activation offload):
    there the function's smaller set buys nothing, and under torch's checkpoint it measured
    slower than the module's own calls (17.1 ms against 15.8 for a Llama-3-8B MLP's
    forward, recompute and backward on an H200)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _fused_mlp_forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """A routed gated MLP's output for ``x``, plus ``residual`` where given (a decoder
    layer's residual stream: the fused layer's last add, taken inside the down product
    where ``meshlab.ops.swiglu_mlp`` runs, else after the MLP as the layer adds it)."""
    from ...ops.swiglu import geglu, geglu_mlp, swiglu, swiglu_mlp

    gate, mlp = (swiglu, swiglu_mlp) if _gate_kind(self) == "swiglu" else (geglu, geglu_mlp)
    if not hasattr(self, "gate_proj"):     # one gate_up_proj: its halves, read in place
        a, b = self.gate_up_proj(x).chunk(2, -1)
        out = self.down_proj(gate(a, b))
        return out if residual is None else residual + out
    projs = (self.gate_proj, self.up_proj, self.down_proj)
    # Compiled, the function traces as one (its backward keeps what it keeps eagerly);
    # saved-tensor hooks are then the compiler's, not read from here.
    if not _is_dtensor(x) and not torch.is_autocast_enabled(x.device.type) and \
            (torch.compiler.is_compiling() or not _saved_tensors_hooked()) and \
            all(_bare_linear(m, x.dtype) for m in projs) and \
            (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                  and not _is_dtensor(residual))):
        return mlp(x, *(m.weight for m in projs), residual=residual)
    a, b = self.gate_proj(x), self.up_proj(x)
    if a.dtype != b.dtype:                 # autocast leaves both in its dtype; be exact
        b = b.to(a.dtype)
    out = self.down_proj(gate(a, b))
    return out if residual is None else residual + out


_fused_mlp_forward.takes_residual = True    # (read by the fused layer forward, _residual)


@in_float32
def _probe_mlp(m: nn.Module) -> None:
    """The class built small (its config with hidden 8, intermediate 16) computes what the
    fused forward computes on the same weights."""
    cfg = getattr(m, "config", None)
    what = type(m).__name__
    fix = "leave 'mlp' out of fuse(ops=...)"
    if cfg is None:
        raise ConfigError(f"{what}: a gated MLP without a config to build a probe from; {fix}")
    small = copy.deepcopy(cfg)
    for attr, v in (("hidden_size", 8), ("intermediate_size", 16)):
        if hasattr(small, attr):
            setattr(small, attr, v)
    try:
        with torch.device("cpu"):
            clone = type(m)(small).float()
    except Exception as e:
        raise ConfigError(f"{what}: cannot build a small copy to probe the fused MLP against "
                          f"({type(e).__name__}: {e}); {fix}") from None
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in clone.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(3, clone.down_proj.out_features, generator=g)
    probe_close(_fused_mlp_forward(clone, x), type(m).forward(clone, x), what, fix)


def _find_mlp(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each gated MLP (or one routed before); each class not routed
    before is probed once."""
    found, probed = [], set()
    for name, m in model.named_modules():
        routed = getattr(m, "_meshlab_mlp", False)
        if not routed and _gate_kind(m) is None:
            continue
        if not routed and type(m) not in probed:
            _probe_mlp(m)
            probed.add(type(m))
        found.append((name, m))
    return found


def _route_mlp(model: nn.Module, found) -> list[str]:
    for _, m in found:
        if not getattr(m, "_meshlab_mlp", False):
            m.forward = types.MethodType(_fused_mlp_forward, m)
            m._meshlab_mlp = True
    return [name for name, _ in found]


# ------------------------------------------------------------------------ loss

_LABELS = threading.local()


@contextlib.contextmanager
def fused_labels(labels: Tensor, ignore_index: int = -100, guard=None):
    """Inside this block a routed output head returns the causal-LM loss of ``labels``
    (B, S), next-token shifted, instead of logits. ``guard``: the vocabulary guard of the
    parallelized model whose forward runs inside (``losses.guard_of_model``), which checks
    the labels of a head split over the vocabulary."""
    prev = getattr(_LABELS, "value", None)
    _LABELS.value = (labels, ignore_index, guard)
    try:
        yield
    finally:
        _LABELS.value = prev


def _fused_head_forward(self, hidden_states: Tensor) -> Tensor:
    ctx = getattr(_LABELS, "value", None)
    if ctx is None:
        return self._meshlab_linear_forward(hidden_states)
    from ...ops.linear_cross_entropy import linear_cross_entropy

    labels, ignore_index, guard = ctx
    hidden_states, w, split = _split_head(self, hidden_states)
    dev = hidden_states.device.type
    if torch.is_autocast_enabled(dev):
        # What autocast does to the head's matmul: both sides in the autocast dtype.
        dt = torch.get_autocast_dtype(dev)
        hidden_states, w = hidden_states.to(dt), w.to(dt)
    if hidden_states.shape[:2] != labels.shape:
        raise ConfigError(f"fused loss: hidden states {tuple(hidden_states.shape)} do not match "
                          f"labels {tuple(labels.shape)}; call the model with logits_to_keep=0")
    if split is None:
        return linear_cross_entropy(hidden_states[:, :-1], w, labels[:, 1:],
                                    ignore_index=ignore_index)
    from ...ops.linear_cross_entropy import linear_cross_entropy_split
    from ..losses import check_labels

    group, start, vocab = split
    target = labels[:, 1:].to(hidden_states.device)
    check_labels(guard, target, vocab, "the fused loss of the vocabulary-split head",
                 ignore_index)
    return linear_cross_entropy_split(hidden_states[:, :-1], w, target, start=start,
                                      vocab=vocab, group=group, ignore_index=ignore_index)


def _split_head(head: nn.Module, hidden: Tensor):
    """``(hidden, weight, split)`` for the fused loss: the head's rows as its forward sees
    them, and ``(group, start, vocab)`` where they are one rank's share of the vocabulary
    (``shard``'s head, in its regions or as a DTensor split on its rows), else None. A
    DTensor head is read locally: its rows, and the hidden states of every rank, whose
    gradient is then each rank's share of the sum (``Partial``)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w = head.weight
    split = vocab_split_of(head)
    if split is not None or not isinstance(w, DTensor) or \
            all(p.is_replicate() for p in w.placements):
        return hidden, w, split      # a replicated DTensor head: the op's sharding rule
    if w.device_mesh.ndim != 1 or w.placements[0] != Shard(0):
        raise ConfigError(f"fused loss: the output head's weight is laid out as "
                          f"{w.placements} over {w.device_mesh.ndim} mesh axes; the fused loss "
                          f"takes a head whole on each rank or split over its rows (the "
                          f"vocabulary) on one axis; leave 'loss' out of fuse()")
    if isinstance(hidden, DTensor):
        if not hidden.placements[0].is_replicate():
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()])
        hidden = hidden.to_local(grad_placements=(Partial(),))
    from ...core.placement import dim_block

    mesh = w.device_mesh
    start = dim_block(w.shape[0], [mesh.size()], [mesh.get_local_rank()])[0]
    return hidden, w.to_local(), (mesh.get_group(), start, w.shape[0])


def _find_loss(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(name, head)`` of the output head, refused where the fused loss would compute
    something else."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"fuse(ops=('loss',)): {type(model).__name__} has no nn.Linear "
                          f"output head (get_output_embeddings() is {type(head).__name__}); "
                          f"leave 'loss' out")
    if head.bias is not None:
        raise ConfigError(f"fuse(ops=('loss',)): {type(model).__name__}'s output head has a "
                          f"bias, which meshlab::linear_cross_entropy does not add; leave "
                          f"'loss' out")
    # the fused loss takes the hidden states and the head's weight: a transform of the
    # logits after the head would be skipped
    for attr, v in set_extras(getattr(model, "config", None), LOGIT_TRANSFORMS)[:1]:
        raise ConfigError(f"fuse(ops=('loss',)): {type(model).__name__} transforms its logits "
                          f"({attr}={v}) after the head, which the fused loss would skip; "
                          f"leave 'loss' out")
    return [(next(n for n, m in model.named_modules() if m is head), head)]


def _route_loss(model: nn.Module, found) -> list[str]:
    (name, head), = found
    if getattr(head, "_meshlab_linear_forward", None) is None:
        head._meshlab_linear_forward = head.forward
        head.forward = types.MethodType(_fused_head_forward, head)
    mark_fused_loss(model)
    return [name]


def head_loss(head: nn.Module, hidden_states: Tensor, labels: Tensor,
              ignore_index: int = -100) -> Tensor:
    """The causal-LM loss of ``labels`` through a routed output ``head`` on the final hidden
    states (after the last norm): what the head returns inside :func:`fused_labels`. A
    pipeline's last stage hands its hidden states to the loss this way, the head's weight
    taking its gradient from the loss's backward."""
    if getattr(head, "_meshlab_linear_forward", None) is None:
        raise ConfigError(f"{type(head).__name__} is not a fused output head; route it with "
                          f"fuse('loss') first")
    with fused_labels(labels, ignore_index):
        return head(hidden_states)


def causal_lm_loss(model: nn.Module, batch, ignore_index: int = -100, *,
                   with_output: bool = False):
    """Next-token loss of ``model`` on ``batch`` (``input_ids``, optional ``labels``,
    other model inputs) through the fused head: ``batch['labels']`` (or ``input_ids``)
    shifted by one, ``ignore_index`` not counted. Equal to meshlab.transforms.losses.causal_lm_loss
    of the unfused model's output. ``with_output``: ``(loss, the model's output)``, whose
    other fields (a router's ``aux_loss``) the caller reads. Under meshlab's attention, a
    padded batch whose loss would read a padding token's output (a label other than -100
    right after a token with ``attention_mask`` 0) raises ``ConfigError``, as in
    ``ml.step``."""
    labels = batch["labels"] if "labels" in batch else batch.get("input_ids")
    if not isinstance(labels, Tensor):
        raise ConfigError(f"causal_lm_loss: the batch has neither 'labels' nor 'input_ids' "
                          f"(keys {sorted(batch)}); pass the labels as batch['labels']")
    _check_padding(model, {**batch, "labels": labels})
    return step_loss(model, batch, labels, ignore_index, with_output)


def _check_padding(model: nn.Module, batch) -> None:
    """Under meshlab's attention, a padded batch whose loss would read a padding token's
    output is refused, as ``ml.step`` refuses it (``_packing.check_labels_after_padding``)."""
    from ...ops.attention import HF_NAME
    from .._packing import check_labels_after_padding, layout_of

    if "attention_mask" in batch and \
            getattr(getattr(model, "config", None), "_attn_implementation", None) == HF_NAME:
        check_labels_after_padding(batch, layout_of(batch), "causal_lm_loss",
                                   "leave 'attention' out of fuse_model(ops=...)")


def step_loss(model: nn.Module, batch, labels: Tensor, ignore_index: int = -100,
              with_output: bool = False):
    """:func:`causal_lm_loss` of a batch its caller checked (``ml.step``'s rooms)."""
    if not fused_loss_of(model):
        raise ConfigError(f"{type(model).__name__} has no fused loss; call "
                          f"meshlab.transforms.fuse.fuse_model(model, ops=('loss',)) first")
    from ..losses import guard_of_model

    with fused_labels(labels, ignore_index, guard_of_model(model)):
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    loss = out.logits if hasattr(out, "logits") else out
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        raise ConfigError(f"fused loss: {type(model).__name__}'s forward did not return the "
                          f"head's output as logits; leave 'loss' out of fuse(ops=...)")
    return (loss, out) if with_output else loss


# ------------------------------------------------------------------------ attention

# Config attributes that name an attention-probability dropout, by family (Llama-like,
# GPT-2, BERT, Falcon-like), each with the value at which it does nothing.
_ATTENTION_DROPOUT = dict.fromkeys(("attention_dropout", "attn_pdrop",
                                    "attention_probs_dropout_prob", "attn_dropout"), 0.0)


def _find_attention(model: nn.Module) -> list:
    """The model's ``set_attn_implementation``, refused where it has none; nothing to
    route where its attention drops probabilities out in training (meshlab's attention
    has no dropout: the model keeps its own)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise ConfigError(f"fuse(ops=('attention',)): {type(model).__name__} is not a "
                          f"transformers model with set_attn_implementation; leave "
                          f"'attention' out")
    for attr, v in set_extras(getattr(model, "config", None), _ATTENTION_DROPOUT)[:1]:
        raise NothingToRoute(f"fuse(ops=('attention',)): {type(model).__name__}'s attention "
                             f"drops probabilities out in training ({attr}={v}), which "
                             f"meshlab's fused attention does not; leave 'attention' out, "
                             f"or set {attr}=0.0")
    return [setter]


def _route_attention(model: nn.Module, found) -> list[str]:
    from ...ops._attention_hf import register_hf

    register_hf()
    found[0]("meshlab")
    return [f"config._attn_implementation={model.config._attn_implementation!r}"]


# Each op: what it finds (and probes) without changing the model, and how it installs
# what was found.
_ROUTES = {"rms_norm": (_find_norms, _route_norms), "rotary": (_find_rotary, _route_rotary),
           "attention": (_find_attention, _route_attention), "mlp": (_find_mlp, _route_mlp),
           "loss": (_find_loss, _route_loss)}


def _op_names(ops) -> tuple[str, ...]:
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    bad = [o for o in ops if o not in FUSABLE]
    if bad:
        raise ConfigError(f"fuse(ops={ops!r}): unknown {bad}; choose from {FUSABLE}")
    return ops


class NothingToRoute(ConfigError):
    """An op finds no module of the model to route, or none it computes as the model
    does (attention with dropout): ``fuse()`` leaves it out, an op named in ``fuse(...)``
    is refused."""


def _find(model: nn.Module, op: str) -> list:
    found = _ROUTES[op][0](model)
    if not found:
        raise NothingToRoute(f"fuse(ops=({op!r},)): nothing in {type(model).__name__} to "
                             f"route to meshlab::{op}; leave it out")
    return found


def check(model: nn.Module, ops=FUSABLE) -> None:
    """Raise the ``ConfigError`` that ``fuse(model, ops)`` would raise, changing nothing:
    each op finds its modules and probes them on small CPU copies, and nothing is
    installed (the global RNG is left as it was)."""
    ops = _op_names(ops)
    with torch.random.fork_rng(devices=()):
        for op in ops:
            _find(model, op)


def findings(model: nn.Module, ops=FUSABLE) -> tuple[dict[str, str], tuple[str, ...]]:
    """For each of ``ops`` that ``fuse`` would refuse on ``model``, its ``ConfigError``
    message (:func:`check`, one op at a time), and the ops among them that find nothing
    to route (``NothingToRoute``). Ops that route are left out, and so is one whose
    finding fails otherwise (a module that cannot run where it lies, on the meta device):
    installing it runs the same probe on the real module, and raises there."""
    out, absent = {}, []
    ops = _op_names(ops)
    with torch.random.fork_rng(devices=()):
        for op in ops:
            try:
                _find(model, op)
            except ConfigError as e:
                out[op] = str(e)
                if isinstance(e, NothingToRoute):
                    absent.append(op)
            except Exception:
                pass
    return out, tuple(absent)


def refusals(model: nn.Module, ops=FUSABLE) -> dict[str, str]:
    """:func:`findings`' messages alone."""
    return findings(model, ops)[0]


def fuse(model: nn.Module, ops=FUSABLE) -> FuseReport:
    """Route ``ops`` (a subset of :data:`FUSABLE`) of ``model`` to meshlab's fused ops.

    Mutates ``model`` in place (instance attributes and hooks only; the classes and other
    models are untouched) and returns what was routed. An op that finds nothing to route
    raises, as does one whose probe disagrees with the module it would replace; every op
    is found and probed (:func:`check`) before any is installed.
    """
    ops = _op_names(ops)
    get = getattr(model, "get_output_embeddings", None)
    if "loss" in ops and is_elsewhere(get() if get is not None else None):
        # a pipeline rank without the last stage: its head runs elsewhere, the loss is
        # still fused (every rank's step takes the fused loss's path)
        ops = tuple(op for op in ops if op != "loss")
        mark_fused_loss(model)
    found = {op: _find(model, op) for op in ops}
    report = FuseReport({op: _ROUTES[op][1](model, found[op]) for op in ops})
    if "rms_norm" in ops:
        layers, report.unfused = route_layers(model)
        if layers:
            report.routed["residual_add"] = layers
    return report
