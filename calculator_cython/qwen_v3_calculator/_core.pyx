# cython: language_level=3, boundscheck=False, wraparound=False
"""Native core of qwen_v3_calculator: vocabulary loading and byte-level BPE.

Pure C-level loops over a Python ``dict[bytes, int]`` of BPE ranks (rank == token id for the
Qwen2/2.5/3 vocabulary).  No vLLM, torch or transformers needed.
"""
import base64

from libc.stdlib cimport malloc, free


def load_tiktoken_ranks(path):
    """Read a tiktoken-format BPE file (``base64(token) rank`` per line) into ``{bytes: rank}``."""
    cdef dict ranks = {}
    b64decode = base64.b64decode
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            tok, rank = line.split()
            ranks[b64decode(tok)] = int(rank)
    return ranks


cdef inline long _pair_rank(bytes piece, dict ranks, Py_ssize_t* starts, Py_ssize_t i,
                            Py_ssize_t nparts, long max_rank):
    """Rank of the merge of parts i and i+1 (or -1 when no such token / not allowed)."""
    if i + 2 > nparts:
        return -1
    r = ranks.get(piece[starts[i]:starts[i + 2]])
    if r is None:
        return -1
    cdef long rr = r
    if max_rank >= 0 and rr >= max_rank:
        return -1
    return rr


def bpe_parts(bytes piece, dict ranks, long max_rank=-1):
    """Byte-pair-merge ``piece`` with ``ranks``; return the list of merged byte strings.

    ``max_rank`` (when >= 0) only allows merges into tokens of rank < max_rank: this derives
    the merge list of a rank-ordered vocabulary (the last pair before a token exists).
    Same algorithm as tiktoken's ``_byte_pair_merge``: repeatedly merge the adjacent pair whose
    merged bytes have the lowest rank.
    """
    cdef Py_ssize_t n = len(piece)
    if n == 0:
        return []
    if n == 1:
        return [piece]
    # starts[k] = start offset of part k; starts[nparts] = n
    cdef Py_ssize_t* starts = <Py_ssize_t*> malloc((n + 1) * sizeof(Py_ssize_t))
    cdef long* prank = <long*> malloc(n * sizeof(long))
    cdef Py_ssize_t i, best_i, nparts = n
    cdef long best, r
    if starts == NULL or prank == NULL:
        free(starts); free(prank)
        raise MemoryError()
    try:
        for i in range(n + 1):
            starts[i] = i
        for i in range(n - 1):
            prank[i] = _pair_rank(piece, ranks, starts, i, nparts, max_rank)
        while nparts > 1:
            best = -1
            best_i = -1
            for i in range(nparts - 1):
                r = prank[i]
                if r >= 0 and (best < 0 or r < best):
                    best = r
                    best_i = i
            if best_i < 0:
                break
            # merge part best_i with best_i + 1: drop boundary best_i + 1
            for i in range(best_i + 1, nparts):
                starts[i] = starts[i + 1]
            for i in range(best_i + 1, nparts - 1):
                prank[i] = prank[i + 1]
            nparts -= 1
            prank[best_i] = _pair_rank(piece, ranks, starts, best_i, nparts, max_rank)
            if best_i > 0:
                prank[best_i - 1] = _pair_rank(piece, ranks, starts, best_i - 1, nparts, max_rank)
        return [piece[starts[i]:starts[i + 1]] for i in range(nparts)]
    finally:
        free(starts)
        free(prank)


def bpe_encode(bytes piece, dict ranks):
    """Token ids of one pre-tokenized piece (every single byte is in a byte-level vocabulary)."""
    return [ranks[p] for p in bpe_parts(piece, ranks)]
