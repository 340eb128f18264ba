"""P (PartitionSpec) values, the P <-> DTensor placement conversion, and block arithmetic."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import meshlab
from meshlab import P, SpecError, from_placements, to_placements
from meshlab.core.placement import dim_block, local_shape, uneven_dims

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# P as a value
# ---------------------------------------------------------------------------------------

SPECS = [
    P(),
    P(None),
    P("dp"),
    P("dp", None),
    P(None, "tp"),
    P("dp", "tp"),
    P(("dp", "tp")),
    P(("dp", "tp"), "sp", None),
    P(None, ("fsdp", "tp")),
    P(partial="tp"),
    P("dp", partial="tp"),
    P(("dp", "fsdp"), partial=("tp", "sp")),
    P("batch", "embed"),
]


def test_partial_axes_are_a_set():
    # Found by the property test below: placements list partial axes in mesh order.
    a, b = P(partial=("tp", "dp")), P(partial=("dp", "tp"))
    assert a == b and hash(a) == hash(b)
    assert repr(a) == "P(partial=('tp', 'dp'))"          # written as the user wrote it
    mesh = ("dp", "tp")
    assert from_placements(to_placements(a, mesh, ()), mesh, 0) == a


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_repr_pastes_back_as_code(spec):
    again = eval(repr(spec), {"P": P})
    assert again == spec
    assert repr(again) == repr(spec)
    assert again.partial == spec.partial
    assert tuple(again) == tuple(spec)


def test_repr_spelling():
    assert repr(P()) == "P()"
    assert repr(P("dp", None)) == "P('dp', None)"
    assert repr(P(("dp", "tp"), "sp")) == "P(('dp', 'tp'), 'sp')"
    assert repr(P("dp", partial="tp")) == "P('dp', partial='tp')"
    assert repr(P(partial=("dp", "tp"))) == "P(partial=('dp', 'tp'))"


def test_empty_spec_is_replicated():
    p = P()
    assert len(p) == 0
    assert p.axes == ()
    assert p.partial == ()
    assert p.dim_axes(0) == () and p.dim_axes(5) == ()
    assert p == P(None, None, None)
    assert p.padded(3) == P(None, None, None)
    assert len(p.padded(3)) == 3


def test_trailing_none_equality_and_hash():
    assert P("dp") == P("dp", None) == P("dp", None, None)
    assert hash(P("dp")) == hash(P("dp", None)) == hash(P("dp", None, None))
    assert P(None, "dp") != P("dp")
    assert P("dp", partial="tp") == P("dp", None, partial="tp")
    assert hash(P("dp", partial="tp")) == hash(P("dp", None, partial="tp"))
    assert P("dp", partial="tp") != P("dp")
    assert len({P("dp"), P("dp", None), P("dp", None, None)}) == 1
    assert P("dp", None).normalized() == P("dp") and len(P("dp", None).normalized()) == 1


def test_entry_spellings_normalize():
    # a 1-tuple is the bare name, an empty tuple is None, a list is a tuple
    assert P(("dp",)) == P("dp") and P(("dp",))[0] == "dp"
    assert P(()) == P(None) and P(())[0] is None
    assert P(["dp", "tp"]) == P(("dp", "tp")) and P(["dp", "tp"])[0] == ("dp", "tp")
    assert P(("dp", "tp"), "sp").axes == ("dp", "tp", "sp")
    assert P("dp", partial="tp").axes == ("dp", "tp")
    assert P(("dp", "tp"), "sp").dim_axes(0) == ("dp", "tp")
    assert P(("dp", "tp"), "sp").dim_axes(1) == ("sp",)


def test_p_is_immutable():
    p = P("dp")
    with pytest.raises(AttributeError):
        p.foo = 1
    with pytest.raises(AttributeError):
        p._dims = ()


@pytest.mark.parametrize("make", [
    lambda: P("dp", "dp"),
    lambda: P(("dp", "dp")),
    lambda: P(("dp", "tp"), "tp"),
    lambda: P("dp", partial="dp"),
    lambda: P(None, ("tp", "sp"), partial=("dp", "sp")),
    lambda: P(partial=("tp", "tp")),
], ids=["two-dims", "in-tuple", "tuple-and-dim", "dim-and-partial", "tuple-and-partial",
        "partial-twice"])
def test_axis_used_twice_raises(make):
    with pytest.raises(SpecError, match="twice"):
        make()


@pytest.mark.parametrize("entries, kwargs", [
    ((1,), {}),
    ((0,), {}),
    ((1.5,), {}),
    (("",), {}),
    (("a-b",), {}),
    (("1dp",), {}),
    (("dp tp",), {}),
    ((("dp", 1),), {}),
    ((("dp", ""),), {}),
    (((("dp", "tp"),),), {}),      # nested tuple
    (({"dp"},), {}),
    (({"dp": 1},), {}),
    ((True,), {}),
    ((), {"partial": ""}),
    ((), {"partial": "a-b"}),
    ((), {"partial": ("dp", 3)}),
    ((), {"partial": 1}),
], ids=repr)
def test_bad_entries_raise_spec_error(entries, kwargs):
    with pytest.raises(SpecError):
        P(*entries, **kwargs)


def test_spec_error_is_value_error_and_meshlab_error():
    with pytest.raises(ValueError):
        P(1)
    with pytest.raises(meshlab.MeshlabError):
        P("dp", "dp")


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_pickle_round_trip(spec):
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec
    assert repr(again) == repr(spec)
    assert again.partial == spec.partial
    assert hash(again) == hash(spec)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_json_round_trip(spec):
    text = json.dumps(spec.to_json())
    again = P.from_json(json.loads(text))
    assert again == spec
    assert tuple(again) == tuple(spec)      # same entries, trailing Nones included
    assert again.partial == spec.partial


def test_padded_and_replace():
    assert tuple(P("dp").padded(3)) == ("dp", None, None)
    with pytest.raises(SpecError):
        P("dp", "tp").padded(1)
    assert P("dp", partial="tp").replace(None, "dp") == P(None, "dp", partial="tp")
    assert P("dp", partial="tp").replace(partial=None) == P("dp")


# ---------------------------------------------------------------------------------------
# to_placements / from_placements
# ---------------------------------------------------------------------------------------

def test_to_placements_concrete():
    axes = ("dp", "tp")
    assert to_placements(P("dp", "tp"), axes, (4, 4)) == (Shard(0), Shard(1))
    assert to_placements(P(None, "dp"), axes, (4, 4)) == (Shard(1), Replicate())
    assert to_placements(P(("dp", "tp")), axes, (8,)) == (Shard(0), Shard(0))
    assert to_placements(P(), axes, (8,)) == (Replicate(), Replicate())
    assert to_placements(P("dp", partial="tp"), axes, (8,)) == (Shard(0), Partial("sum"))


def test_from_placements_concrete():
    axes = ("dp", "tp")
    assert from_placements((Shard(-1), Replicate()), axes, 2) == P(None, "dp")
    assert from_placements((Shard(0), Shard(0)), axes, 1) == P(("dp", "tp"))
    assert from_placements((Replicate(), Partial("sum")), axes, 3) == P(partial="tp")
    with pytest.raises(SpecError, match="reduce op"):
        from_placements((Partial("max"), Replicate()), axes, 1)


@pytest.mark.parametrize("spec, shape, match", [
    (P("sp"), (4,), "does not"),                 # unknown axis
    (P("dp", "tp"), (4,), "entries"),            # more entries than dims
    (P(("tp", "dp")), (4,), "mesh order"),       # tuple against mesh order
    (P(partial="sp"), (4,), "does not"),         # unknown partial axis
])
def test_to_placements_rejects(spec, shape, match):
    with pytest.raises(SpecError, match=match):
        to_placements(spec, ("dp", "tp"), shape)


NAMES = ["dp", "tp", "sp", "fsdp", "ep", "pp"]


@st.composite
def mesh_axes(draw):
    """1-4 distinct axis names, each with a size 1-4."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    sizes = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
    return dict(zip(names, sizes))


@st.composite
def valid_case(draw):
    """(mesh axes, ndim, shape, spec): a spec valid on the mesh, tuples in mesh order."""
    axes = draw(mesh_axes())
    names = list(axes)
    ndim = draw(st.integers(0, 4))
    # each mesh axis goes to one dim, to partial, or is unused (-1)
    choices = [-1, -2] + list(range(ndim))           # -2: partial
    where = [draw(st.sampled_from(choices)) for _ in names]
    dims: list = []
    for d in range(ndim):
        used = [n for n, w in zip(names, where) if w == d]   # in mesh order
        dims.append(None if not used else (used[0] if len(used) == 1 else tuple(used)))
    partial = tuple(n for n, w in zip(names, where) if w == -2)
    last = max([d + 1 for d, e in enumerate(dims) if e is not None], default=0)
    length = draw(st.integers(last, ndim))      # trailing Nones are optional
    spec = P(*dims[:length], partial=partial or None)
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    return axes, ndim, shape, spec


@SETTINGS
@given(valid_case())
def test_placements_round_trip(case):
    axes, ndim, shape, spec = case
    names = tuple(axes)
    pls = to_placements(spec, names, shape)
    assert len(pls) == len(names)
    for name, pl in zip(names, pls):
        if name in spec.partial:
            assert pl == Partial("sum")
        elif name in spec.axes:
            d = next(d for d in range(len(spec)) if name in spec.dim_axes(d))
            assert pl == Shard(d)
        else:
            assert pl == Replicate()
    back = from_placements(pls, names, ndim)
    assert back == spec
    assert back == spec.normalized()
    assert back.partial == spec.partial
    assert len(back) == len(spec.normalized())


ENTRY_NAMES = st.sampled_from(NAMES + ["unknown", "batch", "x1"])


@st.composite
def any_entry(draw):
    return draw(st.one_of(
        st.none(),
        ENTRY_NAMES,
        st.lists(ENTRY_NAMES, min_size=0, max_size=3).map(tuple),  # any order, duplicates
        st.integers(-2, 3),
        st.sampled_from(["", "a-b", "0x"]),
    ))


@SETTINGS
@given(axes=mesh_axes(), ndim=st.integers(0, 4),
       entries=st.lists(any_entry(), min_size=0, max_size=6),
       partial=st.one_of(st.none(), ENTRY_NAMES,
                         st.lists(ENTRY_NAMES, max_size=3).map(tuple)),
       data=st.data())
def test_arbitrary_specs_succeed_or_raise_spec_error(axes, ndim, entries, partial, data):
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    names = tuple(axes)
    try:
        spec = P(*entries, partial=partial)
    except SpecError:
        return
    try:
        pls = to_placements(spec, names, shape)
    except SpecError:
        # it must have been one of the documented reasons
        bad_len = len(spec) > ndim
        unknown = any(a not in names for a in spec.axes)
        order = any([names.index(a) for a in spec.dim_axes(d) if a in names]
                    != sorted(names.index(a) for a in spec.dim_axes(d) if a in names)
                    for d in range(len(spec)))
        assert bad_len or unknown or order
        return
    # accepted: then it is valid and round-trips
    assert len(spec) <= ndim
    assert all(a in names for a in spec.axes)
    assert from_placements(pls, names, ndim) == spec


# ---------------------------------------------------------------------------------------
# dim_block vs torch.chunk (DTensor's semantics)
# ---------------------------------------------------------------------------------------

def _chunk(t: torch.Tensor, k: int, c: int) -> torch.Tensor:
    """Chunk ``c`` of ``k`` as DTensor has it: torch.chunk, padded with empty chunks."""
    chunks = torch.chunk(t, k)
    return chunks[c] if c < len(chunks) else t[len(t):]


@SETTINGS
@given(n=st.integers(0, 80), k=st.integers(1, 12))
def test_dim_block_matches_torch_chunk(n, k):
    x = torch.arange(n)
    total = 0
    for c in range(k):
        off, length = dim_block(n, [k], [c])
        expect = _chunk(x, k, c)
        assert length == len(expect)
        if length:
            assert off == int(expect[0])
            assert torch.equal(x[off:off + length], expect)
        else:
            assert off == n          # empty chunks sit at the end
        # DTensor's own helper agrees, offsets included
        size, doff = Shard.local_shard_size_and_offset(n, k, c)
        assert (off, length) == (int(doff), int(size))
        total += length
    assert total == n


@SETTINGS
@given(n=st.integers(0, 60), k1=st.integers(1, 6), k2=st.integers(1, 6))
def test_nested_dim_block_matches_chunking_twice(n, k1, k2):
    x = torch.arange(n)
    seen = []
    for c1 in range(k1):
        outer = _chunk(x, k1, c1)
        for c2 in range(k2):
            off, length = dim_block(n, [k1, k2], [c1, c2])
            inner = _chunk(outer, k2, c2)
            assert length == len(inner)
            if length:
                assert off == int(inner[0])
            seen.extend(range(off, off + length))
    # every element is held by exactly one (c1, c2), in order
    assert seen == list(range(n))


def test_dim_block_examples():
    # 7 over 2 x 2: dp takes [0:4] and [4:7]; tp splits each
    assert [dim_block(7, [2, 2], [a, b]) for a in range(2) for b in range(2)] == \
        [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert [dim_block(5, [4], [c]) for c in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert dim_block(9, [], []) == (0, 9)


def test_local_shape_and_uneven_dims():
    sizes = {"dp": 2, "tp": 4}
    assert local_shape((8, 16), P("dp", "tp"), sizes) == (4, 4)
    assert local_shape((7, 16), P(("dp", "tp")), sizes) == (1, 16)   # ceil(ceil(7/2)/4)
    assert local_shape((5, 3), P("tp"), sizes) == (2, 3)
    assert uneven_dims((8, 6), P("dp", "tp"), sizes) == [(1, 4)]
    assert uneven_dims((7, 16), P(("dp", "tp")), sizes) == [(0, 8)]
    assert uneven_dims((8, 8), P("dp", "tp"), sizes) == []
