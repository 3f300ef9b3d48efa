"""scaletrain's packages import each other without a cycle (STYLE.md: one concern per subpackage,
arrows point down only).

The graph is read from the source with ast, nothing is imported: a node is a subpackage (model/) or a
top-level module (config.py), an edge is any import statement that runs, at module level or inside a
function. Function-local imports count because they are for start-up speed only, never to hide a
cycle, so they must point down too. Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scaletrain"


def _node(module: str) -> str:
    """`scaletrain.families.gpt.model` -> `families`; `scaletrain` and names defined in its __init__ -> `scaletrain`."""
    parts = module.split(".")
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "scaletrain"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the statements inside `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    return skipped


@cache
def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package -> the module-to-module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "scaletrain" and _node(module) != _node(target):
                    edges.setdefault((_node(module), _node(target)), []).append(f"{module} -> {target}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The shortest cycle through each package that is in one, as the path [a, b, ..., a], each cycle once."""
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        graph.setdefault(importer, set()).add(imported)
    found: dict[frozenset[tuple[str, str]], list[str]] = {}
    for start in sorted(graph):
        path = _path_back(graph, start)
        if path is not None:
            found.setdefault(frozenset(pairwise(path)), path)
    return list(found.values())


def _path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest path start -> ... -> start (breadth-first), or None."""
    visited, queue = set(), deque([[start]])
    while queue:
        path = queue.popleft()
        for following in sorted(graph.get(path[-1], ())):
            if following == start:
                return [*path, start]
            if following not in visited:
                visited.add(following)
                queue.append([*path, following])
    return None


def describe(cycle: list[str], edges: dict[tuple[str, str], list[str]]) -> str:
    """`a -> b -> a`, then for each step the first few imports that make it."""
    steps = [f"  {a} -> {b}: {', '.join(list(dict.fromkeys(edges[a, b]))[:3])}" for a, b in pairwise(cycle)]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_packages_import_each_other_without_a_cycle():
    edges = package_imports()
    found = cycles(edges)
    assert not found, "import cycles between packages:\n" + "\n".join(describe(cycle, edges) for cycle in found)


def test_the_graph_sees_function_local_imports_and_skips_type_checking_ones():
    edges = package_imports()
    assert "scaletrain.cli -> scaletrain.train.loop.train" in edges["cli", "train"]  # inside cli._train
    assert "scaletrain.model.family -> scaletrain.config.Config" not in edges["model", "config"]  # TYPE_CHECKING


@pytest.mark.parametrize("package", ["model", "families", "tracking"])
def test_model_and_tracking_import_nothing_from_planner_or_scaling(package):
    """Counts live with the model (model/counts.py, each family's `counts`); the planner and the
    scaling science use them, never the reverse."""
    edges = package_imports()
    assert edges.get((package, "planner"), []) + edges.get((package, "scaling"), []) == []


def test_the_block_kit_and_checkpoints_know_no_family():
    """Families are built from model/ and read HF files with checkpoint/hf/; neither looks a family up
    (the registry, families/__init__.py, sits above both), so a family's folder is the only place
    that knows it."""
    edges = package_imports()
    assert edges.get(("model", "families"), []) + edges.get(("checkpoint", "families"), []) == []
