"""A kernel build that was killed never blocks a later process.

``cpp_extension.load`` leaves a ``lock`` file in the build folder while it compiles and
makes every other process wait until the file goes, without limit: a build killed midway
(Ctrl-C, a CI job's time limit) made every later run of the suite wait forever at its first
native op. meshlab's builds hold the folder by an OS lock instead (dropped when the holder
dies), clear a leftover ``lock`` under it, and give up on a live holder after
``BUILD_WAIT_S`` with the op's reference.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
import time

import pytest

from meshlab.ops import _build

pytestmark = pytest.mark.timeout(300)


def test_leftover_lock_file_is_cleared(tmp_path):
    (tmp_path / "lock").touch()                 # what a killed build leaves
    with _build._folder_lock(tmp_path, "meshlab_x"):
        assert not (tmp_path / "lock").exists()


def _hold(folder, ready, release):
    with _build._folder_lock(folder, "meshlab_x"):
        ready.set()
        release.wait(60)


def test_live_builder_is_waited_for_then_refused(tmp_path, monkeypatch):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        (tmp_path / "lock").touch()             # the live builder's own lock file stays
        monkeypatch.setattr(_build, "BUILD_WAIT_S", 0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another process has held its build folder"):
            with _build._folder_lock(tmp_path, "meshlab_x"):
                pass
        assert time.monotonic() - t0 < 10
        assert (tmp_path / "lock").exists()
    finally:
        release.set()
        holder.join(30)
    with _build._folder_lock(tmp_path, "meshlab_x"):    # its holder gone, the folder is free
        assert not (tmp_path / "lock").exists()


@pytest.mark.skipif(_build._compiler_missing() is not None, reason="no C++ toolchain")
def test_build_after_a_killed_build_completes(tmp_path):
    """End to end: a build folder holding a killed build's ``lock`` file; the next process
    builds the extension (before, it waited on the file forever)."""
    src = tmp_path / "csrc"
    src.mkdir()
    # Python's C API alone, not torch/extension.h nor pybind11: the build is what is
    # tested, and their headers would take most of its time
    (src / "tiny.cpp").write_text(textwrap.dedent("""
        #include <Python.h>
        static PyObject *twice(PyObject *, PyObject *x) {
            return PyLong_FromLongLong(2 * PyLong_AsLongLong(x));
        }
        static PyMethodDef methods[] = {{"twice", twice, METH_O, nullptr}, {}};
        #define INIT2(name) PyInit_##name
        #define INIT(name) INIT2(name)
        PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() {
            static PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
            return PyModule_Create(&def);
        }
    """))
    ext = tmp_path / "ext"
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        os.environ["TORCH_EXTENSIONS_DIR"] = {str(ext)!r}
        from meshlab.ops import _build
        _build._CSRC = Path({str(src)!r})
        _build._cflags = lambda: ["-O0"]
        (_build.build_dir("meshlab_tiny") / "lock").touch()     # a killed build's leftover
        mod = _build.cpu_extension("meshlab_tiny", ("tiny.cpp",))
        print(_build.failure("meshlab_tiny"), mod.twice(21))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "42"]
