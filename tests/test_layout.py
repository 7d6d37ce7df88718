"""The shape of the package, the harness and the benchmarks: no import cycle between modules
(TYPE_CHECKING imports included, and across the three) and no module over 700 lines; and the
shared modules' doctests, which the doctest collection of the testpaths does not reach. The
layering itself is import-linter's contracts in pyproject.toml, run by ``make lint``; this test
runs the same graph builder (grimp) for what contracts cannot say."""

from __future__ import annotations

import doctest
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the sidecar, what the tests and the benchmarks share, and the benchmarks
PACKAGES = ("sidecar", "harness", "bench")
MAX_LINES = 700


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_module_over_700_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


@pytest.mark.parametrize(
    "module", ["harness.stats", "harness.exposition", "harness.vllm_formats", "bench.registry"]
)
def test_shared_doctests(module: str) -> None:
    """The examples in the shared modules' docstrings hold (pytest's --doctest-modules collects
    only its testpaths, which do not include harness/ or bench/)."""
    result = doctest.testmod(__import__(module, fromlist=["_"]))
    assert result.attempted > 0 and result.failed == 0
