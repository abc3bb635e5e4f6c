"""The package's shape, read from the source: no import cycles, lower layers never import higher ones, kernels
below file formats, nothing in src/ importing bench or test code, no file far over 500 lines without a reason, and
no src/ text that cites a measurement (a GPU model, bench/ or its RESULTS): figures live in bench/RESULTS.md, the
reasons in docs/.

The import graph is built statically (ast) from every `import` and `from ... import` in src/diffgemma, function-
local ones included, each resolved to the package's modules: `from pkg import name` depends on pkg.name when that
is a module, else on pkg itself; importing a module also runs its parent packages' __init__, so an import from
outside a package depends on that package's __init__ too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "diffgemma"
MAX_LINES = 500

# Files over MAX_LINES, each with the reason it stays whole. Keep this short and true.
LONG_FILES: dict[str, str] = {}

# The layers, lowest first: a module may import its own layer and the ones below, never one above. Each entry
# is a set of top-level names under diffgemma (a module or a subpackage); "" is the package's own __init__.
# events, reply, slots, options (the loop's events; the session's split), vision and quality arrive from other
# branches of the same restructuring; a name in no layer fails the check below.
LAYERS = [
    {"errors", "config", "settings", "checkpoint", "tokenizer", "stop_strings", "tool_calls", "events",
     "grammars"},  # foundations
    {"ops"},  # kernels and the bit layouts they read
    {"quant"},  # pack formats: read and write them (import their layouts from ops)
    {"model", "sampling"},  # the forward pass; the sampler
    # KV slots, the op-log; loading a model (and its vision tower); the expert-parallel engine; starting its ranks
    {"slots", "oplog", "loader", "vision", "parallel", "launch"},
    {"core"},  # the engine core: requests, the scheduler, the generation algorithm, the one loop (step)
    # the drivers (generate, generate_batch, warm-up, conversations, replay); the public API
    {"generation", "batch", "warmup", "session", "reply", "options", "replay", "golden", "tool_repair", ""},
    {"server", "cli", "batch_file", "quality", "__main__"},  # the applications
]

# ops/ is the bottom layer: inside the package it may import only these besides itself.
OPS_MAY_IMPORT = {"errors", "config"}
SAMPLING_MAY_NOT_IMPORT = {"model", "server", "cli", "session", "generation", "loader"}
TEST_PACKAGES = {"bench", "tests", "conftest"}


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/diffgemma (a package is named by its __init__)."""
    out = {}
    for f in sorted((src / PKG).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(tree: ast.AST):
    for node in ast.walk(tree):  # every node: function-local and conditional imports too
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _package_of(name: str, f: Path) -> list[str]:
    return name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]


def _longest_module(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(name: str, f: Path, mods) -> tuple[set[str], set[str]]:
    """(modules of the package that `name` imports, top-level names of anything else it imports)."""
    inside, outside = set(), set()
    for node in _imports(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            deps = {_longest_module(t, mods) for t in targets}
        else:
            if node.level:
                base = _package_of(name, f)[: len(_package_of(name, f)) - node.level + 1]
                b = ".".join(base + ([node.module] if node.module else []))
            else:
                b = node.module or ""
            targets = [b]
            deps = set()
            for a in node.names:
                sub = f"{b}.{a.name}"
                deps.add(sub if sub in mods else _longest_module(b, mods))
        outside |= {t.split(".")[0] for t in targets if t.split(".")[0] != PKG}
        for d in deps - {None}:
            inside.add(d)
            # importing d first runs the __init__ of each package above it that `name` is not inside
            parts = d.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in mods and not (name == parent or name.startswith(parent + ".")):
                    inside.add(parent)
    inside.discard(name)
    return inside, outside


def import_graph(src: Path = SRC) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = module_files(src)
    graph, external = {}, {}
    for name, f in mods.items():
        graph[name], external[name] = imported_names(name, f, mods)
    return graph, external


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (iterative DFS, deterministic order)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack, path = [(root, iter(sorted(graph[root])))], [root]
        color[root] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
            elif color.get(nxt) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif color.get(nxt) == WHITE:
                color[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (so a failure lists every knot at once)."""
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def visit(v):  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [find_cycle({n: graph[n] & comp for n in comp}) for comp in sccs]


def top(name: str) -> str:
    """The top-level name under diffgemma a module belongs to ("" for the package itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int:
    for i, names in enumerate(LAYERS):
        if top(name) in names:
            return i
    raise AssertionError(f"{name} is in no layer of tests/test_layering.py's LAYERS: add its top-level name")


def short(name: str) -> str:
    return name[len(PKG) + 1:] if name.startswith(PKG + ".") else name


@pytest.fixture(scope="module")
def graphs():
    return import_graph()


# ------------------------------------------------------------------------------------------------- the checks

def test_no_import_cycles(graphs):
    graph, _ = graphs
    cycles = all_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(map(short, c)) for c in cycles)


def test_nothing_in_src_imports_bench_or_tests(graphs):
    _, external = graphs
    test_modules = TEST_PACKAGES | {f.stem for d in ("tests", "bench") for f in (SRC.parent / d).glob("*.py")}
    bad = {short(m): sorted(names & test_modules) for m, names in external.items() if names & test_modules}
    assert not bad, f"src/ modules importing bench or test code: {bad}"


def test_ops_is_the_bottom_layer(graphs):
    graph, _ = graphs
    bad = {short(m): sorted(short(d) for d in deps if top(d) not in OPS_MAY_IMPORT | {"ops"})
           for m, deps in graph.items() if top(m) == "ops"}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"ops/ (kernels) may import only ops, {sorted(OPS_MAY_IMPORT)} from the package: {bad}"


def test_sampling_imports_no_model_server_or_app(graphs):
    graph, _ = graphs
    bad = {short(m): sorted(short(d) for d in deps if top(d) in SAMPLING_MAY_NOT_IMPORT)
           for m, deps in graph.items() if top(m) == "sampling"}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"sampling/ importing {sorted(SAMPLING_MAY_NOT_IMPORT)}: {bad}"


def test_parallel_never_imports_the_loader(graphs):
    """The loader builds the expert-parallel engine; parallel/ must not reach back (launch.py loads the ranks)."""
    graph, _ = graphs
    bad = {short(m): sorted(short(d) for d in deps if top(d) == "loader")
           for m, deps in graph.items() if top(m) == "parallel"}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"parallel/ importing the loader: {bad}"


def test_no_layer_imports_a_higher_one(graphs):
    graph, _ = graphs
    bad = sorted(f"{short(m)} (layer {layer_of(m)}) imports {short(d)} (layer {layer_of(d)})"
                 for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert not bad, "imports from a higher layer:\n  " + "\n  ".join(bad)


def test_no_file_far_over_the_size_limit_without_a_reason():
    lines = {str(f.relative_to(SRC / PKG)): len(f.read_text().splitlines()) for f in module_files().values()}
    over = {f: n for f, n in lines.items() if n > MAX_LINES and f not in LONG_FILES}
    assert not over, f"files over {MAX_LINES} lines (split them, or list them in LONG_FILES with the reason): {over}"
    stale = sorted(f for f in LONG_FILES if lines.get(f, 0) <= MAX_LINES)
    assert not stale, f"LONG_FILES lists files that are not over {MAX_LINES} lines (take them off): {stale}"


# ----------------------------------------------------------------------------------------- the checker itself

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / PKG / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


# a bench script or its results, a GPU's name, a timing or a throughput
MEASUREMENT_CITES = re.compile(r"bench/|\bbench_\w+|RESULTS\.md|\b[AH]100\b|\bH200\b|\d ?(ms|us|µs)\b|TFLOP|\d SMs\b")


def measurement_cites(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MEASUREMENT_CITES.search(line)]


def test_src_cites_docs_not_measurements():
    found = {str(f.relative_to(SRC)): hits for f in sorted((SRC / PKG).rglob("*.py"))
             if (hits := measurement_cites(f.read_text()))}
    assert not found, f"src/ cites measurements (move the figures to bench/RESULTS.md, the reason to docs/): {found}"
    assert measurement_cites("x = 1  # 9.1 ms on one H200 (bench/RESULTS.md)")  # the pattern finds what it should
    assert measurement_cites("# as bench_pack measured") and measurement_cites("# 485 TFLOP/s")
    assert measurement_cites("# 64 programs on 132 SMs")  # one GPU's SM count


def test_the_checker_finds_a_planted_cycle_through_a_function_local_import(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "ops/a.py": "from . import b\n",
        "ops/b.py": "from ..errors import x\nfrom .c import f\n",
        "ops/c.py": "def f():\n    from .a import g\n",
    })
    graph, _ = import_graph(src)
    assert graph["diffgemma.ops.b"] == {"diffgemma.errors", "diffgemma.ops.c"}
    assert find_cycle(graph) == ["diffgemma.ops.a", "diffgemma.ops.b", "diffgemma.ops.c", "diffgemma.ops.a"]
    assert all_cycles(graph) == [find_cycle(graph)]
    del graph["diffgemma.ops.c"]
    graph["diffgemma.ops.b"] = {"diffgemma.errors"}
    assert find_cycle(graph) is None and all_cycles(graph) == []


def test_the_checker_resolves_packages_the_way_python_imports_them(tmp_path):
    """A submodule importing a sibling through its package is no cycle with the package's __init__; importing
    a package's submodule from outside runs (so depends on) that __init__; a name that is no module is its module's."""
    src = _tree(tmp_path, {
        "__init__.py": "from .quant import source\n",
        "quant/__init__.py": "from .source import open_pack\n",
        "quant/source.py": "from . import codecs\nfrom .codecs import planes\n",
        "quant/codecs.py": "import numpy as np\nfrom diffgemma.ops.layouts import planes\n",
        "ops/layouts.py": "import bench.fixtures\n",
        "model/engine.py": "from ..quant.source import open_pack\nfrom ..quant import open_pack\n",
    })
    graph, external = import_graph(src)
    assert graph["diffgemma.quant.source"] == {"diffgemma.quant.codecs"}
    assert graph["diffgemma.quant.codecs"] == {"diffgemma.ops.layouts"}  # ops is a namespace package: no __init__
    assert graph["diffgemma.model.engine"] == {"diffgemma.quant", "diffgemma.quant.source"}
    assert external["diffgemma.quant.codecs"] == {"numpy"} and external["diffgemma.ops.layouts"] == {"bench"}
    assert all_cycles(graph) == []
