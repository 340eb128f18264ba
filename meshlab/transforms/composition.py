"""The composition table: what composes with what, as data every room's check reads.

Its rows are transforms as users spell them; variants that behave differently are rows
of their own (``data_parallel`` and each ``zero_shard`` stage, each ``offload`` target,
each ``sequence`` mode, each ``precision`` mode, the ``fuse`` ops other rooms care about).
A transform names the rows it takes in a bound plan with ``Transform.rows(plan)``. Each
unordered pair of rows is one ``Cell``:

* ``composes``, with ``test``: the node id of a test that trains the pair against one
  process: an earlier test, or the pair's case of ``tests/transforms/test_table_parity.py``,
  which runs every composing cell (``parity_test``); every cell of this table names one;
* ``not yet``, with the reason and how it is refused: ``plan`` raises ``ConfigError``
  (``RAISES``), records ``NotRunnable`` in ``plan.not_runnable`` for ``parallelize`` to
  raise (``RECORDS``), or ``meshlab.optimizer`` refuses it (``AT_OPTIMIZER``); ``scope``
  narrows a refusal to meshes with more than one data rank;
* ``meaningless``: two variants of one kind on one axis (two ZeRO stages).

``Transform.composition_check`` reads the table for every pair of rows of a bound plan
(``Plan.bind`` calls it once), and ``|`` reads it for two transforms of one kind or a
pair written in the wrong order. A transform written outside meshlab declares its row's
cells in a ``composition`` class attribute (``{row: Cell}``); a row it names no cell for
is ``not yet``. ``docs/composition.md`` is ``page()``; ``scripts/composition_matrix.py``
measures the table against ``meshlab.plan``.

>>> cell("step_in_backward", "zero_shard(1)").describe()
'not yet (plan raises ConfigError)'
>>> cell("sequence('all_to_all')", "sequence('ring')").describe()
'composes'
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from ._cell import (ALWAYS as ALWAYS, AT_OPTIMIZER as AT_OPTIMIZER, COMPOSES as COMPOSES,
                    MEANINGLESS as MEANINGLESS, NOT_YET as NOT_YET, PAGE as PAGE,
                    RAISES as RAISES, RECORDS as RECORDS,
                    SEVERAL_DATA_RANKS as SEVERAL_DATA_RANKS, TP_REGIONS as TP_REGIONS,
                    Cell as Cell,
                    composes as composes, meaningless as meaningless, not_yet as not_yet)

# -- the rows, in the page's order ---------------------------------------------------------
ROWS: dict[str, str] = {
    "shard": "tensor parallelism: parameter specs over the tensor-parallel axis",
    "data_parallel": "zero_shard(0): replicated parameters, gradients all-reduced",
    "zero_shard(1)": "optimizer state sharded over the data axes (meshlab's flat optimizer)",
    "zero_shard(2)": "optimizer state and gradients sharded (FSDP2)",
    "zero_shard(3)": "optimizer state, gradients and parameters sharded (FSDP2; also "
                     "parameter specs over a data axis)",
    "offload(optimizer)": "optimizer state and fp32 masters in host memory (CPU AdamW)",
    "offload(grads)": "gradients leave the device in the backward",
    "offload(params)": "FSDP2 units keep their parameter shards in host memory",
    "pipeline": "the blocks split into stages over a mesh axis",
    "sequence('split_gather')": "Megatron sequence parallelism inside tensor parallelism "
                                "(also shard with seq -> the tensor-parallel axis)",
    "sequence('all_to_all')": "Ulysses: attention exchanges sequence for heads",
    "sequence('ring')": "ring attention: K/V blocks travel around the ranks",
    "expert_route": "experts sharded over an expert axis, tokens dispatched to them",
    "lora": "low-rank adapters through peft, the base frozen",
    "lora(quantize)": "QLoRA: lora(..., quantize=...), the frozen base held in 4 bits by "
                      "bitsandbytes (also takes the lora row)",
    "remat": "activation checkpointing of the blocks",
    "remat(offload)": "blocks' saved activations in host memory from their forward to their "
                      "backward (remat(..., offload=k))",
    "precision('fp32')": "fp32 compute",
    "precision('bf16')": "bf16 compute (autocast; FSDP2's mixed precision)",
    "precision('fp16')": "fp16 compute",
    "precision(reduce='bf16')": "gradients reduced in bf16",
    "precision(reduce='fp16')": "gradients reduced in fp16",
    "precision(loss_scale)": "a loss scale (fp16's default 'dynamic', or fixed)",
    "precision('fp8')": "float8 products of the linear layers (torchao), bf16 elsewhere",
    "fuse": "fused RMSNorm, rotary embedding and gated MLP (fuse('rms_norm', 'rotary', "
            "'mlp'))",
    "fuse('attention')": "meshlab's fused attention",
    "fuse('loss')": "the fused head and cross-entropy",
    "compile_blocks": "torch.compile of every block",
    "step_in_backward": "each parameter updated in the backward as its gradient completes",
}

# -- the tests that train a pair against one process ---------------------------------------
_PAR = "tests/transforms/test_parallel_gloo.py::test_parity_world4"
_HAND = "tests/transforms/test_handwritten_gloo.py::test_composes_with_zero_remat_and_compile"
_TRAIN = "tests/train/test_train_gloo.py"
_PIPE = "tests/transforms/pipeline/test_pipeline_gloo.py"
_EXP = "tests/transforms/expert/test_expert_gloo.py"
_LORA = "tests/transforms/lora/test_lora_gloo.py"
_FUSE = "tests/transforms/fuse/test_fuse.py"
_SEQ = "tests/transforms/sequence/test_sequence_gloo.py::test_sequence_modes"
_BOOST = "tests/booster/test_booster_gloo.py"
_OFF = "tests/transforms/offload/test_offload_gloo.py::" \
       "test_fractions_match_no_offload_bitwise_on_2_ranks"
_COMP = "tests/transforms/compile/test_compile.py::test_compiled_blocks_gloo"
_SIB = "tests/transforms/step_in_backward/test_step_in_backward.py::" \
       "test_trains_as_the_ordinary_step"
_FP16 = f"{_BOOST}::test_mixed_precision_through_the_booster"
_GUIDE = f"{_BOOST}::test_guide_scaffold_trains_like_one_process"
_VS_ZERO = "bitwise against the same zero_shard without offload (itself shown against one " \
           "process)"
_VS_EAGER = "against the same spec run eagerly (itself shown against one process)"
_VS_STEP = "against the ordinary step of the same spec on one process"
_HYBRID = "hybrid sharding over two data axes: data_parallel('rep') | zero_shard({s}, 'dp') " \
          "is one value, zero_shard({s}, 'dp', replicate='rep'), the batch split over " \
          "both; {how}; the same axis given to both is refused by name"
_HOW = {1: "gradients all-reduced over rep from the backward, then ZeRO-1's reduce-scatter "
           "over dp",
        2: "FSDP2 on the 2-D mesh (rep, dp) (HSDP; rep first in the mesh)",
        3: "FSDP2 on the 2-D mesh (rep, dp) (HSDP; rep first in the mesh)"}
_PP_FSDP = "torchtitan's layout: each pipeline stage module is an FSDP2 root over its " \
           "blocks' units (embeddings on the first stage, norm and head on the last " \
           "in the root's unit), gradients reduce-scattered once per schedule, after " \
           "each stage's last microbatch; tests/transforms/pipeline/test_pipeline_gloo.py" \
           "::test_pp2_zero_matches_one_process also trains 1F1B, interleaved and GPipe " \
           "against one process in float64, and sums forward/backward calls without " \
           "zero_grad (an evaluation between them too); zero_bubble and zbv, whose " \
           "backward is split, are refused by the pipeline's check (measured: weights off " \
           "after the first step under zero_shard(3), a hang for zbv under zero_shard(2))"
_HEAD = "the output head split over the vocabulary: the fused loss is the split one " \
        "(meshlab.ops.linear_cross_entropy_split), chunked over tokens, each rank's rows " \
        "of the vocabulary and one all-gather of two numbers a token per chunk, so no " \
        "rank builds the logits or its shard of them"

# -- why pairs are not yet shown, and today's refusals: meshlab/transforms/_reasons.py
from ._reasons import _DTYPE, _ORDER, _REDUCE_ONE, _SEQ_SG, _STEP, _STEP_SCALE, _ZERO

_OFFLOADS = ("offload(optimizer)", "offload(grads)", "offload(params)")
_SEQS = ("sequence('split_gather')", "sequence('all_to_all')", "sequence('ring')")
_PRECS = ("precision('fp32')", "precision('bf16')", "precision('fp16')",
          "precision(reduce='bf16')", "precision(reduce='fp16')", "precision(loss_scale)")
_FUSES = ("fuse", "fuse('attention')", "fuse('loss')")
# the rows beside a 4-bit base that leave it whole and in place: its products are cast by
# autocast or run in quantize's compute dtype, only the adapters' gradients are reduced
_QL_TRAINED = "remat " + " ".join(r for r in _PRECS if r != "precision('fp32')")
_FP8 = "precision('fp8')"
from ._cell_notes import (_AOT, _FP8_BLOCKS, _FP8_EXACT, _FP8_OFF, _FP8_TP_NOTE,  # noqa: E402
                          _OFFACT, _OFFACT_BITS, _OFFACT_NOT, _OFFACT_NOTE, _OFFACT_T,
                          _TP_COMPILE, _QL, _QLORA, _qlora_refused)

_PARITY = "tests/transforms/test_table_parity.py::test_cell"

def parity_test(a: str, b: str) -> str:
    """The node id of the case of ``tests/transforms/test_table_parity.py`` (generated from
    this table: one case per composing cell) that trains ``a x b`` against one process."""
    if a in ROWS and b in ROWS and list(ROWS).index(a) > list(ROWS).index(b):
        a, b = b, a
    return f"{_PARITY}[{a.replace(chr(39), '')}-{b.replace(chr(39), '')}]"


def _each(rows: Iterable[str], other: str, c: Cell) -> list:
    """The same cell for ``row x other``, each of ``rows``."""
    return [(r, other, c) for r in rows]


def _shown(a: str, b: str, note: str = "") -> Cell:
    """A pair that composes, trained against one process by its case of the table's own
    parity tests (``parity_test``)."""
    if "compile_blocks" in (a, b):
        note = f"{note}; {_AOT}" if note else _AOT
    return composes(parity_test(a, b), note)


def _trained(row: str, others: str) -> list:
    """Pairs that compose, each trained by its case of the table's own parity tests
    (``others`` space-separated)."""
    return [(row, o, _shown(row, o)) for o in others.split()]


def _t(test: str, note: str = "") -> Cell:
    return composes(test, note)


# Every unordered pair of ROWS once, as (a, b, cell): ``_index`` refuses a pair given twice.
_LISTED: list[tuple[str, str, Cell]] = [
    # shard
    ("shard", "data_parallel", _t(f"{_PAR}[llama-tp]")),
    ("shard", "zero_shard(1)", _t(f"{_HAND}[zero1]")),
    ("shard", "zero_shard(3)", _t(f"{_PAR}[llama-tp_zero3]")),
    *[("shard", o, _shown("shard", o)) for o in _OFFLOADS],
    ("shard", "pipeline", _t(f"{_PIPE}::test_pp2_composed[tp-pp=2,tp=2]")),
    ("shard", "sequence('split_gather')", _t(f"{_PAR}[llama-tp_sp]")),
    ("shard", "expert_route", _t(f"{_EXP}::test_four_ranks_match_one_process[mixtral-ep2_tp2]")),
    ("lora", "shard", composes(f"{_LORA}::test_lora_under_tensor_parallelism[False]",
                               before="shard", message=_ORDER)),
    ("shard", "remat", _t(f"{_TRAIN}::test_remat_keeps_the_numbers[full-tp]")),
    ("shard", "precision('bf16')", _t(f"{_TRAIN}::test_bf16[tp]")),
    ("shard", "fuse", _t(f"{_FUSE}::test_fuse_composes_gloo[tp-ops2]")),
    ("shard", "fuse('attention')", _t(f"{_FUSE}::test_fuse_composes_gloo[tp-ops2]")),
    ("shard", "fuse('loss')", _shown("shard", "fuse('loss')", _HEAD)),
    ("step_in_backward", "shard", _STEP),
    ("shard", "compile_blocks", _shown("shard", "compile_blocks", _TP_COMPILE)),
    *_trained("shard", "zero_shard(2) sequence('all_to_all') sequence('ring') "
                        "precision('fp32') precision('fp16') precision(reduce='bf16') "
                        "precision(reduce='fp16') precision(loss_scale)"),
    # data_parallel
    *[("data_parallel", f"zero_shard({s})",
       _shown("data_parallel", f"zero_shard({s})", _HYBRID.format(s=s, how=_HOW[s])))
      for s in (1, 2, 3)],
    ("offload(grads)", "data_parallel", _shown("offload(grads)", "data_parallel")),
    ("offload(params)", "data_parallel", _shown("offload(params)", "data_parallel")),
    ("data_parallel", "pipeline", _t(f"{_FP16}[pp_fp16]")),
    ("data_parallel", "sequence('split_gather')", _t(f"{_PAR}[llama-tp_sp]")),
    ("data_parallel", "sequence('all_to_all')", _t(f"{_SEQ}[all_to_all-dp=2,sp=2-llama]")),
    ("data_parallel", "sequence('ring')", _t(f"{_SEQ}[ring-dp=2,sp=2-llama]")),
    ("data_parallel", "expert_route",
     _t(f"{_EXP}::test_four_ranks_match_one_process[mixtral-ep2_dp2]")),
    ("data_parallel", "lora", _t(f"{_LORA}::test_lora_matches_single_process_peft[False-dp]")),
    ("data_parallel", "remat", _t(f"{_TRAIN}::test_remat_keeps_the_numbers[full-tp]")),
    ("data_parallel", "precision('bf16')", _t(f"{_TRAIN}::test_bf16[dp]")),
    ("data_parallel", "precision('fp16')", _t(f"{_FP16}[pp_fp16]")),
    *[(r, "data_parallel", _shown(r, "data_parallel"))
      for r in ("precision(reduce='bf16')", "precision(reduce='fp16')")],
    ("data_parallel", "precision(loss_scale)", _t(f"{_FP16}[pp_fp16]")),
    ("data_parallel", "compile_blocks", _t(f"{_COMP}[remat]", _VS_EAGER)),
    ("step_in_backward", "data_parallel", _STEP),
    *_trained("data_parallel", "offload(optimizer) precision('fp32') fuse fuse('attention') "
                                "fuse('loss')"),
    # zero_shard(1)
    ("zero_shard(1)", "zero_shard(2)", _ZERO),
    ("zero_shard(1)", "zero_shard(3)", _ZERO),
    ("zero_shard(1)", "offload(optimizer)", _t(_OFF, _VS_ZERO)),
    ("offload(grads)", "zero_shard(1)", _shown("offload(grads)", "zero_shard(1)")),
    ("offload(params)", "zero_shard(1)", _shown("offload(params)", "zero_shard(1)")),
    ("zero_shard(1)", "pipeline", _t(f"{_PIPE}::test_pp2_composed[zero1-pp=2,dp=2]")),
    ("zero_shard(1)", "expert_route", _t(f"{_BOOST}::test_loop_matches_one_process[moe]")),
    ("zero_shard(1)", "lora",
     _t(f"{_LORA}::test_lora_matches_single_process_peft[False-zero1]")),
    ("zero_shard(1)", "precision('fp16')", _t(f"{_FP16}[zero_fp16]")),
    *[(r, "zero_shard(1)", _shown(r, "zero_shard(1)"))
      for r in ("precision(reduce='bf16')", "precision(reduce='fp16')")],
    ("zero_shard(1)", "precision(loss_scale)", _t(f"{_FP16}[zero_fp16]")),
    *[("zero_shard(1)", f, _t(f"{_FUSE}::test_fuse_composes_gloo[zero1-ops1]"))
      for f in _FUSES],
    ("step_in_backward", "zero_shard(1)", _STEP),
    *_trained("zero_shard(1)", "sequence('split_gather') sequence('all_to_all') "
                                "sequence('ring') remat precision('fp32') precision('bf16') "
                                "compile_blocks"),
    # zero_shard(2)
    ("zero_shard(2)", "zero_shard(3)", _ZERO),
    ("offload(params)", "zero_shard(2)", _shown("offload(params)", "zero_shard(2)")),
    ("zero_shard(2)", "pipeline", _shown("zero_shard(2)", "pipeline", _PP_FSDP)),
    ("zero_shard(2)", "lora",
     _t(f"{_LORA}::test_lora_matches_single_process_peft[False-zero2]")),
    ("step_in_backward", "zero_shard(2)", _STEP),
    *_trained("zero_shard(2)", "offload(optimizer) offload(grads) sequence('split_gather') "
                                "sequence('all_to_all') sequence('ring') expert_route remat "
                                + " ".join(_PRECS + _FUSES) + " compile_blocks"),
    # zero_shard(3)
    ("zero_shard(3)", "offload(optimizer)",
     _t(f"{_BOOST}::test_loop_matches_one_process[gemini]")),
    ("zero_shard(3)", "offload(grads)", _t(_OFF, _VS_ZERO)),
    ("zero_shard(3)", "offload(params)", _t(_OFF, _VS_ZERO)),
    ("zero_shard(3)", "pipeline", _shown("zero_shard(3)", "pipeline", _PP_FSDP)),
    ("zero_shard(3)", "expert_route",
     _t(f"{_EXP}::test_four_ranks_match_one_process[mixtral-ep2_zero3]")),
    ("zero_shard(3)", "lora",
     _t(f"{_LORA}::test_lora_matches_single_process_peft[False-zero3]")),
    ("zero_shard(3)", "remat", _t(f"{_TRAIN}::test_remat_keeps_the_numbers[full-zero3]")),
    ("zero_shard(3)", "precision('bf16')", _t(f"{_TRAIN}::test_bf16[zero3]")),
    *[("zero_shard(3)", f, _t(f"{_FUSE}::test_fuse_composes_gloo[zero3-ops0]"))
      for f in _FUSES],
    ("zero_shard(3)", "compile_blocks", _t(f"{_COMP}[zero3]", _VS_EAGER)),
    ("zero_shard(3)", "step_in_backward", _shown("zero_shard(3)", "step_in_backward")),
    *_trained("zero_shard(3)", "sequence('split_gather') sequence('all_to_all') "
                                "sequence('ring') precision('fp32') precision('fp16') "
                                "precision(reduce='bf16') precision(reduce='fp16') "
                                "precision(loss_scale)"),
    # offload: one value holds its three targets
    ("offload(optimizer)", "offload(grads)", _t(_OFF, _VS_ZERO)),
    ("offload(optimizer)", "offload(params)", _t(_OFF, _VS_ZERO)),
    ("offload(grads)", "offload(params)", _t(_OFF, _VS_ZERO)),
    *[(o, "pipeline", _shown(o, "pipeline")) for o in _OFFLOADS],
    *[(o, "sequence('split_gather')", _shown(o, "sequence('split_gather')"))
      for o in _OFFLOADS],
    *[(o, s, _shown(o, s)) for o in _OFFLOADS for s in _SEQS[1:]],
    *[("expert_route", o, _shown("expert_route", o)) for o in _OFFLOADS],
    *[("lora", o, _shown("lora", o)) for o in _OFFLOADS],
    *[("compile_blocks", o, _shown("compile_blocks", o)) for o in _OFFLOADS],
    *[("step_in_backward", o, _STEP) for o in _OFFLOADS],
    *[(o, x, _shown(o, x)) for o in _OFFLOADS for x in ("remat",) + _PRECS + _FUSES],
    # pipeline
    *[("pipeline", s, _shown("pipeline", s)) for s in _SEQS],
    ("pipeline", "expert_route",
     _t(f"{_EXP}::test_pipeline_with_expert_parallelism[mixtral-1f1b]")),
    ("pipeline", "lora", _t(f"{_LORA}::test_lora_matches_single_process_peft[False-pp2]")),
    ("pipeline", "precision('bf16')", _t(_GUIDE)),
    ("pipeline", "precision('fp16')", _t(f"{_FP16}[pp_fp16]")),
    ("pipeline", "precision(loss_scale)", _t(f"{_FP16}[pp_fp16]")),
    ("pipeline", "fuse", _t(f"{_PIPE}::test_pp2_fused_ops")),
    ("pipeline", "fuse('attention')", _t(f"{_PIPE}::test_pp2_fused_ops")),
    ("fuse('loss')", "pipeline", _shown("fuse('loss')", "pipeline")),
    ("compile_blocks", "pipeline", _shown("compile_blocks", "pipeline")),
    ("step_in_backward", "pipeline", _STEP),
    *_trained("pipeline", "remat precision('fp32') precision(reduce='bf16') "
                           "precision(reduce='fp16')"),
    # sequence('split_gather')
    *[("sequence('split_gather')", s, _shown("sequence('split_gather')", s, _SEQ_SG))
      for s in _SEQS[1:]],
    ("expert_route", "sequence('split_gather')", _shown("expert_route",
                                                         "sequence('split_gather')")),
    ("lora", "sequence('split_gather')", _shown("lora", "sequence('split_gather')")),
    ("sequence('split_gather')", "remat",
     _t(f"{_TRAIN}::test_remat_keeps_the_numbers[selective-tp_sp]")),
    ("sequence('split_gather')", "fuse('loss')", _shown("sequence('split_gather')",
                                                        "fuse('loss')", _HEAD)),
    ("compile_blocks", "sequence('split_gather')",
     _shown("compile_blocks", "sequence('split_gather')", _TP_COMPILE)),
    ("step_in_backward", "sequence('split_gather')", _STEP),
    *_trained("sequence('split_gather')", " ".join(_PRECS) + " fuse fuse('attention')"),
    # sequence('all_to_all') and sequence('ring')
    ("sequence('all_to_all')", "sequence('ring')", _shown(
        "sequence('all_to_all')", "sequence('ring')",
        "2-D sequence parallelism: sequence('sp', 'all_to_all') | sequence('cp', 'ring') is "
        "one value, sequence('sp', mode='all_to_all', ring='cp'); Ulysses' all-to-all over sp "
        "gives each rank H/sp heads of its ring part, ring attention runs over cp; "
        "tests/transforms/sequence/test_sequence_gloo.py::test_ulysses_around_the_ring also "
        "trains it with grouped K/V heads and a padded batch against one process")),
    *[("expert_route", s, _shown("expert_route", s)) for s in _SEQS[1:]],
    *[("lora", s, _shown("lora", s)) for s in _SEQS[1:]],
    *[("fuse('attention')", s, _shown("fuse('attention')", s)) for s in _SEQS[1:]],
    ("compile_blocks", "sequence('all_to_all')", _shown("compile_blocks", "sequence('all_to_all')")),
    ("compile_blocks", "sequence('ring')", _shown("compile_blocks", "sequence('ring')")),
    *[("step_in_backward", s, _STEP) for s in _SEQS[1:]],
    *[(s, x, _shown(s, x)) for s in _SEQS[1:] for x in ("remat",) + _PRECS
      + ("fuse", "fuse('loss')")],
    # expert_route
    ("lora", "expert_route", _shown("lora", "expert_route")),
    ("expert_route", "remat", _t(f"{_EXP}::test_ep2_with_remat_matches_one_process[mixtral]")),
    ("expert_route", "precision('bf16')",
     _t(f"{_EXP}::test_ep2_under_bf16_matches_one_process_under_autocast")),
    ("expert_route", "fuse", _shown("expert_route", "fuse", "fuse() leaves 'mlp' out in a model "
                                    "whose MLPs are mixtures of experts (nothing to route; the "
                                    "plan's FuseLeft says so), and fuse('mlp') named is refused")),
    ("compile_blocks", "expert_route", _shown("compile_blocks", "expert_route")),
    ("step_in_backward", "expert_route", _STEP),
    *_trained("expert_route", "precision('fp32') precision('fp16') precision(reduce='bf16') "
                               "precision(reduce='fp16') precision(loss_scale) "
                               "fuse('attention') fuse('loss')"),
    # lora
    ("lora", "precision('bf16')", _t(f"{_LORA}::test_lora_under_bf16")),
    ("compile_blocks", "lora", _shown("compile_blocks", "lora")),
    ("lora", "step_in_backward", _shown("lora", "step_in_backward")),
    *_trained("lora", "remat precision('fp32') precision('fp16') precision(reduce='bf16') "
                       "precision(reduce='fp16') precision(loss_scale) fuse "
                       "fuse('attention') fuse('loss')"),
    # lora(quantize): the 4-bit base runs replicated and frozen; what would split, move or
    # replace it is refused by name
    ("lora", _QL, _t(f"{_QLORA}[dp]", "one value takes both rows")),
    *[(r, _QL, _t(f"{_QLORA}[{case}]")) for r, case in (
        ("data_parallel", "dp"), ("zero_shard(1)", "zero1"), ("zero_shard(2)", "zero2"),
        ("precision('fp32')", "dp_fp32"))],
    *_trained(_QL, _QL_TRAINED),
    *[(r, _QL, _qlora_refused(r)) for r in ROWS if r not in (
        "lora", _QL, "data_parallel", "zero_shard(1)", "zero_shard(2)", "precision('fp32')")
      and r not in _QL_TRAINED.split()],
    # remat
    ("remat", "compile_blocks", _t(f"{_COMP}[remat]", _VS_EAGER)),
    ("remat", "step_in_backward", _t(f"{_SIB}[AdamW-fuse_remat]", _VS_STEP)),
    *_trained("remat", " ".join(_PRECS + _FUSES)),
    # remat(offload): one remat value holds it
    *[("remat", _OFFACT, _shown("remat", _OFFACT, _OFFACT_NOTE))],
    *[(r, _OFFACT, _shown(r, _OFFACT, _OFFACT_NOTE)) for r in ("data_parallel",)],
    *[(_OFFACT, r, _shown(_OFFACT, r, _OFFACT_NOTE))
      for r in ("precision('fp32')", "precision('bf16')") + _FUSES],
    (_OFFACT, "step_in_backward", _t(f"{_OFFACT_T}[sib]", _OFFACT_BITS)),
    *[(r, _OFFACT, _OFFACT_NOT) for r in ("shard", "zero_shard(1)", "zero_shard(2)",
                                          "zero_shard(3)") + _OFFLOADS
      + ("pipeline",) + _SEQS + ("expert_route", "lora")],
    *[(_OFFACT, r, _OFFACT_NOT) for r in _PRECS[2:] + (_FP8, "compile_blocks")],
    # precision: one value holds a compute dtype, a reduction dtype and a loss scale
    ("precision('fp32')", "precision('bf16')", _DTYPE),
    ("precision('fp32')", "precision('fp16')", _DTYPE),
    ("precision('bf16')", "precision('fp16')", _DTYPE),
    ("precision(reduce='bf16')", "precision(reduce='fp16')", _REDUCE_ONE),
    ("precision('fp16')", "precision(loss_scale)", _t(f"{_FP16}[zero_fp16]")),
    *[(p, r, _shown(p, r)) for p in _PRECS[:3] for r in _PRECS[3:]
      if (p, r) != ("precision('fp16')", "precision(loss_scale)")],
    *[(r, "precision(loss_scale)", _shown(r, "precision(loss_scale)")) for r in _PRECS[3:5]],
    ("precision('bf16')", "fuse", _t(_GUIDE)),
    ("precision('bf16')", "fuse('attention')", _t(_GUIDE)),
    *[(p, x, _shown(p, x)) for p in _PRECS for x in _FUSES + ("compile_blocks",)
      if (p, x) not in (("precision('bf16')", "fuse"), ("precision('bf16')",
                                                        "fuse('attention')"))],
    ("precision('bf16')", "step_in_backward", _t(f"{_SIB}[AdamW-bf16]", _VS_STEP)),
    ("precision(loss_scale)", "step_in_backward", _STEP_SCALE),
    *[(p, "step_in_backward", _shown(p, "step_in_backward")) for p in _PRECS[:1] + _PRECS[2:5]],
    # precision('fp8')
    # (pairs in the rows' order: the generated case's name is the pair's)
    *[(r, _FP8, _shown(r, _FP8, _FP8_EXACT)) for r in (
        "data_parallel", "zero_shard(1)", "zero_shard(2)", "zero_shard(3)")],
    *[(r, _FP8, _shown(r, _FP8)) for r in ("remat", "precision(reduce='bf16')",
                                           "precision(reduce='fp16')")],
    *[(_FP8, r, _shown(_FP8, r)) for r in _FUSES + ("compile_blocks",)],
    *[(p, _FP8, _DTYPE) for p in _PRECS[:3]],
    ("precision(loss_scale)", _FP8, _shown("precision(loss_scale)", _FP8)),
    *[(o, _FP8, _shown(o, _FP8, _FP8_OFF)) for o in _OFFLOADS],
    *[(r, _FP8, _shown(r, _FP8, note)) for r, note in _FP8_BLOCKS.items()],
    *[(r, _FP8, _shown(r, _FP8, _FP8_TP_NOTE)) for r in ("shard", "sequence('split_gather')")],
    (_FP8, "step_in_backward", _t(f"{_SIB}[AdamW-fp8]", _VS_STEP)),
    # fuse: one value routes any of its ops
    ("fuse", "fuse('attention')", _t(f"{_FUSE}::test_fused_equals_unfused[llama]")),
    ("fuse", "fuse('loss')", _t(f"{_FUSE}::test_fused_equals_unfused[llama]")),
    ("fuse('attention')", "fuse('loss')", _t(f"{_FUSE}::test_fused_equals_unfused[llama]")),
    *[(f, "compile_blocks", _t(f"{_COMP}[zero3]", _VS_EAGER)) for f in _FUSES],
    *[(f, "step_in_backward", _t(f"{_SIB}[AdamW-fuse_remat]", _VS_STEP)) for f in _FUSES],
    # compile_blocks
    ("compile_blocks", "step_in_backward", _t(f"{_SIB}[FusedAdamW-compiled]", _VS_STEP)),
]


def _index(listed) -> dict[tuple[str, str], Cell]:
    """The listed cells by pair; a row that is not in ROWS, or a pair given twice (in
    either order), is refused here, when meshlab is imported."""
    from ..core.errors import PlanError

    out: dict[tuple[str, str], Cell] = {}
    for a, b, c in listed:
        if a not in ROWS or b not in ROWS or a == b:
            raise PlanError(f"composition table: {a} x {b} is not a pair of two rows of ROWS")
        if (a, b) in out or (b, a) in out:
            raise PlanError(f"composition table: {a} x {b} is given twice")
        out[(a, b)] = c
    return out


CELLS: dict[tuple[str, str], Cell] = _index(_LISTED)
_DECLARED: dict[str, Mapping[str, Cell]] = {}      # rows declared outside meshlab


# -- reading the table ---------------------------------------------------------------------
def declare(row: str, cells: Mapping[str, Cell]) -> None:
    """Add ``row`` (a transform written outside meshlab) with its ``cells`` to the table;
    ``Transform`` calls this for a subclass with a ``composition`` attribute."""
    from ..core.errors import ConfigError

    if row in ROWS:
        raise ConfigError(f"composition: {row!r} is a row of meshlab's own table; give the "
                          f"transform another kind, or leave out its composition attribute")
    if not isinstance(cells, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Cell) for k, v in cells.items()):
        raise ConfigError(f"{row}.composition: a mapping of row names to Cell values, e.g. "
                          f"{{'zero_shard(1)': composes('tests/test_mine.py::test_x')}}")
    _DECLARED[row] = dict(cells)


def rows(declared: bool = True) -> tuple[str, ...]:
    """Every row: meshlab's, then (with ``declared``) those declared outside it."""
    return tuple(ROWS) + tuple(r for r in _DECLARED if declared)


def cell(a: str, b: str) -> Cell:
    """The cell of rows ``a`` and ``b`` (either order). A row from outside meshlab gets the
    cell it (or the other row) declares, else ``not yet``."""
    return _lookup(a, b)[0]


def _lookup(a: str, b: str) -> tuple[Cell, bool]:
    """The cell, and whether the table names the pair the other way round (``b x a``)."""
    from ..core.errors import ConfigError, PlanError

    for key, flip in (((a, b), False), ((b, a), True)):
        if key in CELLS:
            return CELLS[key], flip
    if a in ROWS and b in ROWS:
        raise PlanError(f"composition table: no cell for {a} x {b}")
    mine, theirs = _DECLARED.get(a, {}).get(b), _DECLARED.get(b, {}).get(a)
    if mine is not None and theirs is not None and mine != theirs:
        raise ConfigError(f"composition: {a} and {b} declare different cells for each other "
                          f"({mine.describe()} and {theirs.describe()}); make them agree")
    if mine is not None or theirs is not None:
        return (mine if mine is not None else theirs), mine is None
    outside, other = (a, b) if a not in ROWS else (b, a)
    return not_yet(f"{outside} is written outside meshlab and declares no cell for {other}; "
                   f"add {other!r} to its composition attribute once a test shows the "
                   f"pair"), outside != a


def table(declared: bool = True) -> dict[tuple[str, str], Cell]:
    """Every pair of rows (``rows(declared)``, in order) -> its cell."""
    names = rows(declared)
    return {(a, b): cell(a, b) for i, a in enumerate(names) for b in names[i + 1:]}


def label(a: str, b: str, c: Cell) -> str:
    """Where a refusal comes from: the cell, and the page that shows the table."""
    status = f"composes with {c.before} first" if c.before and not c.refused else c.status
    return f"(composition table: {a} x {b}: {status}; see {PAGE})"


def refusal(a: str, b: str, ta, tb, *, tp=None, ranks: int = 1) -> str:
    """The text refusing rows ``a`` (held by transform ``ta``) and ``b`` (``tb``): the
    cell's message, ending in its label."""
    c, flip = _lookup(a, b)
    if flip:
        a, b, ta, tb = b, a, tb, ta
    text = (c.message or "{a} with {b}: " + c.reason).format(a=ta, b=tb, tp=tp, ranks=ranks)
    return f"{text} {label(a, b, c)}"


def applies(c: Cell, data_ranks: int, regions: bool = True) -> bool:
    """Whether ``c`` refuses its pair on a mesh of ``data_ranks`` data ranks, where shard
    runs a policy's tensor-parallel regions (``regions``) or the model's own forward on
    DTensors (specs alone)."""
    return c.refused and (c.scope == ALWAYS or (c.scope == SEVERAL_DATA_RANKS and data_ranks > 1)
                          or (c.scope == TP_REGIONS and regions))


@dataclasses.dataclass(frozen=True)
class Expected:
    """What ``meshlab.plan`` does with a spec, by the table: ``outcome`` (``runnable``,
    ``raises``, ``not runnable``) and the pairs that decide it."""

    outcome: str
    pairs: tuple[tuple[str, str], ...]

    def matches(self, outcome: str, message: str) -> bool:
        """Whether a measured ``outcome`` and its ``message`` are what the table predicts:
        the same outcome, and a refusal that names a cell names one of ``pairs``."""
        if outcome != self.outcome:
            return False
        if "composition table:" not in message:
            return True
        return any(f"composition table: {x} x {y}:" in message
                   for a, b in self.pairs for x, y in ((a, b), (b, a)))


def expect(names: Iterable[str], data_ranks: int = 1, regions: bool = True) -> Expected:
    """What the table says ``plan`` does with a spec that takes the rows ``names``
    (``regions``: shard runs a policy's tensor-parallel regions, as on a Hugging Face
    model)."""
    names = set(names)
    ordered = [n for n in rows() if n in names] + sorted(names - set(rows()))
    raised, recorded = [], []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            c = cell(a, b)
            if applies(c, data_ranks, regions) and c.refusal != AT_OPTIMIZER:
                (recorded if c.refusal == RECORDS and c.status == NOT_YET
                 else raised).append((a, b))
    if raised:
        return Expected("raises", tuple(raised))
    return Expected("not runnable", tuple(recorded)) if recorded else Expected("runnable", ())


# -- the page ------------------------------------------------------------------------------
def page() -> str:
    """``docs/composition.md``: meshlab's rows, the matrix of their marks, every cell."""
    names = rows(declared=False)
    num = {n: i + 1 for i, n in enumerate(names)}
    cells = table(declared=False)
    out = ["# Composition table", "",
           "<!-- generated from meshlab/transforms/composition.py by "
           "`python scripts/composition_matrix.py --page`; edit the table there -->", "",
           "What composes with what. Every room's check reads this table "
           "(`meshlab.transforms.composition`); a refusal names its cell and this page. "
           "`python scripts/composition_matrix.py` plans every pair on a fake mesh and "
           "holds the outcome against the table.", "",
           "Marks: ✓ composes (a test trains the pair against one process), ○ composes (no "
           "parity test yet), E not yet (`plan` raises `ConfigError`), N not yet (`plan` "
           "records `NotRunnable`, `parallelize` raises it), O not yet (`meshlab.optimizer` "
           "raises), * only over more than one data rank, ^ only where shard runs a policy's "
           "tensor-parallel regions (specs alone compose), - meaningless (two variants of "
           "one kind on one axis).", "", "## Rows", ""]
    out += [f"{num[n]}. `{n}`: {ROWS[n]}" for n in names]
    out += ["", "## Matrix", "", "| | " + " | ".join(str(num[n]) for n in names) + " |",
            "|---|" + "---|" * len(names)]
    out += [f"| {num[a]} `{a}` | " + " | ".join("" if a == b else cell(a, b).mark()
                                                for b in names) + " |" for a in names]
    out += ["", "## Cells", ""]
    for (a, b), c in cells.items():
        parts = [f"* `{a}` x `{b}`: {c.describe()}"] + [x for x in (
            c.reason, c.test and f"test: `{c.test}`", c.note,
            c.before and f"write `{c.before}` first in the spec") if x]
        out.append(". ".join(parts))
    counts: dict[str, int] = {}
    for c in cells.values():
        counts[c.describe()] = counts.get(c.describe(), 0) + 1
    out += ["", "## Summary", "", f"{len(names)} rows, {len(cells)} pairs:", ""]
    out += [f"* {k}: {v}" for k, v in sorted(counts.items())]
    return "\n".join(out) + "\n"
