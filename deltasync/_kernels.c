/* Hot loops of the chunk codec (deltasync/format/codec.py), as a CPython extension module.
 *
 * deltasync/_kernels_py.py is the pure-numpy twin of every function here: same arguments,
 * byte-identical results, the same inputs refused (tests/test_codec.py checks both). The
 * codec uses this module when it imports and the twin otherwise, so everything below is an
 * optimisation, never a format decision of its own; the layouts are documented in codec.py.
 *
 * Every loop runs without the GIL, so the codec's thread pools scale. Malformed input data
 * raises ValueError (the codec turns it into CorruptObjectError); nothing reads or writes
 * outside the buffers it was given.
 *
 * Bit streams are LSB-first: bit i is (byte[i / 8] >> (i % 8)) & 1. A unary code of q is q
 * zero bits then a one. Streams are padded with zero bits to whole bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "deltasync._kernels supports little-endian hosts only (numpy fallback elsewhere)"
#endif

#define MAX_RICE_K 31
#define PAD 16 /* zero bytes after every scratch bit buffer, so 8-byte loads never run off it */
#define PREFETCH 2048 /* bytes ahead that the scan asks for (prefetches never fault) */

/* -- small helpers ----------------------------------------------------------------------- */

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static inline uint64_t load_elem(const uint8_t *p, int w) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)w);
    return v;
}

static inline void store_elem(uint8_t *p, uint64_t v, int w) { memcpy(p, &v, (size_t)w); }

static inline int bitlen(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

static inline uint64_t width_mask(int w) { return w == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * w)) - 1); }

static inline uint64_t zigzag(uint64_t d, int w) {
    int shift = 64 - 8 * w;
    int64_t s = (int64_t)(d << shift) >> shift; /* sign-extend the w-byte difference */
    return ((uint64_t)s << 1 ^ (uint64_t)(s >> 63)) & width_mask(w);
}

static inline uint64_t unzigzag(uint64_t z) { return (z >> 1) ^ (0 - (z & 1)); }

/* Appends bits to a stream a 32-bit word at a time (no read-modify-write of memory). */
typedef struct {
    uint8_t *p;
    uint64_t acc;
    int n; /* bits in acc, < 32 between calls */
} BitWriter;

static inline void bw_put(BitWriter *w, uint64_t v, int nbits) { /* v < 2**nbits, nbits <= 32 */
    w->acc |= v << w->n;
    w->n += nbits;
    if (w->n >= 32) {
        uint32_t word = (uint32_t)w->acc;
        memcpy(w->p, &word, 4);
        w->p += 4;
        w->acc >>= 32;
        w->n -= 32;
    }
}

static inline void bw_put_wide(BitWriter *w, uint64_t v, int nbits) { /* nbits <= 64 */
    if (nbits > 32) {
        bw_put(w, v & 0xFFFFFFFFu, 32);
        bw_put(w, v >> 32, nbits - 32);
    } else {
        bw_put(w, v, nbits);
    }
}

static inline void bw_unary(BitWriter *w, uint64_t q) { /* q zero bits, then a one */
    if (q >= 64) { /* complete the current word, then whole zero words */
        int fill = 32 - w->n;
        bw_put(w, 0, fill);
        q -= (uint64_t)fill;
        uint64_t words = q / 32;
        memset(w->p, 0, (size_t)words * 4);
        w->p += words * 4;
        q -= words * 32;
    }
    for (; q >= 31; q -= 31) bw_put(w, 0, 31);
    bw_put(w, (uint64_t)1 << q, (int)q + 1);
}

static inline void bw_flush(BitWriter *w) {
    for (; w->n > 0; w->n -= 8) {
        *w->p++ = (uint8_t)w->acc;
        w->acc >>= 8;
    }
}

static inline uint64_t get_bits57(const uint8_t *buf, uint64_t pos, int n) {
    uint64_t v = load64(buf + (pos >> 3)) >> (pos & 7);
    return n == 0 ? 0 : (v & (((uint64_t)1 << n) - 1));
}

static inline uint64_t get_bits(const uint8_t *buf, uint64_t pos, int n) {
    if (n > 32) return get_bits57(buf, pos, 32) | (get_bits57(buf, pos + 32, n - 32) << 32);
    return get_bits57(buf, pos, n);
}

/* A copy of ``src`` followed by PAD zero bytes (bit readers load 8 bytes at a time). */
static uint8_t *padded_copy(const void *src, size_t len) {
    uint8_t *p = (uint8_t *)malloc(len + PAD);
    if (p) {
        if (len) memcpy(p, src, len);
        memset(p + len, 0, PAD);
    }
    return p;
}

/* Bits ``nbits`` .. 8*len of a ``len``-byte stream must be zero padding, and nothing more. */
static int exact_padding(const uint8_t *buf, size_t len, uint64_t nbits) {
    if (len != (nbits + 7) / 8) return 0;
    if (nbits & 7) return (buf[len - 1] >> (nbits & 7)) == 0;
    return 1;
}

static int check_width(int w) {
    if (w == 1 || w == 2 || w == 4 || w == 8) return 1;
    PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8, got %d", w);
    return 0;
}

/* Buffers: a read-only or writable C-contiguous view, released by the caller. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS);
}

/* -- scan: one pass over target and base ------------------------------------------------- */

typedef struct {
    uint32_t *idx;
    uint8_t *tv, *bv;
    size_t len, cap;
} Changes;

static int changes_reserve(Changes *c, size_t need, int w) {
    if (need <= c->cap) return 1;
    size_t cap = c->cap ? c->cap : 256;
    while (cap < need) cap *= 2;
    uint32_t *idx = (uint32_t *)realloc(c->idx, cap * sizeof(uint32_t));
    if (!idx) return 0;
    c->idx = idx;
    uint8_t *tv = (uint8_t *)realloc(c->tv, cap * (size_t)w);
    if (!tv) return 0;
    c->tv = tv;
    uint8_t *bv = (uint8_t *)realloc(c->bv, cap * (size_t)w);
    if (!bv) return 0;
    c->bv = bv;
    c->cap = cap;
    return 1;
}

#if defined(__SSE2__) && !defined(DELTASYNC_PORTABLE) /* PORTABLE: test the plain C path */
#define BASELINE_SIMD "sse2"
#include <emmintrin.h>

static inline __m128i ld(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

/* Bit j set iff element j of the 64 elements at t and b differs (SSE2: x86-64 baseline). */
static inline uint64_t change_mask64(const uint8_t *t, const uint8_t *b, int w) {
    uint64_t eq = 0;
    if (w == 1) {
        for (int q = 0; q < 4; q++)
            eq |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(ld(t + 16 * q), ld(b + 16 * q))) << (16 * q);
    } else if (w == 2) {
        for (int q = 0; q < 4; q++) {
            const uint8_t *tq = t + 32 * q, *bq = b + 32 * q;
            __m128i e0 = _mm_cmpeq_epi16(ld(tq), ld(bq)), e1 = _mm_cmpeq_epi16(ld(tq + 16), ld(bq + 16));
            eq |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_packs_epi16(e0, e1)) << (16 * q);
        }
    } else if (w == 4) {
        for (int q = 0; q < 4; q++) {
            const uint8_t *tq = t + 64 * q, *bq = b + 64 * q;
            __m128i e0 = _mm_cmpeq_epi32(ld(tq), ld(bq)), e1 = _mm_cmpeq_epi32(ld(tq + 16), ld(bq + 16));
            __m128i e2 = _mm_cmpeq_epi32(ld(tq + 32), ld(bq + 32)), e3 = _mm_cmpeq_epi32(ld(tq + 48), ld(bq + 48));
            __m128i p = _mm_packs_epi16(_mm_packs_epi32(e0, e1), _mm_packs_epi32(e2, e3));
            eq |= (uint64_t)(uint32_t)_mm_movemask_epi8(p) << (16 * q);
        }
    } else {
        for (int q = 0; q < 32; q++) {
            __m128i e = _mm_cmpeq_epi32(ld(t + 16 * q), ld(b + 16 * q));
            e = _mm_and_si128(e, _mm_shuffle_epi32(e, _MM_SHUFFLE(2, 3, 0, 1))); /* both halves equal */
            eq |= (uint64_t)(uint32_t)_mm_movemask_pd(_mm_castsi128_pd(e)) << (2 * q);
        }
    }
    return ~eq;
}
#else
#define BASELINE_SIMD "none"
static inline uint64_t change_mask64(const uint8_t *t, const uint8_t *b, int w) {
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)(load_elem(t + j * w, w) != load_elem(b + j * w, w)) << j;
    return m;
}
#endif

/* Lowest set bit of m (63 when m is 0: a defined garbage value, overwritten later). */
static inline uint32_t low_bit(uint64_t m) { return (uint32_t)__builtin_ctzll(m | ((uint64_t)1 << 63)); }

/* Count changed elements; while the count stays <= limit, also record each one. Returns the
 * count, or -1 when out of memory. Branch-light: the positions of a 64-element mask are
 * written four at a time without asking how many there are (the usual case is 0 or 1). */
#define DEFINE_SCAN(SCAN_ATTR, SCAN_NAME, MASK_FN) \
SCAN_ATTR static inline __attribute__((always_inline)) int64_t SCAN_NAME(const uint8_t *t, const uint8_t *b, size_t n, \
                                                               int w, size_t limit, Changes *c) { \
    size_t count = 0, e = 0; \
    int collect = 1; \
    for (; e + 64 <= n; e += 64) { \
        for (int line = 0; line < w; line++) { /* the hardware prefetcher alone leaves ~25% */ \
            __builtin_prefetch(t + e * (size_t)w + PREFETCH + 64 * line, 0, 2); \
            __builtin_prefetch(b + e * (size_t)w + PREFETCH + 64 * line, 0, 2); \
        } \
        uint64_t m = MASK_FN(t + e * (size_t)w, b + e * (size_t)w, w); \
        size_t cnt = (size_t)__builtin_popcountll(m); \
        count += cnt; \
        if (!collect) continue; \
        if (count > limit) { \
            collect = 0; \
            continue; \
        } \
        if (c->len + 64 > c->cap && !changes_reserve(c, c->len + 64, w)) return -1; \
        uint32_t *out = c->idx + c->len, base = (uint32_t)e; \
        uint8_t *tv = c->tv + c->len * (size_t)w, *bv = c->bv + c->len * (size_t)w; \
        const uint8_t *tg = t + e * (size_t)w, *bg = b + e * (size_t)w; \
        int r = 0; \
        if (count * 16 > e) { /* denser than 1/16 so far: eight slots (a predictable branch) */ \
            for (; r < 8; r++) { \
                uint32_t j = low_bit(m); \
                out[r] = base + j; \
                memcpy(tv + r * w, tg + j * (uint32_t)w, (size_t)w); \
                memcpy(bv + r * w, bg + j * (uint32_t)w, (size_t)w); \
                m &= m - 1; \
            } \
        } else { \
            for (; r < 4; r++) { \
                uint32_t j = low_bit(m); \
                out[r] = base + j; \
                memcpy(tv + r * w, tg + j * (uint32_t)w, (size_t)w); /* j = 63 when m ran out: in the group */ \
                memcpy(bv + r * w, bg + j * (uint32_t)w, (size_t)w); \
                m &= m - 1; \
            } \
        } \
        for (; m; r++) { \
            uint32_t j = low_bit(m); \
            out[r] = base + j; \
            memcpy(tv + r * w, tg + j * (uint32_t)w, (size_t)w); \
            memcpy(bv + r * w, bg + j * (uint32_t)w, (size_t)w); \
            m &= m - 1; \
        } \
        c->len += cnt; \
    } \
    for (; e < n; e++) { \
        if (load_elem(t + e * (size_t)w, w) == load_elem(b + e * (size_t)w, w)) continue; \
        count++; \
        if (!collect) continue; \
        if (count > limit) { \
            collect = 0; \
            continue; \
        } \
        if (c->len + 64 > c->cap && !changes_reserve(c, c->len + 64, w)) return -1; \
        memcpy(c->tv + c->len * (size_t)w, t + e * (size_t)w, (size_t)w); \
        memcpy(c->bv + c->len * (size_t)w, b + e * (size_t)w, (size_t)w); \
        c->idx[c->len++] = (uint32_t)e; \
    } \
    return (int64_t)count; \
}

DEFINE_SCAN(, scan_impl, change_mask64)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DELTASYNC_PORTABLE)
#define HAVE_AVX512 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw")))

/* change_mask64 with AVX-512BW compares straight to mask registers (chosen at run time). */
AVX512 static inline uint64_t change_mask64_avx512(const uint8_t *t, const uint8_t *b, int w) {
    if (w == 1) return _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(t), _mm512_loadu_si512(b));
    uint64_t m = 0;
    for (int q = 0; q < w; q++) {
        __m512i x = _mm512_loadu_si512(t + 64 * q), y = _mm512_loadu_si512(b + 64 * q);
        uint64_t part = w == 2 ? (uint64_t)_mm512_cmpneq_epi16_mask(x, y)
                      : w == 4 ? (uint64_t)_mm512_cmpneq_epi32_mask(x, y)
                               : (uint64_t)_mm512_cmpneq_epi64_mask(x, y);
        m |= part << (q * (64 / w));
    }
    return m;
}
#else
#define HAVE_AVX512 0
#endif

#if HAVE_AVX512
DEFINE_SCAN(AVX512, scan_impl_avx512, change_mask64_avx512)
#endif

static int use_avx512 = 0; /* set once at import */

#if HAVE_AVX512
AVX512 static int64_t scan_any_avx512(const uint8_t *t, const uint8_t *b, size_t n, int w, size_t limit,
                                      Changes *c) {
    switch (w) {
    case 1: return scan_impl_avx512(t, b, n, 1, limit, c);
    case 2: return scan_impl_avx512(t, b, n, 2, limit, c);
    case 4: return scan_impl_avx512(t, b, n, 4, limit, c);
    default: return scan_impl_avx512(t, b, n, 8, limit, c);
    }
}
#endif

static int64_t scan_any(const uint8_t *t, const uint8_t *b, size_t n, int w, size_t limit, Changes *c) {
#if HAVE_AVX512
    if (use_avx512) return scan_any_avx512(t, b, n, w, limit, c);
#endif
    switch (w) {
    case 1: return scan_impl(t, b, n, 1, limit, c);
    case 2: return scan_impl(t, b, n, 2, limit, c);
    case 4: return scan_impl(t, b, n, 4, limit, c);
    default: return scan_impl(t, b, n, 8, limit, c);
    }
}

PyDoc_STRVAR(scan_doc,
             "scan(target, base, width, limit) -> (count, indices, target_values, base_values)\n\n"
             "Changed elements of two equal-length buffers. ``indices`` are u32, the values are the\n"
             "elements' bytes; all three are None when count > limit (then only counted).");

static PyObject *k_scan(PyObject *self, PyObject *args) {
    PyObject *to, *bo;
    int w;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOin:scan", &to, &bo, &w, &limit)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer tb, bb;
    if (get_buffer(to, &tb, 0) < 0) return NULL;
    if (get_buffer(bo, &bb, 0) < 0) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *result = NULL;
    if (tb.len != bb.len || tb.len % w) {
        PyErr_SetString(PyExc_ValueError, "target and base must be equal lengths of whole elements");
        goto done;
    }
    size_t n = (size_t)tb.len / (size_t)w;
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many elements for u32 indices");
        goto done;
    }
    Changes c = {0};
    int64_t count;
    size_t lim = limit < 0 ? 0 : (size_t)limit;
    Py_BEGIN_ALLOW_THREADS
    count = scan_any((const uint8_t *)tb.buf, (const uint8_t *)bb.buf, n, w, lim, &c);
    Py_END_ALLOW_THREADS
    if (count < 0) {
        PyErr_NoMemory();
    } else if ((size_t)count > lim) {
        result = Py_BuildValue("(LOOO)", (long long)count, Py_None, Py_None, Py_None);
    } else {
        /* y# turns a NULL pointer into None: no changes recorded means empty bytes */
        result = Py_BuildValue("(Ly#y#y#)", (long long)count, c.idx ? (const char *)c.idx : "",
                               (Py_ssize_t)(c.len * 4), c.tv ? (const char *)c.tv : "",
                               (Py_ssize_t)(c.len * (size_t)w), c.bv ? (const char *)c.bv : "",
                               (Py_ssize_t)(c.len * (size_t)w));
    }
    free(c.idx);
    free(c.tv);
    free(c.bv);
done:
    PyBuffer_Release(&tb);
    PyBuffer_Release(&bb);
    return result;
}

/* -- Rice-coded gaps between positions --------------------------------------------------- */

/* For k = lo, lo + 1, lo + 2 (each <= MAX_RICE_K): sum over the gaps of ceil((g >> k) / 2),
 * which exceeds m iff the Rice cost m * (1 + k) + sum(g >> k) still drops from k to k + 1, and
 * sum(g >> k), the unary bits. One pass; also checks that the indices increase. */
static int rice_stats(const uint32_t *idx, size_t m, int lo, uint64_t halves[3], uint64_t sums[3]) {
    /* u32 throughout: every sum is at most the sum of the gaps, idx[m - 1] + 1 - m < 2**32 */
    const int k0 = lo, k1 = lo + 1 > MAX_RICE_K ? MAX_RICE_K : lo + 1, k2 = lo + 2 > MAX_RICE_K ? MAX_RICE_K : lo + 2;
    uint32_t g = idx[0], q0 = g >> k0, q1 = g >> k1, q2 = g >> k2;
    uint32_t s0 = q0, s1 = q1, s2 = q2, h0 = (q0 >> 1) + (q0 & 1), h1 = (q1 >> 1) + (q1 & 1), h2 = (q2 >> 1) + (q2 & 1);
    uint32_t bad = 0;
    for (size_t i = 1; i < m; i++) { /* no loop-carried state but the sums: vectorizes */
        uint32_t a = idx[i], p = idx[i - 1], gi = a - p - 1;
        bad |= (uint32_t)(a <= p);
        uint32_t r0 = gi >> k0, r1 = gi >> k1, r2 = gi >> k2;
        s0 += r0, s1 += r1, s2 += r2;
        h0 += (r0 >> 1) + (r0 & 1), h1 += (r1 >> 1) + (r1 & 1), h2 += (r2 >> 1) + (r2 & 1);
    }
    halves[0] = h0, halves[1] = h1, halves[2] = h2;
    sums[0] = s0, sums[1] = s1, sums[2] = s2;
    return !bad;
}

/* The cheapest Rice parameter (the smallest among equals) and its unary bits sum(g >> k).
 * The cost m * (1 + k) + sum(g >> k) is convex in k, so k is the smallest with halves(k) <= m;
 * look around a guess (log2 of the mean gap) in one pass, and move the window (rarely) when
 * the answer is outside it. Returns 0 if the indices do not increase. */
static int rice_choose(const uint32_t *idx, size_t m, int *k, uint64_t *sum_q) {
    uint64_t mean = ((uint64_t)idx[m - 1] + 1 - m) / m, halves[3], sums[3];
    int lo = bitlen(mean) >= 2 ? bitlen(mean) - 2 : 0;
    for (;;) {
        if (!rice_stats(idx, m, lo, halves, sums)) return 0;
        if (lo > 0 && halves[0] <= m) { /* the answer is below lo: a window ending at lo */
            lo = lo >= 2 ? lo - 2 : 0;
            continue;
        }
        int j = halves[0] <= m ? 0 : halves[1] <= m ? 1 : 2;
        if (halves[j] > m && lo + 2 < MAX_RICE_K) { /* the answer is above lo + 2 */
            lo += 3;
            continue;
        }
        *k = lo + j > MAX_RICE_K ? MAX_RICE_K : lo + j;
        *sum_q = sums[j];
        return 1;
    }
}

PyDoc_STRVAR(rice_encode_doc,
             "rice_encode(indices) -> (k, data)\n\n"
             "Strictly increasing u32 positions as Rice-coded gaps (gap = index - previous - 1,\n"
             "previous of the first is -1) with the cheapest k (the smallest among equals): the\n"
             "unary stream of gap >> k, then the k low bits of every gap.");

static PyObject *k_rice_encode(PyObject *self, PyObject *args) {
    PyObject *io;
    if (!PyArg_ParseTuple(args, "O:rice_encode", &io)) return NULL;
    Py_buffer ib;
    if (get_buffer(io, &ib, 0) < 0) return NULL;
    PyObject *result = NULL;
    uint8_t *buf = NULL;
    if (ib.len % 4) {
        PyErr_SetString(PyExc_ValueError, "indices must be u32");
        goto done;
    }
    const uint32_t *idx = (const uint32_t *)ib.buf;
    size_t m = (size_t)ib.len / 4;
    int k = 0, ok = 1, oom = 0;
    uint64_t sum_q = 0, ulen = 0, llen = 0;
    Py_BEGIN_ALLOW_THREADS
    if (m) ok = rice_choose(idx, m, &k, &sum_q);
    if (m && ok) {
        ulen = (sum_q + m + 7) / 8;
        llen = ((uint64_t)m * (uint64_t)k + 7) / 8;
        buf = (uint8_t *)calloc(ulen + llen + PAD, 1);
        oom = !buf;
    }
    if (buf) {
        BitWriter unary = {buf, 0, 0}, low = {buf + ulen, 0, 0};
        uint64_t mask = ((uint64_t)1 << k) - 1;
        int64_t prev = -1;
        for (size_t i = 0; i < m; i++) {
            uint64_t g = (uint64_t)((int64_t)idx[i] - prev - 1);
            prev = idx[i];
            bw_unary(&unary, g >> k);
            bw_put(&low, g & mask, k); /* k <= 31 */
        }
        bw_flush(&unary);
        bw_flush(&low);
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "indices must be strictly increasing");
        goto done;
    }
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("(iy#)", k, buf ? (const char *)buf : "", (Py_ssize_t)(ulen + llen));
done:
    free(buf);
    PyBuffer_Release(&ib);
    return result;
}

PyDoc_STRVAR(rice_decode_doc,
             "rice_decode(data, count, k, n) -> indices\n\n"
             "Inverse of rice_encode: ``count`` u32 positions, each < n. ValueError unless ``data``\n"
             "is exactly what rice_encode writes for some positions.");

static PyObject *k_rice_decode(PyObject *self, PyObject *args) {
    PyObject *dobj;
    Py_ssize_t count, n;
    int k;
    if (!PyArg_ParseTuple(args, "Onin:rice_decode", &dobj, &count, &k, &n)) return NULL;
    if (k < 0 || k > MAX_RICE_K) return PyErr_Format(PyExc_ValueError, "bad Rice parameter %d", k);
    if (count < 1 || n < 1 || count > n || (uint64_t)n > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "bad count %zd for %zd elements", count, n);
    Py_buffer db;
    if (get_buffer(dobj, &db, 0) < 0) return NULL;
    PyObject *result = NULL;
    const char *err = NULL;
    size_t m = (size_t)count;
    uint64_t lbits = (uint64_t)m * (uint64_t)k, llen = (lbits + 7) / 8;
    uint8_t *buf = NULL, *low = NULL;
    uint32_t *idx = NULL;
    if ((uint64_t)db.len < llen + 1) {
        PyErr_SetString(PyExc_ValueError, "Rice stream too short");
        goto done;
    }
    uint64_t ulen = (uint64_t)db.len - llen;
    buf = padded_copy(db.buf, (size_t)ulen);
    low = padded_copy((const uint8_t *)db.buf + ulen, (size_t)llen);
    idx = (uint32_t *)malloc(m * sizeof(uint32_t));
    if (!buf || !low || !idx) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    /* Pass 1: the unary parts, from the positions of the one bits (word by word, so codes do
     * not wait on each other); q goes into idx for now. */
    const uint64_t qmax = (uint64_t)n >> k, words = (ulen + 7) / 8;
    uint64_t last = UINT64_MAX; /* position of the previous one bit; the first "previous" is -1 */
    size_t j = 0;
    for (uint64_t wi = 0; wi < words && j < m; wi++) {
        uint64_t word = load64(buf + 8 * wi);
        while (word && j < m) {
            uint64_t at = 64 * wi + (uint64_t)__builtin_ctzll(word), q = at - last - 1;
            if (q > qmax) {
                err = "position past the end of the chunk";
                break;
            }
            idx[j++] = (uint32_t)q;
            last = at;
            word &= word - 1;
        }
        if (err) break;
    }
    if (!err && j < m) err = "Rice stream ends early";
    /* Pass 2: positions from the unary parts and the low bits. */
    uint64_t pos = UINT64_MAX;
    for (size_t i = 0; i < m && !err; i++) {
        pos += 1 + (((uint64_t)idx[i] << k) | get_bits57(low, (uint64_t)i * (uint64_t)k, k));
        if (pos >= (uint64_t)n) err = "position past the end of the chunk";
        idx[i] = (uint32_t)pos;
    }
    if (!err && !exact_padding(buf, (size_t)ulen, last + 1)) err = "Rice stream has trailing data";
    if (!err && !exact_padding(low, (size_t)llen, lbits)) err = "Rice low bits have trailing data";
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)idx, (Py_ssize_t)(m * 4));
done:
    free(buf);
    free(low);
    free(idx);
    PyBuffer_Release(&db);
    return result;
}

/* -- 2-bit symbols with exp-Golomb escapes ------------------------------------------------ */

/* The cheapest exp-Golomb order k <= kmax for the escapes (the smallest among equals).
 * cost(k) = m * (1 + k) + 2 * sum(nb), nb = bit_length((e >> k) + 1) - 1. With L = bit_length(e),
 * x = e >> k has bit_length max(L - k, 0), one more after adding 1 exactly when x is all ones,
 * that is when k >= z = bit_length of the zero bits of e below L. So one pass counting L and z
 * prices every k. */
static int expg_best_k(const uint64_t *e, size_t m, int kmax) {
    uint64_t hist_l[65] = {0}, hist_z[65] = {0};
    for (size_t i = 0; i < m; i++) {
        int l = bitlen(e[i]);
        uint64_t below = l == 64 ? ~(uint64_t)0 : (((uint64_t)1 << l) - 1);
        hist_l[l]++;
        hist_z[bitlen(~e[i] & below)]++;
    }
    uint64_t best = UINT64_MAX, ones = 0;
    int k = 0;
    for (int kk = 0; kk <= kmax; kk++) {
        ones += hist_z[kk]; /* escapes with z <= kk */
        uint64_t above = 0;   /* sum of max(L - kk, 0) */
        for (int l = kk + 1; l <= 64; l++) above += hist_l[l] * (uint64_t)(l - kk);
        uint64_t cost = (uint64_t)m * (uint64_t)(1 + kk) + 2 * (above + ones - m);
        if (cost < best) {
            best = cost;
            k = kk;
        }
    }
    return k;
}

/* The 2-bit symbols of pack2 (into zeroed ``syms``) and its escapes; returns their count. */
static inline __attribute__((always_inline)) size_t symbols_impl(const uint8_t *t, const uint8_t *b, size_t count,
                                                                 int w, uint8_t *syms, uint64_t *esc, int *bad) {
    size_t m = 0;
    int zero = 0;
    for (size_t i = 0; i < count; i += 4) { /* a byte of four symbols at a time, in a register */
        size_t end = i + 4 < count ? i + 4 : count;
        unsigned byte = 0;
        for (size_t r = i; r < end; r++) {
            uint64_t z = zigzag(load_elem(t + r * (size_t)w, w) - load_elem(b + r * (size_t)w, w), w);
            zero |= z == 0;
            byte |= (unsigned)(z - 1 < 3 ? z - 1 : 3) << (2 * (r - i));
            esc[m] = z - 4;
            m += z >= 4;
        }
        syms[i >> 2] = (uint8_t)byte;
    }
    *bad = zero;
    return m;
}

PyDoc_STRVAR(pack2_doc,
             "pack2(target_values, base_values, width) -> (symbols, k, prefix, suffix)\n\n"
             "z = zigzag(target - base) >= 1 of every change as the 2-bit symbol min(z - 1, 3), four\n"
             "to a byte, first in the low bits; every z >= 4 also as e = z - 4 in exp-Golomb order\n"
             "k (the cheapest k < 8 * width, the smallest among equals) split in two streams:\n"
             "``prefix`` holds nb = bit_length((e >> k) + 1) - 1 in unary, ``suffix`` the k low\n"
             "bits of e then the nb low bits of (e >> k) + 1.");

static PyObject *k_pack2(PyObject *self, PyObject *args) {
    PyObject *to, *bo;
    int w;
    if (!PyArg_ParseTuple(args, "OOi:pack2", &to, &bo, &w)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer tb, bb;
    if (get_buffer(to, &tb, 0) < 0) return NULL;
    if (get_buffer(bo, &bb, 0) < 0) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *result = NULL;
    uint8_t *syms = NULL, *pre = NULL, *suf = NULL;
    uint64_t *esc = NULL;
    if (tb.len != bb.len || tb.len % w) {
        PyErr_SetString(PyExc_ValueError, "target and base values must be equal lengths of whole elements");
        goto done;
    }
    size_t count = (size_t)tb.len / (size_t)w, nsym = (count + 3) / 4, m = 0;
    syms = (uint8_t *)calloc(nsym + 1, 1);
    esc = (uint64_t *)malloc((count + 1) * sizeof(uint64_t));
    if (!syms || !esc) {
        PyErr_NoMemory();
        goto done;
    }
    int k = 0, bad = 0, oom = 0;
    uint64_t plen = 0, slen = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *t = (const uint8_t *)tb.buf, *b = (const uint8_t *)bb.buf;
    switch (w) {
    case 1: m = symbols_impl(t, b, count, 1, syms, esc, &bad); break;
    case 2: m = symbols_impl(t, b, count, 2, syms, esc, &bad); break;
    case 4: m = symbols_impl(t, b, count, 4, syms, esc, &bad); break;
    default: m = symbols_impl(t, b, count, 8, syms, esc, &bad); break;
    }
    if (!bad && m) {
        uint64_t emax = 0;
        for (size_t i = 0; i < m; i++) emax = esc[i] > emax ? esc[i] : emax;
        int kmax = bitlen(emax) < 8 * w - 1 ? bitlen(emax) : 8 * w - 1;
        k = expg_best_k(esc, m, kmax);
        uint64_t pbits = 0, sbits = 0;
        for (size_t i = 0; i < m; i++) {
            int nb = bitlen((esc[i] >> k) + 1) - 1;
            pbits += (uint64_t)nb + 1;
            sbits += (uint64_t)(nb + k);
        }
        plen = (pbits + 7) / 8;
        slen = (sbits + 7) / 8;
        pre = (uint8_t *)calloc(plen + PAD, 1);
        suf = (uint8_t *)calloc(slen + PAD, 1);
        if (!pre || !suf) {
            oom = 1;
        } else {
            BitWriter prefix = {pre, 0, 0}, suffix = {suf, 0, 0};
            uint64_t low_mask = k ? ~(uint64_t)0 >> (64 - k) : 0;
            for (size_t i = 0; i < m; i++) {
                uint64_t x = (esc[i] >> k) + 1;
                int nb = bitlen(x) - 1;
                bw_unary(&prefix, (uint64_t)nb);
                bw_put_wide(&suffix, esc[i] & low_mask, k);
                bw_put_wide(&suffix, x - ((uint64_t)1 << nb), nb);
            }
            bw_flush(&prefix);
            bw_flush(&suffix);
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "an unchanged element has no symbol");
        goto done;
    }
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("(y#iy#y#)", (const char *)syms, (Py_ssize_t)nsym, k, pre ? (const char *)pre : "",
                           (Py_ssize_t)plen, suf ? (const char *)suf : "", (Py_ssize_t)slen);
done:
    free(syms);
    free(esc);
    free(pre);
    free(suf);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&bb);
    return result;
}

PyDoc_STRVAR(unpack2_doc,
             "unpack2(symbols, count, k, prefix, suffix, width) -> values\n\n"
             "Inverse of pack2: the ``count`` zigzagged changes as w-byte elements. ValueError\n"
             "unless the streams are exactly what pack2 writes for some changes.");

/* Symbol i's value: z = symbol + 1, or the next escape's z for symbol 3 (esc has a spare slot,
 * so reading one past the last escape is harmless). */
static inline __attribute__((always_inline)) void fill_impl(const uint8_t *s, size_t n, const uint64_t *esc,
                                                            uint8_t *out, int w) {
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t sym = (s[i >> 2] >> (2 * (i & 3))) & 3;
        uint64_t z = sym == 3 ? esc[j] : sym + 1;
        j += sym == 3;
        store_elem(out + i * (size_t)w, z, w);
    }
}

static PyObject *k_unpack2(PyObject *self, PyObject *args) {
    PyObject *so, *po, *fo;
    Py_ssize_t count;
    int k, w;
    if (!PyArg_ParseTuple(args, "OniOOi:unpack2", &so, &count, &k, &po, &fo, &w)) return NULL;
    if (!check_width(w)) return NULL;
    if (count < 1) return PyErr_Format(PyExc_ValueError, "bad count %zd", count);
    if (k < 0 || k >= 8 * w) return PyErr_Format(PyExc_ValueError, "bad escape parameter %d", k);
    Py_buffer sb, pb, fb;
    if (get_buffer(so, &sb, 0) < 0) return NULL;
    if (get_buffer(po, &pb, 0) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (get_buffer(fo, &fb, 0) < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&pb);
        return NULL;
    }
    PyObject *result = NULL;
    const char *err = NULL;
    uint8_t *pre = NULL, *suf = NULL;
    uint64_t *esc = NULL;
    size_t n = (size_t)count;
    const uint8_t *s = (const uint8_t *)sb.buf;
    if ((size_t)sb.len != (n + 3) / 4) {
        PyErr_SetString(PyExc_ValueError, "symbol stream of the wrong size");
        goto done;
    }
    size_t m = 0; /* escapes: symbols 3 among the first n */
    for (size_t i = 0; i < n / 4; i++) m += (size_t)__builtin_popcount(s[i] & (s[i] >> 1) & 0x55);
    for (size_t i = n & ~(size_t)3; i < n; i++) m += ((s[i >> 2] >> (2 * (i & 3))) & 3) == 3;
    pre = padded_copy(pb.buf, (size_t)pb.len);
    suf = padded_copy(fb.buf, (size_t)fb.len);
    esc = (uint64_t *)malloc((m + 1) * sizeof(uint64_t));
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (size_t)w));
    if (!pre || !suf || !esc || !result) {
        if (result) Py_CLEAR(result);
        else PyErr_Clear();
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result); /* not shared yet: filled without the GIL */
    Py_BEGIN_ALLOW_THREADS
    const uint64_t emax = width_mask(w) - 4, hmax = emax >> k;
    const uint64_t lmax = k ? emax & (~(uint64_t)0 >> (64 - k)) : 0;
    const uint64_t pbits = 8 * (uint64_t)pb.len, sbits = 8 * (uint64_t)fb.len;
    uint64_t ppos = 0, spos = 0;
    /* The unary prefixes first, word by word from the one bits (as in rice_decode); nb into esc. */
    uint64_t last = UINT64_MAX;
    size_t found = 0;
    for (uint64_t wi = 0; wi < (pbits + 63) / 64 && found < m; wi++) {
        uint64_t word = load64(pre + 8 * wi);
        for (; word && found < m; word &= word - 1) {
            uint64_t at = 64 * wi + (uint64_t)__builtin_ctzll(word);
            esc[found++] = at - last - 1;
            last = at;
        }
    }
    ppos = last + 1;
    if (found < m) err = "escape stream ends early";
    for (size_t j = 0; j < m && !err; j++) {
        uint64_t nb = esc[j];
        if (nb > 63 || spos + (uint64_t)k + nb > sbits) {
            err = "escape runs past its stream";
            break;
        }
        uint64_t low = get_bits(suf, spos, k);
        spos += (uint64_t)k;
        uint64_t hi = ((uint64_t)1 << nb) - 1 + get_bits(suf, spos, (int)nb); /* e >> k */
        spos += nb;
        if (hi > hmax || (hi == hmax && low > lmax)) {
            err = "escaped change wider than the element";
            break;
        }
        esc[j] = ((hi << k) | low) + 4;
    }
    esc[m] = 0;
    if (!err && (n & 3) && (s[n >> 2] >> (2 * (n & 3))) != 0) err = "symbol stream has trailing data";
    if (!err && !m && k != 0) err = "escape parameter without escapes";
    if (!err && !exact_padding(pre, (size_t)pb.len, ppos)) err = "escape stream has trailing data";
    if (!err && !exact_padding(suf, (size_t)fb.len, spos)) err = "escape stream has trailing data";
    if (!err) {
        switch (w) {
        case 1: fill_impl(s, n, esc, out, 1); break;
        case 2: fill_impl(s, n, esc, out, 2); break;
        case 4: fill_impl(s, n, esc, out, 4); break;
        default: fill_impl(s, n, esc, out, 8); break;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, err);
    }
done:
    free(pre);
    free(suf);
    free(esc);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&fb);
    return result;
}

/* -- scatter: apply changes in place ----------------------------------------------------- */

/* Copy ``src`` (unless NULL) into ``o`` a block at a time and apply the changes that fall in
 * each block while it is still in cache; ``idx`` is strictly increasing and < n. */
static inline __attribute__((always_inline)) void apply_impl(uint8_t *o, const uint8_t *src, size_t n,
                                                             const uint32_t *idx, const uint8_t *v, size_t m,
                                                             int w, int transform) {
    const size_t block = (size_t)(32768 / w); /* elements */
    size_t i = 0;
    if (!src) { /* in place: the changed elements' cache lines come from memory; ask early */
        for (; i < m; i++) {
            if (i + 64 < m) __builtin_prefetch(o + (size_t)idx[i + 64] * (size_t)w, 1, 3);
            uint8_t *p = o + (size_t)idx[i] * (size_t)w;
            uint64_t x = load_elem(v + i * (size_t)w, w), cur = load_elem(p, w);
            store_elem(p, transform == 0 ? cur ^ x : cur + unzigzag(x), w);
        }
        return;
    }
    for (size_t start = 0; start < n; start += block) {
        size_t end = start + block < n ? start + block : n;
        memcpy(o + start * (size_t)w, src + start * (size_t)w, (end - start) * (size_t)w);
        for (; i < m && idx[i] < end; i++) {
            uint8_t *p = o + (size_t)idx[i] * (size_t)w;
            uint64_t x = load_elem(v + i * (size_t)w, w), cur = load_elem(p, w);
            store_elem(p, transform == 0 ? cur ^ x : cur + unzigzag(x), w);
        }
    }
}

PyDoc_STRVAR(scatter_doc,
             "scatter(out, base, indices, values, width, transform)\n\n"
             "Copy ``base`` into ``out`` (unless base is None: out already holds it), then apply each\n"
             "change: transform 0 XORs the value in, 1 adds the unzigzagged value (wrapping).\n"
             "``indices`` (u32) must be strictly increasing and in range.");

static PyObject *k_scatter(PyObject *self, PyObject *args) {
    PyObject *oo, *bo, *io, *vo;
    int w, transform;
    if (!PyArg_ParseTuple(args, "OOOOii:scatter", &oo, &bo, &io, &vo, &w, &transform)) return NULL;
    if (!check_width(w)) return NULL;
    if (transform != 0 && transform != 1) return PyErr_Format(PyExc_ValueError, "bad transform %d", transform);
    Py_buffer ob, bb = {0}, ib, vb;
    int have_base = bo != Py_None;
    if (get_buffer(oo, &ob, 1) < 0) return NULL;
    if (have_base && get_buffer(bo, &bb, 0) < 0) {
        PyBuffer_Release(&ob);
        return NULL;
    }
    if (get_buffer(io, &ib, 0) < 0) {
        PyBuffer_Release(&ob);
        if (have_base) PyBuffer_Release(&bb);
        return NULL;
    }
    if (get_buffer(vo, &vb, 0) < 0) {
        PyBuffer_Release(&ob);
        if (have_base) PyBuffer_Release(&bb);
        PyBuffer_Release(&ib);
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)ob.len / (size_t)w, m = (size_t)ib.len / 4;
    const uint32_t *idx = (const uint32_t *)ib.buf;
    if (ob.len % w || ib.len % 4 || (size_t)vb.len != m * (size_t)w || (have_base && bb.len != ob.len)) {
        PyErr_SetString(PyExc_ValueError, "scatter: buffers of mismatched sizes");
        goto done;
    }
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    bad = m && idx[m - 1] >= n;
    for (size_t i = 1; i < m; i++) bad |= idx[i] <= idx[i - 1];
    if (!bad) {
        uint8_t *o = (uint8_t *)ob.buf;
        const uint8_t *src = have_base && bb.buf != ob.buf ? (const uint8_t *)bb.buf : NULL;
        const uint8_t *v = (const uint8_t *)vb.buf;
        switch (w) {
        case 1: apply_impl(o, src, n, idx, v, m, 1, transform); break;
        case 2: apply_impl(o, src, n, idx, v, m, 2, transform); break;
        case 4: apply_impl(o, src, n, idx, v, m, 4, transform); break;
        default: apply_impl(o, src, n, idx, v, m, 8, transform); break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "scatter: indices must be increasing and in range");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&ob);
    if (have_base) PyBuffer_Release(&bb);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    return result;
}

/* -- magnitude classes: the context of codec version 2 ---------------------------------- */

/* An element's magnitude is its bits without the sign bit; class c holds the elements whose
 * magnitude is in [lim[c - 1], lim[c]) (lim[-1] = 0, lim[B - 1] = infinity). The limits are
 * ``threshold << shift`` for the thresholds the payload names (see codec.py). Both kernels
 * below walk the base in blocks of 64 elements and build, per block, one 64-bit membership
 * word per class (with AVX-512BW: one compare per threshold and 32 elements, straight to a
 * mask register). */
#define MAX_CLASSES 8

typedef struct {
    int B;
    uint64_t lim[MAX_CLASSES - 1];
} Classes;

static inline uint64_t sign_off(int w) { return width_mask(w) >> 1; }

/* words[c] from the B - 1 nested masks ge[t] (magnitude >= lim[t]) of a block of m elements. */
static inline void words_from_ge(const uint64_t *ge, int nt, size_t m, uint64_t *words) {
    uint64_t valid = m == 64 ? ~(uint64_t)0 : (((uint64_t)1 << m) - 1);
    if (nt == 0) {
        words[0] = valid;
        return;
    }
    words[0] = valid & ~ge[0];
    for (int c = 1; c < nt; c++) words[c] = ge[c - 1] & ~ge[c];
    words[nt] = ge[nt - 1];
}

static inline void block_words(const uint8_t *x, size_t start, size_t m, int w, const Classes *cl, uint64_t *words) {
    uint64_t ge[MAX_CLASSES - 1] = {0};
    int nt = cl->B - 1;
#if defined(__SSE2__) && !defined(DELTASYNC_PORTABLE)
    if (w == 2 && m == 64) {
        const __m128i mask = _mm_set1_epi16(0x7FFF);
        __m128i v[8];
        for (int q = 0; q < 8; q++) v[q] = _mm_and_si128(_mm_loadu_si128((const __m128i *)(x + 2 * (start + 8 * (size_t)q))), mask);
        for (int t = 0; t < nt; t++) {
            /* magnitudes and limits are at most 0x7FFF: signed 16-bit compares are exact */
            const __m128i lim = _mm_set1_epi16((short)((int)cl->lim[t] - 1));
            uint64_t word = 0;
            for (int q = 0; q < 4; q++) {
                __m128i a = _mm_cmpgt_epi16(v[2 * q], lim), b = _mm_cmpgt_epi16(v[2 * q + 1], lim);
                word |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_packs_epi16(a, b)) << (16 * q);
            }
            ge[t] = word;
        }
        words_from_ge(ge, nt, m, words);
        return;
    }
#endif
    uint64_t off = sign_off(w);
    for (size_t i = 0; i < m; i++) {
        uint64_t mag = load_elem(x + (start + i) * (size_t)w, w) & off;
        for (int t = 0; t < nt; t++) ge[t] |= (uint64_t)(mag >= cl->lim[t]) << i;
    }
    words_from_ge(ge, nt, m, words);
}

/* The position of the r-th (from 0) one bit of w; w has more than r one bits. */
static inline int select64(uint64_t w, int r) {
    for (int q = 0; q < 8; q++) {
        uint32_t b = (uint32_t)(w >> (8 * q)) & 0xFF;
        int pc = __builtin_popcount(b);
        if (r < pc) {
            for (; r > 0; r--) b &= b - 1;
            return 8 * q + __builtin_ctz(b);
        }
        r -= pc;
    }
    return 64; /* not reached */
}

#if HAVE_AVX512
#define AVX512_BMI2 __attribute__((target("avx512f,avx512bw,bmi2")))
AVX512_BMI2 static inline void block_words_avx512(const uint8_t *x, size_t start, size_t m, int w, const Classes *cl,
                                                 uint64_t *words) {
    if (m < 64) {
        block_words(x, start, m, w, cl, words);
        return;
    }
    uint64_t ge[MAX_CLASSES - 1] = {0};
    int nt = cl->B - 1;
    const uint8_t *p = x + start * (size_t)w;
    if (w == 1) {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(0x7F));
        for (int t = 0; t < nt; t++) ge[t] = _mm512_cmpge_epu8_mask(v, _mm512_set1_epi8((char)cl->lim[t]));
    } else if (w == 2) {
        const __m512i mask = _mm512_set1_epi16(0x7FFF);
        __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(p), mask), v1 = _mm512_and_si512(_mm512_loadu_si512(p + 64), mask);
        for (int t = 0; t < nt; t++) {
            __m512i lim = _mm512_set1_epi16((short)cl->lim[t]);
            ge[t] = (uint64_t)_mm512_cmpge_epu16_mask(v0, lim) | (uint64_t)_mm512_cmpge_epu16_mask(v1, lim) << 32;
        }
    } else if (w == 4) {
        const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
        __m512i v[4];
        for (int q = 0; q < 4; q++) v[q] = _mm512_and_si512(_mm512_loadu_si512(p + 64 * q), mask);
        for (int t = 0; t < nt; t++) {
            __m512i lim = _mm512_set1_epi32((int)cl->lim[t]);
            uint64_t word = 0;
            for (int q = 0; q < 4; q++) word |= (uint64_t)_mm512_cmpge_epu32_mask(v[q], lim) << (16 * q);
            ge[t] = word;
        }
    } else {
        block_words(x, start, m, w, cl, words);
        return;
    }
    words_from_ge(ge, nt, m, words);
}

AVX512_BMI2 static inline int select64_bmi2(uint64_t w, int r) { return __builtin_ctzll(_pdep_u64((uint64_t)1 << r, w)); }
#endif

/* The two loops, written once and compiled for each block_words/select64 pair (like scan). */
#define DEFINE_CLASS_LOOPS(ATTR, SUFFIX, WORDS, SELECT) \
ATTR static void ranks_loop##SUFFIX(const uint8_t *base, size_t n, int w, const Classes *cl, const uint32_t *idx, \
                                    size_t k, uint8_t *cls, uint32_t *ranks, uint32_t *running) { \
    size_t j = 0; \
    uint64_t words[MAX_CLASSES]; \
    for (size_t start = 0; start < n; start += 64) { \
        size_t m = n - start < 64 ? n - start : 64; \
        WORDS(base, start, m, w, cl, words); \
        for (; j < k && idx[j] < start + m; j++) { \
            int bit = (int)(idx[j] - start); \
            int c = 0; \
            while (!(words[c] >> bit & 1)) c++; \
            cls[j] = (uint8_t)c; \
            ranks[j] = running[c] + (uint32_t)__builtin_popcountll(words[c] & (((uint64_t)1 << bit) - 1)); \
        } \
        for (int c = 0; c < cl->B; c++) running[c] += (uint32_t)__builtin_popcountll(words[c]); \
    } \
} \
ATTR static void select_loop##SUFFIX(const uint8_t *base, size_t n, int w, const Classes *cl, const uint32_t *ranks, \
                                     size_t *ptr, const size_t *end, uint32_t *out, uint32_t *order, \
                                     uint32_t *running) { \
    uint64_t words[MAX_CLASSES]; \
    uint32_t slot[64]; \
    size_t o = 0; \
    for (size_t start = 0; start < n; start += 64) { \
        size_t m = n - start < 64 ? n - start : 64; \
        WORDS(base, start, m, w, cl, words); \
        uint64_t hits = 0; \
        for (int c = 0; c < cl->B; c++) { \
            uint32_t pc = (uint32_t)__builtin_popcountll(words[c]); \
            /* ranks increase within a class (checked), so r >= running[c] always holds here */ \
            for (; ptr[c] < end[c] && ranks[ptr[c]] - running[c] < pc; ptr[c]++) { \
                int bit = SELECT(words[c], (int)(ranks[ptr[c]] - running[c])); \
                hits |= (uint64_t)1 << bit; \
                slot[bit] = (uint32_t)ptr[c]; \
            } \
            running[c] += pc; \
        } \
        for (; hits; hits &= hits - 1) { \
            int bit = __builtin_ctzll(hits); \
            out[o] = (uint32_t)(start + (size_t)bit); \
            order[o++] = slot[bit]; \
        } \
    } \
}

DEFINE_CLASS_LOOPS(, , block_words, select64)
#if HAVE_AVX512
DEFINE_CLASS_LOOPS(AVX512_BMI2, _avx512, block_words_avx512, select64_bmi2)
#endif

/* Parses ``thresholds`` (u16 each, strictly increasing, 1 <= t <= max bin) into limits. */
static int parse_classes(const Py_buffer *tb, int w, Classes *cl) {
    static const int shift[9] = {0, 3, 7, 0, 23, 0, 0, 0, 52};
    size_t nt = (size_t)tb->len / 2;
    if (tb->len % 2 || nt > MAX_CLASSES - 1) {
        PyErr_SetString(PyExc_ValueError, "bad class thresholds");
        return 0;
    }
    uint64_t max_bin = sign_off(w) >> shift[w];
    const uint8_t *p = (const uint8_t *)tb->buf;
    uint64_t prev = 0;
    cl->B = (int)nt + 1;
    for (size_t t = 0; t < nt; t++) {
        uint64_t th = (uint64_t)p[2 * t] | (uint64_t)p[2 * t + 1] << 8;
        if (th <= prev || th > max_bin) {
            PyErr_SetString(PyExc_ValueError, "class thresholds must increase from 1 to the largest bin");
            return 0;
        }
        cl->lim[t] = th << shift[w];
        prev = th;
    }
    return 1;
}

PyDoc_STRVAR(class_ranks_doc,
             "class_ranks(base, width, thresholds, indices) -> (order, ranks, per_class, counts)\n\n"
             "The changed elements (``indices``: increasing u32) class after class of their magnitude\n"
             "in ``base``: ``order`` (u32 each) lists their places in ``indices`` class after class (in\n"
             "increasing order within a class), ``ranks`` (u32 each, same order) their ranks among\n"
             "the elements of their class; ``per_class`` (u32 per class) how many changed, ``counts``\n"
             "(u32 per class) how many elements each class holds.");

static PyObject *k_class_ranks(PyObject *self, PyObject *args) {
    PyObject *bo, *to, *io;
    int w;
    if (!PyArg_ParseTuple(args, "OiOO:class_ranks", &bo, &w, &to, &io)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer bb, tb, ib;
    if (get_buffer(bo, &bb, 0) < 0) return NULL;
    if (get_buffer(to, &tb, 0) < 0) {
        PyBuffer_Release(&bb);
        return NULL;
    }
    if (get_buffer(io, &ib, 0) < 0) {
        PyBuffer_Release(&bb);
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *result = NULL, *oo = NULL, *ro = NULL, *po = NULL, *no = NULL;
    uint8_t *cls = NULL;
    uint32_t *raw = NULL;
    Classes cl;
    size_t n = (size_t)bb.len / (size_t)w, k = (size_t)ib.len / 4;
    if (!parse_classes(&tb, w, &cl)) goto done;
    if (bb.len % w || ib.len % 4) {
        PyErr_SetString(PyExc_ValueError, "class_ranks: buffers of mismatched sizes");
        goto done;
    }
    oo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * k));
    ro = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * k));
    po = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * cl.B));
    no = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * cl.B));
    cls = (uint8_t *)malloc(k ? k : 1);
    raw = (uint32_t *)malloc(4 * (k ? k : 1));
    if (!oo || !ro || !po || !no || !cls || !raw) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    const uint32_t *idx = (const uint32_t *)ib.buf;
    uint32_t *order = (uint32_t *)PyBytes_AS_STRING(oo), *ranks = (uint32_t *)PyBytes_AS_STRING(ro);
    uint32_t running[MAX_CLASSES] = {0}, per[MAX_CLASSES] = {0};
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 1; i < k; i++) bad |= idx[i] <= idx[i - 1];
    bad |= k && idx[k - 1] >= n;
    if (!bad) {
#if HAVE_AVX512
        if (use_avx512)
            ranks_loop_avx512((const uint8_t *)bb.buf, n, w, &cl, idx, k, cls, raw, running);
        else
#endif
            ranks_loop((const uint8_t *)bb.buf, n, w, &cl, idx, k, cls, raw, running);
        size_t at[MAX_CLASSES], total = 0; /* counting sort by class, stable */
        for (size_t j = 0; j < k; j++) per[cls[j]]++;
        for (int c = 0; c < cl.B; c++) {
            at[c] = total;
            total += per[c];
        }
        for (size_t j = 0; j < k; j++) {
            size_t q = at[cls[j]]++;
            order[q] = (uint32_t)j;
            ranks[q] = raw[j];
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "class_ranks: indices must be increasing and in range");
        goto done;
    }
    memcpy(PyBytes_AS_STRING(po), per, 4 * (size_t)cl.B);
    memcpy(PyBytes_AS_STRING(no), running, 4 * (size_t)cl.B);
    result = PyTuple_Pack(4, oo, ro, po, no);
done:
    free(cls);
    free(raw);
    Py_XDECREF(oo);
    Py_XDECREF(ro);
    Py_XDECREF(po);
    Py_XDECREF(no);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ib);
    return result;
}

PyDoc_STRVAR(class_select_doc,
             "class_select(base, width, thresholds, counts, ranks, per_class) -> (indices, order)\n\n"
             "Inverse of class_ranks: ``ranks`` (u32) holds, class after class, the increasing ranks of\n"
             "the changed elements of each class (``per_class[c]`` of them, u32 each). Returns their\n"
             "element indices in increasing order (u32) and, for each, its place in ``ranks`` (u32).\n"
             "ValueError unless ``counts`` (u32 per class) is the number of elements of each class\n"
             "and every rank is increasing within its class and below its class's count.");

static PyObject *k_class_select(PyObject *self, PyObject *args) {
    PyObject *bo, *to, *no, *ro, *po;
    int w;
    if (!PyArg_ParseTuple(args, "OiOOOO:class_select", &bo, &w, &to, &no, &ro, &po)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer bufs[5];
    PyObject *objs[5] = {bo, to, no, ro, po};
    int got = 0;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &bufs[got], 0) < 0) break;
    PyObject *result = NULL, *io = NULL, *oo = NULL;
    if (got < 5) goto done;
    Py_buffer *bb = &bufs[0], *nb = &bufs[2], *rb = &bufs[3], *pb = &bufs[4];
    Classes cl;
    if (!parse_classes(&bufs[1], w, &cl)) goto done;
    size_t n = (size_t)bb->len / (size_t)w, k = (size_t)rb->len / 4;
    if (bb->len % w || rb->len % 4 || nb->len != 4 * cl.B || pb->len != 4 * cl.B) {
        PyErr_SetString(PyExc_ValueError, "class_select: buffers of mismatched sizes");
        goto done;
    }
    const uint32_t *counts = (const uint32_t *)nb->buf, *ranks = (const uint32_t *)rb->buf;
    const uint32_t *per = (const uint32_t *)pb->buf;
    size_t ptr[MAX_CLASSES], end[MAX_CLASSES], total = 0;
    for (int c = 0; c < cl.B; c++) {
        ptr[c] = total;
        total += per[c];
        end[c] = total;
    }
    if (total != k) {
        PyErr_SetString(PyExc_ValueError, "class_select: per-class counts do not add up to the ranks");
        goto done;
    }
    io = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * k));
    oo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * k));
    if (!io || !oo) goto done;
    uint32_t *out = (uint32_t *)PyBytes_AS_STRING(io), *order = (uint32_t *)PyBytes_AS_STRING(oo);
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int c = 0; c < cl.B && !bad; c++)
        for (size_t i = ptr[c] + 1; i < end[c]; i++) bad |= ranks[i] <= ranks[i - 1];
    if (!bad) {
        uint32_t running[MAX_CLASSES] = {0};
#if HAVE_AVX512
        if (use_avx512)
            select_loop_avx512((const uint8_t *)bb->buf, n, w, &cl, ranks, ptr, end, out, order, running);
        else
#endif
            select_loop((const uint8_t *)bb->buf, n, w, &cl, ranks, ptr, end, out, order, running);
        for (int c = 0; c < cl.B; c++) bad |= running[c] != counts[c] || ptr[c] != end[c];
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "class positions do not match the base (ranks or class counts)");
        goto done;
    }
    result = PyTuple_Pack(2, io, oo);
done:
    Py_XDECREF(io);
    Py_XDECREF(oo);
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

/* -- module ------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"scan", k_scan, METH_VARARGS, scan_doc},
    {"rice_encode", k_rice_encode, METH_VARARGS, rice_encode_doc},
    {"rice_decode", k_rice_decode, METH_VARARGS, rice_decode_doc},
    {"pack2", k_pack2, METH_VARARGS, pack2_doc},
    {"unpack2", k_unpack2, METH_VARARGS, unpack2_doc},
    {"scatter", k_scatter, METH_VARARGS, scatter_doc},
    {"class_ranks", k_class_ranks, METH_VARARGS, class_ranks_doc},
    {"class_select", k_class_select, METH_VARARGS, class_select_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "deltasync._kernels",
    .m_doc = "Hot loops of the chunk codec; deltasync._kernels_py is the pure-numpy twin.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#if HAVE_AVX512
    __builtin_cpu_init();
    use_avx512 = __builtin_cpu_supports("avx512bw") && !getenv("DELTASYNC_NO_AVX512");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "simd", use_avx512 ? "avx512bw" : BASELINE_SIMD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
