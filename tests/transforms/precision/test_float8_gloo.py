"""precision('fp8') on 2 and 4 gloo ranks, exact against one process.

A dynamic float8 scale is the largest magnitude of the tensor a layer is given: each data
rank takes it over the batch it holds. The single process that computes what the data
ranks compute runs each rank's batch as a microbatch, with the same layers in float8
(torchao's ``Float8Linear``, swapped by the same decision) under the same bf16 autocast,
and averages the microbatches' gradients as the ranks' all-reduce does. Against it the
layout trains to float32 rounding: a term missing, doubled or taken over the wrong batch
would be a float8 rounding step (6%) or more. Three SGD steps of a two-block Llama whose
every block linear is float8; the output head stays bf16.

Beside the other rooms: offload (each target, under the ZeRO stage it runs with) trains
bitwise as the same layout without it; LoRA, Ulysses and ring attention, expert parallelism
and the pipeline train to float32 rounding against one process whose every linear layer
computes each rank's block apart (a microbatch of the rank's batch, the sequence positions
it holds), so that each dynamic scale is taken over what a rank's layer is given.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.timeout(600)

STEPS, LR = 3, 0.1
# ZeRO-3: the first step's loss is exact against FSDP2's mixed precision run on one process
# (_fsdp2_microbatches); the updates then differ by rounding in the gradients' path, which
# float8 magnifies: a weight whose largest value moves by a rounding moves its dynamic
# scale, and every value of it may round one float8 step (2^-4) apart. Measured: losses
# 2.4e-4 apart (relative 5e-5) after three steps, weights within 1.6% of the largest
# (bf16 alone, the same run: 0.16%); with the reference's gradients halved: 13%.
_ZERO3 = (1e-3, 3e-2)
# every op but the fused loss, whose head the reference's Hugging Face loss computes apart
_FUSED = ("rms_norm", "rotary", "attention", "mlp")


def _spec(extra: str, recipe: str):
    import meshlab as ml

    base = ml.precision("fp8", recipe=recipe)
    return {"dp": base | ml.data_parallel("dp"),
            "zero1": base | ml.zero_shard(1, "dp"),
            "zero3": base | ml.zero_shard(3, "dp"),
            "remat": base | ml.data_parallel("dp") | ml.remat("full"),
            "fuse": base | ml.data_parallel("dp") | ml.fuse(*_FUSED),
            # fuse installed first (one phase, spec order): its layers' query projection
            # computes the key and value products with its own, which the swap undoes
            "fuse_first": ml.fuse(*_FUSED) | ml.data_parallel("dp") | base,
            "compile": base | ml.data_parallel("dp") | ml.compile_blocks(backend="aot_eager"),
            }[extra]


def float8_case(rank, world, extra, recipe):
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model
    from meshlab.transforms.precision._float8 import Float8Layers, convert

    spec = _spec(extra, recipe)
    data = M.batches(STEPS, batch=4, seq=8)
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world), seed=0)
    rt = model._meshlab
    chosen = rt.plan.decision(Float8Layers)
    swapped = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    assert swapped == sorted(chosen.layers) and len(swapped) == 14, swapped
    opt = ml.optimizer(model, torch.optim.SGD, lr=LR)
    losses = []
    for b in data:
        local = b.chunk(world)[rank]
        loss = torch.tensor([float(ml.step(model, opt, {"input_ids": local}))],
                            dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(float(loss) / world)

    ref = ml.init_weights(M.build("llama"), seed=0)
    convert(ref, chosen)
    if extra.startswith("fuse"):        # the same fused ops, routed after the swap
        fuse_model(ref, _FUSED)
    ref_losses = (_fsdp2_microbatches if extra == "zero3" else _microbatches)(ref, data, world)
    tol = _ZERO3 if extra == "zero3" else (1e-5, 1e-5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=tol[0],
                               rtol=tol[0])
    worst = 0.0
    mine = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        w = M.full(mine[n]).detach()
        worst = max(worst, float((w - p.detach()).abs().max() / p.detach().abs().max()))
    return {"losses": losses, "worst": worst}


def _microbatches(ref, data, world) -> list[float]:
    """SGD on one process, each step's batch as ``world`` microbatches under bf16 autocast,
    their gradients averaged (the data ranks' all-reduce)."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for b in data:
        total = 0.0
        for micro in b.chunk(world):        # what each data rank holds
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref(input_ids=micro, labels=micro).loss
            (loss / world).backward()
            total += float(loss) / world
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _fsdp2_microbatches(ref, data, world) -> list[float]:
    """What FSDP2's mixed precision computes, on one process: the forward and backward on
    bf16 copies of fp32 masters (no autocast), each microbatch's bf16 gradients cast to
    fp32 and averaged there, SGD on the masters."""
    import copy

    work = copy.deepcopy(ref).to(torch.bfloat16)
    masters = list(ref.parameters())
    opt = torch.optim.SGD(masters, lr=LR)
    losses = []
    for b in data:
        total, grads = 0.0, [torch.zeros_like(p) for p in masters]
        for micro in b.chunk(world):
            loss = work(input_ids=micro, labels=micro).loss
            loss.backward()
            total += float(loss) / world
            for g, w in zip(grads, work.parameters()):
                g += w.grad.float() / world
                w.grad = None
        for p, g in zip(masters, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for w, p in zip(work.parameters(), masters):
                w.copy_(p)
        losses.append(total)
    return losses


@pytest.mark.parametrize("extra", ["dp", "zero1", "zero3", "remat", "fuse", "fuse_first",
                                   "compile"])
def test_float8_matches_one_process_by_microbatches(world2, extra):
    out = world2.run(float8_case, extra=extra, recipe="tensorwise")
    assert all(o["worst"] < (_ZERO3 if extra == "zero3" else (1e-5, 1e-5))[1] for o in out), out


def test_rowwise_recipe(world2):
    out = world2.run(float8_case, extra="dp", recipe="rowwise")
    assert all(o["worst"] < 1e-5 for o in out), out



# -- beside offload: bitwise against the same layout without it ----------------------------
OFF_LR = 1e-2


def _offload_run(rank, world, stage, kind, data):
    """(losses, weights) of ``precision('fp8') | zero_shard(stage) | offload(kind)`` (kind
    ``None``: no offload) under AdamW."""
    import meshlab as ml

    extra = {None: (), "optimizer": (ml.offload(optimizer=1.0),),
             "grads": (ml.offload(grads=1.0, optimizer=1.0),),
             "params": (ml.offload(params=1.0, grads=1.0, optimizer=1.0),)}[kind]
    spec = ml.precision("fp8") | ml.zero_shard(stage, "dp")
    for t in extra:
        spec = spec | t
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world), seed=0)
    swapped = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(swapped) == 14, swapped
    opt = ml.optimizer(model, torch.optim.AdamW, lr=OFF_LR, foreach=False)
    losses = []
    for b in data:
        x = b.chunk(world)[rank]
        losses.append(float(ml.step(model, opt, {"input_ids": x})))
    return losses, {n: M.full(p).detach().float().clone() for n, p in model.named_parameters()}


def offload_case(rank, world, cases):
    """Each (stage, kind) of ``cases`` against the same stage without offload: the host
    AdamW runs its reference (``torch.optim.AdamW``'s single-tensor arithmetic)."""
    from meshlab.ops import _build

    data = M.batches(STEPS, batch=4, seq=8)
    out = {}
    with _build.force_reference():
        base = {}
        for stage, kind in cases:
            if stage not in base:
                base[stage] = _offload_run(rank, world, stage, None, data)
            losses, got = _offload_run(rank, world, stage, kind, data)
            want_losses, want = base[stage]
            out[(stage, kind)] = dict(
                losses=losses, want_losses=want_losses,
                worst=max(float((got[n] - want[n]).abs().max()) for n in want),
                bitwise=all(torch.equal(got[n], want[n]) for n in want))
    return out


def test_offload_trains_bitwise_as_without_it(world2):
    """Each offload target beside the float8 layers, against the same ZeRO stage without
    offload (``precision('fp8') x zero_shard`` is shown against one process above): the
    stages the table's cases run, data_parallel for the optimizer state, ZeRO-2 for the
    gradients, ZeRO-3 for the parameters, and ZeRO-3's optimizer state and gradients."""
    cases = [(0, "optimizer"), (2, "grads"), (3, "grads"), (3, "params")]
    for out in world2.run(offload_case, cases=cases):
        for key, r in out.items():
            assert r["bitwise"], f"{key}: weights differ (worst absolute {r['worst']:.2e})"
            assert r["losses"] == r["want_losses"], key


# -- beside the other rooms: exact against one process whose layers compute per rank --------
# A rank's float8 layer takes its dynamic scales over the tensor it is given: the rows of
# its batch share (for a pipeline stage, of one microbatch of it), and under sequence
# parallelism the positions that rank holds. The reference computes every linear layer of
# the single process block by block, each block what one rank's layer is given; each
# layer that is not float8 casts its weight to bf16 for each block apart (autocast casts a
# weight once per forward, so the blocks' bf16 weight gradients would be summed in bf16,
# where the ranks' are summed in fp32 by the reduction). The attention is computed as the
# layout computes it: Ulysses repeats K/V to every query head before SDPA (transformers'
# SDPA passes enable_gqa, which sums each K/V head's gradient inside the kernel, a bf16
# rounding apart, and an e5m2 gradient makes that a float8 step); ring attention's blocks
# and merges on one process, in the ring's order (``_RingOnOneProcess``).
_EXACT = (1e-5, 1e-5)


def _exact_spec(pair: str):
    """(spec, mesh, family) of ``precision('fp8')`` beside ``pair`` as the table's case
    spells it (``tests/transforms/_pairs.py``)."""
    import meshlab as ml

    f8 = ml.precision("fp8")
    return {"lora": (ml.lora(r=2, target_modules=["q_proj", "v_proj"]) | ml.data_parallel("dp")
                     | f8, dict(dp=2), "llama"),
            "all_to_all": (ml.sequence("sp", "all_to_all") | ml.data_parallel("dp") | f8,
                           dict(dp=2, sp=2), "llama"),
            "ring": (ml.sequence("sp", "ring") | ml.data_parallel("dp") | f8,
                     dict(dp=2, sp=2), "llama"),
            "expert_route": (ml.expert_route("ep") | ml.data_parallel("dp") | f8,
                             dict(dp=2, ep=2), "qwen3_moe"),
            "pipeline": (ml.data_parallel("dp") | f8 | ml.pipeline("pp"), dict(dp=2, pp=2),
                         "llama")}[pair]


def _per_block(module, nb: int, positions, cast: bool) -> None:
    """``module``'s forward on ``nb`` row blocks of its input apart, and in each on the
    sequence positions of each index tensor of ``positions`` apart (``cast``: an
    ``nn.Linear`` computing in bf16 under autocast, its weight cast for each block)."""
    inner = module.forward
    if cast:
        def inner(x):
            if not torch.is_autocast_enabled("cpu"):
                return torch.nn.functional.linear(x, module.weight, module.bias)
            bf16 = torch.bfloat16
            with torch.autocast("cpu", enabled=False):
                return torch.nn.functional.linear(
                    x.to(bf16), module.weight.to(bf16),
                    None if module.bias is None else module.bias.to(bf16))
    inv = torch.argsort(torch.cat(positions))

    def forward(x):
        return torch.cat([torch.cat([inner(xb[:, p]) for p in positions], dim=1)[:, inv]
                          for xb in x.chunk(nb, dim=0)], dim=0)

    module.forward = forward


def _repeat_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Causal SDPA with K/V repeated to every query head first, as Ulysses attends."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class _RingOnOneProcess(torch.autograd.Function):
    """Ring attention of ``n`` ranks on one process: each rank's zigzag chunks meet the
    K/V of rank r, r-1, ... as the ring passes them, merged in that order; in the
    backward each K/V gradient sums the ranks' blocks in the order its buffer travels."""

    @staticmethod
    def forward(ctx, q, k, v, n, scale):
        from meshlab.transforms.sequence._ring import _block, _merge, _pairs, zigzag_positions

        seq = q.shape[2]
        pos = [zigzag_positions(r, n, seq) for r in range(n)]
        c = seq // (2 * n)
        halves = lambda t: (t[:, :, :c], t[:, :, c:])    # noqa: E731
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        for r in range(n):
            qs, acc = halves(q[:, :, pos[r]]), [None, None]
            for step in range(n):
                src = (r - step) % n
                ks, vs = halves(k[:, :, pos[src]]), halves(v[:, :, pos[src]])
                for a, b, causal in _pairs(r, src, n):
                    acc[a] = _merge(acc[a], *_block(qs[a], ks[b], vs[b], causal, scale))
            out[:, :, pos[r]] = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
            lse[:, :, pos[r]] = torch.cat([acc[0][1], acc[1][1]], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.n, ctx.scale = n, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from meshlab.transforms.sequence._ring import _block_grad, _pairs, zigzag_positions

        q, k, v, out, lse = ctx.saved_tensors
        n, scale, seq = ctx.n, ctx.scale, q.shape[2]
        pos = [zigzag_positions(r, n, seq) for r in range(n)]
        c = seq // (2 * n)
        halves = lambda t: (t[:, :, :c], t[:, :, c:])    # noqa: E731
        dq = [torch.zeros(q[:, :, pos[r]].shape) for r in range(n)]
        dk = [torch.zeros(k[:, :, pos[r]].shape) for r in range(n)]
        dv = [torch.zeros(v[:, :, pos[r]].shape) for r in range(n)]
        for step in range(n):
            for r in range(n):
                src = (r - step) % n
                qs, outs = halves(q[:, :, pos[r]]), halves(out[:, :, pos[r]])
                lses, douts = halves(lse[:, :, pos[r]]), halves(dout[:, :, pos[r]].contiguous())
                ks, vs = halves(k[:, :, pos[src]]), halves(v[:, :, pos[src]])
                for a, b, causal in _pairs(r, src, n):
                    g = _block_grad(douts[a], qs[a], ks[b], vs[b], outs[a], lses[a], causal,
                                    scale)
                    dq[r][:, :, a * c:(a + 1) * c] += g[0]
                    dk[src][:, :, b * c:(b + 1) * c] += g[1]
                    dv[src][:, :, b * c:(b + 1) * c] += g[2]
        grads = []
        for parts, like in ((dq, q), (dk, k), (dv, v)):
            g = torch.empty(like.shape, dtype=like.dtype)
            for r in range(n):
                g[:, :, pos[r]] = parts[r].to(like.dtype)
            grads.append(g)
        return grads[0], grads[1], grads[2], None, None


def _ring_attention(n: int):
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        from meshlab.transforms.sequence._ring import _one_dtype

        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        query, key, value = _one_dtype(query, key, value)
        with torch.autocast("cpu", enabled=False):
            out = _RingOnOneProcess.apply(query.contiguous(), key.contiguous(),
                                          value.contiguous(), n, float(scale))
        return out.transpose(1, 2).contiguous(), None

    return attend


def exact_case(rank, world, pair, seq=8):
    """``ml.verify`` of ``precision('fp8')`` beside ``pair`` against the per-block
    reference; returns (ok, the report's text)."""
    import copy
    import math

    from transformers import AttentionInterface

    import meshlab as ml
    from meshlab.transforms.precision._float8 import Float8Layers, convert
    from meshlab.transforms.sequence._ring import zigzag_positions

    spec, mesh, family = _exact_spec(pair)
    model = M.build(family)
    if pair in ("all_to_all", "ring"):
        model.config._attn_implementation = "sdpa"
    plan = ml.plan(model, spec, ml.Mesh(**mesh, fake=True))
    chosen = plan.decision(Float8Layers)
    pipe = next((t for t in spec.parts if isinstance(t, ml.transforms.Pipeline)), None)
    data = M.batches(STEPS, batch=8 if pipe else 4, seq=seq)
    nb = math.prod(mesh[a] for a in plan.roles.data) * (pipe.microbatches if pipe else 1)
    sp = mesh.get("sp", 1)
    positions = ([zigzag_positions(r, sp, seq) for r in range(sp)] if pair == "ring"
                 else list(torch.arange(seq).chunk(sp)))
    if pair == "lora":       # one process with the same adapters, as verify builds it
        lora = next(t for t in spec.parts if isinstance(t, ml.transforms.Lora))
        ref = lora.single_process(plan, copy.deepcopy(model), lambda m, on_module=None:
                                  ml.init_weights(m, seed=0, on_module=on_module))
    else:
        ref = ml.init_weights(copy.deepcopy(model), seed=0)
    assert convert(ref, chosen) == len(chosen.layers)
    if pair in ("all_to_all", "ring"):
        name = f"float8_test_{pair}"
        AttentionInterface.register(name, _repeat_sdpa if pair == "all_to_all"
                                    else _ring_attention(sp))
        ref.config._attn_implementation = name
    for n, m in ref.named_modules():
        if n in chosen.layers:
            _per_block(m, nb, positions, cast=False)
        elif isinstance(m, torch.nn.Linear):           # the head sees the whole sequence
            _per_block(m, nb, positions if n != plan.model.head else [torch.arange(seq)],
                       cast=True)
    report = ml.verify(model, spec, ml.Mesh(**mesh), [{"input_ids": b} for b in data],
                       optimizer=torch.optim.SGD, lr=LR, dtype=torch.float32, reference=ref,
                       atol=_EXACT[0], rtol=_EXACT[1])
    return report.ok, str(report)


@pytest.mark.parametrize("pair", ["lora", "all_to_all", "ring", "expert_route", "pipeline"])
def test_exact_beside_per_rank_blocks(request, pair):
    """Two SGD steps against the per-block reference to float32 rounding: a term missing,
    doubled or scaled over another block than the rank's is a float8 step (6%) or more."""
    import math

    world = request.getfixturevalue(f"world{math.prod(_exact_spec(pair)[1].values())}")
    out = world.run(exact_case, pair=pair)
    assert all(o == out[0] for o in out), "the ranks' reports differ"
    assert out[0][0], out[0][1]
