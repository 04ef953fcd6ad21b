/* Hot loops of the chunk codec (deltasync/format/codec.py), as a CPython extension module.
 *
 * deltasync/format/_kernels_py.py is the pure-numpy twin of every function here: same arguments,
 * byte-identical results, the same inputs refused (tests/format/test_codec.py checks both). The
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

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "deltasync.format._kernels supports little-endian hosts only (numpy fallback elsewhere)"
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

static inline uint64_t load_u8(const uint8_t *p) { return *p; }
static inline uint64_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline uint64_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t load_u64(const uint8_t *p) { return load64(p); }

/* One w-byte element. A switch, not memcpy(.., w): where w is not a constant, that is a call
 * into libc per element; the switch is a branch that always goes the same way. */
static inline uint64_t load_elem(const uint8_t *p, int w) {
    uint8_t v1;
    uint16_t v2;
    uint32_t v4;
    uint64_t v8;
    switch (w) {
    case 1: memcpy(&v1, p, 1); return v1;
    case 2: memcpy(&v2, p, 2); return v2;
    case 4: memcpy(&v4, p, 4); return v4;
    default: memcpy(&v8, p, 8); return v8;
    }
}

static inline void store_elem(uint8_t *p, uint64_t v, int w) {
    uint8_t v1 = (uint8_t)v;
    uint16_t v2 = (uint16_t)v;
    uint32_t v4 = (uint32_t)v;
    switch (w) {
    case 1: memcpy(p, &v1, 1); break;
    case 2: memcpy(p, &v2, 2); break;
    case 4: memcpy(p, &v4, 4); break;
    default: memcpy(p, &v, 8); break;
    }
}

/* Branch-free: escapes of 0 are common, and a branch on them mispredicts. */
static inline int bitlen(uint64_t x) { return 64 - __builtin_clzll(x | 1) - (x == 0); }

static inline uint64_t width_mask(int w) { return w == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * w)) - 1); }

static inline uint64_t zigzag(uint64_t d, int w) {
    int shift = 64 - 8 * w;
    int64_t s = (int64_t)(d << shift) >> shift; /* sign-extend the w-byte difference */
    return ((uint64_t)s << 1 ^ (uint64_t)(s >> 63)) & width_mask(w);
}

static inline uint64_t unzigzag(uint64_t z) { return (z >> 1) ^ (0 - (z & 1)); }

/* An element's magnitude bin (codec.py, magnitude classes): its bits without the sign bit,
 * shifted right by 3, 7, 23 or 52 for widths 1, 2, 4, 8; and how many bins a width has. */
static inline int bin_shift(int w) { return w == 1 ? 3 : w == 2 ? 7 : w == 4 ? 23 : 52; }
static inline size_t mag_bin(uint64_t v, int w) { return (size_t)((v & (width_mask(w) >> 1)) >> bin_shift(w)); }
static inline size_t bin_count(int w) { return (size_t)((width_mask(w) >> 1) >> bin_shift(w)) + 1; }

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

/* Appends up to 56 bits at a time without a branch: the accumulator is stored 8 bytes wide
 * after every code and its whole bytes are dropped (the stream needs 8 bytes of slack: PAD).
 * The bits written are BitWriter's. */
typedef struct {
    uint8_t *p;
    uint64_t acc;
    int n; /* bits in acc, < 8 between calls */
} ByteWriter;

static inline void byw_put(ByteWriter *w, uint64_t v, int nbits) { /* v < 2**nbits, nbits <= 56 */
    w->acc |= v << w->n;
    w->n += nbits;
    store64(w->p, w->acc);
    int bytes = w->n >> 3;
    w->p += bytes;
    w->acc >>= 8 * bytes; /* bytes <= 7 */
    w->n &= 7;
}

static inline void byw_flush(ByteWriter *w) {
    if (w->n) *w->p++ = (uint8_t)w->acc; /* the last, partial byte (already stored once) */
    w->acc = 0;
    w->n = 0;
}

/* A ByteWriter as a BitWriter (both hold the bits not yet final in acc, from p on). */
static inline BitWriter byw_bits(const ByteWriter *w) { return (BitWriter){w->p, w->acc, w->n}; }

/* And back: the BitWriter's whole bytes written out first. */
static inline ByteWriter bw_bytes(BitWriter *w) {
    for (; w->n >= 8; w->n -= 8) {
        *w->p++ = (uint8_t)w->acc;
        w->acc >>= 8;
    }
    return (ByteWriter){w->p, w->acc, w->n};
}

static inline uint64_t get_bits57(const uint8_t *buf, uint64_t pos, int n) {
    uint64_t v = load64(buf + (pos >> 3)) >> (pos & 7);
    return n == 0 ? 0 : (v & (((uint64_t)1 << n) - 1));
}

static inline uint64_t get_bits(const uint8_t *buf, uint64_t pos, int n) {
    if (n > 32) return get_bits57(buf, pos, 32) | (get_bits57(buf, pos + 32, n - 32) << 32);
    return get_bits57(buf, pos, n);
}

/* n <= 64 bits at bit ``pos``, without a branch (reads 9 bytes from byte pos / 8). */
static inline uint64_t get_bits64(const uint8_t *buf, uint64_t pos, int n) {
    const uint8_t *p = buf + (pos >> 3);
    int s = (int)(pos & 7);
    uint64_t v = (load64(p) >> s) | (((uint64_t)p[8] << 1) << (63 - s));
    return n >= 64 ? v : v & (((uint64_t)1 << n) - 1);
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
    int w; /* the element width the value buffers were sized for (in the thread's cache) */
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

/* The sample of the base that class_thresholds takes, counted while the scan reads the base
 * anyway: elements 0, 16, 32 and 48 of a block of 64 into four interleaved histograms (a
 * counter array would make each increment wait for the previous one to the same bin). */
#define SAMPLE_BLOCK(bp, w, sample, nbins)                                                                 \
    do {                                                                                                   \
        (sample)[mag_bin(load_elem((bp), (w)), (w))]++;                                                    \
        (sample)[(nbins) + mag_bin(load_elem((bp) + 16 * (w), (w)), (w))]++;                               \
        (sample)[2 * (nbins) + mag_bin(load_elem((bp) + 32 * (w), (w)), (w))]++;                           \
        (sample)[3 * (nbins) + mag_bin(load_elem((bp) + 48 * (w), (w)), (w))]++;                           \
    } while (0)

/* Count changed elements; while the count stays <= limit, also record each one. Returns the
 * count, or -1 when out of memory. With ``sample`` (4 histograms of bin_count(w) counters,
 * zeroed), also counts the bins of every 16th base element. Branch-light: the positions of a 64-element mask are
 * written four at a time without asking how many there are (the usual case is 0 or 1). */
#define DEFINE_SCAN(SCAN_ATTR, SCAN_NAME, MASK_FN) \
SCAN_ATTR static inline __attribute__((always_inline)) int64_t SCAN_NAME(const uint8_t *t, const uint8_t *b, size_t n, \
                                                               int w, size_t limit, Changes *c, \
                                                               uint32_t *sample) { \
    size_t count = 0, e = 0, nbins = bin_count(w); \
    int collect = 1; \
    for (; e + 64 <= n; e += 64) { \
        for (int line = 0; line < w; line++) { /* the hardware prefetcher alone leaves ~25% */ \
            __builtin_prefetch(t + e * (size_t)w + PREFETCH + 64 * line, 0, 2); \
            __builtin_prefetch(b + e * (size_t)w + PREFETCH + 64 * line, 0, 2); \
        } \
        if (sample) SAMPLE_BLOCK(b + e * (size_t)w, w, sample, nbins); \
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
        if (sample && e % 16 == 0) sample[mag_bin(load_elem(b + e * (size_t)w, w), w)]++; \
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
static int use_vbmi2 = 0; /* AVX-512 VBMI2 (compress of bytes and words); set once at import */
#define VBMI2 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2")))

/* The scan of 2-byte elements with VBMI2: per 64 elements, the changed ones' positions and
 * values are compressed out of the vectors (no loop over the changes); full vectors are stored,
 * the lanes past the changes are overwritten next or land in the 64 entries reserved ahead. */
VBMI2 static int64_t scan_w2_vbmi2(const uint8_t *t, const uint8_t *b, size_t n, size_t limit, Changes *c,
                                   uint32_t *sample) {
    size_t count = 0, e = 0;
    int collect = 1;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (; e + 64 <= n; e += 64) {
        const uint8_t *tg = t + 2 * e, *bg = b + 2 * e;
        for (int line = 0; line < 2; line++) {
            __builtin_prefetch(tg + PREFETCH + 64 * line, 0, 2);
            __builtin_prefetch(bg + PREFETCH + 64 * line, 0, 2);
        }
        if (sample) SAMPLE_BLOCK(bg, 2, sample, 256);
        __m512i t0 = _mm512_loadu_si512(tg), t1 = _mm512_loadu_si512(tg + 64);
        __m512i b0 = _mm512_loadu_si512(bg), b1 = _mm512_loadu_si512(bg + 64);
        __mmask32 m0 = _mm512_cmpneq_epi16_mask(t0, b0), m1 = _mm512_cmpneq_epi16_mask(t1, b1);
        uint64_t m = (uint64_t)m0 | (uint64_t)m1 << 32;
        size_t cnt = (size_t)__builtin_popcountll(m);
        count += cnt;
        if (!collect || !m) continue;
        if (count > limit) {
            collect = 0;
            continue;
        }
        if (c->len + 64 > c->cap && !changes_reserve(c, c->len + 64, 2)) return -1;
        size_t len = c->len, c0 = (size_t)__builtin_popcount(m0);
        uint8_t *tv = c->tv + 2 * len, *bv = c->bv + 2 * len;
        _mm512_storeu_si512(tv, _mm512_maskz_compress_epi16(m0, t0));
        _mm512_storeu_si512(bv, _mm512_maskz_compress_epi16(m0, b0));
        _mm512_storeu_si512(tv + 2 * c0, _mm512_maskz_compress_epi16(m1, t1));
        _mm512_storeu_si512(bv + 2 * c0, _mm512_maskz_compress_epi16(m1, b1));
        uint32_t *out = c->idx + len;
        for (int q = 0; q < 4; q++) {
            __mmask16 mq = (__mmask16)(m >> (16 * q));
            __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(e + 16 * (size_t)q)));
            _mm512_storeu_si512(out, _mm512_maskz_compress_epi32(mq, at));
            out += __builtin_popcount(mq);
        }
        c->len = len + cnt;
    }
    for (; e < n; e++) {
        if (sample && e % 16 == 0) sample[mag_bin(load_elem(b + 2 * e, 2), 2)]++;
        if (load_elem(t + 2 * e, 2) == load_elem(b + 2 * e, 2)) continue;
        count++;
        if (!collect) continue;
        if (count > limit) {
            collect = 0;
            continue;
        }
        if (c->len + 64 > c->cap && !changes_reserve(c, c->len + 64, 2)) return -1;
        memcpy(c->tv + c->len * 2, t + 2 * e, 2);
        memcpy(c->bv + c->len * 2, b + 2 * e, 2);
        c->idx[c->len++] = (uint32_t)e;
    }
    return (int64_t)count;
}
#endif

#if HAVE_AVX512
AVX512 static int64_t scan_any_avx512(const uint8_t *t, const uint8_t *b, size_t n, int w, size_t limit,
                                      Changes *c, uint32_t *s) {
    switch (w) {
    case 1: return scan_impl_avx512(t, b, n, 1, limit, c, s);
    case 2: return scan_impl_avx512(t, b, n, 2, limit, c, s);
    case 4: return scan_impl_avx512(t, b, n, 4, limit, c, s);
    default: return scan_impl_avx512(t, b, n, 8, limit, c, s);
    }
}
#endif

static int64_t scan_any(const uint8_t *t, const uint8_t *b, size_t n, int w, size_t limit, Changes *c,
                        uint32_t *s) {
#if HAVE_AVX512
    if (use_vbmi2 && w == 2) return scan_w2_vbmi2(t, b, n, limit, c, s);
    if (use_avx512) return scan_any_avx512(t, b, n, w, limit, c, s);
#endif
    switch (w) {
    case 1: return scan_impl(t, b, n, 1, limit, c, s);
    case 2: return scan_impl(t, b, n, 2, limit, c, s);
    case 4: return scan_impl(t, b, n, 4, limit, c, s);
    default: return scan_impl(t, b, n, 8, limit, c, s);
    }
}

/* Each thread keeps its scan buffers between calls (up to CACHE_BYTES): fresh ones of a few
 * MiB per chunk cost more in page faults than the scan itself. Freed when the thread ends. */
#define CACHE_BYTES ((size_t)16 << 20)
static pthread_key_t changes_key;
static int changes_key_ok = 0;

static void changes_free(void *p) {
    Changes *c = (Changes *)p;
    if (!c) return;
    free(c->idx);
    free(c->tv);
    free(c->bv);
    free(c);
}

/* The calling thread's cached buffers (emptied) if sized for w-byte values, or none. */
static Changes changes_take(int w) {
    Changes c = {0};
    Changes *kept = changes_key_ok ? (Changes *)pthread_getspecific(changes_key) : NULL;
    if (kept && kept->cap) {
        if (kept->w == w) {
            c = *kept;
        } else {
            free(kept->idx);
            free(kept->tv);
            free(kept->bv);
        }
        *kept = (Changes){0};
    }
    c.len = 0;
    return c;
}

/* Give the buffers back to the thread's cache, or free them if too large or no cache. */
static void changes_keep(Changes *c, int w) {
    Changes *kept = changes_key_ok ? (Changes *)pthread_getspecific(changes_key) : NULL;
    if (!kept && changes_key_ok && c->cap * (4 + 2 * (size_t)w) <= CACHE_BYTES) {
        kept = (Changes *)calloc(1, sizeof(Changes));
        if (kept && pthread_setspecific(changes_key, kept) != 0) {
            free(kept);
            kept = NULL;
        }
    }
    if (kept && !kept->cap && c->cap * (4 + 2 * (size_t)w) <= CACHE_BYTES) {
        *kept = *c;
        kept->w = w;
    } else {
        free(c->idx);
        free(c->tv);
        free(c->bv);
    }
    *c = (Changes){0};
}

PyDoc_STRVAR(scan_doc,
             "scan(target, base, width, limit) -> (count, indices, target_values, base_values)\n\n"
             "Changed elements of two equal-length buffers. ``indices`` are u32, the values are the\n"
             "elements' bytes; all three are None when count > limit (then only counted).");

PyDoc_STRVAR(scan_sampled_doc,
             "scan_sampled(target, base, width, limit) -> (count, indices, target_values, base_values, sample)\n\n"
             "scan, and the sample of ``base`` that class_thresholds_sampled takes, counted in the same\n"
             "pass: u32 per magnitude bin, how many of every 16th element (from the first) it holds.");

/* scan and scan_sampled. */
static PyObject *scan_call(PyObject *args, int sampled) {
    PyObject *to, *bo;
    int w;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, sampled ? "OOin:scan_sampled" : "OOin:scan", &to, &bo, &w, &limit)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer tb, bb;
    if (get_buffer(to, &tb, 0) < 0) return NULL;
    if (get_buffer(bo, &bb, 0) < 0) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *result = NULL, *sample = NULL;
    uint32_t *sub = NULL;
    if (tb.len != bb.len || tb.len % w) {
        PyErr_SetString(PyExc_ValueError, "target and base must be equal lengths of whole elements");
        goto done;
    }
    size_t n = (size_t)tb.len / (size_t)w, nbins = bin_count(w);
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many elements for u32 indices");
        goto done;
    }
    if (sampled) {
        sub = (uint32_t *)calloc(4 * nbins, sizeof(uint32_t));
        sample = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * nbins));
        if (!sub || !sample) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto done;
        }
    }
    Changes c = changes_take(w);
    int64_t count;
    size_t lim = limit < 0 ? 0 : (size_t)limit;
    Py_BEGIN_ALLOW_THREADS
    /* Room for 1/8 of the elements changed (an RL step changes a few percent) up front, so
     * that the buffers rarely grow (each growth copies them); changes_reserve doubles beyond. */
    count = changes_reserve(&c, (lim < n / 8 ? lim : n / 8) + 64, w) ? 0 : -1;
    if (count == 0) count = scan_any((const uint8_t *)tb.buf, (const uint8_t *)bb.buf, n, w, lim, &c, sub);
    Py_END_ALLOW_THREADS
    if (sampled) {
        uint32_t *out = (uint32_t *)PyBytes_AS_STRING(sample); /* little-endian host */
        for (size_t i = 0; i < nbins; i++) out[i] = sub[i] + sub[nbins + i] + sub[2 * nbins + i] + sub[3 * nbins + i];
    }
    if (count < 0) {
        PyErr_NoMemory();
    } else if ((size_t)count > lim) {
        result = sampled ? Py_BuildValue("(LOOOO)", (long long)count, Py_None, Py_None, Py_None, sample)
                         : Py_BuildValue("(LOOO)", (long long)count, Py_None, Py_None, Py_None);
    } else {
        /* y# turns a NULL pointer into None: no changes recorded means empty bytes */
        const char *idx = c.idx ? (const char *)c.idx : "", *tv = c.tv ? (const char *)c.tv : "";
        const char *bv = c.bv ? (const char *)c.bv : "";
        Py_ssize_t ilen = (Py_ssize_t)(c.len * 4), vlen = (Py_ssize_t)(c.len * (size_t)w);
        result = sampled ? Py_BuildValue("(Ly#y#y#O)", (long long)count, idx, ilen, tv, vlen, bv, vlen, sample)
                         : Py_BuildValue("(Ly#y#y#)", (long long)count, idx, ilen, tv, vlen, bv, vlen);
    }
    changes_keep(&c, w);
done:
    free(sub);
    Py_XDECREF(sample);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&bb);
    return result;
}

static PyObject *k_scan(PyObject *self, PyObject *args) { return scan_call(args, 0); }

static PyObject *k_scan_sampled(PyObject *self, PyObject *args) { return scan_call(args, 1); }

/* -- Rice-coded gaps between positions --------------------------------------------------- */

/* For k = lo, lo + 1, lo + 2 (each <= MAX_RICE_K): sum over the gaps of ceil((g >> k) / 2),
 * which exceeds m iff the Rice cost m * (1 + k) + sum(g >> k) still drops from k to k + 1, and
 * sum(g >> k), the unary bits. One pass; also checks that the indices increase. */
static inline __attribute__((always_inline)) int rice_stats_impl(const uint32_t *idx, size_t m, int lo,
                                                                uint64_t halves[3], uint64_t sums[3]) {
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
static int rice_stats(const uint32_t *idx, size_t m, int lo, uint64_t halves[3], uint64_t sums[3]) {
    return rice_stats_impl(idx, m, lo, halves, sums);
}

#if HAVE_AVX512
/* The Rice kernels' AVX-512 paths (with BMI2's pext); the results are the portable ones. */
#define AVX512_RICE __attribute__((target("avx512f,avx512bw,avx512vl,bmi2")))

AVX512_RICE static int rice_stats_avx512(const uint32_t *idx, size_t m, int lo, uint64_t halves[3], uint64_t sums[3]) {
    return rice_stats_impl(idx, m, lo, halves, sums); /* the same loop, 16 lanes */
}
#endif

static int rice_choose(const uint32_t *idx, size_t m, int *k, uint64_t *sum_q) {
    uint64_t mean = ((uint64_t)idx[m - 1] + 1 - m) / m, halves[3], sums[3];
    int lo = bitlen(mean) >= 2 ? bitlen(mean) - 2 : 0;
    for (;;) {
#if HAVE_AVX512
        if (!(use_avx512 ? rice_stats_avx512 : rice_stats)(idx, m, lo, halves, sums)) return 0;
#else
        if (!rice_stats(idx, m, lo, halves, sums)) return 0;
#endif
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

/* The unary stream of rice_write, code by code: code i sets the bit at ``at``, the sum of
 * the first i + 1 codes' lengths minus 1, by storing the word it ends in, cleared first when
 * it is a new one (words it skips stay zero: the buffer is zeroed). */
typedef struct {
    uint64_t at, cur, word; /* the last code's bit, its word's index, and that word */
} RiceUnary;

static inline __attribute__((always_inline)) void rice_unary_step(RiceUnary *u, uint32_t g, int k, uint8_t *buf) {
    u->at += (uint64_t)(g >> k) + 1;
    uint64_t wi = u->at >> 6;
    u->word = (wi == u->cur ? u->word : 0) | (uint64_t)1 << (u->at & 63);
    store64(buf + 8 * wi, u->word);
    u->cur = wi;
}

#if HAVE_AVX512
/* The same stream eight codes at a time: their bits' positions from a prefix sum of their
 * lengths, OR-ed together into the (at most two) words they fall in, each stored once; eight
 * codes that reach a third word go code by code. */
AVX512_RICE static void rice_unary_avx512(const uint32_t *idx, size_t m, int k, uint8_t *buf) {
    RiceUnary u = {UINT64_MAX, 0, 0};
    rice_unary_step(&u, idx[0], k, buf); /* the first gap is idx[0]: its "previous" is -1 */
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi64(1), low6 = _mm512_set1_epi64(63);
    const __m512i lane7 = _mm512_set1_epi64(7);
    const __m256i one32 = _mm256_set1_epi32(1);
    const __m128i shift = _mm_cvtsi32_si128(k);
    __m512i at = _mm512_set1_epi64((long long)u.at); /* the last code's bit, in every lane */
    size_t i = 1;
    for (; i + 8 <= m; i += 8) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(idx + i)), p = _mm256_loadu_si256((const __m256i *)(idx + i - 1));
        __m256i g = _mm256_sub_epi32(_mm256_sub_epi32(a, p), one32);
        __m512i len = _mm512_cvtepu32_epi64(_mm256_add_epi32(_mm256_srl_epi32(g, shift), one32)); /* <= 2**32 - 1 */
        len = _mm512_add_epi64(len, _mm512_alignr_epi64(len, zero, 7)); /* inclusive prefix sum */
        len = _mm512_add_epi64(len, _mm512_alignr_epi64(len, zero, 6));
        len = _mm512_add_epi64(len, _mm512_alignr_epi64(len, zero, 4));
        __m512i pos = _mm512_add_epi64(len, at);
        at = _mm512_permutexvar_epi64(lane7, pos);
        uint64_t first = (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(pos));
        uint64_t last = (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(at));
        uint64_t w0 = first >> 6, w1 = last >> 6;
        if (w1 - w0 > 1) { /* a long code: one at a time */
            for (size_t r = i; r < i + 8; r++) rice_unary_step(&u, idx[r] - idx[r - 1] - 1, k, buf);
            continue;
        }
        __m512i bits = _mm512_sllv_epi64(one, _mm512_and_si512(pos, low6));
        __mmask8 in0 = _mm512_cmpeq_epi64_mask(_mm512_srli_epi64(pos, 6), _mm512_set1_epi64((long long)w0));
        /* both words' bits OR-ed across the lanes at once: word 0 ends in lane 0, word 1 in lane 1 */
        __m512i b0 = _mm512_maskz_mov_epi64(in0, bits), b1 = _mm512_maskz_mov_epi64((__mmask8)~in0, bits);
        __m512i t = _mm512_or_si512(_mm512_unpacklo_epi64(b0, b1), _mm512_unpackhi_epi64(b0, b1));
        t = _mm512_or_si512(t, _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm512_or_si512(t, _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
        __m128i words = _mm512_castsi512_si128(t);
        uint64_t word0 = (uint64_t)_mm_cvtsi128_si64(words) | (w0 == u.cur ? u.word : 0);
        uint64_t word1 = (uint64_t)_mm_extract_epi64(words, 1); /* 0 when w1 == w0 */
        /* No branch on w1 != w0 (a third of the steps, at random): word w0 + 1 is stored either
         * way, a zero one still before the end of the unary stream plus PAD. */
        store64(buf + 8 * w0, word0);
        store64(buf + 8 * w0 + 8, word1);
        u.word = w1 != w0 ? word1 : word0;
        u.cur = w1;
        u.at = last;
    }
    for (; i < m; i++) rice_unary_step(&u, idx[i] - idx[i - 1] - 1, k, buf);
}

/* The low parts for k <= 8 of the codes at idx[0 .. 16 * (m / 16) - 1] (idx[-1], their first
 * "previous", is readable), written from ``lp`` (k bytes per eight codes): sixteen gaps' low
 * bytes in a vector, each eight of them packed to their k low bits by pext and stored 8 bytes
 * wide (the spare bytes are overwritten next, or land in the PAD). Returns the codes written. */
AVX512_RICE static size_t rice_low_avx512(const uint32_t *idx, size_t m, int k, uint8_t *lp) {
    const uint64_t keep = 0x0101010101010101ull * (uint64_t)(((unsigned)1 << k) - 1);
    const __m512i one = _mm512_set1_epi32(1);
    size_t i = 0;
    for (; i + 16 <= m; i += 16, lp += 2 * k) {
        __m512i a = _mm512_loadu_si512(idx + i), p = _mm512_loadu_si512(idx + i - 1);
        __m128i bytes = _mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_sub_epi32(a, p), one)); /* low 8 bits */
        store64(lp, _pext_u64((uint64_t)_mm_cvtsi128_si64(bytes), keep));
        store64(lp + k, _pext_u64((uint64_t)_mm_extract_epi64(bytes, 1), keep));
    }
    return i;
}
#endif

PyDoc_STRVAR(rice_encode_doc,
             "rice_encode(indices) -> (k, data)\n\n"
             "Strictly increasing u32 positions as Rice-coded gaps (gap = index - previous - 1,\n"
             "previous of the first is -1) with the cheapest k (the smallest among equals): the\n"
             "unary stream of gap >> k, then the k low bits of every gap.");

/* The Rice code of m >= 1 strictly increasing positions with the cheapest k: a malloc'd
 * buffer of *len bytes (the unary stream, then the low bits). NULL with *bad set when the
 * positions do not increase, NULL alone when out of memory. Runs without the GIL. */
static uint8_t *rice_write(const uint32_t *idx, size_t m, int *k_out, size_t *len, int *bad) {
    int k = 0;
    uint64_t sum_q = 0;
    *bad = 0;
    if (!rice_choose(idx, m, &k, &sum_q)) {
        *bad = 1;
        return NULL;
    }
    uint64_t ulen = (sum_q + m + 7) / 8, llen = ((uint64_t)m * (uint64_t)k + 7) / 8;
    uint8_t *buf = (uint8_t *)calloc(ulen + llen + PAD, 1);
    if (!buf) return NULL;
    /* The unary stream from the positions of its one bits (code i ends at bit at_i, the sum of
     * the first i + 1 codes' lengths, minus 1), a word at a time: each code stores the word
     * it ends in, cleared first when it is a new one (words it skips stay zero). The word of
     * the last code may spill up to 7 zero bytes into the low bits, written next. */
#if HAVE_AVX512
    if (use_avx512) {
        rice_unary_avx512(idx, m, k, buf);
    } else
#endif
    {
        RiceUnary u = {UINT64_MAX, 0, 0};
        for (size_t i = 0; i < m; i++) rice_unary_step(&u, idx[i] - (i ? idx[i - 1] : UINT32_MAX) - 1, k, buf);
    }
    /* The low parts: for k <= 8, eight codes make k whole bytes, built in a register from
     * independent shifts (stored 8 bytes wide: the spare ones are overwritten next, or land in
     * the PAD); then the rest one code at a time. */
    uint8_t *lp = buf + ulen;
    uint32_t mask = (uint32_t)(((uint64_t)1 << k) - 1);
    size_t i = 0;
    if (k <= 8)
        for (; i + 8 <= m; i += 8, lp += k) {
            uint64_t x = 0;
            for (int r = 0; r < 8; r++) {
                uint32_t before = i + (size_t)r ? idx[i + (size_t)r - 1] : UINT32_MAX;
                x |= (uint64_t)((idx[i + (size_t)r] - before - 1) & mask) << (r * k);
            }
            store64(lp, x);
#if HAVE_AVX512
            if (i == 0 && use_avx512) { /* after the first eight (the first "previous" is -1) */
                size_t done = rice_low_avx512(idx + 8, m - 8, k, lp + k);
                i += done;
                lp += (size_t)k * (done / 8);
            }
#endif
        }
    BitWriter low = {lp, 0, 0};
    uint32_t prev = i ? idx[i - 1] : UINT32_MAX;
    for (; i < m; i++) {
        bw_put(&low, (idx[i] - prev - 1) & mask, k); /* k <= 31 */
        prev = idx[i];
    }
    bw_flush(&low);
    *k_out = k;
    *len = (size_t)(ulen + llen);
    return buf;
}

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
    size_t m = (size_t)ib.len / 4, len = 0;
    int k = 0, bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (m) buf = rice_write(idx, m, &k, &len, &bad);
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "indices must be strictly increasing");
        goto done;
    }
    if (m && !buf) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("(iy#)", k, buf ? (const char *)buf : "", (Py_ssize_t)len);
done:
    free(buf);
    PyBuffer_Release(&ib);
    return result;
}

PyDoc_STRVAR(rice_decode_doc,
             "rice_decode(data, count, k, n) -> indices\n\n"
             "Inverse of rice_encode: ``count`` u32 positions, each < n. ValueError unless ``data``\n"
             "is exactly what rice_encode writes for some positions.");

static const char RICE_OOM[] = "out of memory";

#define RICE_SLACK 16 /* idx entries past m that rice_read may scribble on (see pass 1) */

/* Pass 1 of rice_read over whole words while they hold fewer than the m - *j one bits still
 * wanted: the positions of their one bits into idx[*j...], 16 at a time (the rest of a group of
 * 16 is overwritten next, or lands in the RICE_SLACK spare). Returns the word it stopped at. */
#if HAVE_AVX512
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) static uint64_t ones_vbmi2(const uint8_t *buf, uint64_t words,
                                                                                  size_t m, uint32_t *idx, size_t *j) {
    const __m512i iota = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45,
                                         44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26,
                                         25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                         4, 3, 2, 1, 0);
    size_t at = *j;
    uint64_t wi = 0;
    for (; wi < words; wi++) {
        uint64_t word = load64(buf + 8 * wi);
        size_t c = (size_t)__builtin_popcountll(word);
        if (at + c >= m) break;
        __m512i pos = _mm512_maskz_compress_epi8(word, iota), b0 = _mm512_set1_epi32((int)(64 * wi));
        uint32_t *o = idx + at;
        _mm512_storeu_si512(o, _mm512_add_epi32(b0, _mm512_cvtepu8_epi32(_mm512_castsi512_si128(pos))));
        if (c > 16) _mm512_storeu_si512(o + 16, _mm512_add_epi32(b0, _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 1))));
        if (c > 32) _mm512_storeu_si512(o + 32, _mm512_add_epi32(b0, _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 2))));
        if (c > 48) _mm512_storeu_si512(o + 48, _mm512_add_epi32(b0, _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(pos, 3))));
        at += c;
    }
    *j = at;
    return wi;
}
#endif

#if HAVE_AVX512
/* Pass 2 of rice_read for 1 <= k <= 25, 16 codes per step: 16 codes' low parts span 2k whole
 * bytes, so every step takes its fields from the same byte offsets and shifts of a 64-byte
 * window (``low`` has 64 readable bytes past its end; a field and its shift fit in 4 bytes),
 * then sums them in the vector. Returns how many codes it did; *sum is their low parts' sum. */
VBMI2 static size_t rice_pass2_vbmi(const uint8_t *low, uint32_t *idx, size_t m, int k, uint64_t *sum) {
    uint8_t perm[64];
    uint32_t shift[16];
    for (int l = 0; l < 16; l++) {
        for (int b = 0; b < 4; b++) perm[4 * l + b] = (uint8_t)((l * k >> 3) + b);
        shift[l] = (uint32_t)(l * k & 7);
    }
    const __m512i pv = _mm512_loadu_si512(perm), sv = _mm512_loadu_si512(shift), zero = _mm512_setzero_si512();
    const __m512i kmask = _mm512_set1_epi32((int)(((uint32_t)1 << k) - 1));
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m128i kk = _mm_cvtsi32_si128(k);
    uint64_t total = 0;
    uint32_t carry = 0; /* total mod 2**32: what the positions need */
    size_t i = 0;
    for (; i + 16 <= m; i += 16) {
        __m512i f = _mm512_permutexvar_epi8(pv, _mm512_loadu_si512(low + i * (size_t)k / 8));
        f = _mm512_and_si512(_mm512_srlv_epi32(f, sv), kmask);
        f = _mm512_add_epi32(f, _mm512_alignr_epi32(f, zero, 15)); /* inclusive prefix sums */
        f = _mm512_add_epi32(f, _mm512_alignr_epi32(f, zero, 14));
        f = _mm512_add_epi32(f, _mm512_alignr_epi32(f, zero, 12));
        f = _mm512_add_epi32(f, _mm512_alignr_epi32(f, zero, 8));
        uint32_t step = (uint32_t)_mm_extract_epi32(_mm512_extracti32x4_epi32(f, 3), 3); /* < 16 << 25 */
        __m512i iv = _mm512_add_epi32(iota, _mm512_set1_epi32((int)i));
        __m512i at = _mm512_sub_epi32(_mm512_loadu_si512(idx + i), iv);
        __m512i pos = _mm512_add_epi32(_mm512_add_epi32(iv, _mm512_sll_epi32(at, kk)),
                                       _mm512_add_epi32(f, _mm512_set1_epi32((int)carry)));
        _mm512_storeu_si512(idx + i, pos);
        total += step;
        carry += step;
    }
    *sum = total;
    return i;
}
#endif

/* Decodes m >= 1 Rice-coded positions, each < n, from a ``len``-byte stream into idx (room for
 * m + RICE_SLACK entries): NULL, or the reason the stream is not exactly what rice_write
 * writes (RICE_OOM when out of memory). k <= MAX_RICE_K. Runs without the GIL.
 *
 * With at_i the position of the i-th one bit of the unary stream, at_i - i zero bits precede
 * it: the sum of the first i + 1 unary parts. So position i is i + ((at_i - i) << k) + L_i,
 * L_i the sum of the first i + 1 low parts, and no code waits on the one before it. */
static const char *rice_read(const uint8_t *data, size_t len, size_t m, int k, uint64_t n, uint32_t *idx) {
    uint64_t lbits = (uint64_t)m * (uint64_t)k, llen = (lbits + 7) / 8;
    if ((uint64_t)len < llen + 1) return "Rice stream too short";
    uint64_t ulen = (uint64_t)len - llen;
    /* An accepted unary stream holds at most n bits (its parts sum to at most (n - m) >> k):
     * longer is refused before anything is read, which also keeps bit positions in u32. */
    if (ulen > (n + 7) / 8) return "Rice stream has trailing data";
    uint8_t *buf = padded_copy(data, (size_t)ulen), *low = (uint8_t *)malloc((size_t)llen + 64);
    const char *err = NULL;
    if (!buf || !low) {
        err = RICE_OOM;
        goto done;
    }
    if (llen) memcpy(low, data + ulen, (size_t)llen);
    memset(low + llen, 0, 64); /* zero bytes after the low bits: the vector pass loads 64 at a time */
    /* Pass 1: the positions of the first m one bits. Eight are written per word without
     * asking how many there are (the rest is overwritten next; idx has RICE_SLACK spare). */
    const uint64_t words = (ulen + 7) / 8;
    uint64_t last = 0, wi = 0;
    size_t j = 0;
#if HAVE_AVX512
    if (use_vbmi2) wi = ones_vbmi2(buf, words, m, idx, &j);
#endif
    for (; wi < words; wi++) {
        uint64_t word = load64(buf + 8 * wi);
        size_t c = (size_t)__builtin_popcountll(word);
        uint32_t b0 = (uint32_t)(64 * wi);
        if (j + c >= m) { /* the word with the m-th one bit */
            for (; j < m; j++, word &= word - 1) idx[j] = b0 + (uint32_t)__builtin_ctzll(word);
            last = idx[m - 1];
            break;
        }
        uint32_t *o = idx + j;
        for (int r = 0; r < 8; r++, word &= word - 1) o[r] = b0 + low_bit(word);
        for (int r = 8; word; r++, word &= word - 1) o[r] = b0 + low_bit(word);
        j += c;
    }
    if (j < m) {
        err = "Rice stream ends early";
        goto done;
    }
    /* The unary parts sum to last + 1 - m; more than n >> k puts the last position past n
     * (and keeps every sum below from overflowing). */
    if (last + 1 - m > (n >> k)) {
        err = "position past the end of the chunk";
        goto done;
    }
    /* Pass 2: positions from the one bits and the running sum of the low bits. */
    const uint64_t mask = ((uint64_t)1 << k) - 1;
    uint64_t sum_low = 0;
    size_t i = 0;
#if HAVE_AVX512
    if (use_vbmi2 && k >= 1 && k <= 25) i = rice_pass2_vbmi(low, idx, m, k, &sum_low);
#endif
    for (; i < m; i++) {
        uint64_t at = (uint64_t)i * (uint64_t)k;
        sum_low += (load64(low + (at >> 3)) >> (at & 7)) & mask;
        idx[i] = (uint32_t)((uint64_t)i + ((uint64_t)(idx[i] - (uint32_t)i) << k) + sum_low);
    }
    /* Positions increase: the last is the largest. Exact in u64 (the stores above may wrap). */
    if ((uint64_t)(m - 1) + ((last + 1 - m) << k) + sum_low >= n) err = "position past the end of the chunk";
    if (!err && !exact_padding(buf, (size_t)ulen, last + 1)) err = "Rice stream has trailing data";
    if (!err && !exact_padding(low, (size_t)llen, lbits)) err = "Rice low bits have trailing data";
done:
    free(buf);
    free(low);
    return err;
}

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
    /* Decoded straight into the result (not shared yet), then cut to size: no copy. */
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((m + RICE_SLACK) * 4));
    if (!result) goto done;
    uint32_t *idx = (uint32_t *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    err = rice_read((const uint8_t *)db.buf, (size_t)db.len, m, k, (uint64_t)n, idx);
    Py_END_ALLOW_THREADS
    if (err) {
        Py_CLEAR(result);
        if (err == RICE_OOM) PyErr_NoMemory();
        else PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    _PyBytes_Resize(&result, (Py_ssize_t)(m * 4)); /* on failure: result NULL, the error set */
done:
    PyBuffer_Release(&db);
    return result;
}

/* -- 2-bit symbols with exp-Golomb escapes ------------------------------------------------ */

/* The cheapest exp-Golomb order k <= kmax for the escapes (the smallest among equals).
 * cost(k) = m * (1 + k) + 2 * sum(nb), nb = bit_length((e >> k) + 1) - 1. With L = bit_length(e),
 * x = e >> k has bit_length max(L - k, 0), one more after adding 1 exactly when x is all ones,
 * that is when k >= z = bit_length of the zero bits of e below L. So one pass counting L and z
 * prices every k. */
static int expg_best_k(const uint64_t *e, size_t m, int wmax, uint64_t *sum_nb) {
    /* Four interleaved histograms of each: most escapes share a few lengths, and one array of
     * counters would make every increment wait for the previous one. */
    uint64_t sub_l[4][65] = {{0}}, sub_z[4][65] = {{0}}, hist_l[65], hist_z[65];
#define EXPG_COUNT(r, x)                                                                                   \
    {                                                                                                      \
        int l = bitlen(x);                                                                                 \
        uint64_t below = l == 64 ? ~(uint64_t)0 : (((uint64_t)1 << l) - 1);                               \
        sub_l[r][l]++;                                                                                     \
        sub_z[r][bitlen(~(x) & below)]++;                                                                  \
    }
    size_t i = 0;
    for (; i + 4 <= m; i += 4) {
        EXPG_COUNT(0, e[i])
        EXPG_COUNT(1, e[i + 1])
        EXPG_COUNT(2, e[i + 2])
        EXPG_COUNT(3, e[i + 3])
    }
    for (; i < m; i++) EXPG_COUNT(0, e[i])
#undef EXPG_COUNT
    for (int l = 0; l <= 64; l++) {
        hist_l[l] = sub_l[0][l] + sub_l[1][l] + sub_l[2][l] + sub_l[3][l];
        hist_z[l] = sub_z[0][l] + sub_z[1][l] + sub_z[2][l] + sub_z[3][l];
    }
    int kmax = 64; /* bit_length of the largest escape, at most wmax */
    while (kmax > 0 && !hist_l[kmax]) kmax--;
    if (kmax > wmax) kmax = wmax;
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
    *sum_nb = (best - (uint64_t)m * (uint64_t)(1 + k)) / 2; /* the nb of every escape, summed */
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

#if HAVE_AVX512
/* symbols_impl for 2-byte elements, 32 changes per step: the symbols packed four to a byte
 * with two multiply-adds, the escapes compressed out of the vector into e16 (room for count +
 * 32) and widened into esc afterwards. */
VBMI2 static size_t symbols_w2_vbmi2(const uint8_t *t, const uint8_t *b, size_t count, uint8_t *syms, uint64_t *esc,
                                     uint16_t *e16, int *bad) {
    size_t m = 0, i = 0;
    __mmask32 zero = 0;
    const __m512i one = _mm512_set1_epi16(1), three = _mm512_set1_epi16(3), four = _mm512_set1_epi16(4);
    const __m256i w14 = _mm256_set1_epi16(0x0401), w116 = _mm256_set1_epi32(0x00100001);
    for (; i + 32 <= count; i += 32) {
        __m512i d = _mm512_sub_epi16(_mm512_loadu_si512(t + 2 * i), _mm512_loadu_si512(b + 2 * i));
        __m512i z = _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
        zero |= _mm512_cmpeq_epi16_mask(z, _mm512_setzero_si512());
        __m256i sym = _mm512_cvtepi16_epi8(_mm512_min_epu16(_mm512_sub_epi16(z, one), three));
        __m256i pairs = _mm256_maddubs_epi16(sym, w14);          /* s0 + 4 s1, s2 + 4 s3, ... */
        __m256i quads = _mm256_madd_epi16(pairs, w116);          /* (s0 + 4 s1) + 16 (s2 + 4 s3) */
        _mm_storel_epi64((__m128i *)(syms + i / 4), _mm256_cvtepi32_epi8(quads));
        __mmask32 big = _mm512_cmpge_epu16_mask(z, four);
        _mm512_storeu_si512(e16 + m, _mm512_maskz_compress_epi16(big, _mm512_sub_epi16(z, four)));
        m += (size_t)__builtin_popcount(big);
    }
    for (size_t j = 0; j < m; j++) esc[j] = e16[j];
    int tail_bad = 0;
    m += symbols_impl(t + 2 * i, b + 2 * i, count - i, 2, syms + i / 4, esc + m, &tail_bad);
    *bad = zero != 0 || tail_bad;
    return m;
}
#endif

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
#if HAVE_AVX512
    uint16_t *e16 = NULL;
    if (use_vbmi2 && w == 2 && (e16 = (uint16_t *)malloc((count + 32) * sizeof(uint16_t)))) {
        m = symbols_w2_vbmi2(t, b, count, syms, esc, e16, &bad);
        free(e16);
    } else
#endif
    switch (w) {
    case 1: m = symbols_impl(t, b, count, 1, syms, esc, &bad); break;
    case 2: m = symbols_impl(t, b, count, 2, syms, esc, &bad); break;
    case 4: m = symbols_impl(t, b, count, 4, syms, esc, &bad); break;
    default: m = symbols_impl(t, b, count, 8, syms, esc, &bad); break;
    }
    if (!bad && m) {
        uint64_t sum_nb = 0;
        k = expg_best_k(esc, m, 8 * w - 1, &sum_nb);
        uint64_t pbits = sum_nb + m, sbits = sum_nb + (uint64_t)m * (uint64_t)k;
        plen = (pbits + 7) / 8;
        slen = (sbits + 7) / 8;
        pre = (uint8_t *)calloc(plen + PAD, 1);
        suf = (uint8_t *)calloc(slen + PAD, 1);
        if (!pre || !suf) {
            oom = 1;
        } else {
            ByteWriter prefix = {pre, 0, 0}, suffix = {suf, 0, 0};
            uint64_t low_mask = k ? ~(uint64_t)0 >> (64 - k) : 0;
            for (size_t i = 0; i < m; i++) {
                uint64_t x = (esc[i] >> k) + 1;
                int nb = bitlen(x) - 1;
                if (nb + k <= 56) { /* the usual case: one code in each stream */
                    byw_put(&prefix, (uint64_t)1 << nb, nb + 1);
                    byw_put(&suffix, (esc[i] & low_mask) | (x - ((uint64_t)1 << nb)) << k, nb + k);
                    continue;
                }
                BitWriter pw = byw_bits(&prefix), sw = byw_bits(&suffix);
                bw_unary(&pw, (uint64_t)nb);
                bw_put_wide(&sw, esc[i] & low_mask, k);
                bw_put_wide(&sw, x - ((uint64_t)1 << nb), nb);
                prefix = bw_bytes(&pw);
                suffix = bw_bytes(&sw);
            }
            byw_flush(&prefix);
            byw_flush(&suffix);
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

/* For every byte of four symbols and every width, the four elements it stands for: in
 * Z_TABLE the zigzagged changes z = symbol + 1, in D_TABLE the changes themselves (unzigzag(z)
 * in w bytes, what apply2 adds); 0 for symbol 3, an escape, written afterwards. Filled at import. */
static uint8_t Z_TABLE[4][256 * 4 * 8], D_TABLE[4][256 * 4 * 8];

static int width_slot(int w) { return w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3; }

static void fill_tables(void) {
    for (int slot = 0, w = 1; slot < 4; slot++, w *= 2)
        for (unsigned byte = 0; byte < 256; byte++)
            for (unsigned r = 0; r < 4; r++) {
                uint64_t sym = (byte >> (2 * r)) & 3, z = sym == 3 ? 0 : sym + 1;
                uint64_t d = sym == 3 ? 0 : unzigzag(z) & width_mask(w);
                store_elem(Z_TABLE[slot] + (4 * byte + r) * (unsigned)w, z, w);
                store_elem(D_TABLE[slot] + (4 * byte + r) * (unsigned)w, d, w);
            }
}

/* The n elements of ``n`` symbols from ``table`` (Z_TABLE or D_TABLE), four at a time, then the
 * escapes in order over the symbol 3s: their z, or unzigzag(z) when ``changes``. */
static inline __attribute__((always_inline)) void fill_impl(const uint8_t *s, size_t n, const uint64_t *esc,
                                                            uint8_t *out, int w, int changes) {
    const uint8_t *table = changes ? D_TABLE[width_slot(w)] : Z_TABLE[width_slot(w)];
    const size_t quad = 4 * (size_t)w;
    for (size_t i = 0; i < n / 4; i++) memcpy(out + i * quad, table + s[i] * quad, quad);
    if (n & 3) memcpy(out + (n / 4) * quad, table + s[n / 4] * quad, (n & 3) * (size_t)w);
    /* Symbol 3s: both bits of a pair set. A word of 32 symbols at a time (the last one copied
     * out, so that nothing is read past the stream). */
    size_t j = 0, bytes = (n + 3) / 4;
    for (size_t at = 0; at < bytes; at += 8) {
        uint64_t x = 0;
        memcpy(&x, s + at, bytes - at < 8 ? bytes - at : 8);
        uint64_t e = x & (x >> 1) & 0x5555555555555555u;
        for (; e; e &= e - 1) {
            size_t i = 4 * at + (size_t)(__builtin_ctzll(e) >> 1);
            if (i >= n) break; /* padding symbols are 0: never reached in a checked stream */
            uint64_t z = esc[j++];
            store_elem(out + i * (size_t)w, changes ? unzigzag(z) : z, w);
        }
    }
}

#if HAVE_AVX512
/* fill_impl of the changes (D_TABLE) for 2-byte elements, 32 symbols per step: each symbol
 * moved into its own 16-bit lane and looked up, the escapes' changes expanded into the lanes
 * of the symbol 3s. The escapes' changes are narrowed to 16 bits in place in esc first. */
VBMI2 static void fill_changes_w2_vbmi2(const uint8_t *s, size_t n, uint64_t *esc, size_t m, uint16_t *d) {
    uint16_t *e16 = (uint16_t *)esc; /* esc[j] is read before e16[j] is written: in place is safe */
    for (size_t j = 0; j < m; j++) e16[j] = (uint16_t)unzigzag(esc[j]);
    /* lane i (bytes 2i, 2i + 1) takes byte i / 4 of the symbols, then shifts by 2 (i % 4) */
    const __m512i sel = _mm512_set_epi8(0, 7, 0, 7, 0, 7, 0, 7, 0, 6, 0, 6, 0, 6, 0, 6, 0, 5, 0, 5, 0, 5, 0, 5, 0, 4, 0, 4,
                                        0, 4, 0, 4, 0, 3, 0, 3, 0, 3, 0, 3, 0, 2, 0, 2, 0, 2, 0, 2, 0, 1, 0, 1, 0, 1,
                                        0, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i shifts = _mm512_set_epi16(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4,
                                            2, 0, 6, 4, 2, 0);
    const __m512i three = _mm512_set1_epi16(3);
    const uint16_t tab[4] = {0xFFFF, 1, 0xFFFE, 0}; /* unzigzag(symbol + 1); symbol 3: an escape */
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           0, 0, (short)0xFFFE, 1, (short)0xFFFF);
    size_t i = 0, j = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i src = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(s + i / 4)));
        __m512i sym = _mm512_maskz_permutexvar_epi8(0x5555555555555555u, sel, src);
        sym = _mm512_and_si512(_mm512_srlv_epi16(sym, shifts), three);
        __mmask32 em = _mm512_cmpeq_epi16_mask(sym, three);
        __m512i dv = _mm512_mask_expandloadu_epi16(_mm512_permutexvar_epi16(sym, table), em, e16 + j);
        j += (size_t)__builtin_popcount(em);
        _mm512_storeu_si512(d + i, dv);
    }
    for (; i < n; i++) {
        unsigned sym = (s[i >> 2] >> (2 * (i & 3))) & 3;
        d[i] = sym == 3 ? e16[j++] : tab[sym];
    }
}
#endif

#if HAVE_AVX512
/* Whether u32 indices strictly increase, 16 compares at a time (m >= 1). */
VBMI2 static int increasing_avx512(const uint32_t *idx, size_t m) {
    __mmask16 ok = 0xFFFF;
    size_t i = 0;
    for (; i + 17 <= m; i += 16)
        ok &= _mm512_cmpgt_epu32_mask(_mm512_loadu_si512(idx + i + 1), _mm512_loadu_si512(idx + i));
    int good = ok == 0xFFFF;
    for (i += 1; i < m; i++) good &= idx[i] > idx[i - 1];
    return good;
}

/* apply2 in place for 2-byte elements: fill_changes_w2_vbmi2's 32 changes at a time, each
 * block added while the next one's lines are asked for, so that the decoding of the symbols
 * overlaps the memory traffic. esc holds the escapes' z, narrowed to 16-bit changes here. */
VBMI2 static void apply2_w2_vbmi2(uint8_t *o, const uint32_t *idx, const uint8_t *s, size_t n_sym, uint64_t *esc,
                                  size_t m) {
    uint16_t *e16 = (uint16_t *)esc, *out = (uint16_t *)o;
    for (size_t j = 0; j < m; j++) e16[j] = (uint16_t)unzigzag(esc[j]);
    const __m512i sel = _mm512_set_epi8(0, 7, 0, 7, 0, 7, 0, 7, 0, 6, 0, 6, 0, 6, 0, 6, 0, 5, 0, 5, 0, 5, 0, 5, 0, 4, 0, 4,
                                        0, 4, 0, 4, 0, 3, 0, 3, 0, 3, 0, 3, 0, 2, 0, 2, 0, 2, 0, 2, 0, 1, 0, 1, 0, 1,
                                        0, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i shifts = _mm512_set_epi16(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4,
                                            2, 0, 6, 4, 2, 0);
    const __m512i three = _mm512_set1_epi16(3);
    const uint16_t tab[4] = {0xFFFF, 1, 0xFFFE, 0};
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           0, 0, (short)0xFFFE, 1, (short)0xFFFF);
    size_t i = 0, j = 0;
    uint16_t d[32] __attribute__((aligned(64)));
    for (; i + 32 <= n_sym; i += 32) {
        __m512i src = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(s + i / 4)));
        __m512i sym = _mm512_maskz_permutexvar_epi8(0x5555555555555555u, sel, src);
        sym = _mm512_and_si512(_mm512_srlv_epi16(sym, shifts), three);
        __mmask32 em = _mm512_cmpeq_epi16_mask(sym, three);
        _mm512_store_si512(d, _mm512_mask_expandloadu_epi16(_mm512_permutexvar_epi16(sym, table), em, e16 + j));
        j += (size_t)__builtin_popcount(em);
        if (i + 96 <= n_sym)
            for (int r = 0; r < 32; r++) __builtin_prefetch(out + idx[i + 64 + (size_t)r], 1, 3);
        for (int r = 0; r < 32; r++) out[idx[i + (size_t)r]] += d[r];
    }
    for (; i < n_sym; i++) {
        unsigned sym = (s[i >> 2] >> (2 * (i & 3))) & 3;
        out[idx[i]] += sym == 3 ? e16[j++] : tab[sym];
    }
}
#endif

/* The escapes of ``n`` 2-bit symbols (the symbol 3s among them: *m_out), decoded and checked
 * with everything else about the streams but the symbols' own values: NULL, or why the
 * streams are not what pack2 writes (RICE_OOM when out of memory). On success *esc_out is a
 * malloc'd array of the escapes' z, plus a spare 0 (fill_impl reads one past the last). */
static const char *escapes_read(const uint8_t *s, size_t n, int k, const uint8_t *pdata, size_t plen,
                                const uint8_t *sdata, size_t slen, int w, uint64_t **esc_out, size_t *m_out) {
    const char *err = NULL;
    size_t m = 0, i = 0; /* escapes: symbols 3 among the first n, 32 at a time */
    for (; i + 8 <= n / 4; i += 8) {
        uint64_t x = load64(s + i);
        m += (size_t)__builtin_popcountll(x & (x >> 1) & 0x5555555555555555u);
    }
    for (; i < n / 4; i++) m += (size_t)__builtin_popcount(s[i] & (s[i] >> 1) & 0x55);
    for (i = n & ~(size_t)3; i < n; i++) m += ((s[i >> 2] >> (2 * (i & 3))) & 3) == 3;
    uint8_t *pre = padded_copy(pdata, plen), *suf = padded_copy(sdata, slen);
    uint64_t *esc = (uint64_t *)malloc((m + 1 + RICE_SLACK) * sizeof(uint64_t));
    if (!pre || !suf || !esc) {
        err = RICE_OOM;
        goto done;
    }
    const uint64_t emax = width_mask(w) - 4, hmax = emax >> k;
    const uint64_t kmask = k ? ~(uint64_t)0 >> (64 - k) : 0, lmax = emax & kmask;
    const uint64_t sbits = 8 * (uint64_t)slen, words = (plen + 7) / 8;
    uint64_t ppos = 0, spos = 0;
    /* The positions of the prefixes' one bits (as in rice_read's pass 1), into esc. */
    size_t found = 0;
    for (uint64_t wi = 0; wi < words && found < m; wi++) {
        uint64_t word = load64(pre + 8 * wi), b0 = 64 * wi;
        size_t c = (size_t)__builtin_popcountll(word);
        if (found + c >= m) {
            for (; found < m; found++, word &= word - 1) esc[found] = b0 + (uint64_t)__builtin_ctzll(word);
            break;
        }
        uint64_t *o = esc + found;
        for (int r = 0; r < 8; r++, word &= word - 1) o[r] = b0 + low_bit(word);
        for (int r = 8; word; r++, word &= word - 1) o[r] = b0 + low_bit(word);
        found += c;
    }
    if (found < m) err = "escape stream ends early";
    uint64_t last = UINT64_MAX;
    for (size_t j = 0; j < m && !err; j++) {
        uint64_t nb = esc[j] - last - 1, lo, hi; /* prefix j: nb zero bits, then a one */
        last = esc[j];
        if (nb > 63 || spos + (uint64_t)k + nb > sbits) {
            err = "escape runs past its stream";
            break;
        }
        uint64_t nmask = ((uint64_t)1 << nb) - 1;
        if ((uint64_t)k + nb <= 57) { /* the usual case: one load */
            uint64_t v = load64(suf + (spos >> 3)) >> (spos & 7);
            lo = v & kmask;
            hi = nmask + ((v >> k) & nmask); /* e >> k */
        } else {
            lo = get_bits(suf, spos, k);
            hi = nmask + get_bits(suf, spos + (uint64_t)k, (int)nb);
        }
        spos += (uint64_t)k + nb;
        if (hi > hmax || (hi == hmax && lo > lmax)) {
            err = "escaped change wider than the element";
            break;
        }
        esc[j] = ((hi << k) | lo) + 4;
    }
    ppos = last + 1;
    esc[m] = 0;
    if (!err && (n & 3) && (s[n >> 2] >> (2 * (n & 3))) != 0) err = "symbol stream has trailing data";
    if (!err && !m && k != 0) err = "escape parameter without escapes";
    if (!err && !exact_padding(pre, plen, ppos)) err = "escape stream has trailing data";
    if (!err && !exact_padding(suf, slen, spos)) err = "escape stream has trailing data";
done:
    free(pre);
    free(suf);
    if (err) {
        free(esc);
        esc = NULL;
    }
    *esc_out = esc;
    *m_out = m;
    return err;
}

/* The argument checks unpack2 and apply2 share; 0 with an exception set when one fails. */
static int zz2_args(int w, Py_ssize_t count, int k) {
    if (!check_width(w)) return 0;
    if (count < 1) {
        PyErr_Format(PyExc_ValueError, "bad count %zd", count);
        return 0;
    }
    if (k < 0 || k >= 8 * w) {
        PyErr_Format(PyExc_ValueError, "bad escape parameter %d", k);
        return 0;
    }
    return 1;
}

static PyObject *k_unpack2(PyObject *self, PyObject *args) {
    PyObject *so, *po, *fo;
    Py_ssize_t count;
    int k, w;
    if (!PyArg_ParseTuple(args, "OniOOi:unpack2", &so, &count, &k, &po, &fo, &w)) return NULL;
    if (!zz2_args(w, count, k)) return NULL;
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
    uint64_t *esc = NULL;
    size_t n = (size_t)count;
    const uint8_t *s = (const uint8_t *)sb.buf;
    if ((size_t)sb.len != (n + 3) / 4) {
        PyErr_SetString(PyExc_ValueError, "symbol stream of the wrong size");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (size_t)w));
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result); /* not shared yet: filled without the GIL */
    Py_BEGIN_ALLOW_THREADS
    size_t n_esc = 0;
    err = escapes_read(s, n, k, (const uint8_t *)pb.buf, (size_t)pb.len, (const uint8_t *)fb.buf, (size_t)fb.len,
                       w, &esc, &n_esc);
    if (!err) {
        switch (w) {
        case 1: fill_impl(s, n, esc, out, 1, 0); break;
        case 2: fill_impl(s, n, esc, out, 2, 0); break;
        case 4: fill_impl(s, n, esc, out, 4, 0); break;
        default: fill_impl(s, n, esc, out, 8, 0); break;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_CLEAR(result);
        if (err == RICE_OOM) PyErr_NoMemory();
        else PyErr_SetString(PyExc_ValueError, err);
    }
done:
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

/* -- apply2: 2-bit symbols applied straight from their stream -------------------------- */

/* apply_impl for the add transform, with the changes themselves (unzigzagged) in ``d``. */
static inline __attribute__((always_inline)) void add_impl(uint8_t *o, const uint8_t *src, size_t n,
                                                           const uint32_t *idx, const uint8_t *d, size_t m, int w) {
    size_t i = 0;
#define ADD_ONE                                                                 \
    do {                                                                        \
        uint8_t *p = o + (size_t)idx[i] * (size_t)w;                            \
        store_elem(p, load_elem(p, w) + load_elem(d + i * (size_t)w, w), w);    \
    } while (0)
    if (!src) { /* in place: the changed elements' cache lines come from memory; ask early */
        for (; i + 64 < m; i++) {
            __builtin_prefetch(o + (size_t)idx[i + 64] * (size_t)w, 1, 3);
            ADD_ONE;
        }
        for (; i < m; i++) ADD_ONE;
        return;
    }
    const size_t block = (size_t)(32768 / w); /* elements */
    for (size_t start = 0; start < n; start += block) {
        size_t end = start + block < n ? start + block : n;
        memcpy(o + start * (size_t)w, src + start * (size_t)w, (end - start) * (size_t)w);
        for (; i < m && idx[i] < end; i++) ADD_ONE;
    }
#undef ADD_ONE
}

PyDoc_STRVAR(apply2_doc,
             "apply2(out, base, indices, symbols, k, prefix, suffix, width)\n\n"
             "scatter(out, base, indices, unpack2(symbols, count, k, prefix, suffix, width), width, 1)\n"
             "with count = len(indices) // 4, in one pass: the values are never materialized. The\n"
             "same inputs are refused, and ``out`` is written only once everything has been checked.");

static PyObject *k_apply2(PyObject *self, PyObject *args) {
    PyObject *oo, *bo, *io, *so, *po, *fo;
    int k, w;
    if (!PyArg_ParseTuple(args, "OOOOiOOi:apply2", &oo, &bo, &io, &so, &k, &po, &fo, &w)) return NULL;
    PyObject *objs[5] = {io, so, po, fo, oo};
    Py_buffer bufs[5], bb = {0};
    int got = 0, have_base = bo != Py_None;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &bufs[got], got == 4) < 0) break;
    PyObject *result = NULL;
    const char *err = NULL;
    uint64_t *esc = NULL;
    if (got < 5) goto done;
    if (have_base && get_buffer(bo, &bb, 0) < 0) {
        have_base = 0;
        goto done;
    }
    Py_buffer *ib = &bufs[0], *sb = &bufs[1], *pb = &bufs[2], *fb = &bufs[3], *ob = &bufs[4];
    size_t m = (size_t)ib->len / 4;
    if (!zz2_args(w, (Py_ssize_t)m, k)) goto done;
    if ((size_t)sb->len != (m + 3) / 4) {
        PyErr_SetString(PyExc_ValueError, "symbol stream of the wrong size");
        goto done;
    }
    size_t n = (size_t)ob->len / (size_t)w;
    const uint32_t *idx = (const uint32_t *)ib->buf;
    const uint8_t *s = (const uint8_t *)sb->buf;
    int mismatched = ob->len % w || ib->len % 4 || (have_base && bb.len != ob->len), bad = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t n_esc = 0;
    err = escapes_read(s, m, k, (const uint8_t *)pb->buf, (size_t)pb->len, (const uint8_t *)fb->buf,
                       (size_t)fb->len, w, &esc, &n_esc);
    if (!err && !mismatched) {
        bad = idx[m - 1] >= n;
#if HAVE_AVX512
        if (use_vbmi2) bad |= !increasing_avx512(idx, m);
        else
#endif
        for (size_t i = 1; i < m; i++) bad |= idx[i] <= idx[i - 1];
    }
    const uint8_t *src = have_base && bb.buf != ob->buf ? (const uint8_t *)bb.buf : NULL;
    int ready = !err && !mismatched && !bad; /* everything checked: out may be written */
#if HAVE_AVX512
    if (ready && use_vbmi2 && w == 2 && !src) {
        apply2_w2_vbmi2((uint8_t *)ob->buf, idx, s, m, esc, n_esc);
        ready = 0; /* applied */
    }
#endif
    uint8_t *d = NULL;
    if (ready && !(d = (uint8_t *)malloc(m * (size_t)w))) err = RICE_OOM;
    if (d) {
        uint8_t *o = (uint8_t *)ob->buf;
#if HAVE_AVX512
        if (use_vbmi2 && w == 2) {
            fill_changes_w2_vbmi2(s, m, esc, n_esc, (uint16_t *)d);
            add_impl(o, src, n, idx, d, m, 2);
        } else
#endif
        switch (w) {
        case 1: fill_impl(s, m, esc, d, 1, 1), add_impl(o, src, n, idx, d, m, 1); break;
        case 2: fill_impl(s, m, esc, d, 2, 1), add_impl(o, src, n, idx, d, m, 2); break;
        case 4: fill_impl(s, m, esc, d, 4, 1), add_impl(o, src, n, idx, d, m, 4); break;
        default: fill_impl(s, m, esc, d, 8, 1), add_impl(o, src, n, idx, d, m, 8); break;
        }
        free(d);
    }
    Py_END_ALLOW_THREADS
    if (err == RICE_OOM) PyErr_NoMemory();
    else if (err) PyErr_SetString(PyExc_ValueError, err);
    else if (mismatched) PyErr_SetString(PyExc_ValueError, "scatter: buffers of mismatched sizes");
    else if (bad) PyErr_SetString(PyExc_ValueError, "scatter: indices must be increasing and in range");
    else result = Py_NewRef(Py_None);
done:
    free(esc);
    if (have_base) PyBuffer_Release(&bb);
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
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
    /* A chained loop on purpose: vectorized, it reloads the masks just stored one by one as a
     * vector, which stalls on store forwarding in every block. */
    uint64_t above = m == 64 ? ~(uint64_t)0 : (((uint64_t)1 << m) - 1);
    for (int t = 0; t < nt; t++) {
        words[t] = above & ~ge[t];
        above = ge[t];
    }
    words[nt] = above;
}

/* The class of a magnitude: how many limits it reaches (unused limits are UINT64_MAX). */
static inline unsigned class_of(uint64_t mag, const Classes *cl) {
    unsigned c = 0;
    for (int t = 0; t < MAX_CLASSES - 1; t++) c += mag >= cl->lim[t];
    return c;
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

/* The low popcount(mask) bits of src, deposited at the one bits of mask (BMI2's pdep), for
 * hosts without it: one select per one bit of src, as a class has few changes in a block. */
static inline uint64_t pdep_soft(uint64_t src, uint64_t mask) {
    uint64_t out = 0;
    for (; src; src &= src - 1) out |= (uint64_t)1 << select64(mask, __builtin_ctzll(src));
    return out;
}

static inline void copy_elem(uint8_t *dst, const uint8_t *src, int w) {
    switch (w) { /* constant sizes: a load and a store, not a call */
    case 1: *dst = *src; break;
    case 2: memcpy(dst, src, 2); break;
    case 4: memcpy(dst, src, 4); break;
    default: memcpy(dst, src, 8); break;
    }
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
            /* Joined by kunpackd, not by widening and shifting: GCC 12 folds the widening into the
             * compare and may then spill the mask with a 32-bit store and reload 64 bits (seen at
             * -O1 -fsanitize=undefined: the high lanes picked up stale stack bytes). */
            ge[t] = _mm512_kunpackd(_mm512_cmpge_epu16_mask(v1, lim), _mm512_cmpge_epu16_mask(v0, lim));
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

AVX512_BMI2 static inline uint64_t pdep_bmi2(uint64_t src, uint64_t mask) { return _pdep_u64(src, mask); }
#endif

/* The two loops, written once and compiled for each block_words/pdep pair (like scan).
 *
 * ranks_loop: for every changed element (its class known) its rank among the class's
 * elements, and its place among the class's changes, where its rank and values go. Both are
 * popcounts of the block's membership words, so no change waits on another (a per-class
 * counter would, and a search for the class mispredicts on about every change).
 *
 * select_loop, its inverse: each class's changes as a bitmap over the class's ranks; the
 * bits of it that cover this block's members of the class, deposited at those members'
 * places (pdep), are the block's changed elements of that class; no loop per change but the
 * one that writes them out, in index order, each with its value from the class-ordered
 * values. Returns 0 when the base holds more elements of a class than ``counts`` says. */
#define DEFINE_CLASS_LOOPS(ATTR, SUFFIX, WORDS, PDEP) \
ATTR static void ranks_loop##SUFFIX(const uint8_t *base, size_t n, int w, const Classes *cl, const uint32_t *idx, \
                                    size_t k, const uint8_t *cls, const uint8_t *tv, const uint8_t *bv, size_t *vat, \
                                    uint32_t *ranks, uint8_t *tv_out, uint8_t *bv_out, uint32_t *running) { \
    size_t j = 0; \
    uint64_t words[MAX_CLASSES]; \
    for (size_t start = 0; start < n; start += 64) { \
        size_t m = n - start < 64 ? n - start : 64, j0 = j; \
        WORDS(base, start, m, w, cl, words); \
        uint64_t changed = 0; \
        for (; j < k && idx[j] < start + m; j++) changed |= (uint64_t)1 << (idx[j] - start); \
        for (size_t i = j0; i < j; i++) { \
            uint64_t below = ((uint64_t)1 << (idx[i] - start)) - 1; \
            unsigned c = cls[i]; \
            size_t q = vat[c] + (size_t)__builtin_popcountll(words[c] & changed & below); \
            ranks[q] = running[c] + (uint32_t)__builtin_popcountll(words[c] & below); \
            copy_elem(tv_out + q * (size_t)w, tv + i * (size_t)w, w); \
            copy_elem(bv_out + q * (size_t)w, bv + i * (size_t)w, w); \
        } \
        for (int c = 0; c < cl->B; c++) { \
            running[c] += (uint32_t)__builtin_popcountll(words[c]); \
            vat[c] += (size_t)__builtin_popcountll(words[c] & changed); \
        } \
    } \
} \
ATTR static int select_loop##SUFFIX(const uint8_t *base, size_t n, int w, const Classes *cl, uint8_t *const *bitmaps, \
                                    const uint32_t *counts, const uint8_t *values, size_t *vat, uint32_t *out, \
                                    uint8_t *out_values, uint64_t *running) { \
    uint64_t words[MAX_CLASSES], dep[MAX_CLASSES], off = sign_off(w); \
    size_t o = 0; \
    for (size_t start = 0; start < n; start += 64) { \
        size_t m = n - start < 64 ? n - start : 64; \
        WORDS(base, start, m, w, cl, words); \
        uint64_t hits = 0; \
        for (int c = 0; c < cl->B; c++) { \
            int pc = __builtin_popcountll(words[c]); \
            if (running[c] + (uint64_t)pc > counts[c]) return 0; /* the bitmap holds counts[c] bits */ \
            dep[c] = PDEP(get_bits64(bitmaps[c], running[c], pc), words[c]); \
            hits |= dep[c]; \
            running[c] += (uint64_t)pc; \
        } \
        for (; hits; hits &= hits - 1) { \
            int bit = __builtin_ctzll(hits); \
            unsigned c = class_of(load_elem(base + (start + (size_t)bit) * (size_t)w, w) & off, cl); \
            size_t slot = vat[c] + (size_t)__builtin_popcountll(dep[c] & (((uint64_t)1 << bit) - 1)); \
            out[o] = (uint32_t)(start + (size_t)bit); \
            copy_elem(out_values + o * (size_t)w, values + slot * (size_t)w, w); \
            o++; \
        } \
        for (int c = 0; c < cl->B; c++) vat[c] += (size_t)__builtin_popcountll(dep[c]); \
    } \
    return 1; \
}

DEFINE_CLASS_LOOPS(, , block_words, pdep_soft)
#if HAVE_AVX512
DEFINE_CLASS_LOOPS(AVX512_BMI2, _avx512, block_words_avx512, pdep_bmi2)
/* Without AVX-512, x86-64 still has POPCNT nearly everywhere (not in the baseline, where every
 * popcount is a libgcc call): the portable loops built for it run about 1.4x faster. */
DEFINE_CLASS_LOOPS(__attribute__((target("popcnt"))), _popcnt, block_words, pdep_soft)
static int use_popcnt = 0; /* set once at import */
#endif

static const int BIN_SHIFT[9] = {0, 3, 7, 0, 23, 0, 0, 0, 52};

/* Parses ``thresholds`` (u16 each, strictly increasing, 1 <= t <= max bin) into limits. */
static int parse_classes(const Py_buffer *tb, int w, Classes *cl) {
    size_t nt = (size_t)tb->len / 2;
    if (tb->len % 2 || nt > MAX_CLASSES - 1) {
        PyErr_SetString(PyExc_ValueError, "bad class thresholds");
        return 0;
    }
    uint64_t max_bin = sign_off(w) >> BIN_SHIFT[w];
    const uint8_t *p = (const uint8_t *)tb->buf;
    uint64_t prev = 0;
    cl->B = (int)nt + 1;
    for (int t = 0; t < MAX_CLASSES - 1; t++) cl->lim[t] = UINT64_MAX;
    for (size_t t = 0; t < nt; t++) {
        uint64_t th = (uint64_t)p[2 * t] | (uint64_t)p[2 * t + 1] << 8;
        if (th <= prev || th > max_bin) {
            PyErr_SetString(PyExc_ValueError, "class thresholds must increase from 1 to the largest bin");
            return 0;
        }
        cl->lim[t] = th << BIN_SHIFT[w];
        prev = th;
    }
    return 1;
}

/* -- choosing the thresholds -- */

#define MAX_RUNS 64 /* bins the DP splits at most; more present bins are thinned to 64 */

/* The twin computes the same costs with numpy's exactly rounded + - * / and Python's
 * math.log2, which is this libm's log2: a fused multiply-add here would round differently and
 * could flip a near tie between two splits. */
#if defined(__clang__)
#define FP_STRICT_FN
#define FP_STRICT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define FP_STRICT_FN __attribute__((optimize("fp-contract=off")))
#define FP_STRICT_BODY
#else
#define FP_STRICT_FN
#define FP_STRICT_BODY
#endif

/* nn * H(kk / nn): the bits of which of nn elements are the kk that changed, at their rate. */
FP_STRICT_FN static double class_cost(double nn, double kk) {
    FP_STRICT_BODY
    double p = nn > 0 ? kk / nn : 0.0;
    double lp = log2(p > 0 ? p : 1.0), lq = log2(p < 1 ? 1.0 - p : 1.0);
    double h = -(p * lp + (1.0 - p) * lq);
    return nn * h;
}

/* The thresholds (bins, increasing) of the best split of a chunk into at most G classes, as
 * documented at class_thresholds below; returns their number, or -1 when out of memory. The
 * elements per bin come from the n elements at base, or (n = 0) from ``sample``. */
static int choose_thresholds(const uint8_t *base, size_t n, const uint32_t *sample, const uint8_t *vals, size_t k,
                             int w, int G, double overhead, uint16_t *out) {
    const int shift = BIN_SHIFT[w];
    const uint64_t off = sign_off(w);
    const size_t nbins = (size_t)(off >> shift) + 1;
    uint64_t *hn = (uint64_t *)calloc(2 * nbins + 1, sizeof(uint64_t)), *hk = hn + nbins;
    uint32_t *present = (uint32_t *)malloc(nbins * sizeof(uint32_t));
    uint32_t *sub = (uint32_t *)calloc(8 * nbins, sizeof(uint32_t)); /* 4 histograms of each */
    double *cost = (double *)malloc((MAX_RUNS + 1) * (MAX_RUNS + 1) * sizeof(double));
    int found = -1;
    if (!hn || !present || !sub || !cost) goto done;
    /* Four interleaved histograms each: changes crowd into a few bins, and one array of
     * counters would make every increment wait for the previous one to the same bin. Unrolled,
     * so that no counter's address waits on an index computation either. */
#define BIN(T, p) ((size_t)((load_##T(p) & off) >> shift))
#define HISTOGRAMS(T, W)                                                                                   \
    {                                                                                                      \
        size_t i = 0;                                                                                      \
        for (; i + 64 <= n; i += 64) {                                                                     \
            const uint8_t *p = base + i * W;                                                               \
            sub[BIN(T, p)]++;                                                                              \
            sub[nbins + BIN(T, p + 16 * W)]++;                                                             \
            sub[2 * nbins + BIN(T, p + 32 * W)]++;                                                         \
            sub[3 * nbins + BIN(T, p + 48 * W)]++;                                                         \
        }                                                                                                  \
        for (; i < n; i += 16) sub[BIN(T, base + i * W)]++;                                                \
        size_t j = 0;                                                                                      \
        for (; j + 4 <= k; j += 4) {                                                                       \
            const uint8_t *p = vals + j * W;                                                               \
            sub[4 * nbins + BIN(T, p)]++;                                                                  \
            sub[5 * nbins + BIN(T, p + W)]++;                                                              \
            sub[6 * nbins + BIN(T, p + 2 * W)]++;                                                          \
            sub[7 * nbins + BIN(T, p + 3 * W)]++;                                                          \
        }                                                                                                  \
        for (; j < k; j++) sub[4 * nbins + BIN(T, vals + j * W)]++;                                        \
    }
    switch (w) {
    case 1: HISTOGRAMS(u8, 1) break;
    case 2: HISTOGRAMS(u16, 2) break;
    case 4: HISTOGRAMS(u32, 4) break;
    default: HISTOGRAMS(u64, 8) break;
    }
#undef BIN
#undef HISTOGRAMS
    for (size_t b = 0; b < nbins; b++) {
        hn[b] = (uint64_t)sub[b] + sub[nbins + b] + sub[2 * nbins + b] + sub[3 * nbins + b] + (sample ? sample[b] : 0);
        hk[b] = (uint64_t)sub[4 * nbins + b] + sub[5 * nbins + b] + sub[6 * nbins + b] + sub[7 * nbins + b];
    }
    size_t L = 0;
    for (size_t b = 0; b < nbins; b++)
        if (hn[b] || hk[b]) present[L++] = (uint32_t)b;
    found = 0;
    if (L < 2 || G < 2) goto done;
    if (L > MAX_RUNS) { /* numpy's linspace(0, L - 1, 64) truncated: i * step, the last exact */
        double step = (double)(L - 1) / (double)(MAX_RUNS - 1);
        for (size_t i = 0; i < MAX_RUNS - 1; i++) present[i] = present[(size_t)((double)i * step)];
        present[MAX_RUNS - 1] = present[L - 1];
        L = MAX_RUNS;
    }
    /* cn[i], ck[i]: elements (the sample's count times 16) and changes in bins before run i */
    size_t m = L;
    double cn[MAX_RUNS + 1], ck[MAX_RUNS + 1];
    uint64_t sn = 0, sk = 0;
    size_t r = 0;
    for (size_t b = 0; b <= nbins && r <= m; b++) {
        if (b == (r < m ? present[r] : nbins)) {
            cn[r] = r ? (double)(16 * sn) : 0.0;
            ck[r] = r ? (double)sk : 0.0;
            r++;
        }
        if (b < nbins) sn += hn[b], sk += hk[b];
    }
    for (size_t i = 0; i < m; i++)
        for (size_t j = i + 1; j <= m; j++) {
            double nn = cn[j] - cn[i], kk = ck[j] - ck[i];
            cost[i * (m + 1) + j] = class_cost(nn, kk < nn ? kk : nn);
        }
    double prev[MAX_RUNS + 1], cur[MAX_RUNS + 1], totals[MAX_CLASSES];
    uint8_t back[MAX_CLASSES - 1][MAX_RUNS + 1];
    prev[0] = INFINITY;
    for (size_t j = 1; j <= m; j++) prev[j] = cost[j];
    totals[0] = prev[m];
    for (int g = 1; g < G; g++) {
        for (size_t j = 0; j <= m; j++) {
            double best = INFINITY;
            size_t arg = 0;
            for (size_t i = 0; i < j; i++) { /* the first of equals, like numpy's argmin */
                double v = prev[i] + cost[i * (m + 1) + j];
                if (v < best) best = v, arg = i;
            }
            cur[j] = j ? best : INFINITY;
            back[g - 1][j] = (uint8_t)arg;
        }
        memcpy(prev, cur, sizeof(prev));
        totals[g] = prev[m] + (double)g * overhead;
    }
    int g = 0;
    for (int q = 1; q < G; q++)
        if (totals[q] < totals[g]) g = q;
    size_t j = m;
    for (int level = g; level > 0; level--) {
        j = back[level - 1][j];
        out[level - 1] = (uint16_t)present[j];
    }
    found = g;
done:
    free(hn);
    free(present);
    free(sub);
    free(cost);
    return found;
}

PyDoc_STRVAR(class_thresholds_doc,
             "class_thresholds(base, width, values, max_classes, overhead_bits) -> thresholds\n\n"
             "The bins (u16 each, increasing; empty: one class is best) that split a chunk into at\n"
             "most ``max_classes`` magnitude classes of elements whose chance of changing differs\n"
             "most. Elements per bin come from a sample of ``base`` (every 16th element, times 16),\n"
             "changes per bin from ``values`` (the changed elements of the base). Bins present in\n"
             "either are cut into runs (at most 64: linspace over them, truncated); the split into\n"
             "runs minimises sum over classes of n H(k / n) (k capped at n) plus ``overhead_bits``\n"
             "per class after the first (dynamic programming in float64, the first of equals).");

PyDoc_STRVAR(class_thresholds_sampled_doc,
             "class_thresholds_sampled(sample, width, values, max_classes, overhead_bits) -> thresholds\n\n"
             "class_thresholds with the elements per bin taken from ``sample`` (what scan_sampled\n"
             "returns for the base) instead of counted in the base again.");

/* class_thresholds and class_thresholds_sampled (``base`` is then the sample). */
static PyObject *thresholds_call(PyObject *args, int sampled) {
    PyObject *bo, *vo;
    int w, G, overhead;
    if (!PyArg_ParseTuple(args, sampled ? "OiOii:class_thresholds_sampled" : "OiOii:class_thresholds", &bo, &w, &vo,
                          &G, &overhead))
        return NULL;
    if (!check_width(w)) return NULL;
    if (G < 1 || G > MAX_CLASSES || overhead < 0) return PyErr_Format(PyExc_ValueError, "bad class count %d", G);
    Py_buffer bb, vb;
    if (get_buffer(bo, &bb, 0) < 0) return NULL;
    if (get_buffer(vo, &vb, 0) < 0) {
        PyBuffer_Release(&bb);
        return NULL;
    }
    PyObject *result = NULL;
    uint16_t th[MAX_CLASSES - 1];
    int found = 0;
    if (bb.len % w || vb.len % w) {
        PyErr_SetString(PyExc_ValueError, "class_thresholds: buffers of whole elements expected");
        goto done;
    }
    if (sampled && (size_t)bb.len != 4 * bin_count(w)) {
        PyErr_SetString(PyExc_ValueError, "class_thresholds_sampled: a sample of u32 per bin of the width expected");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    found = choose_thresholds(sampled ? NULL : (const uint8_t *)bb.buf, sampled ? 0 : (size_t)bb.len / (size_t)w,
                              sampled ? (const uint32_t *)bb.buf : NULL, (const uint8_t *)vb.buf,
                              (size_t)vb.len / (size_t)w, w, G, (double)overhead, th);
    Py_END_ALLOW_THREADS
    if (found < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)th, 2 * (Py_ssize_t)found); /* little-endian host */
done:
    PyBuffer_Release(&bb);
    PyBuffer_Release(&vb);
    return result;
}

static PyObject *k_class_thresholds(PyObject *self, PyObject *args) { return thresholds_call(args, 0); }

static PyObject *k_class_thresholds_sampled(PyObject *self, PyObject *args) { return thresholds_call(args, 1); }

/* -- encoding: ranks, values and streams of every class -- */

PyDoc_STRVAR(class_encode_doc,
             "class_encode(base, width, thresholds, indices, target_values, base_values)\n"
             "    -> (counts, per_class, target_values, base_values, classes)\n\n"
             "The changed elements (``indices``: increasing u32; the values: their elements' bytes)\n"
             "in the magnitude classes of ``base``: ``counts`` (u32 per class) how many elements each\n"
             "class holds, ``per_class`` (u32 per class) how many of them changed, both values\n"
             "reordered class after class (in index order within a class), and per class a tuple\n"
             "``(rice_k, rice, bitmap)``: the changes' ranks among the class's elements Rice-coded as\n"
             "rice_encode does ((0, b'') for none) and, when at least 1/8 of the class changed, the\n"
             "bitmap of those ranks (LSB-first, zero padding), else None.");

static PyObject *k_class_encode(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    int w;
    if (!PyArg_ParseTuple(args, "OiOOOO:class_encode", &objs[0], &w, &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer bufs[5];
    int got = 0;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &bufs[got], 0) < 0) break;
    PyObject *result = NULL, *tvo = NULL, *bvo = NULL, *classes = NULL;
    uint8_t *cls = NULL, *rice[MAX_CLASSES] = {0}, *bitmap[MAX_CLASSES] = {0};
    uint32_t *sorted = NULL;
    if (got < 5) goto done;
    Py_buffer *bb = &bufs[0], *ib = &bufs[2], *tb = &bufs[3], *vb = &bufs[4];
    Classes cl;
    if (!parse_classes(&bufs[1], w, &cl)) goto done;
    size_t n = (size_t)bb->len / (size_t)w, k = (size_t)ib->len / 4;
    if (bb->len % w || ib->len % 4 || (size_t)tb->len != k * (size_t)w || (size_t)vb->len != k * (size_t)w) {
        PyErr_SetString(PyExc_ValueError, "class_encode: buffers of mismatched sizes");
        goto done;
    }
    tvo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(k * (size_t)w));
    bvo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(k * (size_t)w));
    cls = (uint8_t *)malloc(k ? k : 1);
    sorted = (uint32_t *)malloc(4 * (k ? k : 1));
    if (!tvo || !bvo || !cls || !sorted) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    const uint32_t *idx = (const uint32_t *)ib->buf;
    const uint8_t *tv = (const uint8_t *)tb->buf, *bv = (const uint8_t *)vb->buf;
    uint8_t *tv_out = (uint8_t *)PyBytes_AS_STRING(tvo), *bv_out = (uint8_t *)PyBytes_AS_STRING(bvo);
    uint32_t running[MAX_CLASSES] = {0}, per[MAX_CLASSES] = {0};
    size_t rice_len[MAX_CLASSES] = {0};
    int rice_k[MAX_CLASSES] = {0}, bad = 0, oom = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 1; i < k; i++) bad |= idx[i] <= idx[i - 1];
    bad |= k && idx[k - 1] >= n;
    if (!bad) {
        const uint8_t *bp = (const uint8_t *)bb->buf;
        const uint64_t off = sign_off(w);
        for (size_t j = 0; j < k; j++) cls[j] = (uint8_t)class_of(load_elem(bp + (size_t)idx[j] * (size_t)w, w) & off, &cl);
        for (int c = 0; c < cl.B; c++) { /* one count per class: no chain through a counter array */
            uint32_t count = 0;
            for (size_t j = 0; j < k; j++) count += cls[j] == c;
            per[c] = count;
        }
        size_t vat[MAX_CLASSES], total = 0;
        for (int c = 0; c < cl.B; c++) {
            vat[c] = total;
            total += per[c];
        }
#if HAVE_AVX512
        if (use_avx512)
            ranks_loop_avx512(bp, n, w, &cl, idx, k, cls, tv, bv, vat, sorted, tv_out, bv_out, running);
        else if (use_popcnt)
            ranks_loop_popcnt(bp, n, w, &cl, idx, k, cls, tv, bv, vat, sorted, tv_out, bv_out, running);
        else
#endif
            ranks_loop(bp, n, w, &cl, idx, k, cls, tv, bv, vat, sorted, tv_out, bv_out, running);
        const uint32_t *ranks = sorted;
        for (int c = 0; c < cl.B && !oom; ranks += per[c], c++) {
            if (!per[c]) continue;
            int not_increasing = 0; /* cannot happen: ranks within a class increase with the index */
            rice[c] = rice_write(ranks, per[c], &rice_k[c], &rice_len[c], &not_increasing);
            oom |= !rice[c];
            if (!oom && 8 * (uint64_t)per[c] >= running[c]) { /* the bitmap: unary codes of the gaps */
                bitmap[c] = (uint8_t *)calloc((running[c] + 7) / 8 + PAD, 1);
                oom |= !bitmap[c];
                if (!oom) {
                    BitWriter bw = {bitmap[c], 0, 0};
                    int64_t prev = -1;
                    for (uint32_t i = 0; i < per[c]; i++) {
                        bw_unary(&bw, (uint64_t)((int64_t)ranks[i] - prev - 1));
                        prev = ranks[i];
                    }
                    bw_flush(&bw);
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "class_encode: indices must be increasing and in range");
        goto done;
    }
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    classes = PyTuple_New(cl.B);
    if (!classes) goto done;
    for (int c = 0; c < cl.B; c++) {
        PyObject *item;
        if (bitmap[c])
            item = Py_BuildValue("(iy#y#)", rice_k[c], (const char *)rice[c], (Py_ssize_t)rice_len[c],
                                 (const char *)bitmap[c], (Py_ssize_t)((running[c] + 7) / 8));
        else
            item = Py_BuildValue("(iy#O)", rice_k[c], rice[c] ? (const char *)rice[c] : "", (Py_ssize_t)rice_len[c],
                                 Py_None);
        if (!item) goto done;
        PyTuple_SET_ITEM(classes, c, item);
    }
    result = Py_BuildValue("(y#y#OOO)", (const char *)running, (Py_ssize_t)(4 * cl.B), (const char *)per,
                           (Py_ssize_t)(4 * cl.B), tvo, bvo, classes);
done:
    for (int c = 0; c < MAX_CLASSES; c++) {
        free(rice[c]);
        free(bitmap[c]);
    }
    free(cls);
    free(sorted);
    Py_XDECREF(tvo);
    Py_XDECREF(bvo);
    Py_XDECREF(classes);
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

/* -- decoding -- */

#define CLASS_HEAD 10 /* u32 changes, u8 method, u8 parameter, u32 stream length */

PyDoc_STRVAR(class_select_doc,
             "class_select(base, width, thresholds, counts, heads, streams, values) -> (indices, values)\n\n"
             "Inverse of class_encode. ``counts``: u32 per class; ``heads``: per class the payload's\n"
             "header (u32 changes, u8 method, u8 parameter, u32 stream length); ``streams``: per\n"
             "class a buffer, for method 0 the Rice code of the class's ranks (parameter k, as\n"
             "rice_decode reads it), for method 1 their bitmap, decompressed; ``values``: the changes'\n"
             "elements, class after class. Returns the changed elements' indices (increasing u32)\n"
             "and their values in that order. ValueError unless every stream is exactly what\n"
             "class_encode writes for ranks below its class's count (an empty class: method 0,\n"
             "parameter 0, no stream; a Rice stream: as long as its header says), the changes add\n"
             "up to the values and the classes of ``base`` hold ``counts`` elements.");

static PyObject *k_class_select(PyObject *self, PyObject *args) {
    PyObject *objs[5], *so;
    int w;
    if (!PyArg_ParseTuple(args, "OiOOOOO:class_select", &objs[0], &w, &objs[1], &objs[2], &objs[3], &so, &objs[4]))
        return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer bufs[5], sb[MAX_CLASSES];
    int got = 0, got_s = 0;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &bufs[got], 0) < 0) break;
    PyObject *result = NULL, *io = NULL, *vo = NULL, *seq = NULL;
    uint8_t *maps = NULL;
    uint32_t *scratch = NULL;
    const char *err = NULL;
    if (got < 5) goto done;
    Py_buffer *bb = &bufs[0], *nb = &bufs[2], *hb = &bufs[3], *vb = &bufs[4];
    Classes cl;
    if (!parse_classes(&bufs[1], w, &cl)) goto done;
    seq = PySequence_Fast(so, "class_select: streams must be a sequence");
    if (!seq) goto done;
    if (bb->len % w || vb->len % w || nb->len != 4 * cl.B || hb->len != CLASS_HEAD * cl.B ||
        PySequence_Fast_GET_SIZE(seq) != cl.B) {
        PyErr_SetString(PyExc_ValueError, "class_select: buffers of mismatched sizes");
        goto done;
    }
    for (; got_s < cl.B; got_s++)
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, got_s), &sb[got_s], 0) < 0) goto done;
    size_t n = (size_t)bb->len / (size_t)w, k = (size_t)vb->len / (size_t)w;
    const uint8_t *h = (const uint8_t *)hb->buf;
    uint32_t counts[MAX_CLASSES], per[MAX_CLASSES];
    uint64_t sum_n = 0, sum_k = 0, map_bytes = 0, most = 1;
    uint8_t method[MAX_CLASSES], param[MAX_CLASSES];
    memcpy(counts, nb->buf, 4 * (size_t)cl.B);
    for (int c = 0; c < cl.B && !err; c++) {
        uint32_t length;
        memcpy(&per[c], h + CLASS_HEAD * c, 4);
        method[c] = h[CLASS_HEAD * c + 4], param[c] = h[CLASS_HEAD * c + 5];
        memcpy(&length, h + CLASS_HEAD * c + 6, 4);
        uint64_t n_c = counts[c], k_c = per[c], len = (uint64_t)sb[c].len;
        sum_n += n_c, sum_k += k_c;
        map_bytes += (n_c + 7) / 8 + PAD;
        if (k_c > most) most = k_c;
        if (k_c > n_c) err = "more changes than elements in a class";
        else if (k_c == 0 && (method[c] != 0 || param[c] != 0 || length != 0 || len != 0)) err = "empty class with a stream";
        else if (k_c && method[c] == 0 && (param[c] > MAX_RICE_K || len != length)) err = "bad Rice class stream";
        else if (k_c && method[c] == 1 && (param[c] != 0 || len != (n_c + 7) / 8)) err = "bad class bitmap";
        else if (method[c] > 1) err = "unknown class coding";
    }
    if (!err && sum_n != n) err = "class counts do not add up to the chunk";
    if (!err && sum_k != k) err = "class changes do not add up to the values";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    io = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * k));
    vo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(k * (size_t)w));
    maps = (uint8_t *)malloc((size_t)map_bytes);
    scratch = (uint32_t *)malloc(4 * ((size_t)most + RICE_SLACK));
    if (!io || !vo || !maps || !scratch) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    uint32_t *out = (uint32_t *)PyBytes_AS_STRING(io);
    uint8_t *out_values = (uint8_t *)PyBytes_AS_STRING(vo);
    Py_BEGIN_ALLOW_THREADS
    uint8_t *bitmaps[MAX_CLASSES];
    size_t vat[MAX_CLASSES], at = 0, map_at = 0;
    for (int c = 0; c < cl.B && !err; c++) {
        size_t bytes = ((size_t)counts[c] + 7) / 8;
        uint8_t *bm = bitmaps[c] = maps + map_at;
        map_at += bytes + PAD;
        vat[c] = at;
        at += per[c];
        if (per[c] && method[c] == 1) {
            memcpy(bm, sb[c].buf, bytes);
            memset(bm + bytes, 0, PAD);
            uint64_t ones = 0;
            for (size_t i = 0; i < bytes; i += 8) ones += (uint64_t)__builtin_popcountll(load64(bm + i));
            if (!exact_padding(bm, bytes, counts[c])) err = "class bitmap padding is not zero";
            else if (ones != per[c]) err = "class bitmap holds another number of changes";
            continue;
        }
        memset(bm, 0, bytes + PAD);
        if (!per[c]) continue;
        err = rice_read((const uint8_t *)sb[c].buf, (size_t)sb[c].len, per[c], param[c], counts[c], scratch);
        for (uint32_t i = 0; !err && i < per[c]; i++) bm[scratch[i] >> 3] |= (uint8_t)(1u << (scratch[i] & 7));
    }
    if (!err) {
        uint64_t running[MAX_CLASSES] = {0};
        int ok;
#if HAVE_AVX512
        if (use_avx512)
            ok = select_loop_avx512((const uint8_t *)bb->buf, n, w, &cl, bitmaps, counts, (const uint8_t *)vb->buf,
                                    vat, out, out_values, running);
        else if (use_popcnt)
            ok = select_loop_popcnt((const uint8_t *)bb->buf, n, w, &cl, bitmaps, counts, (const uint8_t *)vb->buf,
                                    vat, out, out_values, running);
        else
#endif
            ok = select_loop((const uint8_t *)bb->buf, n, w, &cl, bitmaps, counts, (const uint8_t *)vb->buf, vat,
                             out, out_values, running);
        for (int c = 0; c < cl.B; c++) ok &= running[c] == counts[c];
        if (!ok) err = "class positions do not match the base (ranks or class counts)";
    }
    Py_END_ALLOW_THREADS
    if (err == RICE_OOM) {
        PyErr_NoMemory();
        goto done;
    }
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    result = PyTuple_Pack(2, io, vo);
done:
    free(maps);
    free(scratch);
    Py_XDECREF(io);
    Py_XDECREF(vo);
    for (int i = 0; i < got_s; i++) PyBuffer_Release(&sb[i]);
    Py_XDECREF(seq);
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

/* -- module ------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"scan", k_scan, METH_VARARGS, scan_doc},
    {"scan_sampled", k_scan_sampled, METH_VARARGS, scan_sampled_doc},
    {"rice_encode", k_rice_encode, METH_VARARGS, rice_encode_doc},
    {"rice_decode", k_rice_decode, METH_VARARGS, rice_decode_doc},
    {"pack2", k_pack2, METH_VARARGS, pack2_doc},
    {"unpack2", k_unpack2, METH_VARARGS, unpack2_doc},
    {"scatter", k_scatter, METH_VARARGS, scatter_doc},
    {"apply2", k_apply2, METH_VARARGS, apply2_doc},
    {"class_thresholds", k_class_thresholds, METH_VARARGS, class_thresholds_doc},
    {"class_thresholds_sampled", k_class_thresholds_sampled, METH_VARARGS, class_thresholds_sampled_doc},
    {"class_encode", k_class_encode, METH_VARARGS, class_encode_doc},
    {"class_select", k_class_select, METH_VARARGS, class_select_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "deltasync.format._kernels",
    .m_doc = "Hot loops of the chunk codec; deltasync.format._kernels_py is the pure-numpy twin.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    fill_tables();
    if (!changes_key_ok) changes_key_ok = pthread_key_create(&changes_key, changes_free) == 0;
#if HAVE_AVX512
    __builtin_cpu_init();
    use_avx512 = __builtin_cpu_supports("avx512bw") && !getenv("DELTASYNC_NO_AVX512");
    use_popcnt = __builtin_cpu_supports("popcnt") && !getenv("DELTASYNC_NO_POPCNT");
    use_vbmi2 = use_avx512 && __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512vbmi") &&
                __builtin_cpu_supports("avx512vl");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "simd", use_avx512 ? "avx512bw" : BASELINE_SIMD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
