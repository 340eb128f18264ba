"""A supervised fine-tuning batch, padded and packed, against its samples run one by one.

The batch holds three samples of different lengths from the tiny Llama: row 0 is sample A
left-padded (``attention_mask`` 0 on the padding), row 1 is samples B and C packed with
``position_ids`` that restart at 0, then padding. Labels are -100 on each sample's prompt
and on the padding. The reference is Hugging Face's own forward on one process, each
sample alone and unpadded; the batch's loss is the token-weighted mean over every label
that is not -100 (``step(reduction='tokens')``) and the gradient is that loss's.

Trained as the reference (the loss and every gradient; float64 to 1e-10, float32 to
1e-5): data parallelism (one row a rank), tensor parallelism (with Megatron SP, and
one row a microbatch), LoRA, the fused norms, rotary, MLP and loss, the fused attention
(``fuse()``: meshlab's C++ kernel masking the segments it reads from transformers' mask),
Ulysses (``sequence('sp', 'all_to_all')``: the whole-sequence mask after the exchange),
ring attention (``sequence('sp', 'ring')``: each block pair masked by the segments of its
positions, in float64 and on the C++ kernel in float32), the pipeline (pp=2, one row a
microbatch, 1F1B and GPipe: every stage builds its microbatch's mask and positions from
the ``attention_mask`` and ``position_ids`` the schedule hands it, and each microbatch's
loss is its sum over tokens divided by the whole batch's token count), and the same batch
with the padding marked by position ids alone. ``reduction='tokens'`` through the pipeline
is also checked on an unpadded batch whose microbatches hold different numbers of labels
(where the mean of the microbatches' means is not the token mean). Refused with a
``ConfigError`` on every rank, before any collective of the model: tokens masked inside a
packed sample, and a batch key the pipeline's stages would drop.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)

S = 12                                   # the batch's sequence length
PAD = 0
LENGTHS, PROMPTS = (9, 5, 6), (3, 2, 2)  # samples A, B, C


def samples():
    """(input_ids, labels) of samples A, B and C: labels -100 on each prompt."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = torch.randint(1, 97, (n,), generator=g)
        labels = ids.clone()
        labels[:p] = -100
        out.append((ids, labels))
    return out


def packed_batch(mask: bool = True) -> dict:
    """Row 0: A left-padded; row 1: B and C packed (positions restart at 0), then padding.
    ``mask=False`` leaves ``attention_mask`` out (the padding is then marked by its labels
    and by position ids that start each pad token afresh)."""
    (a, la), (b, lb), (c, lc) = samples()
    ids = torch.full((2, S), PAD)
    labels = torch.full((2, S), -100)
    attn = torch.zeros(2, S, dtype=torch.long)
    pos = torch.zeros(2, S, dtype=torch.long)
    k = S - len(a)
    ids[0, k:], labels[0, k:], attn[0, k:], pos[0, k:] = a, la, 1, torch.arange(len(a))
    n = len(b) + len(c)
    ids[1, :n], labels[1, :n], attn[1, :n] = torch.cat([b, c]), torch.cat([lb, lc]), 1
    pos[1, :n] = torch.cat([torch.arange(len(b)), torch.arange(len(c))])
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "labels": labels}
    if not mask:
        del batch["attention_mask"]
    return batch


def reference(model):
    """The loss and gradients of the samples one by one: Hugging Face's forward on each
    sample alone, the token-weighted mean of their next-token losses (from the logits,
    in the model's dtype: transformers' own loss upcasts to float32 only)."""
    import torch.nn.functional as F

    model.zero_grad()
    total, count = 0.0, 0
    for ids, labels in samples():
        logits = model(input_ids=ids[None]).logits[0]
        total = total + F.cross_entropy(logits[:-1], labels[1:], reduction="sum")
        count += int((labels[1:] != -100).sum())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad()
    return float(loss), grads


class Grads(torch.optim.Optimizer):
    """An optimizer that only records the gradients of its step (whole tensors)."""

    def __init__(self, named):
        self.names = {id(p): n for n, p in named}
        super().__init__([p for _, p in named], {})
        self.seen = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.seen[self.names[id(p)]] = M.full(p.grad).detach().clone()


def _check(loss, grads, ref_loss, ref_grads, tol):
    assert abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (loss, ref_loss)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    worst = 0.0
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, atol=tol, rtol=tol,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")
        worst = max(worst, (grads[n] - g).abs().max().item())
    return worst


def _rows(batch, rank, size):
    return {k: v.chunk(size)[rank] for k, v in batch.items()}


def build(attention: str = "sdpa"):
    """The tiny Llama (on the meta device) with ``attention``. transformers' eager
    attention turns a float64 padding mask into NaN (its softmax runs in float32, where
    float64's lowest value is -inf, and a row of padding masks every key), so the float64
    cases run SDPA."""
    model = M.build("llama")
    model.set_attn_implementation(attention)
    return model


def _reduction(reduction):
    """``step``'s keyword: ``reduction='tokens'``, or none for the default ``'mean'``."""
    return {} if reduction is None else {"reduction": reduction}


def parity_case(rank, world, layout, dtype="float64", mask=True, microbatches=1,
                reduction="tokens"):
    import torch.distributed as dist

    import meshlab as ml

    torch.set_default_dtype(getattr(torch, dtype))
    try:
        tol = 1e-10 if dtype == "float64" else 1e-5
        rules = ml.Rules(**M.TP_RULES)
        spec, mesh = {
            "dp": (ml.data_parallel("dp"), dict(dp=2)),
            "fuse_no_attention": (ml.fuse("rms_norm", "rotary", "mlp", "loss")
                                  | ml.data_parallel("dp"), dict(dp=2)),
            "fuse": (ml.fuse() | ml.data_parallel("dp"), dict(dp=2)),
            "all_to_all": (ml.sequence("sp", "all_to_all"), dict(sp=2)),
            "ring": (ml.sequence("sp", "ring"), dict(sp=2)),
            "ulysses_ring": (ml.sequence("sp", "all_to_all") | ml.sequence("cp", "ring"),
                             dict(sp=2, cp=2)),
            "fuse_tp": (ml.fuse("rms_norm", "rotary", "attention", "mlp")
                        | ml.shard(ml.policies.auto, rules), dict(tp=2)),
            "tp": (ml.shard(ml.policies.auto, rules), dict(tp=2)),
            "tp_sp": (ml.shard(ml.policies.auto, rules | ml.Rules(seq="tp")), dict(tp=2)),
            "pipeline": (ml.pipeline("pp", schedule="1f1b", microbatches=2), dict(pp=2)),
            "pipeline_gpipe": (ml.pipeline("pp", schedule="gpipe", microbatches=2),
                               dict(pp=2)),
        }[layout]
        mesh = ml.Mesh(**mesh)          # built for the layout run: others need other worlds
        attention = "sdpa" if dtype == "float64" else "eager"
        model = ml.parallelize(build(attention), spec, mesh, seed=0)
        ref = ml.init_weights(build(attention), seed=0)
        ref_loss, ref_grads = reference(ref)
        rt = model._meshlab
        r = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
        batch = _rows(packed_batch(mask), r, rt.dp_size)
        opt = Grads(list(model.named_parameters()))
        loss = ml.step(model, opt, batch, microbatches=microbatches, **_reduction(reduction))
        return _check(loss, opt.seen, ref_loss, _held(model, ref_grads), tol)
    finally:
        torch.set_default_dtype(torch.float32)


def _held(model, ref_grads):
    """The reference gradients of the parameters this rank holds (a pipeline stage's
    own), once the ranks together are seen to hold every one."""
    import torch.distributed as dist

    held = {n for n, _ in model.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(held))
    assert set().union(*map(set, every)) >= set(ref_grads), sorted(set(ref_grads) - held)
    return {n: g for n, g in ref_grads.items() if n in held}


def tokens_case(rank, world, schedule, reduction="tokens"):
    """``reduction='tokens'`` through the pipeline on rows of one sample each, without
    padding, whose labels are -100 on 2 and on 7 tokens: one row a microbatch, so the
    mean of the microbatches' means (9 and 4 labelled tokens) is not the token-weighted
    mean one process takes of the batch. Loss and gradients against one process."""
    import torch.nn.functional as F

    import meshlab as ml

    torch.set_default_dtype(torch.float64)
    try:
        ids = torch.randint(1, 97, (2, S), generator=torch.Generator().manual_seed(5))
        labels = ids.clone()
        labels[0, :2], labels[1, :7] = -100, -100
        ref = ml.init_weights(build(), seed=0)
        logits = ref(input_ids=ids).logits
        total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                labels[:, 1:].reshape(-1), reduction="sum")
        ref_loss = total / (labels[:, 1:] != -100).sum()
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        model = ml.parallelize(build(), ml.pipeline("pp", schedule=schedule, microbatches=2),
                               ml.Mesh(pp=2), seed=0)
        opt = Grads(list(model.named_parameters()))
        loss = ml.step(model, opt, {"input_ids": ids, "labels": labels},
                       **_reduction(reduction))
        return _check(loss, opt.seen, float(ref_loss), _held(model, ref_grads), 1e-10)
    finally:
        torch.set_default_dtype(torch.float32)


def hole_case(rank, world):
    """A token masked inside a packed sample cannot be written as position ids (transformers
    reads packing from them only where there is no mask): refused on the rank that holds
    it, and every other rank stops with it, before any collective of the model."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=2), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = packed_batch()
    batch["attention_mask"][1, 7] = 0           # inside sample C, whose positions go on
    try:
        ml.step(model, opt, _rows(batch, rank, 2))
    except ml.MeshlabError as e:
        return type(e).__name__, str(e)
    raise AssertionError("a token masked inside a packed sample was trained")


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj", "down_proj"])


def lora_case(rank, world):
    """LoRA through peft on 2 data-parallel ranks against single-process peft on the
    same weights (the adapters' B drawn, so every adapter has a gradient)."""
    import torch.distributed as dist
    from peft import get_peft_model

    import meshlab as ml

    torch.set_default_dtype(torch.float64)
    try:
        model = ml.parallelize(build(), ml.lora(_lora_config()) |
                               ml.data_parallel("dp"), ml.Mesh(dp=2), seed=0)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in sorted(model.named_parameters()):
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        ref = get_peft_model(ml.init_weights(build(), seed=0), _lora_config())
        own = dict(ref.base_model.model.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                own[n].copy_(M.full(p))
        ref_loss, ref_grads = reference(ref.base_model.model)
        rt = model._meshlab
        batch = _rows(packed_batch(), dist.get_rank(rt.dp_group), rt.dp_size)
        opt = Grads(list(model.named_parameters()))
        loss = ml.step(model, opt, batch, reduction="tokens")
        assert len(opt.seen) == 2 * 3 * 2         # A and B of 3 targets in 2 layers
        return _check(loss, opt.seen, ref_loss, ref_grads, 1e-10)
    finally:
        torch.set_default_dtype(torch.float32)


def refusal_case(rank, world, layout):
    """``step`` refuses a batch with a key the room would drop on every rank with a
    ``ConfigError`` naming it, before any collective of the model (agreement exchanges
    aside); the next step, on the same batch without that key, trains."""
    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    spec, mesh = {
        "pipeline": (ml.pipeline("pp", schedule="1f1b", microbatches=2), ml.Mesh(pp=2)),
    }[layout]
    model = ml.parallelize(M.build("llama"), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    rt = model._meshlab
    share = (lambda b: _rows(b, rank, 2)) if rt.dp_size == 2 else (lambda b: b)
    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    messages = []
    for batch in (packed_batch(), packed_batch(mask=False)):
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        with CommCounter(per_module=False) as cc:
            try:
                ml.step(model, opt, share(batch), reduction="tokens")
            except ml.ConfigError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"{layout}: a key the stages do not read was dropped")
        assert [c for c in cc.calls if c[0] != "control"] == [], cc.calls
    for n, p in model.named_parameters():
        assert torch.equal(M.full(p).detach(), before[n]), n
    loss = ml.step(model, opt, share(packed_batch()), reduction="tokens")
    assert loss == loss and loss > 0
    return messages


def test_data_parallel_trains_as_the_samples_one_by_one(world2):
    world2.run(parity_case, layout="dp")


def test_tensor_parallel_trains_as_the_samples_one_by_one(world2):
    world2.run(parity_case, layout="tp")


def test_fused_kernels_without_attention_train_as_the_samples_one_by_one(world2):
    world2.run(parity_case, layout="fuse_no_attention", dtype="float32")


def test_fused_attention_trains_as_the_samples_one_by_one(world2):
    # meshlab's attention kernel (C++ on the CPU) with the segments it reads from the mask:
    # rank 0 the left-padded row (its attention_mask), rank 1 the packed one (position ids)
    world2.run(parity_case, layout="fuse", dtype="float32")


def test_fused_attention_with_both_rows_on_each_rank(world2):
    # both rows in one forward, the padding folded into the position ids (as_packed)
    world2.run(parity_case, layout="fuse_tp", dtype="float32")


def test_ulysses_trains_as_the_samples_one_by_one(world2):
    # both rows on each rank, the sequence split in two: the mask of the whole sequence
    # (packing folded into the position ids) applies after the all-to-all
    world2.run(parity_case, layout="all_to_all")


def test_ring_attention_trains_as_the_samples_one_by_one(world2):
    # zigzag chunks of 3 tokens: the pair (tokens 6-8, keys 0-2) meets no key in either
    # row (A against its padding, C against B) and is skipped; in the pair (3-5, 0-2) row
    # 0's queries see no key (A against its padding) and join the merge with weight 0
    world2.run(parity_case, layout="ring")


def test_ring_attention_on_the_fused_kernel(world2):
    # float32: each block pair on meshlab's C++ kernel with the segment ids of its positions
    world2.run(parity_case, layout="ring", dtype="float32")


def test_packed_without_a_mask_trains_as_the_samples_one_by_one(world2):
    # the padding marked by position ids alone (each pad token at 0), as
    # transformers' DataCollatorWithFlattening lays samples out
    world2.run(parity_case, layout="dp", mask=False)


def test_token_weighting_across_microbatches(world2):
    # one row a microbatch: the step divides by the token count of the whole batch
    world2.run(parity_case, layout="tp", microbatches=2)


def test_megatron_sequence_parallel_trains_as_the_samples_one_by_one(world2):
    world2.run(parity_case, layout="tp_sp")


def test_tensor_parallel_in_float32(world2):
    world2.run(parity_case, layout="tp", dtype="float32")


@pytest.mark.parametrize("layout", ["pipeline", "pipeline_gpipe"])
def test_pipeline_trains_as_the_samples_one_by_one(world2, layout):
    # pp=2, one row a microbatch: every stage builds its microbatch's mask and positions
    # (row 0 its padding mask, row 1 its packed position ids, the mask folded into them)
    world2.run(parity_case, layout=layout)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_weighs_tokens_across_microbatches(world2, schedule):
    # unpadded: 9 and 4 labelled tokens in the two microbatches
    world2.run(tokens_case, schedule=schedule)


# The default reduction, 'mean', with the default loss: the mean over the global batch's
# labelled tokens, as one process takes it, where the rows hold different numbers of them.
# It was the mean of the parts' means (each data rank's, microbatch's or pipeline
# microbatch's), which no error reported.

def test_the_default_mean_is_the_token_mean_under_data_parallelism(world2):
    world2.run(parity_case, layout="dp", reduction=None)


def test_the_default_mean_is_the_token_mean_over_microbatches(world2):
    world2.run(parity_case, layout="tp", microbatches=2, reduction=None)


def test_the_default_mean_is_the_token_mean_through_the_pipeline(world2):
    world2.run(tokens_case, schedule="1f1b", reduction=None)


def test_a_token_masked_inside_a_packed_sample_is_refused(world2):
    (peer, theirs), (kind, mine) = world2.run(hole_case)      # rank 1 holds row 1
    assert kind == "ConfigError" and "column 8" in mine and "position_ids" in mine, mine
    assert peer == "PeerError" and mine[:300] in theirs, theirs


def label_after_padding_case(rank, world, layout, labels=True, attention="sdpa"):
    """Row 0's first token after its left padding labelled (not -100): the loss reads the
    padding token's output, which attention over segments does not compute as
    transformers does. Every rank refuses the step by name; the weights stay."""
    import meshlab as ml

    spec, mesh = {"ring": (ml.sequence("sp", "ring"), ml.Mesh(sp=2)),
                  "fuse": (ml.fuse("attention") | ml.data_parallel("dp"), ml.Mesh(dp=2)),
                  "all_to_all": (ml.sequence("sp", "all_to_all"), ml.Mesh(sp=2))}[layout]
    model = ml.parallelize(build(attention), spec, mesh, seed=0)
    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    batch = packed_batch()
    k = int((batch["attention_mask"][0] == 0).sum())
    batch["labels"][0, k] = batch["input_ids"][0, k]
    if not labels:      # the default loss takes the ids as labels, padding included
        del batch["labels"]
    try:
        loss = ml.step(model, opt, batch, reduction="tokens")
    except ml.ConfigError as e:
        unchanged = all(torch.equal(M.full(p).detach(), before[n])
                        for n, p in model.named_parameters())
        return "ConfigError", str(e), unchanged, k
    return "trained", float(loss), None, k


@pytest.mark.parametrize("layout", ["ring", "fuse"])
def test_a_label_after_padding_is_refused_where_attention_runs_over_segments(world2, layout):
    """Before, ring attention trained on it silently: the loss was 9.4e-3 off one process
    in float64, the gradients 8.2e-2 (fuse('attention') refused it already)."""
    for kind, msg, unchanged, k in world2.run(label_after_padding_case, layout=layout):
        assert kind == "ConfigError", (kind, msg)
        assert f"labels column {k} (not -100) after a padding token" in msg, msg
        assert unchanged


@pytest.mark.parametrize("layout", ["ring", "fuse"])
def test_a_padded_batch_without_labels_is_refused_where_attention_runs_over_segments(
        world2, layout):
    """Before, the check read only ``batch['labels']``: without them the default loss took
    the ids as labels, read the padding tokens' outputs, and trained 1.7e-2 off one
    process's loss, no error."""
    for kind, msg, unchanged, k in world2.run(label_after_padding_case, layout=layout,
                                              labels=False):
        assert kind == "ConfigError", (kind, msg)
        assert "after a padding token" in msg and "this batch has no 'labels'" in msg, msg
        assert unchanged


def test_a_label_after_padding_trains_under_ulysses(world2):
    """Ulysses runs transformers' own mask over the whole sequence: nothing to refuse."""
    for kind, _, _, _ in world2.run(label_after_padding_case, layout="all_to_all"):
        assert kind == "trained"


def test_a_label_after_padding_is_refused_under_ulysses_for_a_model_on_eager_attention(
        world2):
    """Ulysses runs SDPA, whose output at a fully masked padding row is not eager
    attention's: before, a GPT-2 on eager attention trained 3.4e-3 off one process's loss
    on such a batch, no error."""
    for kind, msg, unchanged, k in world2.run(label_after_padding_case, layout="all_to_all",
                                              attention="eager"):
        assert kind == "ConfigError", (kind, msg)
        assert f"labels column {k} (not -100) after a padding token" in msg, msg
        assert "the model's 'eager' attention" in msg and "attn_implementation='sdpa'" in msg
        assert unchanged


def test_lora_trains_as_the_samples_one_by_one(world2):
    pytest.importorskip("peft")
    world2.run(lora_case)


@pytest.mark.parametrize("layout,says", [
    ("pipeline", ["['token_type_ids'] would be dropped"]),
])
def test_refused_before_any_collective(world2, layout, says):
    for messages in world2.run(refusal_case, layout=layout):
        for m in messages:
            assert all(s in m for s in says), m
