#!/usr/bin/env python3
"""Import-layer check for the ckrun package (``runner/``, import name ``ckrun``).

Three rules, checked on every ``import`` statement of every module, including imports
inside functions and under ``if TYPE_CHECKING:`` (an upward import is a wrong room even
when it only serves a type annotation):

1. **No import cycles** between ckrun modules (strongly connected components of the
   module graph, Tarjan's algorithm).
2. **No upward imports**: a module never imports one of a higher layer. The layers, low
   to high, are :data:`LAYERS`; modules of one layer may import each other (rule 1 still
   holds).
3. **No private names across modules**: a module never imports, or reads as an
   attribute of an imported module, another module's ``_private`` name (one leading
   underscore; dunders are public).

An import ``from ckrun.pkg import name`` is an edge to ``ckrun.pkg.name`` when that is a
module, otherwise to ``ckrun.pkg`` (its ``__init__``). The implicit import of a parent
package's ``__init__`` is not an edge (as in ``import-linter``/``grimp``).

Usage: ``python tools/check_layers.py [ROOT]`` (``ROOT`` defaults to ``runner``). Prints
one line per violation (``path:line: edge: rule``) and exits 1 when there is any, else
prints a one-line summary and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "ckrun"

# (layer name, first-level names under ckrun that belong to it), lowest first.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # procs: fork/exec into a new session and prctl(2), shared by scheduler and supervisor
    (
        "errors/notices",
        ("errors", "notices", "version", "options", "enums", "procs", "notice_hold"),
    ),
    ("storage", ("storage",)),  # fsutil lives here: control writes its files with it
    ("control/runlog", ("control", "control_files", "notice_signals", "runlog")),
    ("checkpoint", ("checkpoint",)),
    ("integrations", ("integrations",)),  # framework callbacks over checkpoint (issue 15)
    ("cloud/scheduler", ("cloud", "scheduler")),
    ("config", ("config",)),
    ("supervisor", ("supervisor",)),
    ("report", ("report",)),  # read-only accounting of a run: status, runs, the page
    ("cli", ("cli", "__main__")),
    # The package __init__ is the public surface: it re-exports from every layer.
    ("public surface", ("",)),
)


@dataclass(frozen=True)
class Import:
    """One import edge: ``source`` imports ``target`` (both dotted module names)."""

    source: str
    target: str
    path: Path
    line: int


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def layer_of(module: str) -> tuple[int, str]:
    """``(rank, layer name)`` of a dotted ckrun module name.

    Raises:
        KeyError: the module's first-level name is in no layer (add it to LAYERS).
    """
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else ""
    for rank, (name, members) in enumerate(LAYERS):
        if head in members:
            return rank, name
    raise KeyError(f"{module}: {PACKAGE}.{head} is in no layer; add it to LAYERS")


def discover(root: Path) -> dict[str, Path]:
    """Map every module under ``root`` (the package directory) to its file."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        modules[".".join((PACKAGE, *rel))] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_from(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module a ``from ... import`` names (None when outside ckrun)."""
    if node.level == 0:
        return node.module
    base = _package_of(module, path).split(".")
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _inside(name: str | None) -> bool:
    return name is not None and (name == PACKAGE or name.startswith(PACKAGE + "."))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scan(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Import], list[Violation]]:
    """Import edges and private-name violations of one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    edges: list[Import] = []
    violations: list[Violation] = []
    # local alias -> ckrun module it names (for `alias._private` attribute reads)
    aliases: dict[str, str] = {}

    def private(line: int, target: str, name: str) -> None:
        violations.append(
            Violation(
                path,
                line,
                f"{module} -> {target}.{name}: imports another module's private name "
                f"{name!r}; make it public or move the caller into {target}",
            )
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _inside(alias.name):
                    continue
                target = alias.name
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                edges.append(Import(module, target, path, node.lineno))
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, path, node)
            if not _inside(base):
                continue
            assert base is not None
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    edges.append(Import(module, sub, path, node.lineno))
                    aliases[alias.asname or alias.name] = sub
                    continue
                target = base
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                edges.append(Import(module, target, path, node.lineno))
                if _private(alias.name) and target != module:
                    private(node.lineno, target, alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and aliases[node.value.id] != module
        ):
            private(node.lineno, aliases[node.value.id], node.attr)
    return edges, violations


def cycles(edges: Sequence[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan 1972
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def _cycle_path(comp: list[str], edges: Sequence[Import]) -> list[Import]:
    """One closed path through a strongly connected component, as its import edges."""
    members = set(comp)
    by_source: dict[str, list[Import]] = {}
    for e in edges:
        if e.source in members and e.target in members:
            by_source.setdefault(e.source, []).append(e)
    start = comp[0]
    # breadth-first search from start back to start inside the component
    prev: dict[str, Import] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for e in sorted(by_source.get(v, []), key=lambda e: e.target):
                if e.target == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, prev[path[0].source])
                    return path
                if e.target not in seen:
                    seen.add(e.target)
                    prev[e.target] = e
                    nxt.append(e.target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def check(root: Path) -> list[Violation]:
    """Every violation of the three rules in the package rooted at ``root``."""
    modules = discover(root)
    edges: list[Import] = []
    violations: list[Violation] = []
    for module, path in modules.items():
        found, bad = scan(module, path, modules)
        edges.extend(x for x in found if x.target != x.source)
        violations.extend(bad)
    for e in edges:
        try:
            src_rank, src_layer = layer_of(e.source)
            dst_rank, dst_layer = layer_of(e.target)
        except KeyError as err:
            violations.append(Violation(e.path, e.line, str(err.args[0])))
            continue
        if dst_rank > src_rank:
            violations.append(
                Violation(
                    e.path,
                    e.line,
                    f"{e.source} -> {e.target}: upward import ({src_layer} imports "
                    f"{dst_layer}); a lower layer never imports a higher one "
                    f"({' < '.join(name for name, _ in LAYERS[:-1])})",
                )
            )
    for comp in cycles(edges):
        loop = _cycle_path(comp, edges)
        chain = " -> ".join([loop[0].source] + [e.target for e in loop])
        where = ", ".join(f"{e.path}:{e.line}" for e in loop)
        rest = sorted(set(comp) - {e.source for e in loop})
        also = f"; also in this cycle: {', '.join(rest)}" if rest else ""
        violations.append(
            Violation(loop[0].path, loop[0].line, f"import cycle {chain} ({where}){also}")
        )
    return violations


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="runner", type=Path)
    args = parser.parse_args(argv)
    violations = check(args.root)
    for v in violations:
        print(v)
    if violations:
        print(f"check_layers: {len(violations)} violation(s)", file=sys.stderr)
        return 1
    print(f"check_layers: {len(discover(args.root))} modules, no cycles, no upward imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
