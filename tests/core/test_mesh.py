"""Mesh: fake meshes for planning, the one real single-process mesh, and the context."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import meshlab as ml
from meshlab import Mesh, MeshError

from tests import REPO

ROOT = os.fspath(REPO)


def test_fake_mesh_shape_and_size():
    m = Mesh(pp=8, dp=16, tp=8, fake=True)
    assert m.axis_names == ("pp", "dp", "tp")
    assert m.shape == {"pp": 8, "dp": 16, "tp": 8}
    assert list(m.shape) == ["pp", "dp", "tp"]          # mesh order
    assert m.shape_tuple == (8, 16, 8)
    assert m.size == 1024
    assert m.ndim == 3
    assert m.fake and m.device_type == "meta"
    assert m.rank == 0
    assert m.axis_size("dp") == 16
    assert list(m) == ["pp", "dp", "tp"]
    assert m.ranks.shape == (8, 16, 8)
    assert np.array_equal(m.ranks.ravel(), np.arange(1024))


def test_mapping_and_keyword_axes_keep_order():
    m = Mesh({"a": 2, "b": 3}, c=4, fake=True)
    assert m.axis_names == ("a", "b", "c")
    assert m.size == 24
    assert Mesh(dp=np.int64(4), fake=True).shape == {"dp": 4}


def test_axis_size_of_missing_axis():
    with pytest.raises(MeshError, match="'sp'"):
        Mesh(dp=2, fake=True).axis_size("sp")


def test_fake_mesh_has_no_device_mesh():
    with pytest.raises(MeshError, match="fake"):
        Mesh(dp=2, fake=True).device_mesh


def test_sub_mesh():
    m = Mesh(dp=2, tp=4, fake=True)
    tp = m["tp"]
    assert tp == m.sub("tp")
    assert tp.shape == {"tp": 4} and tp.fake
    assert list(tp.ranks) == [0, 1, 2, 3]      # the tp group of rank 0
    dp = m["dp"]
    assert list(dp.ranks) == [0, 4]            # the dp group of rank 0
    both = m["dp", "tp"]
    assert both.shape == m.shape and np.array_equal(both.ranks, m.ranks)


def test_sub_mesh_keeps_requested_order():
    m = Mesh(a=2, b=3, c=4, fake=True)
    s = m.sub("c", "a")
    assert s.axis_names == ("c", "a")
    assert s.ranks.shape == (4, 2)
    for c in range(4):
        for a in range(2):
            assert s.ranks[c, a] == m.ranks[a, 0, c]
    s3 = m.sub("c", "a", "b")
    assert s3.ranks.shape == (4, 2, 3)
    for a in range(2):
        for b in range(3):
            for c in range(4):
                assert s3.ranks[c, a, b] == m.ranks[a, b, c]
                assert m.coordinate(int(m.ranks[a, b, c])) == {"a": a, "b": b, "c": c}


def test_sub_mesh_errors():
    m = Mesh(dp=2, tp=2, fake=True)
    with pytest.raises(MeshError):
        m.sub("sp")
    with pytest.raises(MeshError):
        m.sub("dp", "dp")


def test_flatten():
    m = Mesh(pp=2, dp=3, tp=4, fake=True)
    f = m.flatten("pp", "dp")
    assert f.shape == {"pp_dp": 6, "tp": 4}
    assert np.array_equal(f.ranks.ravel(), np.arange(24))
    g = m.flatten("dp", "tp", name="dtp")
    assert g.shape == {"pp": 2, "dtp": 12}
    h = m.flatten("pp", "dp", "tp")
    assert h.shape == {"pp_dp_tp": 24}
    assert repr(Mesh(pp=8, dp=16, tp=8, fake=True).flatten("pp", "dp")) == \
        "Mesh(pp_dp=128, tp=8, fake=True)"


@pytest.mark.parametrize("names", [("pp",), ("pp", "tp"), ("dp", "pp"), ("pp", "sp")])
def test_flatten_errors(names):
    with pytest.raises(MeshError):
        Mesh(pp=2, dp=3, tp=4, fake=True).flatten(*names)


@pytest.mark.parametrize("axes, names, name", [
    ({"a": 2, "b": 2, "tp": 2}, ("a", "b"), "tp"),      # explicit name of another axis
    ({"a": 2, "b": 3, "a_b": 4}, ("a", "b"), None),     # default name of another axis
])
def test_flatten_to_existing_name_raises_mesh_error(axes, names, name):
    # The merged axis must not silently swallow (or crash on) an axis of the same name.
    with pytest.raises(MeshError):
        Mesh(axes, fake=True).flatten(*names, name=name)


def test_coordinate():
    m = Mesh(dp=2, tp=4, fake=True)
    assert m.coordinate(0) == {"dp": 0, "tp": 0}
    assert m.coordinate(6) == {"dp": 1, "tp": 2}
    assert m.coordinate(7) == {"dp": 1, "tp": 3}
    with pytest.raises(MeshError, match="8"):
        m.coordinate(8)


def test_parse():
    m = Mesh.parse("pp=8,dp=16,tp=8")
    assert m == Mesh(pp=8, dp=16, tp=8, fake=True)
    assert Mesh.parse(" dp = 4 , tp=2 ,").shape == {"dp": 4, "tp": 2}


@pytest.mark.parametrize("text", ["dp", "dp=", "dp=x", "dp=-1", "dp=0", "dp=2.5", "", "=4",
                                  "d-p=2", "dp=2,dp=4", "dp=\u00b2"])
def test_parse_rejects(text):
    with pytest.raises(MeshError):
        Mesh.parse(text)


@pytest.mark.parametrize("mesh", [
    Mesh(dp=4, fake=True),
    Mesh(dp=2, tp=2, fake=True),
    Mesh(pp=8, dp=16, tp=8, fake=True),
    Mesh(pp=2, dp=3, tp=4, fake=True).flatten("dp", "tp"),
], ids=repr)
def test_repr_pastes_back(mesh):
    again = eval(repr(mesh), {"Mesh": Mesh})
    assert again == mesh
    assert hash(again) == hash(mesh)
    assert "fake=True" in repr(mesh)


def test_equality():
    assert Mesh(dp=2, tp=2, fake=True) == Mesh(dp=2, tp=2, fake=True)
    assert Mesh(dp=2, tp=2, fake=True) != Mesh(tp=2, dp=2, fake=True)
    assert Mesh(dp=2, tp=2, fake=True) != Mesh(dp=4, fake=True)
    assert Mesh(dp=2, tp=2, fake=True) != Mesh(dp=2, tp=2, fake=True)["tp"]


def test_immutable():
    m = Mesh(dp=2, fake=True)
    with pytest.raises(AttributeError):
        m.foo = 1


def test_a_copy_of_a_mesh_or_of_what_holds_one_shares_it():
    """An immutable value: copy and deepcopy give the mesh itself (a deepcopy had raised
    "Mesh is immutable" rebuilding its slots)."""
    import copy

    m = Mesh(dp=2, tp=2, fake=True)
    assert copy.copy(m) is m and copy.deepcopy(m) is m
    holder = copy.deepcopy({"mesh": m, "n": [1]})
    assert holder["mesh"] is m


@pytest.mark.slow
def test_a_parallelized_models_deepcopy_is_refused_by_name(one_process):
    """``copy.deepcopy`` of a parallelized model (Colossal-AI's LoRA test copies a boosted
    model) raises a ConfigError naming the fix, before it reaches the process groups it
    could not copy (a TypeError on pickling a ProcessGroup before)."""
    import copy

    import meshlab as ml
    from meshlab.core.errors import ConfigError
    from tests import _models as M

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=1), seed=0)
    with pytest.raises(ConfigError, match="Keep a copy of its weights"):
        copy.deepcopy(model)


@pytest.mark.parametrize("args, kwargs", [
    ((), {"fake": True}),
    ((), {"dp": 0, "fake": True}),
    ((), {"dp": -2, "fake": True}),
    ((), {"dp": 2.0, "fake": True}),
    ((), {"dp": "2", "fake": True}),
    ((), {"dp": True, "fake": True}),
    ((), {"dp": None, "fake": True}),
    (({"d-p": 2},), {"fake": True}),
    (({"": 2},), {"fake": True}),
    (({1: 2},), {"fake": True}),
    (({"dp": 2},), {"dp": 2, "fake": True}),
], ids=repr)
def test_invalid_sizes_and_names(args, kwargs):
    with pytest.raises(MeshError):
        Mesh(*args, **kwargs)


def test_real_mesh_without_launcher_raises_in_subprocess():
    code = textwrap.dedent("""
        import sys
        from meshlab import Mesh, MeshError
        import torch.distributed as dist
        try:
            Mesh(dp=2, tp=2)
        except MeshError as e:
            print("MSG:" + str(e))
            print("INIT:" + str(dist.is_initialized()))
            sys.exit(0)
        print("no error")
        sys.exit(3)
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    msg = next(line for line in out.stdout.splitlines() if line.startswith("MSG:"))
    assert "4" in msg
    assert "fake=True" in msg
    assert "INIT:False" in out.stdout          # nothing was left initialized


def test_real_single_process_mesh(monkeypatch):
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    was = dist.is_initialized()
    try:
        m = Mesh(dp=1)
        assert not m.fake
        assert m.device_type == "cpu"
        assert m.size == 1 and m.rank == 0
        dm = m.device_mesh
        assert tuple(dm.mesh_dim_names) == ("dp",)
        assert tuple(dm.shape) == (1,)
        assert repr(m) == "Mesh(dp=1)"
        assert m != Mesh(dp=1, fake=True)
    finally:
        if dist.is_initialized() and not was:
            dist.destroy_process_group()


def test_with_mesh_sets_current_mesh():
    a = Mesh(dp=2, fake=True)
    b = Mesh(tp=4, fake=True)
    assert ml.current_mesh() is None
    with a as got:
        assert got is a
        assert ml.current_mesh() is a
        with b:
            assert ml.current_mesh() is b
        assert ml.current_mesh() is a
    assert ml.current_mesh() is None


def test_with_mesh_unsets_on_error():
    a = Mesh(dp=2, fake=True)
    with pytest.raises(KeyError):
        with a:
            raise KeyError("x")
    assert ml.current_mesh() is None


def test_use_mesh_with_rules():
    from meshlab.core.context import current_rules

    mesh, rules = Mesh(dp=2, fake=True), ml.Rules(batch="dp")
    with ml.use_mesh(mesh, rules):
        assert ml.current_mesh() is mesh
        assert current_rules() is rules
    assert ml.current_mesh() is None and current_rules() is None


def test_abstract_mesh_is_its_own_type_and_cannot_run():
    """A planning mesh is an ``AbstractMesh`` (JAX's split): it plans, and ``parallelize``
    refuses it by its type before any process group is needed."""
    from meshlab import AbstractMesh, MeshError
    from tests import _models as M

    m = Mesh(dp=2, tp=2, fake=True)
    assert type(m) is AbstractMesh and not isinstance(m, Mesh)
    assert AbstractMesh(dp=2, tp=2) == m and m.flatten("dp", "tp") == AbstractMesh(dp_tp=4)
    assert type(m["tp"]) is AbstractMesh and m.rank == 0
    with pytest.raises(MeshError, match="no DeviceMesh"):
        m.device_mesh
    assert ml.plan(M.build("llama"), ml.zero_shard(3, ("dp", "tp")), m).runnable
    with pytest.raises(MeshError, match="abstract mesh is for planning only"):
        ml.parallelize(M.build("llama"), ml.zero_shard(3, "dp"), AbstractMesh(dp=1))
