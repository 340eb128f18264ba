"""Why pairs of the composition table are not yet shown, or are refused: the cells
``meshlab.transforms.composition`` lists its pairs with, each reason measured or
argued where it is written."""

from __future__ import annotations

from ._cell import AT_OPTIMIZER, RECORDS, SEVERAL_DATA_RANKS, TP_REGIONS, meaningless, not_yet


_ZERO = meaningless("one ZeRO stage for the data axes; keep one zero_shard")
_DTYPE = meaningless("one compute dtype per spec; keep one precision()")
_REDUCE_ONE = meaningless("one reduction dtype per spec; keep one precision()")
_FP8_NO = not_yet("torchao's float8 layers are not yet shown to train like one process with it",
                  "{a} with {b}: float8 layers are not yet shown to train like one process "
                  "beside it; use precision('bf16') there")
_FP8_SCALE = not_yet("float8 training scales each tensor itself and runs beside bf16, which "
                     "needs no loss scale", "{a} with {b}: float8 training takes no loss "
                     "scale; leave loss_scale out")
_PIPE_ZERO = not_yet("FSDP2 under the pipeline schedule is not supported",
                     "pipeline with zero_shard(stage >= 2) is not supported; use "
                     "zero_shard(1, ...) on the data-parallel axis")
_PIPE_SP = not_yet("Megatron SP between pipeline stages is not supported",
                   "pipeline with sequence parallelism is not supported; map 'seq' to None "
                   "in Rules")
_SEQ_PIPE = {m: not_yet(f"sequence({m}) between pipeline stages is not supported",
                        f"sequence({m}) with pipeline is not supported")
             for m in ("all_to_all", "ring")}
_OFF_PIPE = not_yet("offload is not yet shown to match the single process under pipeline "
                    "stages", "{a} with {b}: offload is not yet shown to match the single "
                    "process under pipeline stages; drop one of them", RECORDS)
_OFF_SEQ = not_yet("offload is not yet shown to match the single process under "
                   "sequence-parallel attention", "{a} with {b}: offload is not yet shown to "
                   "match the single process under sequence-parallel attention; drop one of "
                   "them", RECORDS)
_OFF_GRADS_SEQ = not_yet(
    "offloaded gradients miss the sum over the sequence axis: measured on sp=2 (SGD, float32), "
    "updates off by 2x their size at the first step",
    "{a} with {b}: gradients offloaded as the backward makes them miss the sum over the "
    "sequence axis (measured: updates off by 2x); use offload(optimizer=...) alone",
    RECORDS, note="offload(params) takes the offload(grads) row too")
_OFF_GRADS_EXPERT = not_yet(
    "offloaded gradients do not train like one process beside expert parallelism (measured "
    "on 2 ranks, SGD, float32)",
    "{a} with {b}: gradient offload beside expert parallelism does not yet train like one "
    "process; use offload(optimizer=...)", RECORDS,
    note="offload(params) takes the offload(grads) row too")
_OFF_TP = not_yet("offload is not yet shown to match the single process with sharded "
                  "parameters", "{a} with tensor parallelism over {tp!r}: offload is not yet "
                  "shown to match the single process with sharded parameters; offload under "
                  "zero_shard only", RECORDS)
_OFF_GRADS = not_yet(
    "gradients reduced after the backward cannot leave the device as the backward makes "
    "them", "{a} under {b} over {ranks} data ranks: the gradients are reduced after the "
    "backward there (whole on every rank until the step), so they cannot leave the device "
    "as the backward makes them; use zero_shard(2) or zero_shard(3), or grads=0",
    scope=SEVERAL_DATA_RANKS)
_OFF_PARAMS = not_yet(
    "parameters leave the device per FSDP2 unit, which needs zero_shard(3)",
    "{a}: parameters leave the device per FSDP2 unit, which needs zero_shard(3) (on one "
    "rank too: zero_shard(3) over a size-1 axis); add it or use params=0")
_REDUCE = {d: not_yet(f"only FSDP2 reduces gradients in {d}",
                      "{a} with {b}: gradients are reduced in " + d + " only by FSDP2 "
                      "(zero_shard(2) or zero_shard(3)); this room reduces them in fp32. Use "
                      "reduce='fp32', or zero_shard(2)", scope=SEVERAL_DATA_RANKS)
           for d in ("bfloat16", "float16")}
_EXPERT = not_yet("expert parallelism is not yet shown to match the single process with it",
                  "{a} with {b}: not yet shown to match the single process; drop one of them",
                  RECORDS)
_EXPERT_SP = not_yet(
    "each tensor-parallel rank would route another part of every sequence",
    "{a} with sequence parallelism over {tp!r} (seq -> {tp!r} in the rules): each "
    "tensor-parallel rank would route another part of every sequence; not yet shown to "
    "match the single process", RECORDS,
    note="shard's tensor-parallel layout raises ConfigError first: the experts, "
         "replicated over the tensor-parallel axis, would see part of the activations")
_LORA_NO = not_yet("not yet shown to match single-process peft",
                   "{a} with {b}: not yet shown to match single-process peft; drop one of "
                   "them", RECORDS)
_COMPILE = not_yet("not yet shown to train like the eager model",
                   "compile_blocks() with {b} is not yet shown to train like the eager model; "
                   "leave one of them out")
_SHARD_COMPILE = not_yet(
    "a policy's tensor-parallel modules show their forward the local shards through the "
    "module's __dict__ (set in a pre-hook), which dynamo does not read: it traces the "
    "DTensor parameters, and the first forward of a compiled block raises TorchRuntimeError "
    "(aten.mm got mixed torch.Tensor and DTensor; measured on tp=2, Llama, aot_eager); the "
    "switches of the dropout stream around each region (torch.Generator.get_state, in a "
    "model that drops) would break the graph too",
    "compile_blocks() with tensor parallelism over {tp!r}: the compiled blocks would trace "
    "the DTensor parameters where each tensor-parallel module computes on its local shard; "
    "leave one of them out, or shard by specs alone (no policy regions), which composes", scope=TP_REGIONS,
    note="specs alone (no policy regions: the model's own forward on DTensors) compose, "
         "trained against one process by tests/transforms/test_handwritten_gloo.py::"
         "test_composes_with_zero_remat_and_compile[compile] and against the eager run by "
         "tests/transforms/compile/test_compile.py::test_blocks_compile_in_dtensor_mode_gloo")
_STEP = not_yet("not yet shown to train like the ordinary step",
                "step_in_backward() with {b} is not yet shown to train like the ordinary "
                "step; leave one of them out")
_STEP_SCALE = not_yet("each parameter is updated before the global gradient norm (and an "
                      "overflow) is known", "step_in_backward() with precision('fp16')'s "
                      "loss scaling: each parameter is updated before the global gradient "
                      "norm is known; leave one of them out", AT_OPTIMIZER)
_FUSE_LOSS_PIPE = not_yet("the last stage's loss comes from the schedule's loss_fn on "
                          "logits", "fuse('loss') with pipeline(): the last stage's loss "
                          "comes from the schedule's loss_fn on logits; leave 'loss' out of "
                          "fuse()")
_FUSE_ATTN_SEQ = not_yet("sequence parallelism installs its own attention",
                         "fuse('attention') with sequence(): sequence parallelism installs "
                         "its own attention; leave 'attention' out of fuse()")
_TWO_SEQ = not_yet("Ulysses over one axis with ring attention over another (2-D sequence "
                   "parallelism) is not yet supported; one sequence() per spec")
_SEQ_SG = "spelled shard(..., Rules(seq=<tp axis>)) | sequence(axis, mode): two sequence() " \
          "values in one spec are refused, the room holds one"
_SG_2D = {m: not_yet(
    f"Megatron sequence parallelism over one axis with sequence('{m}') over another does "
    f"not train like one process: measured on tp=2, sp=2 (float64, SGD), {diff}",
    "{a} with {b}: Megatron sequence parallelism with sequence('" + m + "') over another "
    "axis does not yet train like one process; keep one of them (map 'seq' to None in Rules, "
    "or drop sequence())", RECORDS, note=_SEQ_SG)
    for m, diff in (("all_to_all", "the loss is off by 2.6e-2 at the first step and every "
                                   "gradient differs (lm_head's by 1.2 times its largest "
                                   "element)"),
                    ("ring", "the loss is off by 4.5e-3 at the first step and every gradient "
                             "differs (lm_head's by 1.5 times its largest element)"))}
_ORDER = "lora(...) | {b}: the sharding reads the model as it was before adapters; write " \
         "{b} | lora(...)"
