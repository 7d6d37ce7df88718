"""The shape of the package, the harness and the benchmarks: no import cycle between modules
(TYPE_CHECKING imports included, and across the three) and no module over 700 lines; and the
shared modules' doctests, which the doctest collection of the testpaths does not reach; and no
test module importing another (what they share lives in tests/support/ or tests/conftest.py).
The layering itself is import-linter's contracts in pyproject.toml, run by ``make lint``; this test
runs the same graph builder (grimp) for what contracts cannot say."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
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


def _is_test_module(name: str) -> bool:
    """``tests.test_*`` or anything inside one."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "tests" and parts[1].startswith("test_")


def _test_module_imports(path: Path, source: str | None = None) -> list[str]:
    """``file:line: statement`` for each import of a test module in ``path`` (or in ``source``,
    read as that file): absolute, relative, ``from tests import test_x``, and imports inside
    functions or ``if TYPE_CHECKING:`` alike."""
    relative = path.relative_to(ROOT)
    package = list(relative.parent.parts)
    tree = ast.parse(path.read_text() if source is None else source, filename=str(relative))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*parent, *([node.module] if node.module else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(_is_test_module(name) for name in names):
            found.append((node.lineno, f"{relative}:{node.lineno}: {ast.unparse(node)}"))
    return [line for _, line in sorted(found)]


def test_no_test_module_imports_another() -> None:
    """Every tests/test_*.py (and tests/support/, tests/conftest.py) imports no tests.test_*
    module: a helper two test modules share lives in tests/support/ or is a conftest fixture."""
    paths = [
        *sorted(TESTS.glob("test_*.py")),
        *sorted((TESTS / "support").rglob("*.py")),
        TESTS / "conftest.py",
    ]
    assert len(paths) > 10
    found = [hit for path in paths for hit in _test_module_imports(path)]
    assert not found, (
        "imports of a test module (move what they use to tests/support/):\n" + "\n".join(found)
    )


def test_the_test_import_finder_finds_each_form() -> None:
    source = "\n".join(
        [
            "from tests.test_proxy import Stack",
            "import os, tests.test_alerts as alerts",
            "from tests import test_grafana",
            "from .test_deploy import render",
            "from . import test_tracing",
            "def later() -> None:",
            "    from tests.test_admission import Clock",
            "from tests.support.wait import wait_for",
            "from tests.conftest import VllmInfo",
            "from tests import support, conftest",
            "import tests.support.sim",
            "from .support.stack import run_sidecar",
            "from sidecar.admission import test_mode",
        ]
    )
    found = _test_module_imports(TESTS / "test_example.py", source)
    assert found == [
        "tests/test_example.py:1: from tests.test_proxy import Stack",
        "tests/test_example.py:2: import os, tests.test_alerts as alerts",
        "tests/test_example.py:3: from tests import test_grafana",
        "tests/test_example.py:4: from .test_deploy import render",
        "tests/test_example.py:5: from . import test_tracing",
        "tests/test_example.py:7: from tests.test_admission import Clock",
    ]
    # one level up from tests/support/ is tests/: ``from ..test_x`` there is a test module too
    assert _test_module_imports(TESTS / "support" / "x.py", "from ..test_proxy import Stack") == [
        "tests/support/x.py:1: from ..test_proxy import Stack"
    ]
