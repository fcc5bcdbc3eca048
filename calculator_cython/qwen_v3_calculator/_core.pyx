# cython: language_level=3, boundscheck=False, wraparound=False
"""Native core of qwen_v3_calculator: the tokenization engine (:class:`Engine`).

The engine holds a vocabulary's BPE ranks in C tables and runs the whole pipeline in C-level loops: added-token
splitting, NFC (with the reference's Unicode tables, :func:`init_unicode_tables`), the Qwen pre-tokenizer split
rules and byte-level BPE, with caches of whole pieces. Vocabulary files are read in Python
(:mod:`qwen_v3_calculator.vocab`); no vLLM, torch or transformers needed.
"""
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memcmp, memset, memmove, memchr

import os
import threading
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t, uint64_t, int64_t, INT32_MAX, UINT64_MAX

from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM

cdef extern from "Python.h":          # on borrowed references: no reference counting in _Batch's loop
    bint PyUnicode_Check(PyObject* o) noexcept
    int PyUnicode_READY(PyObject* o) noexcept      # -1: failed, with an exception set
    int PyUnicode_KIND(PyObject* o) noexcept
    void* PyUnicode_DATA(PyObject* o) noexcept
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject* o) noexcept
    bint PyUnicode_IS_ASCII(PyObject* o) noexcept

cdef extern from *:
    """
    #define QV3_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    #define QV3_LITTLE 1
    #else
    #define QV3_LITTLE 0
    #endif
    #define QV3_UNLIKELY(x) __builtin_expect(!!(x), 0)
    /* UCS-2 code units u[0:n] to UTF-8 at o + *m up to the first that is not NFC-safe or is a surrogate (stop: a
       bit per BMP code point); returns how many it converted and advances *m. The common case of _text's loop
       in a few instructions per character, with no table larger than 8 KiB. */
    static inline Py_ssize_t qv3_ucs2_run(const uint16_t* u, Py_ssize_t n, uint8_t* o, Py_ssize_t* m,
                                          const uint8_t* stop) {
        Py_ssize_t k = 0, mm = *m;
        for (; k < n; k++) {
            uint32_t c = u[k];
            if (c < 0x80) {
                o[mm++] = (uint8_t) c;
                continue;
            }
            if ((stop[c >> 3] >> (c & 7)) & 1)
                break;
            if (c < 0x800) {
                o[mm] = (uint8_t) (0xC0 | (c >> 6));
                o[mm + 1] = (uint8_t) (0x80 | (c & 0x3F));
                mm += 2;
            } else {
                o[mm] = (uint8_t) (0xE0 | (c >> 12));
                o[mm + 1] = (uint8_t) (0x80 | ((c >> 6) & 0x3F));
                o[mm + 2] = (uint8_t) (0x80 | (c & 0x3F));
                mm += 3;
            }
        }
        *m = mm;
        return k;
    }
    /* Index of the lowest of rk[0:n] (the leftmost on ties) and, in *best, its value: rank and index packed in
       one word, so the loop is a compare and a conditional move per entry (no branch to mispredict). */
    static inline int qv3_argmin(const int32_t* rk, int n, int32_t* best) {
        uint64_t b = UINT64_MAX, v;
        for (int k = 0; k < n; k++) {
            v = ((uint64_t) (uint32_t) rk[k] << 32) | (uint32_t) k;
            b = v < b ? v : b;
        }
        *best = (int32_t) (b >> 32);
        return (int) (uint32_t) b;
    }
    #include <stdint.h>
    #include <string.h>
    #include <time.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* _load3 of 2..8 bytes at p in one unaligned read, when 8 bytes may be read at p (end: the end of the
       buffer). Same words as _load3 (zero-padded little-endian); little-endian only. Returns 0 when it cannot. */
    static inline int qv3_load_short(const unsigned char* p, Py_ssize_t n, const unsigned char* end,
                                     unsigned long long* w) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        unsigned long long a;
        if (n <= 8 && end - p >= 8) {
            memcpy(&a, p, 8);
            w[0] = a & (~0ULL >> (64 - 8 * n));
            w[1] = 0;
            w[2] = 0;
            return 1;
        }
    #endif
        (void) p; (void) n; (void) end; (void) w;
        return 0;
    }
    /* Length of the run of ASCII letters [A-Za-z] at s[0:n], eight bytes per step: a byte is a letter when
       its high bit is clear and (byte | 0x20) is in 0x61..0x7A (no carry crosses a byte: (b & 0x7F) + 0x1F
       <= 0x9E). Little-endian only (the first byte is the lowest); elsewhere 0, and the caller's byte loop
       does all the work. */
    static inline Py_ssize_t qv3_ascii_letters(const unsigned char* s, Py_ssize_t n) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        const unsigned long long H = 0x8080808080808080ULL, L7 = 0x7F7F7F7F7F7F7F7FULL;
        Py_ssize_t j = 0;
        unsigned long long x, y, bad;
        while (j + 8 <= n) {
            memcpy(&x, s + j, 8);
            y = (x | 0x2020202020202020ULL) & L7;
            bad = ~(((y + 0x1F1F1F1F1F1F1F1FULL) & ~(y + 0x0505050505050505ULL) & ~x) & H) & H;
            if (bad) return j + (__builtin_ctzll(bad) >> 3);
            j += 8;
        }
        return j;
    #else
        (void) s; (void) n;
        return 0;
    #endif
    }
    /* The split scanner's pieces of ASCII text, 64 bytes at a time, with no branch per piece: the bytes'
       classes as bit masks (bit k: s[k]), then where the Qwen pattern starts a piece, from the masks alone.
       Text from a piece start splits the same whatever came before it (the pattern has no look-behind), so
       bit 0 is a start and the byte before it counts as nothing. Classes (checked against the Unicode tables
       when they load: qv3_ascii_classes_ok): L letters, D digits, W whitespace (\t..\r, space), R CR/LF,
       SP the space, P everything else, Q the apostrophe. Where a piece starts (the scalar scanner's rules):
       - every digit (\p{N}: a piece of its own);
       - a run of letters, unless the byte before it is whitespace other than CR/LF, or a lone P not after a
         space (both are a piece's first byte, [^\r\n\p{L}\p{N}]?\p{L}+); a lone apostrophe so placed starts a
         contraction ('s 't 'm 'd 're 've 'll, any case), after which a piece starts;
       - a run of P, unless after a space (" ?[^\s\p{L}\p{N}]+"); the CR/LFs right after it belong to it;
       - whitespace not so taken: the start of its run; after its last CR/LF (\s*[\r\n]+); and, when at least
         two bytes follow that last CR/LF (or the run's start), its last byte (\s+(?!\S)), unless the run
         ends the text.
       A start near the window's end may depend on bytes after it: unless the window ends the text
       (end_text), only starts up to the first byte of the last run (a run of one class, or a digit) are
       certain. Returns cut, the last certain start (0: not one whole piece is certain), with *b the starts
       (bit 0 always). The window holds the ASCII bytes up to 64, the first non-ASCII byte or avail (then not
       the text's end); when end_text, every piece in it is whole and cut is its length. */
    static int qv3_ascii_classes_ok = 0;
    static int qv3_portable = 0;    /* 1: the portable loops, as on a CPU without SSE2 (tests run both) */
    static inline int qv3_ascii_pieces(const uint8_t* s, Py_ssize_t avail, int end_text, uint64_t* b) {
        uint64_t L = 0, D = 0, W = 0, R = 0, SP = 0, Q = 0, H = 0, V, P;
        uint8_t buf[64];
        const uint8_t* t = s;
        int m, k;
        if (avail < 64) {
            memset(buf, 0, 64);
            memcpy(buf, s, (size_t) avail);
            t = buf;
        }
    #if defined(__SSE2__)
        if (!qv3_portable)
        {
            const __m128i c20 = _mm_set1_epi8(0x20), lb = _mm_set1_epi8(0x1F), ll = _mm_set1_epi8(-102);
            const __m128i db = _mm_set1_epi8(0x50), dl = _mm_set1_epi8(-118);
            const __m128i wb = _mm_set1_epi8(0x77), wl = _mm_set1_epi8(-123);
            const __m128i lf = _mm_set1_epi8(10), cr = _mm_set1_epi8(13), ap = _mm_set1_epi8(0x27);
            for (k = 0; k < 4; k++) {
                __m128i v = _mm_loadu_si128((const __m128i*) (t + 16 * k));
                __m128i sp = _mm_cmpeq_epi8(v, c20);
                uint64_t sh = 16 * (uint64_t) k;
                H |= (uint64_t) (uint32_t) _mm_movemask_epi8(v) << sh;
                L |= (uint64_t) (uint32_t) _mm_movemask_epi8(_mm_cmplt_epi8(_mm_add_epi8(_mm_or_si128(v, c20), lb), ll)) << sh;
                D |= (uint64_t) (uint32_t) _mm_movemask_epi8(_mm_cmplt_epi8(_mm_add_epi8(v, db), dl)) << sh;
                W |= (uint64_t) (uint32_t) _mm_movemask_epi8(_mm_or_si128(_mm_cmplt_epi8(_mm_add_epi8(v, wb), wl), sp)) << sh;
                R |= (uint64_t) (uint32_t) _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(v, lf), _mm_cmpeq_epi8(v, cr))) << sh;
                SP |= (uint64_t) (uint32_t) _mm_movemask_epi8(sp) << sh;
                Q |= (uint64_t) (uint32_t) _mm_movemask_epi8(_mm_cmpeq_epi8(v, ap)) << sh;
            }
        }
        else
    #endif
        for (k = 0; k < 64; k++) {
            uint8_t c = t[k], lc = c | 0x20;
            uint64_t bit = 1ULL << k;
            if (c >= 0x80) H |= bit;
            if (lc >= 'a' && lc <= 'z') L |= bit;
            if (c >= '0' && c <= '9') D |= bit;
            if ((c >= 9 && c <= 13) || c == 32) W |= bit;
            if (c == 10 || c == 13) R |= bit;
            if (c == 32) SP |= bit;
            if (c == 0x27) Q |= bit;
        }
        m = (int) (avail < 64 ? avail : 64);
        if (H) {
            k = __builtin_ctzll(H);
            if (k < m) { m = k; end_text = 0; }
        }
        if (m == 0) return 0;
        V = m == 64 ? ~0ULL : (1ULL << m) - 1;
        L &= V; D &= V; W &= V; R &= V; SP &= V; Q &= V;
        P = V & ~(L | D | W);
        {
            uint64_t P1 = P & ~(P << 1) & ~(P >> 1);          /* a lone P */
            uint64_t J = P1 & ~(SP << 1);                      /* ... that starts a piece: the prefix of letters */
            uint64_t Ls = L & ~(L << 1);
            uint64_t B = 1 | D | (Ls & ~(((W & ~R) | J) << 1)) | (P & ~(P << 1) & ~(SP << 1));
            uint64_t X = R & (P << 1), Rabs = R & ((R + X) ^ R), Wn = W & ~Rabs;
            uint64_t F = R & Wn, G = Wn, T, Cq;
            F |= (F >> 1) & G; G &= G >> 1;
            F |= (F >> 2) & G; G &= G >> 2;
            F |= (F >> 4) & G; G &= G >> 4;
            F |= (F >> 8) & G; G &= G >> 8;
            F |= (F >> 16) & G; G &= G >> 16;
            F |= (F >> 32) & G;
            T = Wn & ~F;                                       /* whitespace after its run's last CR/LF */
            B |= (Wn & ~(Wn << 1)) | (T & ~(T << 1)) | (T & (T << 1) & ~(W >> 1) & (V >> 1));
            Cq = Q & J & (L >> 1);                             /* contractions */
            while (Cq) {
                int q = __builtin_ctzll(Cq);
                uint8_t c1 = t[q + 1] | 0x20, c2;
                Cq &= Cq - 1;
                if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                    if (q + 2 < 64) B |= 1ULL << (q + 2);
                } else if ((c1 == 'r' || c1 == 'v' || c1 == 'l') && q + 2 < m) {
                    c2 = t[q + 2] | 0x20;
                    if (((c1 == 'l') ? (c2 == 'l') : (c2 == 'e')) && q + 3 < 64) B |= 1ULL << (q + 3);
                }
            }
            B &= V;
            *b = B;
            if (end_text) return m;
            {
                uint64_t last = 1ULL << (m - 1), G2, Z;
                int r0;
                if (D & last) r0 = m - 1;
                else {
                    G2 = (L & last) ? L : (W & last) ? W : P;
                    Z = V & ~G2;
                    r0 = Z ? 64 - __builtin_clzll(Z) : 0;
                }
                B &= r0 >= 63 ? ~0ULL : (2ULL << r0) - 1;
                return 63 - __builtin_clzll(B);
            }
        }
    }
    /* A position in s[i:n] where 16 ASCII bytes in a row start (n if it finds none), 16 bytes per step, each
       step independent of the last (what a step reads does not decide where the next reads): in text that is
       mostly not ASCII the scanner tries the ASCII window again only there. A run of 31 ASCII bytes or more
       is always found; a shorter one may be passed over (the byte scanner then takes its pieces). */
    static inline Py_ssize_t qv3_ascii_ahead(const uint8_t* s, Py_ssize_t i, Py_ssize_t n) {
        for (; i + 16 <= n; i += 16) {
            uint64_t a, b;
    #if defined(__SSE2__)
            if (!qv3_portable) {
                if (_mm_movemask_epi8(_mm_loadu_si128((const __m128i*) (s + i))) == 0)
                    return i;
                continue;
            }
    #endif
            memcpy(&a, s + i, 8);
            memcpy(&b, s + i + 8, 8);
            if (((a | b) & 0x8080808080808080ULL) == 0)
                return i;
        }
        return n;
    }
    /* A batch's next run of positions [*k1 - its length, *k1) out of n, taken atomically from *next: guided
       runs (what is left / div, at most most, at least 1), so that at the end of a batch no thread still has a
       long run to do while the others wait. Returns the run's start, n when none is left. */
    static inline Py_ssize_t qv3_claim(Py_ssize_t* next, Py_ssize_t n, Py_ssize_t most, Py_ssize_t div,
                                       Py_ssize_t* k1) {
        Py_ssize_t pos = __atomic_load_n(next, __ATOMIC_RELAXED), c;
        do {
            if (pos >= n) return n;
            c = (n - pos) / div;
            c = c < 1 ? 1 : (c > most ? most : c);
        } while (!__atomic_compare_exchange_n(next, &pos, pos + c, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        *k1 = pos + c;
        return pos;
    }
    /* The end of a threaded batch without a round trip through the thread pool. A helper thread enters with
       qv3_enter (false: the calling thread has already closed the batch, and the helper must not touch it) and
       counts itself out with qv3_exit once it has written its last result. The calling thread, done draining,
       closes the batch with qv3_close (the number of helpers that entered) and waits with qv3_wait until that
       many have exited, spinning for at most spin_ns (the helpers are finishing their last short runs on other
       cores): 1 when they all have, 0 when the time ran out (then the caller blocks on the helpers' futures,
       which also gives the CPU to a helper that waits for this very core). */
    #define QV3_CLOSED ((int64_t) 1 << 62)
    static inline int qv3_enter(int64_t* entered) {
        return !(__atomic_fetch_add(entered, 1, __ATOMIC_ACQ_REL) & QV3_CLOSED);
    }
    static inline void qv3_exit(int64_t* exited) { __atomic_fetch_add(exited, 1, __ATOMIC_RELEASE); }
    static inline int64_t qv3_close(int64_t* entered) {
        return __atomic_fetch_or(entered, QV3_CLOSED, __ATOMIC_ACQ_REL) & (QV3_CLOSED - 1);
    }
    static double qv3_now(void) {     /* monotonic seconds */
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double) t.tv_sec + 1e-9 * (double) t.tv_nsec;
    }
    static int qv3_wait(const int64_t* exited, int64_t count, long spin_ns) {
        double end = qv3_now() + 1e-9 * (double) spin_ns;
        long spins = 0;
        while (__atomic_load_n(exited, __ATOMIC_ACQUIRE) < count) {
    #if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
    #elif defined(__aarch64__)
            __asm__ __volatile__("yield");
    #endif
            if ((++spins & 63) == 0 && qv3_now() > end) return 0;
        }
        return 1;
    }
    /* The piece cache's per-set sequence lock (a seqlock: readers never write, writers never wait). Even: the
       set is stable; odd: a writer is changing it. A reader takes v = qv3_seq_begin, reads, and keeps what it
       read only if qv3_seq_valid(v): the sequence was even and has not moved, so no write overlapped the
       read. A writer takes the set with qv3_seq_lock (fails, and the writer skips caching, when another
       writer holds it or it moved since v) and gives it back with qv3_seq_unlock. The fences are compiler
       barriers on x86 (every x86 load/store is already ordered enough) and real barriers on weaker CPUs. */
    static inline uint32_t qv3_seq_begin(const uint32_t* s) { return __atomic_load_n(s, __ATOMIC_ACQUIRE); }
    static inline int qv3_seq_valid(const uint32_t* s, uint32_t v) {
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        return !(v & 1) && __atomic_load_n(s, __ATOMIC_RELAXED) == v;
    }
    static inline int qv3_seq_lock(uint32_t* s, uint32_t v) {
        if ((v & 1) || !__atomic_compare_exchange_n(s, &v, v + 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return 0;
        __atomic_thread_fence(__ATOMIC_RELEASE);    /* the odd sequence is visible before any data store */
        return 1;
    }
    static inline void qv3_seq_unlock(uint32_t* s, uint32_t v) { __atomic_store_n(s, v + 2, __ATOMIC_RELEASE); }
    /* A new list of the ids[0:n] as int objects: table[id] (a list of ints, one reference more per item) for
       ids inside it, a new int otherwise. The list is filled in place (no None to replace, no bounds checks):
       this is the part of encode_batch that holds the GIL. */
    static PyObject* qv3_ids_list(const int32_t* ids, Py_ssize_t n, PyObject* table) {
        Py_ssize_t k, size = PyList_GET_SIZE(table);
        PyObject** tab = ((PyListObject*) table)->ob_item;
        PyObject* res = PyList_New(n);
        PyObject** out;
        PyObject* o;
        if (res == NULL) return NULL;
        out = ((PyListObject*) res)->ob_item;
        for (k = 0; k < n; k++) {
            if (ids[k] >= 0 && ids[k] < size) {
                o = tab[ids[k]];
                Py_INCREF(o);
            } else if ((o = PyLong_FromLong(ids[k])) == NULL) {
                Py_DECREF(res);
                return NULL;
            }
            out[k] = o;
        }
        return res;
    }
    /* count_batch's result: the list of res[k] as ints, in input order (position k holds text order[k]; order
       NULL: text k). Filled in place, like qv3_ids_list (a list's unset items are NULL, which its
       deallocation skips). */
    static PyObject* qv3_counts_list(const int64_t* res, const Py_ssize_t* order, Py_ssize_t n) {
        Py_ssize_t k;
        PyObject* out = PyList_New(n);
        PyObject* o;
        if (out == NULL) return NULL;
        for (k = 0; k < n; k++) {
            if ((o = PyLong_FromLongLong(res[k])) == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, order != NULL ? order[k] : k, o);
        }
        return out;
    }
    """
    void QV3_PREFETCH(const void* p) noexcept nogil
    bint QV3_LITTLE
    bint QV3_UNLIKELY(bint x) noexcept nogil
    Py_ssize_t qv3_claim(Py_ssize_t* next, Py_ssize_t n, Py_ssize_t most, Py_ssize_t div, Py_ssize_t* k1) noexcept nogil
    bint qv3_enter(int64_t* entered) noexcept nogil
    void qv3_exit(int64_t* exited) noexcept nogil
    int64_t qv3_close(int64_t* entered) noexcept nogil
    bint qv3_wait(const int64_t* exited, int64_t count, long spin_ns) noexcept nogil
    double qv3_now() noexcept nogil
    int qv3_argmin(const int32_t* rk, int n, int32_t* best) noexcept nogil
    Py_ssize_t qv3_ucs2_run(const uint16_t* u, Py_ssize_t n, uint8_t* o, Py_ssize_t* m, const uint8_t* stop) noexcept nogil
    Py_ssize_t qv3_ascii_letters(const uint8_t* s, Py_ssize_t n) noexcept nogil
    int qv3_ascii_pieces(const uint8_t* s, Py_ssize_t avail, int end_text, uint64_t* b) noexcept nogil
    int qv3_ascii_classes_ok
    int qv3_portable
    Py_ssize_t qv3_ascii_ahead(const uint8_t* s, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    int qv3_ctz "__builtin_ctzll" (uint64_t x) noexcept nogil
    int qv3_popcount "__builtin_popcountll" (uint64_t x) noexcept nogil
    int qv3_load_short(const uint8_t* p, Py_ssize_t n, const uint8_t* end, uint64_t* w) noexcept nogil
    uint32_t qv3_seq_begin(const uint32_t* s) noexcept nogil
    bint qv3_seq_valid(const uint32_t* s, uint32_t v) noexcept nogil
    bint qv3_seq_lock(uint32_t* s, uint32_t v) noexcept nogil
    void qv3_seq_unlock(uint32_t* s, uint32_t v) noexcept nogil
    list qv3_ids_list(const int32_t* ids, Py_ssize_t n, list table)
    list qv3_counts_list(const int64_t* res, const Py_ssize_t* order, Py_ssize_t n)

from libc.stdlib cimport qsort

cdef extern from *:
    """
    #include <stdlib.h>
    #include <stdint.h>
    #include <string.h>
    #include <sys/mman.h>
    /* Zeroed memory for a large, randomly read table (free() it): 2 MiB aligned and, on Linux, advised for
       transparent huge pages, so that its reads do not also miss the TLB (with 4 KiB pages nearly every read
       across the ~10 MiB of tables BPE and the piece cache touch needs a page-table walk). Where the kernel
       gives no huge page: plain pages, same result. */
    static void* qv3_table_alloc(size_t size) {
        void* p = NULL;
        size_t huge = (size_t) 2 << 20, n = (size + huge - 1) & ~(huge - 1);
        if (posix_memalign(&p, huge, n) != 0) return NULL;
    #if defined(MADV_HUGEPAGE)
        madvise(p, n, MADV_HUGEPAGE);
    #endif
        memset(p, 0, n);
        return p;
    }
    /* Zeroed memory for the piece cache, whose pages are touched only as pieces get cached: an anonymous
       mapping (zero pages on first touch: none at all for an engine that is only cloned, like the bundled
       template engine), 2 MiB aligned and advised for huge pages like qv3_table_alloc. *base and *len are what
       qv3_lazy_free needs. */
    static void* qv3_lazy_alloc(size_t size, void** base, size_t* len) {
        size_t huge = (size_t) 2 << 20, n = ((size + huge - 1) & ~(huge - 1)) + huge;
        char* p = (char*) mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == (char*) MAP_FAILED) return NULL;
        *base = p;
        *len = n;
        p = (char*) (((uintptr_t) p + huge - 1) & ~(uintptr_t) (huge - 1));
    #if defined(MADV_HUGEPAGE)
        madvise(p, (size + huge - 1) & ~(huge - 1), MADV_HUGEPAGE);
    #endif
        return p;
    }
    static void qv3_lazy_free(void* base, size_t len) {
        if (base != NULL) munmap(base, len);
    }
    """
    void* _table_alloc "qv3_table_alloc" (size_t size) noexcept nogil
    void* qv3_lazy_alloc(size_t size, void** base, size_t* len) noexcept nogil
    void qv3_lazy_free(void* base, size_t len) noexcept nogil

DEF MAXCP = 0x110000
DEF F_L = 1
DEF F_N = 2
DEF F_M = 4
DEF F_WS = 8
DEF F_UNSAFE = 16      # not NFC_QC=Yes, or ccc != 0
DEF F_CRLF = 32
DEF F_OMARK = 64      # F_UNSAFE only for ccc != 0: NFC_QC=Yes, no decomposition, in no composition pair
DEF PAIR_ID_BITS = 20  # merge table: one uint64 per merge, left id | right id | rank (see Engine._pinsert)
DEF PAIR_RANK_BITS = 24
DEF NO_RANK = 0xFFFFFF # PAIR_RANK_BITS ones: an empty slot's rank, and "no merge" out of _prank
DEF PBLOOM_BITS = 21   # filter over the merge table's pairs, two bits per pair in one word (256 KiB): most pairs BPE asks about in
                       # Chinese text (neighbouring characters) have no merge, and are answered here
DEF JMEMO_BITS = 11    # per-engine direct-mapped memo of _cut's answers for a pair of characters (16 KiB)
DEF PCACHE_BITS = 12   # per-engine direct-mapped cache of merge-table lookups (32 KiB, hits and misses)
DEF VT_ID = 0xFFFFF    # vocabulary table entry: token id (low 20 bits) | 12-bit hash tag; all ones = empty
DEF SHORT_BPE = 32     # pieces of up to this many initial symbols use the array merge loop, longer ones a heap
DEF CACHE_BITS = 17    # piece cache: 2**17 sets of 2 ways, 64-byte entries (16 MiB, zero pages touched lazily)
DEF CACHE_KEY = 24     # pieces of 2..24 bytes are cached (key = three zero-padded little-endian words)
DEF CACHE_IDS = 8      # a CacheEnt is 64 bytes: 24 key + 32 ids + seq, klen, nids
DEF MIN_PARALLEL = 65536  # code points: smaller batches run in the calling thread (handing work to a thread
                          # and collecting it costs tens of microseconds; below this threads did not pay)
DEF SPIN_NS = 50000    # a threaded batch's caller spins this long for its helpers' last runs, then blocks
DEF JBLOOM_BITS = 22   # junction filter (512 KiB): the characters around the junctions tokens span (_build_junctions)
DEF LC_BITS = 13       # long-piece cache: 2**13 direct-mapped entries (192 KiB) ...
DEF LC_ARENA = 1 << 21 # ... over a 2 MiB ring of the pieces' bytes and ids; both allocated on first use
DEF LC_MAX = 4096      # longest piece the long-piece cache keeps (bytes)
DEF LC_LEN = 0xFFFF     # LongEnt.n: the piece's length (<= LC_MAX) ...
DEF LC_COUNT_ONLY = 0x10000  # ... and this bit: the record holds the count alone (count(), not encode())
DEF LPIPE = 16         # parts of a long piece between _long's junction walk and the cache/BPE stage
DEF PIPE = 32          # pieces between the split scanner and the cache/BPE stage (their cache sets are prefetched)
DEF SBASE = 0xAC00
DEF LBASE = 0x1100
DEF VBASE = 0x1161
DEF TBASE = 0x11A7
DEF LCOUNT = 19
DEF VCOUNT = 21
DEF TCOUNT = 28
DEF NCOUNT = 588
DEF SCOUNT = 11172

# ---------------------------------------------------------------- Unicode tables (module globals)
cdef uint8_t* CLS = NULL        # F_* flags per code point
cdef uint8_t* CCC = NULL        # canonical combining class per code point (reference's NFC data)
cdef uint8_t BMP_STOP[8192]     # bit per BMP code point: not NFC-safe, or a surrogate (_text's fast loop stops)
cdef uint8_t CI_LETTER[0x180]   # case-insensitive contraction letter ('s','t',...) or 0, cp < 0x180
cdef uint32_t* DEC_CP = NULL    # sorted code points with a canonical decomposition (non-Hangul)
cdef int32_t* DEC_OFF = NULL    # offsets into DEC_DATA (n+1 entries)
cdef uint32_t* DEC_DATA = NULL
cdef Py_ssize_t NDEC = 0
cdef uint64_t* COMP_KEY = NULL  # sorted (first << 21 | second)
cdef uint32_t* COMP_VAL = NULL
cdef Py_ssize_t NCOMP = 0
_tables_ready = False


cdef void _check_ascii_classes(const uint8_t* cls):
    """Turn on the 64-byte ASCII splitter (qv3_ascii_pieces) only if the tables give ASCII the classes it
    assumes: letters A-Z a-z, digits, whitespace \\t..\\r and space, no marks, the contraction letters."""
    global qv3_ascii_classes_ok
    cdef int c, want
    cdef uint8_t f = F_L | F_N | F_M | F_WS | F_CRLF
    for c in range(128):
        want = 0
        if 65 <= c <= 90 or 97 <= c <= 122:
            want |= F_L
        if 48 <= c <= 57:
            want |= F_N
        if 9 <= c <= 13 or c == 32:
            want |= F_WS
        if c == 10 or c == 13:
            want |= F_CRLF
        if (cls[c] & f) != want:
            return
        if CI_LETTER[c] != ((c | 0x20) if (want & F_L) and chr(c | 0x20) in "stmdrvel" else 0):
            return
    qv3_ascii_classes_ok = 1


def init_unicode_tables(dict data):
    """Load the generated tables (``data/unicode_tables.json``) into C arrays; idempotent."""
    global CLS, CCC, DEC_CP, DEC_OFF, DEC_DATA, NDEC, COMP_KEY, COMP_VAL, NCOMP, _tables_ready
    if _tables_ready:
        return
    cdef uint8_t* cls = <uint8_t*> calloc(MAXCP, 1)
    cdef uint8_t* ccc = <uint8_t*> calloc(MAXCP, 1)
    if cls == NULL or ccc == NULL:
        raise MemoryError()
    cdef Py_ssize_t a, b, c, i, k
    for name, flag in (("L", F_L), ("N", F_N), ("M", F_M), ("WS", F_WS)):
        for a, b in data[name]:
            for c in range(a, b + 1):
                cls[c] |= flag
    cls[10] |= F_CRLF
    cls[13] |= F_CRLF
    memset(CI_LETTER, 0, sizeof(CI_LETTER))
    for letter, cps in data["CI"].items():
        for c in cps:
            if c >= 0x180:
                raise ValueError(f"case-insensitive match U+{c:04X} outside the supported range")
            CI_LETTER[c] = ord(letter)
    _check_ascii_classes(cls)
    for a, b, v in data["ccc"]:
        for c in range(a, b + 1):
            ccc[c] = v
            cls[c] |= F_UNSAFE
    dec = data["decomp"]
    comp = data["comp"]
    NDEC = len(dec)
    DEC_CP = <uint32_t*> malloc(max(NDEC, 1) * sizeof(uint32_t))
    DEC_OFF = <int32_t*> malloc((NDEC + 1) * sizeof(int32_t))
    total = sum(len(d) for _, d in dec)
    DEC_DATA = <uint32_t*> malloc(max(total, 1) * sizeof(uint32_t))
    k = 0
    for i in range(NDEC):
        DEC_CP[i] = dec[i][0]
        DEC_OFF[i] = k
        for c in dec[i][1]:
            DEC_DATA[k] = c
            k += 1
    DEC_OFF[NDEC] = k
    NCOMP = len(comp)
    COMP_KEY = <uint64_t*> malloc(max(NCOMP, 1) * sizeof(uint64_t))
    COMP_VAL = <uint32_t*> malloc(max(NCOMP, 1) * sizeof(uint32_t))
    composites = set()
    for i, (a, b, c) in enumerate(sorted(comp)):
        COMP_KEY[i] = (<uint64_t> a << 21) | <uint64_t> b
        COMP_VAL[i] = c
        composites.add(c)
        cls[b] |= F_UNSAFE           # NFC_QC=Maybe: may combine with what precedes it
    for i in range(NDEC):            # NFC_QC=No: decomposes and does not recompose to itself
        if DEC_CP[i] not in composites:
            cls[DEC_CP[i]] |= F_UNSAFE
    for c in range(VBASE, VBASE + VCOUNT):
        cls[c] |= F_UNSAFE
    for c in range(TBASE + 1, TBASE + TCOUNT):
        cls[c] |= F_UNSAFE
    # marks that are unsafe only for their combining class (NFC_QC=Yes): in canonical order after what precedes
    # them they leave a text in NFC (UAX #15's quick check), so _text records them only when out of order
    paired = {a for a, _, _ in comp} | {b for _, b, _ in comp} | {c for _, _, c in comp} | set(d for d, _ in dec)
    for a, b, v in data["ccc"]:
        for c in range(a, b + 1):
            if v and c not in paired and not (VBASE <= c < VBASE + VCOUNT or TBASE < c < TBASE + TCOUNT):
                cls[c] |= F_OMARK
    for c in range(0x4000, 0xA000):   # _nfc_unsafe decides these without the table
        if cls[c] & F_UNSAFE:
            raise ValueError(f"U+{c:04X} is not NFC-safe in these tables; _nfc_unsafe assumes U+4000..U+9FFF are")
    memset(BMP_STOP, 0, sizeof(BMP_STOP))
    for c in range(0x10000):
        if (cls[c] & F_UNSAFE) or 0xD800 <= c < 0xE000:
            BMP_STOP[c >> 3] |= 1 << (c & 7)
    CLS = cls
    CCC = ccc
    _tables_ready = True


cdef inline uint32_t _dec(const uint8_t* s, Py_ssize_t i, int* ln) noexcept nogil:
    """Decode the (valid) UTF-8 code point at s[i]."""
    cdef uint8_t b = s[i]
    if b < 0x80:
        ln[0] = 1
        return b
    if b < 0xE0:
        ln[0] = 2
        return ((b & 0x1F) << 6) | (s[i + 1] & 0x3F)
    if b < 0xF0:
        ln[0] = 3
        return ((b & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F)
    ln[0] = 4
    return ((b & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F)


cdef inline int _put_utf8(uint8_t* o, uint32_t c) noexcept nogil:
    if c < 0x80:
        o[0] = c
        return 1
    if c < 0x800:
        o[0] = 0xC0 | (c >> 6)
        o[1] = 0x80 | (c & 0x3F)
        return 2
    if c < 0x10000:
        o[0] = 0xE0 | (c >> 12)
        o[1] = 0x80 | ((c >> 6) & 0x3F)
        o[2] = 0x80 | (c & 0x3F)
        return 3
    o[0] = 0xF0 | (c >> 18)
    o[1] = 0x80 | ((c >> 12) & 0x3F)
    o[2] = 0x80 | ((c >> 6) & 0x3F)
    o[3] = 0x80 | (c & 0x3F)
    return 4


cdef inline Py_ssize_t _find_dec(uint32_t c) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = NDEC - 1, mid
    while lo <= hi:
        mid = (lo + hi) >> 1
        if DEC_CP[mid] == c:
            return mid
        if DEC_CP[mid] < c:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


cdef inline int64_t _compose(uint32_t a, uint32_t b) noexcept nogil:
    cdef uint64_t key
    cdef Py_ssize_t lo, hi, mid
    if LBASE <= a < LBASE + LCOUNT and VBASE <= b < VBASE + VCOUNT:
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT
    if SBASE <= a < SBASE + SCOUNT and (a - SBASE) % TCOUNT == 0 and TBASE < b < TBASE + TCOUNT:
        return a + (b - TBASE)
    key = (<uint64_t> a << 21) | b
    lo = 0
    hi = NCOMP - 1
    while lo <= hi:
        mid = (lo + hi) >> 1
        if COMP_KEY[mid] == key:
            return COMP_VAL[mid]
        if COMP_KEY[mid] < key:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


cdef inline bint _nfc_unsafe(uint32_t c) noexcept nogil:
    """Is c not NFC-safe (F_UNSAFE: not NFC_QC=Yes, or ccc != 0)? No character below U+0300 is, nor any of
    U+4000..U+9FFF (init_unicode_tables checks): those are decided without the table."""
    return c >= 0x300 and (c < 0x4000 or c >= 0xA000) and (CLS[c] & F_UNSAFE) != 0


cdef inline bint _nfc_recorded(uint32_t c, uint32_t prev) noexcept nogil:
    """Does the encoder (_text) record the not NFC-safe character c after prev (0: none) for NFC? All of them but
    a mark that is unsafe only for its combining class (F_OMARK: NFC_QC=Yes, no decomposition, in no composition)
    whose class is not below prev's: UAX #15's quick check says a text of NFC_QC=Yes characters in canonical order
    is in NFC. NFC (_nfc) works from the recorded offsets and nothing else; a text without one is in NFC."""
    return not (CLS[c] & F_OMARK) or CCC[prev] > CCC[c]


# ---------------------------------------------------------------- C data structures of the engine
ctypedef struct CacheEnt:  # one way of a piece cache set (a set: two entries, the first holds the set's seq)
    uint64_t w[3]         # the piece's bytes, zero-padded little-endian words
    int32_t ids[CACHE_IDS]
    uint32_t seq          # first entry of a set: the set's sequence lock (qv3_seq_*); unused in the second
    uint8_t klen          # 0 = empty
    uint8_t nids
    uint8_t pad[2]

ctypedef struct Text:      # a str's canonical representation, read without the GIL (the caller holds a reference)
    const void* data
    Py_ssize_t len        # code points
    int kind              # 1, 2 or 4 bytes per code point
    bint ascii            # data is already UTF-8

ctypedef struct Batch:     # one count_batch/encode_batch call, shared by its worker threads
    Text* texts
    Py_ssize_t n
    Py_ssize_t* order     # processing order (longest first when several workers share it; NULL: as given)
    Py_ssize_t next       # next position in order not yet taken (runs taken with qv3_claim)
    Py_ssize_t chunk      # longest run taken at once
    Py_ssize_t div        # a run is at most 1/div of the positions left
    int64_t entered       # helper threads that entered the batch, | QV3_CLOSED once the caller closed it
    int64_t exited        # helper threads done with the batch (qv3_enter ... qv3_exit)
    bint failed           # a helper thread raised (its future holds the exception)
    bint counting
    int64_t* res          # per position in order: the text's token count (its ids' count when encoding)
    int64_t* start        # encode: where its ids start in the output buffer of the worker that ran it
    void* lists           # encode: the result list (borrowed; _Batch holds it); the worker that runs a chunk
    void* table           # puts the chunk's id lists into it, holding the GIL (ids -> int objects: _id_table)
    int64_t* bad          # per position: 1 + index of a lone surrogate, 0 if none
                          # (per position, not per text: each worker writes its own runs of these arrays)

ctypedef struct CharEnt:  # a multi-byte character whose own token may start the merge (see _build_chars)
    int32_t tok           # -1: start from its bytes
    int32_t risk          # -1: safe next to any neighbour; else index into risk_hdr
    uint32_t lmask
    uint32_t rmask

ctypedef struct LongEnt:  # a cached piece of more than CACHE_KEY bytes: its record is at pos in the ring
    uint64_t h            # _hbytes of the piece
    uint64_t pos          # ring position (monotonic; the record is intact while lc_pos - pos <= LC_ARENA)
    uint32_t n            # bytes, LC_COUNT_ONLY set when no ids follow (a count() record)
    uint32_t nids         # ids, stored after the bytes (4-byte aligned)

ctypedef struct LongParts:  # the parts of a long piece between its cuts, waiting for their cache sets (_lp_add)
    const uint8_t* p[LPIPE]
    int32_t len[LPIPE]
    uint64_t h[LPIPE]
    uint64_t w[3 * LPIPE]
    int n

ctypedef struct RiskHdr:
    int32_t off           # into risk_ent: nl left entries, then nr right entries
    uint8_t nl
    uint8_t nr

ctypedef struct RiskEnt:  # a neighbour (packed little-endian UTF-8 bytes) next to which the char is not safe
    uint32_t val
    uint8_t vlen
    uint8_t kind          # RK_CHAR: neighbour == val; RK_END: neighbour ends with val (left);
                          # RK_START: neighbour starts with val (right); both proper, multi-byte neighbours


cdef inline uint64_t _hbytes(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = 0x9E3779B97F4A7C15ULL ^ (<uint64_t> n * 0xFF51AFD7ED558CCDULL)
    cdef uint64_t w
    while n >= 8:
        memcpy(&w, p, 8)
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL
        h ^= h >> 31
        p += 8
        n -= 8
    if n > 0:
        w = 0
        memcpy(&w, p, n)
        h = (h ^ w) * 0x94D049BB133111EBULL
        h ^= h >> 29
    h *= 0xBF58476D1CE4E5B9ULL
    h ^= h >> 32
    return h


cdef inline void _load3(const uint8_t* p, Py_ssize_t n, uint64_t* w) noexcept nogil:
    """The 1..24 bytes at p as three zero-padded little-endian words (no read outside p[0:n])."""
    cdef uint64_t a
    cdef uint32_t x, y
    cdef Py_ssize_t k, r
    w[0] = 0
    w[1] = 0
    w[2] = 0
    if n >= 8:
        k = n >> 3
        memcpy(&w[0], p, 8)
        if k >= 2:
            memcpy(&w[1], p + 8, 8)
            if k >= 3:
                memcpy(&w[2], p + 16, 8)
        r = n & 7
        if r:
            memcpy(&a, p + n - 8, 8)
            w[k] = a >> (8 * (8 - r))
    elif n >= 4:
        memcpy(&x, p, 4)
        memcpy(&y, p + n - 4, 4)
        w[0] = <uint64_t> x | (<uint64_t> y << (8 * (n - 4)))
    else:
        w[0] = (<uint64_t> p[0]) | (<uint64_t> p[n >> 1] << (8 * (n >> 1))) | (<uint64_t> p[n - 1] << (8 * (n - 1)))


cdef inline uint64_t _hwords(const uint64_t* w, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = (w[0] * 0x9E3779B97F4A7C15ULL) ^ (w[1] * 0xC2B2AE3D27D4EB4FULL) \
        ^ ((w[2] + <uint64_t> n) * 0x165667B19E3779F9ULL)
    h ^= h >> 29
    h *= 0xBF58476D1CE4E5B9ULL
    h ^= h >> 32
    return h


cdef inline uint64_t _hkey(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """Hash of a byte string: _hwords of its padded words up to 24 bytes, _hbytes beyond."""
    cdef uint64_t w[3]
    if 0 < n <= CACHE_KEY:
        _load3(p, n, w)
        return _hwords(w, n)
    return _hbytes(p, n)


cdef inline int _u8len(uint8_t b) noexcept nogil:
    if b < 0x80:
        return 1
    if b < 0xE0:
        return 2
    if b < 0xF0:
        return 3
    return 4


cdef inline uint32_t _pack(const uint8_t* p, int n) noexcept nogil:
    """1 to 4 bytes as a little-endian integer (unrolled: n is nearly always the same, 3, in CJK text)."""
    cdef uint32_t v = p[0]
    if n > 1:
        v |= (<uint32_t> p[1]) << 8
        if n > 2:
            v |= (<uint32_t> p[2]) << 16
            if n > 3:
                v |= (<uint32_t> p[3]) << 24
    return v


cdef list _risk_list(const RiskEnt* ent, int n):
    cdef list out = []
    cdef int i, k
    cdef bytearray val
    for i in range(n):
        val = bytearray(ent[i].vlen)
        for k in range(ent[i].vlen):
            val[k] = (ent[i].val >> (8 * k)) & 0xFF
        out.append((ent[i].kind, bytes(val)))
    return out


cdef inline bint _allcont(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        if not (0x80 <= p[k] < 0xC0):
            return False
    return True


cdef inline bint _risk_match(const RiskEnt* e, uint32_t nb, int nlen) noexcept nogil:
    if e.kind == 0:
        return nlen == e.vlen and nb == e.val
    if nlen <= e.vlen:
        return False
    if e.kind == 1:
        return (nb >> (8 * (nlen - e.vlen))) == e.val
    return (nb & ((1u << (8 * e.vlen)) - 1)) == e.val


cdef inline uint32_t _rbit(uint32_t packed) noexcept nogil:
    return 1u << ((packed * 0x9E3779B1u) >> 27)


cdef uint32_t _risk_mask(const RiskEnt* ent, int n) noexcept nogil:
    cdef uint32_t m = 0
    cdef int k
    for k in range(n):
        if ent[k].kind != 0:
            return 0xFFFFFFFFu
        m |= _rbit(ent[k].val)
    return m


cdef inline uint64_t _hpair(uint64_t key) noexcept nogil:
    key *= 0x9E3779B97F4A7C15ULL
    return key ^ (key >> 29)


cdef inline uint64_t _bloom_word(uint64_t hh) noexcept nogil:
    """The merge filter's word for a pair of hash hh = _hpair(key) (bits independent of the table slot's)."""
    return (hh >> 19) & ((1 << (PBLOOM_BITS - 6)) - 1)


cdef inline uint64_t _bloom_mask(uint64_t hh) noexcept nogil:
    """The merge filter's two bits in that word: a pair may merge only when both are set (two bits in one word: one
    read, and about half the false positives of one bit)."""
    return (1ULL << ((hh >> 34) & 63)) | (1ULL << ((hh >> 46) & 63))


cdef inline uint64_t _pcache_slot(uint64_t hh) noexcept nogil:
    """The pair cache's slot for a pair of hash hh = _hpair(key)."""
    return (hh >> 40) & ((1 << PCACHE_BITS) - 1)


cdef inline uint64_t _pairkey(int32_t a, int32_t b) noexcept nogil:
    return ((<uint64_t> <uint32_t> a) << PAIR_ID_BITS) | <uint32_t> b


# ================================================================ Engine: one tokenizer instance
cdef class Engine:
    """C core: vocabulary, merge table, added-token matcher, NFC, split scanner and BPE."""
    cdef char pad_head[64]        # engines of one batch run on different cores: no cache line of one engine's
                                  # fields (written per piece) may hold another engine's (see pad_tail)
    cdef int32_t ntok
    cdef uint8_t* arena
    cdef int64_t* tok_off
    cdef int32_t* tok_len
    cdef uint8_t* selfok          # BPE of the token's own bytes gives the token (whole-piece shortcut)
    cdef uint32_t* vtab           # open addressing: bytes -> tag << 20 | id (VT_ID: see _vlookup_h)
    cdef uint64_t vmask
    cdef uint64_t* ptab           # merges: open addressing, (left << 20 | right) << 24 | rank; all ones = empty
    cdef uint64_t pmask
    cdef int32_t* mnew            # the token a merge of rank r makes (== r for tiktoken vocabularies)
    cdef readonly bint mident     # mnew[r] == r for every merge: BPE skips the read (a dependent load per merge)
    cdef uint64_t* pbloom         # _bloom_mask set in word _bloom_word for every merge (of _hpair(key))
    cdef int32_t nrank
    cdef uint64_t* pcache         # this engine's recent _prank answers, ptab's format (NO_RANK: no merge)
    cdef uint64_t* jmemo          # this engine's recent _cut answers that hang on x|y alone (in pcache's block)
    cdef int32_t byte_id[256]
    cdef int32_t maxtok           # longest token (bytes)
    cdef CacheEnt* cache          # 2 MiB aligned inside the mapping cache_raw (cache_len bytes; qv3_lazy_*)
    cdef void* cache_raw
    cdef size_t cache_len
    cdef CharEnt* cbmp            # per BMP code point (owned like the vocabulary)
    cdef uint32_t* csupp_cp       # sorted supplementary code points with an entry
    cdef CharEnt* csupp
    cdef Py_ssize_t ncsupp
    cdef RiskHdr* risk_hdr
    cdef RiskEnt* risk_ent
    cdef public bint premerge     # start merges from safe characters' own tokens (exact; off = plain bytes)
    cdef public int rule          # 0 = qwen2, 1 = qwen35
    cdef public bint nfc          # NFC-normalize segments (tokenizer.json normalizer NFC vs none)
    cdef readonly int32_t unmerged  # from_tiktoken: tokens no merge of two lower ranks makes (never produced)
    cdef bint owns                # False for clones: vocabulary tables belong to `owner`
    cdef object owner
    # added tokens, sorted by length (longest first)
    cdef uint8_t add_first[256]
    cdef int nadd
    cdef uint8_t* add_arena
    cdef int64_t* add_off
    cdef int32_t* add_len
    cdef int32_t* add_id
    # output / scratch
    cdef int32_t* out
    cdef Py_ssize_t nout, outcap
    cdef bint counting
    cdef int64_t counted
    cdef int64_t misses           # cacheable pieces (2..CACHE_KEY bytes) the piece cache did not answer
    cdef uint32_t* ubuf
    cdef Py_ssize_t ucap
    cdef uint8_t* nbuf
    cdef Py_ssize_t ncap
    cdef uint8_t* u8              # UTF-8 of the current text when it is not ASCII
    cdef Py_ssize_t u8cap
    cdef Py_ssize_t badpos        # _text: index of the lone surrogate it stopped at
    cdef Py_ssize_t* upos         # _text: offsets in its UTF-8 (at ubase) of the characters that are not NFC-safe
    cdef Py_ssize_t nupos, upos_cap, upos_i   # ... their number, room, and the next one _segment/_nfc look at
    cdef const uint8_t* ubase
    cdef object added_list        # set_added_tokens' argument (clones copy it)
    cdef object id_objects        # list: id -> int object, for _ids (on the root engine; clones share it)
    cdef object helpers           # engines of the batch worker threads (clones), created on first use
    cdef object batch_lock        # held while helpers run a batch
    cdef int add_only             # the one first byte of all added tokens (memchr), or -1
    cdef const uint8_t* pq_p[PIPE]  # the piece pipeline (_queue/_flush): start, length, cache hash
    cdef int32_t pq_n[PIPE]
    cdef uint64_t pq_h[PIPE]
    cdef uint64_t pq_w[3 * PIPE]     # its bytes as _load3 words (2 <= length <= CACHE_KEY)
    cdef int npq
    cdef const uint8_t* seg_end   # end of the segment _scan reads (bounds the 8-byte reads of qv3_load_short)
    cdef uint64_t* jbloom         # junction filter (owned like the vocabulary; _build_junctions)
    cdef uint8_t* jopen           # per code point: bit 1, some token ends inside a character after it; bit 2,
                                  # some token starts inside a character before it
    cdef uint8_t* jbyte           # (last byte, next byte) pairs a token made only of two partial characters joins
    cdef LongEnt* lc              # long-piece cache (this engine's; mapped on the first long piece)
    cdef uint8_t* lc_ring
    cdef uint64_t lc_pos
    cdef readonly int64_t long_hits   # pieces over CACHE_KEY bytes the long-piece cache answered
    cdef readonly int64_t splits      # junctions no token spans at which a long piece was cut
    cdef int32_t* hsym            # scratch of the heap merge loop (4 * hcap int32 + 3 * hcap uint64)
    cdef uint64_t* hheap
    cdef Py_ssize_t hcap
    cdef public bint fast_ascii   # split ASCII 64 bytes at a time (qv3_ascii_pieces); off: the byte scanner only
                                  # (last: the fields the byte scanner reads per piece keep their places)
    cdef char pad_tail[64]

    # ------------------------------------------------------------ lifetime
    def __cinit__(self):
        self.ntok = 0
        self.misses = 0
        self.arena = NULL
        self.tok_off = NULL
        self.tok_len = NULL
        self.selfok = NULL
        self.vtab = NULL
        self.ptab = NULL
        self.mnew = NULL
        self.pbloom = NULL
        self.nrank = 0
        self.pcache = NULL
        self.cache = NULL
        self.cache_raw = NULL
        self.cbmp = NULL
        self.csupp_cp = NULL
        self.csupp = NULL
        self.ncsupp = 0
        self.risk_hdr = NULL
        self.risk_ent = NULL
        self.premerge = True
        self.maxtok = 0
        self.nadd = 0
        self.add_arena = NULL
        self.add_off = NULL
        self.add_len = NULL
        self.add_id = NULL
        self.out = NULL
        self.nout = 0
        self.outcap = 0
        self.ubuf = NULL
        self.ucap = 0
        self.nbuf = NULL
        self.ncap = 0
        self.hsym = NULL
        self.hheap = NULL
        self.hcap = 0
        self.jbloom = NULL
        self.jopen = NULL
        self.jbyte = NULL
        self.lc = NULL
        self.lc_ring = NULL
        self.lc_pos = 0
        self.long_hits = 0
        self.splits = 0
        self.npq = 0
        self.u8 = NULL
        self.u8cap = 0
        self.upos = NULL
        self.nupos = 0
        self.upos_cap = 0
        self.upos_i = 0
        self.ubase = NULL
        self.add_only = -1
        self.rule = 0
        self.nfc = True
        self.fast_ascii = qv3_ascii_classes_ok
        self.owns = True
        self.owner = None
        memset(self.add_first, 0, 256)

    def __dealloc__(self):
        if self.owns:
            free(self.arena); free(self.tok_off); free(self.tok_len); free(self.selfok); free(self.vtab)
            free(self.ptab); free(self.mnew); free(self.pbloom); free(self.cbmp); free(self.csupp_cp); free(self.csupp)
            free(self.risk_hdr); free(self.risk_ent); free(self.jbloom); free(self.jopen); free(self.jbyte)
        free(self.lc); free(self.lc_ring)
        qv3_lazy_free(self.cache_raw, self.cache_len); free(self.pcache); free(self.add_arena); free(self.add_off); free(self.add_len)
        free(self.add_id); free(self.out); free(self.ubuf); free(self.nbuf); free(self.u8); free(self.upos)
        free(self.hsym); free(self.hheap)

    # ------------------------------------------------------------ construction
    cdef int _alloc_vocab(self, Py_ssize_t ntok, Py_ssize_t nbytes) except -1:
        if ntok >= VT_ID:
            raise ValueError(f"vocabulary too large ({ntok} tokens; at most {VT_ID - 1})")
        self.ntok = ntok
        self.arena = <uint8_t*> calloc(nbytes + 8, 1)   # + 8: _vlookup_h reads a short token as one word
        self.tok_off = <int64_t*> malloc((ntok + 1) * sizeof(int64_t))
        self.tok_len = <int32_t*> calloc(ntok + 1, sizeof(int32_t))
        self.selfok = <uint8_t*> calloc(ntok + 1, 1)
        cdef uint64_t cap = 1024
        while cap < <uint64_t> ntok * 2:
            cap <<= 1
        self.vmask = cap - 1
        self.vtab = <uint32_t*> _table_alloc(cap * sizeof(uint32_t))
        if (self.arena == NULL or self.tok_off == NULL or self.tok_len == NULL or self.selfok == NULL
                or self.vtab == NULL):
            raise MemoryError()
        self._alloc_cache()
        memset(self.vtab, 0xFF, cap * sizeof(uint32_t))
        return 0

    cdef int _alloc_cache(self, bint pieces=True) except -1:
        """The pair cache, and the piece cache unless the engine will share another's (pieces=False)."""
        if pieces:
            self.cache = <CacheEnt*> qv3_lazy_alloc((2 << CACHE_BITS) * sizeof(CacheEnt), &self.cache_raw,
                                                    &self.cache_len)
            if self.cache == NULL:
                raise MemoryError()
        self.pcache = <uint64_t*> malloc(((1 << PCACHE_BITS) + (1 << JMEMO_BITS)) * sizeof(uint64_t))
        if self.pcache == NULL:
            raise MemoryError()
        memset(self.pcache, 0xFF, ((1 << PCACHE_BITS) + (1 << JMEMO_BITS)) * sizeof(uint64_t))
        self.jmemo = self.pcache + (1 << PCACHE_BITS)
        return 0

    cdef inline int32_t _vlookup(self, const uint8_t* p, Py_ssize_t n) noexcept nogil:
        return self._vlookup_h(p, n, _hkey(p, n))

    cdef inline int32_t _vlookup_h(self, const uint8_t* p, Py_ssize_t n, uint64_t h) noexcept nogil:
        """Token id of the bytes p[0:n] (hash h), or -1. Slots hold the id with 12 bits of the hash as a tag:
        a piece that is no token (most pieces BPE sees) costs one table read, not the token's length and
        bytes too."""
        cdef uint64_t slot = h & self.vmask
        cdef uint32_t e, tag = (<uint32_t> (h >> 52)) << 20
        cdef int32_t t
        cdef uint64_t w[3]
        cdef uint64_t a
        while True:
            e = self.vtab[slot]
            if e == 0xFFFFFFFFu:
                return -1
            if (e & ~(<uint32_t> VT_ID)) == tag:
                t = <int32_t> (e & VT_ID)
                if self.tok_len[t] == n:
                    if n <= 8 and QV3_LITTLE:   # one word each (the arena has 8 bytes to spare), no memcmp call
                        _load3(p, n, w)
                        memcpy(&a, self.arena + self.tok_off[t], 8)
                        if (a & (~(<uint64_t> 0) >> (64 - 8 * n))) == w[0]:
                            return t
                    elif memcmp(self.arena + self.tok_off[t], p, n) == 0:
                        return t
            slot = (slot + 1) & self.vmask

    cdef int _vinsert_all(self) except -1:
        cdef int32_t t
        cdef uint8_t bb
        cdef uint64_t slot, h
        for t in range(self.ntok):
            if self.tok_len[t] < 0:
                continue
            if self._vlookup(self.arena + self.tok_off[t], self.tok_len[t]) >= 0:
                raise ValueError(f"duplicate token bytes for id {t}")
            h = _hkey(self.arena + self.tok_off[t], self.tok_len[t])
            slot = h & self.vmask
            if self.tok_len[t] > self.maxtok:
                self.maxtok = self.tok_len[t]
            while self.vtab[slot] != 0xFFFFFFFFu:
                slot = (slot + 1) & self.vmask
            self.vtab[slot] = ((<uint32_t> (h >> 52)) << 20) | <uint32_t> t
        for t in range(256):
            bb = <uint8_t> t
            self.byte_id[t] = self._vlookup(&bb, 1)
            if self.byte_id[t] < 0:
                raise ValueError(f"vocabulary lacks the single byte 0x{t:02X} (not a byte-level BPE vocabulary)")
        return 0

    cdef int _alloc_pairs(self, Py_ssize_t nmerges, Py_ssize_t nrank) except -1:
        """The merge table for nmerges merges of ranks < nrank. One 8-byte word per merge at a load factor
        <= 2/3: the table is probed for every pair of neighbouring symbols in every piece BPE sees, and at
        8 bytes it is a quarter of what (key, rank, id) records took -- 2 MiB for Qwen's 151k merges, which
        stays in a core's L2 cache far more often than 8 MiB did."""
        cdef uint64_t cap = 1024, i
        if self.ntok >= (1 << PAIR_ID_BITS) - 1 or nrank >= NO_RANK:
            raise ValueError(f"vocabulary too large for the merge table ({self.ntok} tokens, {nrank} ranks)")
        while cap * 2 < <uint64_t> nmerges * 3:
            cap <<= 1
        self.pmask = cap - 1
        self.ptab = <uint64_t*> _table_alloc(cap * sizeof(uint64_t))
        self.mnew = <int32_t*> malloc(max(nrank, 1) * sizeof(int32_t))
        self.pbloom = <uint64_t*> _table_alloc((1 << (PBLOOM_BITS - 6)) * sizeof(uint64_t))
        if self.ptab == NULL or self.mnew == NULL or self.pbloom == NULL:
            raise MemoryError()
        self.nrank = <int32_t> nrank
        for i in range(cap):
            self.ptab[i] = UINT64_MAX
        for i in range(nrank):
            self.mnew[i] = -1
        return 0

    cdef inline void _pinsert(self, int32_t a, int32_t b, int32_t rank, int32_t new_id) noexcept nogil:
        """Record merge (a, b) -> new_id of priority rank (0 <= a, b < ntok, rank < nrank; a pair listed
        again takes its later rank, as HF ``tokenizers`` builds its merge map)."""
        cdef uint64_t key = _pairkey(a, b)
        cdef uint64_t hh = _hpair(key)
        cdef uint64_t slot = hh & self.pmask
        while self.ptab[slot] != UINT64_MAX and (self.ptab[slot] >> PAIR_RANK_BITS) != key:
            slot = (slot + 1) & self.pmask
        self.ptab[slot] = (key << PAIR_RANK_BITS) | <uint32_t> rank
        self.mnew[rank] = new_id
        self.pbloom[_bloom_word(hh)] |= _bloom_mask(hh)
        self.pcache[_pcache_slot(hh)] = UINT64_MAX

    cdef inline bint _bloom_has(self, uint64_t hh) noexcept nogil:
        """May the pair of hash hh merge (both its filter bits set)? False: it certainly does not."""
        cdef uint64_t mask = _bloom_mask(hh)
        return (self.pbloom[_bloom_word(hh)] & mask) == mask

    cdef inline void _pprefetch(self, int32_t a, int32_t b) noexcept nogil:
        cdef uint64_t key = _pairkey(a, b)
        cdef uint64_t hh = _hpair(key)
        if (self.pcache[_pcache_slot(hh)] >> PAIR_RANK_BITS) != key and self._bloom_has(hh):
            QV3_PREFETCH(&self.ptab[hh & self.pmask])

    cdef inline int32_t _prank(self, int32_t a, int32_t b) noexcept nogil:
        """Rank of the merge (a, b), or INT32_MAX; the token it makes is mnew[rank]. The answer comes from the
        engine's small pair cache when it holds (a, b) (neighbouring symbols repeat: the same characters and
        sub-words meet again and again), else from the merge table, and is remembered either way."""
        cdef uint64_t key = _pairkey(a, b)
        cdef uint64_t hh = _hpair(key)
        cdef uint64_t* pc = &self.pcache[_pcache_slot(hh)]
        cdef uint64_t slot, e
        cdef uint32_t r
        if (pc[0] >> PAIR_RANK_BITS) != key:
            slot = hh & self.pmask
            QV3_PREFETCH(&self.ptab[slot])          # with the filter's read, not after it (on text not seen
            e = UINT64_MAX                           # lately both miss the caches); no merge, unless the filter
            if self._bloom_has(hh):                  # and then the table say so
                while True:
                    e = self.ptab[slot]
                    if (e >> PAIR_RANK_BITS) == key or e == UINT64_MAX:
                        break
                    slot = (slot + 1) & self.pmask
            pc[0] = (key << PAIR_RANK_BITS) | (e & NO_RANK)
        r = <uint32_t> (pc[0] & NO_RANK)
        return INT32_MAX if r == NO_RANK else <int32_t> r

    cdef int _finish(self) except -1:
        """Mark tokens whose own bytes BPE-merge back into themselves (exact whole-piece shortcut)."""
        cdef int32_t t
        cdef int32_t* tmp = <int32_t*> malloc(4096 * sizeof(int32_t))
        cdef Py_ssize_t n, r
        if tmp == NULL:
            raise MemoryError()
        self.mident = True
        for r in range(self.nrank):
            if self.mnew[r] >= 0 and self.mnew[r] != r:
                self.mident = False
                break
        self._ensure_scratch(4096)
        try:
            for t in range(self.ntok):
                n = self.tok_len[t]
                if n < 2 or n > 4000:
                    self.selfok[t] = n == 1
                    continue
                if self._bpe_into(self.arena + self.tok_off[t], n, tmp) == 1 and tmp[0] == t:
                    self.selfok[t] = 1
        finally:
            free(tmp)
        return 0

    cdef int _build_junctions(self) except -1:
        """Where a long piece may be cut. BPE only ever joins symbols into tokens, so at a point of a piece that
        no token of the vocabulary spans, the merges on its two sides are independent: BPE(piece) = BPE(left) +
        BPE(right), exactly (every step merges the lowest-ranked pair of one side or the other, in the order the
        side alone would). Recorded here, for every token and every character start inside it (a junction
        between characters x and y), what a text must hold around such a point for the token to span it:
        * x or y only partly in the token (it starts inside x or ends inside y): never cut next to that
          character (jopen), or, when both are partial, at that pair of bytes (jbyte);
        * else, in a one-hash filter, the pair (x, y) (key P: no such key, no token spans x|y), and with the
          characters beside them: (x, y) when the token starts at or inside x's left neighbour's place and ends
          at or inside y's right one's (A: it is "xy", or partial characters around it), (x, y, z) when it
          starts there and holds the next character z whole (B), (w, x, y) mirrored (C), (w, x, y, z) (D).
        _cut asks for the keys a text's w x | y z could meet; a false positive of the filter only means a piece
        is not cut where it could have been, never a different result. Junctions between two ASCII characters
        are never cut, and so not recorded (English pieces are short; it halves the filter)."""
        cdef int32_t t
        cdef Py_ssize_t n, k, j, jw, kz, L, L2
        cdef const uint8_t* s
        cdef uint32_t x = 0, y = 0, w = 0, z = 0
        cdef bint xfull, yfull, wfull, zfull
        cdef int ln
        self.jbloom = <uint64_t*> calloc(1 << (JBLOOM_BITS - 6), sizeof(uint64_t))
        self.jopen = <uint8_t*> calloc(MAXCP, 1)
        self.jbyte = <uint8_t*> calloc(8192, 1)
        if self.jbloom == NULL or self.jopen == NULL or self.jbyte == NULL:
            raise MemoryError()
        for t in range(self.ntok):
            n = self.tok_len[t]
            if n < 2:
                continue
            s = self.arena + self.tok_off[t]
            j = -1                              # the last byte that starts a character, or -1
            jw = -1                             # the one before it
            for k in range(n):
                if (s[k] & 0xC0) == 0x80:
                    continue
                if k > 0 and s[k] < 0xF8:       # a character of valid text may start here
                    L = _u8len(s[k])
                    yfull = k + L <= n and _allcont(s + k + 1, L - 1)
                    xfull = j >= 0 and _u8len(s[j]) == k - j
                    if xfull:
                        x = _dec(s, j, &ln)
                        xfull = x < MAXCP       # else no valid text holds these bytes: a partial character
                    if yfull:
                        y = _dec(s, k, &ln)
                        yfull = y < MAXCP
                    if xfull and yfull and x < 0x80 and y < 0x80:
                        pass                    # _cut never cuts between two ASCII characters
                    elif xfull and yfull:
                        wfull = jw >= 0 and _u8len(s[jw]) == j - jw
                        kz = k + L
                        zfull = False
                        if kz < n and (s[kz] & 0xC0) != 0x80 and s[kz] < 0xF8:
                            L2 = _u8len(s[kz])
                            zfull = kz + L2 <= n and _allcont(s + kz + 1, L2 - 1)
                        if wfull:
                            w = _dec(s, jw, &ln)
                            wfull = w < MAXCP
                        if zfull:
                            z = _dec(s, kz, &ln)
                            zfull = z < MAXCP
                        self._jset(1, x, y, 0, 0)
                        if wfull and zfull:
                            self._jset(5, w, x, y, z)
                        elif wfull:
                            self._jset(4, w, x, y, 0)
                        elif zfull:
                            self._jset(3, x, y, z, 0)
                        else:
                            self._jset(2, x, y, 0, 0)
                    elif xfull:
                        self.jopen[x] |= 1
                    elif yfull:
                        self.jopen[y] |= 2
                    else:
                        self.jbyte[(<Py_ssize_t> s[k - 1] << 5) | (s[k] >> 3)] |= <uint8_t> (1 << (s[k] & 7))
                jw = j
                j = k
        return 0

    cdef inline uint64_t _jbit(self, uint32_t tag, uint32_t a, uint32_t b, uint32_t c, uint32_t d) noexcept nogil:
        cdef uint64_t h = ((((<uint64_t> a) << 21) | b) * 0x9E3779B97F4A7C15ULL) \
            ^ (((((<uint64_t> c) << 21) | d) + tag) * 0xC2B2AE3D27D4EB4FULL)
        return _hpair(h) >> (64 - JBLOOM_BITS)

    cdef inline void _jset(self, uint32_t tag, uint32_t a, uint32_t b, uint32_t c, uint32_t d) noexcept nogil:
        cdef uint64_t bit = self._jbit(tag, a, b, c, d)
        self.jbloom[bit >> 6] |= 1ULL << (bit & 63)

    cdef inline bint _jhas(self, uint32_t tag, uint32_t a, uint32_t b, uint32_t c, uint32_t d) noexcept nogil:
        cdef uint64_t bit = self._jbit(tag, a, b, c, d)
        return (self.jbloom[bit >> 6] >> (bit & 63)) & 1

    cdef inline bint _cut(self, const uint8_t* p, bint hasw, uint32_t w, uint32_t x, uint32_t y, bint hasz,
                          uint32_t z) noexcept nogil:
        """May a piece be cut between x and y (y's first byte at p; w before x and z after y when the piece has
        them): no token spans that point (_build_junctions)."""
        cdef uint64_t key, e
        cdef uint64_t* slot
        if x < 0x80 and y < 0x80:
            return False
        key = ((<uint64_t> x) << 21) | y
        slot = &self.jmemo[(key * 0x9E3779B97F4A7C15ULL) >> (64 - JMEMO_BITS)]
        e = slot[0]
        if (e >> 2) != key:         # the answer for x|y alone: 0 no cut, 1 cut, 2 the neighbours decide
            if (self.jopen[x] & 1) or (self.jopen[y] & 2) or (self.jbyte[(<Py_ssize_t> p[-1] << 5) | (p[0] >> 3)]
                                                              >> (p[0] & 7)) & 1:
                e = 0
            elif not self._jhas(1, x, y, 0, 0):
                e = 1
            elif self._jhas(2, x, y, 0, 0):
                e = 0
            else:
                e = 2
            slot[0] = (key << 2) | e
        e &= 3
        if e != 2:
            return e == 1
        if hasz and self._jhas(3, x, y, z, 0):
            return False
        if hasw and (self._jhas(4, w, x, y, 0) or (hasz and self._jhas(5, w, x, y, z))):
            return False
        return True

    # ------------------------------------------------------------ per-character table (premerge, risk)
    cdef int _build_chars(self) except -1:
        """Which multi-byte characters may enter the merge loop as their own token instead of as bytes.

        BPE (lowest-ranked applicable merge first, leftmost on ties) over a piece's bytes gives the same result
        as BPE started with character c already merged into its token T(c) when, with R(c) the highest rank
        among the merges that turn c's bytes alone into T(c):
          (a) BPE of c's bytes alone gives exactly [T(c)];
          (b) every merge with T(c) as one side has a rank > R(c);
          (c) every merge that could join a proper fragment of c (c[k:] on its right edge, c[:k] on its left
              edge) with a symbol next to c, given c's actual neighbouring characters, has a rank > R(c).
        Proof sketch: while c is not yet whole, one of its internal merges (rank <= R(c)) is applicable, so a
        merge that crosses c's boundary, or uses T(c), can never be the lowest-ranked one before c is whole by
        (b) and (c); c's internal merges happen in the same order as alone (a); and every other merge sees the
        same symbols in both runs. Induction over the characters extends it to all of them at once.
        For (c), a symbol X that ends where c begins (in valid UTF-8) ends with the whole previous character p,
        or is a proper suffix of p (continuation bytes only); a symbol Y that starts where c ends begins with
        the whole next character, or is a proper prefix of it. So each merge (c[k:], Y) or (X, c[:k]) with
        rank < R(c) is recorded as a "risk": next to which neighbours (that character exactly, or any
        multi-byte character ending/starting with those bytes) c must stay as bytes. Few merges in a byte-level
        vocabulary join fragments of characters, so nearly all characters are safe next to nearly everything.
        """
        cdef Py_ssize_t cap = self.pmask + 1, i, t, k, j, nrisk = 0, riskcap = 0, nhdr = 0, hdrcap = 0
        cdef int32_t* use = <int32_t*> malloc((self.ntok + 1) * sizeof(int32_t))
        cdef int32_t a, b, r, R, cur, bi, nsym
        cdef int la, lb, L, ln
        cdef const uint8_t* pa
        cdef const uint8_t* pb
        cdef uint32_t cp, packed, lm, rm
        cdef uint8_t enc[4]
        cdef int32_t sym[4]
        cdef CharEnt* cbmp = NULL
        cdef RiskHdr* hdr = NULL
        cdef RiskEnt* ent = NULL
        cdef RiskHdr* hnew
        cdef RiskEnt* enew
        cdef uint64_t pe
        # risk merges: (key, klen, rank, kind, val, vlen); right: key = suffix fragment (left side of the merge);
        # left: key = prefix fragment (right side of the merge)
        cdef Py_ssize_t nrr, nlr
        cdef int nl, nr, side
        cdef int32_t ri
        cdef uint32_t* rec
        cdef uint32_t* rr = NULL
        cdef uint32_t* lr = NULL
        if use == NULL:
            raise MemoryError()
        try:
            for t in range(self.ntok + 1):
                use[t] = INT32_MAX
            rr_list = []
            lr_list = []
            for i in range(cap):
                pe = self.ptab[i]
                if pe == UINT64_MAX:
                    continue
                a = <int32_t> (pe >> (PAIR_RANK_BITS + PAIR_ID_BITS))
                b = <int32_t> ((pe >> PAIR_RANK_BITS) & ((1 << PAIR_ID_BITS) - 1))
                r = <int32_t> (pe & NO_RANK)
                if a < 0 or b < 0 or a >= self.ntok or b >= self.ntok:
                    continue
                if r < use[a]:
                    use[a] = r
                if r < use[b]:
                    use[b] = r
                la = self.tok_len[a]
                lb = self.tok_len[b]
                if la <= 0 or lb <= 0:
                    continue
                pa = self.arena + self.tok_off[a]
                pb = self.arena + self.tok_off[b]
                if la <= 3 and _allcont(pa, la) and not (0x80 <= pb[0] < 0xC0):
                    if pb[0] >= 0xC0 and lb < _u8len(pb[0]) and _allcont(pb + 1, lb - 1):
                        rr_list.append((_pack(pa, la), la, r, 2, _pack(pb, lb), lb))
                    else:
                        L = _u8len(pb[0])
                        if lb >= L:
                            rr_list.append((_pack(pa, la), la, r, 0, _pack(pb, L), L))
                if pb[0] >= 0xC0 and lb < _u8len(pb[0]) and _allcont(pb + 1, lb - 1) and pa[la - 1] < 0xC0:
                    if la <= 3 and _allcont(pa, la):
                        lr_list.append((_pack(pb, lb), lb, r, 1, _pack(pa, la), la))
                    else:
                        k = la - 1
                        while k > 0 and 0x80 <= pa[k] < 0xC0 and la - k < 4:
                            k -= 1
                        if not (0x80 <= pa[k] < 0xC0) and _u8len(pa[k]) == la - k:
                            lr_list.append((_pack(pb, lb), lb, r, 0, _pack(pa + k, <int> (la - k)), la - k))
            nrr = len(rr_list)
            nlr = len(lr_list)
            rr = <uint32_t*> malloc((nrr + 1) * 6 * sizeof(uint32_t))
            lr = <uint32_t*> malloc((nlr + 1) * 6 * sizeof(uint32_t))
            if rr == NULL or lr == NULL:
                raise MemoryError()
            for i in range(nrr):
                for k in range(6):
                    rr[6 * i + k] = rr_list[i][k]
            for i in range(nlr):
                for k in range(6):
                    lr[6 * i + k] = lr_list[i][k]
            cbmp = <CharEnt*> _table_alloc(0x10000 * sizeof(CharEnt))
            if cbmp == NULL:
                raise MemoryError()
            for i in range(0x10000):
                cbmp[i].tok = -1
                cbmp[i].risk = -1
                cbmp[i].lmask = 0
                cbmp[i].rmask = 0
            supp = []
            for t in range(self.ntok):
                ln = self.tok_len[t]
                if ln < 2 or ln > 4:
                    continue
                pa = self.arena + self.tok_off[t]
                if pa[0] < 0xC2 or _u8len(pa[0]) != ln or not _allcont(pa + 1, ln - 1):
                    continue
                cp = _dec(pa, 0, &L)
                if cp > 0x10FFFF or _put_utf8(enc, cp) != ln or memcmp(enc, pa, ln) != 0:
                    continue
                # (a): merge the bytes alone, noting the highest rank used
                for k in range(ln):
                    sym[k] = self.byte_id[pa[k]]
                nsym = ln
                R = -1
                while nsym > 1:
                    cur = INT32_MAX
                    bi = -1
                    for k in range(nsym - 1):
                        r = self._prank(sym[k], sym[k + 1])
                        if r < cur:
                            cur = r
                            bi = k
                    if bi < 0:
                        break
                    sym[bi] = self.mnew[cur]
                    for k in range(bi + 1, nsym - 1):
                        sym[k] = sym[k + 1]
                    nsym -= 1
                    if cur > R:
                        R = cur
                if nsym != 1 or sym[0] != t:
                    continue
                if use[t] <= R:                      # (b)
                    continue
                packed = _pack(pa, ln)
                k = nrisk
                nl = 0
                nr = 0
                for side in range(2):
                    for i in range(nlr if side == 0 else nrr):
                        rec = (lr if side == 0 else rr) + 6 * i
                        if <int32_t> rec[2] >= R or rec[1] >= <uint32_t> ln:
                            continue
                        if side == 0:               # key = c[:klen]
                            if (packed & ((1u << (8 * rec[1])) - 1)) != rec[0]:
                                continue
                        elif (packed >> (8 * (ln - rec[1]))) != rec[0]:   # key = c[ln - klen:]
                            continue
                        if nrisk >= riskcap:
                            riskcap = max(64, 2 * riskcap)
                            enew = <RiskEnt*> realloc(ent, riskcap * sizeof(RiskEnt))
                            if enew == NULL:
                                raise MemoryError()
                            ent = enew
                        ent[nrisk].val = rec[4]
                        ent[nrisk].vlen = <uint8_t> rec[5]
                        ent[nrisk].kind = <uint8_t> rec[3]
                        nrisk += 1
                        if side == 0:
                            nl += 1
                        else:
                            nr += 1
                ri = -1
                if nl or nr:
                    if nl > 255 or nr > 255:
                        continue                     # never in practice; stay on the byte path
                    if nhdr >= hdrcap:
                        hdrcap = max(64, 2 * hdrcap)
                        hnew = <RiskHdr*> realloc(hdr, hdrcap * sizeof(RiskHdr))
                        if hnew == NULL:
                            raise MemoryError()
                        hdr = hnew
                    hdr[nhdr].off = <int32_t> k
                    hdr[nhdr].nl = <uint8_t> nl
                    hdr[nhdr].nr = <uint8_t> nr
                    ri = nhdr
                    nhdr += 1
                lm = _risk_mask(ent + k, nl) if ri >= 0 else 0
                rm = _risk_mask(ent + k + nl, nr) if ri >= 0 else 0
                if cp < 0x10000:
                    cbmp[cp].tok = t
                    cbmp[cp].risk = ri
                    cbmp[cp].lmask = lm
                    cbmp[cp].rmask = rm
                else:
                    supp.append((cp, t, ri, lm, rm))
            supp.sort()
            self.ncsupp = len(supp)
            self.csupp_cp = <uint32_t*> malloc((self.ncsupp + 1) * sizeof(uint32_t))
            self.csupp = <CharEnt*> malloc((self.ncsupp + 1) * sizeof(CharEnt))
            if self.csupp_cp == NULL or self.csupp == NULL:
                raise MemoryError()
            for i in range(self.ncsupp):
                self.csupp_cp[i] = supp[i][0]
                self.csupp[i].tok = supp[i][1]
                self.csupp[i].risk = supp[i][2]
                self.csupp[i].lmask = supp[i][3]
                self.csupp[i].rmask = supp[i][4]
            self.risk_hdr = hdr
            self.risk_ent = ent
            self.cbmp = cbmp
            hdr = NULL
            ent = NULL
            cbmp = NULL
        finally:
            free(use)
            free(rr)
            free(lr)
            free(hdr)
            free(ent)
            free(cbmp)
        return 0

    def premerge_table(self):
        """{code point: (token, [(kind, neighbour bytes) left...], [(kind, neighbour bytes) right...])} for the
        characters that may start as their own token (kind: 0 = that character, 1 = a longer multi-byte
        character ending with these bytes, 2 = one starting with them). For tests and diagnostics."""
        cdef Py_ssize_t i, k
        cdef uint32_t cp
        cdef const CharEnt* ce
        cdef const RiskHdr* hd
        cdef const RiskEnt* ren
        cdef dict out = {}
        cdef list left, right, cps
        if self.cbmp == NULL:
            return out
        cps = []
        for i in range(0x10000):
            if self.cbmp[i].tok >= 0:
                cps.append(i)
        for i in range(self.ncsupp):
            cps.append(self.csupp_cp[i])
        for k in range(len(cps)):
            cp = cps[k]
            ce = self._char(cp)
            left = []
            right = []
            if ce.risk >= 0:
                hd = &self.risk_hdr[ce.risk]
                left = _risk_list(self.risk_ent + hd.off, hd.nl)
                right = _risk_list(self.risk_ent + hd.off + hd.nl, hd.nr)
            out[cp] = (ce.tok, left, right)
        return out

    def premerge_stats(self):
        """(characters that may start as their own token, of which with a risk list, risk entries)."""
        cdef Py_ssize_t i, n = 0, nr = 0, ne = 0
        if self.cbmp == NULL:
            return (0, 0, 0)
        for i in range(0x10000):
            if self.cbmp[i].tok >= 0:
                n += 1
                if self.cbmp[i].risk >= 0:
                    nr += 1
                    ne += self.risk_hdr[self.cbmp[i].risk].nl + self.risk_hdr[self.cbmp[i].risk].nr
        for i in range(self.ncsupp):
            n += 1
            if self.csupp[i].risk >= 0:
                nr += 1
                ne += self.risk_hdr[self.csupp[i].risk].nl + self.risk_hdr[self.csupp[i].risk].nr
        return (n, nr, ne)

    # ------------------------------------------------------------ constructors: from_tiktoken, from_vocab, clones
    @staticmethod
    def from_tiktoken(bytes data):
        """Engine from a tiktoken rank file (rank == id); merges derived as HF's exporter does."""
        cdef Engine e = Engine()
        cdef const uint8_t* s = data
        cdef Py_ssize_t n = len(data), i = 0, j, ntok = 0, k, nb = 0
        cdef int64_t rank
        # pass 1: count lines
        for i in range(n):
            if s[i] == 10:
                ntok += 1
        if n and s[n - 1] != 10:
            ntok += 1
        e._alloc_vocab(ntok, n)
        for k in range(ntok + 1):
            e.tok_len[k] = -1
        cdef uint8_t dtab[256]
        memset(dtab, 0xFF, 256)
        cdef const uint8_t* alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
        for k in range(64):
            dtab[alphabet[k]] = k
        cdef uint32_t acc
        cdef int bits
        cdef Py_ssize_t maxrank = -1, count = 0
        i = 0
        while i < n:
            while i < n and (s[i] == 10 or s[i] == 13 or s[i] == 32):
                i += 1
            if i >= n:
                break
            # base64 token
            acc = 0
            bits = 0
            j = nb
            while i < n and s[i] != 32:
                if s[i] != 61:  # '='
                    if dtab[s[i]] == 0xFF:
                        raise ValueError("malformed tiktoken file")
                    acc = (acc << 6) | dtab[s[i]]
                    bits += 6
                    if bits >= 8:
                        bits -= 8
                        e.arena[nb] = (acc >> bits) & 0xFF
                        nb += 1
                i += 1
            i += 1
            rank = 0
            while i < n and 48 <= s[i] <= 57:
                rank = rank * 10 + (s[i] - 48)
                i += 1
            if rank >= ntok or e.tok_len[rank] >= 0:
                raise ValueError("tiktoken ranks must be distinct and 0..n-1")
            e.tok_off[rank] = j
            e.tok_len[rank] = nb - j
            count += 1
            if rank > maxrank:
                maxrank = rank
        if count != maxrank + 1:
            raise ValueError("tiktoken ranks must be 0..n-1")
        e.ntok = count
        e._vinsert_all()
        e._alloc_pairs(count, count)
        e._derive_merges()
        e._build_chars()
        e._finish()
        e._build_junctions()
        return e

    cdef int _derive_merges(self) except -1:
        """For every token (rank order), its merge as the official Qwen files have it: byte-pair merging of its bytes
        with NO rank cap (the adjacent pair whose concatenation has the lowest rank anywhere in the vocabulary, until
        nothing merges); when that ends in the token itself, the pair joined at the last step is its merge, else it
        has none. Capping the ranks below the token gives the same Qwen3 merges but misses 31 Qwen3.5/3.6 ones
        (人力资源, является, ...: pieces that rank above the result); this rule reproduces both official files
        byte for byte (``hf_export`` writes them; tests check their sha256)."""
        cdef int32_t t, r, best, bi, nparts, k, a, b, last_a, last_b
        cdef Py_ssize_t n
        cdef int32_t* starts = <int32_t*> malloc(4098 * sizeof(int32_t))
        cdef int32_t* pr = <int32_t*> malloc(4098 * sizeof(int32_t))
        cdef const uint8_t* p
        if starts == NULL or pr == NULL:
            free(starts); free(pr)
            raise MemoryError()
        try:
            for t in range(self.ntok):
                n = self.tok_len[t]
                if n < 2:
                    continue
                if n > 4096:
                    raise ValueError("token too long")
                p = self.arena + self.tok_off[t]
                nparts = n
                for k in range(n + 1):
                    starts[k] = k
                for k in range(n - 1):
                    r = self._vlookup(p + k, 2)
                    pr[k] = r if r >= 0 else INT32_MAX
                last_a = last_b = -1
                while nparts > 1:
                    best = INT32_MAX
                    bi = -1
                    for k in range(nparts - 1):
                        if pr[k] < best:
                            best = pr[k]
                            bi = k
                    if bi < 0:
                        break
                    last_a = self._vlookup(p + starts[bi], starts[bi + 1] - starts[bi])
                    last_b = self._vlookup(p + starts[bi + 1], starts[bi + 2] - starts[bi + 1])
                    memmove(starts + bi + 1, starts + bi + 2, (nparts - bi - 1) * sizeof(int32_t))
                    if nparts - bi - 2 > 0:
                        memmove(pr + bi + 1, pr + bi + 2, (nparts - bi - 2) * sizeof(int32_t))
                    nparts -= 1
                    if bi + 1 < nparts:
                        r = self._vlookup(p + starts[bi], starts[bi + 2] - starts[bi])
                        pr[bi] = r if r >= 0 else INT32_MAX
                    if bi > 0:
                        r = self._vlookup(p + starts[bi - 1], starts[bi + 1] - starts[bi - 1])
                        pr[bi - 1] = r if r >= 0 else INT32_MAX
                if nparts != 1:
                    # No merge for it, so BPE never produces it (201 of the Qwen3.5/3.6 ranks; none of Qwen3's).
                    self.unmerged += 1
                    continue
                self._pinsert(last_a, last_b, t, t)
        finally:
            free(starts)
            free(pr)
        return 0

    @staticmethod
    def from_vocab(list tokens, const int32_t[:] merges):
        """Engine from token bytes by id (None for holes) and merges as (left, right, new) id triples
        in priority order (flat int32 buffer)."""
        cdef Engine e = Engine()
        cdef Py_ssize_t ntok = len(tokens), nb = 0, t, m, nm = merges.shape[0] // 3
        for tok in tokens:
            if tok is not None:
                nb += len(tok)
        e._alloc_vocab(ntok, nb)
        nb = 0
        cdef const uint8_t* src
        for t in range(ntok):
            tok = tokens[t]
            if tok is None:
                e.tok_len[t] = -1
                e.tok_off[t] = 0
                continue
            src = <bytes> tok
            memcpy(e.arena + nb, src, len(tok))
            e.tok_off[t] = nb
            e.tok_len[t] = len(tok)
            nb += len(tok)
        e._vinsert_all()
        e._alloc_pairs(nm, nm)
        for m in range(nm):
            for t in range(3):
                if not 0 <= merges[3 * m + t] < ntok or e.tok_len[merges[3 * m + t]] < 0:
                    raise ValueError(f"merge {m} names token id {merges[3 * m + t]}, which is not in the vocabulary")
            e._pinsert(merges[3 * m], merges[3 * m + 1], <int32_t> m, merges[3 * m + 2])
        e._build_chars()
        e._finish()
        e._build_junctions()
        return e

    def set_added_tokens(self, list added):
        """``[(content bytes, id), ...]``; matched leftmost-longest before anything else."""
        self.added_list = list(added)
        added = sorted(added, key=lambda x: -len(x[0]))
        free(self.add_arena); free(self.add_off); free(self.add_len); free(self.add_id)
        self.nadd = len(added)
        cdef Py_ssize_t nb = sum(len(a) for a, _ in added), k = 0, i
        self.add_arena = <uint8_t*> malloc(max(nb, 1))
        self.add_off = <int64_t*> malloc(max(self.nadd, 1) * sizeof(int64_t))
        self.add_len = <int32_t*> malloc(max(self.nadd, 1) * sizeof(int32_t))
        self.add_id = <int32_t*> malloc(max(self.nadd, 1) * sizeof(int32_t))
        memset(self.add_first, 0, 256)
        cdef const uint8_t* src
        for i in range(self.nadd):
            content, tid = added[i]
            if len(content) == 0:
                raise ValueError("empty added token")
            src = <bytes> content
            memcpy(self.add_arena + k, src, len(content))
            self.add_off[i] = k
            self.add_len[i] = len(content)
            self.add_id[i] = tid
            self.add_first[src[0]] = 1
            k += len(content)
        firsts = [b for b in range(256) if self.add_first[b]]
        self.add_only = firsts[0] if len(firsts) == 1 else -1

    def clone(self):
        """A new engine sharing this one's (read-only) vocabulary and merge tables, with its own copy of the
        added tokens and options, and its own cache and scratch buffers."""
        return self._clone(False)

    cdef Engine _clone(self, bint share_cache):
        """clone(); with share_cache, the new engine uses this engine's piece cache (batch helpers: pieces
        one thread has tokenized are hits for the others; see _piece for why sharing is safe)."""
        cdef Engine e = Engine()
        e.owns = False
        e.owner = self
        e.ntok = self.ntok
        e.unmerged = self.unmerged
        e.arena = self.arena
        e.tok_off = self.tok_off
        e.tok_len = self.tok_len
        e.selfok = self.selfok
        e.vtab = self.vtab
        e.vmask = self.vmask
        e.ptab = self.ptab
        e.pmask = self.pmask
        e.mnew = self.mnew
        e.pbloom = self.pbloom
        e.nrank = self.nrank
        e.mident = self.mident
        memcpy(e.byte_id, self.byte_id, sizeof(self.byte_id))
        e.maxtok = self.maxtok
        e.cbmp = self.cbmp
        e.csupp_cp = self.csupp_cp
        e.csupp = self.csupp
        e.ncsupp = self.ncsupp
        e.risk_hdr = self.risk_hdr
        e.risk_ent = self.risk_ent
        e.jbloom = self.jbloom
        e.jopen = self.jopen
        e.jbyte = self.jbyte
        e.premerge = self.premerge
        e._alloc_cache(not share_cache)
        if share_cache:
            e.cache = self.cache    # owned by this engine, which the clone keeps alive (e.owner)
        e.rule = self.rule
        e.nfc = self.nfc
        e.fast_ascii = self.fast_ascii
        if self.added_list is not None:
            e.set_added_tokens(self.added_list)
        return e

    @property
    def piece_cache_misses(self):
        """Cacheable pieces this engine looked up in its piece cache and did not find (since it was made)."""
        return self.misses

    @property
    def num_tokens(self):
        return self.ntok

    def token_bytes(self, int32_t t):
        if t < 0 or t >= self.ntok or self.tok_len[t] < 0:
            raise IndexError(t)
        return (<char*> self.arena)[self.tok_off[t]:self.tok_off[t] + self.tok_len[t]]

    # ------------------------------------------------------------ BPE of one piece (short and heap merge loops)
    cdef Py_ssize_t _bpe_into(self, const uint8_t* p, Py_ssize_t n, int32_t* dst) noexcept nogil:
        """HF BPE of one piece from its bytes: repeatedly apply the lowest-ranked merge (leftmost on ties).
        Long pieces need _ensure_scratch(n) first."""
        cdef int32_t ids[SHORT_BPE]
        cdef Py_ssize_t k
        if n > SHORT_BPE:
            if n > self.hcap:
                return -1
            for k in range(n):
                self.hsym[k] = self.byte_id[p[k]]
            return self._merge_long(n, dst)
        for k in range(n):
            ids[k] = self.byte_id[p[k]]
        return self._merge_short(ids, n, dst)

    cdef Py_ssize_t _bpe_text(self, const uint8_t* p, Py_ssize_t n, int32_t* dst) noexcept nogil:
        """The same result for a piece of valid UTF-8 text, starting from characters' own tokens where that
        is provably the same (_build_chars). Needs _ensure_scratch(n) first for n > SHORT_BPE."""
        cdef int32_t ids[SHORT_BPE]
        cdef Py_ssize_t m
        if not self.premerge or self.cbmp == NULL:
            return self._bpe_into(p, n, dst)
        if n <= SHORT_BPE:
            m = self._syms(p, n, ids)
            return self._merge_short(ids, m, dst)
        if n > self.hcap:
            return -1
        m = self._syms(p, n, self.hsym)
        if m <= SHORT_BPE:
            memcpy(ids, self.hsym, m * sizeof(int32_t))
            return self._merge_short(ids, m, dst)
        return self._merge_long(m, dst)

    cdef inline const CharEnt* _char(self, uint32_t cp) noexcept nogil:
        cdef Py_ssize_t lo, hi, mid
        if cp < 0x10000:
            return &self.cbmp[cp]
        lo = 0
        hi = self.ncsupp - 1
        while lo <= hi:
            mid = (lo + hi) >> 1
            if self.csupp_cp[mid] == cp:
                return &self.csupp[mid]
            if self.csupp_cp[mid] < cp:
                lo = mid + 1
            else:
                hi = mid - 1
        return NULL

    cdef bint _risky(self, int32_t ri, uint32_t pb, int plen, const uint8_t* q, Py_ssize_t qn) noexcept nogil:
        """Is the character with risk list ri unsafe between neighbour pb (plen bytes, 0: none) and the text
        at q (qn bytes, 0: none)?"""
        cdef const RiskHdr* hd = &self.risk_hdr[ri]
        cdef const RiskEnt* ent = self.risk_ent + hd.off
        cdef int k, nl
        cdef uint32_t nb
        if plen > 0:
            for k in range(hd.nl):
                if _risk_match(&ent[k], pb, plen):
                    return True
        if hd.nr and qn > 0:
            nl = _u8len(q[0])
            nb = _pack(q, nl)
            for k in range(hd.nr):
                if _risk_match(&ent[hd.nl + k], nb, nl):
                    return True
        return False

    cdef inline bint _maybe_risky(self, const CharEnt* ce, uint32_t pb, int plen, const uint8_t* q,
                                  Py_ssize_t qn) noexcept nogil:
        if plen > 0 and (ce.lmask & _rbit(pb)):
            return True
        return qn > 0 and ce.rmask != 0 and (ce.rmask & _rbit(_pack(q, _u8len(q[0])))) != 0

    cdef Py_ssize_t _syms(self, const uint8_t* p, Py_ssize_t n, int32_t* ids) noexcept nogil:
        """Initial symbols of a piece of valid UTF-8: bytes, except safe multi-byte characters as one token."""
        cdef Py_ssize_t i = 0, m = 0, k
        cdef uint8_t b
        cdef int ln
        cdef uint32_t cp, pb = 0, cb
        cdef int plen = 0
        cdef const CharEnt* ce
        while i < n:
            b = p[i]
            if b < 0x80:
                ids[m] = self.byte_id[b]
                m += 1
                pb = b
                plen = 1
                i += 1
                continue
            if 0xE0 <= b < 0xF0:    # three bytes (CJK): cbmp directly (_syms runs only when cbmp exists)
                ln = 3
                cp = ((b & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F)
                cb = b | (<uint32_t> p[i + 1] << 8) | (<uint32_t> p[i + 2] << 16)
                ce = &self.cbmp[cp]
            else:
                cp = _dec(p, i, &ln)
                cb = _pack(p + i, ln)
                ce = self._char(cp)
            if ce != NULL and ce.tok >= 0 and (
                    ce.risk < 0 or not self._maybe_risky(ce, pb, plen, p + i + ln, n - i - ln)
                    or not self._risky(ce.risk, pb, plen, p + i + ln, n - i - ln)):
                ids[m] = ce.tok
                m += 1
            else:
                for k in range(ln):
                    ids[m + k] = self.byte_id[p[i + k]]
                m += ln
            pb = cb
            plen = ln
            i += ln
        return m

    cdef Py_ssize_t _merge_short(self, int32_t* ids, Py_ssize_t m, int32_t* dst) noexcept nogil:
        """Array merge loop over m <= SHORT_BPE initial symbols (ids is clobbered)."""
        cdef int32_t rk[SHORT_BPE]
        cdef Py_ssize_t k, bi
        cdef int32_t best
        for k in range(m - 1):
            self._pprefetch(ids[k], ids[k + 1])
        for k in range(m - 1):
            rk[k] = self._prank(ids[k], ids[k + 1])
        while m > 1:
            bi = qv3_argmin(rk, <int> (m - 1), &best)
            if best == INT32_MAX:
                break
            ids[bi] = best if self.mident else self.mnew[best]
            m -= 1
            if bi + 1 < m:
                memmove(ids + bi + 1, ids + bi + 2, (m - bi - 1) * sizeof(int32_t))
                memmove(rk + bi + 1, rk + bi + 2, (m - bi - 2) * sizeof(int32_t))
                rk[bi] = self._prank(ids[bi], ids[bi + 1])
            if bi > 0:
                rk[bi - 1] = self._prank(ids[bi - 1], ids[bi])
        memcpy(dst, ids, m * sizeof(int32_t))
        return m

    cdef Py_ssize_t _merge_long(self, Py_ssize_t n, int32_t* dst) noexcept nogil:
        """O(n log n) merge loop over the n initial symbols in self.hsym[0:n]: linked list of symbols +
        binary min-heap of (rank, pos)."""
        cdef int32_t* sym = self.hsym
        cdef int32_t* nxt = self.hsym + self.hcap
        cdef int32_t* prv = self.hsym + 2 * self.hcap
        cdef uint64_t* heap = self.hheap
        cdef Py_ssize_t hn = 0, k, c, par, m = 0
        cdef uint64_t item, tmp
        cdef int32_t r, pos, q, rr
        if n > self.hcap:
            return -1
        for k in range(n):
            nxt[k] = k + 1 if k + 1 < n else -1
            prv[k] = k - 1
        for k in range(n - 1):
            r = self._prank(sym[k], sym[k + 1])
            if r != INT32_MAX:
                # push
                item = (<uint64_t> <uint32_t> r << 32) | <uint32_t> k
                c = hn
                hn += 1
                while c > 0:
                    par = (c - 1) >> 1
                    if heap[par] <= item:
                        break
                    heap[c] = heap[par]
                    c = par
                heap[c] = item
        while hn > 0:
            item = heap[0]
            hn -= 1
            # pop: sift down the last element
            tmp = heap[hn]
            c = 0
            while True:
                k = 2 * c + 1
                if k >= hn:
                    break
                if k + 1 < hn and heap[k + 1] < heap[k]:
                    k += 1
                if heap[k] >= tmp:
                    break
                heap[c] = heap[k]
                c = k
            if hn > 0:
                heap[c] = tmp
            r = <int32_t> (item >> 32)
            pos = <int32_t> <uint32_t> item
            if sym[pos] < 0:
                continue
            q = nxt[pos]
            if q < 0:
                continue
            rr = self._prank(sym[pos], sym[q])
            if rr != r:
                continue
            # merge pos and q
            sym[pos] = r if self.mident else self.mnew[r]
            sym[q] = -1
            nxt[pos] = nxt[q]
            if nxt[q] >= 0:
                prv[nxt[q]] = pos
            # new pairs (prev, pos) and (pos, next)
            for k in range(2):
                if k == 0:
                    if prv[pos] < 0:
                        continue
                    q = prv[pos]
                else:
                    q = pos
                if nxt[q] < 0:
                    continue
                rr = self._prank(sym[q], sym[nxt[q]])
                if rr == INT32_MAX:
                    continue
                item = (<uint64_t> <uint32_t> rr << 32) | <uint32_t> q
                c = hn
                hn += 1
                while c > 0:
                    par = (c - 1) >> 1
                    if heap[par] <= item:
                        break
                    heap[c] = heap[par]
                    c = par
                heap[c] = item
        k = 0
        while k >= 0 and k < n:
            dst[m] = sym[k]
            m += 1
            k = nxt[k]
        return m

    # ------------------------------------------------------------ output buffer and the piece pipeline (queue, piece cache)
    cdef int _ensure_scratch(self, Py_ssize_t n) except -1 nogil:
        if n <= self.hcap:
            return 0
        free(self.hsym)
        free(self.hheap)
        self.hcap = 0
        self.hsym = <int32_t*> malloc(3 * (n + 16) * sizeof(int32_t))
        self.hheap = <uint64_t*> malloc((3 * (n + 16) + 4) * sizeof(uint64_t))
        if self.hsym == NULL or self.hheap == NULL:
            with gil:
                raise MemoryError()
        self.hcap = n + 16
        return 0

    cdef inline int _ensure_out(self, Py_ssize_t extra) except -1 nogil:
        cdef Py_ssize_t cap
        cdef int32_t* o
        if self.nout + extra <= self.outcap:
            return 0
        cap = max(self.outcap * 2, self.nout + extra + 1024)
        o = <int32_t*> realloc(self.out, cap * sizeof(int32_t))
        if o == NULL:
            with gil:
                raise MemoryError()
        self.out = o
        self.outcap = cap
        return 0

    cdef inline int _emit1(self, int32_t t) except -1 nogil:
        if self.counting:
            self.counted += 1
        else:
            if self.nout >= self.outcap:
                self._ensure_out(1)
            self.out[self.nout] = t
            self.nout += 1
        return 0

    cdef inline void _prefetch_piece(self, uint64_t h) noexcept nogil:
        """Start the reads _piece and _miss make for a piece of cache hash h: its piece-cache set (two lines)
        and its vocabulary slot."""
        cdef const CacheEnt* ce = &self.cache[(h & ((1 << CACHE_BITS) - 1)) << 1]
        QV3_PREFETCH(ce)
        QV3_PREFETCH(ce + 1)
        QV3_PREFETCH(&self.vtab[h & self.vmask])

    cdef inline int _queue(self, const uint8_t* p, Py_ssize_t n) except -1 nogil:
        """Hand a piece of the segment being scanned to the cache/BPE stage. Pieces wait in a short queue
        whose cache sets are prefetched as they enter it: the scanner's work on the next pieces overlaps the
        memory latency of the cache probes (one cache miss per piece dominated the time otherwise). Output
        order is the pieces' order: the queue is flushed before the scanner returns."""
        cdef uint64_t* w
        cdef uint64_t h = 0
        if n == 1 and self.counting:   # one byte, one token: nothing to look up, and order does not matter
            self.counted += 1
            return 0
        if 2 <= n <= CACHE_KEY:
            w = &self.pq_w[3 * self.npq]
            if not qv3_load_short(p, n, self.seg_end, w):
                _load3(p, n, w)
            h = _hwords(w, n)
            self._prefetch_piece(h)
        elif CACHE_KEY < n <= LC_MAX:           # the long-piece cache's entry (its miss was most of a new long
            h = _hbytes(p, n)                   # piece's lookup)
            if self.lc != NULL:
                QV3_PREFETCH(&self.lc[h & ((1 << LC_BITS) - 1)])
        self.pq_p[self.npq] = p
        self.pq_n[self.npq] = <int32_t> n
        self.pq_h[self.npq] = h
        self.npq += 1
        if self.npq == PIPE:
            return self._flush()
        return 0

    cdef int _flush(self) except -1 nogil:
        cdef int k, n = self.npq
        self.npq = 0
        for k in range(n):
            self._piece(self.pq_p[k], self.pq_n[k], self.pq_h[k], &self.pq_w[3 * k])
        return 0

    cdef inline int _piece(self, const uint8_t* p, Py_ssize_t n, uint64_t h, const uint64_t* w) except -1 nogil:
        """Emit the tokens of one piece (h, w: its cache hash and _load3 words when 2 <= n <= CACHE_KEY): the
        piece cache's hits here (inlined into _flush), the rest in _miss.

        The piece cache may be shared by threads (an engine and its batch helpers run at once): a hit counts
        only when the set's sequence shows that no write overlapped the read (qv3_seq_*), else it is a miss;
        a miss is cached only when the set is free and unchanged since the read (_cache_put). So a result
        never depends on what another thread did, only on the piece."""
        cdef CacheEnt* st
        cdef const CacheEnt* ce
        cdef uint32_t v
        cdef int nids
        if n == 1:
            return self._emit1(self.byte_id[p[0]])
        if n > CACHE_KEY:
            return self._miss(p, n, h, w, NULL, 1)
        st = &self.cache[(h & ((1 << CACHE_BITS) - 1)) << 1]
        v = qv3_seq_begin(&st.seq)
        ce = st
        if not (ce.klen == n and ce.w[0] == w[0] and ce.w[1] == w[1] and ce.w[2] == w[2]):
            ce = st + 1
            if not (ce.klen == n and ce.w[0] == w[0] and ce.w[1] == w[1] and ce.w[2] == w[2]):
                return self._miss(p, n, h, w, st, v)
        nids = ce.nids                  # <= CACHE_IDS even in a torn read: every value written is
        if self.counting:
            if qv3_seq_valid(&st.seq, v):
                self.counted += nids
                return 0
        else:
            self._ensure_out(CACHE_IDS)     # all CACHE_IDS slots: a fixed-size copy is a few moves, no call
            memcpy(self.out + self.nout, ce.ids, CACHE_IDS * sizeof(int32_t))
            if qv3_seq_valid(&st.seq, v):
                self.nout += nids
                return 0
        return self._miss(p, n, h, w, st, v)

    cdef int _miss(self, const uint8_t* p, Py_ssize_t n, uint64_t h, const uint64_t* w, CacheEnt* st,
                   uint32_t v) except -1 nogil:
        """_piece for a piece of two or more bytes the cache did not answer (st: its cache set, NULL when it
        is too long to cache; v: the set's sequence when _piece read it)."""
        cdef int32_t t
        cdef Py_ssize_t m
        if st != NULL:
            self.misses += 1
            t = self._vlookup_h(p, n, h)
            if t >= 0 and self.selfok[t]:
                self._cache_put(st, v, w, n, &t, 1)
                return self._emit1(t)
        else:
            return self._long(p, n, h)
        if n > SHORT_BPE:
            self._ensure_scratch(n)
        self._ensure_out(n)     # counting: scratch space at the end of the (unused) output buffer
        m = self._bpe_text(p, n, self.out + self.nout)
        if m < 0:
            with gil:
                raise MemoryError()
        if st != NULL and m <= CACHE_IDS:
            self._cache_put(st, v, w, n, self.out + self.nout, m)
        if self.counting:
            self.counted += m
        else:
            self.nout += m
        return 0

    cdef int _long(self, const uint8_t* p, Py_ssize_t n, uint64_t h) except -1 nogil:
        """A piece of more than CACHE_KEY bytes: the long-piece cache first (keyed by all its bytes: a piece seen
        before costs one lookup, not a walk over its junctions), else cut where no token spans
        (_build_junctions), each part through the piece cache or, when still long, the long-piece cache and
        BPE; the whole piece's result is then cached. h: _hbytes(p, n) when n <= LC_MAX (0: not known)."""
        cdef Py_ssize_t i, iz, xs = 0, a = 0, st = self.nout
        cdef int64_t c_st = self.counted
        cdef int lx, ly, lz = 0
        cdef uint32_t c0 = 0, x, y, z = 0
        cdef bint hasz
        cdef LongParts q
        q.n = 0
        if self.jbloom == NULL:
            return self._long_part(p, n, h)
        if n <= LC_MAX:
            if h == 0:
                h = _hbytes(p, n)
            if self._lc_hit(p, n, h):
                return 0
        x = _dec(p, 0, &lx)         # n > CACHE_KEY bytes: at least two characters
        i = lx
        y = _dec(p, i, &ly)
        while True:                 # the junction x | y at i; x starts at xs, c0 before it when xs > 0, z after y
            iz = i + ly
            hasz = iz < n
            if hasz:
                z = _dec(p, iz, &lz)
            if self._cut(p + i, xs > 0, c0, x, y, hasz, z):
                self.splits += 1
                self._lp_add(&q, p + a, i - a)
                a = i
            if not hasz:
                break
            c0 = x
            xs = i
            x = y
            y = z
            i = iz
            ly = lz
        if a == 0:                  # no cut: BPE of the whole piece, cached under the same key
            return self._long_bpe(p, n, h, n <= LC_MAX)
        self._lp_add(&q, p + a, n - a)
        self._lp_flush(&q)
        if n <= LC_MAX:             # counting: the count alone (a record encode() does not take)
            if self.counting:
                self._lc_put(p, n, h, NULL, <Py_ssize_t> (self.counted - c_st))
            else:
                self._lc_put(p, n, h, self.out + st, self.nout - st)
        return 0

    cdef inline int _lp_add(self, LongParts* q, const uint8_t* p, Py_ssize_t n) except -1 nogil:
        """Queue a part of a long piece for _lp_flush, prefetching its piece-cache set (as _queue does for the
        scanner's pieces: the parts' probes overlap, where one after another each waited for its cache miss)."""
        cdef uint64_t h = 0
        cdef int k = q.n
        if 2 <= n <= CACHE_KEY:
            _load3(p, n, &q.w[3 * k])
            h = _hwords(&q.w[3 * k], n)
            self._prefetch_piece(h)
        q.p[k] = p
        q.len[k] = <int32_t> n
        q.h[k] = h
        q.n = k + 1
        if q.n == LPIPE:
            return self._lp_flush(q)
        return 0

    cdef int _lp_flush(self, LongParts* q) except -1 nogil:
        """Emit the queued parts in order: one byte as its token, a cacheable part through the piece cache, a
        longer one through the long-piece cache (or BPE)."""
        cdef int k, n = q.n
        q.n = 0
        for k in range(n):
            if q.len[k] == 1:
                self._emit1(self.byte_id[q.p[k][0]])
            elif q.len[k] <= CACHE_KEY:
                self._piece(q.p[k], q.len[k], q.h[k], &q.w[3 * k])
            else:
                self._long_part(q.p[k], q.len[k], 0)
        return 0

    cdef int _long_part(self, const uint8_t* p, Py_ssize_t n, uint64_t h) except -1 nogil:
        """A long piece no junction cuts: the long-piece cache (keyed by all its bytes), else BPE. h: as _long's."""
        if n <= LC_MAX:
            if h == 0:
                h = _hbytes(p, n)
            if self._lc_hit(p, n, h):
                return 0
        return self._long_bpe(p, n, h, n <= LC_MAX)

    cdef bint _lc_hit(self, const uint8_t* p, Py_ssize_t n, uint64_t h) except -1 nogil:
        """Emit the long piece p[0:n] (hash h) from the long-piece cache; False when it does not hold it (or
        holds only its count and ids are wanted)."""
        cdef LongEnt* le
        cdef uint8_t* rec
        if self.lc == NULL:
            self._lc_alloc()
        le = &self.lc[h & ((1 << LC_BITS) - 1)]
        if le.h != h or (le.n & LC_LEN) != n or self.lc_pos - le.pos > LC_ARENA:
            return False
        if not self.counting and (le.n & LC_COUNT_ONLY):
            return False
        rec = self.lc_ring + (le.pos & (LC_ARENA - 1))
        if memcmp(rec, p, n) != 0:
            return False
        self.long_hits += 1
        if self.counting:
            self.counted += le.nids
        else:
            self._ensure_out(le.nids)
            memcpy(self.out + self.nout, rec + ((n + 3) & ~3), le.nids * sizeof(int32_t))
            self.nout += le.nids
        return True

    cdef int _lc_put(self, const uint8_t* p, Py_ssize_t n, uint64_t h, const int32_t* ids, Py_ssize_t m) \
            except -1 nogil:
        """Cache the long piece p[0:n] (hash h, n <= LC_MAX) with its m ids, or (ids NULL) its count m alone."""
        cdef Py_ssize_t size = ((n + 3) & ~3) + (m * <Py_ssize_t> sizeof(int32_t) if ids != NULL else 0)
        cdef LongEnt* le
        cdef uint8_t* rec
        if self.lc == NULL:
            self._lc_alloc()
        le = &self.lc[h & ((1 << LC_BITS) - 1)]
        if (self.lc_pos & (LC_ARENA - 1)) + size > LC_ARENA:
            self.lc_pos = (self.lc_pos | (LC_ARENA - 1)) + 1    # wrap: the record never straddles the end
        rec = self.lc_ring + (self.lc_pos & (LC_ARENA - 1))
        memcpy(rec, p, n)
        if ids != NULL:
            memcpy(rec + ((n + 3) & ~3), ids, m * sizeof(int32_t))
        le.h = h
        le.n = <uint32_t> n | (0 if ids != NULL else LC_COUNT_ONLY)
        le.nids = <uint32_t> m
        le.pos = self.lc_pos
        self.lc_pos += size
        return 0

    cdef int _long_bpe(self, const uint8_t* p, Py_ssize_t n, uint64_t h, bint cache) except -1 nogil:
        """A long piece by its own vocabulary entry or BPE (cached when cache: its hash is h)."""
        cdef int32_t t
        cdef Py_ssize_t m
        if n <= self.maxtok:
            t = self._vlookup_h(p, n, h) if cache else self._vlookup(p, n)
            if t >= 0 and self.selfok[t]:
                return self._emit1(t)
        if n > SHORT_BPE:
            self._ensure_scratch(n)
        self._ensure_out(n)     # counting: scratch space at the end of the (unused) output buffer
        m = self._bpe_text(p, n, self.out + self.nout)
        if m < 0:
            with gil:
                raise MemoryError()
        if cache:
            self._lc_put(p, n, h, self.out + self.nout, m)
        if self.counting:
            self.counted += m
        else:
            self.nout += m
        return 0

    cdef int _lc_alloc(self) except -1 nogil:
        # calloc: zero pages as they are touched, 4 KiB at a time (a huge page would cost its 2 MiB of
        # zeroing on the first long piece of every fresh engine)
        self.lc = <LongEnt*> calloc(1 << LC_BITS, sizeof(LongEnt))
        self.lc_ring = <uint8_t*> calloc(LC_ARENA, 1)
        if self.lc == NULL or self.lc_ring == NULL:
            with gil:
                raise MemoryError()
        self.lc_pos = 2 * LC_ARENA      # an entry never written (pos 0) is never intact: lc_pos - 0 > LC_ARENA
        return 0

    cdef inline void _cache_put(self, CacheEnt* st, uint32_t v, const uint64_t* w, Py_ssize_t n,
                                const int32_t* ids, Py_ssize_t m) noexcept nogil:
        """Cache a piece's ids (m <= CACHE_IDS) as the first entry of its set st, the old first entry moving
        to the second way; skipped when another thread holds the set or changed it since the reader's v."""
        if not qv3_seq_lock(&st.seq, v):
            return
        if st.klen:
            memcpy(st + 1, st, sizeof(CacheEnt))    # copies the odd seq too: the second entry's is unused
        st.w[0] = w[0]
        st.w[1] = w[1]
        st.w[2] = w[2]
        st.klen = <uint8_t> n
        st.nids = <uint8_t> m
        memcpy(st.ids, ids, m * sizeof(int32_t))
        qv3_seq_unlock(&st.seq, v)

    # ------------------------------------------------------------ split scanner (pre-tokenizer), then NFC, segments, texts
    cdef int _scan(self, const uint8_t* s, Py_ssize_t n) except -1 nogil:
        """Split one normalized segment with the Qwen pre-tokenizer regex and BPE every piece."""
        cdef Py_ssize_t i = 0, j, e, lastcr, lastch
        cdef int l0, l1, l2
        cdef uint32_t c0, c1, c2
        cdef uint8_t f0, f1, letter, l_2
        cdef uint8_t LET = (F_L | F_M) if self.rule == 1 else F_L
        cdef uint8_t NOTP = F_WS | F_L | F_N | (F_M if self.rule == 1 else 0)
        cdef uint8_t* cls = CLS
        cdef Py_ssize_t ascii_at = 0 if self.fast_ascii else n
        self.seg_end = s + n
        while i < n:              # each rule finds the end e of the piece at i; one _queue call (inlined)
            if QV3_UNLIKELY(i >= ascii_at):     # ASCII ahead: up to 64 bytes' pieces at once (out of the loop's way)
                e = self._window(s, i, n, &ascii_at)
                if e > i:
                    i = e
                    continue
            c0 = _dec(s, i, &l0)
            f0 = cls[c0]
            e = -1
            # 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
            if c0 == 0x27 and i + l0 < n:
                c1 = _dec(s, i + l0, &l1)
                letter = CI_LETTER[c1] if c1 < 0x180 else 0
                if letter == 115 or letter == 116 or letter == 109 or letter == 100:   # s t m d
                    e = i + l0 + l1
                elif letter != 0 and i + l0 + l1 < n:
                    c2 = _dec(s, i + l0 + l1, &l2)
                    l_2 = CI_LETTER[c2] if c2 < 0x180 else 0
                    if ((letter == 114 or letter == 118) and l_2 == 101) or (letter == 108 and l_2 == 108):
                        e = i + l0 + l1 + l2
            if e < 0:
                # 2. [^\r\n\p{L}\p{N}]?\p{L}+   (qwen35: [\p{L}\p{M}]+)
                j = -1
                if f0 & LET:
                    j = i
                elif not (f0 & (F_L | F_N | F_CRLF)) and i + l0 < n:
                    c1 = _dec(s, i + l0, &l1)
                    if cls[c1] & LET:
                        j = i + l0
                if j >= 0:
                    while j < n:
                        if s[j] < 0x80:      # ASCII: whole runs of ASCII letters at once, no decoding
                            if not (cls[s[j]] & LET):
                                break
                            j += 1
                            j += qv3_ascii_letters(s + j, n - j)
                            continue
                        if s[j] < 0xE0:      # two bytes (Latin, Greek, Cyrillic, Arabic, Hebrew): decoded in place
                            if not (cls[((s[j] & 0x1F) << 6) | (s[j + 1] & 0x3F)] & LET):
                                break
                            j += 2
                            continue
                        c1 = _dec(s, j, &l1)
                        if not (cls[c1] & LET):
                            break
                        if l1 > 1 and c1 < 0x10000 and self.cbmp != NULL:
                            QV3_PREFETCH(&self.cbmp[c1])    # for _syms, a few pieces later
                        j += l1
                    e = j
                elif f0 & F_N:
                    # 3. \p{N}
                    e = i + l0
                else:
                    # 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
                    if not (f0 & NOTP):
                        j = i
                    elif c0 == 0x20 and i + 1 < n:
                        c1 = _dec(s, i + 1, &l1)
                        if not (cls[c1] & NOTP):
                            j = i + 1
                    if j >= 0:
                        while j < n:
                            c1 = _dec(s, j, &l1)
                            if cls[c1] & NOTP:
                                break
                            j += l1
                        while j < n and (s[j] == 10 or s[j] == 13):
                            j += 1
                        e = j
                    else:
                        # whitespace: 5. \s*[\r\n]+   6. \s+(?!\S)   7. \s+
                        j = i
                        lastcr = -1
                        lastch = i
                        while j < n:
                            c1 = _dec(s, j, &l1)
                            if not (cls[c1] & F_WS):
                                break
                            if c1 == 10 or c1 == 13:
                                lastcr = j + 1
                            lastch = j
                            j += l1
                        if lastcr >= 0:
                            e = lastcr
                        elif j >= n:
                            e = n
                        elif lastch > i:
                            e = lastch
                        else:
                            e = i + l0
            self._queue(s + i, e - i)
            i = e
        return self._flush()

    cdef Py_ssize_t _window(self, const uint8_t* s, Py_ssize_t i, Py_ssize_t n, Py_ssize_t* ascii_at) \
            except -1 nogil:
        """_scan at a piece start i in s[0:n]: with 16 ASCII bytes ahead (or only ASCII to the end), the whole
        pieces of the next 64 bytes (qv3_ascii_pieces) go to the queue, and the position after them is
        returned. Else i, and the byte scanner takes the piece: *ascii_at then says where 16 ASCII bytes in a
        row come next (a window over a few ASCII bytes between others costs more than it saves), and _scan
        does not call again before there."""
        cdef uint64_t bm, one, rest
        cdef Py_ssize_t k
        cdef int cut, st, nx
        if n - i >= 16:
            k = qv3_ascii_ahead(s, i, n)
            if k != i:
                ascii_at[0] = k
                return i
        cut = qv3_ascii_pieces(s + i, n - i, n - i <= 64, &bm)
        if cut == 0:
            if n - i < 16:
                ascii_at[0] = n     # the text's last bytes: the byte scanner takes the rest
            return i
        if cut < 64:
            bm &= (<uint64_t> 1 << cut) - 1
        if self.counting:               # pieces of one byte are one token each: counted at once, not queued
            one = bm & ((bm >> 1) | (<uint64_t> 1 << (cut - 1)))
            self.counted += qv3_popcount(one)
            rest = bm & ~one
            while rest:
                st = qv3_ctz(rest)
                rest &= rest - 1
                nx = st + 1 + qv3_ctz((bm >> st >> 1) | (<uint64_t> 1 << (cut - st - 1)))
                self._queue(s + i + st, nx - st)
            return i + cut
        bm &= bm - 1                    # bit 0: the piece at i
        st = 0
        while bm:
            nx = qv3_ctz(bm)
            self._queue(s + i + st, nx - st)
            st = nx
            bm &= bm - 1
        self._queue(s + i + st, cut - st)
        return i + cut

    # ------------------------------------------------------------ NFC
    cdef int _nbuf_reserve(self, Py_ssize_t need) except -1 nogil:
        """Room for need bytes in self.nbuf, keeping its content."""
        cdef Py_ssize_t cap
        cdef uint8_t* b
        if need <= self.ncap:
            return 0
        cap = max(need, self.ncap * 2)
        b = <uint8_t*> realloc(self.nbuf, cap)
        if b == NULL:
            with gil:
                raise MemoryError()
        self.nbuf = b
        self.ncap = cap
        return 0

    cdef inline Py_ssize_t _next_unsafe(self, const uint8_t* s, Py_ssize_t n) noexcept nogil:
        """Offset in s[0:n] of the first character _text recorded as not NFC-safe at or after s, or -1 (s in the
        text's UTF-8; positions are asked for in increasing order)."""
        cdef Py_ssize_t at = s - self.ubase
        while self.upos_i < self.nupos and self.upos[self.upos_i] < at:
            self.upos_i += 1
        if self.upos_i < self.nupos and self.upos[self.upos_i] < at + n:
            return self.upos[self.upos_i] - at
        return -1

    cdef int _upos_push(self, Py_ssize_t m) except -1 nogil:
        cdef Py_ssize_t cap
        cdef Py_ssize_t* q
        if self.nupos == self.upos_cap:
            cap = max(64, 2 * self.upos_cap)
            q = <Py_ssize_t*> realloc(self.upos, cap * sizeof(Py_ssize_t))
            if q == NULL:
                with gil:
                    raise MemoryError()
            self.upos = q
            self.upos_cap = cap
        self.upos[self.nupos] = m
        self.nupos += 1
        return 0

    cdef Py_ssize_t _nfc(self, const uint8_t* s, Py_ssize_t n, Py_ssize_t u) except -1 nogil:
        """NFC of a UTF-8 segment whose first recorded character (_nfc_recorded) is at u, into self.nbuf; returns its length.
        NFC(x + y) = NFC(x) + NFC(y) when y starts with a character that is NFC_QC=Yes with ccc 0 (it has
        a normalization boundary before it), and a run of such characters is its own NFC: so only the chunks
        from the safe character before an unsafe run to the next safe character are normalized (one
        compatibility ideograph or accent no longer sends a whole long text through decomposition and
        composition); the text between them is copied."""
        cdef Py_ssize_t i = 0, o = 0, a, b
        cdef int ln
        while u >= 0:
            a = i + u
            while a > i:                    # back to the safe character before: the unsafe ones may combine with
                a -= 1                      # it (marks in canonical order before u are not recorded: _nfc_recorded)
                while a > i and (s[a] & 0xC0) == 0x80:
                    a -= 1
                if not (CLS[_dec(s, a, &ln)] & F_UNSAFE):
                    break
            b = i + u
            while b < n:
                if not (CLS[_dec(s, b, &ln)] & F_UNSAFE) and b > i + u:
                    break
                b += ln
            self._nbuf_reserve(o + (a - i) + 1)
            memcpy(self.nbuf + o, s + i, a - i)
            o += a - i
            o += self._nfc_span(s + a, b - a, o)
            i = b
            u = self._next_unsafe(s + i, n - i)     # (_text recorded every one NFC may change)
        self._nbuf_reserve(o + (n - i) + 1)
        memcpy(self.nbuf + o, s + i, n - i)
        return o + (n - i)

    cdef Py_ssize_t _nfc_span(self, const uint8_t* s, Py_ssize_t n, Py_ssize_t at) except -1 nogil:
        """NFC of the UTF-8 text s[0:n] (reference tables) into self.nbuf at offset at; returns its length."""
        cdef Py_ssize_t need = n * 4 + 16, i = 0, j, m = 0, k, a, b, d, x, run
        cdef int ln
        cdef uint32_t c, si, tmpc
        cdef uint32_t* u
        cdef uint8_t cc, last
        cdef int64_t comp
        cdef Py_ssize_t starter
        cdef Py_ssize_t counts[256]
        if self.ucap < need * 2:
            free(self.ubuf)
            self.ubuf = <uint32_t*> malloc(need * 2 * sizeof(uint32_t))
            if self.ubuf == NULL:
                self.ucap = 0
                with gil:
                    raise MemoryError()
            self.ucap = need * 2
        u = self.ubuf
        # decompose (at most 4 code points per decomposition, UTF-8 is >= 1 byte per code point)
        while i < n:
            c = _dec(s, i, &ln)
            i += ln
            if SBASE <= c < SBASE + SCOUNT:
                si = c - SBASE
                u[m] = LBASE + si // NCOUNT
                u[m + 1] = VBASE + (si % NCOUNT) // TCOUNT
                m += 2
                if si % TCOUNT:
                    u[m] = TBASE + si % TCOUNT
                    m += 1
            elif (CLS[c] & F_UNSAFE) or c >= 0xC0:
                d = _find_dec(c) if c >= 0xC0 else -1
                if d >= 0:
                    for k in range(DEC_OFF[d], DEC_OFF[d + 1]):
                        u[m] = DEC_DATA[k]
                        m += 1
                else:
                    u[m] = c
                    m += 1
            else:
                u[m] = c
                m += 1
        # canonical ordering: stable sort of each run of non-starters by ccc
        i = 0
        cdef uint32_t* tmpbuf = u + need
        while i < m:
            if CCC[u[i]] == 0:
                i += 1
                continue
            j = i
            while j < m and CCC[u[j]] != 0:
                j += 1
            run = j - i
            if run > 1:
                if run <= 16:
                    for a in range(i + 1, j):
                        tmpc = u[a]
                        b = a - 1
                        while b >= i and CCC[u[b]] > CCC[tmpc]:
                            u[b + 1] = u[b]
                            b -= 1
                        u[b + 1] = tmpc
                else:   # counting sort (linear: adversarial runs of marks stay O(n))
                    memset(counts, 0, sizeof(counts))
                    for a in range(i, j):
                        counts[CCC[u[a]]] += 1
                    x = 0
                    for a in range(256):
                        k = counts[a]
                        counts[a] = x
                        x += k
                    for a in range(i, j):
                        tmpbuf[counts[CCC[u[a]]]] = u[a]
                        counts[CCC[u[a]]] += 1
                    memcpy(u + i, tmpbuf, run * sizeof(uint32_t))
            i = j
        # canonical composition
        k = 0
        starter = -1
        last = 0
        for i in range(m):
            c = u[i]
            cc = CCC[c]
            if starter >= 0 and (last == 0 or last < cc):
                comp = _compose(u[starter], c)
                if comp >= 0:
                    u[starter] = <uint32_t> comp
                    continue
            if cc == 0:
                starter = k
            last = cc
            u[k] = c
            k += 1
        # encode
        self._nbuf_reserve(at + k * 4 + 4)
        x = at
        for i in range(k):
            x += _put_utf8(self.nbuf + x, u[i])
        return x - at

    cdef int _segment(self, const uint8_t* s, Py_ssize_t n, bint check) except -1 nogil:
        """Normalize (when check: the text holds characters that are not NFC-safe, at the offsets _text recorded)
        and split one segment."""
        cdef Py_ssize_t m, u
        if n == 0:
            return 0
        if self.nfc and check:
            u = self._next_unsafe(s, n)
            if u >= 0:
                m = self._nfc(s, n, u)
                return self._scan(self.nbuf, m)
        return self._scan(s, n)

    cdef int _run(self, const uint8_t* s, Py_ssize_t n, bint check) except -1 nogil:
        """Tokenize UTF-8 text: split on the added tokens (leftmost-longest), then every segment (check: the
        text may hold characters that are not NFC-safe; False when its encoder saw none)."""
        cdef Py_ssize_t i = 0, seg = 0, a, L
        cdef const uint8_t* hit
        cdef int best
        if self.nadd == 0:
            return self._segment(s, n, check)
        while i < n:
            if self.add_only >= 0:              # Qwen: every added token starts with "<"
                hit = <const uint8_t*> memchr(s + i, self.add_only, n - i)
                if hit == NULL:
                    break
                i = hit - s
            elif not self.add_first[s[i]]:
                i += 1
                continue
            best = -1
            for a in range(self.nadd):          # sorted longest first: the first hit is the longest
                L = self.add_len[a]
                if i + L <= n and memcmp(s + i, self.add_arena + self.add_off[a], L) == 0:
                    best = a
                    break
            if best < 0:
                i += 1
                continue
            self._segment(s + seg, i - seg, check)
            if self.counting:
                self.counted += 1
            else:
                self._ensure_out(1)
                self.out[self.nout] = self.add_id[best]
                self.nout += 1
            i += self.add_len[best]
            seg = i
        return self._segment(s + seg, n - seg, check)

    cdef int _text(self, const Text* t) except -1 nogil:
        """Tokenize one text (its ids appended to the output, or counted); 1 when it holds a lone surrogate,
        whose index goes to badpos (nothing of the text is then emitted in a meaningful way)."""
        cdef Py_ssize_t k, m = 0, need
        cdef uint32_t c
        cdef const uint16_t* u2
        cdef const uint32_t* u4
        cdef const uint8_t* u1
        cdef uint8_t* o
        cdef bint check = False     # a character that is not NFC-safe seen (none below U+0300 is)
        if t.ascii:
            return self._run(<const uint8_t*> t.data, t.len, False)
        need = t.len * (2 if t.kind == 1 else 3 if t.kind == 2 else 4) + 1
        if need > self.u8cap:
            free(self.u8)
            self.u8cap = 0
            self.u8 = <uint8_t*> malloc(need)
            if self.u8 == NULL:
                with gil:
                    raise MemoryError()
            self.u8cap = need
        o = self.u8
        self.nupos = 0
        if t.kind == 1:
            u1 = <const uint8_t*> t.data
            for k in range(t.len):
                m += _put_utf8(o + m, u1[k])
        elif t.kind == 2:
            u2 = <const uint16_t*> t.data
            k = 0
            while True:
                k += qv3_ucs2_run(u2 + k, t.len - k, o, &m, BMP_STOP)
                if k >= t.len:
                    break
                c = u2[k]           # a surrogate, or a character that is not NFC-safe
                if 0xD800 <= c < 0xE000:
                    self.badpos = k
                    return 1
                if _nfc_recorded(c, u2[k - 1] if k > 0 else 0):
                    check = True
                    self._upos_push(m)
                m += _put_utf8(o + m, c)
                k += 1
        else:
            u4 = <const uint32_t*> t.data
            for k in range(t.len):
                c = u4[k]
                if 0xD800 <= c < 0xE000:
                    self.badpos = k
                    return 1
                if _nfc_unsafe(c) and _nfc_recorded(c, u4[k - 1] if k > 0 else 0):
                    check = True
                    self._upos_push(m)
                m += _put_utf8(o + m, c)
        self.ubase = o
        self.upos_i = 0
        return self._run(o, m, check)

    # ------------------------------------------------------------ batches (worker threads) and the Python API
    cdef int _drain(self, Batch* b, bint helper) except -1 nogil:
        """Tokenize texts of the batch until none is left (any number of engines drain one batch at once); a
        helper thread's engine then counts itself out (qv3_exit: its last result is written)."""
        cdef Py_ssize_t k, k0, k1 = 0, i, st
        cdef int rc
        self.counting = b.counting
        while True:
            k0 = qv3_claim(&b.next, b.n, b.chunk, b.div, &k1)
            if k0 >= b.n:
                break
            for k in range(k0, k1):
                i = b.order[k] if b.order != NULL else k
                self.counted = 0
                st = self.nout
                rc = self._text(&b.texts[i])
                if rc == 1:
                    b.bad[k] = self.badpos + 1
                    self.nout = st
                    continue
                if b.counting:
                    b.res[k] = self.counted
                else:
                    b.res[k] = self.nout - st
                    b.start[k] = st
            if not b.counting:
                # this chunk's lists now, while the other threads tokenize (the GIL is needed for lists only)
                with gil:
                    self._lists(b, k0, k1)
                self.nout = 0
        self.counting = False
        if helper:
            qv3_exit(&b.exited)
        return 0

    cdef int _lists(self, Batch* b, Py_ssize_t k0, Py_ssize_t k1) except -1:
        """encode_batch: the id lists of positions [k0, k1), which this engine has just tokenized, into the
        batch's result list."""
        cdef list lists = <list> b.lists
        cdef list table = <list> b.table
        cdef Py_ssize_t k
        for k in range(k0, k1):
            if not b.bad[k]:
                lists[b.order[k] if b.order != NULL else k] = qv3_ids_list(self.out + b.start[k], b.res[k], table)
        return 0

    def _work(self, _Batch batch):
        """A helper thread's share of a batch, without the GIL (nothing when the batch is already closed: the
        calling thread drained it alone)."""
        if not qv3_enter(&batch.c.entered):
            return
        try:
            with nogil:
                self._drain(&batch.c, True)
        except BaseException:
            batch.c.failed = True
            qv3_exit(&batch.c.exited)
            raise

    cdef void _release(self) noexcept:
        """Give back large scratch buffers after a call (a 10 MB text must not pin 40 MB per engine)."""
        self.nout = 0
        if self.outcap > (1 << 20):
            free(self.out)
            self.out = NULL
            self.outcap = 0
        if self.u8cap > (1 << 22):
            free(self.u8)
            self.u8 = NULL
            self.u8cap = 0

    cdef list _ids(self, Py_ssize_t start, Py_ssize_t n):
        """The output ids [start, start + n) as a list of int. The int objects come from a table shared by the
        engine and its clones (built on the first encode: ~5 MB for Qwen's 151k tokens), so a list costs a
        reference per id instead of a new int object per id (encode; encode_batch: _lists)."""
        return qv3_ids_list(self.out + start, n, self._id_table())

    cdef list _id_table(self):
        cdef Engine root = self
        while root.owner is not None:
            root = root.owner
        if root.id_objects is None:
            top = max([self.ntok] + [i + 1 for _, i in (self.added_list or [])])
            root.id_objects = list(range(top))
        return root.id_objects

    # ------------------------------------------------------------ public
    def encode(self, text):
        """Token ids of ``text`` (str)."""
        cdef Text t
        _text_of(text, &t, -1)
        self.counting = False
        self.nout = 0
        try:
            if self._text(&t) == 1:
                raise _surrogate_error(text, self.badpos, -1)
            return self._ids(0, self.nout)
        finally:
            self._release()

    def count(self, text):
        """Number of tokens of ``text`` (str); no ids are materialised."""
        cdef Text t
        _text_of(text, &t, -1)
        self.counting = True
        self.counted = 0
        self.nout = 0
        try:
            if self._text(&t) == 1:
                raise _surrogate_error(text, self.badpos, -1)
            return self.counted
        finally:
            self.counting = False
            self._release()

    def count_batch(self, texts, int threads=1):
        """Token counts of a sequence of str, in order; ``threads`` > 1 spreads them over that many threads
        (see _batch)."""
        cdef _Batch b = _Batch(texts, True)
        self._batch(b, threads)
        return qv3_counts_list(b.c.res, b.c.order, b.c.n)

    def encode_batch(self, texts, int threads=1):
        """Token ids of a sequence of str, in order (``threads`` as for count_batch)."""
        cdef _Batch b = _Batch(texts, False)
        b.table = self._id_table()
        b.c.table = <void*> b.table
        self._batch(b, threads)
        return b.lists

    cdef int _batch(self, _Batch b, int threads) except -1:
        """Run a batch: b's result arrays (and, encoding, its lists) hold the results.

        With threads <= 1, or a batch too small to be worth a thread (MIN_PARALLEL code points), this engine
        runs it in the calling thread, holding the GIL like ``count``. Otherwise ``threads`` helper engines
        (clones: shared vocabulary and piece cache, kept for later batches) drain it together, the calling
        thread being one of them, without the GIL, taking runs of consecutive texts (longest texts first when
        a few of them are a large part of the work) so that the threads finish together; encoding, each
        worker builds the lists of the run it has just tokenized, holding the GIL meanwhile (_drain). Results
        do not depend on the number of threads: each text is tokenized whole by one engine with this
        engine's options and added tokens. A second batch on the same engine waits for the first."""
        cdef list workers = [self]
        cdef Engine w
        cdef Py_ssize_t k, i, first = -1, pos = 0
        cdef bint done
        threads = min(threads, b.c.n)
        try:
            if threads <= 1 or b.units < MIN_PARALLEL:
                self.nout = 0
                b.c.chunk = max(b.c.n, 1)
                b.c.div = 1
                self._drain(&b.c, False)
            else:
                if self.batch_lock is None:
                    self.batch_lock = threading.Lock()
                with self.batch_lock:
                    if self.helpers is None:
                        self.helpers = []
                    while len(self.helpers) < threads:
                        self.helpers.append(self._clone(True))
                    workers = self.helpers[:threads]
                    for w in workers:
                        w.nout = 0
                        w.rule = self.rule            # options set on this engine after its helpers were made
                        w.nfc = self.nfc
                        w.fast_ascii = self.fast_ascii
                        w.premerge = self.premerge
                        if w.added_list != self.added_list:
                            w.set_added_tokens(self.added_list or [])
                    if b.longest * threads * 16 > b.units:
                        b.longest_first()   # some text is a large part of a worker's share: longest first
                    # runs of consecutive positions: few atomic operations, and each worker writes its own
                    # runs of the result arrays; at most 1/32 of a worker's share, and shrinking with what is
                    # left (1/4 of it per worker), so that the workers end together
                    b.c.chunk = max(1, min(64, b.c.n // (32 * threads)))
                    b.c.div = 4 * threads
                    futures = [_thread_pool(threads - 1).submit(workers[k]._work, b) for k in range(1, threads)]
                    errors = []
                    try:
                        w = workers[0]
                        with nogil:
                            w._drain(&b.c, False)
                    except BaseException as exc:
                        errors.append(exc)
                    # every helper is done with the batch before its arrays go away: those that entered it
                    # are waited for here (briefly spinning: they are finishing their last runs); a helper
                    # that has not started by now will find the batch closed and return at once
                    with nogil:
                        done = qv3_wait(&b.c.exited, qv3_close(&b.c.entered), SPIN_NS)
                    if not done or errors or b.c.failed:
                        for f in futures:
                            try:
                                f.result()
                            except BaseException as exc:
                                errors.append(exc)
                    if errors:
                        raise errors[0]
        finally:
            for w in workers:
                w._release()
        for k in range(b.c.n):           # the first text (in input order) with a lone surrogate
            i = b.c.order[k] if b.c.order != NULL else k
            if b.c.bad[k] and (first < 0 or i < first):
                first = i
                pos = b.c.bad[k] - 1
        if first >= 0:
            raise _surrogate_error(b.texts[first], pos, first)
        return 0


_POOL = None
_POOL_KEY = None
_POOL_LOCK = threading.Lock()


# ================================================================ batch plumbing, helpers, probes
def _thread_pool(int workers):
    """The process's batch worker threads (created on first use, grown on demand, re-created in a forked
    child, whose copy of the parent's pool has no threads)."""
    global _POOL, _POOL_KEY
    with _POOL_LOCK:
        if _POOL is None or _POOL_KEY[0] != os.getpid() or _POOL_KEY[1] < workers:
            from concurrent.futures import ThreadPoolExecutor

            if _POOL is not None and _POOL_KEY[0] == os.getpid():
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qwen_v3_calculator")
            _POOL_KEY = (os.getpid(), workers)
        return _POOL


cdef inline int _text_ptr(PyObject* s, Text* t) noexcept:
    """t = the str s's representation: 0; 1: s is not a str; -1: the str could not be made ready (exception
    set; only legacy strings of Python < 3.12 need it)."""
    if not PyUnicode_Check(s):
        return 1
    if PyUnicode_READY(s) < 0:
        return -1
    t.data = PyUnicode_DATA(s)
    t.len = PyUnicode_GET_LENGTH(s)
    t.kind = PyUnicode_KIND(s)
    t.ascii = PyUnicode_IS_ASCII(s)
    return 0


cdef int _text_of(object s, Text* t, Py_ssize_t index) except -1:
    cdef int rc = _text_ptr(<PyObject*> s, t)
    if rc == 1:
        name = "text" if index < 0 else f"texts[{index}]"
        raise TypeError(f"{name} must be str, not {type(s).__name__}")
    return rc       # 0, or -1 with the exception set


ctypedef struct _LenIdx:
    Py_ssize_t len
    Py_ssize_t idx


cdef int _longer_first(const void* a, const void* b) noexcept nogil:
    cdef Py_ssize_t x = (<const _LenIdx*> a).len, y = (<const _LenIdx*> b).len
    if x != y:
        return -1 if x > y else 1
    x = (<const _LenIdx*> a).idx
    y = (<const _LenIdx*> b).idx
    return -1 if x < y else (1 if x > y else 0)


cdef class _Batch:
    """The texts of one batch call (references held while threads read them) and its result arrays."""
    cdef Batch c
    cdef tuple texts
    cdef Py_ssize_t units         # code points of all texts
    cdef Py_ssize_t longest       # of the longest text
    cdef list lists               # encode: the result (filled by the workers, see Batch.lists)
    cdef list table               # encode: the id -> int table (kept alive while workers read it)

    def __cinit__(self, texts, bint counting):
        cdef Py_ssize_t i, n
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of str, not a single " + type(texts).__name__)
        self.texts = tuple(texts)
        n = len(self.texts)
        memset(&self.c, 0, sizeof(Batch))
        self.c.n = n
        self.c.counting = counting
        self.c.texts = <Text*> calloc(max(n, 1), sizeof(Text))
        self.c.res = <int64_t*> calloc(max(n, 1), sizeof(int64_t))
        self.c.bad = <int64_t*> calloc(max(n, 1), sizeof(int64_t))
        if not counting:
            self.c.start = <int64_t*> calloc(max(n, 1), sizeof(int64_t))
            self.lists = [None] * n
            self.c.lists = <void*> self.lists
        if (self.c.texts == NULL or self.c.res == NULL or self.c.bad == NULL
                or (not counting and self.c.start == NULL)):
            raise MemoryError()
        self.units = 0
        self.longest = 0
        for i in range(n):          # a tight loop over borrowed references (the tuple holds them)
            if _text_ptr(PyTuple_GET_ITEM(self.texts, i), &self.c.texts[i]) != 0:
                _text_of(self.texts[i], &self.c.texts[i], i)        # raises the error
            self.units += self.c.texts[i].len
            if self.c.texts[i].len > self.longest:
                self.longest = self.c.texts[i].len

    cdef int longest_first(self) except -1:
        cdef Py_ssize_t i, n = self.c.n
        cdef _LenIdx* tmp = <_LenIdx*> malloc(max(n, 1) * sizeof(_LenIdx))
        self.c.order = <Py_ssize_t*> malloc(max(n, 1) * sizeof(Py_ssize_t))
        if tmp == NULL or self.c.order == NULL:
            free(tmp)
            raise MemoryError()
        for i in range(n):
            tmp[i].len = self.c.texts[i].len
            tmp[i].idx = i
        qsort(tmp, n, sizeof(_LenIdx), _longer_first)
        for i in range(n):
            self.c.order[i] = tmp[i].idx
        free(tmp)
        return 0

    def __dealloc__(self):
        free(self.c.texts); free(self.c.res); free(self.c.bad); free(self.c.start)
        free(self.c.order)


def _portable_ascii(bint on):
    """Tests: the ASCII window's portable loops (a CPU without SSE2) instead of SSE2; returns the old value."""
    global qv3_portable
    cdef bint old = qv3_portable
    qv3_portable = on
    return old


def _surrogate_error(str text, Py_ssize_t pos, Py_ssize_t index):
    name = "text" if index < 0 else f"texts[{index}]"
    return ValueError(f"{name} contains a lone surrogate at index {pos} (U+{ord(text[pos]):04X}), which is not "
                      "valid Unicode and cannot be tokenized (the reference tokenizer rejects it too); "
                      "encode/decode the text with errors='replace' first")


def _ascii_letter_run(bytes data):
    """qv3_ascii_letters over data (for tests): the scanner's 8-bytes-at-a-time step."""
    return qv3_ascii_letters(<const uint8_t*> data, len(data))


def _probe(Py_ssize_t table_bytes, Py_ssize_t reads, barrier=None):
    """A machine probe for benchmarks/bench_calculator.py (not the tokenizer): ``reads`` steps of a xorshift
    generator, each also reading 8 bytes at a random place of a zeroed table of ``table_bytes`` (allocated like
    the engine's tables and touched first), or only the arithmetic when table_bytes is 0; without the GIL, so
    that threads run it at once (``barrier``: a threading.Barrier passed once the table is ready). Returns
    (checksum, seconds of the loop). Its speed on two CPUs at once against one CPU says what the machine gave two
    threads at that moment (a reference for a batch's speedup, not a bound: the tokenizer's reads are less
    scattered)."""
    cdef uint64_t x = 88172645463325252ULL, s = 0, mask = 0
    cdef Py_ssize_t i, words = 0
    cdef uint64_t* t = NULL
    cdef double t0, t1
    if table_bytes > 0:
        words = 1
        while words * 2 * 8 <= table_bytes:
            words *= 2
        mask = words - 1
        t = <uint64_t*> _table_alloc(words * 8)
        if t == NULL:
            raise MemoryError()
        for i in range(0, words, 512):
            t[i] = i
    try:
        if barrier is not None:
            barrier.wait()
        with nogil:
            t0 = qv3_now()
            for i in range(reads):
                x ^= x << 13
                x ^= x >> 7
                x ^= x << 17
                s += x
                if t != NULL:
                    s += t[x & mask]
            t1 = qv3_now()
    finally:
        free(t)
    return s, t1 - t0
