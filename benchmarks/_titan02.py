"""torchtitan 0.2.x's llama3 training step at the shapes of ``benchmarks/single_gpu.py``.

``_titan.titan_step`` hands over to ``titan_step`` here when the installed torchtitan is a
0.2 release (``_titan``'s docstring says why). It builds what torchtitan 0.2.2's ``Trainer``
builds for one GPU at data-parallel degree 1 and no pipeline (``torchtitan/train.py``,
``Trainer.__init__``, ``train_step`` and ``forward_backward_step``) with the llama3 train
spec (``torchtitan/models/llama3/__init__.py``) and a ``JobConfig`` of its defaults, except
where ``titan_step`` says otherwise:

* the model: ``TransformerModelArgs`` of the shape's sizes, as ``update_from_config`` leaves
  it (``max_seq_len`` = ``training.seq_len``); the FFN hidden size is exactly the shape's
  intermediate size and RoPE is unscaled (``model_args``); untied embeddings (0.2.2's llama3
  has no tying); the attention of the ``8B`` flavor, causal SDPA. Built on the meta device
  in fp32, converted by ``build_model_converters`` (``quantize.linear.float8`` when
  ``float8``), ``parallelize_llama``, ``to_empty`` and ``init_weights`` (seeded);
* ``parallelize_llama`` at world 1: activation checkpointing if asked, each
  ``TransformerBlock`` compiled with ``fullgraph=True`` when ``compile`` (components model
  and loss), no FSDP (``data_parallel_shard_degree`` resolves to 1, so ``fsdp_enabled`` is
  False): mixed precision is ``maybe_enable_amp``'s ``torch.autocast`` in bf16 around the
  forward and the loss, over fp32 parameters, gradients and AdamW moments;
* the loss: ``build_cross_entropy_loss`` (sum over the tokens, divided by the valid-token
  count in ``forward_backward_step``), compiled when ``compile``;
* ``build_optimizers`` (AdamW, betas 0.9/0.95, weight decay 0.1, eps 1e-8, ``fused``),
  ``build_lr_schedulers`` (linear warm-up of 200 steps over ``training.steps`` = 10000),
  the converters' post-optimizer hook;
* the step: ``zero_grad``, forward and backward, ``clip_grad_norm_`` at
  ``training.max_norm`` (1.0), the optimizer and scheduler steps.

0.2.2's Trainer has no CUDA graphs: ``cuda_graphs`` is accepted and ignored. Its
``GarbageCollection`` (``gc.disable()`` for the process, a collection every 50 steps) is
not reproduced, as ``_titan`` leaves 0.3.0's out. Every torchtitan import is inside the
functions. torchtitan 0.2.2's llama3 model module imports ``torchtitan.protocols.train_spec``
and through it torchtitan's data loading (``torchdata``, ``datasets``, so pandas and
pyarrow) and metrics (``tensorboard``), which the step never calls, and
``torchtitan/__init__.py`` imports triton: they must be importable.
"""

from __future__ import annotations

import math

import torch

# attn_backend -> TransformerModelArgs.attn_type. The benchmark's default, "flex", means
# the attention of 0.2.2's llama3 "8B" flavor, which leaves attn_type at its default,
# "sdpa" (causal); the "8B_flex" flavor's FlexAttention needs a tokenizer's EOS id for
# its block-causal mask and is not offered.
_ATTN_TYPE = {"flex": "sdpa", "sdpa": "sdpa"}


def model_args(shape_cfg: dict, seq: int, attn_backend: str = "flex"):
    """``TransformerModelArgs`` of the benchmark's shape dict (transformers' field names)
    after ``update_from_config`` (``max_seq_len`` = ``seq``)."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    if attn_backend not in _ATTN_TYPE:
        raise ValueError(f"torchtitan 0.2.x: attn_backend {attn_backend!r} not in "
                         f"{sorted(_ATTN_TYPE)}")
    dim = shape_cfg["hidden_size"]
    heads = shape_cfg["num_attention_heads"]
    hidden = shape_cfg["intermediate_size"]
    theta = shape_cfg.get("rope_theta", 10000.0)
    # FeedForward(dim, hidden_dim=4 * dim, multiple_of, ffn_dim_multiplier) computes
    #   h = int(2 * 4 * dim / 3); h = int(ffn_dim_multiplier * h);
    #   h = multiple_of * ceil(h / multiple_of).
    # With multiple_of = intermediate_size and ffn_dim_multiplier = intermediate_size / h0
    # the middle value is intermediate_size or, by rounding, one less, and the rounding up
    # to a multiple of intermediate_size lands on it exactly (checked after the build).
    h0 = int(2 * 4 * dim / 3)
    # precompute_freqs_cis always applies llama3's scaling (the args cannot turn it off).
    # With scaling_factor 1 and original_max_position_embeddings so large that every
    # wavelength (at most 2*pi*theta) is below original/high_freq_factor, every frequency
    # takes the "do nothing" branch: plain RoPE with theta, bit for bit.
    scaling = RoPEScalingArgs(scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=math.ceil(
                                  8 * 4.0 * 2 * math.pi * theta))
    args = TransformerModelArgs(
        dim=dim, n_layers=shape_cfg["num_hidden_layers"], n_heads=heads,
        n_kv_heads=shape_cfg.get("num_key_value_heads", heads),
        vocab_size=shape_cfg["vocab_size"], multiple_of=hidden,
        ffn_dim_multiplier=hidden / h0, norm_eps=shape_cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta, rope_scaling_args=scaling,
        attn_type=_ATTN_TYPE[attn_backend], attn_mask_type="causal")
    # Transformer.update_from_config(job_config): RoPE cache of training.seq_len
    args.max_seq_len = seq
    return args


def titan_step(shape_cfg: dict, batch: int, seq: int, *, compile: bool, float8: bool,
               ac: str | None = None, cuda_graphs: bool = True, attn_backend: str = "flex",
               device: str = "cuda",
               ids: torch.Tensor | None = None, seed: int = 0, lr: float = 3e-4):
    """(step callable returning the loss tensor, the model): torchtitan 0.2.x's training
    step of ``shape_cfg`` on ``batch`` x ``seq`` tokens (module docstring). The arguments
    are ``_titan.titan_step``'s; here ``attn_backend`` is ``'sdpa'`` or ``'flex'`` (both
    the ``8B`` flavor's causal SDPA), ``ac`` ``'selective'`` is ``llama3_8b.toml``'s
    per-op selective checkpointing (``selective_ac_option='op'``), ``float8`` is
    ``model.converters=['quantize.linear.float8']`` with 0.2.2's default ``Float8Linear``
    options (tensorwise scales; SM89 on), and ``cuda_graphs`` is ignored."""
    del cuda_graphs      # 0.2.2's Trainer captures no CUDA graphs
    import torchtitan.distributed.activation_checkpoint as tt_ac
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.model import Transformer
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils as tt_utils

    from _titan import _process_group, ids_and_labels

    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        # torchtitan takes the accelerator's type at import ("cuda" where there is none)
        # for its device meshes and autocast; a run on the CPU (a check of this module)
        # sets it
        import torchtitan.distributed.parallel_dims as tt_dims

        tt_dims.device_type = tt_utils.device_type = device
    device_type = tt_utils.device_type
    _process_group(device)          # Trainer.init_distributed skips an initialized one

    job_config = JobConfig()
    job_config.model.converters = ["quantize.linear.float8"] if float8 else []
    job_config.compile.enable = compile         # components: ["model", "loss"]
    job_config.activation_checkpoint.mode = ac or "none"
    if ac == "selective":
        job_config.activation_checkpoint.selective_ac_option = "op"   # llama3_8b.toml's
    job_config.training.local_batch_size = batch
    job_config.training.seq_len = seq
    job_config.optimizer.lr = lr
    training = job_config.training

    # Trainer.__init__, for one process and no pipeline stages
    parallelism = job_config.parallelism
    parallel_dims = ParallelDims(
        dp_shard=parallelism.data_parallel_shard_degree,
        dp_replicate=parallelism.data_parallel_replicate_degree,
        cp=parallelism.context_parallel_degree, tp=parallelism.tensor_parallel_degree,
        pp=parallelism.pipeline_parallel_degree, ep=parallelism.expert_parallel_degree,
        etp=parallelism.expert_tensor_parallel_degree,
        world_size=torch.distributed.get_world_size())
    assert not (parallel_dims.dp_enabled or parallel_dims.pp_enabled)
    dist_utils.set_determinism(parallel_dims, torch.device(device), job_config.debug,
                               distinct_seed_mesh_dims=["pp"])
    margs = model_args(shape_cfg, training.seq_len, attn_backend)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[training.dtype]):
        model = Transformer(margs)
    for block in model.layers.values():
        if block.feed_forward.w1.out_features != shape_cfg["intermediate_size"]:
            raise AssertionError(f"FFN width {block.feed_forward.w1.out_features} != "
                                 f"intermediate_size {shape_cfg['intermediate_size']}")
    model_converters = build_model_converters(job_config, parallel_dims)
    model_converters.convert(model)
    loss_fn = build_cross_entropy_loss(job_config, parallel_dims=parallel_dims)
    # _apply_layer_sac counts blocks process-wide: start from 0, as a fresh Trainer does
    tt_ac._layer_sac_count = 0
    model = parallelize_llama(model, parallel_dims, job_config)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    model_parts = [model]
    optimizers = build_optimizers(model_parts, job_config.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job_config.lr_scheduler, training.steps)
    optimizers.register_step_post_hook(
        lambda *args, **kwargs: model_converters.post_optimizer_hook(model_parts))
    loss_parallel_enabled = (parallel_dims.tp_enabled
                             and not parallelism.disable_loss_parallel)
    train_context = dist_utils.get_train_context(loss_parallel_enabled)
    maybe_enable_amp = dist_utils.maybe_enable_amp(
        parallel_dims, training.mixed_precision_param, device_type)

    # as _titan (0.2.2's text loader gives no positions for llama3)
    ids, labels = ids_and_labels(shape_cfg, batch, seq, ids, device, seed, IGNORE_INDEX)
    # train_step: the valid-token count, a float on the device when dp is off
    global_valid_tokens = (labels != IGNORE_INDEX).sum().to(device).float()
    params = [p for m in model_parts for p in m.parameters()]

    def step():
        """Trainer.train_step with one microbatch (forward_backward_step, non-PP)."""
        optimizers.zero_grad()
        # post_dataloading_process: no masks for "sdpa", no context parallelism
        with train_context():
            with maybe_enable_amp:
                pred = model(ids)
                loss_sum = loss_fn(pred, labels)
                loss = loss_sum / global_valid_tokens
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True,
                                   pp_mesh=parallel_dims.get_optional_mesh("pp"),
                                   ep_enabled=parallel_dims.ep_enabled)
        optimizers.step()
        lr_schedulers.step()
        return loss

    return step, model
