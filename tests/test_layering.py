"""Dependencies point one way: the engine and the drafters share `core`; drafters never import the engine."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def offenders(package: str, forbidden: tuple[str, ...], root: Path = ROOT, skip: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(skip):
            continue
        for mod in imported_modules(path):
            if mod.split(".")[0] in forbidden or mod.startswith(forbidden):
                bad.append(f"{rel} imports {mod}")
    return bad


def test_core_imports_neither_engine_nor_drafters():
    assert offenders("core", ("server", "drafters", "kernels")) == []


def test_drafters_import_core_not_the_engine():
    # The training pipeline drives the target model as a client of the engine (it runs the target to make data);
    # the drafters that serve read the target only through core and the views of drafters.base.
    assert offenders("drafters", ("server",), skip=("training/",)) == []


def test_engine_reads_drafters_only_through_their_contract():
    bad = [b for b in offenders("server/engine", ("drafters",)) if not b.endswith("imports drafters.base")]
    assert bad == []
