"""The package's shape: no import cycles, kernels that take plain arguments, a core without torch.

The import graph is read from the source (ast), with every import a module makes, at its
top or inside a function: an import deferred into a function still ties the two modules
together, and hiding a cycle that way is what this test exists to stop.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"lowvram": ROOT / "lowvram", "lowvram.kernels": ROOT / "kernels", "lowvram.tui": ROOT / "tui"}
CORE_TESTS = ["test_block_manager.py", "test_scheduler.py", "test_controller.py", "test_spill_policy.py"]
CORE_TESTS += ["test_context.py"]


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the lowvram modules it imports (a package's import counts as its __init__)."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module
                targets.update(
                    f"{parent}.{alias.name}" if f"{parent}.{alias.name}" in modules else parent for alias in node.names
                )
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "lowvram.cli" in graph and "lowvram.tui.cli" in graph["lowvram.cli"]  # imported inside a function
    assert "lowvram.core.block_manager" in graph["lowvram.core.scheduler"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_nothing_of_lowvram_but_its_errors():
    """Plain arguments in, tensors out: a kernel module may import other kernels and
    lowvram.errors, nothing of the engine's state or formats."""
    arrows = sorted(
        f"{name} -> {target}"
        for name, targets in import_graph().items()
        if name.startswith("lowvram.kernels")
        for target in targets
        if not target.startswith("lowvram.kernels") and target not in ("lowvram", "lowvram.errors")
    )
    assert arrows == []


def test_lowvram_itself_imports_nothing_heavy():
    """`import lowvram` runs before any part of it: it must not drag in the engine."""
    assert import_graph()["lowvram"] <= {"lowvram.errors", "lowvram.core.sampling_params"}


NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not available here")
        return None

sys.meta_path.insert(0, NoTorch())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_core_runs_its_exact_tests_without_torch():
    tests = [str(ROOT / "tests" / name) for name in CORE_TESTS]
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "-q", "-p", "no:cacheprovider", "--noconftest", *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-500:]


def run_without_torch(statement: str) -> subprocess.CompletedProcess:
    code = NO_TORCH.replace("import pytest\nsys.exit(pytest.main(sys.argv[1:]))", statement)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_blocker_blocks_torch():
    result = run_without_torch("import lowvram.engine.sampler")
    assert result.returncode != 0 and "torch is not available here" in result.stderr


@pytest.mark.parametrize(
    "module",
    [
        "lowvram.core.block_manager",
        "lowvram.core.scheduler",
        "lowvram.core.controller",
        "lowvram.core.spill_policy",
        "lowvram.core.sequence",
        "lowvram.core.context",
    ],
)
def test_each_core_module_imports_without_torch(module):
    result = run_without_torch(f"import {module}")
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_model_runner_sees_pages_only_through_the_scheduled_batch():
    """The runner gets block tables, live tables and free pages in ScheduledBatch; it never
    imports or holds the block manager."""
    from lowvram.engine.model_runner import ModelRunner

    assert "lowvram.core.block_manager" not in import_graph()["lowvram.engine.model_runner"]
    source = (ROOT / "lowvram" / "engine" / "model_runner.py").read_text()
    assert "block_manager" not in source
    assert "block_manager" not in ModelRunner.__init__.__code__.co_varnames


def test_the_command_line_help_needs_no_torch():
    """`lowvram --help` and each command's --help start at once: building the parser imports no torch."""
    statement = "from lowvram.cli import build_parser; build_parser().parse_args(['doctor', '--quick'])"
    result = run_without_torch(statement)
    assert result.returncode == 0, result.stderr[-2000:]
