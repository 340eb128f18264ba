"""Buffers a training forward changes, where the step cuts the batch (``train/_buffers``).

A module of the user's own that keeps a running mean of its input in a buffer trained,
under data parallelism, with each rank's mean of its own share: the replicas' buffers
differed from each other and from the single process's, and so did every later output,
without an error. Cut into microbatches, the buffer was updated once per microbatch. On
the first step that cuts the batch, every rank now stops with an error naming the buffer,
before the step's first backward (the weights are as they were); a buffer every rank
updates alike and once a step (as transformers' dynamic rotary frequencies follow the
sequence length) trains as before.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)


class RunningMean(nn.Module):
    """Subtracts a running mean of its input, updated in the training forward."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.mean


class SeenLength(nn.Module):
    """Keeps the last batch's feature count: the same on every rank and microbatch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("width", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.width.fill_(x.shape[-1])
        return x


def _loss(out, batch):
    return ((out - batch["y"]) ** 2).mean()


def case(rank, world, module, split, microbatches):
    import meshlab as ml

    torch.manual_seed(0)
    made = {"running_mean": lambda: RunningMean(4), "seen_length": SeenLength}[module]()
    net = nn.Sequential(nn.Linear(4, 4), made, nn.Linear(4, 1)).double()
    model = ml.parallelize(net, ml.data_parallel("dp"), ml.Mesh(dp=world))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    # ``split``: each rank its share of the batch; else every rank the same whole batch
    batch = {"x": x.chunk(world)[rank], "y": y.chunk(world)[rank]} if split else \
        {"x": x, "y": y}
    try:
        for _ in range(2):
            ml.step(model, opt, batch, _loss, inputs=["x"], microbatches=microbatches)
    except ml.MeshlabError as e:
        unchanged = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
        return type(e).__name__, str(e), unchanged
    return "trained", None, None


def test_a_buffer_each_rank_updates_from_its_share_is_refused(world2):
    for kind, msg, unchanged in world2.run(case, module="running_mean", split=True,
                                           microbatches=1):
        assert kind == "RankMismatchError", (kind, msg)
        assert "buffer 1.mean differs among ranks" in msg and "whole batch" in msg, msg
        assert unchanged


def test_a_buffer_updated_once_per_microbatch_is_refused(world2):
    # the same whole batch on both ranks: the replicas agree, the microbatches do not
    for kind, msg, unchanged in world2.run(case, module="running_mean", split=False,
                                           microbatches=2):
        assert kind == "ConfigError", (kind, msg)
        assert "buffer '1.mean' changed again in the second microbatch's forward" in msg, msg
        assert unchanged


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_buffer_every_rank_updates_alike_trains(world2, microbatches):
    for kind, msg, _ in world2.run(case, module="seen_length", split=True,
                                   microbatches=microbatches):
        assert kind == "trained", msg


# -- parameters the training forward writes ------------------------------------------------
class ActNorm(nn.Module):
    """Glow's activation normalization: its scale is set from the first training batch's
    statistics (a data-dependent initialization), in the forward."""

    def __init__(self, n: int, ready: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n, dtype=torch.float64))
        self.register_buffer("ready", torch.tensor(ready))

    def forward(self, x):
        if self.training and not bool(self.ready):
            with torch.no_grad():
                self.scale.copy_(1 / (x.std(0) + 1e-6))
                self.ready.fill_(True)
        return x * self.scale


def actnorm_case(rank, world, layout, ready, microbatches=1):
    import meshlab as ml

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), ActNorm(4, ready), nn.Linear(4, 1)).double()
    spec = {"dp": ml.data_parallel("dp"), "zero1": ml.zero_shard(1),
            "zero2": ml.zero_shard(2), "zero3": ml.zero_shard(3)}[layout]
    model = ml.parallelize(net, spec, ml.Mesh(dp=world))
    before = {n: _full(p).clone() for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    batch = {"x": x.chunk(world)[rank], "y": y.chunk(world)[rank]}
    try:
        for _ in range(2):
            ml.step(model, opt, batch, _loss, inputs=["x"], microbatches=microbatches)
    except ml.MeshlabError as e:
        # the optimizer did not run: only what the forward itself wrote differs
        unchanged = all(torch.equal(_full(p), before[n]) for n, p in model.named_parameters()
                        if n != "1.scale")
        return type(e).__name__, str(e), unchanged
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), ActNorm(4, ready), nn.Linear(4, 1)).double()
    return "trained", _distance_after_two_steps(model, ref, x, y), None


def _distance_after_two_steps(model, ref, x, y) -> float:
    """The largest difference between ``model``'s weights and ``ref``'s after two SGD
    steps of one process on the whole batch."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        _loss(ref(x), {"y": y}).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max(float((_full(p) - q).abs().max()) for p, q in
               zip(model.parameters(), ref.parameters()))


def _full(p):
    t = p.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("layout", ["dp", "zero1"])
def test_a_parameter_each_rank_sets_from_its_share_in_the_forward_is_refused(world2, layout):
    """Before: under data parallelism each replica set ActNorm's scale from its half of
    the batch, and the replicas trained apart from each other and from one process."""
    for kind, msg, unchanged in world2.run(actnorm_case, layout=layout, ready=False):
        assert kind == "ConfigError", (kind, msg)
        assert "parameter '1.scale' is written in the training forward" in msg, msg
        assert "initialize it before ml.parallelize" in msg, msg
        assert unchanged


def test_a_parameter_set_in_the_forward_under_zero3_is_refused(world2):
    """Before: under ZeRO-3 the forward wrote FSDP's gathered copy, dropped after it: the
    scale trained on from 1 where one process set it from the data."""
    for kind, msg, unchanged in world2.run(actnorm_case, layout="zero3", ready=False):
        assert kind == "ConfigError", (kind, msg)
        assert "parameter '1.scale' is written in the training forward, to the copy " \
            "zero_shard (FSDP) gathers" in msg, msg
        assert unchanged


def test_a_parameter_set_in_the_forward_over_microbatches_is_refused(world2):
    for kind, msg, _ in world2.run(actnorm_case, layout="dp", ready=False, microbatches=2):
        assert kind == "ConfigError" and "'1.scale'" in msg, (kind, msg)


@pytest.mark.parametrize("layout", ["dp", "zero2", "zero3"])
def test_a_parameter_initialized_before_parallelize_trains_as_one_process(world2, layout):
    """No parameter is written in these forwards: nothing is refused (under zero_shard(2)
    FSDP's gathered copies stay registered after the forward, which is not a write)."""
    for kind, err, _ in world2.run(actnorm_case, layout=layout, ready=True):
        assert kind == "trained", err
        assert err < 1e-12, err


# -- compiled blocks ------------------------------------------------------------------------
class TracedActNorm(nn.Module):
    """ActNorm as a graph can hold it (no branch on the data): in training its scale is
    written every forward, from the batch until it is set, with itself after."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n, dtype=torch.float64))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.scale.copy_(torch.where(self.ready, self.scale, 1 / (x.std(0) + 1e-6)))
                self.ready.fill_(True)
        return x * self.scale


class NormedStack(nn.Module):
    """Two repeated blocks (what compile_blocks compiles), each a map then an ActNorm."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), TracedActNorm(4)) for _ in range(2))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def compiled_actnorm_case(rank, world, layout, by_hand):
    import meshlab as ml

    torch.manual_seed(0)
    spec = {"dp": ml.data_parallel("dp"), "zero3": ml.zero_shard(3)}[layout]
    model = ml.parallelize(NormedStack().double(),
                           spec | ml.compile_blocks(backend="aot_eager"), ml.Mesh(dp=world))
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64).chunk(world)[rank]
    y = torch.randn(8, 1, generator=g, dtype=torch.float64).chunk(world)[rank]
    try:
        for _ in range(2):
            if by_hand:
                _loss(model(x), {"y": y}).backward()
                opt.step()
                opt.zero_grad()
            else:
                ml.step(model, opt, {"x": x, "y": y}, _loss, inputs=["x"])
    except ml.MeshlabError as e:
        compiled = [m for m in model.modules()
                    if getattr(m, "_compiled_call_impl", None) is not None]
        return type(e).__name__, str(e), len(compiled)
    return "trained", None, None


@pytest.mark.parametrize("layout,by_hand", [("zero3", False), ("zero3", True), ("dp", False)])
def test_a_parameter_set_in_a_compiled_block_is_refused(world2, layout, by_hand):
    """Before: under ZeRO-3 a compiled block's graph wrote FSDP's gathered copy with no
    hook to see it, and the scales trained on from 1 where one process set them from the
    data. The first training forward now runs the blocks eagerly under the watch; the
    blocks are compiled again after it."""
    for kind, msg, compiled in world2.run(compiled_actnorm_case, layout=layout,
                                          by_hand=by_hand):
        assert kind == "ConfigError", (kind, msg)
        assert "parameter 'layers.0.1.scale' is written in the training forward" in msg, msg
        assert compiled == 2, compiled


# -- the pipeline's own schedule runs the microbatches' forwards ---------------------------
class CountedBlock(nn.Module):
    """Wraps a pipeline block with a buffer its training forward updates: ``running``, a
    running mean of the block's output (updated in every forward); ``once``, the mean of
    the first output it sees (a data-dependent initialization, set in the first forward
    only); ``width``, the feature count (the same in every forward)."""

    def __init__(self, block: nn.Module, kind: str):
        super().__init__()
        self.block, self.kind = block, kind
        self.register_buffer("seen", torch.zeros(block.o.out_features))

    def reset_parameters(self):        # built on the meta device: init_weights calls it
        self.seen.zero_()

    def forward(self, h, attention_mask=None):
        out = self.block(h, attention_mask)
        if self.training:
            with torch.no_grad():
                if self.kind == "running":
                    self.seen.mul_(0.5).add_(out.detach().mean((0, 1)), alpha=0.5)
                elif self.kind == "once":
                    if not self.seen.any():
                        self.seen.copy_(out.detach().mean((0, 1)))
                else:
                    self.seen.fill_(out.shape[-1])
        return out if self.kind == "width" else out - self.seen


class GainBlock(nn.Module):
    """Wraps a pipeline block with a parameter set from the first output it sees (an
    ActNorm-style data-dependent initialization, in the training forward)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.gain = nn.Parameter(torch.empty(block.o.out_features))

    def reset_parameters(self):        # built on the meta device: init_weights calls it
        with torch.no_grad():
            self.gain.fill_(1.0)

    def forward(self, h, attention_mask=None):
        out = self.block(h, attention_mask)
        if self.training and bool((self.gain == 1).all()):
            with torch.no_grad():
                self.gain.copy_(1 / (out.detach().std((0, 1)) + 1e-6))
        return out * self.gain


def pipeline_case(rank, world, kind, mesh_text):
    import meshlab as ml
    from tests import _models as M

    torch.set_default_dtype(torch.float64)
    try:
        base = M.build_staged()
        with torch.device("meta"):
            base.layers["2"] = GainBlock(base.layers["2"]) if kind == "gain" else \
                CountedBlock(base.layers["2"], kind)
        mesh = ml.Mesh(ml.Mesh.parse(mesh_text).shape)
        spec = ml.pipeline("pp", microbatches=4, blocks="layers")
        if "dp" in mesh.shape:
            spec = spec | ml.data_parallel("dp")
        model = ml.parallelize(base, spec, mesh, seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rt = model._meshlab
        dp_rank = torch.distributed.get_rank(rt.dp_group) if rt.dp_group is not None else 0
        seen = None
        try:
            for s in range(2):
                batch = M.padded_batch(batch=8 * rt.dp_size, seed=s)
                ml.step(model, opt, {k: v.chunk(rt.dp_size)[dp_rank] for k, v in batch.items()},
                        M.staged_loss)
                buffers = dict(model.named_buffers())
                if seen is None and "layers.2.seen" in buffers:
                    seen = buffers["layers.2.seen"].clone()
        except ml.MeshlabError as e:
            unchanged = all(torch.equal(p.detach(), before[n])
                            for n, p in model.named_parameters())
            return type(e).__name__, str(e), unchanged
        return "trained", None, seen
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_pipeline_stage_buffer_updated_once_per_microbatch_is_refused(world2):
    """A pipeline's schedule ran every microbatch's forward through the stage: the running
    mean was updated four times a step, where one process updates it once, silently."""
    out = world2.run(pipeline_case, kind="running", mesh_text="pp=2")
    for kind, msg, unchanged in out:
        assert kind in ("ConfigError", "PeerError"), (kind, msg)
        assert unchanged, msg
    assert any(k == "ConfigError" and "'layers.2.seen'" in m and "microbatch" in m
               for k, m, _ in out), out


def test_a_pipeline_stage_parameter_set_in_its_forward_is_refused(world2):
    """Before: the stage's gain was set in the schedule's setup forward from uninitialized
    tensors (then kept, as every later forward saw it set), where one process sets it
    from the data."""
    out = world2.run(pipeline_case, kind="gain", mesh_text="pp=2")
    for kind, msg, unchanged in out:
        assert kind in ("ConfigError", "PeerError"), (kind, msg)
    assert any(k == "ConfigError" and "parameter 'layers.2.gain' is written in the training "
               "forward of a pipeline stage" in m for k, m, _ in out), out


def test_a_pipeline_stage_buffer_updated_alike_trains(world2):
    for kind, msg, _ in world2.run(pipeline_case, kind="width", mesh_text="pp=2"):
        assert kind == "trained", msg


def test_a_pipeline_stage_buffer_each_replica_sets_from_its_share_is_refused(world4):
    """Two data-parallel replicas of a two-stage pipeline: the buffer set once from the
    first microbatch each replica sees differs between them."""
    out = world4.run(pipeline_case, kind="once", mesh_text="dp=2,pp=2")
    for kind, msg, unchanged in out:
        assert kind == "RankMismatchError", (kind, msg)
        assert "buffer layers.2.seen differs among ranks" in msg, msg
        assert unchanged, msg
    # the second stage's ranks (1 and 3, which hold layers 2 and 3) say how to fix it
    assert all("whole batch" in out[r][1] for r in (1, 3)), out


def test_a_pipeline_stage_buffer_set_in_its_first_forward_is_set_from_the_data(world2):
    """torch's schedule sets its stages up with one more forward of each stage, the later
    stage's on uninitialized tensors: a buffer set from the first output a block sees
    (a data-dependent initialization) took its value from that memory, where one process
    sets it from the first microbatch. It now holds the first microbatch's value."""
    import meshlab as ml
    from tests import _models as M

    out = world2.run(pipeline_case, kind="once", mesh_text="pp=2")
    assert [k for k, _, _ in out] == ["trained", "trained"], out
    torch.set_default_dtype(torch.float64)
    try:
        ref = M.build_staged()
        with torch.device("meta"):
            ref.layers["2"] = CountedBlock(ref.layers["2"], "once")
        ref = ml.init_weights(ref, seed=0)
        first = {k: v[:2] for k, v in M.padded_batch(batch=8, seed=0).items()}   # microbatch 0
        ref(first["ids"], first["attention_mask"], first["position_ids"])
    finally:
        torch.set_default_dtype(torch.float32)
    got = out[1][2]                            # the second stage holds layers 2 and 3
    torch.testing.assert_close(got, ref.layers["2"].seen, rtol=1e-12, atol=1e-12)


# -- a forward called by hand (a plain loop, a boosted model) ------------------------------
def by_hand_case(rank, world, module, layout, split=True):
    """Two steps of a plain loop (or the Booster's) over a model whose buffer or
    parameter the training forward updates: what the ranks raised, or the largest
    difference from one process on the whole batch."""
    import meshlab as ml

    def build():
        torch.manual_seed(0)
        made = {"running_mean": lambda: RunningMean(4), "seen_length": SeenLength,
                "actnorm": lambda: ActNorm(4)}[module]()
        return nn.Sequential(nn.Linear(4, 4), made, nn.Linear(4, 1)).double()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    xs, ys = (x.chunk(world)[rank], y.chunk(world)[rank]) if split else (x, y)
    if layout == "booster":
        from meshlab.booster import Booster, TorchDDPPlugin

        net = build()
        model, opt, *_ = Booster(plugin=TorchDDPPlugin()).boost(
            net, torch.optim.SGD(net.parameters(), lr=0.1))
    else:
        spec = {"dp": ml.data_parallel("dp"), "zero3": ml.zero_shard(3)}[layout]
        model = ml.parallelize(build(), spec, ml.Mesh(dp=world))
        opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    before = {n: _full(p).clone() for n, p in model.named_parameters()}
    try:
        for _ in range(2):
            loss = _loss(model(xs), {"y": ys})
            loss.backward()
            opt.step()
            opt.zero_grad()
    except ml.MeshlabError as e:
        # raised before the first backward: no weight moved (the forward's own write aside)
        unchanged = all(torch.equal(_full(p), before[n]) for n, p in model.named_parameters()
                        if n != "1.scale")
        return type(e).__name__, str(e), unchanged
    return "trained", _distance_after_two_steps(model, build(), x, y), None


@pytest.mark.parametrize("layout", ["dp", "booster"])
def test_a_buffer_each_rank_updates_in_a_forward_called_by_hand_is_refused(world2, layout):
    """Before: ``model(x)`` in a plain loop (or a boosted model's) updated each replica's
    running mean from its own half of the batch and trained on, the replicas apart from
    each other and from one process, without an error."""
    for kind, msg, unchanged in world2.run(by_hand_case, module="running_mean",
                                           layout=layout):
        assert kind == "RankMismatchError", (kind, msg)
        assert "buffer 1.mean differs among ranks" in msg and "whole batch" in msg, msg
        assert "the first training forward" in msg, msg
        assert unchanged


@pytest.mark.parametrize("layout", ["dp", "zero3"])
def test_a_parameter_set_in_a_forward_called_by_hand_is_refused(world2, layout):
    for kind, msg, unchanged in world2.run(by_hand_case, module="actnorm", layout=layout):
        assert kind == "ConfigError", (kind, msg)
        assert "parameter '1.scale' is written in the training forward" in msg, msg
        assert unchanged


@pytest.mark.parametrize("layout", ["dp", "booster"])
def test_a_buffer_every_rank_updates_alike_trains_by_hand(world2, layout):
    for kind, err, _ in world2.run(by_hand_case, module="seen_length", layout=layout):
        assert kind == "trained", err
        assert err < 1e-12, err


def test_the_same_batch_on_every_rank_trains_by_hand(world2):
    """Every replica given the whole batch updates the running mean alike: nothing is
    refused, and the weights are one process's."""
    for kind, err, _ in world2.run(by_hand_case, module="running_mean", layout="dp",
                                   split=False):
        assert kind == "trained", err
        assert err < 1e-12, err
