"""The layering holds: imports run one way (integration -> capabilities -> store and pure cores), the calculator
imports nothing from the application, and every package ships in the wheel."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "qwen_vllm_ext"
CALCULATOR = ROOT / "calculator_cython" / "qwen_v3_calculator"
CAPABILITIES = ("scheduling", "usage", "gateway", "keys", "kv", "provider", "counting", "sampling")


def module_name(path: Path, package_root: Path, package: str) -> str:
    parts = list(path.relative_to(package_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def imports(path: Path, name: str) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved; lazy imports included; imports
    under ``if TYPE_CHECKING:`` counted too: a name an annotation needs ties the modules as much as a run-time
    import does)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def app_modules():
    for path in sorted(APP.rglob("*.py")):
        yield path, module_name(path, APP, "qwen_vllm_ext")


def test_the_calculator_imports_nothing_from_the_application():
    for path in sorted(CALCULATOR.rglob("*.py")):
        name = module_name(path, CALCULATOR, "qwen_v3_calculator")
        bad = sorted(m for m in imports(path, name) if m == "qwen_vllm_ext" or m.startswith("qwen_vllm_ext."))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("capability", [*CAPABILITIES, "store", "observability", "common"])
def test_capabilities_and_stores_never_import_the_integration_layer(capability):
    forbidden = ("qwen_vllm_ext.integration", "qwen_vllm_ext.plugin", "qwen_vllm_ext.patches",
                 "qwen_vllm_ext.sourcepatch", "qwen_vllm_ext.serve")
    for path, name in app_modules():
        if not name.startswith(f"qwen_vllm_ext.{capability}"):
            continue
        bad = sorted(m for m in imports(path, name) if m.startswith(forbidden))
        assert not bad, f"{name} imports {bad}: imports run integration -> capabilities -> store"


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_get_their_settings_passed_in(capability):
    """Settings are resolved once per process (integration layer, CLIs) and passed as parameters: no capability
    module imports ``qwen_vllm_ext.config`` (a ``__main__`` CLI resolves its own)."""
    for path, name in app_modules():
        if not name.startswith(f"qwen_vllm_ext.{capability}.") or name.endswith("__main__"):
            continue
        bad = sorted(m for m in imports(path, name) if m == "qwen_vllm_ext.config" or m.startswith("qwen_vllm_ext.config."))
        assert not bad, f"{name} imports {bad}: take the settings as a parameter"


@pytest.mark.parametrize("core", ["store", "observability", "common"])
def test_the_store_and_observability_import_no_capability(core):
    for path, name in app_modules():
        if name.startswith(f"qwen_vllm_ext.{core}"):
            bad = sorted(m for m in imports(path, name)
                         if any(m.startswith(f"qwen_vllm_ext.{c}") for c in CAPABILITIES))
            assert not bad, f"{name} imports {bad}"


def import_graph() -> dict[str, set[str]]:
    """Module -> the application modules it imports (packages count as their ``__init__``)."""
    modules = dict((name, path) for path, name in app_modules())
    return {name: {m for m in imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_through_others():
    """No circle in the application's import graph (TYPE_CHECKING imports included): a circle means two modules
    cannot be understood, tested or moved one without the other."""
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_type_checking_imports_count(tmp_path):
    pkg = tmp_path / "qwen_vllm_ext" / "common"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..kv.server import KvState\n")
    assert "qwen_vllm_ext.kv.server" in imports(pkg / "x.py", "qwen_vllm_ext.common.x")


def test_the_resolver_sees_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "qwen_vllm_ext" / "usage"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from ..integration import plugin\n")
    assert "qwen_vllm_ext.integration.plugin" in imports(pkg / "x.py", "qwen_vllm_ext.usage.x")


def test_every_package_ships_in_the_wheel():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(cfg["packages"])
    found = {module_name(p, APP, "qwen_vllm_ext") for p in APP.rglob("__init__.py")}
    assert found <= packages, f"packages missing from pyproject.toml: {sorted(found - packages)}"


def test_the_package_and_the_calculator_need_no_newer_python_than_declared():
    """pyproject says requires-python >= 3.10 (users' vLLM environments run 3.10-3.12): vermin's static analysis
    of every module must find nothing newer (it flagged the launcher's `tomllib` before the tomli fallback). No
    3.10 interpreter can be installed offline on the test machine, so this is a static check."""
    import re
    import subprocess
    import sys

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    target = re.fullmatch(r">=\s*(\d+\.\d+)", declared).group(1)
    vermin = Path(sys.executable).with_name("vermin")  # the console script of the test extra
    proc = subprocess.run([str(vermin), "--no-tips", "--violations", f"-t={target}-",
                           "--eval-annotations", "--backport", "typing", str(APP), str(CALCULATOR)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_package_root_holds_the_public_entry_points_only():
    """Everything else has its package (issue 37): the launcher, the doctor, the demo models, the settings object,
    the plugin entry-point module and ``python -m qwen_vllm_ext --version``."""
    loose = sorted(p.stem for p in APP.glob("*.py"))
    assert loose == ["__init__", "__main__", "config", "demo", "doctor", "plugin", "serve"], loose


def test_no_test_module_imports_a_test_module_or_a_conftest(tmp_path):
    """Test modules share data, clients and servers through tests/helpers/ and tests/e2e/servers.py, never by
    importing a test module (its body runs again under another name, its helpers have no home) or a conftest (fixtures
    and hooks only). Every file under tests/ counts; relative, absolute and lazy imports, and the ``from``/``import``
    lines of the scripts a test hands to a child interpreter (a string) too."""
    import re

    def offenders(root: Path) -> list[str]:
        """``path: module`` for every import under ``root`` (a ``tests`` package) of a test module or a conftest."""
        forbidden = {module_name(p, root, root.name) for p in root.rglob("*.py")
                     if p.name.startswith("test_") or p.name == "conftest.py"}
        found = []
        for path in sorted(root.rglob("*.py")):
            name = module_name(path, root, root.name)
            text = path.read_text(encoding="utf-8")
            in_strings = {m.group(2) for m in re.finditer(r"^\s*(from|import)\s+([\w.]+)", text, re.M)}
            found += [f"{path.relative_to(root.parent)}: {m}" for m in sorted((imports(path, name) | in_strings)
                                                                               & forbidden)]
        return found

    fake = tmp_path / "tests"
    for package in (fake, fake / "unit", fake / "helpers"):
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
    (fake / "conftest.py").write_text("LINES = {}\n")
    (fake / "helpers" / "data.py").write_text("DATA = 1\n")
    (fake / "unit" / "test_a.py").write_text("from ..helpers.data import DATA\nfrom ..conftest import LINES\n"
                                             "def test_x():\n    from . import test_b\n")
    (fake / "unit" / "test_b.py").write_text('CHILD = """\nimport sys\nfrom tests.unit.test_a import DATA\n"""\n')
    assert offenders(fake) == ["tests/unit/test_a.py: tests.conftest", "tests/unit/test_a.py: tests.unit.test_b",
                               "tests/unit/test_b.py: tests.unit.test_a"]
    assert offenders(ROOT / "tests") == [], "move what they share to tests/helpers/ (e2e servers: tests/e2e/servers.py)"
