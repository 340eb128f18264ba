"""sharding_view / visualize / type_string on fake meshes."""

from __future__ import annotations

import pytest
import torch

import meshlab as ml
from meshlab import Mesh, P, SpecError
from meshlab.core.visualize import sharding_view, type_string

MESH = Mesh(dp=2, tp=2, fake=True)


def test_blocks_2d_dp_tp():
    view = sharding_view((8, 4), P("dp", "tp"), MESH)
    assert view.blocks == {
        ((0, 4), (0, 2)): (0,),
        ((0, 4), (2, 2)): (1,),
        ((4, 4), (0, 2)): (2,),
        ((4, 4), (2, 2)): (3,),
    }
    assert view.shape == (8, 4)
    assert view.spec == P("dp", "tp")
    assert view.mesh_shape == (("dp", 2), ("tp", 2))
    assert view.rank_block(3) == ((4, 4), (2, 2))
    with pytest.raises(KeyError):
        view.rank_block(4)


def test_blocks_2d_transposed_spec():
    view = sharding_view((8, 4), P("tp", "dp"), MESH)
    # rank = 2 * dp + tp; tp splits rows, dp splits columns
    assert view.blocks == {
        ((0, 4), (0, 2)): (0,),
        ((4, 4), (0, 2)): (1,),
        ((0, 4), (2, 2)): (2,),
        ((4, 4), (2, 2)): (3,),
    }


def test_uneven_1d_over_two_axes():
    view = sharding_view((7,), P(("dp", "tp")), MESH)
    # dp splits 7 into [0:4] and [4:7]; tp splits each of them (torch.chunk)
    assert view.blocks == {((0, 2),): (0,), ((2, 2),): (1,), ((4, 2),): (2,), ((6, 1),): (3,)}
    # every element is held exactly once
    held = sorted(i for (o, n), in view.blocks for i in range(o, o + n))
    assert held == list(range(7))
    assert view.type_str == "f32[7@(dp,tp)]"


def test_more_shards_than_elements_gives_empty_blocks():
    view = sharding_view((3,), P(("dp", "tp")), MESH)
    # 3 over dp: [0:2], [2:3]; then over tp: [0:1], [1:2] | [2:3], empty
    assert view.blocks == {((0, 1),): (0,), ((1, 1),): (1,), ((2, 1),): (2,), ((3, 0),): (3,)}
    assert "3:3" in str(view)                   # the empty block is shown too


def test_replicated_axes_list_several_ranks():
    view = sharding_view((8,), P("tp"), MESH)
    assert view.blocks == {((0, 4),): (0, 2), ((4, 4),): (1, 3)}
    view = sharding_view((8,), P("dp"), MESH)
    assert view.blocks == {((0, 4),): (0, 1), ((4, 4),): (2, 3)}
    view = sharding_view((8, 2), P(), MESH)
    assert view.blocks == {((0, 8), (0, 2)): (0, 1, 2, 3)}
    big = Mesh(dp=2, tp=8, fake=True)
    view = sharding_view((4,), P("dp"), big)
    assert view.blocks == {((0, 2),): tuple(range(8)), ((2, 2),): tuple(range(8, 16))}
    text = str(view)
    assert "(8)" in text         # long rank lists are abbreviated with their count


def test_scalar_and_3d_views():
    view = sharding_view((), P(), MESH)
    assert view.blocks == {(): (0, 1, 2, 3)}
    assert view.type_str == "f32[]"
    assert "f32[]" in str(view)
    view = sharding_view((2, 4, 6), P(None, "dp", "tp"), MESH, torch.bfloat16)
    assert len(view.blocks) == 4
    assert view.blocks[((0, 2), (2, 2), (3, 3))] == (3,)
    assert "bf16[2,4@dp,6@tp]" in str(view)


def test_sharding_view_checks_spec():
    with pytest.raises(SpecError, match="'sp'"):
        sharding_view((8,), P("sp"), MESH)
    with pytest.raises(SpecError):
        sharding_view((8,), P("dp", "tp"), MESH)
    with pytest.raises(SpecError, match="mesh order"):
        sharding_view((8,), P(("tp", "dp")), MESH)


@pytest.mark.parametrize("shape, dtype, spec, text", [
    ((8, 4), torch.float32, P("dp", "tp"), "f32[8@dp,4@tp]"),
    ((8,), torch.bfloat16, P(("dp", "tp")), "bf16[8@(dp,tp)]"),
    ((8, 4), torch.float16, P(None, "tp"), "f16[8,4@tp]"),
    ((8, 4), torch.float32, P(), "f32[8,4]"),
    ((3,), torch.int64, P(), "i64[3]"),
    ((8, 4), torch.float32, P("dp", partial="tp"), "f32[8@dp,4]{P:tp}"),
    ((8,), torch.float32, P(partial=("dp", "tp")), "f32[8]{P:dp,tp}"),
    ((2,), torch.complex64, P(), "complex64[2]"),
])
def test_type_string(shape, dtype, spec, text):
    assert type_string(shape, dtype, spec) == text
    assert ml.type_string(shape, dtype, spec) == text


def test_typeof_plain_tensor():
    assert ml.typeof(torch.zeros(2, 3)) == "f32[2,3]"
    assert ml.typeof(torch.zeros(4, dtype=torch.bfloat16)) == "bf16[4]"


def test_str_view_renders_text():
    view = sharding_view((8, 4), P("dp", "tp"), MESH)
    text = str(view)
    assert isinstance(text, str)
    assert "f32[8@dp,4@tp]" in text
    assert "Mesh(dp=2, tp=2)" in text
    # row and column ranges of the blocks
    assert "0:4" in text and "4:8" in text and "0:2" in text and "2:4" in text
    partial = sharding_view((8, 4), P("dp", partial="tp"), MESH)
    flat = " ".join(str(partial).split())
    assert "values are partial sums over tp" in flat


@pytest.mark.parametrize("shape, spec, type_str", [
    ((7,), P(("dp", "tp")), "f32[7@(dp,tp)]"),
    ((8,), P("dp", partial="tp"), "f32[8@dp]{P:tp}"),
    ((8,), P("tp"), "f32[8@tp]"),
])
def test_str_view_of_narrow_table_keeps_type_string_whole(shape, spec, type_str):
    # The rendered text must contain the type string itself, even when the table (a 1-D
    # tensor: one narrow column) is narrower than the title.
    view = sharding_view(shape, spec, MESH)
    assert view.type_str == type_str
    assert type_str in str(view)


def test_visualize_returns_view_without_printing(capsys):
    view = ml.visualize((8, 4), P("dp", "tp"), MESH, show=False)
    assert view.type_str == "f32[8@dp,4@tp]"
    assert len(view.blocks) == 4
    assert capsys.readouterr().out == ""
    t = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert ml.visualize(t, P("dp"), MESH, show=False).type_str == "bf16[8@dp,4]"


def test_visualize_prints(capsys):
    ml.visualize((8, 4), P("dp", "tp"), MESH, show=True)
    assert "f32[8@dp,4@tp]" in capsys.readouterr().out


def test_visualize_needs_spec_and_mesh():
    with pytest.raises(SpecError):
        ml.visualize((8, 4), show=False)
    with pytest.raises(SpecError):
        ml.visualize((8, 4), P("dp"), show=False)
