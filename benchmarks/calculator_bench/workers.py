"""Implementations and their measurement, inside the worker subprocesses (one per implementation and trial)."""
from __future__ import annotations

import array
import functools
import gc
import glob
import hashlib
import json
import os
import re
import statistics
import time

from .common import BATCH_DOCS, BATCH_ROUNDS


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


class AddedTokens:
    """The reference pipeline's first steps for a BPE core that has neither (tiktoken, riptoken): split the text on
    the added tokens first (leftmost-longest: longest first in the alternation), then NFC each segment between them
    (``unicodedata.normalize``: *Python's* Unicode tables)."""

    def __init__(self, special: dict[str, int]):
        self.special = special
        self.split = re.compile("(" + "|".join(re.escape(s) for s in sorted(special, key=len, reverse=True))
                                + ")").split
        self.first = {s[0] for s in special}

    def wrap(self, ordinary):
        """-> encode(text): ``ordinary`` (the core's call without special tokens) on each NFC segment, the added
        tokens' ids between them."""
        import unicodedata

        split, nfc, special, firsts = self.split, unicodedata.normalize, self.special, self.first
        first = next(iter(firsts)) if len(firsts) == 1 else None  # Qwen: every added token starts with "<"

        def encode(text: str) -> list[int]:
            if first not in text if first else not any(c in text for c in firsts):  # no added token starts in it
                return ordinary(nfc("NFC", text))
            out: list[int] = []
            for i, part in enumerate(split(text)):
                if i % 2:
                    out.append(special[part])
                elif part:
                    out.extend(ordinary(nfc("NFC", part)))
            return out

        return encode

    def normalize(self, text: str) -> str:
        """``text`` with every segment between added tokens NFC-normalized (added tokens kept): for a core's own
        call that matches the added tokens itself (its batch call)."""
        import unicodedata

        return "".join(part if i % 2 else unicodedata.normalize("NFC", part)
                       for i, part in enumerate(self.split(text)))


def tiktoken_exact(ranks: dict, vocab: str = "qwen3", with_encoding: bool = False):
    """tiktoken configured like the reference pipeline: added tokens split first, NFC per segment, the vocabulary's
    split regex and added tokens. ``with_encoding``: -> (encode, the tiktoken.Encoding, the AddedTokens)."""
    import tiktoken
    from qwen_v3_calculator.tokenizer import SPLIT_RULES
    from qwen_v3_calculator.vocab import ADDED_TOKENS, VOCABULARIES

    v = VOCABULARIES[vocab]
    special = {content: v.num_base + i for i, (content, _) in enumerate(ADDED_TOKENS[vocab])}
    enc = tiktoken.Encoding(vocab, pat_str=SPLIT_RULES[v.split_rule], mergeable_ranks=ranks, special_tokens=special)
    added = AddedTokens(special)
    assert added.first == {"<"}  # every added token starts with "<"
    encode = added.wrap(enc.encode_ordinary)

    # sanity: same output as tiktoken's own allowed_special="all" path on NFC text
    probe = "hi <|im_start|>user\n你好<think>x</think>"
    assert encode(probe) == enc.encode(probe, allowed_special="all"), "tiktoken wrapper disagrees with tiktoken"
    return (encode, enc, added) if with_encoding else encode


def tokenizer_json_config(path: str) -> tuple[str, dict[str, int]]:
    """(split regex, {added token: id}) of a tokenizer.json whose pre-tokenizer is a Split on a regex then
    ByteLevel (Qwen's): what a tiktoken-format core needs besides the ranks."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    pre = tj["pre_tokenizer"]
    steps = pre.get("pretokenizers", [pre])
    regex = next(s["pattern"]["Regex"] for s in steps if s.get("type") == "Split")
    if (tj.get("normalizer") or {}).get("type") not in (None, "NFC"):
        raise ValueError(f"normalizer {tj['normalizer']!r}: only NFC is applied by this wrapper")
    return regex, {t["content"]: t["id"] for t in tj["added_tokens"]}


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
    """-> (kind, callable, info) with kind in per_doc_count | per_doc_ids | per_doc_hf | batch_count | batch_hf
    (``make_batch_impl``: also batch_ids, batch_awkward)."""
    info: dict = {}
    t0 = time.perf_counter()
    if name in PEER_LOADERS:  # the peers (--peers), and ours.encode_fn
        return PEER_LOADERS[name](paths, info, t0, batch=False)
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


# ---- the peers (--peers): each loaded from the files hf_export writes (tokenizer.json; tiktoken-format cores from
# the bundled ranks with tokenizer.json's split regex and added tokens), once for one text at a time and once for
# its own batch call (the all-cores section) --------------------------------------------------------------------------
class NotConfigurable(RuntimeError):
    """The peer is installed but cannot be given the reference's pre-tokenizer, normalizer and added tokens."""


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _loaded(info: dict, t1: float, what: str, kind: str, fn, dist: str | None = None):
    info["load_s"] = time.perf_counter() - t1
    info["load_what"] = what
    if dist:
        info["version"] = _version(dist)
    return kind, fn, info


def _ours(paths, info, t0, batch):
    import qwen_v3_calculator as q
    info["import_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    v = bench_vocab()
    if batch:  # count_tokens_batch for the count row, encode_batch for the encode row (threads: every allowed core)
        fn = functools.partial(q.count_tokens_batch if info["row"] == "ours.count_tokens" else q.encode_batch, model=v)
        fn(["hello"])
        kind = "batch_count" if info["row"] == "ours.count_tokens" else "batch_ids"
        return _loaded(info, t1, f"first qwen_v3_calculator.{fn.func.__name__}(model={v!r}) call", kind, fn)
    fn = functools.partial(q.encode, model=v)
    fn("hello")
    return _loaded(info, t1, f"first qwen_v3_calculator.encode(model={v!r}) call (its default Calculator)",
                   "per_doc_ids", fn)


def _tiktoken(paths, info, t0, batch):
    import tiktoken.load
    from qwen_v3_calculator.vocab import VOCABULARIES
    info["import_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    encode, enc, added = tiktoken_exact(tiktoken.load.load_tiktoken_bpe(VOCABULARIES[bench_vocab()].path),
                                        bench_vocab(), with_encoding=True)
    encode("hello")
    # (batch only: one text at a time is make_impl's "tiktoken") tiktoken's own batch call: a thread pool over
    # encode, which matches the added tokens itself, on the texts with NFC segments
    threads, norm = len(os.sched_getaffinity(0)), added.normalize

    def fn(texts):
        return enc.encode_batch([norm(t) for t in texts], num_threads=threads, allowed_special="all")
    return _loaded(info, t1, "load_tiktoken_bpe + tiktoken.Encoding + first encode", "batch_ids", fn, "tiktoken")


def _hf_like(module: str, loader: str, dist: str):
    """Loader of a peer with HF's API (``Tokenizer.<loader>(tokenizer.json)``, ``encode``, ``encode_batch``)."""
    def load(paths, info, t0, batch):
        import importlib
        tokenizer_cls = importlib.import_module(module).Tokenizer
        info["import_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        tok = getattr(tokenizer_cls, loader)(paths["tokenizer_json"])
        tok.encode("hello")
        return _loaded(info, t1, f"{module}.Tokenizer.{loader}(tokenizer.json) + first encode",
                       "batch_hf" if batch else "per_doc_hf", tok.encode_batch if batch else tok.encode, dist)
    return load


_hf = _hf_like("tokenizers", "from_file", "tokenizers")
_fastokens = _hf_like("fastokens", "from_file", "fastokens")
_tokie = _hf_like("tokie", "from_json", "tokie")


def _gigatoken(paths, info, t0, batch):
    import gigatoken
    info["import_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    tok = gigatoken.Tokenizer(paths["tokenizer_json"])
    tok.encode("hello")
    if batch:
        fn = functools.partial(tok.encode_batch, parallel=True)
        return _loaded(info, t1, "gigatoken.Tokenizer(tokenizer.json) + first encode", "batch_awkward", fn,
                       "gigatoken")
    return _loaded(info, t1, "gigatoken.Tokenizer(tokenizer.json) + first encode", "per_doc_ids", tok.encode,
                   "gigatoken")


def _riptoken(paths, info, t0, batch):
    import riptoken
    from qwen_v3_calculator.vocab import VOCABULARIES
    info["import_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    regex, special = tokenizer_json_config(paths["tokenizer_json"])
    core = riptoken.CoreBPE(riptoken.load_tiktoken_bpe(VOCABULARIES[bench_vocab()].path), special, regex)
    added = AddedTokens(special)
    encode = added.wrap(core.encode_ordinary)
    encode("hello")
    what = "riptoken.load_tiktoken_bpe + CoreBPE(ranks, added tokens, split regex) + first encode"
    if batch:
        allowed, norm = set(special), added.normalize

        def fn(texts):
            return core.encode_batch([norm(t) for t in texts], allowed)
        return _loaded(info, t1, what, "batch_ids", fn, "riptoken")
    return _loaded(info, t1, what, "per_doc_ids", encode, "riptoken")


def _bpe_qwen(paths, info, t0, batch):
    mod, how = _load_bpe_qwen()
    info["import_s"] = time.perf_counter() - t0
    info["import_how"] = how
    t1 = time.perf_counter()
    tok = mod.QwenTokenizer(paths["tokenizer_dir"])
    tok.encode("hello")
    what = "bpe_qwen.QwenTokenizer(dir with vocab.json/merges.txt) + first encode"
    if batch:
        fn = functools.partial(tok.encode_batch_parallel, num_workers=len(os.sched_getaffinity(0)))
        return _loaded(info, t1, what, "batch_ids", fn, "bpe-qwen")
    return _loaded(info, t1, what, "per_doc_ids", tok.encode, "bpe-qwen")


def _runtoken(paths, info, t0, batch):
    import inspect

    import runtoken  # ImportError when not installed: the parent reports pip's reason
    info["import_s"] = time.perf_counter() - t0
    try:
        params = set(inspect.signature(runtoken.Tokenizer).parameters)
    except (TypeError, ValueError):  # a compiled class without a signature
        params = set((runtoken.Tokenizer.__text_signature__ or "").replace("(", ",").replace(")", ",").split(","))
    if not params & {"pattern", "pat_str", "regex", "split_regex"}:
        raise NotConfigurable(f"runtoken {_version('runtoken')}: Tokenizer{sorted(params)} takes an encoding name, "
                              "which picks its split regex (cl100k_base, o200k_base, p50k_base): Qwen's "
                              "pre-tokenizer, NFC and added tokens cannot be set")
    raise NotConfigurable(f"runtoken {_version('runtoken')} takes a split regex ({sorted(params)}): not wired up "
                          "here yet")


PEER_LOADERS = {"ours.encode_fn": _ours, "fastokens": _fastokens, "gigatoken": _gigatoken, "riptoken": _riptoken,
                "tokie": _tokie, "runtoken": _runtoken}
BATCH_LOADERS = {"ours.count_tokens": _ours, "ours.encode_fn": _ours, "tiktoken": _tiktoken, "hf.encode": _hf,
                 "fastokens": _fastokens, "gigatoken": _gigatoken, "riptoken": _riptoken, "tokie": _tokie,
                 "bpe-qwen": _bpe_qwen}


def make_batch_impl(name: str, paths: dict):
    """-> (kind, callable over a list of texts, info): the implementation's own batch/parallel call, on every core
    this process may use (the all-cores section)."""
    if name not in BATCH_LOADERS:
        raise NotConfigurable(f"{name} has no batch call here")
    info: dict = {"row": name}
    return BATCH_LOADERS[name](paths, info, time.perf_counter(), batch=True)


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


def _ids_of(kind: str, out) -> list | None:
    """Each text's ids (a list, or an array of uint32) from a pass's outputs; None for a count-only call."""
    if kind in ("per_doc_ids", "batch_ids"):
        return out
    if kind in ("per_doc_hf", "batch_hf"):  # Encoding objects (HF tokenizers, fastokens, tokie)
        return [e.ids for e in out]
    if kind == "batch_awkward":  # gigatoken's batch: one awkward array, a row per text
        import awkward as ak
        import numpy as np
        flat = ak.to_numpy(ak.flatten(out)).astype(np.uint32, copy=False)
        ends = np.cumsum(ak.to_numpy(ak.num(out)))
        return np.split(flat, ends[:-1]) if len(ends) else []
    return None


def _ids_bytes(ids) -> bytes:
    if isinstance(ids, list):
        return array.array("I", ids).tobytes()
    if hasattr(ids, "dtype"):  # numpy
        return ids.astype("uint32", copy=False).tobytes()
    return array.array("I", list(ids)).tobytes()


def _hash_ids(ids) -> int:
    """64-bit digest of one text's ids (blake2b): compares outputs of passes, trials and processes."""
    return int.from_bytes(hashlib.blake2b(_ids_bytes(ids), digest_size=8).digest(), "little")


def write_ids(prefix: str, seqs) -> None:
    """Every text's ids, in order: ``prefix.ids`` (uint32, concatenated) and ``prefix.off`` (uint64, n + 1
    offsets into it). Read back with :func:`read_ids`."""
    off = array.array("Q", [0])
    with open(prefix + ".ids", "wb") as f:
        n = 0
        for ids in seqs:
            b = _ids_bytes(ids)
            f.write(b)
            n += len(b) // 4
            off.append(n)
    with open(prefix + ".off", "wb") as f:
        off.tofile(f)


def read_ids(prefix: str) -> tuple[array.array, array.array]:
    """-> (offsets, ids) as written by :func:`write_ids`: text i's ids are ``ids[offsets[i]:offsets[i + 1]]``."""
    off, ids = array.array("Q"), array.array("I")
    with open(prefix + ".off", "rb") as f:
        off.frombytes(f.read())
    with open(prefix + ".ids", "rb") as f:
        ids.frombytes(f.read())
    return off, ids


def _outputs(kind: str, out) -> tuple[list[int], list[int] | None, list | None]:
    """-> (counts, digests or None, ids or None) of a pass's outputs."""
    ids = _ids_of(kind, out)
    if ids is None:
        return list(out), None, None
    return [len(x) for x in ids], [_hash_ids(x) for x in ids], ids


def worker(args) -> None:
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)
    paths = corpus["paths"]
    gc.collect()
    rss0 = _rss_kb()
    hwm_ok = _reset_hwm()
    res: dict = {"impl": args.worker, "pid": os.getpid(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
                 "slices": {}}
    allcores = args.slices == "@allcores"
    if allcores and args.cpus:  # before anything starts a thread pool: every core the run may use
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        res["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    try:
        kind, fn, info = (make_batch_impl if allcores else make_impl)(args.worker, paths)
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
    if allcores:
        res["allcores"] = allcores_worker(kind, fn, corpus, args)
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
    verify = getattr(args, "verify", False)  # --peers: every warm pass's outputs checked against the first's
    ids_dir = getattr(args, "ids_dir", "")     # --peers: the first pass's ids written for the parent to check
    for sl in args.slices.split(","):
        docs = corpus["slices"][sl]
        gc.collect()
        gc.disable()
        same = True
        try:
            c1, t1, out = _run_pass(kind, fn, docs)  # first pass: text this process has not seen
            counts, hashes, ids = _outputs(kind, out)
            reps = []
            for _ in range(max(0, args.passes - 1)):
                c, t, rep = _run_pass(kind, fn, docs)
                reps.append((c, t))
                if verify:  # outside the timed call, before the next one
                    same = same and _outputs(kind, rep)[:2] == (counts, hashes)
                del rep
        except Exception as exc:
            gc.enable()
            res["slices"][sl] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        gc.enable()
        res["slices"][sl] = {"first_cpu_s": c1, "first_wall_s": t1, "repeat_cpu_s": [r[0] for r in reps],
                             "repeat_wall_s": [r[1] for r in reps], "counts": counts, "hashes": hashes}
        if verify:
            res["slices"][sl]["warm_same"] = same
        if ids_dir and ids is not None:
            res["slices"][sl]["ids"] = prefix = os.path.join(ids_dir, f"{args.worker}-{sl}")
            write_ids(prefix, ids)
        del out, ids
    _dump(args.out, res)


def allcores_worker(kind: str, fn, corpus: dict, args) -> dict:
    """The implementation's own batch call on every core this (unpinned) process may use, by wall clock, over the
    chat messages, the 16 long documents (``batch_inputs``) and the multi-turn requests: the first call over each
    workload (cold: this process has only seen the warm-up) and ``args.passes - 1`` more (warm: the best of them),
    every call's outputs checked against the first's, the first's ids written for the parent to check."""
    cores = sorted(os.sched_getaffinity(0))
    workloads = batch_inputs(corpus)
    if corpus["slices"].get("multiturn"):
        workloads["multiturn"] = corpus["slices"]["multiturn"]
    out: dict = {"cores": cores, "workloads": {}}
    for name, texts in workloads.items():
        w: dict = {"texts": len(texts), "bytes": sum(len(t.encode("utf-8")) for t in texts)}
        gc.collect()
        gc.disable()
        try:
            c1, t1, first = _run_pass(kind, fn, texts)
            counts, hashes, ids = _outputs(kind, first)
            warm, same = [], True
            for _ in range(max(0, args.passes - 1)):
                c, t, rep = _run_pass(kind, fn, texts)
                warm.append((c, t))
                same = same and _outputs(kind, rep)[:2] == (counts, hashes)
                del rep
        except Exception as exc:
            gc.enable()
            w["error"] = f"{type(exc).__name__}: {exc}"
            out["workloads"][name] = w
            continue
        gc.enable()
        w.update(cold_wall_s=t1, cold_cpu_s=c1, warm_wall_s=[t for _, t in warm], warm_cpu_s=[c for c, _ in warm],
                 counts=counts, hashes=hashes, warm_same=same)
        if getattr(args, "ids_dir", "") and ids is not None:
            w["ids"] = prefix = os.path.join(args.ids_dir, f"{args.worker}-allcores-{name}")
            write_ids(prefix, ids)
        out["workloads"][name] = w
        del first, ids
    return out


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
