"""Losses that accept vocab-sharded logits (the output of a tensor-parallel LM head), and
the checks of token ids and labels against the vocabulary that keep them exact."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..core import collectives as C
from ..core.agree import agree
from ..core.errors import BatchError, ConfigError
from ..core.sections import inside
from ..core.placement import dim_block
from ..core.tensors import local as _local


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Softmax in at least float32 (bf16/fp16 logits are upcast; float64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cross_entropy(logits, labels: torch.Tensor, ignore_index: int = -100,
                  num_items: int | torch.Tensor | None = None, *,
                  check: bool = True) -> torch.Tensor:
    """Mean token cross-entropy of ``logits`` (..., V) against ``labels`` (...).

    ``logits`` may be a DTensor sharded over the vocabulary (``Shard(-1)``, uneven
    allowed): then the softmax is computed in parallel (a max, a sum-exp and a target
    all-reduce over the tensor-parallel group) and the full logits never exist.
    ``num_items`` divides the summed loss instead of the count of labelled tokens
    (transformers' ``num_items_in_batch``, for gradient accumulation).

    Labels outside ``[0, V)`` other than ``ignore_index`` raise ``BatchError`` (one
    process raises ``IndexError``; the parallel softmax would read them as a zero logit)
    before any collective: on sharded logits always, on the logits of a parallelized model
    on every rank together (see ``VocabGuard``). ``check=False`` skips it, for a caller
    that checked the labels itself.
    """
    from torch.distributed.tensor import DTensor, Shard

    if check:
        _check_labels(logits, labels, ignore_index)
    if isinstance(logits, DTensor) and (len(logits.placements) != 1 or
                                        logits.placements[0] != Shard(logits.ndim - 1)):
        logits = logits.full_tensor()
    if not isinstance(logits, DTensor):
        y = labels.flatten().to(logits.device)
        total = F.cross_entropy(_wide(logits.flatten(0, -2)), y, ignore_index=ignore_index,
                                reduction="sum")
        return total / _count(y, ignore_index, num_items)
    import torch.distributed as dist

    mesh = logits.device_mesh
    group = mesh.get_group()
    n, r = mesh.size(), mesh.get_local_rank()
    vocab = logits.shape[-1]
    lo, cnt = dim_block(vocab, [n], [r])
    local = _wide(logits.to_local().flatten(0, -2))          # (N, V/n)
    y = labels.flatten()
    valid = y != ignore_index
    with torch.no_grad():
        m = local.max(dim=-1).values if cnt else local.new_full((local.shape[0],), -torch.inf)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sumexp = C.reduce_from_region(torch.exp(local - m.unsqueeze(-1)).sum(-1), group)
    mine = (y >= lo) & (y < lo + cnt) & valid
    idx = (y - lo).clamp(0, max(cnt - 1, 0)).unsqueeze(-1)
    tgt = local.gather(-1, idx).squeeze(-1) * mine if cnt else local.new_zeros(y.shape)
    tgt = C.reduce_from_region(tgt, group)
    per_tok = torch.log(sumexp) + m - tgt
    return (per_tok * valid).sum() / _count(y, ignore_index, num_items)


def _check_labels(logits, labels: torch.Tensor, ignore_index: int) -> None:
    """``cross_entropy``'s check of ``labels`` against the vocabulary of ``logits``. Plain
    logits of no parallelized model are left to ``F.cross_entropy``, which raises itself."""
    from torch.distributed.tensor import DTensor

    guard = guard_of(logits)
    if guard is not None or isinstance(logits, DTensor):
        check_labels(guard, labels, logits.shape[-1], "the logits given to cross_entropy",
                     ignore_index)


def check_labels(guard: "VocabGuard | None", labels: torch.Tensor, vocab: int, where: str,
                 ignore_index: int) -> None:
    """Labels read by a loss over a vocabulary split across ranks (where one outside
    ``[0, vocab)`` would read as a zero logit): through ``guard``, the vocabulary guard of
    the parallelized forward computing the loss, else on this rank alone."""
    item = ("labels", labels, vocab, where, ignore_index)
    if guard is not None:
        # Whether the ranks exchange their outcome must not depend on this rank's tensors:
        # labels that are the checked ids (``labels=x``) skip the check, a copy of them
        # does not, and one rank agreeing while another goes on would hang both. Inside a
        # collective section (``step``, a parallelized training forward) an error raised
        # here reaches every rank at the section's end; outside one, every rank agrees
        # (those whose labels were checked already with nothing to report).
        covered = guard.covers(labels, vocab, ignore_index)
        guard.check("loss", [] if covered else [item], local=inside())
        return
    rng = value_range(labels, ignore_index)
    err = None if rng is None else vocab_error(*item[:1], rng, *item[2:])
    if err is not None:
        raise err


def _count(y: torch.Tensor, ignore_index: int, num_items):
    if num_items is not None:
        return num_items.to(y.device) if isinstance(num_items, torch.Tensor) else num_items
    return (y != ignore_index).sum().clamp(min=1)


def causal_lm_loss(output, batch) -> torch.Tensor:
    """Next-token loss: ``output.logits`` (B, S, V) against ``batch['labels']`` shifted by
    one (or ``input_ids`` when there are no labels); -100 is ignored."""
    logits = output.logits if hasattr(output, "logits") else output
    labels = batch["labels"] if "labels" in batch else batch["input_ids"]
    if isinstance(labels, torch.Tensor) and isinstance(logits, torch.Tensor):
        key = "labels" if "labels" in batch else "input_ids"
        err = _form_error({"labels": labels}, False)
        if err is None and tuple(labels.shape) != tuple(logits.shape[:2]):
            err = BatchError(
                f"batch[{key!r}] has shape {tuple(labels.shape)} and the logits "
                f"{tuple(logits.shape)}: the causal-LM loss reads one label per input "
                f"position, shape {tuple(logits.shape[:2])} (it shifts them by one itself). "
                f"Pass labels of that shape, -100 where a position has none")
        if err is not None:
            raise err
    return cross_entropy(logits[:, :-1], labels[:, 1:])


def masked_lm_loss(output, batch) -> torch.Tensor:
    """Masked-LM loss: ``output.logits`` (B, S, V) against ``batch['labels']`` (-100 ignored)."""
    logits = output.logits if hasattr(output, "logits") else output
    return cross_entropy(logits, batch["labels"])


def hf_loss(kind: str):
    """transformers' ``loss_function`` for ``kind`` (``'ForCausalLM'``, ``'ForMaskedLM'``)
    on ``cross_entropy``, so ``model(input_ids=x, labels=x).loss`` reads vocab-sharded
    logits; the same arguments and results as transformers' own (plus ``check``, passed to
    ``cross_entropy``)."""
    def causal(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
               shift_labels=None, check=True, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return cross_entropy(logits, shift_labels, ignore_index, num_items_in_batch,
                             check=check)

    def masked(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
               check=True, **kwargs):
        return cross_entropy(logits, labels, ignore_index, num_items_in_batch, check=check)

    return {"ForCausalLM": causal, "ForConditionalGeneration": causal,
            "ForMaskedLM": masked}.get(kind)


# -- token ids and labels against the vocabulary ------------------------------------------
# A vocabulary-split embedding looks an id outside this rank's rows up as zeros, and the
# vocabulary-parallel loss reads a label no rank holds as a zero logit: an id or label
# outside the vocabulary trains silently where one process raises IndexError. The checks
# below cost a min and a max per tensor (one host transfer) and raise ``BatchError``.
_GUARD = "_meshlab_vocab_guard"      # the attribute a guarded model holds its guard in


def value_range(t: torch.Tensor, ignore_index: int | None = None) -> tuple[int, int] | None:
    """(min, max) of an integer tensor, entries equal to ``ignore_index`` left out of the
    min; None for an empty or non-integer tensor (nothing to check)."""
    t = _local(t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_floating_point() or \
            t.is_complex() or t.dtype == torch.bool:
        return None
    low = t if ignore_index is None else t.masked_fill(t == ignore_index, 0)
    lo, hi = torch.stack([low.min(), t.max()]).tolist()
    return int(lo), int(hi)


def vocab_error(key: str, rng: tuple[int, int], vocab: int, where: str,
                ignore_index: int | None = None) -> BatchError | None:
    """The error for values ``rng`` of ``key`` outside ``[0, vocab)`` (``ignore_index``
    allowed for labels), or None."""
    lo, hi = rng
    if lo >= 0 and hi < vocab:
        return None
    bad = hi if hi >= vocab else lo
    kind = "token id" if ignore_index is None else "label"
    allowed = f"0..{vocab - 1}" + ("" if ignore_index is None else
                                   f", or {ignore_index} for a position without a label")
    fix = (f"mark padded or unlabelled positions with {ignore_index}" if ignore_index is not
           None else "pad with an id inside it (such as the tokenizer's pad_token_id)")
    return BatchError(
        f"{key} holds the {kind} {bad}, outside the vocabulary of {vocab} ({allowed}) of "
        f"{where}: one process raises IndexError here, and a vocabulary-split embedding or "
        f"loss would read it silently as another value. Feed the model ids of a tokenizer "
        f"with its vocabulary (config.vocab_size) and {fix}")


def _elements_within(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether every element of ``x`` is an element of ``t``: ``x`` lies inside the memory
    of a contiguous ``t`` (a slice of it, such as ``t[:, 1:]``) and neither changed since."""
    if x.device != t.device or x.untyped_storage().data_ptr() != \
            t.untyped_storage().data_ptr() or x._version != t._version or not t.is_contiguous():
        return False
    if any(s < 0 for s in x.stride()) or x.numel() == 0:
        return False
    start = x.storage_offset()
    end = start + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return t.storage_offset() <= start and end < t.storage_offset() + t.numel()


class VocabGuard:
    """The vocabulary checks of one parallelized model (``guard_model`` installs them).

    ``group`` is the model's gloo control group. ``agreed``: whether the ranks must agree
    on a check's outcome. Ranks along data axes read different batches, so a bad value on
    one of them alone would leave it raising while the others wait in the next collective;
    there every rank exchanges its outcome (``meshlab.core.agree.agree``) and all raise
    together. Only forwards with grad enabled agree: a training forward is collective
    anyway (its backward reduces gradients over the data axes), while an evaluation under
    ``torch.no_grad()`` may run on one rank alone. Tensor-parallel peers read the same
    batch, so without data parallelism each rank raises on its own, all alike.
    """

    def __init__(self, group, agreed: bool) -> None:
        self.group, self.agreed = group, agreed
        self.named: list = []      # (key, tensor): the inputs of the forward running now
        self.checked: list = []    # (tensor, ignore_index, max): those found in range

    def begin(self, named: list) -> None:
        """A forward starts (the model's first pre-hook)."""
        self.named, self.checked = named, []

    def name_of(self, x: torch.Tensor) -> tuple[str | None, torch.Tensor | None]:
        """The forward's input that ``x`` is (key, tensor), or (None, None)."""
        x = _local(x)
        for key, t in self.named:
            t = _local(t)
            if x is t or (x.data_ptr() == t.data_ptr() and x.shape == t.shape and
                          x.stride() == t.stride() and x.device == t.device):
                return key, t
        return None, None

    def check(self, what: str, items: list, *, local: bool = False,
              error: BaseException | None = None) -> None:
        """Check ``(key, tensor, vocab, where, ignore_index)`` items; raise on every rank
        together (here alone when not ``agreed``, or ``local``) if one is out of range, or
        ``error`` (the batch's form) is given."""
        if error is not None:
            items = []
        for key, t, vocab, where, ignore in items:
            rng = value_range(t, ignore)
            if rng is None:
                continue
            err = vocab_error(key, rng, vocab, where, ignore)
            if err is None:
                self.checked.append((_local(t), ignore, rng[1]))
            error = error or err
        self.settle(what, error, local=local)

    def settle(self, what: str, error: BaseException | None, *, local: bool = False) -> None:
        if self.agreed and not local and torch.is_grad_enabled():
            agree(self.group, what, None, error)
        elif error is not None:
            raise error

    def covers(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> bool:
        """Whether ``labels`` hold only values this forward already found in range (the
        causal shift ``input_ids[:, 1:]`` of checked ids): the loss need not check again."""
        labels = _local(labels)
        return any(hi < vocab and ig in (None, ignore_index) and
                   (labels is t or _elements_within(labels, t)) for t, ig, hi in self.checked)


# The logits of each guarded forward, by the address of their storage: a loss finds the
# guard of the forward that made its logits through any view of them (views share the
# storage; a dispatch mode may hand out other tensor objects for them). A weak reference
# says whether the logits are still alive, so an address freed and reused is never taken
# for theirs.
_OUTPUTS: dict = {}


def _address(t: torch.Tensor) -> tuple:
    t = getattr(t, "_local_tensor", t)
    return t.device, t.untyped_storage().data_ptr()


def guard_of(x) -> VocabGuard | None:
    """The guard of the parallelized forward whose logits ``x`` is (or is a view of), as
    long as those logits are alive; else None."""
    if not isinstance(x, torch.Tensor):
        return None
    ref, guard = _OUTPUTS.get(_address(x), (None, None))
    return guard if ref is not None and ref() is not None else None


def mark(out, guard: VocabGuard | None) -> None:
    """Register a forward's logits (a tensor, ``out['logits']``, or the first tensor of a
    tuple) with ``guard``, for the loss computed from them."""
    if guard is None:
        return
    t = out
    if isinstance(out, (tuple, list)):
        t = next((o for o in out if isinstance(o, torch.Tensor)), None)
    elif not isinstance(out, torch.Tensor) and hasattr(out, "get"):
        t = out.get("logits")
    if not isinstance(t, torch.Tensor) or _address(t)[1] == 0:
        return
    for k in [k for k, (r, _) in _OUTPUTS.items() if r() is None]:
        del _OUTPUTS[k]
    _OUTPUTS[_address(t)] = (weakref.ref(t), guard)


def _vocab_module(model, getter: str):
    """(module, vocabulary size) of ``model.get_input_embeddings()`` or
    ``get_output_embeddings()`` (the Hugging Face convention), or None."""
    fn = getattr(model, getter, None)
    try:
        m = fn() if fn is not None else None
    except (NotImplementedError, AttributeError, TypeError):
        return None
    w = getattr(m, "weight", None)
    return (m, int(w.shape[0])) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _vocab_split(m, tp_axis: str | None) -> bool:
    """Whether embedding ``m`` holds its rows split over the tensor-parallel axis."""
    from torch.distributed.tensor import DTensor

    w = m._parameters.get("weight")
    if tp_axis is None or not isinstance(w, DTensor):
        return False
    names = w.device_mesh.mesh_dim_names or (tp_axis,) * len(w.placements)
    return any(p.is_shard() and getattr(p, "dim", None) == 0 and n == tp_axis
               for p, n in zip(w.placements, names))


def _positional_names(model) -> list[str]:
    import inspect

    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


# -- a user's own loss on split logits ---------------------------------------------------------
# The logits a vocabulary-parallel head returns are a DTensor split over the vocabulary.
# ``F.cross_entropy(out.logits, labels)`` on them, with plain labels, failed inside
# DTensor's dispatch ("got mixed torch.Tensor and DTensor"), after the log-softmax had
# gathered the logits. The forward hands them out as ``SplitLogits``: a DTensor whose
# torch functions (and those of every DTensor computed from it) are watched, so that a
# cross-entropy on them, or any operation mixing them with plain tensors, raises a
# ``ConfigError`` naming the fix, before its collectives.

_CE_FUNCS = {F.cross_entropy, F.nll_loss}
_FIX = ("compute the loss with meshlab.losses.cross_entropy(logits, labels) (or "
        "meshlab.losses.causal_lm_loss(out, batch)), which reads the split logits without "
        "gathering them; train with meshlab.step(model, opt, batch), which does so; or take "
        "the whole logits with logits.full_tensor() on every rank")


def _split_dtensor():
    from torch.distributed.tensor import DTensor

    class SplitLogits(DTensor):
        """Logits of a vocabulary-parallel head (a ``DTensor`` split over its last
        dimension) handed to the user: every operation runs as on a ``DTensor``, but a
        cross-entropy against plain labels, or any operation mixing them with plain
        tensors, raises ``ConfigError`` naming meshlab's loss for split logits."""

        __slots__ = ()

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _CE_FUNCS:
                _refuse_plain_loss(func, args, kwargs)
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
            except RuntimeError as e:
                if "mixed torch.Tensor and DTensor" not in str(e):
                    raise
                raise ConfigError(
                    f"{getattr(func, '__name__', func)}: the model's logits are a DTensor "
                    f"split over the vocabulary across the tensor-parallel ranks, and this "
                    f"operation mixes them with a plain tensor; {_FIX}") from None
            return _retag(out)

    return SplitLogits


_SPLIT_CLS: list = []


def split_logits_class():
    if not _SPLIT_CLS:
        _SPLIT_CLS.append(_split_dtensor())
    return _SPLIT_CLS[0]


def _refuse_plain_loss(func, args, kwargs) -> None:
    from torch.distributed.tensor import DTensor

    x = args[0] if args else kwargs.get("input")
    y = args[1] if len(args) > 1 else kwargs.get("target")
    if isinstance(x, DTensor) and isinstance(y, torch.Tensor) and not isinstance(y, DTensor):
        raise ConfigError(
            f"torch.nn.functional.{func.__name__}(logits, labels): the logits are a DTensor "
            f"of shape {tuple(x.shape)} split over the vocabulary ({tuple(x.placements)}) "
            f"across the tensor-parallel ranks and the labels a plain tensor, which "
            f"{func.__name__} cannot read; {_FIX}")


def _retag(out):
    from torch.distributed.tensor import DTensor

    if type(out) is DTensor:
        out.__class__ = split_logits_class()
    elif isinstance(out, (tuple, list)):
        for o in out:
            if type(o) is DTensor:
                o.__class__ = split_logits_class()
    return out


def hand_out_split_logits(out) -> None:
    """Hand the logits of a forward (a tensor, ``out['logits']`` or the first tensor of a
    tuple) to the user as ``SplitLogits`` where they are a DTensor split over their last
    dimension."""
    from torch.distributed.tensor import DTensor, Shard

    t = out
    if isinstance(out, (tuple, list)):
        t = next((o for o in out if isinstance(o, torch.Tensor)), None)
    elif not isinstance(out, torch.Tensor) and hasattr(out, "get"):
        t = out.get("logits")
    if type(t) is DTensor and t.ndim and Shard(t.ndim - 1) in t.placements:
        t.__class__ = split_logits_class()


def guard_of_model(model) -> VocabGuard | None:
    """The vocabulary guard ``guard_model`` gave ``model``, or None."""
    return getattr(model, _GUARD, None)


def guard_model(model, group, *, agreed: bool, pipelined: bool, tp_axis: str | None) -> None:
    """Check every forward's token ids and labels against ``model``'s vocabulary.

    A model with ``get_input_embeddings()`` (every Hugging Face model) has ``input_ids``
    and ``labels=`` checked in a first pre-hook, before any collective of the forward
    (ZeRO-3's gathers, the embedding's reduction), agreed by every rank where ``agreed``.
    Other models have the ids reaching each vocabulary-split embedding (where they would
    be masked) checked there, on each rank alone: tensor-parallel peers raise alike, but a
    data-parallel peer reading good ids goes on to its next collective (defining
    ``get_input_embeddings`` gives such a model the agreed check). The losses check labels
    from the logits the model returns (``cross_entropy``). Under a pipeline the stages run
    the modules without the model's forward, so each split embedding checks its ids.
    """
    guard = VocabGuard(group, agreed and not pipelined)
    setattr(model, _GUARD, guard)
    names = {id(m): n for n, m in model.named_modules()}
    inp, out = _vocab_module(model, "get_input_embeddings"), \
        _vocab_module(model, "get_output_embeddings")
    root_ids = inp is not None and not pipelined
    positional = _positional_names(model)
    encdec = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))

    def where(m) -> str:
        return names.get(id(m)) or type(model).__name__

    def pre(mod, args, kwargs):
        named = [(k, v) for k, v in zip(positional, args) if isinstance(v, torch.Tensor)]
        named += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        guard.begin(named)
        given, items = dict(named), []
        if root_ids and given.get("input_ids") is not None:
            items.append(("input_ids", given["input_ids"], inp[1], where(inp[0]), None))
        if out is not None and given.get("labels") is not None:
            items.append(("labels", given["labels"], out[1], where(out[0]),
                          kwargs.get("ignore_index", -100)))
        error = _form_error(given, encdec, lm=out is not None) \
            if inp is not None and not pipelined else None
        if items or error is not None:
            guard.check("forward", items, error=error)

    def post(mod, args, kwargs, output):
        mark(output, guard)
        hand_out_split_logits(output)

    model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    model.register_forward_hook(post, with_kwargs=True)
    for fqn, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and _vocab_split(m, tp_axis) and \
                not (root_ids and m is inp[0]):
            m.register_forward_pre_hook(_embedding_check(guard, fqn, m.weight.shape[0]),
                                        prepend=True)


def _form_error(given: dict, encdec: bool, lm: bool = True) -> BatchError | None:
    """The error for a batch whose token ids or labels a language model cannot read by
    their form (dtype, dimensions, length), or None. One process raises a torch error
    deep inside the model there (an embedding's dtype check, a reshape of 0 elements, a
    size mismatch in attention or the loss); this names the key and the fix. Labels are
    read as token labels only where the model has a language-model head (``lm``): a
    classifier's labels are one per sequence, a regression's floats."""
    ids, labels, embeds = (given.get(k) for k in ("input_ids", "labels", "inputs_embeds"))
    lead = "input_ids" if ids is not None else "inputs_embeds"
    x = ids if ids is not None else embeds
    if ids is not None:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            return BatchError(
                f"input_ids is a {ids.dtype} tensor: token ids are integers (torch.long), "
                f"indices into the vocabulary. Pass the tokenizer's ids "
                f"(input_ids.long() if they were cast; a mask goes in attention_mask)")
        if ids.dim() != 2:
            fix = ("input_ids.unsqueeze(0) for one sequence" if ids.dim() == 1 else
                   "input_ids.reshape(-1, input_ids.shape[-1]) to fold the leading "
                   "dimensions into the batch" if ids.dim() > 2 else "a (batch, seq) tensor")
            return BatchError(
                f"input_ids has shape {tuple(ids.shape)}: a language model reads "
                f"(batch, seq) token ids, 2 dimensions, not {ids.dim()}. Pass {fix}")
    elif embeds is not None and embeds.dim() != 3:
        return BatchError(
            f"inputs_embeds has shape {tuple(embeds.shape)}: a language model reads "
            f"(batch, seq, hidden) embeddings, 3 dimensions, not {embeds.dim()}")
    if x is not None and x.dim() >= 2 and (x.shape[0] == 0 or x.shape[1] == 0):
        return BatchError(
            f"{lead} has shape {tuple(x.shape)}: an empty batch or empty sequences (no "
            f"token to read). Drop empty samples before batching, or pad each to at least "
            f"one token")
    if labels is not None and lm:
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            return BatchError(
                f"labels is a {labels.dtype} tensor: labels are integer token ids "
                f"(torch.long), -100 where a position has none. Pass labels.long(), or "
                f"input_ids.clone() for next-token training")
        if x is not None and not encdec and tuple(labels.shape) != tuple(x.shape[:2]):
            return BatchError(
                f"labels has shape {tuple(labels.shape)} and {lead} "
                f"{tuple(x.shape)}: a language model reads one label per input "
                f"position, shape {tuple(x.shape[:2])} (the model shifts them by one "
                f"itself). Pass labels of that shape, -100 where a position has none")
    return None


def _embedding_check(guard: VocabGuard, fqn: str, vocab: int):
    def pre(mod, args):
        if not args or not isinstance(args[0], torch.Tensor):
            return
        key, _ = guard.name_of(args[0])
        guard.check(f"forward {fqn}", [(key or f"the ids given to {fqn}", args[0], vocab,
                                        fqn, None)], local=True)
    return pre
