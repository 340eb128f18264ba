"""Why pairs of the composition table are not yet shown, or are refused: the cells
``meshlab.transforms.composition`` lists its pairs with, each reason measured or
argued where it is written."""

from __future__ import annotations

from ._cell import AT_OPTIMIZER, RECORDS, SEVERAL_DATA_RANKS, meaningless, not_yet


_ZERO = meaningless("one ZeRO stage for the data axes; keep one zero_shard")
_DTYPE = meaningless("one compute dtype per spec; keep one precision()")
_REDUCE_ONE = meaningless("one reduction dtype per spec; keep one precision()")
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
