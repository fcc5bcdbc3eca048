"""Unit tests of the source-patch machinery (pure: a small fake ``vllm`` tree, no vLLM import)."""
import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from qwen_vllm_ext.sourcepatch import __main__ as cli
from qwen_vllm_ext.sourcepatch import core
from qwen_vllm_ext.sourcepatch.applier import PatchError, apply_file, parse
from qwen_vllm_ext.integration.guard import (SOURCE_MARK, TargetError, check_patch, fingerprint_source,
                                                fingerprints_for)

REPO = Path(__file__).resolve().parents[2]

ORIGINAL = b"".join(f"line {i}\n".encode() for i in range(1, 41))


def _diff(path: str, hunks: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n" + textwrap.dedent(hunks)


# ---- applier ----------------------------------------------------------------------------------------------
def test_apply_and_reverse_restore_the_bytes():
    (fp,) = parse(_diff("vllm/x.py", """\
        @@ -3,3 +3,4 @@
         line 3
        -line 4
        +line four
        +line 4.5
         line 5
        """))
    patched = apply_file(ORIGINAL, fp)
    assert b"line four\nline 4.5\nline 5\n" in patched and b"line 4\n" not in patched
    assert apply_file(patched, fp.reversed()) == ORIGINAL


def test_hunk_found_when_the_file_shifted_but_never_with_different_context():
    (fp,) = parse(_diff("vllm/x.py", """\
        @@ -10,2 +10,3 @@
         line 10
        +inserted
         line 11
        """))
    shifted = b"extra\nextra\n" + ORIGINAL
    assert b"line 10\ninserted\nline 11\n" in apply_file(shifted, fp)
    with pytest.raises(PatchError, match="does not apply"):
        apply_file(ORIGINAL.replace(b"line 11\n", b"line eleven\n"), fp)


def test_end_of_file_without_newline_and_new_files():
    (fp,) = parse(_diff("vllm/x.py", """\
        @@ -1,1 +1,2 @@
        -last
        \\ No newline at end of file
        +last
        +appended
        """))
    assert apply_file(b"last", fp) == b"last\nappended\n"
    new = parse("--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,2 @@\n+a\n+b\n")[0]
    assert new.new_file and apply_file(None, new) == b"a\nb\n"
    with pytest.raises(PatchError, match="already exists"):
        apply_file(b"x", new)


def test_malformed_patches_are_refused():
    with pytest.raises(PatchError, match="no file changes"):
        parse("just text\n")
    with pytest.raises(PatchError, match="truncated hunk"):
        parse(_diff("vllm/x.py", "@@ -1,3 +1,3 @@\n line 1\n"))


# ---- fingerprints -----------------------------------------------------------------------------------------
MODULE = '''
class Config:
    """Doc."""

    def pick(self):
        """Pick one."""
        if self.cls is None:
            return "Scheduler"  # default
        return self.cls


def helper(x):
    return x + 1
'''


def test_fingerprint_ignores_comments_docstrings_and_layout_but_not_code():
    base = fingerprint_source(MODULE, "Config.pick")
    reformatted = MODULE.replace('"""Pick one."""', '"""Pick a scheduler class."""').replace("  # default", "") \
        .replace("        if self.cls is None:", "\n        # explained\n        if (self.cls is None):")
    assert fingerprint_source(reformatted, "Config.pick") == base
    assert fingerprint_source(MODULE.replace('"Scheduler"', '"AsyncScheduler"'), "Config.pick") != base
    assert fingerprint_source(MODULE, "helper") != base and len(base) == 16
    with pytest.raises(TargetError, match="Config.nope is not defined"):
        fingerprint_source(MODULE, "Config.nope")


def _tree(tmp_path: Path, module: str = MODULE, version: str = "0.32.0") -> Path:
    root = tmp_path / "vllm"
    (root / "config").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (root / "config" / "__init__.py").write_text("")
    (root / "config" / "sched.py").write_text(module)
    return root


def test_guard_passes_matching_code_and_names_the_changed_target(tmp_path):
    good = _tree(tmp_path / "good")
    found = fingerprints_for(["vllm.config.sched:Config.pick", "vllm.config.sched:helper"], good)
    targets = {target: {"0.32.0": fingerprint} for target, fingerprint in found.items()}
    assert check_patch("demo_patch", targets, "0.32.0+cpu", good).status == "ok"
    # a version that is not declared passes only while the wrapped code is unchanged
    assert check_patch("demo_patch", targets, "0.32.1", good).status == "ok"

    changed = _tree(tmp_path / "changed", MODULE.replace('"Scheduler"', '"AsyncScheduler"'))
    verdict = check_patch("demo_patch", targets, "0.32.0", changed)
    assert verdict.status == "mismatch" and not verdict.ok
    assert "runtime patch 'demo_patch' disabled" in verdict.message
    assert "vllm.config.sched:Config.pick changed (fingerprint" in verdict.message
    assert "helper" not in verdict.message.split("):", 1)[1]  # only the changed target is named
    assert check_patch("demo_patch", targets, "0.32.1", changed).status == "mismatch"

    missing = _tree(tmp_path / "missing", MODULE.replace("def pick", "def choose"))
    assert "vllm.config.sched:Config.pick missing (Config.pick is not defined)" in \
        check_patch("demo_patch", targets, "0.32.0", missing).message


def test_guard_reports_a_capability_carried_by_a_source_patch(tmp_path):
    marked = _tree(tmp_path, MODULE + f"\n# {SOURCE_MARK}demo_patch\n")
    targets = {"vllm.config.sched:Config.pick": {"0.32.0": "0" * 16}}
    assert check_patch("demo_patch", targets, "0.32.0", marked).status == "source"
    assert check_patch("other_patch", targets, "0.32.0", marked).status == "mismatch"


# ---- core: find, check, apply, revert ---------------------------------------------------------------------
def _patch_dir(tmp_path: Path, version: str = "0.32.0", conflict: bool = False) -> Path:
    base = tmp_path / "sets"
    d = base / f"vllm-{version}"
    d.mkdir(parents=True)
    (d / "0001-first.patch").write_text("Subject: [PATCH] first change\n\n---\n" + _diff("vllm/config/sched.py", """\
        @@ -12,2 +12,3 @@
         def helper(x):
        -    return x + 1
        +    # qwen-vllm-ext source patch: demo
        +    return x + 2
        """))
    (d / "0002-second.patch").write_text(_diff("vllm/__init__.py", """\
        @@ -0,0 +1 @@
        +HOOKED = True
        """) if not conflict else _diff("vllm/config/sched.py", """\
        @@ -1,2 +1,2 @@
         
        -class Absent:
        +class Other:
        """))
    return base


def _hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_apply_is_all_or_nothing_idempotent_and_revert_is_byte_identical(tmp_path, monkeypatch):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    before = _hashes(root)
    patches = core.patch_set("0.32.0")
    assert [p.id for p in patches] == ["0001-first", "0002-second"] and patches[0].summary() == "first change"
    assert core.check(root, patches).ok
    result = core.apply(root, patches, "0.32.0")
    assert result.ok and result.changed == ["vllm/__init__.py", "vllm/config/sched.py"]
    assert "return x + 2" in (root / "config" / "sched.py").read_text()
    assert (root / "__init__.py").read_text() == "HOOKED = True\n"
    assert "already applied" in core.apply(root, patches, "0.32.0").message  # twice: a no-op
    assert "already applied" in core.check(root, patches).message
    assert core.applied_ids(root, patches) == ["0001-first", "0002-second"]
    state = json.loads((root / core.STATE_DIR / "state.json").read_text())
    assert state["patches"] == ["0001-first", "0002-second"] and state["vllm_version"] == "0.32.0"

    (root / "__init__.py").write_text("edited by hand\n")
    with pytest.raises(core.PatchesError, match="changed since the patches were applied: vllm/__init__.py"):
        core.revert(root, patches)
    assert core.revert(root, patches, force=True).ok
    assert _hashes(root) == before and not (root / core.STATE_DIR).exists()
    assert "nothing to do" in core.revert(root, patches).message


def test_another_set_and_a_reinstalled_vllm_are_recognised(tmp_path, monkeypatch):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    pristine = _hashes(root)
    patches = core.patch_set("0.32.0")
    core.apply(root, patches[:1], "0.32.0")
    verdict = core.check(root, patches)
    assert not verdict.ok and "carries another patch set (0001-first); revert it first" in verdict.message
    with pytest.raises(core.PatchesError, match="carries another patch set"):
        core.apply(root, patches, "0.32.0")
    assert "already applied" in core.apply(root, patches[:1], "0.32.0").message
    # vLLM reinstalled over the patched tree: the pristine files are back, the backup record is stale
    (root / "config" / "sched.py").write_bytes((root / core.STATE_DIR / "originals" / "vllm" / "config" /
                                                "sched.py").read_bytes())
    assert core.read_state(root) is None and core.applied_ids(root, patches) == []
    assert "apply cleanly" in core.check(root, patches).message
    assert core.apply(root, patches, "0.32.0").changed == ["vllm/__init__.py", "vllm/config/sched.py"]
    assert core.read_state(root)["patches"] == ["0001-first", "0002-second"]
    core.revert(root, patches)
    assert {k: v for k, v in _hashes(root).items()} == pristine


def test_a_conflicting_patch_changes_nothing(tmp_path, monkeypatch):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path, conflict=True)))
    before = _hashes(root)
    patches = core.patch_set("0.32.0")
    verdict = core.check(root, patches)
    assert not verdict.ok and "0002-second" in verdict.message and "does not apply" in verdict.message
    with pytest.raises(core.PatchesError, match="0002-second: vllm/config/sched.py: hunk 1"):
        core.apply(root, patches, "0.32.0")
    assert _hashes(root) == before  # the first patch was not written either


def test_revert_without_a_backup_reverse_applies(tmp_path, monkeypatch):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    before = _hashes(root)
    patches = core.patch_set("0.32.0")
    core.apply(root, patches, "0.32.0")
    import shutil

    shutil.rmtree(root / core.STATE_DIR)  # e.g. an image built from a patched tree
    assert core.applied_ids(root, patches) == ["0001-first", "0002-second"]
    assert "already applied" in core.check(root, patches).message
    assert "reverse-applied" in core.revert(root, patches).message
    assert _hashes(root) == before


def test_cli_refuses_an_unsupported_version_listing_the_supported_ones(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path / "site", version="0.31.2")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    assert cli.main(["apply", "--vllm-path", str(root.parent)]) == 2
    err = capsys.readouterr().err
    assert "no source patches for vLLM 0.31.2; supported versions: 0.32.0" in err
    assert cli.main(["check", "--vllm-path", str(tmp_path / "nowhere")]) == 2
    assert "is not a vllm package directory" in capsys.readouterr().err
    root32 = _tree(tmp_path / "site32")
    assert cli.main(["apply", "--vllm-path", str(root32), "--only", "0009"]) == 2
    assert "unknown patch(es) 0009; available: 0001-first, 0002-second" in capsys.readouterr().err


def test_cli_round_trip_on_a_fake_tree(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    before = _hashes(root)
    assert cli.main(["check", "--vllm-path", str(root)]) == 0
    assert cli.main(["apply", "--vllm-path", str(root), "--only", "first"]) == 0
    assert "applied 1 patch(es)" in capsys.readouterr().out
    assert cli.main(["list", "--vllm-path", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(p["id"], p["applied"]) for p in listed["patches"]["0.32.0"]] == [("0001-first", True),
                                                                               ("0002-second", False)]
    assert cli.main(["revert", "--vllm-path", str(root)]) == 0
    assert _hashes(root) == before


def test_shipped_patch_sets_are_well_formed():
    """Every shipped patch parses, touches only vllm/ Python files, carries the source-patch marker and only
    inserts lines (vLLM's own code is never removed or altered)."""
    base = REPO / "patches"
    versions = core.supported_versions(base)
    assert {"0.32.0", "0.33.0"} <= set(versions)
    for version in versions:
        patches = core.patch_set(version, base)
        assert [p.name for p in patches] == ["per-chunk-usage", "usage-accounting", "token-weighted-scheduler",
                                             "api-server-hooks", "kv-reuse-template", "turn-checkpoints",
                                             "connection-guard", "cpu-seeded-sampling", "cpu-spec-decode-kernels",
                                             "kv-copies"]
        for patch in patches:
            text = patch.path.read_text()
            assert SOURCE_MARK in text and patch.summary().startswith("qwen-vllm-ext: ")
            for fp in patch.file_patches():
                assert fp.path.startswith("vllm/") and fp.path.endswith(".py") and fp.hunks
                for h in fp.hunks:
                    rest = iter(h.new)
                    assert all(line in rest for line in h.old), (patch.id, fp.path)  # old is a subsequence


def test_symlink_overlay_leaves_the_original_untouched(tmp_path, monkeypatch):
    root = _tree(tmp_path / "site")
    monkeypatch.setenv(core.PATCHES_ENV, str(_patch_dir(tmp_path)))
    before = _hashes(root)
    copy = core.overlay(root, tmp_path / "overlay")
    assert (copy / "config" / "sched.py").is_symlink()
    core.apply(copy, core.patch_set("0.32.0"), "0.32.0")
    assert not (copy / "config" / "sched.py").is_symlink() and "x + 2" in (copy / "config" / "sched.py").read_text()
    assert _hashes(root) == before
    core.revert(copy, core.patch_set("0.32.0"))
    assert _hashes(copy) == before


def test_the_wheel_ships_the_patch_sets():
    """pyproject maps the repository's patches/ to the package ``qwen_vllm_ext.patches.data`` (where
    ``core.patches_dir()`` looks first in an installed wheel) and ships every patch file."""
    import tomllib

    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools_cfg["package-dir"]["qwen_vllm_ext.patches.data"] == "patches"
    assert {"qwen_vllm_ext.patches", "qwen_vllm_ext.patches.data"} <= set(setuptools_cfg["packages"])
    globs = setuptools_cfg["package-data"]["qwen_vllm_ext.patches.data"]
    shipped = {p for g in globs for p in (REPO / "patches").glob(g)}
    assert set((REPO / "patches").glob("vllm-*/*.patch")) <= shipped
    assert core.patches_dir() == REPO / "patches"  # a source checkout / editable install
