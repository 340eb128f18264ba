"""Running a ``meshlab`` command through ``meshlab.cli.main`` in the test process."""

from __future__ import annotations

import contextlib
import io
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_process(argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
    """``meshlab <argv>`` through ``meshlab.cli.main`` here: (exit code, stdout, stderr).
    An exception other than argparse's exit propagates: the command would have printed a
    traceback."""
    from meshlab.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_cols = os.getcwd(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    try:
        os.chdir(cwd or ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
    finally:
        os.chdir(old_cwd)
        if old_cols is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old_cols
    return rc, out.getvalue(), err.getvalue()
