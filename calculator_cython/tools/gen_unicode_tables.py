"""Generate ``qwen_v3_calculator/data/unicode_tables.json`` by probing the reference (HF ``tokenizers``).

The exact tokenizer must reproduce HF ``tokenizers`` bit for bit, so its Unicode tables are not taken
from Python's ``unicodedata`` or the PyPI ``regex`` module (both use newer / different Unicode data):

* regex classes ``\\p{L}``, ``\\p{N}``, ``\\p{M}``, ``\\s`` and the case-insensitive letters of the
  contraction alternatives are read off the reference's own regex engine (Oniguruma) by splitting a
  string of every Unicode scalar value;
* NFC: start from ``unicodedata`` (ccc, canonical decompositions, compositions), find the code points
  the reference's older normalization data does not know (they behave as unassigned: ccc 0, no
  decomposition, no composition) by probing ``tokenizers.normalizers.NFC``, drop them, then validate
  the resulting model against the reference on every single code point, every ordered pair of
  non-starters and every composition pair (with and without intervening marks).  Any mismatch aborts.

Run: ``python calculator_cython/tools/gen_unicode_tables.py`` (needs ``tokenizers``; a few seconds).
"""
from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import tokenizers
from tokenizers import Regex, normalizers, pre_tokenizers

OUT = Path(__file__).resolve().parents[1] / "qwen_v3_calculator" / "data" / "unicode_tables.json"
MAXCP = 0x110000
SCALARS = [c for c in range(MAXCP) if not 0xD800 <= c < 0xE000]
SBASE, LBASE, VBASE, TBASE, LCOUNT, VCOUNT, TCOUNT = 0xAC00, 0x1100, 0x1161, 0x11A7, 19, 21, 28
NCOUNT, SCOUNT = VCOUNT * TCOUNT, LCOUNT * VCOUNT * TCOUNT
CONTRACTION_LETTERS = "strevmld"


def ranges(cps):
    out = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def probe_class(pattern: str) -> set[int]:
    """Code points matched (one at a time) by ``pattern`` in the reference's regex engine."""
    text = "".join(map(chr, SCALARS))
    split = pre_tokenizers.Split(Regex(pattern), "removed")
    kept = set()
    for _, (a, b) in split.pre_tokenize_str(text):
        kept.update(ord(ch) for ch in text[a:b])
    return set(SCALARS) - kept


# ---------------------------------------------------------------- NFC model
class NFCModel:
    def __init__(self, unknown: set[int]):
        self.ccc, self.decomp, self.comp = {}, {}, {}
        for c in SCALARS:
            if c in unknown:
                continue
            ch = chr(c)
            v = unicodedata.combining(ch)
            if v:
                self.ccc[c] = v
            d = unicodedata.decomposition(ch)
            if d and not d.startswith("<") and not SBASE <= c < SBASE + SCOUNT:
                self.decomp[c] = [int(x, 16) for x in d.split()]
        # compositions: canonical pair decompositions that are not excluded / singletons / non-starter
        for c, d in self.decomp.items():
            if len(d) == 2 and self.ccc.get(c, 0) == 0 and self.ccc.get(d[0], 0) == 0 \
                    and unicodedata.normalize("NFC", unicodedata.normalize("NFD", chr(c))) == chr(c):
                self.comp[(d[0], d[1])] = c
        # full (recursive) decompositions
        full = {}
        for c in self.decomp:
            full[c] = self._full(c)
        self.full = full

    def _full(self, c):
        if c not in self.decomp:
            return [c]
        return [x for p in self.decomp[c] for x in self._full(p)]

    def nfc(self, s: str) -> str:
        cps = []
        for ch in s:
            c = ord(ch)
            if SBASE <= c < SBASE + SCOUNT:
                i = c - SBASE
                cps.append(LBASE + i // NCOUNT)
                cps.append(VBASE + (i % NCOUNT) // TCOUNT)
                if i % TCOUNT:
                    cps.append(TBASE + i % TCOUNT)
            else:
                cps.extend(self.full.get(c, [c]))
        # canonical ordering (stable)
        i, n = 0, len(cps)
        while i < n:
            if self.ccc.get(cps[i], 0) == 0:
                i += 1
                continue
            j = i
            while j < n and self.ccc.get(cps[j], 0) != 0:
                j += 1
            cps[i:j] = sorted(cps[i:j], key=lambda x: self.ccc[x])
            i = j
        # composition
        out, starter, last = [], -1, 0
        for c in cps:
            cc = self.ccc.get(c, 0)
            comp = self._compose(out[starter], c) if starter >= 0 else None
            if comp is not None and (last < cc or last == 0):
                out[starter] = comp
                continue
            if cc == 0:
                starter = len(out)
            last = cc
            out.append(c)
        return "".join(map(chr, out))

    def _compose(self, a, b):
        if LBASE <= a < LBASE + LCOUNT and VBASE <= b < VBASE + VCOUNT:
            return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT
        if SBASE <= a < SBASE + SCOUNT and (a - SBASE) % TCOUNT == 0 and TBASE < b < TBASE + TCOUNT:
            return a + (b - TBASE)
        return self.comp.get((a, b))


def ref_nfc_many(strings, sep="\x00|\x00"):
    """Reference NFC of many short strings in one call (separator is a composition barrier)."""
    norm = normalizers.NFC()
    out = norm.normalize_str(sep.join(strings)).split(sep)
    assert len(out) == len(strings)
    return out


def find_unknown() -> set[int]:
    """Code points whose normalization properties the reference does not have."""
    unknown = set()
    # non-starters: does the reference reorder them before a ccc-240 mark (U+0345)?
    marks = [c for c in SCALARS if unicodedata.combining(chr(c)) and unicodedata.combining(chr(c)) < 240]
    probes = ["\u0345" + chr(c) for c in marks]
    py = [unicodedata.normalize("NFC", p) for p in probes]
    for c, r, p in zip(marks, ref_nfc_many(probes), py):
        if r != p:
            unknown.add(c)
    # canonical decompositions: the code point alone, and its decomposition
    decomposable = [c for c in SCALARS if unicodedata.decomposition(chr(c))
                    and not unicodedata.decomposition(chr(c)).startswith("<")]
    for form in ("self", "nfd"):
        probes = [chr(c) if form == "self" else unicodedata.normalize("NFD", chr(c)) for c in decomposable]
        for c, r, p in zip(decomposable, ref_nfc_many(probes), probes):
            if r != unicodedata.normalize("NFC", p):
                unknown.add(c)
    return unknown


def validate(model: NFCModel) -> list:
    bad = []

    def check(probes):
        for p, r in zip(probes, ref_nfc_many(probes)):
            if model.nfc(p) != r:
                bad.append(p)

    check([chr(c) for c in SCALARS])
    check(["a" + chr(c) + "\u0301" for c in SCALARS])
    nonstarters = sorted(set(model.ccc) | {c for c in SCALARS if unicodedata.combining(chr(c))})
    check(["\u0001" + chr(a) + chr(b) for a in nonstarters for b in nonstarters])
    pairs = [(a, b) for c, d in model.decomp.items() if len(d) == 2 for a, b in [d]]
    pairs += [(a, b) for a, b in (tuple(unicodedata.decomposition(chr(c)).split()) for c in SCALARS
              if unicodedata.decomposition(chr(c)).count(" ") == 1
              and not unicodedata.decomposition(chr(c)).startswith("<")) for a, b in [(int(a, 16), int(b, 16))]]
    mids = ["", "\u0316", "\u0301", "\u0334", "\u05b0", "\u0345", "\u093c", "\u1dff"]
    check([chr(a) + m + chr(b) for a, b in pairs for m in mids])
    check([chr(a) + chr(b) + m for a, b in pairs for m in mids])
    # Hangul
    check([chr(LBASE + l) + chr(VBASE + v) + chr(TBASE + t) for l in range(LCOUNT) for v in range(VCOUNT)
           for t in range(TCOUNT)])
    check([chr(SBASE + s) + chr(TBASE + t) for s in range(0, SCOUNT, 7) for t in range(TCOUNT + 1)])
    return bad


def main() -> int:
    classes = {name: ranges(probe_class(pat)) for name, pat in
               (("L", r"\p{L}"), ("N", r"\p{N}"), ("M", r"\p{M}"), ("WS", r"\s"))}
    ci = {}
    for letter in CONTRACTION_LETTERS:
        ci[letter] = sorted(probe_class(f"(?i:{letter})"))
    unknown = find_unknown()
    model = NFCModel(unknown)
    bad = validate(model)
    if bad:
        print(f"NFC model disagrees with the reference on {len(bad)} probes, e.g. "
              f"{[p.encode('unicode_escape') for p in bad[:10]]}", file=sys.stderr)
        return 1
    ccc_ranges = []
    for c in sorted(model.ccc):
        v = model.ccc[c]
        if ccc_ranges and ccc_ranges[-1][1] == c - 1 and ccc_ranges[-1][2] == v:
            ccc_ranges[-1][1] = c
        else:
            ccc_ranges.append([c, c, v])
    data = {
        "about": "Generated by calculator_cython/tools/gen_unicode_tables.py by probing HF tokenizers "
                 f"{tokenizers.__version__} (Python unicodedata {unicodedata.unidata_version} as the "
                 "starting point for NFC). Ranges are inclusive.",
        "unknown_to_reference_nfc": ranges(unknown),
        **classes,
        "CI": ci,
        "ccc": ccc_ranges,
        "decomp": [[c, model.full[c]] for c in sorted(model.full)],
        "comp": sorted([a, b, c] for (a, b), c in model.comp.items()),
    }
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); unknown-to-reference NFC code points: {len(unknown)}; "
          + ", ".join(f"{k}: {len(v)} ranges" for k, v in classes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
