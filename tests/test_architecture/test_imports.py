"""The one-way dependency rule of DESIGN.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "files",
    "p2p",
    "proto",
    "ir",
    "dag",
    "broker",
    "provider",
    "client",
    "gateway",
    "sim",
    "cli",
    "lab",
]
NOT_SHIPPED = {"lab"}  # the home-internet lab: tests and benchmarks use it, users do not

# What each package may import from the project (DESIGN.md, "Dependencies point one way").
ALLOWED: dict[str, set[str]] = {
    "files": set(),
    "p2p": {"files"},
    "proto": {"p2p"},
    "ir": {"files"},
    "dag": set(),
    "broker": {"files", "p2p", "proto", "ir", "dag", "client"},
    "provider": {"files", "p2p", "proto", "ir", "dag"},
    "client": {"files", "p2p", "proto", "ir"},
    "gateway": {"files", "p2p", "proto", "ir", "client", "broker"},
    "sim": {"broker", "dag"},
    "cli": set(PACKAGES) - {"cli", "lab"},
    "lab": {"sim"},  # it runs the product as processes; of it, only lab scenarios (sim.labscenario)
}
# The broker's decision core is pure and synchronous: no event loop, no I/O, no clock, no
# randomness (broker/core/__init__.py); the simulator uses it and nothing else of the broker.
CORE = "broker/core"
CORE_FORBIDDEN = {
    "asyncio", "aiohttp", "sqlite3", "aiosqlite", "socket", "threading", "time", "random",
    "secrets", "uuid", "os", "subprocess", "p2p", "proto", "client", "provider", "trio",
}  # fmt: skip
TRIO_ONLY_IN = {"p2p"}
TRIO_MODULES = {"trio", "libp2p", "multiaddr", "trio_asyncio", "outcome"}
FORBIDDEN = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _imports(path: Path, depth: int = 1) -> set[str]:
    """Modules `path` imports, as their first `depth` dotted parts."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(".".join(alias.name.split(".")[:depth]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(".".join(node.module.split(".")[:depth]))
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_the_design_allows(package: str) -> None:
    assert _modules(package), f"{package}/ has no modules"
    for path in _modules(package):
        imported = _imports(path)
        project = imported & set(PACKAGES) - {package}
        assert project <= ALLOWED[package], (
            f"{path.relative_to(ROOT)} imports {sorted(project - ALLOWED[package])}, "
            f"which {package}/ must not use"
        )
        if package not in TRIO_ONLY_IN:
            assert not imported & TRIO_MODULES, (
                f"{path.relative_to(ROOT)} imports {sorted(imported & TRIO_MODULES)}: "
                f"only p2p/ may touch trio and libp2p"
            )
        assert not imported & FORBIDDEN, (
            f"{path.relative_to(ROOT)} imports {sorted(imported & FORBIDDEN)}: "
            f"nothing that crosses a process boundary is pickled"
        )


def test_the_decision_core_is_pure_and_the_simulator_uses_only_it() -> None:
    core = sorted((ROOT / CORE).rglob("*.py"))
    assert len(core) >= 8, "broker/core/ holds the pool, placement, planner, queue, ..."
    for path in core:
        imported = _imports(path)
        assert not imported & CORE_FORBIDDEN, (
            f"{path.relative_to(ROOT)} imports {sorted(imported & CORE_FORBIDDEN)}: the decision "
            f"core does no I/O and reads no clock or randomness (the service passes them in)"
        )
        broker = {m for m in _imports(path, 2) if m.split(".")[0] == "broker"}
        assert broker <= {"broker.core"}, f"{path.relative_to(ROOT)} imports {sorted(broker)}"
    for path in _modules("sim"):
        broker = {m for m in _imports(path, 2) if m.split(".")[0] == "broker"}
        assert broker <= {"broker.core"}, (
            f"{path.relative_to(ROOT)} imports {sorted(broker - {'broker.core'})}: the simulator "
            f"drives the broker's decision core and nothing else of the broker"
        )


def test_the_allowed_graph_has_no_cycles() -> None:
    seen: dict[str, int] = {}

    def visit(node: str, stack: tuple[str, ...]) -> None:
        assert node not in stack, f"cycle: {' -> '.join((*stack, node))}"
        if seen.get(node):
            return
        for dep in ALLOWED[node]:
            visit(dep, (*stack, node))
        seen[node] = 1

    for package in PACKAGES:
        visit(package, ())


def test_every_package_says_what_it_owns() -> None:
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{package}/__init__.py needs a docstring saying what it owns"


def test_importing_the_packages_does_not_load_libp2p() -> None:
    code = (
        "import sys, p2p, proto.ping, cli.main\n"
        "loaded = sorted(m for m in ('libp2p', 'trio') if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "libp2p" not in out.stdout


def test_no_benchmark_is_named_after_a_top_level_package() -> None:
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path: a `benchmarks/broker.py`
    would be imported instead of the broker package by every other benchmark."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert set(PACKAGES) <= packages
    clashes = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.stem in packages)
    assert not clashes, f"benchmarks named after a package (rename them): {clashes}"
    makefile = (ROOT / "Makefile").read_text()
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        assert f"benchmarks/{path.name}" in makefile, f"`make bench` does not run {path.name}"


def _module_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports at run time (anywhere in it,
    functions included; not what `if TYPE_CHECKING:` imports for annotations only)."""
    paths: dict[str, Path] = {}
    for package in PACKAGES:
        for path in _modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) in _TYPE_CHECKING
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(paths)
                found.update(subs or {node.module})  # `from p2p import host`: the submodule
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


_TYPE_CHECKING = {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph = _module_graph()
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycle = [*stack[stack.index(node) :], node]
            raise AssertionError(f"import circle: {' -> '.join(cycle)}")
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*stack, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_the_broker_service_is_its_one_composition_root() -> None:
    """Components get what they need in their constructors: none imports the service (not
    even for annotations), and none is wired by assigning another's attributes afterwards."""
    for path in _modules("broker"):
        if path.name == "service.py":
            continue
        assert "broker.service" not in _imports(path, 2), (
            f"{path.relative_to(ROOT)} imports broker.service: take the parts you need in "
            f"the constructor"
        )


MODULE_BUDGET = 400  # non-blank, non-comment lines: a module read in one sitting


def test_every_module_fits_the_budget() -> None:
    """No allow-list: a module that outgrows the budget is split by responsibility."""
    over = []
    for package in PACKAGES:
        for path in _modules(package):
            lines = [line.strip() for line in path.read_text().splitlines()]
            n = sum(1 for line in lines if line and not line.startswith("#"))
            if n > MODULE_BUDGET:
                over.append(f"{path.relative_to(ROOT)}: {n}")
    assert not over, f"modules over {MODULE_BUDGET} lines (split them): {over}"


def test_the_distribution_ships_every_package_and_subpackage() -> None:
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(ROOT), include=include))
    present = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for package in set(PACKAGES) - NOT_SHIPPED
        for p in (ROOT / package).rglob("__init__.py")
    }
    assert present <= shipped, f"not in the wheel: {sorted(present - shipped)}"
    assert not {p for p in shipped if p.split(".")[0] in ("tests", "benchmarks", *NOT_SHIPPED)}
