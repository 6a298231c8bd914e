"""The diagrams in docs/diagrams/ cannot go stale silently (no rendering here, only the sources).

Each ``.dot`` source names code the way a reader would grep it: ``<I>path</I>`` for a file or
folder (under ``src/keyserve/`` or the repo root), ``<B>Name</B>`` for a class or function
(``Class.method`` for a method), where ``<B>Name</B> <I>path</I>`` says the name is defined in
that file. So: every path written anywhere in a source exists; every bold identifier is defined
in the file it is paired with, or else somewhere in the package; and the arrows of
``imports.dot`` are exactly the package's imports between its subpackages, dashed where every
such import is function-local. Each committed ``.dot`` has its rendered ``.svg`` and ``.png``.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIAGRAMS = ROOT / "docs" / "diagrams"
SOURCES = sorted(DIAGRAMS.glob("*.dot"))

# A file path anywhere in a source (labels and comments): dir/.../name.ext
PATH_RE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w.-]+\.(?:py|md|sh|dot|yaml|yml|toml|json))\b")
ITALIC_RE = re.compile(r"<I>([^<]*)</I>")
# A bold identifier, and the path written right after it (its home), if any.
BOLD_RE = re.compile(r"<B>([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)</B>\s*(?:<I>([^<]*)</I>)?")
EDGE_RE = re.compile(r"^\s*(\w+)\s*->\s*(\w+)\s*(\[[^\]]*\])?\s*;", re.MULTILINE)
NODE_RE = re.compile(r"^\s*(\w+)\s*\[", re.MULTILINE)


def resolve(path: str, root: Path = ROOT) -> Path | None:
    """A path as the diagrams write it: relative to src/keyserve/, else to the repo root."""
    for base in (root / "src" / "keyserve", root):
        candidate = base / path
        if candidate.is_dir() if path.endswith("/") else candidate.is_file():
            return candidate
    return None


@cache
def _definitions(path: Path) -> frozenset[str]:
    """Classes, functions and methods (at any depth) and module-level names defined in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{m.name}" for m in node.body
                             if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def defined_in(name: str, files: list[Path]) -> bool:
    return any(name in _definitions(f) for f in files)


def package_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "src" / "keyserve").rglob("*.py"))


def without_comments(text: str) -> str:
    """The source without its // comments (which describe the conventions in their own markup)."""
    return re.sub(r"^\s*//.*$", "", text, flags=re.MULTILINE)


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    named = set(PATH_RE.findall(text)) | set(ITALIC_RE.findall(without_comments(text)))
    return sorted(p for p in named if resolve(p, root) is None)


def undefined_names(text: str, root: Path = ROOT) -> list[str]:
    """Bold identifiers not defined where the diagram says (or, unpaired, nowhere in the package)."""
    bad = []
    for name, home in BOLD_RE.findall(without_comments(text)):
        where = resolve(home, root) if home else None
        if home and where is None:
            bad.append(f"{name} ({home}: no such file)")
        elif where is not None and where.suffix == ".py":
            if not defined_in(name, [where]):
                bad.append(f"{name} (not defined in {home})")
        elif not defined_in(name, package_files(root)):
            bad.append(f"{name} (defined nowhere in src/keyserve)")
    return bad


def component(module: str) -> str:
    """The diagram node of a module: its subpackage or top-level module (``keyserve`` for __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_imports(root: Path = ROOT) -> dict[tuple[str, str], bool]:
    """(importer, imported) components -> True if some import between them is at module level."""
    src = root / "src"
    known = components(root)
    edges: dict[tuple[str, str], bool] = {}
    for path in package_files(root):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        here = component(".".join(parts))

        def visit(node: ast.AST, local: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    module = child.module or ""
                    if child.level:  # relative: against this module's package
                        base = parts if is_package else parts[:-1]
                        base = base[: len(base) - (child.level - 1)]
                        module = ".".join([*base, module] if module else base)
                    targets = [  # `from keyserve import engine` imports a subpackage; else __init__
                        f"keyserve.{a.name}" if module == "keyserve" and a.name in known else module
                        for a in child.names
                    ]
                for target in targets:
                    if target.split(".")[0] == "keyserve" and component(target) != here:
                        key = (here, component(target))
                        edges[key] = edges.get(key, False) or not local
                visit(child, inner)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return edges


def components(root: Path = ROOT) -> set[str]:
    pkg = root / "src" / "keyserve"
    return {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()
    } | {"keyserve"}


def drawn_imports(text: str) -> dict[tuple[str, str], bool]:
    """The arrows of imports.dot: (importer, imported) -> solid (False where dashed)."""
    return {(a, b): "dashed" not in (attrs or "") for a, b, attrs in EDGE_RE.findall(text)}


# ----------------------------------------------------------------------------- tests
def test_there_are_diagrams() -> None:
    assert {p.stem for p in SOURCES} >= {"actors", "step", "imports"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_path_in_a_diagram_exists(source: Path) -> None:
    text = source.read_text(encoding="utf-8")
    assert PATH_RE.search(text) or ITALIC_RE.search(text), "a diagram that names no file checks nothing"
    assert missing_paths(text) == [], f"{source.name} names paths that do not exist"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_bold_name_is_defined_where_the_diagram_says(source: Path) -> None:
    assert undefined_names(source.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_diagram_is_rendered(source: Path) -> None:
    for suffix in (".svg", ".png"):
        rendered = source.with_suffix(suffix)
        assert rendered.is_file() and rendered.stat().st_size > 1000, f"run docs/diagrams/render.sh ({rendered.name})"


def test_import_diagram_is_the_package_import_graph() -> None:
    text = (DIAGRAMS / "imports.dot").read_text(encoding="utf-8")
    nodes = set(NODE_RE.findall(text)) - {"graph", "node", "edge"}
    assert nodes == components(), "one node per subpackage / top-level module of keyserve"
    drawn, real = drawn_imports(text), package_imports()
    assert sorted(set(real) - set(drawn)) == [], "imports the diagram does not draw"
    assert sorted(set(drawn) - set(real)) == [], "arrows for imports the package does not have"
    style = {k: ("solid" if real[k] else "dashed", "solid" if drawn[k] else "dashed")
             for k in real if real[k] != drawn[k]}
    assert style == {}, "(package, diagram) style: dashed means only function-local imports"
