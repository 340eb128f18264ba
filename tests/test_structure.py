"""The shape of the code: no function under ``meshlab/`` longer than 80 lines, no import
cycle between its modules (``TYPE_CHECKING`` imports aside), ops import nothing from the
transforms, and every room of ``meshlab.parallel`` is one package."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "meshlab"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        out[name[:-9] if name.endswith(".__init__") else name] = f
    return out


def _imports(name: str, f: pathlib.Path, mods: dict) -> set[str]:
    tree = ast.parse(f.read_text())
    skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If)
            and "TYPE_CHECKING" in ast.unparse(n.test) for x in ast.walk(n)}
    pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            tgt = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{tgt}.{a.name}" for a in node.names} & mods.keys()
            if len(subs) < len(node.names) and tgt in mods:
                out.add(tgt)
            out |= subs
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & mods.keys()
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_function_longer_than_80_lines():
    long = []
    for f in ROOT.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = n.end_lineno - n.lineno + 1
                if length > 80:
                    long.append(f"{f.relative_to(ROOT.parent)}:{n.lineno} {n.name} ({length})")
    assert not long, long


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert _cycles(graph) == []


def test_ops_import_no_transform_or_plan():
    mods = _modules()
    for m, f in mods.items():
        if m.startswith("meshlab.ops"):
            bad = {i for i in _imports(m, f, mods)
                   if i.startswith(("meshlab.parallel", "meshlab._plan"))}
            assert not bad, (m, bad)


def test_every_room_is_a_package_with_its_transform():
    import meshlab.parallel as par

    rooms = {p.name for p in (ROOT / "parallel").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"shard", "zero", "precision", "remat", "pipeline", "sequence", "fuse",
                     "offload", "expert", "lora", "compile", "step_in_backward"}
    for cls in (par.Shard, par.ZeroShard, par.Precision, par.Remat, par.Pipeline,
                par.Sequence, par.Fuse, par.Offload, par.ExpertRoute, par.Lora, par.Compile,
                par.StepInBackward):
        assert cls.__module__.split(".")[2] in rooms, cls
