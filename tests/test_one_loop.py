"""One loop drives generation (issue 49): the step machinery (core/steps.generate_steps and the asks it yields) has
one caller, the engine core; no driver above it answers asks itself or keeps a scheduler of its own; the scheduler
is not under server/ and knows nothing of the worker."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "diffgemma"
LANES = {"read_asks", "forward_lanes", "lane_stats", "lane_masks", "lane_plans", "lane_embeds", "commit_lanes"}
ASKS = {"ForwardAsk", "StatusAsk", "BlockRead", "EmbedAsk", "CommitAsk", "Sampled"}
MACHINERY = {"generate_steps"} | ASKS | LANES
# where each may be named outside core/steps.py: the core's own modules
ALLOWED = {"core/turn.py": {"generate_steps"}, "core/engine.py": ASKS | LANES, "core/lanes.py": ASKS | LANES}


def names_used(tree: ast.AST) -> set[str]:
    """Every name a module reads, imports or reaches as an attribute."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
    return out


def test_the_step_machinery_has_one_driver_the_engine_core():
    found = {}
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC).as_posix()
        if rel == "core/steps.py":
            continue
        used = names_used(ast.parse(f.read_text())) & MACHINERY
        if used - ALLOWED.get(rel, set()):
            found[rel] = sorted(used - ALLOWED.get(rel, set()))
    assert not found, f"the step machinery is driven outside the engine core: {found}"


def test_generate_steps_is_called_in_one_place():
    calls = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                if name == "generate_steps":
                    calls.append(f.relative_to(SRC).as_posix())
    assert calls == ["core/turn.py"]


def test_the_scheduler_is_below_the_server_and_knows_no_worker():
    assert not (SRC / "server" / "scheduler.py").exists()
    for f in sorted((SRC / "core").glob("*.py")):
        text = f.read_text()
        assert "worker" not in names_used(ast.parse(text)), f.name
        assert "from ..server" not in text and "from ..session" not in text, f.name


def test_no_private_name_is_imported_across_modules():
    bad = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad += [f"{f.relative_to(SRC)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad
