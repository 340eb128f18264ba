"""torchtitan's llama3 training step at the shapes of ``benchmarks/single_gpu.py``.

``titan_step`` builds what torchtitan's ``Trainer`` builds for one GPU at data-parallel
degree 1 (``torchtitan/trainer.py``, ``Trainer.__init__`` and ``train_step``), from its own
config objects and builders, with the defaults of its ``Trainer.Config`` and of
``llama3_8b`` in ``torchtitan/models/llama3/config_registry.py``:

* the model: ``Llama3Model.Config`` with ``_build_llama3_layers`` (fused QKV, the attention
  backend ``model_registry`` defaults to, FlexAttention with a block-causal mask from
  per-row positions), the shape's sizes exactly (its FFN hidden size is the shape's
  intermediate size, not ``compute_ffn_hidden_dim``'s), untied embeddings; registered as a
  flavor and taken through ``model_registry``, so the float8 converter is applied as there;
  what ``update_from_config`` does to it (RoPE caches of ``training.seq_len``, the sharding
  declarations; done here with the functions it calls, since it imports
  ``torchtitan.trainer``, whose metrics and data loading import tensorboard and datasets),
  built on the meta device in fp32, ``parallelize_llama``, ``to_empty`` and
  ``init_weights`` (seeded);
* ``parallelize_llama``: activation checkpointing if asked (``llama3_8b`` uses
  ``SelectiveAC``), each ``TransformerBlock`` compiled with ``fullgraph=True`` when
  ``compile`` (``CompileConfig(enable=True)``, components model and loss), and FSDP2 on a
  world of one for its mixed precision: fp32 parameters (the master weights), bf16
  compute copies, fp32 gradient reduction;
* the loss: ``ChunkedLossWrapper`` around ``CrossEntropyLoss`` (8 sequence chunks, the
  ``lm_head`` applied per chunk), compiled with the model when ``compile``;
* the optimizer: ``default_adamw`` (AdamW, betas 0.9/0.95, weight decay 0.1,
  ``implementation='fused'``) and the default warm-up schedule;
* the step: ``zero_grad`` (to zero, not to None, while CUDA graphs are on), the
  positions and mask as ``post_dataloading_process`` makes them, forward and backward
  as ``_forward_backward_body`` runs them (captured as one CUDA graph from the third call
  on by ``wrap_with_cuda_graph`` when ``cuda_graphs``, the Trainer's default on CUDA),
  ``clip_grad_norm_`` at ``training.max_norm`` (1.0), the optimizer and scheduler steps.

Two torchtitan releases are driven, chosen by ``importlib.metadata.version("torchtitan")``:
0.3.0, by the code here, and 0.2.x, by ``_titan02.titan_step`` (imported only then), which
mirrors 0.2.2's ``Trainer`` (``torchtitan/train.py``: ``JobConfig``, ``TransformerModelArgs``,
``parallelize_llama``, ``build_optimizers``; no FSDP at world 1 but ``torch.autocast``, no
CUDA graphs). 0.3.0 follows torch's nightlies and needs torch 2.12 to train; 0.2.2 is
written for released torch, so on the GPU machine's torch 2.11 the titan rows run 0.2.x.

Every torchtitan import is inside the functions: the benchmark imports this module
without torchtitan installed. On a torch older than torchtitan's (2.11), ``_torch_compat``
stands in for the one name its modules import and a world of one never uses.
"""

from __future__ import annotations

import dataclasses
import os
import types

import torch

FLAVOR = "meshlab_bench"        # the flavor name the benchmark's shape is registered as


def _torch_compat() -> None:
    """torchtitan 0.3.0 follows torch's nightlies: its FSDP modules import
    ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.12 on) at module scope and use
    it only to describe data-parallel mesh axes of more than one rank to ``fully_shard``
    (``resolve_fsdp_mesh`` gives None at world 1). On an older torch a stand-in that
    refuses to be built lets those modules import; a run that would need it fails."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    class DataParallelMeshDims:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"torch {torch.__version__} has no DataParallelMeshDims (torch 2.12 on); "
                "the benchmark's torchtitan step runs at data-parallel degree 1 only")

    fsdp.DataParallelMeshDims = DataParallelMeshDims


def _titan_version() -> str:
    """The installed torchtitan's version (its ``__version__`` where no metadata is found)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        import torchtitan

        return torchtitan.__version__


def ids_and_labels(shape_cfg: dict, batch: int, seq: int, ids, device: str, seed: int,
                   ignore_index: int):
    """The step's token ids (``ids``, or random ones seeded with ``seed``) on ``device``
    and their labels as torchtitan's data loader gives them: each position's next token,
    the last position's ignored (``ignore_index``): one document a row."""
    if ids is None:
        g = torch.Generator(device=device).manual_seed(seed)
        ids = torch.randint(0, shape_cfg["vocab_size"], (batch, seq), device=device,
                            generator=g)
    ids = ids.to(device)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = ignore_index
    return ids, labels


def _process_group(device_type: str) -> None:
    """A process group of world 1 (torchtitan's device meshes need one), if none is up."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0,
                            world_size=1)


def model_config(shape_cfg: dict):
    """``Llama3Model.Config`` of the benchmark's shape dict (transformers' field names),
    through torchtitan's ``_build_llama3_layers`` and inits as its llama3 flavors use them.
    A function of ``attn_backend`` and ``tp_gemm_backend``, like the entries of
    ``llama3_configs``."""
    from functools import partial

    import torch.nn as nn

    _torch_compat()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim = shape_cfg["hidden_size"]
    vocab = shape_cfg["vocab_size"]
    heads = shape_cfg["num_attention_heads"]
    s = dim ** -0.5

    def build(attn_backend: str, tp_gemm_backend: str = "default"):
        # "sdpa": torchtitan's ScaledDotProductAttention (causal, no mask), which its
        # get_attention_config no longer offers language models; FlexAttention has no
        # backward on the CPU
        sdpa = attn_backend == "sdpa"
        cfg = Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=False,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab, embedding_dim=dim,
                param_init={"weight": partial(nn.init.normal_, std=1.0)}),
            norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
            lm_head=Linear.Config(
                in_features=dim, out_features=vocab,
                param_init={"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s,
                                              b=3 * s),
                            "bias": nn.init.zeros_}),
            layers=_build_llama3_layers(
                fuse_qkv=True, n_layers=shape_cfg["num_hidden_layers"], dim=dim,
                n_heads=heads, n_kv_heads=shape_cfg.get("num_key_value_heads", heads),
                hidden_dim=shape_cfg["intermediate_size"],
                # the benchmark's transformers rows apply plain RoPE (no llama3 scaling)
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072,
                                        theta=shape_cfg.get("rope_theta", 10000.0),
                                        scaling="none"),
                attn_backend="flex" if sdpa else attn_backend,
                tp_gemm_backend=tp_gemm_backend))
        if sdpa:
            for layer in cfg.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
        return cfg
    return build


def titan_step(shape_cfg: dict, batch: int, seq: int, *, compile: bool, float8: bool,
               ac: str | None = None, cuda_graphs: bool = True, attn_backend: str = "flex",
               device: str = "cuda",
               ids: torch.Tensor | None = None, seed: int = 0, lr: float = 3e-4):
    """(step callable returning the loss tensor, the model) for torchtitan's training step
    of ``shape_cfg`` on ``batch`` x ``seq`` tokens (module docstring).

    ``attn_backend``: ``'flex'`` (``model_registry``'s default), ``'flex_flash'`` or
    ``'varlen'`` (its other choices), or ``'sdpa'`` (``model_config``).
    ``ac``: None, ``'selective'`` or ``'full'`` (torchtitan's ``SelectiveAC`` / ``FullAC``).
    ``float8``: ``Float8LinearConverter`` with its defaults, as ``llama3_debugmodel_float8``
    applies it (torchao; CUDA only). ``ids``: the token ids, ``batch`` x ``seq`` (random,
    seeded, if None); the model reads them all and predicts each next one (the last
    position's label is ignored). ``cuda_graphs``: the Trainer's
    ``not training.disable_cuda_graphs`` (graphs only on CUDA).
    Under torchtitan 0.2.x, ``_titan02.titan_step`` with the same arguments."""
    if _titan_version().startswith("0.2"):
        import _titan02

        return _titan02.titan_step(shape_cfg, batch, seq, compile=compile, float8=float8,
                                   ac=ac, cuda_graphs=cuda_graphs,
                                   attn_backend=attn_backend, device=device, ids=ids,
                                   seed=seed, lr=lr)
    _torch_compat()
    import spmd_types as spmd
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import (TORCH_DTYPE_MAP, CompileConfig, DebugConfig,
                                   ParallelismConfig, TrainingConfig)
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models import llama3
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.common.token_dispatcher import update_ep_token_dispatcher_config
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.tools import utils as tt_utils

    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        # torchtitan takes the accelerator's type at import ("cuda" where there is none)
        # for its device meshes; a run on the CPU (a check of this module) sets it
        import torchtitan.distributed.parallel_dims as tt_dims

        tt_dims.device_type = tt_utils.device_type = device
    _process_group(device)

    converters = None
    if float8:
        from torchtitan.components.quantization import Float8LinearConverter

        converters = [Float8LinearConverter.Config(model_compile_enabled=compile)]
    llama3.llama3_configs[FLAVOR] = model_config(shape_cfg)
    try:
        # attn_backend: model_registry's default is flex, which llama3_8b keeps
        model_spec = llama3.model_registry(FLAVOR, attn_backend=attn_backend,
                                           converters=converters)
    finally:
        del llama3.llama3_configs[FLAVOR]
    # The parts of Trainer.Config this step reads, each as its default or as llama3_8b
    # sets it (torchtitan.trainer itself is not imported: module docstring).
    training = TrainingConfig(local_batch_size=batch, seq_len=seq,
                              disable_cuda_graphs=not cuda_graphs)
    parallelism = ParallelismConfig()
    compile_config = CompileConfig(enable=compile)
    debug = DebugConfig()
    ac_config = {None: None, "selective": SelectiveAC.Config, "full": FullAC.Config}[ac]
    ac_config = ac_config() if ac_config else None
    loss_config = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(
        global_vocab_size=decoder_vocab_size(model_spec)))
    optimizer_config = default_adamw(lr=lr)
    dump_folder = "./outputs"          # Trainer.Config's; read only by debug options

    # Trainer.__init__, for one process and no pipeline stages
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    mcfg = model_spec.model
    # Llama3Model.Config.update_from_config(config=<Trainer.Config>): RoPE caches sized
    # to training.seq_len, token dispatchers (none here), the sharding declarations
    for layer_cfg in mcfg.layers:
        layer_cfg.attention.rope = dataclasses.replace(layer_cfg.attention.rope,
                                                       max_seq_len=training.seq_len)
    update_ep_token_dispatcher_config(mcfg, types.SimpleNamespace(parallelism=parallelism))
    set_llama3_sharding_config(mcfg, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[training.dtype]):
        model = mcfg.build()
    model.verify_module_protocol()
    loss_fn = loss_config.build(compile_config=compile_config)
    model = model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers,
                                                         training_steps=training.steps)
    train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims,
        spmd_typechecking=(parallelism.spmd_backend == "spmd_types"
                           and debug.spmd_typechecking))

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):
        """Trainer._forward_backward_body."""
        with train_context():
            pred = model(inputs, **extra_kwargs)
            loss_kwargs = {}
            if "positions" in extra_kwargs:
                loss_kwargs["positions"] = extra_kwargs["positions"]
            loss, _ = loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
            del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss

    fwd_bwd = forward_backward
    if not training.disable_cuda_graphs and device == "cuda":
        fwd_bwd = wrap_with_cuda_graph(fwd_bwd)

    ids, labels = ids_and_labels(shape_cfg, batch, seq, ids, device, seed, IGNORE_INDEX)
    # one document a row: its positions count from 0 at the document's start
    positions = torch.arange(seq, device=device).expand(batch, seq).contiguous()
    global_valid_tokens = (labels != IGNORE_INDEX).sum()
    params = list(model.parameters())
    masked = isinstance(mcfg.first_attention.inner_attention,
                        (FlexAttention.Config, VarlenAttention.Config))

    def step():
        # torchtitan's init_distributed turns autograd's device threads off for the whole
        # process (activation checkpointing under spmd_types reads thread-local meshes
        # in the backward); here only around its own step
        with torch.autograd.set_multithreading_enabled(False):
            optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
            # Trainer.post_dataloading_process: the mask from the positions, the types
            extra = {"positions": positions}
            if masked:
                extra["attention_masks"] = model.get_attention_masks(positions=positions)
            inputs, lab = ids, labels
            if parallelism.spmd_backend == "spmd_types":      # the default
                inputs, lab, extra = annotate_input_spmd_types(parallel_dims, ids, labels,
                                                               extra)
            loss = fwd_bwd(inputs, lab, global_valid_tokens, extra)
            dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True,
                                       pp_mesh=None, ep_enabled=False)
            optimizers.step()
            lr_schedulers.step()
        return loss

    return step, model


def release() -> None:
    """Drop the CUDA graphs torchtitan captured (its graph pool outlives the steps);
    0.2.x captures none."""
    if torch.cuda.is_available() and not _titan_version().startswith("0.2"):
        from torchtitan.distributed.cudagraph import cudagraph_teardown

        cudagraph_teardown()

