"""The notes and test ids the composition table's cells cite for float8, activations in
host memory, compiled blocks and the 4-bit QLoRA base (``meshlab.transforms.composition``
lists the cells)."""

from __future__ import annotations

from ._cell import not_yet

_FP8_EXACT = ("tests/transforms/precision/test_float8_gloo.py trains it exactly against one "
              "process that runs each data rank's batch as a microbatch (a dynamic scale is "
              "taken over the batch a rank holds); the generated case compares with the "
              "single process on the whole batch at float8's tolerance")
_FP8_F = "tests/transforms/precision/test_float8_gloo.py"
_FP8_WHOLE = "the generated case compares with the single process on the whole batch at " \
             "float8's tolerance"
_FP8_OFF = (f"{_FP8_F}::test_offload_trains_bitwise_as_without_it trains it bitwise against "
            f"the same zero_shard without offload (shown against one process); {_FP8_WHOLE}")
_FP8_BLOCKS = {r: (f"{_FP8_F}::test_exact_beside_per_rank_blocks[{k}] trains it to float32 "
                   f"rounding against one process whose every linear layer computes apart "
                   f"each block a rank's layer is given ({what}): a dynamic scale is taken "
                   f"over it; {_FP8_WHOLE}")
               for r, k, what in (
                   ("pipeline", "pipeline", "a microbatch of the rank's batch"),
                   ("sequence('all_to_all')", "all_to_all",
                    "the sequence positions the rank holds; the reference repeats K/V to "
                    "every query head before SDPA, as Ulysses does"),
                   ("sequence('ring')", "ring",
                    "the zigzag positions the rank holds; the reference runs the ring's "
                    "blocks and merges on one process, in the ring's order"),
                   ("expert_route", "expert_route",
                    "the batch of the rank, the expert axis reading batches too"),
                   ("lora", "lora", "the batch of the rank; peft's reference with the same "
                    "layers in float8"))}


_OFFACT = "remat(offload)"
_OFFACT_T = "tests/transforms/remat/test_offload.py::test_trains_bitwise_as_kept_on_the_device"
_OFFACT_BITS = "bitwise against the same spec with the activations kept on the device " \
               "(itself shown against one process)"
_OFFACT_NOTE = f"{_OFFACT_T} also trains it bitwise against the same spec with the " \
               f"activations kept on the device"
_OFFACT_NOT = not_yet("not yet shown against one process",
                      "remat(offload=...) with {b} is not yet shown to train as one process "
                      "does; leave offload= out (remat's checkpointing composes with it)")


_AOT = "its parity case compiles with backend='aot_eager' (dynamo's graphs and their " \
       "backward, what composes; inductor's code is shown against eager by " \
       "tests/transforms/compile/test_compile.py)"


_TP_COMPILE = "a policy's tensor-parallel regions trace inside each compiled block (their " \
    "hooks and collectives included); a model that drops (dropout above 0) is refused " \
    "beside them, since the switches between the shared and each rank's random stream " \
    "read and set the generator's state, which dynamo cannot trace"


_FP8_TP_NOTE = "each tensor-parallel module runs torchao's float8 layer on its local shards " \
    "(its regions' hooks carried onto the swapped module), so a tensorwise scale is taken " \
    "over a shard of a weight, of a row-parallel input and of a column-parallel output's " \
    "gradient, where one process takes it over the whole: values round to float8 with " \
    "another scale, within float8's tolerance of one process, as a data rank's scales " \
    "over its own batch are"


_QL = "lora(quantize)"
_QLORA = "tests/transforms/lora/test_qlora_gloo.py::test_qlora_matches_bitsandbytes_and_peft"
_QL_FIX = ("the 4-bit base runs replicated and frozen, beside data_parallel, zero_shard(1) or "
           "zero_shard(2), remat, and precision in fp32, bf16 or fp16 (its products in "
           "quantize's compute dtype); "
           "drop {what}, or drop quantize from lora(...) to train the adapters on a "
           "full-precision base")
_QL_WHY = {
    "shard": "tensor parallelism would split the 4-bit base, whose packed bytes and "
             "per-block scales bitsandbytes keeps whole",
    "zero_shard(3)": "ZeRO-3 would shard the 4-bit base's packed bytes between its uses",
    "offload(params)": "the 4-bit base's packed bytes and scales would move to the host",
    "pipeline": "a pipeline's stages are not yet shown with a 4-bit base",
    "precision('fp8')": "float8 products would replace the 4-bit base's Linear layers",
    "fuse": "fused kernels over the 4-bit base's projections are not written",
    "fuse('attention')": "fused kernels over the 4-bit base's projections are not written",
    "fuse('loss')": "the fused head and loss is not yet shown beside a 4-bit base",
}


def _qlora_refused(row: str) -> Cell:
    """``lora(quantize)`` beside ``row``: not yet (plan raises), naming the fix."""
    why = _QL_WHY.get(row, f"{row} is not yet shown to train with a 4-bit base against "
                           f"one process")
    fix = _QL_FIX.format(what=row if row != "lora(quantize)" else "it")
    return not_yet(why, message="{a} with {b}: " + why + "; " + fix)
