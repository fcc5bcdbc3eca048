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


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (annotations only: no import at run time)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for stmt in node.body:
                out |= {id(n) for n in ast.walk(stmt)}
    return out


def imports(path: Path, name: str) -> set[str]:
    """Absolute names of every module ``path`` imports at run time (relative imports resolved; lazy imports
    included; ``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    typing_only = _type_checking_only(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
