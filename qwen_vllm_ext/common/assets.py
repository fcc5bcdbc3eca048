"""Public reference files fetched from PyPI at setup/test time (never vendored).

The source distribution of ``llama-cpp-python`` carries, under ``vendor/llama.cpp/models/``, the
official Qwen chat templates and public tokenizer test vectors for both Qwen split rules. We download
that sdist once (pinned version and sha256), extract only the files we use into the cache, and read them
from there; nothing here runs at serving time unless a template is asked for.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import urllib.request
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"

# name -> path inside vendor/llama.cpp/models/
CHAT_TEMPLATES = {
    "qwen2.5": "templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "templates/Qwen-Qwen3-0.6B.jinja",
    "qwen3.5": "templates/Qwen3.5-4B.jinja",
}
TEST_VECTORS = {
    "qwen2": ("ggml-vocab-qwen2.gguf.inp", "ggml-vocab-qwen2.gguf.out"),
    "qwen35": ("ggml-vocab-qwen35.gguf.inp", "ggml-vocab-qwen35.gguf.out"),
}
_MODELS_PREFIX = "vendor/llama.cpp/models/"


class AssetError(RuntimeError):
    pass


def cache_home() -> Path:
    """Root of everything this project caches outside the clone (``QWEN_VLLM_EXT_HOME``)."""
    return Path(os.environ.get("QWEN_VLLM_EXT_HOME", Path.home() / ".cache" / "qwen-vllm-ext"))


def reference_dir() -> Path:
    return cache_home() / "refs" / f"llama.cpp-models-{SDIST_VERSION}"


def _wanted_members() -> set[str]:
    names = set(CHAT_TEMPLATES.values())
    for inp, out in TEST_VECTORS.values():
        names.update((inp, out))
    return {_MODELS_PREFIX + n for n in names}


def _sdist_url() -> str:
    req = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        index = json.load(resp)
    for f in index["files"]:
        if f["filename"] == SDIST_FILE:
            return f["url"]
    raise AssetError(f"{SDIST_FILE} not listed on {SIMPLE_INDEX}")


def fetch_references(force: bool = False) -> Path:
    """Download the pinned sdist (once), verify its sha256, extract the reference files. Idempotent."""
    dest = reference_dir()
    stamp = dest / ".complete"
    if stamp.exists() and not force:
        return dest
    try:
        with urllib.request.urlopen(_sdist_url(), timeout=300) as resp:
            blob = resp.read()
    except OSError as exc:  # URLError is an OSError
        raise AssetError(
            f"could not download {SDIST_FILE} from PyPI ({exc}); the Qwen chat templates and tokenizer "
            f"test vectors come from it. Run scripts/setup.sh on a machine that reaches pypi.org, or copy "
            f"{dest} from one."
        ) from exc
    digest = hashlib.sha256(blob).hexdigest()
    if digest != SDIST_SHA256:
        raise AssetError(f"{SDIST_FILE}: sha256 {digest} != pinned {SDIST_SHA256}")
    wanted = _wanted_members()
    dest.mkdir(parents=True, exist_ok=True)
    found = set()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar:
            rel = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if rel in wanted and member.isfile():
                target = dest / rel[len(_MODELS_PREFIX):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                found.add(rel)
    missing = wanted - found
    if missing:
        raise AssetError(f"{SDIST_FILE} lacks {sorted(missing)}")
    stamp.write_text(SDIST_SHA256 + "\n")
    return dest


def _path(rel: str) -> Path:
    path = reference_dir() / rel
    if not path.exists():
        fetch_references()
    return path


def chat_template(name: str) -> str:
    """Official chat template text: ``qwen2.5``, ``qwen3`` or ``qwen3.5``."""
    if name not in CHAT_TEMPLATES:
        raise KeyError(f"unknown chat template {name!r}; known: {', '.join(CHAT_TEMPLATES)}")
    return _path(CHAT_TEMPLATES[name]).read_text(encoding="utf-8")


def test_vector_paths(name: str) -> tuple[Path, Path]:
    """(input, expected output) files of llama.cpp's tokenizer test vectors: ``qwen2`` or ``qwen35``."""
    inp, out = TEST_VECTORS[name]
    return _path(inp), _path(out)


if __name__ == "__main__":
    print(fetch_references())
