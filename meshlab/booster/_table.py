"""The argument mapping table of ``docs/booster.md``, generated from the plugins' and
methods' own argument lists.

``python -m meshlab.booster.table docs/booster.md`` rewrites the block between the
page's ``<!-- mapping:begin -->`` and ``<!-- mapping:end -->`` markers; a test checks the
page holds exactly what this module generates.
"""

from __future__ import annotations

BEGIN, END = "<!-- mapping:begin -->", "<!-- mapping:end -->"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _section(title: str, rows: list) -> list[str]:
    out = [f"### {title}", "", "| argument | default | in meshlab | what it becomes |",
           "|---|---|---|---|"]
    out += [f"| `{a}` | `{_escape(d)}` | {k} | {_escape(m)} |" for a, d, k, m in rows]
    return out + [""]


def mapping_table() -> str:
    """Markdown: one table per plugin and per checkpoint method, every argument listed."""
    from ._args import table_rows
    from ._ckpt import METHODS
    from .plugin import PLUGINS

    lines: list[str] = []
    for cls in PLUGINS:
        lines += _section(cls.__name__, table_rows(cls.ARGS))
    for name, args in METHODS.items():
        lines += _section(f"Booster.{name}", table_rows(args))
    return "\n".join(lines).rstrip() + "\n"


def rewrite(path: str) -> bool:
    """Replace the generated block of ``path``; returns whether it changed."""
    with open(path) as f:
        text = f.read()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{mapping_table()}{END}{tail}"
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def generated_block(path: str) -> str:
    with open(path) as f:
        text = f.read()
    return text.partition(BEGIN)[2].partition(END)[0].strip("\n") + "\n"
