"""Why pairs of the composition table are not yet shown, or are refused: the cells
``meshlab.transforms.composition`` lists its pairs with, each reason measured or
argued where it is written."""

from __future__ import annotations

from ._cell import AT_OPTIMIZER, RECORDS, SEVERAL_DATA_RANKS, meaningless, not_yet


_ZERO = meaningless("one ZeRO stage for the data axes; keep one zero_shard")
_DTYPE = meaningless("one compute dtype per spec; keep one precision()")
_REDUCE_ONE = meaningless("one reduction dtype per spec; keep one precision()")
_FP8_TP = not_yet(
    "a policy's tensor-parallel regions compute on local shards, where a tensorwise float8 "
    "scale would be taken over a shard (a weight, a row-parallel input, a column-parallel "
    "output's gradient), not over the whole tensor as one process takes it; precision's swap "
    "replaces the modules that hold the regions' hooks, and the first forward raises "
    "RuntimeError (aten.mm got mixed torch.Tensor and DTensor; measured on dp=2, tp=2, "
    "Llama). Specs alone (DTensor mode) run, torchao taking each scale over the whole "
    "DTensor (q, k and v match one process), but a row-parallel product's partial sums are "
    "rounded to bf16 before the reduction and float8 turns that into rounding steps: "
    "measured on tp=2 (a hand-written decoder, SGD, against one process with the same "
    "float8 layers), the loss 2.1e-3 apart at the first step and the head's gradient off by "
    "5e-2 of its largest element (bf16 alone: 4.2e-4 and 6.6e-3); with Megatron sequence "
    "parallelism the first forward raises NotImplementedError (aten.index_select on a "
    "float8 tensor)",
    "{a} with {b}: float8 layers do not yet train like one process under tensor "
    "parallelism (scales over local shards; bf16-rounded partial sums that float8 "
    "magnifies); use precision('bf16') with shard, or precision('fp8') without it")
_OFF_PARAMS = not_yet(
    "parameters rest on the host as the shards of FSDP2 units, which zero_shard(2) and "
    "zero_shard(3) build; data_parallel and zero_shard(1) keep every parameter whole on the "
    "device (DeepSpeed offloads parameters at stage 3 only)",
    "{a}: parameters rest on the host as the shards of FSDP2 units, which zero_shard(2) and "
    "zero_shard(3) build (on one rank too: over a size-1 axis); use one of them or "
    "params=0")
_STEP = not_yet("not yet shown to train like the ordinary step",
                "step_in_backward() with {b} is not yet shown to train like the ordinary "
                "step; leave one of them out")
_STEP_SCALE = not_yet("each parameter is updated before the global gradient norm (and an "
                      "overflow) is known", "step_in_backward() with precision('fp16')'s "
                      "loss scaling: each parameter is updated before the global gradient "
                      "norm is known; leave one of them out", AT_OPTIMIZER)
_SEQ_SG = "spelled shard(..., Rules(seq=<tp axis>)) | sequence(axis, mode): two sequence() " \
          "values in one spec are refused, the room holds one"
_ORDER = "lora(...) | {b}: the sharding reads the model as it was before adapters; write " \
         "{b} | lora(...)"
