"""The oscar package's import graph, read statically with `ast`: no cycle among top-level imports, nor among all
imports of oscar modules, those inside functions included (a function-local import hides a cycle from import time,
not from the design), dependencies point down the floors (kernels <- core <- cache <- models <- eval/studies <-
serve <- bench <- commands/cli), and every function-local oscar import says why it is local (a `# local:` comment):
it keeps an optional or heavy package (triton, sglang, transformers, omegaconf, ...) out of import time."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package name -> source folder (kernels/ is installed as oscar.kernels, pyproject's package-dir).
SOURCES = {"oscar": ROOT / "oscar", "oscar.kernels": ROOT / "kernels"}

# Floors, lowest first. A module imports at top level only modules of its own floor or of a lower one; a floor
# entry covers a package and its submodules (`oscar` alone is the root package, which holds the version only).
FLOORS: list[tuple[str, ...]] = [
    ("oscar", "oscar.kernels"),
    ("oscar.core",),  # the math core and the artifact: torch, numpy, safetensors only
    ("oscar.data", "oscar.config"),  # corpora; the Hydra schemas (DESIGN puts them with the core: here a floor
    # of their own above it, so that the core stays free of omegaconf)
    ("oscar.cache",),
    ("oscar.models",),
    ("oscar.eval", "oscar.studies"),
    ("oscar.serve",),
    ("oscar.bench",),
    ("oscar.commands", "oscar.cli", "oscar.__main__"),
]

# Packages and modules whose imports the floor and `# local:` checks cover.
CHECKED: list[str] = [
    "oscar.kernels", "oscar.core", "oscar.data", "oscar.config", "oscar.cache", "oscar.models", "oscar.eval",
    "oscar.studies", "oscar.serve", "oscar.bench", "oscar.commands", "oscar.cli", "oscar.__main__",
]
# Modules of CHECKED packages that another task is rewriting at the moment (checked once it lands).
NOT_YET: list[str] = []

# Justified top-level imports of a higher floor: (importer, imported) -> reason. Empty: none is needed.
FLOOR_EXCEPTIONS: dict[tuple[str, str], str] = {}

LOCAL_TAG = "# local:"

# Third-party packages a floor may import at top level (the standard library is always allowed), checked over
# everything its top-level imports load: the math core is torch only; `python -m oscar --help` loads no package.
ALLOWED_PACKAGES: dict[str, set[str]] = {
    "oscar.core": {"torch", "numpy", "safetensors"},
    "oscar.cli": set(),
}


@dataclass(frozen=True)
class Edge:
    """One import of an oscar module: where it is (`path`, `line`), and whether it runs inside a function."""

    source: str
    target: str
    path: Path
    line: int
    local: bool


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name (packages by their `__init__.py`)."""
    out: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if package == "oscar" and name.startswith("oscar.kernels"):
                continue  # never a folder of oscar/: kernels/ is the source of oscar.kernels
            out[name] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, modules: set[str]) -> list[str]:
    """The oscar modules an import statement loads (`from a import b` loads a.b when b is a module, else a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "oscar"]
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    if name.split(".")[0] != "oscar":
        return []
    found = [f"{name}.{alias.name}" for alias in node.names if f"{name}.{alias.name}" in modules]
    return found if len(found) == len(node.names) else [name, *found]


def import_edges() -> list[Edge]:
    """Every import of an oscar module in the package, top level or inside a function (a class body counts as top
    level: it runs at import time). Importing `a.b.c` first runs the package `a.b`, unless the importer lives in
    it (then it is already running), so a target brings its packages that are not the importer's."""
    files = module_files()
    modules = set(files)
    edges = []
    for source, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

        def visit(node: ast.AST, local: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, source, path.name == "__init__.py", modules):
                        parents = [".".join(target.split(".")[:i]) for i in range(2, target.count(".") + 1)]
                        own = {".".join(source.split(".")[:i]) for i in range(1, source.count(".") + 2)}
                        for name in [target, *(p for p in parents if p not in own)]:
                            if name != source and name in modules:
                                edges.append(Edge(source, name, path, child.lineno, local))
                visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return edges


def floor_of(module: str) -> int:
    """Index in FLOORS of the entry that names the module or its closest package."""
    best, index = -1, None
    for i, names in enumerate(FLOORS):
        for name in names:
            covers = module == name or (name != "oscar" and module.startswith(name + "."))
            if covers and len(name) > best:
                best, index = len(name), i
    if index is None:
        raise AssertionError(f"module {module} is on no floor; add it (or its package) to FLOORS")
    return index


def in_scope(module: str) -> bool:
    covered = lambda names: any(module == n or module.startswith(n + ".") for n in names)  # noqa: E731
    return covered(CHECKED) and not covered(NOT_YET)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_graph_sees_the_package(edges):
    """The reader finds the modules and both kinds of import (a broken reader would pass every check below)."""
    files = module_files()
    assert {"oscar.core.quant", "oscar.cache.torch_cache", "oscar.eval.runner", "oscar.kernels", "oscar.cli"} <= set(files)
    pairs = {(e.source, e.target, e.local) for e in edges}
    assert ("oscar.core.clipfit", "oscar.core.quant", False) in pairs
    assert ("oscar.cache.torch_cache", "oscar.core.quant", False) in pairs
    assert ("oscar.models.engine", "oscar.cache", False) in pairs  # oscar.cache.attention runs oscar/cache/__init__
    assert ("oscar.models.engine", "oscar.models", False) not in pairs  # its own package is already running
    assert any(e.local for e in edges)


def test_no_cycle_among_top_level_imports(edges):
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.local:
            graph.setdefault(e.source, set()).add(e.target)
    cycle = find_cycle(graph)
    assert cycle is None, f"top-level import cycle: {' -> '.join(cycle or [])}"


def test_no_cycle_among_all_oscar_imports(edges):
    """Top-level and function-local imports together: a module that imports, even lazily, a module that imports it
    is one circle (move the shared code down, or let the consumer build what it consumes). Only oscar modules are
    nodes, so lazy imports of optional third-party packages are not concerned."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    cycle = find_cycle(graph)
    where = [f"{e.path.relative_to(ROOT)}:{e.line}: {e.source} imports {e.target}{' in a function' if e.local else ''}"
             for a, b in zip(cycle or [], (cycle or [])[1:]) for e in edges if (e.source, e.target) == (a, b)]
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}\n" + "\n".join(where)


def test_the_formats_import_no_cache(edges):
    """The cache formats are below the caches that consume them: those build their caches and layers themselves."""
    consumers = {"oscar.cache.torch_cache", "oscar.cache.device_cache", "oscar.cache.extend", "oscar.serve",
                 "oscar.models"}
    bad = [f"{e.path.relative_to(ROOT)}:{e.line}: imports {e.target}" for e in edges
           if e.source == "oscar.cache.formats" and any(e.target == c or e.target.startswith(c + ".") for c in consumers)]
    assert not bad, "oscar.cache.formats imports a consumer:\n" + "\n".join(bad)


def test_the_combined_graph_sees_local_cycles(tmp_path, monkeypatch):
    """A cycle closed only by a function-local import is found (the reader counts imports inside functions)."""
    pkg = tmp_path / "oscar"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from oscar.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from oscar.sub.a import x  # local: test\n    return x\n")
    monkeypatch.setitem(SOURCES, "oscar", pkg)
    monkeypatch.delitem(SOURCES, "oscar.kernels")
    found = import_edges()
    assert find_cycle({e.source: {t.target for t in found if t.source == e.source and not t.local}
                       for e in found}) is None
    graph: dict[str, set[str]] = {}
    for e in found:
        graph.setdefault(e.source, set()).add(e.target)
    assert find_cycle(graph) == ["oscar.sub.a", "oscar.sub.b", "oscar.sub.a"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_every_module_has_a_floor():
    for module in module_files():
        floor_of(module)  # raises for a module on no floor


def test_top_level_imports_point_down_the_floors(edges):
    bad = [f"{e.path.relative_to(ROOT)}:{e.line}: {e.source} (floor {floor_of(e.source)}) imports {e.target} "
           f"(floor {floor_of(e.target)})"
           for e in edges
           if not e.local and in_scope(e.source) and floor_of(e.target) > floor_of(e.source)
           and (e.source, e.target) not in FLOOR_EXCEPTIONS]
    assert not bad, "imports of a higher floor at top level (move the code, or import it inside the function " \
                    "with a `# local:` comment):\n" + "\n".join(bad)


def test_floor_exceptions_are_still_needed(edges):
    top = {(e.source, e.target) for e in edges if not e.local}
    stale = [pair for pair in FLOOR_EXCEPTIONS if pair not in top]
    assert not stale, f"FLOOR_EXCEPTIONS lists imports that no longer exist: {stale}"


def _statement_lines(path: Path) -> dict[int, tuple[int, int]]:
    """First line -> (first, last) line of every function-level import statement of a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[int, tuple[int, int]] = {}

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if local and isinstance(child, (ast.Import, ast.ImportFrom)):
                out[child.lineno] = (child.lineno, child.end_lineno or child.lineno)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def has_local_comment(path: Path, line: int) -> bool:
    """Whether the import statement starting at `line` says why it is local: `# local: ...` on its own lines,
    or on the comment line just above it or above the run of import lines it belongs to."""
    text = path.read_text(encoding="utf-8").splitlines()
    statements = _statement_lines(path)
    first, last = statements[line]
    if any(LOCAL_TAG in text[i - 1] for i in range(first, last + 1)):
        return True
    above = first - 1
    while above in {end for _, end in statements.values()}:  # the previous line ends another local import
        start = next(s for s, e in statements.values() if e == above)
        above = start - 1
    return above >= 1 and text[above - 1].strip().startswith(LOCAL_TAG)


def third_party_imports(path: Path) -> set[str]:
    """Top-level packages, other than the standard library and oscar, that a file imports at top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("oscar", "__future__")}


@pytest.mark.parametrize("root", sorted(ALLOWED_PACKAGES))
def test_import_time_dependencies_of_the_light_floors(edges, root):
    """What importing a module of `root` loads (its top-level imports, through every oscar module they load)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.local:
            graph.setdefault(e.source, set()).add(e.target)
    for start in (m for m in files if m == root or m.startswith(root + ".")):
        seen, stack = set(), [start]
        while stack:
            module = stack.pop()
            if module not in seen:
                seen.add(module)
                stack.extend(graph.get(module, ()))
        loaded = {pkg: m for m in sorted(seen) for pkg in third_party_imports(files[m])}
        extra = {pkg: via for pkg, via in loaded.items() if pkg not in ALLOWED_PACKAGES[root]}
        assert not extra, f"importing {start} loads {extra} (package: the module that imports it at top level)"


def test_function_local_oscar_imports_say_why(edges):
    seen = set()
    missing = []
    for e in edges:
        if e.local and in_scope(e.source) and (e.path, e.line) not in seen:
            seen.add((e.path, e.line))
            if not has_local_comment(e.path, e.line):
                missing.append(f"{e.path.relative_to(ROOT)}:{e.line}: {e.source} imports {e.target} in a function")
    assert not missing, ("function-local oscar imports without a `# local: <why>` comment (hoist them to the top "
                         "of the file unless they keep an optional dependency out of import time; a local import never "
                         "breaks a cycle, test_no_cycle_among_all_oscar_imports counts it):\n" + "\n".join(missing))


def test_local_comment_reader(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n"
                   "    # local: keeps transformers out of import time\n"
                   "    from oscar.models.engine import Engine\n"
                   "    from oscar.models import load_model\n"
                   "\n"
                   "    from oscar.config import compose\n"
                   "    import oscar.core.quant  # local: oscar.core.quant imports this module\n")
    assert has_local_comment(src, 3) and has_local_comment(src, 4)
    assert not has_local_comment(src, 6)
    assert has_local_comment(src, 7)
