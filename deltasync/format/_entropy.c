/* Hot loops of the codec's full payloads (codec version 3), as a CPython extension module.
 *
 * deltasync/format/_entropy_py.py is the pure-numpy twin of every function here: same arguments,
 * byte-identical results, the same inputs refused (tests/format/test_codec_full.py checks both).
 * The codec (deltasync/format/codec.py, whose docstring documents the layouts) uses this
 * module when it imports and the twin otherwise; frequency tables are built and parsed in
 * Python, so nothing here is a format decision of its own.
 *
 * The entropy coder is static rANS: 32-bit states, 16-bit renormalisation words, frequencies
 * in 1/2^12, LANES states interleaved (symbol i is coded by state i % LANES, so consecutive
 * symbols do not wait on each other). A stream is the LANES final encoder states (u32, the
 * decoder's initial ones) then the u16 words in the order the decoder reads them; decoding
 * must end with every state back at RANS_L and every word read.
 *
 * Every loop runs without the GIL. Malformed data raises ValueError (the codec turns it into
 * CorruptObjectError); nothing reads or writes outside the buffers it was given.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "deltasync.format._entropy supports little-endian hosts only (numpy fallback elsewhere)"
#endif

#define LANES 32
#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_L (1u << 16)
#define HEAD_BYTES (4 * LANES)
#if PROB_BITS != 12
#error "the decoder packs a slot's frequency - 1, offset and symbol into 12 + 12 + 8 bits"
#endif

static int check_width(int w) {
    if (w == 1 || w == 2 || w == 4 || w == 8) return 1;
    PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8, got %d", w);
    return 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS);
}

static inline uint64_t load_elem(const uint8_t *p, int w) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)w);
    return v;
}

static inline uint16_t load16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Rotating left by one bit moves the sign to the bottom: the top byte of a bf16, fp32 or
 * fp64 element is then its exponent (high bits), whose skewed distribution the coder wants
 * alone in a plane rather than mixed with the sign. */
static inline uint64_t rotl1(uint64_t v, int w) {
    int bits = 8 * w;
    uint64_t mask = w == 8 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
    return ((v << 1) | (v >> (bits - 1))) & mask;
}

static inline uint64_t rotr1(uint64_t v, int w) {
    int bits = 8 * w;
    uint64_t mask = w == 8 ? ~(uint64_t)0 : (((uint64_t)1 << bits) - 1);
    return ((v >> 1) | (v << (bits - 1))) & mask;
}

/* -- byte planes -------------------------------------------------------------------------- */

/* Four tables per plane, taking turns by element: an exponent plane is mostly a few values,
 * and one table would make every increment wait on the previous one of the same counter.
 * u32 counters do not overflow: a table sees at most a quarter of 2^32 - 1 elements. */
#define COUNT_TABLES 4

/* Always inlined with a constant width, so that element loads and stores are single moves
 * (a memcpy of a variable size is a library call per element). dst NULL: counts only. */
static inline __attribute__((always_inline)) void split_w(const uint8_t *src, uint8_t *dst, size_t n, const int w,
                                                          int rotate, uint32_t *tab) {
    for (size_t i = 0; i < n; i++) {
        uint64_t v = load_elem(src + (size_t)w * i, w);
        if (rotate) v = rotl1(v, w);
        uint32_t *t = tab + (i % COUNT_TABLES) * 256;
        for (int b = 0; b < w; b++) {
            const uint8_t byte = (uint8_t)(v >> (8 * b));
            if (dst) dst[(size_t)b * n + i] = byte;
            t[(size_t)b * COUNT_TABLES * 256 + byte]++;
        }
    }
}

static inline __attribute__((always_inline)) void join_w(const uint8_t *src, uint8_t *dst, size_t n, const int w,
                                                         int rotate) {
    for (size_t i = 0; i < n; i++) {
        uint64_t v = 0;
        for (int b = 0; b < w; b++) v |= (uint64_t)src[(size_t)b * n + i] << (8 * b);
        if (rotate) v = rotr1(v, w);
        memcpy(dst + (size_t)w * i, &v, (size_t)w);
    }
}

static void split_planes(const uint8_t *src, uint8_t *dst, size_t n, int w, int rotate, uint32_t *tab) {
    switch (w) {
    case 1: if (rotate) split_w(src, dst, n, 1, 1, tab); else split_w(src, dst, n, 1, 0, tab); break;
    case 2: if (rotate) split_w(src, dst, n, 2, 1, tab); else split_w(src, dst, n, 2, 0, tab); break;
    case 4: if (rotate) split_w(src, dst, n, 4, 1, tab); else split_w(src, dst, n, 4, 0, tab); break;
    default: if (rotate) split_w(src, dst, n, 8, 1, tab); else split_w(src, dst, n, 8, 0, tab); break;
    }
}

/* The tables' sums: w * 256 u64 counts, plane after plane. */
static void sum_counts(const uint32_t *tab, int w, uint64_t *out) {
    for (int b = 0; b < w; b++)
        for (int s = 0; s < 256; s++) {
            uint64_t c = 0;
            for (int k = 0; k < COUNT_TABLES; k++) c += tab[((size_t)b * COUNT_TABLES + k) * 256 + s];
            out[b * 256 + s] = c;
        }
}

/* Both for split and counts: the planes (dst may be NULL) and their counts as a bytes object. */
static PyObject *split_impl(PyObject *args, const char *fmt, int with_planes) {
    PyObject *dobj;
    int w, rotate;
    if (!PyArg_ParseTuple(args, fmt, &dobj, &w, &rotate)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer db;
    if (get_buffer(dobj, &db, 0) < 0) return NULL;
    PyObject *planes = NULL, *counts = NULL, *result = NULL;
    uint32_t *tab = NULL;
    const size_t n = (size_t)db.len / (size_t)w;
    if (db.len % w || n > (size_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "split: data is not whole elements, or too many");
        goto done;
    }
    tab = (uint32_t *)calloc((size_t)w * COUNT_TABLES * 256, sizeof(uint32_t));
    if (!tab) {
        PyErr_NoMemory();
        goto done;
    }
    counts = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)w * 256 * 8);
    if (!counts) goto done;
    if (with_planes && !(planes = PyBytes_FromStringAndSize(NULL, db.len))) goto done;
    uint8_t *dst = planes ? (uint8_t *)PyBytes_AS_STRING(planes) : NULL;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(counts);
    Py_BEGIN_ALLOW_THREADS
    split_planes((const uint8_t *)db.buf, dst, n, w, rotate, tab);
    sum_counts(tab, w, out);
    Py_END_ALLOW_THREADS
    result = with_planes ? PyTuple_Pack(2, planes, counts) : Py_NewRef(counts);
done:
    Py_XDECREF(planes);
    Py_XDECREF(counts);
    free(tab);
    PyBuffer_Release(&db);
    return result;
}

static void join_planes(const uint8_t *src, uint8_t *dst, size_t n, int w, int rotate) {
    switch (w) {
    case 1: if (rotate) join_w(src, dst, n, 1, 1); else memcpy(dst, src, n); break;
    case 2: if (rotate) join_w(src, dst, n, 2, 1); else join_w(src, dst, n, 2, 0); break;
    case 4: if (rotate) join_w(src, dst, n, 4, 1); else join_w(src, dst, n, 4, 0); break;
    default: if (rotate) join_w(src, dst, n, 8, 1); else join_w(src, dst, n, 8, 0); break;
    }
}

PyDoc_STRVAR(split_doc, "split(data, width, rotate, /) -> (planes, counts)\n\n"
                        "Byte planes of the elements (each rotated left by one bit if rotate), and how\n"
                        "often each byte value occurs in each plane: width * 256 u64, plane after plane.");

static PyObject *e_split(PyObject *self, PyObject *args) { return split_impl(args, "Oip:split", 1); }

PyDoc_STRVAR(join_doc, "join(planes, out, width, rotate, /) -> None\n\n"
                       "The inverse of split, written into out (writable, of the same size).");

static PyObject *e_join(PyObject *self, PyObject *args) {
    PyObject *pobj, *oobj;
    int w, rotate;
    if (!PyArg_ParseTuple(args, "OOip:join", &pobj, &oobj, &w, &rotate)) return NULL;
    if (!check_width(w)) return NULL;
    Py_buffer pb, ob;
    if (get_buffer(pobj, &pb, 0) < 0) return NULL;
    if (get_buffer(oobj, &ob, 1) < 0) {
        PyBuffer_Release(&pb);
        return NULL;
    }
    PyObject *result = NULL;
    if (pb.len != ob.len || pb.len % w) {
        PyErr_SetString(PyExc_ValueError, "join: buffers of mismatched sizes");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    join_planes((const uint8_t *)pb.buf, (uint8_t *)ob.buf, (size_t)pb.len / (size_t)w, w, rotate);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ob);
    return result;
}

PyDoc_STRVAR(counts_doc, "counts(data, width, rotate, /) -> bytes\n\n"
                         "The counts of split(data, width, rotate), without the planes.");

static PyObject *e_counts(PyObject *self, PyObject *args) { return split_impl(args, "Oip:counts", 0); }

/* -- rANS --------------------------------------------------------------------------------- */

/* Frequencies (256 u32) summing to PROB_SCALE, and their cumulative starts. */
static int read_freqs(PyObject *fobj, uint32_t freq[256], uint32_t cum[256]) {
    Py_buffer fb;
    if (get_buffer(fobj, &fb, 0) < 0) return 0;
    int ok = fb.len == 256 * 4;
    if (ok) {
        uint64_t total = 0;
        for (int s = 0; s < 256; s++) {
            freq[s] = load32((const uint8_t *)fb.buf + 4 * s);
            cum[s] = (uint32_t)(total > PROB_SCALE ? PROB_SCALE : total);
            total += freq[s];
        }
        ok = total == PROB_SCALE;
    }
    PyBuffer_Release(&fb);
    if (!ok) PyErr_SetString(PyExc_ValueError, "frequencies must be 256 u32 summing to 2**12");
    return ok;
}

PyDoc_STRVAR(rans_encode_doc, "rans_encode(plane, freqs, /) -> bytes\n\n"
                              "The rANS stream of plane's bytes under freqs (256 u32 summing to 2**12; every\n"
                              "byte of plane must have a frequency).");

static PyObject *e_rans_encode(PyObject *self, PyObject *args) {
    PyObject *pobj, *fobj;
    if (!PyArg_ParseTuple(args, "OO:rans_encode", &pobj, &fobj)) return NULL;
    uint32_t freq[256], cum[256];
    if (!read_freqs(fobj, freq, cum)) return NULL;
    Py_buffer pb;
    if (get_buffer(pobj, &pb, 0) < 0) return NULL;
    PyObject *result = NULL;
    const size_t n = (size_t)pb.len;
    /* Each symbol emits at most one word; words are written backwards from the end. */
    uint8_t *buf = (uint8_t *)malloc(HEAD_BYTES + 2 * n);
    if (!buf) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *src = (const uint8_t *)pb.buf;
    int missing = 0;
    uint8_t *p = buf + HEAD_BYTES + 2 * n;
    Py_BEGIN_ALLOW_THREADS
    uint32_t x[LANES];
    /* Per symbol: the state at or above which a word is emitted before coding it, and x / f
     * as a multiply (Granlund-Montgomery, exact for every 32-bit x): with l = ceil(log2 f)
     * and m = floor(2^(32 + l) / f) + 1 = 2^32 + rcp, x / f = (x + (x * rcp >> 32)) >> l. */
    uint64_t bound[256];
    uint32_t rcp[256];
    uint8_t shift[256];
    for (int s = 0; s < 256; s++) {
        int l = 0;
        while (l < 32 && ((uint64_t)1 << l) < freq[s]) l++;
        bound[s] = (uint64_t)freq[s] << (32 - PROB_BITS);
        rcp[s] = freq[s] ? (uint32_t)((((uint64_t)1 << (32 + l)) / freq[s] + 1) - ((uint64_t)1 << 32)) : 0;
        shift[s] = (uint8_t)l;
    }
    for (int j = 0; j < LANES; j++) x[j] = RANS_L;
    for (size_t i = n; i-- > 0;) {
        const unsigned s = src[i];
        const uint32_t f = freq[s];
        if (!f) {
            missing = 1;
            break;
        }
        uint32_t v = x[i % LANES];
        /* Without a branch (it would mispredict on every other symbol of a flat plane): the
         * word is always stored below p, and p moves over it only when it is emitted. There
         * is room below: the states' HEAD_BYTES. */
        const uint32_t emit = v >= bound[s];
        const uint16_t word = (uint16_t)v;
        memcpy(p - 2, &word, 2);
        p -= 2 * emit;
        v >>= emit << 4;
        const uint32_t q = (uint32_t)(((uint64_t)v + (((uint64_t)v * rcp[s]) >> 32)) >> shift[s]);
        x[i % LANES] = (q << PROB_BITS) + (v - q * f) + cum[s];
    }
    for (int j = 0; j < LANES; j++) {
        p -= 4;
        memcpy(p, &x[LANES - 1 - j], 4);
    }
    Py_END_ALLOW_THREADS
    if (missing)
        PyErr_SetString(PyExc_ValueError, "rans_encode: a byte of the plane has no frequency");
    else
        result = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)(buf + HEAD_BYTES + 2 * n - p));
done:
    free(buf);
    PyBuffer_Release(&pb);
    return result;
}

/* One symbol: the state's slot names it, and the state steps back to before its coding. */
#define RANS_STEP(v, out_sym)                                                                  \
    do {                                                                                       \
        const uint32_t e_ = table[(v) & (PROB_SCALE - 1)];                                     \
        (out_sym) = (uint8_t)e_;                                                               \
        (v) = ((e_ >> 20) + 1) * ((v) >> PROB_BITS) + ((e_ >> 8) & (PROB_SCALE - 1));          \
    } while (0)

PyDoc_STRVAR(rans_decode_doc, "rans_decode(stream, freqs, n, /) -> bytes\n\n"
                              "The n bytes a rans_encode stream under the same freqs holds. Raises ValueError\n"
                              "on a stream that is not exactly what rans_encode writes.");

static PyObject *e_rans_decode(PyObject *self, PyObject *args) {
    PyObject *sobj, *fobj;
    Py_ssize_t n_arg;
    if (!PyArg_ParseTuple(args, "OOn:rans_decode", &sobj, &fobj, &n_arg)) return NULL;
    if (n_arg < 0) return PyErr_Format(PyExc_ValueError, "bad symbol count %zd", n_arg);
    uint32_t freq[256], cum[256];
    if (!read_freqs(fobj, freq, cum)) return NULL;
    Py_buffer sb;
    if (get_buffer(sobj, &sb, 0) < 0) return NULL;
    PyObject *result = NULL;
    uint32_t *table = NULL;
    const char *err = NULL;
    const size_t n = (size_t)n_arg;
    if (sb.len < HEAD_BYTES || (sb.len - HEAD_BYTES) % 2) {
        PyErr_SetString(PyExc_ValueError, "rANS stream of a bad length");
        goto done;
    }
    /* Per slot, in one u32 (one load per symbol): the frequency less one (12 bits), the slot's
     * offset in its symbol's range (12 bits) and the symbol (8 bits). */
    table = (uint32_t *)malloc(PROB_SCALE * sizeof(uint32_t));
    if (!table) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t s = 0; s < 256; s++)
        for (uint32_t k = 0; k < freq[s]; k++) table[cum[s] + k] = (freq[s] - 1) << 20 | k << 8 | s;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *head = (const uint8_t *)sb.buf;
    const uint8_t *p = head + HEAD_BYTES, *end = head + sb.len;
    Py_BEGIN_ALLOW_THREADS
    uint32_t x[LANES];
    for (int j = 0; j < LANES; j++) {
        x[j] = load32(head + 4 * j);
        if (x[j] < RANS_L) err = "rANS state out of range";
    }
    size_t i = 0;
    if (!err) {
        /* While a whole round of words is left, read a word unconditionally and keep it only
         * where the state needs it (no branch on the data). */
        for (; i + LANES <= n && (size_t)(end - p) >= 2 * LANES; i += LANES) {
#pragma GCC unroll 8
            for (int j = 0; j < LANES; j++) {
                uint32_t v = x[j];
                RANS_STEP(v, out[i + j]);
                /* Arithmetic rather than a select, which compilers turn back into a branch
                 * that mispredicts about every other symbol. */
                const uint32_t need = v < RANS_L;
                v = (v << (need << 4)) | (load16(p) & (0u - need));
                p += 2 * need;
                x[j] = v;
            }
        }
        for (; i < n; i++) {
            uint32_t v = x[i % LANES];
            RANS_STEP(v, out[i]);
            if (v < RANS_L) {
                if (p == end) {
                    err = "rANS stream ends early";
                    break;
                }
                v = (v << 16) | load16(p);
                p += 2;
            }
            x[i % LANES] = v;
        }
    }
    if (!err && p != end) err = "rANS stream longer than its symbols";
    for (int j = 0; j < LANES && !err; j++)
        if (x[j] != RANS_L) err = "rANS stream does not end in its initial states";
    Py_END_ALLOW_THREADS
    if (err) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, err);
    }
done:
    free(table);
    PyBuffer_Release(&sb);
    return result;
}

static PyMethodDef methods[] = {
    {"split", e_split, METH_VARARGS, split_doc},
    {"join", e_join, METH_VARARGS, join_doc},
    {"counts", e_counts, METH_VARARGS, counts_doc},
    {"rans_encode", e_rans_encode, METH_VARARGS, rans_encode_doc},
    {"rans_decode", e_rans_decode, METH_VARARGS, rans_decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "deltasync.format._entropy",
    .m_doc = "Hot loops of the codec's full payloads; deltasync.format._entropy_py is the pure-numpy twin.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__entropy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "LANES", LANES) < 0 || PyModule_AddIntConstant(m, "PROB_BITS", PROB_BITS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
