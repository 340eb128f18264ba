"""The shape of the code, held against a table kept here.

* The package is layered: each module imports only from its own layer and the layers
  below it (``LAYERS``, lowest first), type-only imports (``if TYPE_CHECKING``) and imports
  inside functions counted like the others; and no two modules import each other, however
  indirectly.
* The top level of ``meshlab/`` is the layers plus at most eight modules (the facade and
  the re-export modules that keep older paths working).
* Rooms talk through typed runtime parts: no string keys in ``ctx.state``, no
  ``_meshlab_*`` attribute set on a module by one file and read by another.
* No function under ``meshlab/`` is longer than 80 lines; every room of
  ``meshlab.transforms`` is one package holding its transform.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "meshlab"

# Lowest first. A module of one layer may import from its own layer and any layer before
# it. "meshlab" is the facade (``meshlab/__init__.py`` and the top-level re-export modules);
# only the command line sits above it.
LAYERS = (
    ("core", "values (P, meshes, rules, placements), the ambient context, errors, units, "
             "collectives by group, rank agreement, distribute / shard_map / visualize"),
    ("data", "the corpus the demo trains on"),
    ("ops", "fused kernels as torch.library ops"),
    ("planning", "the Plan value, trace, axis roles, views, diff, the rows rooms estimate"),
    ("policies", "per-architecture sharding as data, presets"),
    ("transforms", "the protocol, the runtime parts, the composition table, one room each"),
    ("estimate", "memory, comm, activations, profile, time, machines, advise"),
    ("apply", "plan(), parallelize, materialize: the only code that mutates modules"),
    ("train", "optimizer, step, dataloader, launchers"),
    ("checkpoint", "checkpoints, adapters, Hugging Face exports"),
    ("inference", "the inference engine"),
    ("booster", "Colossal-AI's surface"),
    ("testing", "tiny configs of every family and the family walk"),
    ("meshlab", "the facade: re-exports only"),
    ("cli", "the meshlab command"),
)
_ORDER = {name: i for i, (name, _) in enumerate(LAYERS)}
MAX_TOP_MODULES = 8


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        out[name[:-9] if name.endswith(".__init__") else name] = f
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in _ORDER else "meshlab"


def _imports(name: str, f: pathlib.Path, mods: dict) -> dict[str, int]:
    """Every meshlab module ``name`` imports (type-only and function-local imports too),
    with the line of the first import."""
    tree = ast.parse(f.read_text())
    pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        found: set[str] = set()
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            tgt = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{tgt}.{a.name}" for a in node.names} & mods.keys()
            if len(subs) < len(node.names) and tgt in mods:
                found.add(tgt)
            found |= subs
        elif isinstance(node, ast.Import):
            found = {a.name for a in node.names} & mods.keys()
        for t in found:
            out.setdefault(t, node.lineno)
    return out


def _graph() -> tuple[dict, dict]:
    mods = _modules()
    return mods, {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycles(graph: dict) -> list[list[str]]:
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


def test_every_package_is_a_layer_of_the_table():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"parallel"} <= set(_ORDER), packages - set(_ORDER)
    assert "parallel" in packages and (ROOT / "parallel" / "__init__.py").read_text().count(
        "def ") == 0     # a re-export package, not a layer


def test_imports_point_down():
    """A module imports only its own layer and the layers below it."""
    mods, graph = _graph()
    up = [f"{m} -> {t} (line {line}): {_layer(m)} imports {_layer(t)}"
          for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
          if _ORDER[_layer(t)] > _ORDER[_layer(m)]]
    assert not up, "\n".join(up)


def test_no_import_circle():
    """No circle of imports, type-only ones included."""
    _, graph = _graph()
    assert _cycles({m: set(t) for m, t in graph.items()}) == []


def test_top_level_holds_few_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert "__init__.py" in top and len(top) <= MAX_TOP_MODULES, top


def test_the_facade_only_re_exports():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    kinds = {type(n).__name__ for n in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Import", "Assign"}, kinds
    assigned = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    assert assigned == ["__version__"] or assigned == [], assigned


def test_no_string_keys_in_shared_install_state():
    hits = [f"{f.relative_to(ROOT.parent)}:{i}" for f in ROOT.rglob("*.py")
            for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"ctx\.state\[", line)]
    assert not hits, hits


def test_no_meshlab_attribute_read_outside_the_module_that_sets_it():
    """An attribute ``_meshlab`` or ``_meshlab_*`` is named in one file only (the one that
    sets it, and reads it through functions it offers), and no module imports another's
    constant that holds such a name."""
    named: dict[str, set] = {}
    constants: dict[str, str] = {}          # constant name -> the file that defines it
    files = {str(f.relative_to(ROOT.parent)): f.read_text() for f in ROOT.rglob("*.py")}
    for rel, text in files.items():
        for name in re.findall(r"\b(_meshlab(?:_\w+)?)\b", text):
            named.setdefault(name, set()).add(rel)
        for const in re.findall(r"^(\w+)\s*=\s*['\"]_meshlab\w*['\"]", text, re.M):
            constants[const] = rel
    spread = {n: sorted(fs) for n, fs in named.items() if len(fs) > 1}
    imported = sorted(f"{rel} imports {c} (defined in {home})" for rel, text in files.items()
                      for c, home in constants.items() if rel != home and
                      re.search(rf"^\s*from \S+ import [^\n]*\b{c}\b", text, re.M))
    assert not spread and not imported, (spread, imported)


def test_no_function_longer_than_80_lines():
    long = []
    for f in ROOT.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = n.end_lineno - n.lineno + 1
                if length > 80:
                    long.append(f"{f.relative_to(ROOT.parent)}:{n.lineno} {n.name} ({length})")
    assert not long, long


def test_every_room_is_a_package_with_its_transform():
    import meshlab.transforms as tr

    rooms = {p.name for p in (ROOT / "transforms").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"shard", "zero", "precision", "remat", "pipeline", "sequence", "fuse",
                     "offload", "expert", "lora", "compile", "step_in_backward"}
    for cls in (tr.Shard, tr.ZeroShard, tr.Precision, tr.Remat, tr.Pipeline,
                tr.Sequence, tr.Fuse, tr.Offload, tr.ExpertRoute, tr.Lora, tr.Compile,
                tr.StepInBackward):
        assert cls.__module__.split(".")[2] in rooms, cls
