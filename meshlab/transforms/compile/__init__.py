"""compile: each repeated block under ``torch.compile``, in place.

The room: ``Compile`` (a plan value), its check (a model with blocks to compile; the rooms
not yet shown compiled are the composition table's) and its install: every block this
rank runs is compiled with ``nn.Module.compile`` after its activation checkpointing is
wrapped and before FSDP2 shards it (``Phase.COMPILE``), as torchtitan orders them.
``fullgraph=True`` (the default) makes a graph break inside a block an error at its first
forward instead of a silent fall back to eager for part of it. Every meshlab op is a custom op with a fake kernel, so
the fused ops compile inside the blocks. Dynamo keeps one cache entry per block (they
share ``Module._call_impl``), so the install raises its recompile limit to the number of
blocks plus its default margin. A block holding modules another room runs eagerly
(``EagerModules``: the expert dispatch, whose all-to-all sizes are read on the host) is
compiled around them, each of its other children on its own, as torchtitan compiles a
mixture-of-experts block.

``mode='reduce-overhead'`` also records each compiled block's forward and backward as CUDA
graphs (torch's CUDA graph trees): a step then costs the host a replay per block instead
of a launch per kernel, which is what a small batch is bound by. ``meshlab.step`` marks
the start of each step for the graph trees (the runtime part below), so the outputs of
one step are never taken for another's. Modes are inductor's: another ``backend`` with a
``mode`` is refused. ``options`` are inductor's configuration, as ``torch.compile``'s, on
top of the mode's own (torch takes a mode or options; here they add up), each name checked
against ``torch._inductor.config`` when the plan is made.

>>> compile_blocks()
compile_blocks(fullgraph=True)
>>> compile_blocks(mode="reduce-overhead")
compile_blocks(fullgraph=True, mode='reduce-overhead')
>>> compile_blocks(options={"force_pointwise_cat": True})
compile_blocks(fullgraph=True, options={'force_pointwise_cat': True})
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ...core.errors import ConfigError, check_bool, check_choice
from ...planning.plan import Plan
from .._install import EagerModules, is_checkpointed, restore_forward
from .._protocol import Part, Phase, Transform

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GRAPH_MODES = ("reduce-overhead", "max-autotune")       # the modes that record CUDA graphs
_COMPILED = 0           # blocks compiled by this room in the process (dynamo's cache holds them)


class GraphSteps(Part):
    """Marks the start of each ``meshlab.step`` for torch's CUDA graph trees, so that a
    step's replays may reuse the memory of the last step's outputs."""

    def run_step(self, rt, opt, batch, loss_fn):
        torch.compiler.cudagraph_mark_step_begin()
        return None


@dataclasses.dataclass(frozen=True)
class Compile(Transform):
    """``torch.compile`` of every repeated block (``mode``, ``dynamic`` and ``backend`` as
    torch's)."""

    kind: ClassVar[str] = "compile"
    phase: ClassVar[Phase] = Phase.COMPILE

    fullgraph: bool = True
    mode: str | None = None
    dynamic: bool | None = False
    backend: str = "inductor"
    options: tuple = ()              # inductor's (name, value) pairs, sorted by name

    def __post_init__(self):
        check_bool(self.fullgraph, "compile_blocks", "fullgraph")
        if self.mode is not None:
            check_choice(self.mode, "compile_blocks", "mode", MODES[1:])
        if self.dynamic is not None:
            check_bool(self.dynamic, "compile_blocks", "dynamic")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"compile_blocks(backend={self.backend!r}): the name of a "
                              f"torch.compile backend, e.g. 'inductor' or 'aot_eager'")
        if self.mode is not None and self.backend != "inductor":
            raise ConfigError(f"compile_blocks(mode={self.mode!r}, backend={self.backend!r}): "
                              f"modes are inductor's; leave mode out or use backend='inductor'")
        object.__setattr__(self, "options", _inductor_options(self.options, self.backend))

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """Its row, as users spell it: ``compile_blocks``."""
        return ("compile_blocks",)

    def check(self, plan: Plan) -> None:
        if not plan.model.blocks:
            raise ConfigError("compile_blocks(): the model has no repeated blocks to compile; "
                              "call torch.compile(model) on it instead")

    def install(self, ctx) -> None:
        import torch._dynamo

        mods = dict(ctx.model.named_modules())
        kw = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        if self.options:
            from torch._inductor import list_mode_options

            kw["options"] = {**list_mode_options(self.mode or "default", self.dynamic),
                             **dict(self.options)}
        elif self.mode is not None:
            kw["mode"] = self.mode
        blocks = [b for b in ctx.plan.model.blocks if b in mods and b not in ctx.dropped]
        eager = ctx.kept(EagerModules)
        units = [u for b in blocks for u in compiled_units(
            b, mods, eager.fqns if eager is not None else frozenset())]
        # Every block shares one code object (Module._call_impl), so dynamo keeps one
        # cache entry per block: its recompile limit (8) must cover the model's depth, or
        # fullgraph turns the ninth block into an error. The entries of blocks compiled
        # earlier in the process stay (a notebook cell run again builds a new model), so
        # the limit covers every block compiled so far.
        global _COMPILED
        _COMPILED += len(units)
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), _COMPILED + 8))
        # A checkpointed block's recompute is a higher-order op dynamo traces without side
        # effects: maps that hand each other their products (fuse's query, key and value
        # projections) run their own products there (the same math).
        for b in blocks:
            if is_checkpointed(mods[b]):
                for m in mods[b].modules():
                    restore_forward(m)
        for u in units:
            mods[u].compile(**kw)
        return GraphSteps() if self.mode in GRAPH_MODES else None

    def work_share(self, plan: Plan, parts: dict) -> dict:
        """Under CUDA graphs the blocks' ops are replayed, not issued one by one: the host
        makes one call per block and direction (a replay, costed as one call of a fused
        op), the device runs the same kernels."""
        if self.mode not in GRAPH_MODES or "blocks" not in parts:
            return parts
        w = parts["blocks"]
        graphs = 2 * len(plan.model.blocks)
        return {**parts, "blocks": dataclasses.replace(
            w, fused=0, hooked=0, hooked_fused=0, replayed=w.ops, graphs=graphs)}

    def __repr__(self) -> str:
        extra = "".join(f", {f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)[1:-1]
                        if getattr(self, f.name) != f.default)
        if self.options:
            extra += f", options={dict(self.options)!r}"
        return f"compile_blocks(fullgraph={self.fullgraph!r}{extra})"


def compiled_units(block: str, mods: dict, eager: frozenset) -> list[str]:
    """The modules compiled for ``block``: the block itself, or, where it holds modules
    another room runs eagerly (``EagerModules``), each of its children that holds none,
    descending into those that do (the eager modules themselves left out)."""
    inside = [f for f in eager if f == block or f.startswith(block + ".")]
    if not inside:
        return [block]
    if block in inside:
        return []
    out = []
    for name, _ in mods[block].named_children():
        out += compiled_units(f"{block}.{name}", mods, frozenset(inside))
    return out


def _inductor_options(options, backend: str) -> tuple:
    """``options`` (a mapping, or the pairs a plan holds) as sorted pairs, each name one of
    ``torch._inductor.config``'s; refused for a backend other than inductor."""
    items = options.items() if isinstance(options, dict) else options
    try:
        pairs = tuple(sorted((str(k), v) for k, v in items))
    except (TypeError, ValueError):
        raise ConfigError(f"compile_blocks(options={options!r}): a dict of inductor's "
                          f"configuration names and values") from None
    if not pairs:
        return ()
    if backend != "inductor":
        raise ConfigError(f"compile_blocks(options=..., backend={backend!r}): options are "
                          f"inductor's; leave them out or use backend='inductor'")
    from torch._inductor import config

    known = config.get_config_copy()
    unknown = [k for k, _ in pairs if k not in known]
    if unknown:
        raise ConfigError(f"compile_blocks(options=...): {unknown} not in torch._inductor.config "
                          f"(torch {torch.__version__}); names are its, e.g. "
                          f"'force_pointwise_cat' or 'triton.cudagraphs'")
    return pairs


def compile_blocks(fullgraph: bool = True, mode: str | None = None,
                   dynamic: bool | None = False, backend: str = "inductor",
                   options: dict | None = None) -> Compile:
    """Compile each repeated block with ``torch.compile`` (see the module doc); ``backend``
    as torch.compile's (``'aot_eager'`` runs the traced graphs without generating code);
    ``options``, inductor's configuration on top of ``mode``'s."""
    return Compile(fullgraph, mode, dynamic, backend, options or ())
