"""Pipeline idle fraction on pp=4 with 16 microbatches (1F1B and interleaved), measured
against the plan's formula ``meshlab.transforms.pipeline.bubble(plan)``.

Each rank times the work of its own blocks (``model._meshlab.part(PipelinePart).kept``): a forward
pre-hook and a forward hook bracket every block's forward, and identity autograd markers
on the block's input and output bracket its backward (the output's marker runs first in
backward, the input's last). On GPU the brackets are CUDA events on the compute stream;
on the CPU they are ``time.perf_counter`` readings, and each block is given a known cost
(``--cost`` seconds of sleep in forward, twice that in backward: the formulas' F = 1,
B = 2) so that the dry run measures the schedule and not two shared cores. The idle
fraction of a rank is 1 - (its blocks' busy time) / (the time of the schedule's ``step``
on that rank); the time of the whole ``ml.step`` (schedule, optimizer, loss all-reduce)
is reported next to it. Embeddings, final norm, head, loss and point-to-point transfers
count as idle, so the model is chosen with blocks dominating (vocabulary 4096).

Medians over ``--steps`` timed steps after ``--warmup`` (the first exchanges shapes).
Worlds of 4 run pp=4; 8 run pp=4 x dp=2 (data parallel over dp); other worlds are
recorded as not fitting.

    torchrun --nproc-per-node 4 benchmarks/multi_gpu/bubble.py
    torchrun --nproc-per-node 4 benchmarks/multi_gpu/bubble.py --device cpu --quick
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.nvlink_multicast_off()

import torch  # noqa: E402

PP, MICROBATCHES = 4, 16
MODEL = {
    "full": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=4096),
    "quick": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
}
SEQ = {"full": 4096, "quick": 16}


def build(cfg: dict, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model("llama", tie_word_embeddings=False, max_position_embeddings=8192,
                             use_cache=False, **cfg)
    c._attn_implementation = attn
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(c)


class Clock:
    """Spans of block work on this rank (events on GPU, perf_counter on the CPU)."""

    def __init__(self, cuda: bool, cost: float):
        self.cuda, self.cost = cuda, cost
        self.spans: list = []          # (kind, start, end)

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def take(self):
        spans, self.spans = self.spans, []
        return spans


class _Token:
    __slots__ = ("fwd_start", "bwd_start")


class _InputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, token):
        ctx.clock, ctx.token = clock, token
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.clock.spans.append(("B", ctx.token.bwd_start, ctx.clock.now()))
        return g, None, None


class _OutputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, token):
        ctx.clock, ctx.token = clock, token
        if clock.cost:
            time.sleep(clock.cost)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.token.bwd_start = ctx.clock.now()
        if ctx.clock.cost:
            time.sleep(2 * ctx.clock.cost)
        return g, None, None


def instrument(model, clock: Clock) -> int:
    from meshlab.transforms.pipeline._runtime import PipelinePart

    mods = dict(model.named_modules())
    kept = sorted(model._meshlab.part(PipelinePart).kept)

    def pre(m, args, kwargs):
        tok = _Token()
        m._bench_token = tok
        tok.fwd_start = clock.now()
        if args:
            return (_InputMark.apply(args[0], clock, tok),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = _InputMark.apply(kwargs["hidden_states"], clock, tok)
        return args, kwargs

    def post(m, args, kwargs, out):
        tok = m._bench_token
        if isinstance(out, tuple):
            out = (_OutputMark.apply(out[0], clock, tok),) + tuple(out[1:])
        else:
            out = _OutputMark.apply(out, clock, tok)
        clock.spans.append(("F", tok.fwd_start, clock.now()))
        return out

    for b in kept:
        mods[b].register_forward_pre_hook(pre, with_kwargs=True)
        mods[b].register_forward_hook(post, with_kwargs=True)
    return len(kept)


def time_schedule(model, clock: Clock, windows: list) -> None:
    """Bracket the pipeline schedule's own ``step`` (the window the formula is about)."""
    pp = model._meshlab.pipeline
    orig = pp.schedule

    def schedule(loss_fn):
        s = orig(loss_fn)
        if not getattr(s, "_bench_timed", False):
            inner = s.step

            def step(*a, **k):
                t0 = clock.now()
                out = inner(*a, **k)
                windows.append((t0, clock.now()))
                return out
            s.step = step
            s._bench_timed = True
        return s
    pp.schedule = schedule


def run(env, args, schedule: str, cfg: dict, seq: int) -> dict:
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.estimate.pipeline import bubble

    axes = {"pp": PP} if env.world == PP else {"pp": PP, "dp": env.world // PP}
    spec = ml.pipeline("pp", schedule=schedule, microbatches=MICROBATCHES)
    if "dp" in axes:
        spec = spec | ml.data_parallel("dp")
    if args.bf16:
        spec = spec | ml.precision("bf16")
    mesh = env.mesh(**axes)
    attn = "sdpa" if env.cuda else "eager"
    plan = ml.plan(build(cfg, attn), spec, mesh)
    expected = bubble(plan)
    # The replay at each stage's profiled costs: embeddings on the first stage, final norm,
    # head and loss on the last (what the closed formula leaves out); on the GPU only,
    # where the profile's rates are the card's.
    costed = (bubble(plan, batch=MICROBATCHES * args.microbatch_size, seq=seq)
              if env.cuda else None)
    model = ml.parallelize(build(cfg, attn), spec, mesh, seed=0)
    if env.cuda and not args.meshlab_as_is:
        C.place_on_device(model, env.device)
    cost = args.cost if args.cost is not None else (0.0 if env.cuda else
                                                    (0.02 if args.quick else 0.05))
    clock = Clock(env.cuda, cost)
    nblocks = instrument(model, clock)
    windows: list = []
    time_schedule(model, clock, windows)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.0)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    dp = rt.dp_size
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg["vocab_size"], (MICROBATCHES * args.microbatch_size * dp, seq),
                          generator=g).chunk(dp)[dp_rank].to(env.device)
    per_step = []
    for i in range(args.warmup + args.steps):
        env.sync()
        clock.take()
        windows.clear()
        t0 = clock.now()
        ml.step(model, opt, {"input_ids": batch})
        t1 = clock.now()
        if env.cuda:
            torch.cuda.synchronize()
        spans = clock.take()
        if i < args.warmup:
            continue
        busy = sum(clock.seconds(a, b) for _, a, b in spans)
        sched = sum(clock.seconds(a, b) for a, b in windows)
        total = clock.seconds(t0, t1)
        per_step.append({"busy_s": busy, "schedule_s": sched, "step_s": total,
                         "forward_spans": sum(1 for k, _, _ in spans if k == "F"),
                         "backward_spans": sum(1 for k, _, _ in spans if k == "B")})
    med = lambda k: C.median([s[k] for s in per_step])  # noqa: E731
    mine = {"pp_rank": rt.pipeline.rank, "blocks": nblocks,
            "busy_s": med("busy_s"), "schedule_s": med("schedule_s"), "step_s": med("step_s"),
            "idle_schedule": C.median([1 - s["busy_s"] / s["schedule_s"] for s in per_step]),
            "idle_step": C.median([1 - s["busy_s"] / s["step_s"] for s in per_step]),
            "spans_per_step": [per_step[0]["forward_spans"], per_step[0]["backward_spans"]],
            "spans_expected": MICROBATCHES * nblocks}
    everyone = env.gather(mine)
    del model, opt
    if env.cuda:
        torch.cuda.empty_cache()
    idle = [m["idle_schedule"] for m in everyone]
    return {"schedule": schedule, "mesh": axes, "microbatches": MICROBATCHES,
            "microbatch_size": args.microbatch_size, "seq": seq, "block_cost_s": cost,
            "expected_bubble": expected, "expected_bubble_costed": costed,
            "measured_idle_per_rank": idle,
            "measured_idle_mean": sum(idle) / len(idle),
            "measured_minus_expected": sum(idle) / len(idle) - expected,
            "measured_idle_whole_step_mean": sum(m["idle_step"] for m in everyone) / len(everyone),
            "spans_complete": all(m["spans_per_step"] == [m["spans_expected"]] * 2
                                  for m in everyone),
            "per_rank": everyone, "status": "ok"}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--schedules", default="1f1b,interleaved")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; quick 1)")
    p.add_argument("--microbatch-size", type=int, default=1)
    p.add_argument("--cost", type=float, default=None,
                   help="seconds of sleep per block forward (2x in backward); default 0 on GPU, "
                        "0.05 on the CPU (0.02 quick)")
    p.add_argument("--fp32", dest="bf16", action="store_false",
                   help="fp32 compute (default: ml.precision('bf16'))")
    args = p.parse_args()
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    env = C.Env(args)
    size = "quick" if args.quick else "full"
    cfg, seq = MODEL[size], SEQ[size]
    rows = []
    if env.world % PP:
        rows.append({"status": f"skipped: pp={PP} needs a world divisible by {PP}, "
                               f"got {env.world}"})
        if env.rank == 0:
            print(rows[-1]["status"], flush=True)
    else:
        for schedule in args.schedules.split(","):
            try:
                row = run(env, args, schedule, cfg, seq)
            except Exception as e:  # noqa: BLE001 - recorded
                row = {"schedule": schedule, **C.describe_error(e)}
            rows.append(row)
            if env.rank == 0:
                if row["status"] == "ok":
                    print(f"{schedule:12s} expected {row['expected_bubble']:.3f}  measured per rank "
                          f"{[round(x, 3) for x in row['measured_idle_per_rank']]}  (whole "
                          f"ml.step {row['measured_idle_whole_step_mean']:.3f})", flush=True)
                else:
                    print(f"{schedule:12s} {row['status'][:200]}", flush=True)
    payload = {
        "model": {"model_type": "llama", **cfg, "tie_word_embeddings": False},
        "precision": "bf16" if args.bf16 else "fp32",
        "definition": "idle = 1 - busy(blocks' forward+backward on this rank) / time of the "
                      "schedule's step on this rank; medians over timed steps",
        "timer": "CUDA events" if env.cuda else "time.perf_counter, block costs by sleep",
        "steps": args.steps, "warmup": args.warmup,
        "results": rows,
    }
    C.write_json(env, "bubble", payload)
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
