"""The package's imports go one way, with no cycles (docs/ARCHITECTURE.md, "Import layers").

An AST walk of every module under src/keyserve: each ``import keyserve...`` / ``from keyserve...
import ...`` -- at module level or inside a function -- must point to the importer's own
package or to a layer below it; the module graph (function-local edges included, so a lazy
import cannot hide a cycle) has no cycle; a function-local keyserve import exists only where
``LAZY`` names it with its reason; the HTTP layer reaches the engine only through its client
surface. A subprocess then checks the ground floor at runtime: ``import keyserve.config``
loads nothing of keyserve but ``config`` and ``types``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "keyserve"

# Bottom first. A module may import its own component (the longest entry that prefixes its
# name) and any component of a lower layer -- not one above, and not a sibling in its layer.
LAYERS: list[tuple[str, ...]] = [
    ("keyserve.types",),
    ("keyserve.config",),
    ("keyserve.core",),
    ("keyserve.kernels",),
    ("keyserve.model",),
    ("keyserve.engine",),
    ("keyserve.actors",),
    ("keyserve.cluster",),
    ("keyserve.llm", "keyserve.training"),  # the Python facade; the draft-training tool
    ("keyserve.cli", "keyserve"),  # the command line; the package's lazy __init__
]



@dataclass(frozen=True)
class Lazy:
    """A function-local keyserve import that is allowed, and why."""

    importer: str
    target: str  # a module, or a package covering its submodules
    names: frozenset[str] | None  # the names imported from it (None: any)
    reason: str


# The only function-local keyserve imports. Each keeps an optional or heavy dependency (triton,
# Ray, the training pipeline, torch) out of a process or a command that does not need it.
LAZY: list[Lazy] = [
    Lazy("keyserve", "keyserve.llm", frozenset({"LLM"}),
         "PEP 562 attribute: importing any submodule must not load torch and the engine"),
    Lazy("keyserve", "keyserve.core.sampling_params", frozenset({"SamplingParams"}),
         "PEP 562 attribute: `import keyserve.config` loads config and types only"),
    Lazy("keyserve.kernels.attention", "keyserve.kernels.paged_attention", None,
         "triton (an optional extra), only for CUDA tensors"),
    Lazy("keyserve.cli", "keyserve.training", None,
         "the draft-training pipeline, only for `keyserve distill-draft`"),
    Lazy("keyserve.cli", "keyserve.llm", frozenset({"LLM", "RayLLM"}),
         "torch and the engine only once `generate` runs; parsing and --help stay light"),
    Lazy("keyserve.llm", "keyserve.actors.ray_engine", frozenset({"RayEngine"}),
         "Ray, only for RayLLM (LLM runs without it)"),
    Lazy("keyserve.cluster.openai_serving", "keyserve.actors.ray_engine", frozenset({"AsyncRayEngine"}),
         "Ray, only when the server runs the Ray engine"),
    Lazy("keyserve.engine.async_engine", "keyserve.engine.llm_engine", frozenset({"LLMEngine"}),
         "torch: the HTTP layer imports the async front torch-free; the model loads on the engine thread"),
]

# What the HTTP / batch layer may import from the layers below the actors.
ENGINE_CLIENT = {"keyserve.engine.async_engine", "keyserve.engine.outputs", "keyserve.engine.errors",
                 "keyserve.engine.stats"}
ACTORS_CLIENT = {"keyserve.actors.ray_engine"}  # AsyncRayEngine


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str
    line: int
    local: bool  # inside a function: runs only when called
    name: str | None = None  # ``from target import name`` (None for ``import target``)

    def __str__(self) -> str:
        where = "function-local" if self.local else "module-level"
        return f"{self.importer} -> {self.target} ({where}, line {self.line})"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(module: str, name: str, modules: dict[str, Path]) -> str:
    """``from module import name``: the submodule when ``name`` is one, else ``module``."""
    sub = f"{module}.{name}"
    return sub if sub in modules else module


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def edges_of(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: list[Edge] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "keyserve" or alias.name.startswith("keyserve."):
                        out.append(Edge(name, alias.name, child.lineno, local))
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    base = name.split(".")
                    base = base if _is_package(path) else base[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    module = ".".join(base + ([module] if module else []))
                if module == "keyserve" or module.startswith("keyserve."):
                    for alias in child.names:
                        target = _resolve(module, alias.name, modules)
                        imported = None if target.endswith("." + alias.name) else alias.name
                        out.append(Edge(name, target, child.lineno, local, imported))
            visit(child, inner)

    visit(tree, False)
    return out


def all_edges() -> list[Edge]:
    modules = module_names()
    return [e for name, path in sorted(modules.items()) for e in edges_of(name, path, modules)]


def component(module: str) -> tuple[int, str]:
    """(layer index, component) of a module: the longest layer entry that prefixes it."""
    best: tuple[int, str] | None = None
    for rank, entries in enumerate(LAYERS):
        for entry in entries:
            if module == entry or (entry != "keyserve" and module.startswith(entry + ".")):
                if best is None or len(entry) > len(best[1]):
                    best = (rank, entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def direction_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        (rank_from, comp_from), (rank_to, comp_to) = component(e.importer), component(e.target)
        if comp_from != comp_to and rank_to >= rank_from:
            what = "a sibling" if rank_to == rank_from else "a layer above"
            bad.append(f"{e}: {comp_from} imports {what} ({comp_to})")
    return bad


def find_cycle(edges: list[Edge]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target != e.importer:
            graph.setdefault(e.importer, set()).add(e.target)
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def lazy_entry(e: Edge) -> Lazy | None:
    for entry in LAZY:
        if (e.importer == entry.importer
                and (e.target == entry.target or e.target.startswith(entry.target + "."))
                and (entry.names is None or e.name in entry.names)):
            return entry
    return None


# ----------------------------------------------------------------------------------- tests
def test_the_walk_sees_the_package() -> None:
    """Guard against a walk that finds nothing (a moved source tree would pass every check)."""
    edges = all_edges()
    assert len(module_names()) > 80
    assert any(e.importer == "keyserve.engine.llm_engine" and e.target == "keyserve.engine.build" for e in edges)
    assert any(e.local and e.importer == "keyserve.cli" for e in edges)


def test_imports_go_one_way() -> None:
    assert direction_violations(all_edges()) == []


def test_no_import_cycles() -> None:
    cycle = find_cycle(all_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_function_local_imports_are_only_the_listed_lazy_ones() -> None:
    local = [e for e in all_edges() if e.local]
    unlisted = [f"{e} {e.name or ''}" for e in local if lazy_entry(e) is None]
    assert unlisted == [], "a function-local keyserve import needs a LAZY entry with its reason (or move it up)"
    used = {lazy_entry(e) for e in local}
    assert [entry for entry in LAZY if entry not in used] == [], "stale LAZY entries"


def test_cluster_uses_only_the_engine_client_surface() -> None:
    bad = []
    for e in all_edges():
        if not e.importer.startswith("keyserve.cluster"):
            continue
        if e.target.startswith("keyserve.engine") and e.target not in ENGINE_CLIENT:
            bad.append(str(e))
        if e.target.startswith("keyserve.actors") and e.target not in ACTORS_CLIENT:
            bad.append(str(e))
    assert bad == []


def test_core_imports_neither_ray_nor_triton_nor_distributed() -> None:
    bad = []
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names
                    if n.split(".")[0] in ("ray", "triton") or n.startswith("torch.distributed")]
    assert bad == []


def test_config_is_the_ground_floor_at_runtime() -> None:
    """Independent of the walk: what importing ``keyserve.config`` really loads."""
    code = "import sys, keyserve.config; print(sorted(m for m in sys.modules if m.startswith('keyserve')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['keyserve', 'keyserve.config', 'keyserve.types']"
