"""Dependencies point one way, with no exemption:

    core  <-  specserve_kernels  <-  server.engine  <-  server.worker  <-  server.api
      ^                         |  (drafters.base only)
      +------  drafters  <------+
    training  ->  the engine's public API (server.engine), server.config / model_files / tokenization / cli, drafters
    specserve ->  server.cli and training.cli (the one module that knows both)

Drafters never import the engine; the server never imports training; the API process imports nothing of the engine;
training reaches the engine only through ``server.engine``'s exported names, never its modules.
"""
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


def imports(package: str, root: Path = ROOT) -> list[tuple[str, str]]:
    """(file, module) for every import of every file under ``package`` (a folder, or one module's .py file)."""
    base = root / package
    paths = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else sorted(base.rglob("*.py"))
    return [(p.relative_to(root).as_posix(), mod) for p in paths for mod in sorted(imported_modules(p))]


def within(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def offenders(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = (), root: Path = ROOT) -> list[str]:
    """Imports from ``package`` of a module within ``forbidden`` and not exactly one of ``allowed``."""
    return [f"{f} imports {mod}" for f, mod in imports(package, root) if within(mod, forbidden) and mod not in allowed]


OURS = ("core", "specserve_kernels", "drafters", "server", "training", "specserve")


def test_core_imports_none_of_ours():
    assert offenders("core", tuple(p for p in OURS if p != "core")) == []


def test_kernels_import_only_core():
    assert offenders("specserve_kernels", ("drafters", "server", "training", "specserve")) == []


def test_drafters_import_core_and_themselves_only():
    assert offenders("drafters", ("server", "training", "specserve")) == []


def test_the_server_never_imports_training_or_the_command_shell():
    assert offenders("server", ("training", "specserve")) == []


def test_engine_reads_drafters_only_through_their_contract():
    assert offenders("server/engine", ("drafters",), allowed=("drafters.base",)) == []


def test_the_api_process_imports_nothing_of_the_engine():
    assert offenders("server/api", ("server.engine", "server.worker.scheduler", "server.worker.budget")) == []


def test_training_uses_the_engine_only_through_its_public_api():
    public = ("server.engine", "server.config", "server.model_files", "server.tokenization", "server.cli")
    assert offenders("training", ("server",), allowed=public) == []
    assert offenders("training", ("specserve",)) == []


def import_circles(package: str, root: Path = ROOT) -> list[list[str]]:
    """The import circles among ``package``'s modules (a package's ``__init__`` is the package itself; imports at
    any depth count), each as its modules sorted: the strongly connected components of more than one module."""
    mods = {p.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): p
            for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in mods.items():
        deps = set()
        names = set(imported_modules(path))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:  # `from pkg import module`
                names.update(f"{node.module}.{a.name}" for a in node.names)
        for mod in names:
            while mod and mod not in mods:  # `from server.engine.model import X` names a module; X may be a name
                mod = mod.rpartition(".")[0]
            if mod and mod != name:
                deps.add(mod)
        graph[name] = deps
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
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
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


# The one circle left: model loading measures `dtype: auto` with the batched step (target -> engine), and the engine
# loads its target (engine -> target). Moving the measurement above the model removes it; no other may appear.
def test_no_import_circle_inside_server_or_training():
    assert import_circles("training") == []
    assert import_circles("server") == []


def test_the_circle_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "training"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from training.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from training import c\n")
    (pkg / "c.py").write_text("import training.a\n")
    (pkg / "d.py").write_text("from training.a import x\n")
    assert import_circles("training", root=tmp_path) == [["training.a", "training.b", "training.c"]]


def test_the_rules_catch_a_violation(tmp_path):
    """The checks above read real import statements: a file that breaks a rule is reported."""
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "x.py").write_text("def f():\n    from server.engine.model import Segment\n")
    (tmp_path / "server" / "api").mkdir(parents=True)
    (tmp_path / "server" / "api" / "y.py").write_text("import server.engine\n")
    assert offenders("training", ("server",), allowed=("server.engine",), root=tmp_path) == [
        "training/x.py imports server.engine.model"]
    assert offenders("server/api", ("server.engine",), root=tmp_path) == ["server/api/y.py imports server.engine"]


def test_the_api_process_loads_no_engine_module():
    """At run time too: importing the API process's modules loads no module of the engine (nor torch's weights
    code), only what it shares with the worker (config, model files, tokenization, messages)."""
    import subprocess
    import sys

    code = ("import sys, server.api.app, server.api.routes, server.api.generation, server.worker.process\n"
            "print(sorted(m for m in sys.modules if m.startswith(('server.engine', 'drafters', 'training'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
