"""The architecture map holds: imports run one way, and no module imports itself back.

``LAYERS`` is the map of docs/design-notes.md "Architecture map", as data, bottom first: each
unit (a package, or a top-level module) and the units it may import. Every import in
``k3bundle`` — at module level, inside a function, under ``TYPE_CHECKING`` — is read with ``ast``
and must be allowed here; a unit may only be allowed what lies below it, so the map itself has
no cycle; and no chain of imports between modules leads back to where it started.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3bundle"
DOC = ROOT / "docs" / "design-notes.md"

BASE = ("errors", "data_dirs", "file_names", "io", "config", "formats", "schema", "checkpoint")
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("k3bundle", ()),  # the package root: __version__ only
    ("errors", ()),
    ("data_dirs", ()),
    ("file_names", ()),
    ("runtime", ("errors",)),
    ("pages", ()),
    ("metrics", ()),
    ("io", ("errors", "file_names")),
    ("config", ("errors", "file_names", "io")),
    ("formats", ("errors",)),
    ("tokenizer_specials", ("errors",)),
    ("tokenizer", ("k3bundle", "errors", "file_names", "io", "tokenizer_specials")),
    ("chat", ("k3bundle", "errors", "tokenizer_specials")),
    ("media", ("errors", "io")),
    ("schema", ("errors", "config")),
    ("checkpoint", ("errors", "config", "io", "schema")),
    ("presets", ("errors", "config", "tokenizer_specials")),
    ("synth", ("k3bundle", "errors", "file_names", "config", "io", "formats", "schema", "tokenizer_specials", "presets")),
    ("pull", ("k3bundle", "errors", "file_names", "io")),
    ("storage", ("errors", "config", "io", "formats", "schema")),
    ("layouts", ("errors", "data_dirs", "io", "formats", "schema", "storage")),
    ("plan", BASE + ("presets", "storage", "layouts")),
    ("ops", ("errors",)),
    ("executor", ("k3bundle",) + BASE + ("storage", "ops")),
    ("bundle", BASE + ("storage", "layouts", "plan", "ops", "executor")),
    ("convert", ("k3bundle",) + BASE + ("storage", "layouts", "plan", "bundle")),
    ("provenance", BASE + ("storage", "layouts", "plan", "bundle", "convert")),
    ("checklist", ("pages",) + BASE + ("media", "storage", "layouts", "plan", "ops", "executor", "bundle", "provenance")),
    ("kernels", ("pages",) + BASE + ("data_dirs", "layouts", "plan", "ops", "executor", "bundle", "checklist")),
    ("golden", ("k3bundle", "metrics") + BASE + ("chat", "media", "tokenizer", "executor", "bundle")),
    ("validate", ("k3bundle", "pages", "metrics") + BASE + ("tokenizer_specials", "executor", "bundle", "provenance", "golden", "kernels")),
    ("calibrate", ("errors", "file_names", "config", "io", "presets", "storage", "layouts", "ops", "executor", "kernels",
                   "synth", "convert", "golden", "validate")),
    ("serve", ("errors", "io", "tokenizer_specials", "tokenizer", "chat", "executor", "bundle")),
    ("endpoint", ("k3bundle", "errors", "data_dirs", "file_names", "pages", "io", "tokenizer", "chat", "golden")),
    ("demo", ("errors", "file_names", "tokenizer", "synth", "pull", "plan", "convert", "provenance", "golden", "validate", "checklist")),
    ("cli", ("k3bundle", "errors", "runtime", "pages", "file_names", "config", "io", "schema", "checkpoint", "presets", "synth", "pull",
             "plan", "executor",
             "bundle", "convert", "provenance", "checklist", "kernels", "golden", "validate", "calibrate", "serve", "endpoint",
             "demo")),
    ("__main__", ("cli",)),
)
ALLOWED = dict(LAYERS)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every k3bundle module ``name`` imports, wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # ``from pkg import mod`` imports the module pkg.mod
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m == "k3bundle" or m.startswith("k3bundle.")}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    return "k3bundle" if module == "k3bundle" else module.split(".")[1]


def test_every_unit_is_on_the_map():
    assert {_unit(m) for m in MODULES} <= set(ALLOWED)


def test_the_map_only_points_down():
    seen: set[str] = set()
    for unit, allowed in LAYERS:
        assert set(allowed) <= seen, f"{unit} may import {sorted(set(allowed) - seen)}, which is not below it"
        seen.add(unit)


def test_no_import_runs_up_the_map():
    bad = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
                 if _unit(t) != _unit(m) and _unit(t) not in ALLOWED[_unit(m)])
    assert not bad, "imports against docs/design-notes.md 'Architecture map':\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_itself_back():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _doc_table() -> dict[str, tuple[str, ...]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Architecture map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = tuple(re.findall(r"`([\w.]+)`", cells[2]))
    return rows


@pytest.mark.parametrize("unit", [u for u, _ in LAYERS])
def test_the_doc_mirrors_the_map(unit):
    doc = _doc_table()
    assert list(doc) == [u for u, _ in LAYERS], "docs/design-notes.md lists the units in another order"
    assert set(doc[unit]) == set(ALLOWED[unit]), f"docs/design-notes.md row for {unit}"
