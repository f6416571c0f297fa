"""The packages' layering, read from their source with :mod:`ast` (nothing is imported).

Every module of ``arona_grpc``, ``gateway_http`` and ``arona_store`` is parsed and each import
of one of those modules becomes an edge of one graph, wherever the import stands: at module
level, inside a function (a late import is still a dependency, only a deferred one) and under
``if TYPE_CHECKING:`` (an import made only for a type annotation still ties the two modules
together, and is how a circle hides). ``from package import name`` is an edge to the module
``package.name`` when that is a module, else to ``package`` itself. Importing a module also
runs its packages' ``__init__``; those implicit edges are left out (a package's ``__init__``
imports nothing but, for a facade such as ``arona_grpc.service``, its own modules; each such
import is an edge like any other).

On that graph: no import circle anywhere; the HTTP layer reaches memory only through the gRPC
stub (STYLE.md); the ground floor (``arona_common``) imports none of the layers, and the memory
store, a server of its own, none of the layers above it. Beside it, the rooms' sizes: no
hand-written module over :data:`MAX_MODULE_LINES` lines, and no module of the memory service's
domain over :data:`MAX_DOMAIN_MODULE_LINES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("arona_common", "arona_grpc", "gateway_http", "arona_store")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    names: tuple[str, ...]  # the names taken from it (empty for ``import target``)
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }


def imports_of(source: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield Import(source, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = source.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = tuple(alias.name for alias in node.names)
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in known]
            for submodule in submodules:
                yield Import(source, submodule, (), node.lineno)
            if base in known and len(submodules) < len(names):
                yield Import(source, base, names, node.lineno)


def import_graph(known: dict[str, Path]) -> dict[str, list[Import]]:
    return {source: list(imports_of(source, path, known)) for source, path in known.items()}


def find_cycle(graph: dict[str, list[Import]]) -> list[Import] | None:
    """One import circle (its edges in order), or None."""
    done: set[str] = set()
    stack: list[Import] = []
    on_stack: dict[str, int] = {}

    def visit(module: str) -> list[Import] | None:
        on_stack[module] = len(stack)
        for edge in graph[module]:
            if edge.target in on_stack:
                return stack[on_stack[edge.target] :] + [edge]
            if edge.target not in done:
                stack.append(edge)
                cycle = visit(edge.target)
                if cycle is not None:
                    return cycle
                stack.pop()
        del on_stack[module]
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle is not None:
                return cycle
    return None


def describe(edges: list[Import], known: dict[str, Path], root: Path = REPO) -> str:
    return "\n".join(
        f"  {edge.source} imports {edge.target} "
        f"({known[edge.source].relative_to(root)}:{edge.line})"
        for edge in edges
    )


def test_the_checker_finds_a_circle_closed_by_a_type_checking_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n"
    )
    (package / "mid.py").write_text("from . import low\n")
    (package / "high.py").write_text("def make():\n    from .mid import low\n")
    known = modules(tmp_path, ("pkg",))
    cycle = find_cycle(import_graph(known))
    assert cycle is not None
    assert describe(cycle, known, tmp_path).splitlines() == [
        "  pkg.high imports pkg.mid (pkg/high.py:2)",
        "  pkg.mid imports pkg.low (pkg/mid.py:1)",
        "  pkg.low imports pkg.high (pkg/low.py:3)",
    ]


def test_no_module_imports_itself_back_through_others() -> None:
    known = modules()
    assert {"arona_grpc.service", "gateway_http.app", "arona_store.store"} <= set(known)
    cycle = find_cycle(import_graph(known))
    assert cycle is None, "an import circle:\n" + describe(cycle, known)


# Where memory is served, behind the gRPC stub.
MEMORY_SIDE = (
    "arona_store",
    "arona_grpc.philia",
    "arona_grpc.service",
    "arona_grpc.servicer",
    "arona_grpc.server",
    "arona_grpc.outbox",
    "arona_grpc.episodes",
)
# The command line starts that side itself (`arona-gateway up`, `store`, `check-memory`): its
# entry point and the commands' package.
COMMAND_LINE = ("gateway_http.cli", "gateway_http.commands")


def _command_line(module: str) -> bool:
    return any(module == part or module.startswith(f"{part}.") for part in COMMAND_LINE)


def test_the_http_layer_reaches_memory_only_through_the_grpc_stub() -> None:
    """Outside its entry point, the HTTP layer takes nothing from the memory side but
    constants of the wire (metadata keys, error codes): no client, store or service."""
    known = modules()
    graph = import_graph(known)
    crossings = [
        edge
        for source, edges in graph.items()
        if source.startswith("gateway_http.") and not _command_line(source)
        for edge in edges
        if any(edge.target == side or edge.target.startswith(f"{side}.") for side in MEMORY_SIDE)
        and not (edge.names and all(name.isupper() for name in edge.names))
    ]
    assert not crossings, "the HTTP layer around the stub:\n" + describe(crossings, known)
    reached = {
        edge.target
        for source, edges in graph.items()
        if source.startswith("gateway_http.")
        for edge in edges
    }
    assert "arona_grpc._gen.arona.memory.v1.memory_service_pb2_grpc" in reached


# Each layer and what it may import of the project's packages besides itself.
ALLOWED_BELOW = {
    "arona_common": set(),
    "arona_store": {"arona_common"},
}


def test_the_ground_floor_and_the_store_import_nothing_above_them() -> None:
    known = modules()
    graph = import_graph(known)
    upward = [
        edge
        for source, edges in graph.items()
        for edge in edges
        if (layer := source.split(".")[0]) in ALLOWED_BELOW
        and (target := edge.target.split(".")[0]) != layer
        and target not in ALLOWED_BELOW[layer]
    ]
    assert not upward, "imports from a layer above:\n" + describe(upward, known)


# A module one can hold in one's head; generated stubs and the console's script aside.
MAX_MODULE_LINES = 800
# The memory service's domain is one module per concern behind a facade, each smaller still.
DOMAIN_PACKAGE = "arona_grpc/service"
MAX_DOMAIN_MODULE_LINES = 500


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _hand_written() -> Iterator[Path]:
    for package in (*PACKAGES, "bench", "scripts"):
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO)
            if "_gen" in relative.parts or ".venv" in relative.parts:
                continue
            yield path


def test_no_hand_written_module_is_over_800_lines() -> None:
    over = {
        str(path.relative_to(REPO)): lines
        for path in _hand_written()
        if (lines := _line_count(path)) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_each_module_of_the_memory_domain_owns_one_concern_and_says_which() -> None:
    paths = sorted((REPO / DOMAIN_PACKAGE).glob("*.py"))
    assert len(paths) >= 6
    for path in paths:
        lines = _line_count(path)
        assert lines <= MAX_DOMAIN_MODULE_LINES, f"{path.name}: {lines} lines"
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert docstring, f"{path.name} does not say what it owns"
