"""What one training step of a model does, read from a shape-only run of one block.

``profile(model, plan, batch, seq)`` copies the model onto the meta device with its
repeated blocks cut to the first one, lets the plan's rooms change that copy as their
install would (``Transform.profile``: fused ops routed in, blocks checkpointed), and runs
forward, loss and backward under ``FakeTensorMode`` on fake CPU tensors (the attention
path the real run takes, no data, milliseconds at any size). It records:

* ``saved``: every storage the forward leaves alive for the backward (what autograd and
  checkpointing keep), with the module that made it, its op, dtype and shape;
* ``peak``: what is alive at the moment of the step's highest memory: the saved
  activations not yet freed, the backward's temporaries, and the gradients made so far;
* per part (the block, the rest), the matmul FLOPs, the bytes the other ops read and
  write, and the number of ops, for forward and backward.

Counting is by storage: views share their base's bytes, and parameters and buffers are
not activations. Modules are named as in the model; ``block`` is the one block profiled.
The rooms then scale these to a rank (``Transform.activation_memory``): tensor parallelism
splits what lives between a column- and a row-parallel linear, pipeline stages hold
their own blocks for each microbatch in flight, and so on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from typing import Any

import torch
from torch import nn

from ..core.units import dtype_name
from ..core.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Saved:
    """One storage alive at a moment of the step: the module that made it (``''`` for
    the model's top level), the op, dtype, shape and bytes; ``grad`` names the parameter
    whose gradient it is (else ``''``)."""

    module: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    grad: str = ""
    users: tuple[str, ...] = ()     # modules of the ops that read it in the forward
    role: str = ""                  # 'block_input' / 'block_output': the hidden states

    def in_block(self, block: str) -> bool:
        return self.module == block or self.module.startswith(block + ".")


@dataclasses.dataclass(frozen=True)
class Work:
    """One part's work in one direction: matmul FLOPs, bytes other ops move, op count,
    fused-attention FLOPs."""

    flops: int = 0
    bytes: int = 0
    ops: int = 0
    attn: int = 0          # FLOPs of fused attention (a rate of its own)
    attn_narrow: int = 0   # of which at head dim <= 64 (a slower rate)
    attn_kv: int = 0       # attention FLOPs over each call's kv length (per-row work that
    attn_kv_narrow: int = 0  # shorter sequences amortize worse); of which at head dim <= 64
    hooked: int = 0        # ops a Python dispatch mode sees (selective checkpointing's)
    fused: int = 0         # of ``ops``, calls of meshlab's fused ops (a host cost of their own)
    hooked_fused: int = 0  # of ``hooked``, fused ops
    replayed: int = 0      # of ``ops``, those replayed from CUDA graphs (no host cost each)
    graphs: int = 0        # CUDA graph replays (one host call each)

    def __add__(self, o: "Work") -> "Work":
        # Field by field by name: ``dataclasses.astuple`` deep-copies each value, and the
        # profile adds one Work per op it sees.
        return Work(*[getattr(self, f) + getattr(o, f) for f in _FIELDS])

    def scale(self, k: float, ops: float | None = None) -> "Work":
        """Work ``k`` times over (op counts ``ops`` times over, when given)."""
        o = k if ops is None else ops
        return Work(**{f.name: int(getattr(self, f.name) * (o if f.name in _COUNTS else k))
                       for f in dataclasses.fields(self)})


_COUNTS = ("ops", "hooked", "fused", "hooked_fused", "replayed", "graphs")  # op counts
_FIELDS = tuple(f.name for f in dataclasses.fields(Work))                  # in order


@dataclasses.dataclass(frozen=True)
class Profile:
    """A step of ``batch`` sequences of ``seq`` tokens through one block (module docstring)."""

    batch: int
    seq: int
    block: str
    saved: tuple[Saved, ...]
    peak: tuple[Saved, ...]
    work: dict          # (part, direction) -> Work; part 'block'|'rest' ('embed': of 'rest',
    #                     the input embeddings' share), direction 'fwd'|'bwd'
    hidden: tuple[int, ...] = ()    # the shape of the block's input (the hidden states)

    @property
    def width(self) -> int | None:
        """The hidden states' last dim, the width of the residual stream (None where the
        block's input is no tensor)."""
        return int(self.hidden[-1]) if self.hidden else None

    def saved_bytes(self, part: str | None = None) -> int:
        return sum(s.bytes for s in self._part(self.saved, part))

    def peak_bytes(self) -> int:
        return sum(s.bytes for s in self.peak)

    def _part(self, rows, part):
        if part is None:
            return rows
        inside = part == "block"
        return [s for s in rows if s.in_block(self.block) == inside]


# -------------------------------------------------------------------------- the copy

def _meta_copy(model: nn.Module, share: tuple[str, ...] = ()) -> nn.Module:
    """``model`` with every parameter and buffer on the meta device (nothing copied).
    The submodules named in ``share`` are not copied: the copy refers to the originals,
    for the caller to drop (``_one_block`` keeps only the first block)."""
    memo: dict[int, Any] = {}
    shared: set[int] = set()
    for mod in map(model.get_submodule, share):
        memo[id(mod)] = mod
        shared.update(id(t) for t in [*mod.parameters(), *mod.buffers()])
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in shared:
            continue
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else m
    return copy.deepcopy(model, memo)


def _one_block(model: nn.Module, blocks: tuple[str, ...]) -> str:
    """Keep only the first repeated block of ``model`` (in place); return its name."""
    if not blocks:
        raise PlanError(f"{type(model).__name__} has no repeated blocks to profile")
    parent_name, _, _ = blocks[0].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    first = model.get_submodule(blocks[0])
    if isinstance(parent, nn.ModuleList):
        parent_owner, _, attr = parent_name.rpartition(".")
        owner = model.get_submodule(parent_owner) if parent_owner else model
        setattr(owner, attr, nn.ModuleList([first]))
    else:
        raise PlanError(f"{type(model).__name__}: the blocks under {parent_name!r} are not an "
                        f"nn.ModuleList; the activation profile cannot cut them to one")
    cfg = getattr(model, "config", None)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if cfg is not None and isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, 1)
    return blocks[0]


# -------------------------------------------------------------------------- the run

class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an op makes (birth, death by weak reference), and each op's work."""

    def __init__(self, tracker, skip: set[int], fake: bool = True, count: bool | None = None):
        super().__init__()
        self.tracker = tracker
        self.skip = skip
        self.fake = fake            # a shape-only run: answer data questions
        self.count = fake if count is None else count      # count each op's work
        self.made: dict[int, list] = {}     # cdata -> [weakref, bytes, module, op, dtype, shape]
        self.t = 0
        self.phase = "fwd"
        self.work: dict = {}
        # The storages not yet seen freed, in the order they were made (a subset of
        # ``made``): a storage once freed stays freed, so each moment's scan for what is
        # alive looks only at these, dropping those it finds freed.
        self.alive: dict[int, int] = {}     # cdata -> bytes
        # The first moment with the most bytes alive: (t, its storages), and those bytes.
        self.peak: tuple[int, tuple[int, ...]] | None = None
        self.peak_bytes = 0

    def _module(self) -> str:
        names = [n for n in self.tracker.parents if n != "Global"]
        return max(names, key=len).split(".", 1)[1] if any("." in n for n in names) else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fake and func is torch.ops.aten._local_scalar_dense.default:
            # Data-dependent checks (``mask.all()``) see ordinary data: no padding.
            return True if args[0].dtype == torch.bool else 1
        out = func(*args, **(kwargs or {}))
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils.flop_counter import flop_registry

        mod = self._module()
        if self.count and self.phase == "fwd":
            for a in args:
                if isinstance(a, torch.Tensor):
                    v = self.made.get(a.untyped_storage()._cdata)
                    if v is not None and mod not in v[7]:
                        v[7].append(mod)
        outs = [_local(o) for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor)]
        new = 0
        for o in outs:
            st = o.untyped_storage()
            k = st._cdata
            if k not in self.made and k not in self.skip:
                self.made[k] = [StorageWeakRef(st), st.nbytes(), mod, str(func.overloadpacket
                                                                          .__name__),
                                dtype_name(o.dtype), tuple(o.shape), self.t, []]
                self.alive[k] = st.nbytes()
                new += st.nbytes()
        if not self.count:
            return out
        packet = func.overloadpacket
        flops = 0
        name = str(packet.__name__)
        attn = _attention_flops(name, args, kwargs or {})
        if attn:
            self._add("attn", (attn, *_attention_dims(name, args)))
        elif name == "linear_cross_entropy":
            t, h = math.prod(args[0].shape[:-1]), args[0].shape[-1]
            flops = 2 * t * h * args[1].shape[0] * (1 if self.phase == "fwd" else 2)
        elif _counted(packet) is not None:
            shapes = torch.utils._pytree.tree_map(
                lambda x: x.shape if isinstance(x, torch.Tensor) else x, (args, kwargs or {},
                                                                            out))
            flops = flop_registry[_counted(packet)](*shapes[0], **shapes[1], out_val=shapes[2])
        # A kernel: an op that makes a tensor, or one that writes into its first argument
        # (``add_``, ``copy_``, ``addmm_``). It moves what it writes and what it reads.
        inplace = not new and name.endswith("_") and bool(outs)
        moved = 0
        if (new or inplace) and not flops and not attn:
            moved = (new or _view_bytes(outs[0])) + sum(
                _view_bytes(a) for a in args if isinstance(a, torch.Tensor))
        kernel = 1 if new or inplace else 0
        self._add("work", Work(flops, moved, kernel,
                               fused=kernel if getattr(func, "namespace", "") == "meshlab" else 0))
        self.t += 1
        self._snapshot()
        return out

    def _snapshot(self) -> None:
        """Record this moment if more bytes are alive than at every moment before it."""
        made, keys, total, gone = self.made, [], 0, []
        for k, n in self.alive.items():
            if made[k][0].expired():
                gone.append(k)
            else:
                keys.append(k)
                total += n
        for k in gone:
            del self.alive[k]
        if self.peak is None or total > self.peak_bytes:
            self.peak, self.peak_bytes = (self.t, tuple(keys)), total

    _block = ""
    _embed = ""

    def _add(self, what: str, amount) -> None:
        mod = self._module()
        part = "block" if self._block and (mod == self._block or
                                           mod.startswith(self._block + ".")) else "rest"
        if what == "attn":
            f, d, kv = amount
            narrow = d <= 64
            amount = Work(attn=int(f), attn_narrow=int(f) if narrow else 0, ops=1,
                          attn_kv=int(f / kv), attn_kv_narrow=int(f / kv) if narrow else 0)
        keys = [(part, self.phase)]
        if self._embed and (mod == self._embed or mod.startswith(self._embed + ".")):
            keys.append(("embed", self.phase))     # of 'rest': the input embeddings' share
        for key in keys:
            self.work[key] = self.work.get(key, Work()) + amount


def _counted(packet):
    """The op whose FLOPs torch's counter knows: ``packet`` itself, or for an in-place op
    (``addmm_``) its out-of-place form."""
    from torch.utils.flop_counter import flop_registry

    if packet in flop_registry:
        return packet
    name = str(packet.__name__)
    if name.endswith("_"):
        base = getattr(torch.ops.aten, name[:-1], None)
        if base in flop_registry:
            return base
    return None


def _view_bytes(t: torch.Tensor) -> int:
    """The bytes an op touches of ``t``: its elements (a view reads its own, not its whole
    storage's), at most the storage."""
    if not t.numel():
        return 0
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def count_work(fn) -> Work:
    """The work ``fn`` does on real tensors, counted by the profile's rule: the bytes an
    op that makes or writes a tensor reads and writes, its matmul FLOPs, its kernels."""
    from torch.utils.module_tracker import ModuleTracker

    tracker = ModuleTracker()
    rec = _Recorder(tracker, set(), fake=False, count=True)
    with tracker, rec:
        fn()
    total = Work()
    for w in rec.work.values():
        total = total + w
    return total


def _attention_dims(name: str, args) -> tuple[int, int]:
    """(head dim, kv length) of a fused attention op's call."""
    q, k = args[1:3] if name.endswith("backward") else args[0:2]
    return int(q.shape[-1]), max(int(k.shape[-2]), 1)


def _attention_flops(name: str, args, kwargs) -> int:
    """FLOPs of a fused attention op: 4 b h s s_k d forward (half when causal), 2.5 times
    that backward (the recomputed scores and three products)."""
    if "scaled_dot_product" not in name and not name.startswith("attention"):
        return 0
    q, k = args[0], args[1]
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.ndim != 4:
        return 0
    if name.endswith("backward"):
        q, k = args[1], args[2]
    b, h, s, d = q.shape
    causal = kwargs.get("is_causal", kwargs.get("causal", True))
    if name.startswith("attention") and len(args) > 3 and isinstance(args[3], bool):
        causal = args[3]
    f = 4 * b * h * s * k.shape[-2] * d * (0.5 if causal else 1.0)
    return int(f * (2.5 if name.endswith("backward") else 1.0))


def _watch_ends(block: nn.Module) -> dict:
    """Storage ids of the block's hidden-state input and output, and the input's shape,
    filled as it runs."""
    ends: dict = {}

    def first(x):
        x = x[0] if isinstance(x, (tuple, list)) and x else x
        return x.untyped_storage()._cdata if isinstance(x, torch.Tensor) else None

    def pre(_m, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not args and isinstance(x, (tuple, list)) and x:
            x = x[0]
        ends["block_input"] = x.untyped_storage()._cdata if isinstance(x, torch.Tensor) \
            else None
        ends["shape"] = tuple(x.shape) if isinstance(x, torch.Tensor) else ()

    def post(_m, _args, out):
        ends["block_output"] = first(out)

    ends["hooks"] = [block.register_forward_pre_hook(pre, with_kwargs=True),
                     block.register_forward_hook(post)]
    return ends


def _row(v: list, grad: str = "") -> Saved:
    return Saved(module=v[2], op=v[3], dtype=v[4], shape=v[5], bytes=v[1], grad=grad,
                 users=tuple(v[7]))


def _patched_tracing():
    """Hugging Face takes its tracing paths (masks built, KV heads repeated) when it sees a
    fake tensor; the profile is of the eager run, so it is told it sees none."""
    try:
        import transformers.utils.import_utils as iu
    except ImportError:
        return contextlib.nullcontext()
    from unittest import mock

    return mock.patch.object(iu, "is_fake_tensor", lambda *a, **k: False)


def _run(model: nn.Module, block: str, batch: int, seq: int, step, contexts) -> Profile:
    """One forward, loss and backward of ``model`` on fake tensors, the example step's
    arguments built before anything is counted (``meshlab.estimate.example``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.module_tracker import ModuleTracker

    with _patched_tracing(), FakeTensorMode():
        _to_fake(model)
        params = dict(model.named_parameters(remove_duplicate=False))
        skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        args = step.build(batch, seq)
        tracker = ModuleTracker()
        rec = _Recorder(tracker, skip)
        rec._block = block
        rec._embed = _embedding_name(model)
        ends = _watch_ends(model.get_submodule(block))
        with tracker, rec, contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            loss = step.run(args)
            saved = [k for k, v in rec.made.items() if not v[0].expired()
                     and k != loss.untyped_storage()._cdata]
            rec.phase = "bwd"
            loss.backward()
        grads = {p.grad.untyped_storage()._cdata: n for n, p in params.items()
                 if p.grad is not None}
        # The peak: the moment the most bytes are alive (gradients included).
        best = rec.peak or (0, ())
        for h in ends.pop("hooks"):
            h.remove()
        hidden = ends.pop("shape", ())
        role = {v: k for k, v in ends.items()}
        return Profile(batch=batch, seq=seq, block=block, hidden=hidden,
                       saved=tuple(dataclasses.replace(_row(rec.made[k]), role=role.get(k, ""))
                                   for k in saved),
                       peak=tuple(_row(rec.made[k], grads.get(k, "")) for k in best[1]),
                       work=dict(rec.work))


def _embedding_name(model: nn.Module) -> str:
    """The input embeddings' module name, or '' where the model does not say."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        emb = None
    return next((n for n, m in model.named_modules() if m is emb), "") if emb is not None else ""


def _to_fake(model: nn.Module) -> None:
    """Replace the copy's meta parameters and buffers by fake CPU tensors (ties kept)."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table, param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    f = torch.empty(t.shape, dtype=t.dtype)
                    made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if param else f
                table[name] = made[id(t)]


class SavedCounter:
    """Counts, in a real run, the bytes the forward leaves alive for the backward, by
    the same rule as the profile: storages made by the ops inside the ``with`` (a
    DTensor's local shard), still alive when ``saved()`` is asked, except parameters,
    buffers and whatever the caller still holds (``exclude``).

    >>> with SavedCounter(model) as sc:        # doctest: +SKIP
    ...     loss = loss_fn(model(**batch), batch)
    >>> sc.saved(exclude=[loss])                # doctest: +SKIP
    """

    def __init__(self, model: nn.Module):
        from torch.utils.module_tracker import ModuleTracker

        skip = {_local(t).untyped_storage()._cdata
                for t in [*model.parameters(), *model.buffers()]}
        self._tracker = ModuleTracker()
        self._rec = _Recorder(self._tracker, skip, fake=False)

    def __enter__(self) -> "SavedCounter":
        self._tracker.__enter__()
        self._rec.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._rec.__exit__(*exc)
        self._tracker.__exit__(*exc)

    def rows(self, exclude=()) -> list[Saved]:
        gone = {_local(t).untyped_storage()._cdata for t in exclude}
        return [_row(v) for k, v in self._rec.made.items()
                if not v[0].expired() and k not in gone]

    def saved(self, exclude=()) -> int:
        return sum(r.bytes for r in self.rows(exclude))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def profile(model: nn.Module, plan, batch: int, seq: int, inputs=None, loss=None) -> Profile:
    """The profile of one step of ``plan`` on ``model`` (module docstring), cached per
    model, spec, batch, sequence length and example step: ``inputs(batch, seq)`` builds
    the forward's arguments and ``loss(output, args)`` the loss, for a model not called
    with ``input_ids`` alone (``meshlab.estimate.example``)."""
    from .example import example_step

    key = (tuple(repr(t) for t in plan.rooms if _profiles(t)), int(batch), int(seq), inputs,
           loss)
    per = _CACHE.setdefault(model, {})
    if key not in per:
        clone = _meta_copy(model, share=tuple(plan.model.blocks[1:]))
        block = _one_block(clone, plan.model.blocks)
        room_loss, contexts, hooked = None, [], []
        for t in plan.rooms:
            if _profiles(t):
                got = t.profile(plan, clone)
                if got is not None:
                    room_loss = got.get("loss", room_loss)
                    contexts += got.get("contexts", [])
                    hooked.extend(got.get("hooked", []))
        step = example_step(clone, inputs, loss, room_loss)
        pr = _run(clone, block, int(batch), int(seq), step, [*contexts, _GroupedMMAnyDtype()])
        if hooked:          # ops the rooms' own dispatch modes saw, counted in the block
            k = ("block", "fwd")
            seen = [c() for c in hooked]          # (all, of which fused)
            pr.work[k] = dataclasses.replace(pr.work.get(k, Work()),
                                             hooked=sum(a for a, _ in seen),
                                             hooked_fused=sum(f for _, f in seen))
        per[key] = pr
    return per[key]


class _GroupedMMAnyDtype(torch.utils._python_dispatch.TorchDispatchMode):
    """``torch._grouped_mm`` on fake tensors of a dtype other than bfloat16: its fake
    kernel takes bfloat16 alone ("Expected inputs of BF16 type"), so a float32 MoE running
    transformers' ``grouped_mm`` experts could not be profiled. The op runs on bfloat16
    copies and its output is cast back: the shapes, the saved tensors (autograd keeps the
    float32 inputs above this mode) and the FLOPs are the float32 op's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            dtype = flat[0].dtype if flat else torch.bfloat16
            if dtype.is_floating_point and dtype != torch.bfloat16:
                def bf(a):
                    return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and \
                        a.is_floating_point() else a
                out = func(*map(bf, args), **{k: bf(v) for k, v in kwargs.items()})
                return out.to(dtype)
        return func(*args, **kwargs)


def _profiles(t) -> bool:
    """Whether room ``t`` changes the profiled copy (overrides ``Transform.profile``)."""
    base = next(c for c in type(t).__mro__ if c.__name__ == "Transform")
    return type(t).profile is not base.profile

