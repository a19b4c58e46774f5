/* The rolling key table and the re-keying of the common events in C (issue #22 §5), compiled
 * into the _accel extension beside _accel.c (which only calls kvcm_rekey_add at its init).
 *
 * sidecar/source/rekey.py is the reference and the fallback: its KeyTable and Rekey._stored /
 * _removed define every rule; this file must match them entry for entry, count for count (a
 * hypothesis test runs both on the same event streams). What is here:
 *   - KeyTable: (group, engine key) -> (state, pending, held, tainted, epoch), open addressing
 *     with linear probing over any number of slots (a multiply-shift home, no power of two: the
 *     table is sized to its capacity, not to the next power of two), at most 3/4 full, deleted by
 *     backward shift (no tombstones). A slot is 24 bytes (+ 8 per earlier key in 1:n), the slot
 *     array an anonymous mapping (it grows by 1/4, and its memory goes back to the system when
 *     it is replaced or cleared).
 *   - KeyTable.rekey: a run of block events (BlockRemoved; BlockStored of full attention whose
 *     tokens are msgpack ints, without LoRA, extra keys or an SGLang root) re-keyed without a
 *     Python call per block; it stops at the first event it cannot take, which rekey.py re-keys
 *     (the rare rules: LoRA, extra keys, salted roots, tokenless, malformed, other groups' kinds).
 * The entry's bits are rekey.py's (its packed int is state | meta << 64): meta = held (24 bits)
 * | tainted << 24 | pending << 32 (24 bits) | epoch << 56; bits 25-31 are this table's own
 * (the group, 6 bits, and "slot used") and never shown. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>
#include <sys/mman.h>

#include "rolling.h"

#define M_HELD 0xFFFFFFULL
#define M_TAINT (1ULL << 24)
#define M_GROUP_SHIFT 25
#define M_GROUP (0x3FULL << M_GROUP_SHIFT)
#define M_USED (1ULL << 31)
#define M_PEND_SHIFT 32
#define M_PEND 0xFFFFFFULL
#define M_EPOCH_SHIFT 56
#define M_EPOCH (0xFFULL << M_EPOCH_SHIFT)
#define M_PUBLIC (~(M_GROUP | M_USED))
#define HOME_MIX 0x9E3779B97F4A7C15ULL

/* rekey.py's REASONS, in order, then blocks keyed: the counters array. */
enum { C_UNKNOWN_PARENT, C_EXTRA_KEYS, C_LORA, C_TAINTED, C_GROUP, C_TOKENLESS, C_MALFORMED,
       C_OTHER_INSTANCE, C_KEYED, C_N };

typedef struct {
    int64_t key;
    uint64_t state;
    uint64_t meta;
    /* int64_t extras[down - 1] follow (1:n) */
} Slot;

typedef struct {
    PyObject_HEAD
    char *slots;
    size_t nslots, bytes, stride;
    int64_t n, capacity, evictions, since;
    int down;
    unsigned epoch;
    uint64_t *tok; /* scratch: one event's tokens */
    Py_ssize_t tok_cap;
} KT;

#define SLOT(t, i) ((Slot *)((t)->slots + (size_t)(i) * (t)->stride))
#define EXTRAS(s) ((int64_t *)((s) + 1))
#define GROUP_OF(m) ((int)(((m) & M_GROUP) >> M_GROUP_SHIFT))

static PyObject *py_64;

static inline size_t home(const KT *t, int g, int64_t key, size_t nslots) {
    uint64_t h = ((uint64_t)key ^ ((uint64_t)g << 57)) * HOME_MIX;
    h ^= h >> 29;
    return (size_t)(((unsigned __int128)h * nslots) >> 64);
}

static inline int64_t epoch_len(const KT *t) {
    int64_t l = t->capacity >> 4;
    return l > 0 ? l : 1;
}

static Py_ssize_t kt_find(const KT *t, int g, int64_t key) {
    if (!t->nslots) return -1;
    size_t i = home(t, g, key, t->nslots);
    for (;;) {
        const Slot *s = SLOT(t, i);
        if (!(s->meta & M_USED)) return -1;
        if (s->key == key && GROUP_OF(s->meta) == g) return (Py_ssize_t)i;
        if (++i == t->nslots) i = 0;
    }
}

static char *map_slots(size_t bytes) {
#ifdef MAP_POPULATE /* the pages at once, not one fault each: the rehash writes all of them */
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
#else
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
#endif
    return p == MAP_FAILED ? NULL : (char *)p;
}

/* Room for one more entry: grows the slots by 1/4 (to the capacity's size when that is
 * nearer), rehashing every entry. -1 (MemoryError set) if the mapping failed. */
static int kt_reserve(KT *t) {
    if ((size_t)(t->n + 1) * 4 <= t->nslots * 3) return 0;
    size_t need = ((size_t)(t->n + 1) * 4 + 2) / 3 + 1;
    size_t cap = ((size_t)t->capacity * 4 + 2) / 3 + 1;
    size_t want = t->nslots + t->nslots / 2;
    if (want < 64) want = 64;
    if (want < need) want = need;
    if (t->nslots < cap && want > cap && cap >= need) want = cap;
    size_t bytes = want * t->stride;
    char *fresh = map_slots(bytes);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < t->nslots; i++) {
        const Slot *s = SLOT(t, i);
        if (!(s->meta & M_USED)) continue;
        size_t j = home(t, GROUP_OF(s->meta), s->key, want);
        while (((Slot *)(fresh + j * t->stride))->meta & M_USED)
            if (++j == want) j = 0;
        memcpy(fresh + j * t->stride, s, t->stride);
    }
    if (t->slots) munmap(t->slots, t->bytes);
    t->slots = fresh;
    t->nslots = want;
    t->bytes = bytes;
    return 0;
}

/* A new entry (the key is not in the table), stamped with the epoch; a creation advances it. */
static Slot *kt_insert(KT *t, int g, int64_t key, uint64_t state, uint64_t meta,
                       const int64_t *extras) {
    if (kt_reserve(t) < 0) return NULL;
    size_t i = home(t, g, key, t->nslots);
    while (SLOT(t, i)->meta & M_USED)
        if (++i == t->nslots) i = 0;
    Slot *s = SLOT(t, i);
    s->key = key;
    s->state = state;
    s->meta = (meta & M_PUBLIC & ~M_EPOCH) | M_USED | ((uint64_t)g << M_GROUP_SHIFT) |
              ((uint64_t)t->epoch << M_EPOCH_SHIFT);
    if (t->down > 1) {
        if (extras)
            memcpy(EXTRAS(s), extras, 8 * (size_t)(t->down - 1));
        else
            memset(EXTRAS(s), 0, 8 * (size_t)(t->down - 1));
    }
    t->n++;
    if (++t->since >= epoch_len(t)) {
        t->epoch = (t->epoch + 1) & 0xFF;
        t->since = 0;
    }
    return s;
}

static inline void stamp(const KT *t, Slot *s) {
    s->meta = (s->meta & ~M_EPOCH) | ((uint64_t)t->epoch << M_EPOCH_SHIFT);
}

/* Remove the entry at slot i; the run after it shifts back (linear probing, no tombstones). */
static void kt_delete_at(KT *t, size_t i) {
    size_t j = i;
    for (;;) {
        if (++j == t->nslots) j = 0;
        Slot *s = SLOT(t, j);
        if (!(s->meta & M_USED)) break;
        size_t h = home(t, GROUP_OF(s->meta), s->key, t->nslots);
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        memcpy(SLOT(t, i), s, t->stride);
        i = j;
    }
    memset(SLOT(t, i), 0, t->stride);
    t->n--;
}

static void kt_release(KT *t) {
    if (t->slots) munmap(t->slots, t->bytes);
    t->slots = NULL;
    t->nslots = t->bytes = 0;
    t->n = t->since = 0;
    t->epoch = 0;
}

/* rekey.py KeyTable.evict: beyond capacity, the entries not held, oldest epoch first, whole
 * epochs, down to capacity - capacity / 16. -1 on MemoryError. */
static int kt_evict(KT *t) {
    if (t->n <= t->capacity) return 0;
    int64_t need = t->n - (t->capacity - epoch_len(t));
    int64_t hist[256] = {0};
    for (size_t i = 0; i < t->nslots; i++) {
        uint64_t m = SLOT(t, i)->meta;
        if ((m & M_USED) && !(m & M_HELD)) hist[(t->epoch - (unsigned)(m >> M_EPOCH_SHIFT)) & 0xFF]++;
    }
    unsigned cutoff = 0;
    int64_t got = 0;
    for (int age = 255; age >= 0; age--) {
        got += hist[age];
        if (got >= need) {
            cutoff = (unsigned)age;
            break;
        }
    }
    /* the victims first (a backward shift moves entries into slots already passed) */
    int64_t nv = 0;
    for (int age = 255; age >= (int)cutoff; age--) nv += hist[age];
    if (!nv) return 0;
    int64_t *vk = PyMem_Malloc((size_t)nv * sizeof(int64_t));
    uint8_t *vg = PyMem_Malloc((size_t)nv);
    if (vk == NULL || vg == NULL) {
        PyMem_Free(vk);
        PyMem_Free(vg);
        PyErr_NoMemory();
        return -1;
    }
    int64_t k = 0;
    for (size_t i = 0; i < t->nslots && k < nv; i++) {
        const Slot *s = SLOT(t, i);
        uint64_t m = s->meta;
        if ((m & M_USED) && !(m & M_HELD) &&
            ((t->epoch - (unsigned)(m >> M_EPOCH_SHIFT)) & 0xFF) >= cutoff) {
            vk[k] = s->key;
            vg[k++] = (uint8_t)GROUP_OF(m);
        }
    }
    for (int64_t v = 0; v < k; v++) {
        Py_ssize_t i = kt_find(t, vg[v], vk[v]);
        if (i >= 0) {
            kt_delete_at(t, (size_t)i);
            t->evictions++;
        }
    }
    PyMem_Free(vk);
    PyMem_Free(vg);
    return 0;
}

/* ---- the Python interface (rekey.py's Table) --------------------------------------------- */
static PyObject *entry_int(const Slot *s) {
    PyObject *hi = PyLong_FromUnsignedLongLong(s->meta & M_PUBLIC);
    if (hi == NULL) return NULL;
    PyObject *sh = PyNumber_Lshift(hi, py_64);
    Py_DECREF(hi);
    if (sh == NULL) return NULL;
    PyObject *lo = PyLong_FromUnsignedLongLong(s->state);
    if (lo == NULL) {
        Py_DECREF(sh);
        return NULL;
    }
    PyObject *v = PyNumber_Or(sh, lo);
    Py_DECREF(sh);
    Py_DECREF(lo);
    return v;
}

/* an entry int -> (state, public meta) */
static int entry_words(PyObject *v, uint64_t *state, uint64_t *meta) {
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "an entry is an int");
        return -1;
    }
    *state = PyLong_AsUnsignedLongLongMask(v);
    if (*state == (uint64_t)-1 && PyErr_Occurred()) return -1;
    PyObject *hi = PyNumber_Rshift(v, py_64);
    if (hi == NULL) return -1;
    *meta = PyLong_AsUnsignedLongLongMask(hi) & M_PUBLIC;
    Py_DECREF(hi);
    if (PyErr_Occurred()) return -1;
    return 0;
}

static int parse_gk(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int *g,
                    int64_t *key) {
    if (nargs < want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments", want);
        return -1;
    }
    long gg = PyLong_AsLong(args[0]);
    if (gg == -1 && PyErr_Occurred()) return -1;
    if (gg < 0 || gg > 62) {
        PyErr_SetString(PyExc_ValueError, "group must be in [0, 62]");
        return -1;
    }
    *g = (int)gg;
    *key = (int64_t)PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *kt_get(KT *t, PyObject *const *args, Py_ssize_t nargs) {
    int g;
    int64_t key;
    if (parse_gk(args, nargs, 2, &g, &key) < 0) return NULL;
    Py_ssize_t i = kt_find(t, g, key);
    if (i < 0) Py_RETURN_NONE;
    return entry_int(SLOT(t, i));
}

static PyObject *kt_extras(KT *t, PyObject *const *args, Py_ssize_t nargs) {
    int g;
    int64_t key;
    if (parse_gk(args, nargs, 2, &g, &key) < 0) return NULL;
    Py_ssize_t i = kt_find(t, g, key);
    if (i < 0 || t->down <= 1) return PyTuple_New(0);
    PyObject *out = PyTuple_New(t->down - 1);
    if (out == NULL) return NULL;
    const int64_t *x = EXTRAS(SLOT(t, i));
    for (int d = 0; d < t->down - 1; d++) {
        PyObject *o = PyLong_FromLongLong(x[d]);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, d, o);
    }
    return out;
}

/* put(g, key, v, extras=None): set the entry, stamped (a use) */
static PyObject *kt_put(KT *t, PyObject *const *args, Py_ssize_t nargs) {
    int g;
    int64_t key;
    uint64_t state, meta;
    if (parse_gk(args, nargs, 3, &g, &key) < 0 || entry_words(args[2], &state, &meta) < 0)
        return NULL;
    int64_t xs[64];
    const int64_t *x = NULL;
    if (nargs > 3 && args[3] != Py_None) {
        PyObject *seq = PySequence_Fast(args[3], "extras must be a sequence");
        if (seq == NULL) return NULL;
        Py_ssize_t nx = PySequence_Fast_GET_SIZE(seq);
        if (nx != t->down - 1 || nx > 64) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "extras: down - 1 keys");
            return NULL;
        }
        for (Py_ssize_t j = 0; j < nx; j++) {
            xs[j] = (int64_t)PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, j));
        }
        Py_DECREF(seq);
        if (PyErr_Occurred()) return NULL;
        x = xs;
    }
    Py_ssize_t i = kt_find(t, g, key);
    if (i < 0) {
        if (kt_insert(t, g, key, state, meta, x) == NULL) return NULL;
        Py_RETURN_NONE;
    }
    Slot *s = SLOT(t, i);
    s->state = state;
    s->meta = (meta & ~M_EPOCH) | (s->meta & (M_GROUP | M_USED));
    stamp(t, s);
    if (x) memcpy(EXTRAS(s), x, 8 * (size_t)(t->down - 1));
    Py_RETURN_NONE;
}

/* keep(g, key, v): set an existing entry as it is, its epoch too (not a use) */
static PyObject *kt_keep(KT *t, PyObject *const *args, Py_ssize_t nargs) {
    int g;
    int64_t key;
    uint64_t state, meta;
    if (parse_gk(args, nargs, 3, &g, &key) < 0 || entry_words(args[2], &state, &meta) < 0)
        return NULL;
    Py_ssize_t i = kt_find(t, g, key);
    if (i < 0) {
        PyErr_SetString(PyExc_KeyError, "keep: no such entry");
        return NULL;
    }
    Slot *s = SLOT(t, i);
    s->state = state;
    s->meta = meta | (s->meta & (M_GROUP | M_USED));
    Py_RETURN_NONE;
}

static PyObject *kt_touch(KT *t, PyObject *const *args, Py_ssize_t nargs) {
    int g;
    int64_t key;
    if (parse_gk(args, nargs, 2, &g, &key) < 0) return NULL;
    Py_ssize_t i = kt_find(t, g, key);
    if (i < 0) {
        PyErr_SetString(PyExc_KeyError, "touch: no such entry");
        return NULL;
    }
    stamp(t, SLOT(t, i));
    Py_RETURN_NONE;
}

static PyObject *kt_evict_py(KT *t, PyObject *unused) {
    if (kt_evict(t) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *kt_unhold(KT *t, PyObject *unused) {
    for (size_t i = 0; i < t->nslots; i++) SLOT(t, i)->meta &= ~M_HELD;
    Py_RETURN_NONE;
}

static PyObject *kt_clear(KT *t, PyObject *unused) {
    kt_release(t);
    Py_RETURN_NONE;
}

/* export() -> (groups u1, keys <i8, states <i8, metas <u8, extras <i8, epoch << 32 | since) as
 * bytes, in slot order (x86-64: native is little-endian) */
static PyObject *kt_export(KT *t, PyObject *unused) {
    Py_ssize_t n = (Py_ssize_t)t->n, d = t->down - 1;
    PyObject *bg = PyBytes_FromStringAndSize(NULL, n), *bk = PyBytes_FromStringAndSize(NULL, 8 * n),
             *bs = PyBytes_FromStringAndSize(NULL, 8 * n), *bm = PyBytes_FromStringAndSize(NULL, 8 * n),
             *bx = PyBytes_FromStringAndSize(NULL, 8 * n * d);
    if (!bg || !bk || !bs || !bm || !bx) goto fail;
    uint8_t *g = (uint8_t *)PyBytes_AS_STRING(bg);
    int64_t *k = (int64_t *)PyBytes_AS_STRING(bk);
    uint64_t *s = (uint64_t *)PyBytes_AS_STRING(bs), *m = (uint64_t *)PyBytes_AS_STRING(bm);
    int64_t *x = (int64_t *)PyBytes_AS_STRING(bx);
    Py_ssize_t j = 0;
    for (size_t i = 0; i < t->nslots && j < n; i++) {
        const Slot *sl = SLOT(t, i);
        if (!(sl->meta & M_USED)) continue;
        g[j] = (uint8_t)GROUP_OF(sl->meta);
        k[j] = sl->key;
        s[j] = sl->state;
        m[j] = sl->meta & M_PUBLIC;
        if (d) memcpy(x + j * d, EXTRAS(sl), 8 * (size_t)d);
        j++;
    }
    return Py_BuildValue("NNNNNL", bg, bk, bs, bm, bx,
                         (long long)((int64_t)t->epoch << 32 | t->since));
fail:
    Py_XDECREF(bg);
    Py_XDECREF(bk);
    Py_XDECREF(bs);
    Py_XDECREF(bm);
    Py_XDECREF(bx);
    return NULL;
}

/* load(groups, keys, states, metas, extras, epoch): replace the table with export()'s columns */
static PyObject *kt_load(KT *t, PyObject *args) {
    Py_buffer vg, vk, vs, vm, vx;
    long long epoch;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*L", &vg, &vk, &vs, &vm, &vx, &epoch)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = vg.len, d = t->down - 1;
    if (vk.len != 8 * n || vs.len != 8 * n || vm.len != 8 * n || vx.len != 8 * n * d) {
        PyErr_SetString(PyExc_ValueError, "load: columns of different lengths");
        goto done;
    }
    kt_release(t);
    const uint8_t *g = vg.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t key, xs[64];
        uint64_t st, me;
        memcpy(&key, (const char *)vk.buf + 8 * j, 8);
        memcpy(&st, (const char *)vs.buf + 8 * j, 8);
        memcpy(&me, (const char *)vm.buf + 8 * j, 8);
        if (d) memcpy(xs, (const char *)vx.buf + 8 * j * d, 8 * (size_t)(d < 64 ? d : 64));
        if (g[j] > 62) {
            PyErr_SetString(PyExc_ValueError, "load: a group above 62");
            goto done;
        }
        Py_ssize_t i = kt_find(t, g[j], key);
        Slot *s;
        if (i >= 0) {
            s = SLOT(t, i);
        } else {
            s = kt_insert(t, g[j], key, st, me, d ? xs : NULL);
            if (s == NULL) goto done;
        }
        s->state = st;
        s->meta = (me & M_PUBLIC) | (s->meta & (M_GROUP | M_USED)); /* its saved epoch */
        if (d) memcpy(EXTRAS(s), xs, 8 * (size_t)d);
    }
    t->epoch = (unsigned)((epoch >> 32) & 0xFF);
    t->since = epoch & 0xFFFFFFFFLL;
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&vg);
    PyBuffer_Release(&vk);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vm);
    PyBuffer_Release(&vx);
    return ret;
}

/* ---- msgpack, as much as the common events need ------------------------------------------- */
static inline uint64_t be(const uint8_t *p, int n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* msgpack's widths as one load each (tokens are mostly 2 or 4 bytes); others byte-wise */
    switch (n) {
    case 1: return p[0];
    case 2: { uint16_t v; memcpy(&v, p, 2); return __builtin_bswap16(v); }
    case 4: { uint32_t v; memcpy(&v, p, 4); return __builtin_bswap32(v); }
    case 8: { uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v); }
    default: break;
    }
#endif
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* one msgpack int at *pp (two's complement in 64 bits); 0: not an int or truncated */
static inline int mp_int(const uint8_t **pp, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pp;
    if (p >= end) return 0;
    uint8_t b = *p++;
    if (b <= 0x7f) {
        *out = b;
    } else if (b >= 0xe0) {
        *out = (uint64_t)(int64_t)(int8_t)b;
    } else {
        int n;
        switch (b) {
        case 0xcc: case 0xd0: n = 1; break;
        case 0xcd: case 0xd1: n = 2; break;
        case 0xce: case 0xd2: n = 4; break;
        case 0xcf: case 0xd3: n = 8; break;
        default: return 0;
        }
        if (end - p < n) return 0;
        uint64_t v = be(p, n);
        p += n;
        if (b >= 0xd0 && n < 8) { /* sign-extend */
            int sh = 64 - 8 * n;
            v = (uint64_t)((int64_t)(v << sh) >> sh);
        }
        *out = v;
    }
    *pp = p;
    return 1;
}

static inline int mp_array(const uint8_t **pp, const uint8_t *end, Py_ssize_t *n) {
    const uint8_t *p = *pp;
    if (p >= end) return 0;
    uint8_t b = *p++;
    if ((b & 0xF0) == 0x90) {
        *n = b & 0x0F;
    } else if (b == 0xdc || b == 0xdd) {
        int w = b == 0xdc ? 2 : 4;
        if (end - p < w) return 0;
        *n = (Py_ssize_t)be(p, w);
        p += w;
    } else {
        return 0;
    }
    *pp = p;
    return 1;
}

/* The event struct's fields by their slot offsets (msgspec Structs keep fields in member
 * slots): found once per struct type, read as one load each (PyObject_GetAttr cost ~10 % of the
 * re-keying). A type whose field is not a plain object slot is read with getattr. */
enum { F_TOKENS, F_PARENT, F_LORA_ID, F_LORA_NAME, F_EXTRA, F_KIND, F_BSIZE, F_N };
static PyObject *f_names[F_N];
#define F_TYPES 8
static struct {
    PyTypeObject *type; /* a strong reference */
    Py_ssize_t off[F_N]; /* -1: getattr */
} f_cache[F_TYPES];

static const Py_ssize_t *field_offsets(PyTypeObject *tp) {
    int free_at = -1;
    for (int c = 0; c < F_TYPES; c++) {
        if (f_cache[c].type == tp) return f_cache[c].off;
        if (f_cache[c].type == NULL && free_at < 0) free_at = c;
    }
    if (free_at < 0) return NULL; /* more struct types than expected: getattr */
    for (int f = 0; f < F_N; f++) {
        f_cache[free_at].off[f] = -1;
        PyObject *d = _PyType_Lookup(tp, f_names[f]); /* borrowed */
        if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            if (m->type == T_OBJECT_EX && !(m->flags & PY_AUDIT_READ))
                f_cache[free_at].off[f] = m->offset;
        }
    }
    Py_INCREF(tp);
    f_cache[free_at].type = tp;
    return f_cache[free_at].off;
}

/* field f of ev (off: its type's field_offsets), a new reference; NULL: absent (no error set) */
static PyObject *field(PyObject *ev, const Py_ssize_t *off, int f) {
    if (off != NULL && off[f] >= 0) {
        PyObject *o = *(PyObject **)((char *)ev + off[f]);
        Py_XINCREF(o);
        return o;
    }
    PyObject *o = PyObject_GetAttr(ev, f_names[f]);
    if (o == NULL) PyErr_Clear();
    return o;
}

/* A field of the event struct (a msgspec.Raw) as bytes: 1 nil (absent, empty or msgpack nil),
 * 0 a value (view filled: release it), -1 not readable here (error cleared). */
static int raw_field(PyObject *ev, const Py_ssize_t *off, int f, Py_buffer *view) {
    PyObject *o = field(ev, off, f);
    if (o == NULL) return -1;
    if (o == Py_None) {
        Py_DECREF(o);
        return 1;
    }
    int r = PyObject_GetBuffer(o, view, PyBUF_SIMPLE);
    Py_DECREF(o); /* the Raw keeps its event's buffer alive, and the event holds the Raw */
    if (r < 0) {
        PyErr_Clear();
        return -1;
    }
    if (view->len == 0 || (view->len == 1 && ((const uint8_t *)view->buf)[0] == 0xc0)) {
        PyBuffer_Release(view);
        return 1;
    }
    return 0;
}

/* rekey.py _full_attention for an ASCII kind: None, or "full" / "mla" in it, any case.
 * 1 full, 0 hand back (not full, or not ASCII), -1 unreadable (hand back). */
static int full_kind(PyObject *ev, const Py_ssize_t *off) {
    PyObject *o = field(ev, off, F_KIND);
    if (o == NULL) return 1; /* getattr(ev, "kv_cache_spec_kind", None) */
    int ok = 0;
    if (o == Py_None) {
        ok = 1;
    } else if (PyUnicode_Check(o) && PyUnicode_IS_ASCII(o)) {
        const char *s = (const char *)PyUnicode_DATA(o);
        Py_ssize_t n = PyUnicode_GET_LENGTH(o);
        for (Py_ssize_t i = 0; i < n && !ok; i++) {
            char c0 = (char)(s[i] | 0x20);
            if (c0 == 'f' && i + 4 <= n && (s[i + 1] | 0x20) == 'u' && (s[i + 2] | 0x20) == 'l' &&
                (s[i + 3] | 0x20) == 'l')
                ok = 1;
            else if (c0 == 'm' && i + 3 <= n && (s[i + 1] | 0x20) == 'l' &&
                     (s[i + 2] | 0x20) == 'a')
                ok = 1;
        }
    }
    Py_DECREF(o);
    return ok;
}

/* The event's parent_block_hash as an engine key (an int, or a digest's last 8 bytes, as
 * sidecar.keys.engine_key): 1 one, 0 none (nil or absent), -1 not readable here. */
static int parent_key(PyObject *ev, const Py_ssize_t *off, int64_t *pkey) {
    Py_buffer v;
    int r = raw_field(ev, off, F_PARENT, &v);
    if (r != 0) return r > 0 ? 0 : -1;
    const uint8_t *p = v.buf, *end = p + v.len;
    uint64_t u = 0;
    int ok = 0;
    if (mp_int(&p, end, &u)) {
        ok = p == end;
    } else if (v.len >= 2 && (p[0] == 0xc4 || p[0] == 0xc5 || p[0] == 0xc6)) {
        int w = p[0] == 0xc4 ? 1 : p[0] == 0xc5 ? 2 : 4;
        if (v.len >= 1 + w) {
            uint64_t len = be(p + 1, w);
            if ((uint64_t)v.len == 1 + w + len) {
                size_t take = len < 8 ? (size_t)len : 8;
                u = be(p + 1 + w + len - take, (int)take);
                ok = 1;
            }
        }
    }
    PyBuffer_Release(&v);
    if (!ok) return -1;
    *pkey = (int64_t)u;
    return 1;
}

/* The home of (g, key) and the line after it (an absent key probes ~2-4 slots at 1/2-3/4 full),
 * fetched ahead of its lookup. */
static inline void prefetch_home(const KT *t, int g, int64_t key) {
    const char *s = (const char *)SLOT(t, home(t, g, key, t->nslots));
    __builtin_prefetch(s);
    __builtin_prefetch(s + 64);
}

/* ---- the re-keying -------------------------------------------------------------------------- */
typedef struct {
    int64_t *keys;
    uint8_t *meds, *grps;
    int8_t *sgns;
    Py_ssize_t m, room;
    uint8_t med, grp;
    int8_t sign;
} Out;

static inline int emit(Out *o, int64_t key) {
    if (o->m >= o->room) {
        PyErr_SetString(PyExc_ValueError, "rekey: the output arrays are too short");
        return -1;
    }
    o->keys[o->m] = key;
    o->meds[o->m] = o->med;
    o->grps[o->m] = o->grp;
    o->sgns[o->m++] = o->sign;
    return 0;
}

/* rekey.py _keys_of */
static inline int keys_of(const KT *t, const Slot *s, Out *o) {
    if ((s->meta & M_TAINT) || ((s->meta >> M_PEND_SHIFT) & M_PEND)) return 0;
    for (int d = 0; d < t->down - 1; d++)
        if (emit(o, EXTRAS(s)[d]) < 0) return -1;
    return emit(o, (int64_t)s->state);
}

/* rekey.py _known */
static inline int known(KT *t, Slot *s, Out *o, int64_t *cnt) {
    if (s->meta & M_TAINT) {
        stamp(t, s);
        cnt[C_TAINTED]++;
        return 0;
    }
    if ((s->meta & M_HELD) < M_HELD) s->meta++;
    stamp(t, s);
    cnt[C_KEYED]++;
    return keys_of(t, s, o);
}

/* rekey.py _taint */
static int taint(KT *t, int g, const int64_t *eng, Py_ssize_t n, int64_t *cnt, int reason) {
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = kt_find(t, g, eng[j]);
        if (i < 0) {
            if (kt_insert(t, g, eng[j], 0, M_TAINT, NULL) == NULL) return -1;
        } else {
            Slot *s = SLOT(t, i);
            if (!(s->meta & M_TAINT)) {
                s->state = 0;
                s->meta = M_TAINT | (s->meta & (M_GROUP | M_USED));
                stamp(t, s);
            }
        }
    }
    cnt[reason] += n;
    return 0;
}

typedef struct {
    int e, k, step, up, down, sglang;
} Params;

/* A BlockStored: 1 re-keyed, 0 hand it back (nothing changed), -1 error. */
static int stored(KT *t, const Params *P, PyObject *ev, int g, const int64_t *eng, Py_ssize_t nb,
                  Out *o, int64_t *cnt) {
    /* a re-store of blocks the table knows: their keys, without reading the tokens */
    Py_ssize_t j = 0;
    while (j < nb && kt_find(t, g, eng[j]) >= 0) j++;
    if (j == nb) {
        for (j = 0; j < nb; j++)
            if (known(t, SLOT(t, kt_find(t, g, eng[j])), o, cnt) < 0) return -1;
        return 1;
    }
    /* what rekey.py decides on its own: hand back */
    const Py_ssize_t *off = field_offsets(Py_TYPE(ev));
    if (full_kind(ev, off) != 1) return 0;
    PyObject *bs = field(ev, off, F_BSIZE);
    if (bs == NULL) return 0;
    long size = bs == Py_None ? 0 : PyLong_Check(bs) ? PyLong_AsLong(bs) : -1;
    Py_DECREF(bs);
    if (size == -1 && PyErr_Occurred()) PyErr_Clear();
    if (size != 0 && size != P->e) return 0;
    Py_buffer v;
    int r = raw_field(ev, off, F_LORA_ID, &v);
    if (r != 1) {
        if (r == 0) PyBuffer_Release(&v);
        return 0;
    }
    r = raw_field(ev, off, F_LORA_NAME, &v);
    if (r == 0) PyBuffer_Release(&v);
    if (r == 0) return 0; /* absent (-1) is getattr's None */
    r = raw_field(ev, off, F_EXTRA, &v);
    if (r == 0) { /* an array whose first nb items are nil or empty: no extra keys */
        const uint8_t *p = v.buf, *end = p + v.len;
        Py_ssize_t nx;
        int plain = mp_array(&p, end, &nx);
        for (Py_ssize_t x = 0; plain && x < nx && x < nb; x++, p++)
            plain = p < end && (*p == 0xc0 || *p == 0x90);
        PyBuffer_Release(&v);
        if (!plain) return 0;
    } else if (r < 0) {
        return 0;
    }
    int64_t pkey = 0;
    int has_parent = parent_key(ev, off, &pkey);
    if (has_parent < 0) return 0;
    if (!has_parent && P->sglang) return 0; /* a root page: the salted-root check is rekey.py's */
    r = raw_field(ev, off, F_TOKENS, &v);
    if (r != 0) return 0; /* tokenless, or unreadable */
    {
        const uint8_t *p = v.buf, *end = p + v.len;
        Py_ssize_t nt;
        int ok = mp_array(&p, end, &nt) && nt == nb * P->e;
        if (ok && nt > t->tok_cap) {
            uint64_t *grown = PyMem_Realloc(t->tok, (size_t)nt * 8);
            if (grown == NULL) {
                PyBuffer_Release(&v);
                PyErr_NoMemory();
                return -1;
            }
            t->tok = grown;
            t->tok_cap = nt;
        }
        for (Py_ssize_t x = 0; ok && x < nt; x++) ok = mp_int(&p, end, &t->tok[x]);
        ok = ok && p == end;
        PyBuffer_Release(&v);
        if (!ok) return 0; /* not a list of ints, or not blocks x block size: malformed */
    }
    /* ---- re-keyed here from now on (rekey.py _stored, the same steps) ---- */
    Py_ssize_t start = 0;
    uint64_t h = 0;
    if (has_parent) {
        Py_ssize_t pi = kt_find(t, g, pkey);
        if (pi >= 0) {
            Slot *ps = SLOT(t, pi);
            stamp(t, ps);
            if (ps->meta & M_TAINT) return taint(t, g, eng, nb, cnt, C_TAINTED) < 0 ? -1 : 1;
            h = ps->state;
        } else {
            while (start < nb && kt_find(t, g, eng[start]) < 0) start++;
            cnt[C_UNKNOWN_PARENT] += start;
            if (start == nb) return 1; /* no entries: the descendants are not reported either */
            Slot *s = SLOT(t, kt_find(t, g, eng[start]));
            if (s->meta & M_TAINT)
                return taint(t, g, eng + start, nb - start, cnt, C_TAINTED) < 0 ? -1 : 1;
            h = s->state;
            if (known(t, s, o, cnt) < 0) return -1;
            start++;
        }
    }
    if (start >= nb) return 1;
    uint64_t base = 0; /* rekey.py _pending_of */
    if (P->up > 1) {
        Py_ssize_t pi = start > 0 ? kt_find(t, g, eng[start - 1])
                                  : has_parent ? kt_find(t, g, pkey) : -1;
        if (pi >= 0) base = (SLOT(t, pi)->meta >> M_PEND_SHIFT) & M_PEND;
    }
    int64_t st[64];
    for (Py_ssize_t b = start; b < nb; b++) {
        const uint64_t *tk = t->tok + b * P->e;
        for (int d = 0; d < P->down; d++) {
            h = kvcm_roll_block(h, tk + (Py_ssize_t)d * P->step, P->step);
            st[d] = (int64_t)h;
        }
        Py_ssize_t i = kt_find(t, g, eng[b]);
        if (i >= 0) {
            if (known(t, SLOT(t, i), o, cnt) < 0) return -1;
            continue;
        }
        if (P->down > 1) {
            for (int d = 0; d < P->down; d++)
                if (emit(o, st[d]) < 0) return -1;
            if (kt_insert(t, g, eng[b], (uint64_t)st[P->down - 1], 1, st) == NULL) return -1;
        } else {
            uint64_t pend = (base + (uint64_t)(b - start + 1) * (uint64_t)P->e) % (uint64_t)P->k;
            if (!pend && emit(o, st[0]) < 0) return -1;
            if (kt_insert(t, g, eng[b], (uint64_t)st[0], 1 | pend << M_PEND_SHIFT, NULL) == NULL)
                return -1;
        }
        cnt[C_KEYED]++;
    }
    return 1;
}

/* rekey.py _removed */
static int removed(KT *t, int g, const int64_t *eng, Py_ssize_t nb, Out *o) {
    for (Py_ssize_t j = 0; j < nb; j++) {
        Py_ssize_t i = kt_find(t, g, eng[j]);
        if (i < 0) continue;
        Slot *s = SLOT(t, i);
        if (!(s->meta & M_HELD)) continue;
        s->meta--;
        if (keys_of(t, s, o) < 0) return -1;
    }
    return 0;
}


/* rekey(codes, counts, keys, events, i, end, blk, m, out_keys, out_mediums, out_groups,
 *       out_signs, counters, e, k, both, sglang) -> (i, blk, m)
 * Events [i, end) (their codes, hash counts, structs; `keys` the engine keys of events from the
 * first call's i on, blk the first of event i's), their KVCM-keyed block events written from
 * out[m]; it stops at end or at the first event rekey.py must re-key (returned as i; nothing of
 * it changed). counters: rekey.py's counts array (REASONS, then keyed). */
static PyObject *kt_rekey(KT *t, PyObject *args) {
    PyObject *o_codes, *o_counts, *o_keys, *events, *o_ok, *o_om, *o_og, *o_os, *o_cnt;
    Py_ssize_t i, end, blk, m;
    int e, k, both, sglang;
    if (!PyArg_ParseTuple(args, "OOOO!nnnnOOOOOiipp", &o_codes, &o_counts, &o_keys,
                          &PyList_Type, &events, &i, &end, &blk, &m, &o_ok, &o_om, &o_og,
                          &o_os, &o_cnt, &e, &k, &both, &sglang))
        return NULL;
    if (e <= 0 || k <= 0 || (e > k ? e % k : k % e)) {
        PyErr_SetString(PyExc_ValueError, "rekey: block sizes without a whole ratio");
        return NULL;
    }
    Params P = {e, k, e < k ? e : k, 0, 0, sglang};
    P.up = k / P.step;
    P.down = e / P.step;
    if (P.down != t->down || P.down > 64) {
        PyErr_SetString(PyExc_ValueError, "rekey: the table's keys per entry differ");
        return NULL;
    }
    Py_buffer vc, vn, vk, vok, vom, vog, vos, vcnt;
    int got = 0;
    PyObject *ret = NULL;
    if (kvcm_view(o_codes, &vc, 8, 0, "codes") < 0) return NULL;
    got++;
    if (kvcm_view(o_counts, &vn, 8, 0, "counts") < 0) goto done;
    got++;
    if (kvcm_view(o_keys, &vk, 8, 0, "keys") < 0) goto done;
    got++;
    if (kvcm_view(o_ok, &vok, 8, 1, "out_keys") < 0) goto done;
    got++;
    if (kvcm_view(o_om, &vom, 1, 1, "out_mediums") < 0) goto done;
    got++;
    if (kvcm_view(o_og, &vog, 1, 1, "out_groups") < 0) goto done;
    got++;
    if (kvcm_view(o_os, &vos, 1, 1, "out_signs") < 0) goto done;
    got++;
    if (kvcm_view(o_cnt, &vcnt, 8, 1, "counters") < 0) goto done;
    got++;
    if (vcnt.len < 8 * C_N || end > vc.len / 8 || end > vn.len / 8 ||
        end > PyList_GET_SIZE(events) || i < 0 || blk < 0 || m < 0) {
        PyErr_SetString(PyExc_ValueError, "rekey: arrays shorter than the events");
        goto done;
    }
    {
        const int64_t *codes = vc.buf, *counts = vn.buf, *keys = vk.buf;
        Py_ssize_t nkeys = vk.len / 8;
        int64_t *cnt = vcnt.buf;
        Out o = {vok.buf, vom.buf, vog.buf, vos.buf, m, vok.len / 8};
        if (vom.len / 1 < o.room) o.room = vom.len;
        if (vog.len < o.room) o.room = vog.len;
        if (vos.len < o.room) o.room = vos.len;
        /* the table outgrows the caches: its slots are fetched two events ahead */
        Py_ssize_t pf_i = i, pf_blk = blk;
        for (; i < end; i++) {
            for (; pf_i < end && pf_i <= i + 2; pf_i++) {
                Py_ssize_t pn = (Py_ssize_t)counts[pf_i];
                if (pn <= 0) continue;
                int pg = (int)((codes[pf_i] >> 1) & 0x3F);
                if (t->nslots && pf_blk + pn <= nkeys)
                    for (Py_ssize_t j = 0; j < pn; j++) prefetch_home(t, pg, keys[pf_blk + j]);
                pf_blk += pn;
                if (codes[pf_i] & 1) __builtin_prefetch(PyList_GET_ITEM(events, pf_i));
            }
            /* the next store's parent (its struct was fetched a turn ago): most chains
             * continue from a block stored long before, a miss of its own */
            if (i + 1 < end && (codes[i + 1] & 1) && counts[i + 1] > 0 && t->nslots) {
                PyObject *nev = PyList_GET_ITEM(events, i + 1);
                int64_t nk;
                if (parent_key(nev, field_offsets(Py_TYPE(nev)), &nk) == 1)
                    prefetch_home(t, (int)((codes[i + 1] >> 1) & 0x3F), nk);
            }
            Py_ssize_t n = (Py_ssize_t)counts[i];
            if (n <= 0) continue;
            if (blk + n > nkeys) {
                PyErr_SetString(PyExc_ValueError, "rekey: fewer keys than the events hold");
                goto done;
            }
            int64_t c = codes[i];
            int g = (int)((c >> 1) & 0x7F);
            if (g > 62) break; /* the decoder drops these; rekey.py would fail on them too */
            const int64_t *eng = keys + blk;
            o.med = (uint8_t)(c >> 8);
            o.grp = (uint8_t)g;
            Py_ssize_t mark = o.m;
            if (both) {
                o.sign = (c & 1) ? 1 : -1;
                for (Py_ssize_t j = 0; j < n; j++)
                    if (emit(&o, eng[j]) < 0) goto done;
            }
            if (c & 1) {
                o.sign = 1;
                int r = stored(t, &P, PyList_GET_ITEM(events, i), g, eng, n, &o, cnt);
                if (r < 0) goto done;
                if (r == 0) { /* rekey.py's: nothing of it was written */
                    o.m = mark;
                    break;
                }
            } else {
                o.sign = -1;
                if (removed(t, g, eng, n, &o) < 0) goto done;
            }
            blk += n;
        }
        ret = Py_BuildValue("nnn", i, blk, o.m);
    }
done:
    if (got > 0) PyBuffer_Release(&vc);
    if (got > 1) PyBuffer_Release(&vn);
    if (got > 2) PyBuffer_Release(&vk);
    if (got > 3) PyBuffer_Release(&vok);
    if (got > 4) PyBuffer_Release(&vom);
    if (got > 5) PyBuffer_Release(&vog);
    if (got > 6) PyBuffer_Release(&vos);
    if (got > 7) PyBuffer_Release(&vcnt);
    return ret;
}

/* ---- the type ------------------------------------------------------------------------------ */
static int kt_init(KT *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", "down", NULL};
    long long capacity;
    int down = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|i", names, &capacity, &down)) return -1;
    if (capacity < 1 || down < 1 || down > 64) {
        PyErr_SetString(PyExc_ValueError, "KeyTable: capacity >= 1, 1 <= down <= 64");
        return -1;
    }
    kt_release(t);
    t->capacity = capacity;
    t->down = down;
    t->stride = sizeof(Slot) + 8 * (size_t)(down - 1);
    return 0;
}

static void kt_dealloc(KT *t) {
    kt_release(t);
    PyMem_Free(t->tok);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *kt_get_capacity(KT *t, void *c) { return PyLong_FromLongLong(t->capacity); }
static int kt_set_capacity(KT *t, PyObject *v, void *c) {
    long long cap = v ? PyLong_AsLongLong(v) : -1;
    if (cap == -1 && PyErr_Occurred()) return -1;
    if (cap < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity >= 1");
        return -1;
    }
    t->capacity = cap;
    return 0;
}
static PyObject *kt_get_n(KT *t, void *c) { return PyLong_FromLongLong(t->n); }
static PyObject *kt_get_evictions(KT *t, void *c) { return PyLong_FromLongLong(t->evictions); }
static PyObject *kt_get_down(KT *t, void *c) { return PyLong_FromLong(t->down); }
static PyObject *kt_get_epoch(KT *t, void *c) { return PyLong_FromLong((long)t->epoch); }
static PyObject *kt_get_slots(KT *t, void *c) { return PyLong_FromSize_t(t->nslots); }

static PyGetSetDef kt_getset[] = {
    {"capacity", (getter)kt_get_capacity, (setter)kt_set_capacity, "entries kept", NULL},
    {"n", (getter)kt_get_n, NULL, "entries", NULL},
    {"evictions", (getter)kt_get_evictions, NULL, "entries evicted", NULL},
    {"down", (getter)kt_get_down, NULL, "KVCM keys per entry", NULL},
    {"epoch", (getter)kt_get_epoch, NULL, "the current epoch", NULL},
    {"slots", (getter)kt_get_slots, NULL, "slots allocated", NULL},
    {NULL},
};

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef kt_methods[] = {
    {"get", FAST(kt_get), "get(g, key) -> entry int or None"},
    {"extras", FAST(kt_extras), "extras(g, key) -> 1:n's earlier keys"},
    {"put", FAST(kt_put), "put(g, key, v, extras=None): set, stamped (a use)"},
    {"keep", FAST(kt_keep), "keep(g, key, v): set an existing entry as it is"},
    {"touch", FAST(kt_touch), "touch(g, key): a use"},
    {"evict", (PyCFunction)kt_evict_py, METH_NOARGS, "evict(): down to capacity (by epochs)"},
    {"unhold", (PyCFunction)kt_unhold, METH_NOARGS, "unhold(): every entry to held 0"},
    {"clear", (PyCFunction)kt_clear, METH_NOARGS, "clear(): no entries"},
    {"export", (PyCFunction)kt_export, METH_NOARGS, "export() -> columns"},
    {"load", (PyCFunction)kt_load, METH_VARARGS, "load(groups, keys, states, metas, extras, epoch)"},
    {"rekey", (PyCFunction)kt_rekey, METH_VARARGS, "rekey(...) -> (i, blk, m)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.shm_ring._accel.KeyTable",
    .tp_basicsize = sizeof(KT),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The rolling key table (sidecar/source/rekey.py's Table) in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kt_init,
    .tp_dealloc = (destructor)kt_dealloc,
    .tp_methods = kt_methods,
    .tp_getset = kt_getset,
};

/* Called by _accel.c's module init: adds KeyTable. 0, or -1 with an exception set. */
int kvcm_rekey_add(PyObject *mod) {
    if (py_64 == NULL) {
        static const char *names[F_N] = {"token_ids",  "parent_block_hash",  "lora_id",
                                         "lora_name",  "extra_keys", "kv_cache_spec_kind",
                                         "block_size"};
        py_64 = PyLong_FromLong(64);
        if (py_64 == NULL) return -1;
        for (int f = 0; f < F_N; f++)
            if ((f_names[f] = PyUnicode_InternFromString(names[f])) == NULL) return -1;
    }
    if (PyType_Ready(&KeyTableType) < 0) return -1;
    return PyModule_AddObjectRef(mod, "KeyTable", (PyObject *)&KeyTableType);
}
