"""Compatibility guard for runtime patches (pure Python: reads vLLM's source files, never imports vLLM).

A runtime patch declares, for each vLLM function or class it replaces or wraps, the fingerprint that target
had in each vLLM version the patch was written for::

    PATCH_TARGETS = {
        "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": {"0.32.0": "3f0c…", "0.33.0": "3f0c…"},
    }

A fingerprint is the first 16 hex digits of the SHA-256 of the target's syntax tree (``ast.dump`` without
positions, docstrings removed), so comments, blank lines and formatting do not count but any change of code
does. At startup :func:`check_patch` compares the declarations with the vLLM that is actually importable:

* ``ok``       every target matches the fingerprint declared for this vLLM version (or, for a version that is
               not declared, one of the declared fingerprints: the code it wraps did not change);
* ``source``   the vLLM source already carries this capability as a source patch (``patches/``, marked with
               ``qwen-vllm-ext source patch: <name>``): nothing to do at runtime;
* ``mismatch`` a target changed or is missing: the patch must not be applied; ``message`` says which.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

SOURCE_MARK = "qwen-vllm-ext source patch: "
FINGERPRINT_LEN = 16


class RuntimePatch(NamedTuple):
    """One runtime patch as the general plugin applies it (entries of ``plugin.runtime_patches()``)."""

    name: str
    apply: Callable[[Any], bool]  # apply(settings) -> active; idempotent
    roles: set[str]  # process roles where it applies (status.process_role())
    targets: Mapping[str, Mapping[str, str]]  # "vllm.module:Qualified.name" -> {vLLM version: fingerprint}
    setting: str  # the Settings field that turns it on (a boolean, or token_weighted_scheduler's false/true/auto)


class TargetError(LookupError):
    """A declared target does not exist in the given source."""


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            child.body = body[1:] or [ast.Pass()]
    return node


def find_node(tree: ast.Module, qualname: str) -> ast.AST:
    """The class or function ``qualname`` (``Class.method``, ``function``) defined in ``tree``."""
    scope: ast.AST = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(scope, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child  # the last definition wins, as at runtime
        if found is None:
            raise TargetError(f"{qualname} is not defined")
        scope = found
    return scope


def fingerprint_source(source: str, qualname: str) -> str:
    """Fingerprint of ``qualname`` in the module source text ``source``."""
    node = _strip_docstrings(find_node(ast.parse(source), qualname))
    dump = ast.dump(node, annotate_fields=True, include_attributes=False)
    return hashlib.sha256(dump.encode()).hexdigest()[:FINGERPRINT_LEN]


def split_target(target: str) -> tuple[str, str]:
    """``"vllm.a.b:Class.method"`` -> (``"vllm.a.b"``, ``"Class.method"``)."""
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"patch target {target!r} must look like 'package.module:Qualified.name'")
    return module, qualname


def vllm_root() -> Path:
    """Directory of the importable ``vllm`` package (found without importing it; honours PYTHONPATH)."""
    import sys

    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__file__", None):
        return Path(module.__file__).parent
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("vllm is not installed in this Python environment")
    return Path(list(spec.submodule_search_locations)[0])


def module_file(module: str, root: Path) -> Path:
    """Source file of ``vllm.x.y`` under the vllm package directory ``root``."""
    parts = module.split(".")
    if parts[0] != "vllm":
        raise ValueError(f"{module!r} is not a vllm module")
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise TargetError(f"module {module} not found under {root}")


@dataclasses.dataclass(frozen=True)
class TargetCheck:
    target: str
    expected: str | None  # the fingerprint declared for this version (None: version not declared)
    actual: str | None  # None: target missing
    ok: bool
    source_patched: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class PatchCheck:
    name: str
    status: str  # "ok" | "source" | "mismatch"
    targets: tuple[TargetCheck, ...]
    message: str

    @property
    def ok(self) -> bool:
        return self.status != "mismatch"

    def as_dict(self) -> dict:
        return {"status": self.status, "message": self.message,
                "targets": {t.target: {"expected": t.expected, "actual": t.actual, "ok": t.ok}
                            for t in self.targets}}


def base_version(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``."""
    return version.split("+", 1)[0]


def check_target(target: str, declared: Mapping[str, str], version: str, root: Path, patch_name: str,
                 _sources: dict | None = None) -> TargetCheck:
    module, qualname = split_target(target)
    expected = declared.get(base_version(version))
    try:
        path = module_file(module, root)
        cache = _sources if _sources is not None else {}
        if path not in cache:
            cache[path] = path.read_text(encoding="utf-8")
        text = cache[path]
        if SOURCE_MARK + patch_name in text:
            return TargetCheck(target, expected, None, True, True, "source-patched")
        actual = fingerprint_source(text, qualname)
    except (TargetError, OSError, SyntaxError) as exc:
        return TargetCheck(target, expected, None, False, False, str(exc))
    if expected is not None:
        ok = actual == expected
    else:
        ok = actual in set(declared.values())
    return TargetCheck(target, expected, actual, ok, False)


def check_patch(name: str, targets: Mapping[str, Mapping[str, str]], version: str,
                root: Path | None = None) -> PatchCheck:
    """Compare a runtime patch's declared targets with the vLLM sources under ``root`` (default: installed)."""
    root = vllm_root() if root is None else Path(root)
    sources: dict = {}
    checks = tuple(check_target(t, declared, version, root, name, sources) for t, declared in targets.items())
    if not checks:
        return PatchCheck(name, "ok", checks, f"{name}: no declared targets")
    if any(c.source_patched for c in checks):  # the source patch's hook lives in one of the target modules
        return PatchCheck(name, "source", checks, f"{name}: provided by a source patch of vLLM {version}")
    bad = [c for c in checks if not c.ok]
    if not bad:
        return PatchCheck(name, "ok", checks, f"{name}: all {len(checks)} targets match vLLM {version}")
    parts = []
    for c in bad:
        if c.actual is None:
            parts.append(f"{c.target} missing ({c.detail})")
        elif c.expected is not None:
            parts.append(f"{c.target} changed (fingerprint {c.actual}, expected {c.expected})")
        else:
            parts.append(f"{c.target} has fingerprint {c.actual}, none of the declared "
                         f"{sorted(set(targets[c.target].values()))}")
    declared_versions = sorted({v for d in targets.values() for v in d})
    message = (f"runtime patch {name!r} disabled: vLLM {version} differs from what it was written for "
               f"(declared: {', '.join(declared_versions)}): " + "; ".join(parts))
    return PatchCheck(name, "mismatch", checks, message)


def fingerprints_for(targets: list[str], root: Path | None = None) -> dict[str, str]:
    """Current fingerprints of ``targets`` under ``root`` (maintainers: to update the declarations)."""
    root = vllm_root() if root is None else Path(root)
    out = {}
    for target in targets:
        module, qualname = split_target(target)
        out[target] = fingerprint_source(module_file(module, root).read_text(encoding="utf-8"), qualname)
    return out
