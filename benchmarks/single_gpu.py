"""One GPU, one training step, every path a Hugging Face user picks from, in one run.

Rows (each from the same bf16 weights, on the same batch):

* ``hf_eager``          -- transformers as shipped (SDPA), ``model(ids, labels=ids).loss``;
* ``hf_compile``        -- the same under ``torch.compile(model)``;
* ``hf_liger``          -- transformers after Liger-Kernel's ``apply_liger_kernel_to_llama``
  (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy);
* ``meshlab_fuse``      -- ``meshlab.transforms.fuse.fuse_model(model)`` (RMSNorm, rotary,
  attention, SwiGLU MLP, the loss without logits) and meshlab's ``FusedAdamW``;
* ``meshlab_step``      -- ``ml.parallelize(model, ml.fuse(), Mesh(dp=1))`` and ``ml.step``
  with ``ml.optimizer(model, FusedAdamW)``: the same kernels through meshlab's API;
* ``meshlab_compile``   -- ``fuse_model`` and then ``torch.compile`` of the whole model;
* ``meshlab_blocks``    -- ``ml.parallelize(model, ml.fuse() | ml.compile_blocks(), ...)`` and
  ``ml.step``: each block compiled with ``fullgraph=True``;
* ``meshlab_graphs``    -- the same with ``compile_blocks(mode='reduce-overhead')``: each
  block's forward and backward replayed as CUDA graphs;
* ``meshlab_blocks_inductor``, ``meshlab_blocks_sdpa``, ``meshlab_graphs_inductor`` --
  compiled blocks with only ``fuse('attention', 'loss')`` or ``fuse('loss')``: inductor's
  own code for the norms, rotary and MLP instead of meshlab's ops;
* ``meshlab_fuse_dw_apart`` -- ``meshlab_fuse`` with the MLP's gate and up weight
  gradients as two products (before its gated backward wrote their input gradients side
  by side, so that one product gives both);
* ``meshlab_fuse_quack_mlp`` -- ``meshlab_fuse`` with the MLP on quack-kernels' gated GEMMs
  (the activation in the products' epilogues; ``meshlab.ops.swiglu.QUACK_MLP``) where it
  is installed on a Hopper card, in place of cuBLAS products and Triton activation passes;
* ``meshlab_fuse_quack_mlp_untuned`` -- the same in quack's default tile configurations
  (``QUACK_TUNED`` off: no autotuning at the first call);
* ``meshlab_blocks_cudnn`` -- ``meshlab_blocks`` with ``meshlab.ops.attention.FA4_COMPILED``
  off: the compiled blocks' attention on cuDNN where flash-attn-4 would take it (the
  comparison for it);
* ``meshlab_fuse_add_apart`` -- ``meshlab_fuse`` with each layer's last residual add a
  pass of its own after the MLP, not inside its down product (the comparison for that);
* ``meshlab_blocks_pwcat``, ``meshlab_graphs_pwcat`` -- ``meshlab_blocks`` and
  ``meshlab_graphs`` with inductor's ``force_pointwise_cat``;
* ``meshlab_count<k>``  -- (8B) ``ml.fuse() | ml.remat('full', count=k)``: k of the 32
  blocks checkpointed, spread evenly; ``meshlab_count<k>_off<m>`` adds ``offload=m``: the
  saved activations of m of the other blocks wait in host memory;
* ``<row>_sib``         -- a parallelize row with ``ml.step_in_backward()`` added: each
  block's parameters updated as their gradients complete, none held until the step;
* ``meshlab_remat2``    -- (8B) ``ml.parallelize(model, ml.fuse() | ml.remat('full', every=2),
  ...)`` and ``ml.step``: every other block checkpointed, in place of transformers'
  checkpointing of all of them;
* ``meshlab_noremat``   -- (8B) ``ml.fuse()`` and ``ml.step`` with no checkpointing at all;
* ``titan_eager``       -- torchtitan's llama3 training step (``benchmarks/_titan.py``), as its
  ``Trainer`` runs it on one GPU with its defaults: a ``Llama3Model`` of the same sizes
  built by torchtitan (fresh, seeded; not the transformers weights) with fused QKV and
  FlexAttention (block-causal mask from per-row positions), FSDP2 at world 1 for its mixed
  precision, ``ChunkedLossWrapper`` cross-entropy, fused AdamW (``default_adamw``),
  gradient clipping at 1.0, forward and backward captured as one CUDA graph from the third
  step on; activation checkpointing where the shape has it (8B: ``SelectiveAC``, as
  ``llama3_8b`` sets it; tinyllama: none, as in the other rows); each block run eagerly;
* ``titan_compile``     -- the same with ``CompileConfig(enable=True)``: each block compiled
  with ``fullgraph=True`` and the loss compiled (torchtitan's best one-GPU setting);
* ``titan_compile_fp8`` -- that with ``Float8LinearConverter`` as ``llama3_debugmodel_float8``
  applies it (torchao's float8 linear layers with torchtitan's default recipe, rowwise
  scales; the lm_head too);
* ``titan_<...>_sdpa``, ``titan_<...>_nocg`` -- a titan row with torchtitan's causal SDPA in
  place of FlexAttention, or without the CUDA graph (``training.disable_cuda_graphs``).

  That is torchtitan 0.3.0 (torch 2.12 on). With torchtitan 0.2.x installed (for torch 2.11)
  the rows run ``benchmarks/_titan02.py``, 0.2.2's ``Trainer`` instead: causal
  SDPA in every row (its ``8B`` flavor's; ``_sdpa`` changes nothing), no FSDP at world 1
  but ``torch.autocast`` to bf16 over the fp32 parameters, the plain summed cross-entropy
  on full logits, no CUDA graphs (``_nocg`` changes nothing), per-op ``SelectiveAC``
  (``llama3_8b.toml``), and float8 with 0.2.2's default tensorwise scales.

torchtitan keeps fp32 master weights: its parameters, gradients and AdamW moments are fp32
(16 bytes a parameter, about 120 GiB at llama3-8b, more than an H100 holds) and only the
forward and backward run in bf16 copies, where every other row holds bf16 parameters and
gradients. Its peak memory is therefore not comparable one for one with theirs, nor is the
time of its optimizer step. The titan rows run after the others (torchtitan sets
process-wide compiler options), with the transformers model moved off the GPU while they
run (the other rows' peaks include it); they are not in the default rows: name them with
``--rows``. torchtitan and its dependencies come from ``PYTHONPATH``.

The other rows step ``torch.optim.AdamW(fused=True)``. Time: CUDA events around each step,
the median of ``--steps`` steps after ``--warmup``; peak memory is
``max_memory_allocated`` over the timed steps. A row that fails records its error. Writes
``benchmarks/results/single_gpu_<shape>_<card>.json``.

    python benchmarks/single_gpu.py --shape tinyllama      # hidden 2048, 22 layers, 8 x 2048
    python benchmarks/single_gpu.py --shape llama3-8b      # hidden 4096, 32 layers, 2 x 4096
    python benchmarks/single_gpu.py --shape tinyllama --batch 1 --tag _b1 \
        --rows hf_eager,hf_liger,meshlab_fuse,meshlab_step,meshlab_graphs   # host-bound
    python benchmarks/single_gpu.py --pair meshlab_fuse,meshlab_step --steps 30
    PYTHONPATH=<torchtitan's wheels unpacked> python benchmarks/single_gpu.py \
        --shape tinyllama --tag _titan --rows meshlab_blocks,titan_compile,titan_compile_fp8

``--pair A,B`` times two rows interleaved, A, B, A, B, ..., both models and optimizers on
the card after both are warmed up, and reports the median of the per-pair ratios B/A:
separate runs drift by about 1% on this card (``meshlab_step`` against the loop:
0.4% ahead in one run, 1.1% behind in the next), which is the size of the differences
some comparisons ask about. Writes ``single_gpu_<shape>_pair_<A>_<B>_<card>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _timing import cuda_times  # noqa: E402

SHAPES = {
    "tinyllama": dict(cfg=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=22, num_attention_heads=32,
                               num_key_value_heads=4), batch=8, seq=2048, checkpointing=False),
    "llama3-8b": dict(cfg=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, rope_theta=500000.0), batch=2, seq=4096,
                      checkpointing=True),
}
# Liger patches the modeling module's functions for every later model of the process: last.
ROWS = ("hf_eager", "hf_compile", "meshlab_fuse", "meshlab_step", "meshlab_compile",
        "meshlab_blocks", "meshlab_graphs", "meshlab_step_sib", "hf_liger")
ROWS_8B = ("hf_eager", "meshlab_fuse", "meshlab_step", "meshlab_remat2", "meshlab_noremat",
           "meshlab_count18", "meshlab_count18_sib", "meshlab_count19_sib", "hf_liger")
NO_HF_CHECKPOINTING = ("meshlab_remat2", "meshlab_noremat", "meshlab_count")  # own remat or none
PEAK_TFLOPS = 989.0          # H200 dense bf16


def _flops_per_token(cfg, seq: int) -> float:
    """6 N (matmul parameters) + attention's 12 L H S (forward and backward)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    n = layers * per_layer + h * cfg.vocab_size
    return 6 * n + 12 * layers * h * seq


def _meshlab_spec(name: str):
    """The spec of a row run through ``ml.parallelize`` and ``ml.step`` (None for the
    others). ``meshlab_count<k>``: ``remat('full', count=k)``; a ``_sib`` suffix adds
    ``step_in_backward()``, ``_fp8`` adds ``precision('fp8')`` (torchao's float8 linear
    layers; compiled blocks fuse its scaling and casts)."""
    import meshlab as ml

    if name.endswith("_fp8"):       # float8 linear layers (torchao), under compiled blocks
        base = _meshlab_spec(name[:-len("_fp8")])
        return None if base is None else base | ml.precision("fp8")
    if name.endswith("_sib"):
        base = _meshlab_spec(name[:-len("_sib")])
        return None if base is None else base | ml.step_in_backward()
    if name.startswith("meshlab_count"):
        count, _, off = name[len("meshlab_count"):].partition("_off")
        if count.isdigit() and (off == "" or off.isdigit()):
            return ml.fuse() | ml.remat("full", count=int(count), offload=int(off or 0))
    return {"meshlab_step": ml.fuse(), "meshlab_noremat": ml.fuse(),
            "meshlab_blocks": ml.fuse() | ml.compile_blocks(),
            "meshlab_blocks_cudnn": ml.fuse() | ml.compile_blocks(),
            "meshlab_blocks_inductor": ml.fuse("attention", "loss") | ml.compile_blocks(),
            "meshlab_blocks_sdpa": ml.fuse("loss") | ml.compile_blocks(),
            # inductor's autotuned products (its Triton templates beside cuBLAS), which
            # may take the elementwise work after a product into the product's epilogue
            "meshlab_blocks_autotune": ml.fuse()
            | ml.compile_blocks(mode="max-autotune-no-cudagraphs"),
            "meshlab_blocks_inductor_autotune": ml.fuse("attention", "loss")
            | ml.compile_blocks(mode="max-autotune-no-cudagraphs"),
            "meshlab_graphs_inductor": ml.fuse("attention", "loss")
            | ml.compile_blocks(mode="reduce-overhead"),
            "meshlab_graphs": ml.fuse() | ml.compile_blocks(mode="reduce-overhead"),
            # a concatenation of extern outputs (the key and value gradients) as one
            # Triton kernel, where inductor otherwise copies each part into place
            "meshlab_blocks_pwcat": ml.fuse()
            | ml.compile_blocks(options={"force_pointwise_cat": True}),
            "meshlab_graphs_pwcat": ml.fuse()
            | ml.compile_blocks(mode="reduce-overhead", options={"force_pointwise_cat": True}),
            "meshlab_remat2": ml.fuse() | ml.remat("full", every=2),
            "meshlab_count19_blocks": ml.fuse() | ml.remat("full", count=19)
            | ml.compile_blocks(),
            # the fused attention and loss only: compiled checkpointed blocks take no
            # rotary routing (its depth counter is a side effect torch.utils.checkpoint's
            # higher-order op refuses under dynamo)
            "meshlab_al_count19_blocks": ml.fuse("attention", "loss")
            | ml.remat("full", count=19) | ml.compile_blocks()}.get(name)


def _titan_options(name: str) -> dict | None:
    """``_titan.titan_step``'s options of a ``titan_*`` row (module docstring), else None."""
    parts = name.split("_")
    if parts[0] != "titan" or len(parts) < 2 or parts[1] not in ("eager", "compile"):
        return None
    extras = set(parts[2:])
    if extras - {"fp8", "sdpa", "nocg"}:
        return None
    return {"compile": parts[1] == "compile", "float8": "fp8" in extras,
            "attn_backend": "sdpa" if "sdpa" in extras else "flex",
            "cuda_graphs": "nocg" not in extras}


def _titan_step(name: str, shape: dict, batch):
    """(step callable, torchtitan's model) of a ``titan_*`` row, on the batch's ids;
    ``SelectiveAC`` where the shape checkpoints (``llama3_8b``'s choice)."""
    import _titan

    ids = batch["input_ids"]
    return _titan.titan_step(shape["cfg"], ids.shape[0], ids.shape[1], ids=ids,
                             ac="selective" if shape["checkpointing"] else None,
                             device=ids.device.type, seed=0, **_titan_options(name))


def _layer_sums_apart(self, hidden_states, **kwargs):
    """A routed decoder layer as ``fuse()`` ran it before its residual stream's gradient
    joined the first norm's backward and its query/key/value input gradient was summed
    inside the products (row ``meshlab_fuse_sums_apart``): the comparison for those two."""
    from meshlab.ops.rms_norm import add_rms_norm
    from meshlab.transforms.fuse._residual import norm_eps

    h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    post = self.post_attention_layernorm
    normed, hidden = add_rms_norm(h, hidden_states, post.weight, norm_eps(post))
    return hidden + self.mlp(normed)


def _step_fn(name: str, model, batch, shape: dict | None = None):
    """The step callable of one row (a ``titan_*`` row builds its own model from
    ``shape`` and ignores ``model``)."""
    if _titan_options(name) is not None:
        return _titan_step(name, shape, batch)[0]
    import meshlab as ml
    from meshlab.ops import FusedAdamW
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    ids = batch["input_ids"]
    if name in ("hf_eager", "hf_compile", "hf_liger"):
        if name == "hf_liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True,
                                        cross_entropy=False, fused_linear_cross_entropy=True,
                                        model=model)
        run = torch.compile(model) if name == "hf_compile" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    spec = _meshlab_spec(name)
    if spec is not None:
        model = ml.parallelize(model, spec, ml.Mesh(dp=1))
        opt = ml.optimizer(model, FusedAdamW, lr=1e-5)
        step = lambda: torch.tensor(ml.step(model, opt, batch))    # noqa: E731
        if name == "meshlab_blocks_cudnn":     # compiled blocks on cuDNN's attention
            return _patched(step, "FA4_COMPILED", False, "meshlab.ops.attention")
        return step
    fuse_model(model)
    if name == "meshlab_fuse_sums_apart":
        for layer in model.model.layers:
            layer.forward = types.MethodType(_layer_sums_apart, layer)
            for proj in ("q_proj", "k_proj", "v_proj"):     # each its own product again
                vars(getattr(layer.self_attn, proj)).pop("forward", None)
    run = torch.compile(model) if name == "meshlab_compile" else model
    opt = FusedAdamW(model.parameters(), lr=1e-5)

    def step():
        loss = causal_lm_loss(run, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    if name == "meshlab_fuse_dw_apart":     # the gate and up weight gradients two products
        return _patched(step, "_backward_side_by_side", lambda *a: None)
    if name == "meshlab_fuse_quack_mlp":    # the MLP on quack-kernels' gated GEMMs
        return _patched(step, "QUACK_MLP", True)
    if name == "meshlab_fuse_add_apart":    # the last residual add after the MLP
        return _patched(step, "_bare_call", lambda m: False,
                        "meshlab.transforms.fuse._residual")
    if name == "meshlab_fuse_quack_mlp_untuned":    # ... in their default tile configuration
        return _patched(_patched(step, "QUACK_TUNED", False), "QUACK_MLP", True)
    return step


def _patched(step, attr: str, value, module: str = "meshlab.ops.swiglu"):
    """``step`` run with ``<module>.<attr>`` set to ``value`` (the comparison rows for one
    change to the fused MLP)."""
    import importlib

    S = importlib.import_module(module)

    def run():
        kept = getattr(S, attr)
        setattr(S, attr, value)
        try:
            return step()
        finally:
            setattr(S, attr, kept)
    return run


def build(shape: dict):
    """(the bf16 Llama of ``shape`` on the GPU, its batch of random ids), seeded."""
    import transformers

    cfg = transformers.LlamaConfig(**shape["cfg"], max_position_embeddings=shape["seq"],
                                   tie_word_embeddings=False, attn_implementation="sdpa",
                                   use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape["batch"], shape["seq"]), device="cuda",
                        generator=g)
    return base, {"input_ids": ids}


def _row(name: str, base, batch, shape: dict) -> tuple:
    """(step callable, what the row's JSON records of its setup) of one row: a copy of
    ``base`` for the transformers and meshlab rows, torchtitan's own model for the titan
    rows (``base`` is left where it is: the caller moves it off the GPU for those)."""
    titan = _titan_options(name)
    if titan is not None:
        step, model = _titan_step(name, shape, batch)
        return step, {"hf_gradient_checkpointing": False, "titan": titan,
                      "titan_activation_checkpointing":
                          "selective" if shape["checkpointing"] else None,
                      "params": sum(p.numel() for p in model.parameters()),
                      "param_dtype": str(next(model.parameters()).dtype)}
    model = copy.deepcopy(base)
    hf_ckpt = shape["checkpointing"] and not name.startswith(NO_HF_CHECKPOINTING)
    if hf_ckpt:
        model.gradient_checkpointing_enable()
    return _step_fn(name, model, batch), {"hf_gradient_checkpointing": hf_ckpt}


def _base_off_gpu(base, names) -> bool:
    """Move ``base`` to the CPU when every row of ``names`` is a titan row (its weights
    are not theirs); True if it moved."""
    if not all(_titan_options(n) is not None for n in names):
        return False
    base.to("cpu")
    torch.cuda.empty_cache()
    return True


def _titan_release() -> None:
    """Drop torchtitan's CUDA graphs (their memory pool outlives the step callables)."""
    if "_titan" in sys.modules:
        sys.modules["_titan"].release()


def run_row(name: str, base, batch, steps: int, warmup: int, shape: dict) -> dict:
    moved = _base_off_gpu(base, [name])
    try:
        step, info = _row(name, base, batch, shape)
        first = [float(step().detach()) for _ in range(min(3, warmup))]
        for _ in range(warmup - len(first)):
            step()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        times = cuda_times(step, steps)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        # the caching allocator freeing its cache to retry an allocation (a device sync)
        info["alloc_retries_timed"] = torch.cuda.memory_stats().get(
            "num_alloc_retries", 0) - retries
        info["reserved_GiB"] = torch.cuda.max_memory_reserved() / 2 ** 30
    finally:
        step = None
        _titan_release()
        if moved:
            base.to("cuda")
    ms = statistics.median(times)
    tokens = batch["input_ids"].numel()
    return {**info, "base_model_on_gpu": not moved,
            "first_losses": first, "ms_per_step": ms, "tokens_per_s": tokens / (ms * 1e-3),
            "peak_GiB": peak, "step_ms": times}


def run_pair(a: str, b: str, base, batch, steps: int, warmup: int, shape: dict,
             clocks: bool = False) -> dict:
    """Rows ``a`` and ``b`` interleaved step by step (module docstring); ``clocks``: the
    SM clock and power each row's steps ran at (``_clocks.py``)."""
    import _clocks

    fns = {}
    for name in (a, b):
        fns[name] = _row(name, base, batch, shape)[0]
        for _ in range(warmup):
            fns[name]()
    times = {a: [], b: []}
    sampler = _clocks.Sampler() if clocks else None
    with sampler or contextlib.nullcontext():
        for _ in range(steps):
            for name in (a, b):
                t0 = time.time()
                times[name] += cuda_times(fns[name], 1)
                if sampler:
                    sampler.mark(name, t0, time.time())
    extra = {"clocks": sampler.by_row()} if sampler else {}
    ratios = [y / x for x, y in zip(times[a], times[b])]
    tokens = batch["input_ids"].numel()
    return {"rows": [a, b], "step_ms": times,
            "tokens_per_s": {k: tokens / (statistics.median(v) * 1e-3) for k, v in times.items()},
            "time_ratio_b_over_a": {"median": statistics.median(ratios), "min": min(ratios),
                                    "max": max(ratios)}, **extra}


_KERNEL_PKGS = ("flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl")


def _paths() -> dict:
    """The path each meshlab op took at its last call (which kernels ran)."""
    from meshlab.ops import _build

    return {f"{op}/{dev}": ("native " if p.native else "fallback ") + p.reason
            for (op, dev), p in _build.LAST_PATH.items()}


def _versions(*pkgs) -> dict:
    """{package with '-' as '_': its installed version, or None}."""
    import importlib.metadata as md

    out = {}
    for pkg in pkgs:
        try:
            out[pkg.replace("-", "_")] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg.replace("-", "_")] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=tuple(SHAPES), default="tinyllama")
    ap.add_argument("--rows", default=None, help="default: every row of the shape")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None, help="default: the shape's")
    ap.add_argument("--seq", type=int, default=None, help="default: the shape's")
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--pair", default=None, help="A,B: two rows timed interleaved")
    ap.add_argument("--clocks", action="store_true",
                    help="with --pair: sample the SM clock and power of each row's steps")
    args = ap.parse_args()
    import transformers

    shape = dict(SHAPES[args.shape])
    shape.update({k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v})
    base, batch = build(shape)
    cfg = base.config
    fpt = _flops_per_token(cfg, shape["seq"])
    if args.pair:
        a, b = args.pair.split(",")
        r = run_pair(a, b, base, batch, args.steps, args.warmup, shape, args.clocks)
        print(f"{b} / {a} step time: median {r['time_ratio_b_over_a']['median']:.4f} "
              f"(min {r['time_ratio_b_over_a']['min']:.4f}, max "
              f"{r['time_ratio_b_over_a']['max']:.4f}); tokens/s {r['tokens_per_s']}",
              flush=True)
        if "clocks" in r:
            print(f"clocks: {r['clocks']}", flush=True)
        dev = torch.cuda.get_device_properties(0)
        out = {"card": dev.name, "torch": torch.__version__,
               "transformers": transformers.__version__, **_versions("torchtitan", "torchao", *_KERNEL_PKGS), "paths": _paths(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "shape": args.shape, "batch": shape["batch"], "seq": shape["seq"],
               "method": f"{args.steps} steps of each row interleaved (CUDA events) after "
                         f"{args.warmup} warm-up steps of each; bf16 parameters", **r}
        name = f"single_gpu_{args.shape}_pair_{a}_{b}{args.tag}"
        print(f"wrote {_results.write(name, dev.name, out, args.copy_to)}")
        return
    results = {}
    rows = (args.rows or ",".join(ROWS_8B if args.shape == "llama3-8b" else ROWS)).split(",")
    # Liger patches transformers' modeling module for the whole process: its row runs after
    # the others but the titan rows, which set process-wide compiler options
    rows = sorted(rows, key=lambda r: (_titan_options(r) is not None, r == "hf_liger"))
    for name in rows:
        try:
            r = run_row(name, base, batch, args.steps, args.warmup, shape)
            r["mfu"] = r["tokens_per_s"] * fpt / (PEAK_TFLOPS * 1e12)
            print(f"{name:>16}: {r['tokens_per_s']:>9,.0f} tokens/s  {100 * r['mfu']:.1f}% MFU  "
                  f"peak {r['peak_GiB']:.1f} GiB  first losses "
                  f"{' '.join(f'{x:.4f}' for x in r['first_losses'])}", flush=True)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                 "traceback": traceback.format_exc()[-3000:]}
            print(f"{name:>16}: failed: {r['error'][:200]}", flush=True)
        results[name] = r
        torch._dynamo.reset()        # each row compiles afresh, not against the last's cache
        gc.collect()
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_properties(0)
    ok = {k: v for k, v in results.items() if "tokens_per_s" in v}
    out = {"card": dev.name, "torch": torch.__version__, "transformers": transformers.__version__,
           **_versions("liger-kernel", "triton", "torchtitan", "torchao", *_KERNEL_PKGS),
           "paths": _paths(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": args.shape, "model": shape["cfg"], "batch": shape["batch"],
           "seq": shape["seq"], "gradient_checkpointing": shape["checkpointing"],
           "params": sum(p.numel() for p in base.parameters()),
           "flops_per_token": fpt, "peak_tflops": PEAK_TFLOPS,
           "method": f"median of {args.steps} steps (CUDA events) after {args.warmup} warm-up "
                     f"steps; bf16 parameters; peak = max_memory_allocated over the timed steps",
           "vs_liger": ({k: v["tokens_per_s"] / ok["hf_liger"]["tokens_per_s"] for k, v in ok.items()}
                        if "hf_liger" in ok else None),
           "results": results}
    path = _results.write(f"single_gpu_{args.shape}{args.tag}", dev.name, out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
