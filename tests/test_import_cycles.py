"""No import circles in ``tensoralg/`` and ``verify/``, and ``tensoralg.verify`` independent of the fast paths.

The repository's ``verify/`` folder is the package ``tensoralg.verify`` (``pyproject.toml``'s
``package-dir``): its modules are named so here, and an import of ``verify.x`` from anywhere is
an error (it would load a second copy, or a user's own ``verify.py``).

The import graph is read from the source with :mod:`ast` (every ``import`` / ``from ... import``
statement anywhere in a module, including those inside functions, methods and module
``__getattr__``; ``importlib.import_module("literal")`` too), one node per module (a package is
its ``__init__``). An edge ``a -> b`` means that some statement in ``a`` imports module ``b``:
``from p import x`` is an edge to ``p.x`` when ``p.x`` is a module, else to ``p``; ``import
p.q`` is an edge to ``p.q``. The implicit execution of parent packages' ``__init__`` (Python
runs ``p/__init__.py`` before ``p.q``) is not an edge: it happens for every submodule and says
nothing about who depends on whom. A module name computed at run time in a package's
``__init__`` (``importlib.import_module(f"{__name__}.{...}")``, the lazy ``__getattr__`` of
``tensoralg.sae`` and ``tensoralg.verify``) counts as an edge to each of the package's own submodules;
elsewhere such a name is not followed (``tensoralg.sae.activations`` loads optional third-party
packages that way). ``if TYPE_CHECKING:`` blocks are skipped (they never run).
Circles are the strongly connected components of the graph (:func:`networkx.simple_cycles`
lists example circles inside each for the message).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package name it is installed under
PACKAGES = (("tensoralg", "tensoralg"), ("verify", "tensoralg.verify"))

# verify checks tensoralg independently: it must not reach tensoralg's fast paths.
FAST_PATHS = ("tensoralg.products", "tensoralg.strategies",
              "tensoralg.planner")


def _module_name(path: Path, folder: Path, package: str) -> str:
    parts = [package] + list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ROOT, packages: tuple = PACKAGES) -> dict[str, Path]:
    return {_module_name(p, root / folder, pkg): p for folder, pkg in packages
            for p in sorted((root / folder).rglob("*.py"))}


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (they never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` imported anywhere in module ``name`` (file ``path``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_blocks(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def target(mod: str) -> None:
        while mod and mod not in modules:   # `import a.b.c` where only a.b is ours
            mod = mod.rpartition(".")[0]
        if mod:
            out.add(mod)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                target(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                target(sub if sub in modules else mod)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                target(arg.value)
            elif path.name == "__init__.py":   # a package's lazy __getattr__: any submodule
                out.update(m for m in modules if m.rpartition(".")[0] == name)
    out.discard(name)
    return out


@functools.cache
def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> nx.DiGraph:
    mods = _modules(root, packages)
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        g.add_edges_from((name, dep) for dep in _imports(name, path, set(mods)))
    return g


def circles(g: nx.DiGraph) -> list[set[str]]:
    """The import circles: strongly connected components with more than one module."""
    return sorted((c for c in nx.strongly_connected_components(g) if len(c) > 1),
                  key=lambda c: sorted(c))


def _describe(g: nx.DiGraph, comp: set[str], limit: int = 5) -> str:
    sub = g.subgraph(comp)
    examples = []
    for cyc in nx.simple_cycles(sub):
        examples.append(" -> ".join(cyc + [cyc[0]]))
        if len(examples) == limit:
            break
    return f"{sorted(comp)}; e.g.\n    " + "\n    ".join(examples)


def test_graph_sees_imports_inside_functions():
    # tensoralg.cli imports each package's CLI inside a function, the decompose CLI imports the
    # checkpoint loader inside one, nn imports the transformer in its module __getattr__
    g = import_graph()
    assert g.has_edge("tensoralg.cli", "tensoralg.audit.cli")
    assert g.has_edge("tensoralg.decompose.cli", "tensoralg.checkpoint")
    assert g.has_edge("tensoralg.nn", "tensoralg.transformer")


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    # A package written here: a -> b at the top (relative), b -> a inside a function
    # (absolute), c -> a only (not in the circle), d imports a name of the package __init__.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.a\n    return pkg.a\n")
    (pkg / "c.py").write_text("from .a import b\n")
    (pkg / "d.py").write_text("from pkg import X\n")
    g = import_graph(tmp_path, (("pkg", "pkg"),))
    assert circles(g) == [{"pkg.a", "pkg.b"}]
    assert set(g.successors("pkg.c")) == {"pkg.a"} and set(g.successors("pkg.d")) == {"pkg"}


def test_no_import_circles():
    g = import_graph()
    found = circles(g)
    assert not found, "import circles:\n" + "\n".join(_describe(g, c) for c in found)


def test_verify_does_not_import_fast_paths():
    # verify's own imports and everything they import in turn (the explicit edges of the graph;
    # Python also runs tensoralg/__init__.py, which loads the engine, but verify calls none of it)
    g = import_graph()
    reached = set()
    mine = [m for m in g if m == "tensoralg.verify" or m.startswith("tensoralg.verify.")]
    assert "tensoralg.verify.certify" in mine   # the folder verify/ is read as tensoralg.verify
    for mod in mine:
        reached |= nx.descendants(g, mod)
    bad = sorted(m for m in reached if any(m == f or m.startswith(f + ".") for f in FAST_PATHS))
    assert not bad, f"tensoralg.verify reaches tensoralg's fast paths: {bad}"
    assert "tensoralg.layers" in reached   # the walk does follow verify into tensoralg


def test_nothing_imports_verify_by_its_folder_name():
    # `import verify` / `from verify.x import` would load the folder a second time under another
    # name (or a user's own verify.py): everything, verify included, uses tensoralg.verify or a
    # relative import. Checked over the packages, tests, benchmarks and the docs' code.
    bad = []
    for folder in ("tensoralg", "verify", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                         else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                        if n == "verify" or n.startswith("verify.")]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
                 *sorted((ROOT / "proofs_notebooks").glob("*.ipynb"))]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(^|[^\w.])(from verify[ .]|import verify\b|python -m verify\b)", line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "uses of the folder name verify instead of tensoralg.verify:\n" + "\n".join(bad)
