/* The hot loops in C, one pass per call: KeyIndex's probe, the hook's resident fold, and the
 * ring write of an engine step.
 *
 * The numpy / Python forms (key_index.py, resident.py, writer.py) are the reference and the
 * fallback when this module was not built (sidecar/shm_ring/compiled.py). With numpy a probe
 * round is ~20 calls over the keys still probing: a batch of 8 k records cost ~250 ns each,
 * ~30 ns in this loop. An engine step's ring write was ~10 Python-level slice copies per call,
 * each costing microseconds on the caches an engine's step leaves cold.
 * Arrays come in through the buffer protocol (no numpy headers needed to build), so callers
 * pass their numpy columns and word arrays as they are. No GIL release: a call takes
 * microseconds, and in the engine a released GIL would have to be won back from the engine.
 *
 * The index layout is key_index.py's: tkeys[slot] = key, tpos[slot] = dense position + 1
 * (0 = empty), home slot = (key * golden) >> (64 - log2(slots)), linear probing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "digits.h"
#include "rolling.h"

/* Raised with every change to a signature or behaviour here; compiled.py uses the module only
 * if it equals its own ACCEL_ABI, so a stale in-place build is never called with the wrong
 * arguments (it falls back to the numpy / Python forms instead). */
#define ACCEL_ABI 25
#define GOLDEN 0x9E3779B97F4A7C15ULL
/* Must equal sidecar/shm_ring/layout.py's KIND_STORED / KIND_REMOVED (a test compares). */
#define KIND_STORED 1
#define KIND_REMOVED 2


/* One key's probe, linear from its home slot: its dense position; absent, -1 (not inserting)
 * or the next position *n, inserted there (*n grows); -2 when every slot is used and none
 * holds it. `mask` is slots - 1, `shift` 64 - log2(slots). */
static inline int64_t index_probe(int64_t key, int64_t *tkeys, int64_t *tpos, int64_t *dense,
                                  Py_ssize_t *n, uint64_t mask, int shift, int insert) {
    uint64_t s = ((uint64_t)key * GOLDEN) >> shift;
    for (uint64_t probes = 0; probes <= mask; probes++, s = (s + 1) & mask) {
        const int64_t p = tpos[s];
        if (p == 0) {
            if (!insert) return -1;
            tpos[s] = *n + 1; /* an empty slot: fewer than cap keys, room for one more */
            tkeys[s] = key;
            dense[*n] = key;
            return (*n)++;
        }
        if (tkeys[s] == key) return p - 1;
    }
    return -2;
}

/* find(ukeys, tkeys, tpos, dense, out, n, insert) -> the new n, or -1 - n if the index is full
 * (the keys before the one that found no slot are in).
 * out[i] = the position of ukeys[i]; a missing key gets n, n+1, ... in first-seen order (and
 * dense[pos] = key) when inserting, else -1. A repeated key gets its one position. */
static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_tkeys, *o_tpos, *o_dense, *o_out;
    Py_ssize_t n;
    int insert;
    if (!PyArg_ParseTuple(args, "OOOOOnp", &o_keys, &o_tkeys, &o_tpos, &o_dense, &o_out, &n,
                          &insert))
        return NULL;
    Py_buffer vk, vt, vp, vd, vo;
    if (kvcm_view(o_keys, &vk, 8, 0, "keys") < 0) return NULL;
    if (kvcm_view(o_tkeys, &vt, 8, 1, "tkeys") < 0) goto e1;
    if (kvcm_view(o_tpos, &vp, 8, 1, "tpos") < 0) goto e2;
    if (kvcm_view(o_dense, &vd, 8, 1, "dense") < 0) goto e3;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) goto e4;
    Py_ssize_t m = vk.len / 8, cap = vt.len / 8, room = vd.len / 8;
    if (vp.len != vt.len || (cap & (cap - 1)) || cap < 2 || vo.len / 8 < m || n < 0 ||
        (insert && room < n + m)) {
        PyErr_SetString(PyExc_ValueError, "find: arrays do not fit the index");
        goto e5;
    }
    const int64_t *keys = vk.buf;
    int64_t *tkeys = vt.buf, *tpos = vp.buf, *dense = vd.buf, *out = vo.buf;
    const uint64_t mask = (uint64_t)cap - 1;
    int shift = 64;
    for (Py_ssize_t c = cap; c > 1; c >>= 1) shift--;
    Py_ssize_t full = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        out[i] = index_probe(keys[i], tkeys, tpos, dense, &n, mask, shift, insert);
        if (out[i] == -2) { /* every slot used and none holds the key */
            full = 1;
            break;
        }
    }
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vd);
    PyBuffer_Release(&vp);
    PyBuffer_Release(&vt);
    PyBuffer_Release(&vk);
    return PyLong_FromSsize_t(full ? -1 - n : n);
e5:
    PyBuffer_Release(&vo);
e4:
    PyBuffer_Release(&vd);
e3:
    PyBuffer_Release(&vp);
e2:
    PyBuffer_Release(&vt);
e1:
    PyBuffer_Release(&vk);
    return NULL;
}

/* apply(pos, metas, masks): for each record in order, its group's bit in masks[pos[i]] is set
 * (stored) or cleared (removed). In order, so the last op per (key, group) wins without
 * sorting. Other kinds change nothing (the caller folds stored/removed only; the numpy fold
 * would let such a record override earlier ones of its key: no caller makes one). */
static PyObject *apply(PyObject *self, PyObject *args) {
    PyObject *o_pos, *o_metas, *o_masks;
    if (!PyArg_ParseTuple(args, "OOO", &o_pos, &o_metas, &o_masks)) return NULL;
    Py_buffer vp, vm, vk;
    if (kvcm_view(o_pos, &vp, 8, 0, "pos") < 0) return NULL;
    if (kvcm_view(o_metas, &vm, 8, 0, "metas") < 0) goto e1;
    if (kvcm_view(o_masks, &vk, 4, 1, "masks") < 0) goto e2;
    Py_ssize_t m = vp.len / 8, cols = vk.len / 4;
    const int64_t *pos = vp.buf;
    const uint64_t *metas = vm.buf;
    uint32_t *masks = vk.buf;
    if (vm.len / 8 != m) {
        PyErr_SetString(PyExc_ValueError, "apply: pos and metas differ in length");
        goto e3;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (pos[i] < 0 || pos[i] >= cols) {
            PyErr_SetString(PyExc_IndexError, "apply: a position beyond the masks");
            goto e3;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint64_t meta = metas[i];
        const unsigned group = (unsigned)((meta >> 8) & 0xFF);
        const uint32_t bit = group < 32 ? (uint32_t)1 << group : 0;
        const unsigned kind = (unsigned)(meta & 0xFF);
        if (kind == KIND_STORED)
            masks[pos[i]] |= bit;
        else if (kind == KIND_REMOVED)
            masks[pos[i]] &= ~bit;
    }
    PyBuffer_Release(&vk);
    PyBuffer_Release(&vm);
    PyBuffer_Release(&vp);
    Py_RETURN_NONE;
e3:
    PyBuffer_Release(&vk);
e2:
    PyBuffer_Release(&vm);
e1:
    PyBuffer_Release(&vp);
    return NULL;
}

/* Must equal sidecar/shm_ring/layout.py's header words (a test compares). */
#define W_CAPACITY 2
#define W_TAIL 8
#define W_LAST_SEQ 10
#define W_ATTEMPTED 12
#define W_HEAD_SEEN 14
#define W_HEAD 16
#define W_READER_IDLE 21
#define HEADER_WORDS 512

/* 2^64, for the range check of an int above 2^63 - 1 */
static PyObject *two_to_64 = NULL;

/* An exact int in [lo, 2^64) as its u64 word, lo = -2^63 (a key: KVCM's signed bit pattern, a
 * negative one wraps) or 0 (a meta): 1, or 0 if out of range. Never raises, not even inside:
 * on CPython 3.11 a raised exception is an object made at once, a GC-tracked allocation that
 * may run a collection (finalizers: Python code) in the middle of Publisher.flush. */
static int u64_word(PyObject *o, uint64_t *out, int signed_ok) {
    int overflow = 0;
    const long long sx = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) { /* (-1 with an error is impossible for an exact int) */
        if (sx < 0 && !signed_ok) return 0;
        *out = (uint64_t)sx;
        return 1;
    }
    if (overflow < 0) return 0;
    /* int's own comparison: PyObject_RichCompare's recursion guard could raise */
    PyObject *lt = PyLong_Type.tp_richcompare(o, two_to_64, Py_LT);
    const int below = lt == Py_True;
    Py_XDECREF(lt);
    if (!below) return 0;
    *out = PyLong_AsUnsignedLongLong(o); /* in [2^63, 2^64): cannot fail */
    return 1;
}

/* key_word for the staging call (words(), outside any flush): the same result, one call for
 * a key in [0, 2^64) (random 64-bit hashes: half are past 2^63), but it may raise and clear
 * an OverflowError on the way (a negative key). */
static int key_word(PyObject *o, uint64_t *out) {
    uint64_t x = PyLong_AsUnsignedLongLong(o);
    if (x == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        const long long sx = PyLong_AsLongLong(o);
        if ((sx == -1 && PyErr_Occurred()) || sx >= 0) {
            PyErr_Clear();
            return 0;
        }
        x = (uint64_t)sx;
    }
    *out = x;
    return 1;
}

/* array.array: put_runs takes exactly its instances (typecode 'Q'), as writer.py's form does. */
static PyTypeObject *array_type = NULL;

/* A staged list's runs, as put_runs and Publisher.flush read them: views[i] over run i's keys
 * (its 'Q' array, or keys[i] holding a single int key), metas[i] its meta. Up to 8 runs (an
 * engine step's usual 2) in the struct itself: no allocation. */
typedef struct {
    Py_buffer small_views[8], *views;
    uint64_t small_metas[8], small_keys[8], *metas, *keys;
    Py_ssize_t got; /* views held */
} Runs;

static void runs_release(Runs *r) {
    for (Py_ssize_t i = 0; i < r->got; i++) {
        if (r->views[i].obj != NULL) PyBuffer_Release(&r->views[i]);
    }
    r->got = 0;
    if (r->views != r->small_views) {
        PyMem_Free(r->views);
        PyMem_Free(r->metas);
        PyMem_Free(r->keys);
        r->views = r->small_views;
    }
}

/* The records in list[0:nr], if every item is (an array('Q') or an exact int key in
 * [-2^63, 2^64), an exact int meta); -1 if one is something else (no exception set); -2 with
 * an exception set if memory ran out. runs_release() after either. */
static Py_ssize_t runs_collect(Runs *r, PyObject *list, Py_ssize_t nr) {
    r->views = r->small_views;
    r->metas = r->small_metas;
    r->keys = r->small_keys;
    r->got = 0;
    if (nr > 8) {
        r->views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)nr);
        r->metas = PyMem_Malloc(sizeof(uint64_t) * (size_t)nr);
        r->keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)nr);
        if (r->views == NULL || r->metas == NULL || r->keys == NULL) {
            PyMem_Free(r->views);
            PyMem_Free(r->metas);
            PyMem_Free(r->keys);
            r->views = r->small_views;
            PyErr_NoMemory();
            return -2;
        }
    }
    Py_ssize_t total = 0;
    for (; r->got < nr; r->got++) {
        PyObject *it = PyList_GET_ITEM(list, r->got);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2) return -1;
        PyObject *kw = PyTuple_GET_ITEM(it, 0), *mo = PyTuple_GET_ITEM(it, 1);
        uint64_t meta;
        if (!PyLong_CheckExact(mo) || !u64_word(mo, &meta, 0)) return -1;
        Py_buffer *v = &r->views[r->got];
        if (PyLong_CheckExact(kw)) { /* one key staged alone (not a bool: not exact) */
            if (!u64_word(kw, &r->keys[r->got], 1)) return -1;
            v->obj = NULL; /* nothing to release */
            v->buf = &r->keys[r->got];
            v->len = 8;
        } else if (!Py_IS_TYPE(kw, array_type)) { /* as writer.py's form */
            return -1;
        } else if (PyObject_GetBuffer(kw, v, PyBUF_CONTIG_RO | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            return -1;
        } else if (v->itemsize != 8 || v->format == NULL || strcmp(v->format, "Q") != 0) {
            PyBuffer_Release(v);
            return -1;
        }
        r->metas[r->got] = meta;
        total += v->len / 8;
    }
    return total;
}

/* Record i of the runs to slot start + i of `words` (the ring's slots as u64 words: seq, key,
 * meta, parent) with seq = seq + 1 + i, the seq words after the payload (a slot is valid once
 * its seq matches), then the header: attempted and last seq, and last the tail (the publishing
 * store). The caller has ruled out a wrap and a full ring. x86-64 keeps stores in order; the
 * fences keep the compiler from reordering or merging them. */
static void runs_store(const Runs *r, uint64_t *words, volatile uint64_t *hw, Py_ssize_t start,
                       Py_ssize_t total, uint64_t seq, uint64_t attempted, uint64_t tail) {
    uint64_t *const base = words + 4 * start;
    uint64_t *sw = base;
    for (Py_ssize_t i = 0; i < r->got; i++) {
        const uint64_t *kw = r->views[i].buf, meta = r->metas[i];
        const Py_ssize_t k = r->views[i].len / 8;
        for (Py_ssize_t j = 0; j < k; j++, sw += 4) {
            sw[1] = kw[j];
            sw[2] = meta;
            sw[3] = 0;
        }
    }
    atomic_signal_fence(memory_order_seq_cst);
    for (Py_ssize_t j = 0; j < total; j++) base[4 * j] = seq + 1 + (uint64_t)j;
    atomic_signal_fence(memory_order_seq_cst);
    hw[W_ATTEMPTED] = attempted + (uint64_t)total;
    hw[W_LAST_SEQ] = seq + (uint64_t)total;
    atomic_signal_fence(memory_order_seq_cst);
    hw[W_TAIL] = tail + (uint64_t)total;
}

/* put_runs(runs, words, hdr, start, room, seq, attempted, tail) -> records written, -1 or
 * -2 - records. runs: the hook's staged list of (keys, meta int), keys an array('Q') or one
 * int key in [-2^63, 2^64) (a negative one, KVCM's signed spelling, wraps). If every item is
 * one of those and their records fit in `room` slots from slot `start` (the caller rules out a
 * wrap and a full ring), they are stored as runs_store() says. -1: an item is something else;
 * -2 - n: n records do not fit; in both cases nothing is written. METH_FASTCALL: argument
 * tuples and format parsing cost microseconds on the caches an engine's step leaves cold. */
static PyObject *put_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "put_runs(runs: list, words, hdr, start, room, seq, attempted, tail)");
        return NULL;
    }
    PyObject *runs = args[0];
    const Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    const Py_ssize_t room = PyLong_AsSsize_t(args[4]);
    if (room == -1 && PyErr_Occurred()) return NULL;
    unsigned long long word[3]; /* seq, attempted, tail */
    for (int i = 0; i < 3; i++) {
        word[i] = PyLong_AsUnsignedLongLong(args[5 + i]);
        if (word[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    Runs r;
    const Py_ssize_t total = runs_collect(&r, runs, PyList_GET_SIZE(runs));
    PyObject *result = NULL;
    if (total == -2) {
        /* no memory: the exception is set */
    } else if (total < 0) {
        PyErr_Clear(); /* (none is set; a backstop: a -1 must never carry one) */
        result = PyLong_FromLong(-1);
    } else if (total > room || start < 0) {
        result = PyLong_FromSsize_t(-2 - total);
    } else {
        Py_buffer w, h;
        if (PyObject_GetBuffer(args[1], &w, PyBUF_CONTIG) == 0) {
            if (PyObject_GetBuffer(args[2], &h, PyBUF_CONTIG) == 0) {
                if (w.itemsize != 8 || h.itemsize != 8 || h.len / 8 < HEADER_WORDS ||
                    (start + total) * 4 > w.len / 8) {
                    PyErr_SetString(PyExc_ValueError, "put_runs: the slots do not fit the ring");
                } else {
                    runs_store(&r, w.buf, h.buf, start, total, word[0], word[1], word[2]);
                    result = PyLong_FromSsize_t(total);
                }
                PyBuffer_Release(&h);
            }
            PyBuffer_Release(&w);
        }
    }
    runs_release(&r);
    return result;
}

/* ---- the engine's flush, whole, in one C call ---------------------------------------------
 * After an engine step's sleep this VM runs everything on cold caches: each Python frame,
 * attribute and object a flush touches costs about a microsecond (bench/README.md,
 * "hotpath"), and the Python flush touched ~100 of them. Publisher.flush keeps what the
 * usual flush needs in one struct and does the whole of it, the resident set's queue
 * included; anything unusual (arguments, a wrap, a full ring, a key that is not a word, a
 * closed hook) goes to the Python flush (`slow`), which handles every case.
 *
 * It never takes the hook's flush token: it only looks that nobody holds it, then runs to the
 * end without running Python code or allocating a GC-tracked object (either could let another
 * thread run: CPython 3.11 collects garbage inside an allocation), so under the GIL nothing
 * else publishes meanwhile. The flusher and the Python flush take the token; when one holds
 * it, this flush counts `busy` and returns 0, as the Python one does. */

/* The resident set's queue (resident.py's RunQueue has the same attributes). */
typedef struct {
    PyObject_HEAD
    PyObject *items; /* list of (keys, meta) runs in call order */
    Py_ssize_t n;    /* records in them */
} RunQueue;

static int rq_init(RunQueue *q, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ":RunQueue")) return -1;
    PyObject *items = PyList_New(0);
    if (items == NULL) return -1;
    Py_XSETREF(q->items, items);
    q->n = 0;
    return 0;
}

static int rq_traverse(RunQueue *q, visitproc visit, void *arg) {
    Py_VISIT(q->items);
    return 0;
}

static int rq_clear(RunQueue *q) {
    Py_CLEAR(q->items);
    return 0;
}

static void rq_dealloc(RunQueue *q) {
    PyObject_GC_UnTrack(q);
    rq_clear(q);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyMemberDef rq_members[] = {
    {"items", T_OBJECT_EX, offsetof(RunQueue, items), 0, "queued (keys, meta) runs"},
    {"n", T_PYSSIZET, offsetof(RunQueue, n), 0, "records in them"},
    {NULL},
};

static PyTypeObject RunQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.shm_ring._accel.RunQueue",
    .tp_basicsize = sizeof(RunQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "RunQueue(): the resident set's queue of runs not yet folded",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rq_init,
    .tp_traverse = (traverseproc)rq_traverse,
    .tp_clear = (inquiry)rq_clear,
    .tp_dealloc = (destructor)rq_dealloc,
    .tp_members = rq_members,
};

/* What a flush leaves to Python (Publisher's `after`), as flag bits. */
#define AFTER_RING 1 /* the reader sleeps on its doorbell: ring it */
#define AFTER_POST 2 /* the queue reached fold_post_at (now set to NEVER): post the flusher */
#define AFTER_FOLD 4 /* the queue reached fold_at: the flusher fell far behind, fold now */
#define FOLD_NEVER (1LL << 62)

typedef struct {
    PyObject_HEAD
    PyObject *staged, *token, *queue, *slow, *after;
    /* the staging calls (stored/removed, below): the Python methods they stand in for, the
     * hook's meta tables, and the run single stored() keys grow (the hook's, shared) */
    PyObject *slow_stored, *slow_removed, *stored_meta, *removed_meta, *run;
    PyObject *ndarray, *dt_int64, *dt_uint64; /* numpy's, from staging(); NULL: no arrays */
    Py_buffer words, hdr;
    int held;  /* words and hdr are held (until release()) */
    int fast;  /* 0: every flush is the Python one */
    int stage; /* 1: the hook's staging append is the staged list's own (see stored) */
    Py_ssize_t capacity;
    long long flushes, busy, fold_post_at, fold_at;
} Publisher;

static int pub_traverse(Publisher *p, visitproc visit, void *arg) {
    Py_VISIT(p->staged);
    Py_VISIT(p->token);
    Py_VISIT(p->queue);
    Py_VISIT(p->slow);
    Py_VISIT(p->after);
    Py_VISIT(p->slow_stored);
    Py_VISIT(p->slow_removed);
    Py_VISIT(p->stored_meta);
    Py_VISIT(p->removed_meta);
    Py_VISIT(p->run);
    Py_VISIT(p->ndarray);
    Py_VISIT(p->dt_int64);
    Py_VISIT(p->dt_uint64);
    return 0;
}

static void pub_release_buffers(Publisher *p) {
    p->fast = 0;
    if (p->held) {
        p->held = 0;
        PyBuffer_Release(&p->hdr);
        PyBuffer_Release(&p->words);
    }
}

static int pub_clear(Publisher *p) {
    pub_release_buffers(p);
    Py_CLEAR(p->staged);
    Py_CLEAR(p->token);
    Py_CLEAR(p->queue);
    Py_CLEAR(p->slow);
    Py_CLEAR(p->after);
    Py_CLEAR(p->slow_stored);
    Py_CLEAR(p->slow_removed);
    Py_CLEAR(p->stored_meta);
    Py_CLEAR(p->removed_meta);
    Py_CLEAR(p->run);
    Py_CLEAR(p->ndarray);
    Py_CLEAR(p->dt_int64);
    Py_CLEAR(p->dt_uint64);
    p->stage = 0;
    return 0;
}

static void pub_dealloc(Publisher *p) {
    PyObject_GC_UnTrack(p);
    pub_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Publisher(staged, token, words, hdr, slow, after): staged and token the hook's lists, words
 * and hdr the ring's slot and header words (held until release()), slow(*args, **kw) the
 * Python flush, after(flags) what a flush leaves to Python. The producer cursors (tail, last
 * seq, attempted) and the cached reader cursor (head seen) are the header's own words: the
 * ring writer's Python paths read them back at each write (writer.py, _sync). */
static int pub_init(Publisher *p, PyObject *args, PyObject *kw) {
    PyObject *staged, *token, *words, *hdr, *slow, *after;
    if (!PyArg_ParseTuple(args, "O!O!OOOO:Publisher", &PyList_Type, &staged, &PyList_Type,
                          &token, &words, &hdr, &slow, &after))
        return -1;
    if (!PyCallable_Check(slow) || !PyCallable_Check(after)) {
        PyErr_SetString(PyExc_TypeError, "Publisher: slow and after must be callable");
        return -1;
    }
    pub_clear(p);
    if (PyObject_GetBuffer(words, &p->words, PyBUF_CONTIG) < 0) return -1;
    if (PyObject_GetBuffer(hdr, &p->hdr, PyBUF_CONTIG) < 0) {
        PyBuffer_Release(&p->words);
        return -1;
    }
    p->held = 1;
    /* The ring's capacity word; the slot words may run past its slots (a longer mapping). */
    const uint64_t cap = p->hdr.itemsize == 8 && p->hdr.len / 8 >= HEADER_WORDS
                             ? ((uint64_t *)p->hdr.buf)[W_CAPACITY]
                             : 0;
    if (p->words.itemsize != 8 || cap == 0 || (cap & (cap - 1)) ||
        cap > (uint64_t)(p->words.len / 32)) {
        pub_release_buffers(p);
        PyErr_SetString(PyExc_ValueError, "Publisher: words and hdr are not one ring's");
        return -1;
    }
    p->capacity = (Py_ssize_t)cap;
    Py_INCREF(staged);
    p->staged = staged;
    Py_INCREF(token);
    p->token = token;
    Py_INCREF(Py_None);
    p->queue = Py_None;
    Py_INCREF(slow);
    p->slow = slow;
    Py_INCREF(after);
    p->after = after;
    p->fast = 1;
    p->flushes = p->busy = 0;
    p->fold_post_at = p->fold_at = FOLD_NEVER;
    return 0;
}

static PyObject *pub_slow(Publisher *p, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (p->slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Publisher: not initialised");
        return NULL;
    }
    return PyObject_Vectorcall(p->slow, args, nargsf, kwnames);
}

static PyObject *pub_publish(Publisher *p, RunQueue *q, Py_ssize_t nr, PyObject *const *args,
                             size_t nargsf, PyObject *kwnames);

/* flush(wait=False) -> records accepted: the hook's flush(). */
static PyObject *pub_flush(Publisher *p, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) || kwnames != NULL || !p->fast || !p->held)
        return pub_slow(p, args, nargsf, kwnames);
    if (PyList_GET_SIZE(p->token) != 1) { /* the flusher (or a flush(wait=True)) publishes */
        p->busy++;
        return PyLong_FromLong(0);
    }
    const Py_ssize_t nr = PyList_GET_SIZE(p->staged);
    if (nr == 0) return PyLong_FromLong(0);
    RunQueue *q = NULL;
    if (p->queue != NULL && p->queue != Py_None) {
        if (!Py_IS_TYPE(p->queue, &RunQueueType)) return pub_slow(p, args, nargsf, kwnames);
        q = (RunQueue *)p->queue;
        if (q->items == NULL || !PyList_CheckExact(q->items))
            return pub_slow(p, args, nargsf, kwnames);
    }
    /* q is held across the publish: only a MemoryError in it could let other code run (and
     * replace the queue), but then q must still be there to look at */
    Py_XINCREF(q);
    PyObject *res = pub_publish(p, q, nr, args, nargsf, kwnames);
    Py_XDECREF(q);
    return res;
}

static PyObject *pub_publish(Publisher *p, RunQueue *q, Py_ssize_t nr, PyObject *const *args,
                             size_t nargsf, PyObject *kwnames) {
    Runs r;
    const Py_ssize_t total = runs_collect(&r, p->staged, nr);
    volatile uint64_t *hw = p->hdr.buf;
    const uint64_t cap = (uint64_t)p->capacity, tail = hw[W_TAIL];
    const uint64_t start = tail & (cap - 1);
    uint64_t seen = hw[W_HEAD_SEEN]; /* stale at worst: it only under-counts the room */
    if (total >= 0 && (tail - seen > cap || cap - (tail - seen) < (uint64_t)total)) {
        const uint64_t head = hw[W_HEAD];
        if (tail - head <= cap) hw[W_HEAD_SEEN] = seen = head; /* else garbage: keep ours */
    }
    if (total < 0 || tail - seen > cap || (uint64_t)total > cap - (tail - seen) ||
        start + (uint64_t)total > cap)
        goto slow; /* a key that is not a word, no memory, a full ring, a wrap */
    /* The resident set first (a failure here changes nothing), then staged, then the ring.
     * Should removing them from staged fail, the Python flush publishes them again: the same
     * transitions twice in the same order end in the same state, and seqs stay dense. */
    const Py_ssize_t queued = q ? PyList_GET_SIZE(q->items) : 0;
    for (Py_ssize_t i = 0; q && i < nr; i++) {
        if (PyList_Append(q->items, PyList_GET_ITEM(p->staged, i)) < 0) {
            PyErr_Clear(); /* (out of memory: the MemoryError may have let another thread run,
                            * so the appends are taken back only if the queue is as we left
                            * it; else they stay: the same runs twice in order are harmless;
                            * a failing rollback's own error is cleared at slow) */
            if (PyList_GET_SIZE(q->items) == queued + i)
                PyList_SetSlice(q->items, queued, PY_SSIZE_T_MAX, NULL);
            goto slow;
        }
    }
    if (PyList_SetSlice(p->staged, 0, nr, NULL) < 0) goto slow;
    runs_store(&r, p->words.buf, hw, (Py_ssize_t)start, total, hw[W_LAST_SEQ], hw[W_ATTEMPTED],
               tail);
    p->flushes++;
    if (q) q->n += total;
    runs_release(&r); /* (the staged arrays the resident set does not keep are freed here) */
    int flags = hw[W_READER_IDLE] ? AFTER_RING : 0;
    if (q) {
        if (q->n >= p->fold_post_at) {
            p->fold_post_at = FOLD_NEVER; /* until the flusher has folded */
            flags |= AFTER_POST;
        }
        if (q->n >= p->fold_at) flags |= AFTER_FOLD;
    }
    if (flags) { /* Python code from here on: everything above is consistent */
        PyObject *res = PyObject_CallFunction(p->after, "i", flags);
        if (res == NULL) { /* after() counts its own failures; the engine never sees one */
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL; /* KeyboardInterrupt, SystemExit: the engine's, as in Python */
            PyErr_Clear();
        }
        Py_XDECREF(res);
    }
    return PyLong_FromSsize_t(total);
slow: /* nothing published: the Python flush does it all */
    runs_release(&r);
    PyErr_Clear();
    return pub_slow(p, args, nargsf, kwnames);
}

static PyObject *pub_release(Publisher *p, PyObject *unused) {
    pub_release_buffers(p);
    Py_RETURN_NONE;
}

/* ---- the engine's staging calls, in C ---------------------------------------------------
 * hook.stored(k) / hook.removed(k) for one int key is the per-block call of an engine that
 * reports block by block: in Python its frame, lookups and method calls cost ~200 ns
 * (bench/README.md, "single key"). Publisher.stored / .removed do what the Python methods
 * (`slow_stored` / `slow_removed`) do for the common calls, an exact int key or a list with
 * group an exact int and medium absent, None or an exact str, with the same meta lookups in
 * the hook's tables (stage_meta), and stage exactly what those stage. stored(k) grows the
 * newest staged run (`run`, the hook's, shared with its Python method: (array('Q'), meta))
 * when its meta matches, else stages a new run, or the key alone if it is no word in
 * [0, 2^64) (negative, or too wide: the flush converts or rejects it); removed(k) stages
 * (k, meta). A list (an engine step's call) is staged as its words (words(), the Python
 * methods' `_words` in a compiled hook), or as a copy if a key is no word; an int64 or uint64
 * ndarray as its int64 copy (stage_ndarray). Every other call (other arrays, a bool, a
 * numpy int, an unknown group or medium, wrong arguments) is the Python method's (~50 ns
 * more than calling it directly), and so is every call that would stage a new item while
 * `stage` is 0: the hook's append is then not the staged list's own (the first staging after
 * a quiet spell posts the flusher's bell; a closed hook counts the call).
 * GIL-safe as Publisher.flush is: between the look at the newest run and the append to it,
 * and between the look at `stage` and the append to `staged`, no Python code runs and no
 * GC-tracked object is allocated (a new item's objects are made before the look), so no
 * other thread stages or publishes in between. */

/* array('Q', [0]): `word_array * k` (sq_repeat) makes a k-word array without parsing. */
static PyObject *word_array = NULL;

/* array.array.append's C function (METH_O), called directly: a call through the bound method
 * costs about as much as the rest of stored(). NULL: call the method by name. */
static PyCFunction array_append_fn = NULL;
static PyObject *str_append = NULL;
static PyObject *kw_group = NULL, *kw_medium = NULL, *int_zero = NULL;
static PyObject *str_dtype = NULL, *str_ravel = NULL, *str_view = NULL, *str_copy = NULL,
                *str_astype = NULL;

static int array_append(PyObject *arr, PyObject *v) {
    PyObject *r = array_append_fn != NULL ? array_append_fn(arr, v)
                                          : PyObject_CallMethodOneArg(arr, str_append, v);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The meta of a call (key, group=0, medium=None) in `table` (a new reference), looked up as
 * the Python methods do (group, or (group, medium) for a medium), or NULL (no exception set)
 * if the call is not of that form with an exact int group and medium None or an exact str, or
 * the table has no such entry (the Python method counts it). Only ints and strs are hashed
 * and compared: no Python code runs. */
static PyObject *stage_meta(PyObject *table, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    const Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (table == NULL || nargs < 1 || nargs + nkw > 3) return NULL;
    PyObject *group = nargs >= 2 ? args[1] : NULL, *medium = nargs >= 3 ? args[2] : NULL;
    for (Py_ssize_t i = 0; i < nkw; i++) { /* interned names; any other spelling: Python's */
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (name == kw_group && group == NULL)
            group = args[nargs + i];
        else if (name == kw_medium && medium == NULL)
            medium = args[nargs + i];
        else
            return NULL;
    }
    if (group == NULL) group = int_zero;
    if (!PyLong_CheckExact(group)) return NULL;
    PyObject *meta;
    if (medium == NULL || medium == Py_None) {
        meta = PyDict_GetItemWithError(table, group);
    } else {
        if (!PyUnicode_CheckExact(medium)) return NULL;
        PyObject *at = PyTuple_Pack(2, group, medium);
        if (at == NULL) {
            PyErr_Clear();
            return NULL;
        }
        meta = PyDict_GetItemWithError(table, at);
        Py_DECREF(at);
    }
    if (meta == NULL || !PyLong_CheckExact(meta)) {
        PyErr_Clear();
        return NULL;
    }
    Py_INCREF(meta);
    return meta;
}

static PyObject *stage_slow(PyObject *slow, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    if (slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Publisher: staging() was not called");
        return NULL;
    }
    return PyObject_Vectorcall(slow, args, (size_t)nargs, kwnames);
}

/* Append `item` (a new reference, taken) to staged if the hook's append is the list's own:
 * 1 if it did, 0 if not (the caller goes to Python; no exception set). */
static int stage_append(Publisher *p, PyObject *item) {
    int done = 0;
    if (p->stage && p->staged != NULL && PyList_Append(p->staged, item) == 0) done = 1;
    PyErr_Clear();
    Py_DECREF(item);
    return done;
}

/* Stages (keys, meta), taking the reference to keys: stage_append's result, or 0 (nothing
 * staged, the caller goes to Python) when the pair cannot be made. */
static int stage_pair(Publisher *p, PyObject *keys, PyObject *meta) {
    PyObject *item = PyTuple_Pack(2, keys, meta);
    Py_DECREF(keys);
    if (item == NULL) {
        PyErr_Clear();
        return 0;
    }
    return stage_append(p, item);
}

static PyObject *words(PyObject *self, PyObject *list);

/* A list's staging, as the Python methods': (words(keys), meta), or a copy of the list if a
 * key is no word (a bool, a str, ...: the flush checks each key); an empty list stages
 * nothing. 1: done; 0: nothing staged, the caller goes to Python (no exception set). */
static int stage_list(Publisher *p, PyObject *list, PyObject *meta) {
    if (PyList_GET_SIZE(list) == 0) return 1;
    PyObject *keys = words(NULL, list);
    if (keys == NULL) {
        const int copy = PyErr_ExceptionMatches(PyExc_OverflowError) ||
                         PyErr_ExceptionMatches(PyExc_TypeError);
        PyErr_Clear();
        keys = copy ? PyList_GetSlice(list, 0, PY_SSIZE_T_MAX) : NULL;
        if (keys == NULL) {
            PyErr_Clear();
            return 0;
        }
    }
    return stage_pair(p, keys, meta);
}

/* An ndarray's staging, as the Python methods' for an int64 or uint64 one (native order: the
 * dtype singletons): its ravel() copied to int64 (astype; a uint64 one viewed as int64,
 * KVCM's signed bit pattern), or nothing if it is empty; the same numpy calls, without the
 * Python frame and its dtype comparisons. 1: done; 0: nothing staged, the caller goes to
 * Python (another dtype, an object array, a failure). */
static int stage_ndarray(Publisher *p, PyObject *nd, PyObject *meta) {
    PyObject *dt = PyObject_GetAttr(nd, str_dtype), *flat = NULL, *keys = NULL;
    const int u64 = dt != NULL && dt == p->dt_uint64;
    if (dt == NULL || (dt != p->dt_int64 && !u64)) goto fail;
    flat = PyObject_CallMethodNoArgs(nd, str_ravel);
    if (flat == NULL) goto fail;
    const Py_ssize_t n = PyObject_Size(flat);
    if (n < 0) goto fail;
    if (n == 0) { /* (as `if len(arr)`: nothing to stage) */
        Py_DECREF(flat);
        Py_DECREF(dt);
        return 1;
    }
    if (u64) {
        PyObject *view = PyObject_CallMethodOneArg(flat, str_view, p->dt_int64);
        keys = view != NULL ? PyObject_CallMethodNoArgs(view, str_copy) : NULL;
        Py_XDECREF(view);
    } else {
        keys = PyObject_CallMethodOneArg(flat, str_astype, p->dt_int64);
    }
    if (keys == NULL) goto fail;
    Py_DECREF(flat);
    Py_DECREF(dt);
    return stage_pair(p, keys, meta);
fail:
    Py_XDECREF(flat);
    Py_XDECREF(dt);
    PyErr_Clear();
    return 0;
}

/* stored(keys, group=0, medium=None): the hook's stored(). */
static PyObject *pub_stored(Publisher *p, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    if (nargs < 1) goto slow;
    PyObject *key = args[0];
    const int list = PyList_CheckExact(key);
    const int nd = !list && p->ndarray != NULL && Py_IS_TYPE(key, (PyTypeObject *)p->ndarray);
    if (!list && !nd && !PyLong_CheckExact(key)) goto slow; /* (no lookup first) */
    PyObject *meta = stage_meta(p->stored_meta, args, nargs, kwnames);
    if (meta == NULL) goto slow;
    if (list || nd) {
        if (!(list ? stage_list(p, key, meta) : stage_ndarray(p, key, meta))) goto slow_meta;
        goto done;
    }
    uint64_t word;
    if (!u64_word(key, &word, 0)) { /* negative or too wide: staged alone, as in Python */
        PyObject *item = PyTuple_Pack(2, key, meta);
        if (item == NULL || !stage_append(p, item)) goto slow_meta;
        goto done;
    }
    PyObject *run = p->run;
    const Py_ssize_t n = p->staged != NULL ? PyList_GET_SIZE(p->staged) : 0;
    if (n && run != NULL && PyList_GET_ITEM(p->staged, n - 1) == run && PyTuple_CheckExact(run) &&
        PyTuple_GET_SIZE(run) == 2 && Py_IS_TYPE(PyTuple_GET_ITEM(run, 0), array_type)) {
        PyObject *rm = PyTuple_GET_ITEM(run, 1);
        int same = rm == meta;
        if (!same && PyLong_CheckExact(rm)) {
            PyObject *eq = PyLong_Type.tp_richcompare(rm, meta, Py_EQ);
            same = eq == Py_True;
            Py_XDECREF(eq);
        }
        if (same) {
            if (array_append(PyTuple_GET_ITEM(run, 0), key) == 0) goto done;
            goto slow_meta; /* (a buffer export, no memory: Python's handling, the same) */
        }
    }
    /* A new run: its objects first (an allocation may run a collection, and other threads),
     * then the look at `stage` and the append, with nothing in between. */
    PyObject *arr = PySequence_Repeat(word_array, 0);
    if (arr == NULL || array_append(arr, key) < 0) {
        Py_XDECREF(arr);
        goto slow_meta;
    }
    PyObject *item = PyTuple_Pack(2, arr, meta);
    Py_DECREF(arr);
    if (item == NULL) goto slow_meta;
    Py_INCREF(item);
    if (!stage_append(p, item)) {
        Py_DECREF(item);
        goto slow_meta;
    }
    PyObject *old = p->run; /* released last: its last reference may run Python code */
    p->run = item;
    Py_XDECREF(old);
done:
    Py_DECREF(meta);
    Py_RETURN_NONE;
slow_meta:
    Py_DECREF(meta);
slow:
    PyErr_Clear();
    return stage_slow(p->slow_stored, args, nargs, kwnames);
}

/* removed(keys, group=0, medium=None): the hook's removed(). */
static PyObject *pub_removed(Publisher *p, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    PyObject *key = nargs >= 1 ? args[0] : NULL;
    const int list = key != NULL && PyList_CheckExact(key);
    const int nd = key != NULL && !list && p->ndarray != NULL &&
                   Py_IS_TYPE(key, (PyTypeObject *)p->ndarray);
    PyObject *meta = list || nd || (key != NULL && PyLong_CheckExact(key))
                         ? stage_meta(p->removed_meta, args, nargs, kwnames)
                         : NULL;
    if (meta != NULL) {
        int done;
        if (list) {
            done = stage_list(p, key, meta);
        } else if (nd) {
            done = stage_ndarray(p, key, meta);
        } else {
            PyObject *item = PyTuple_Pack(2, args[0], meta);
            done = item != NULL && stage_append(p, item);
        }
        Py_DECREF(meta);
        if (done) Py_RETURN_NONE;
        PyErr_Clear();
    }
    return stage_slow(p->slow_removed, args, nargs, kwnames);
}

/* staging(stored, removed, stored_meta, removed_meta, numpy): the Python methods
 * stored()/removed() stand in for, the hook's meta tables ({group: meta, (group, medium):
 * meta}) and (numpy.ndarray, dtype int64, dtype uint64), or None: every array is the Python
 * methods'. */
static PyObject *pub_staging(Publisher *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1]) ||
        !PyDict_CheckExact(args[2]) || !PyDict_CheckExact(args[3]) ||
        (args[4] != Py_None &&
         (!PyTuple_CheckExact(args[4]) || PyTuple_GET_SIZE(args[4]) != 3 ||
          !PyType_Check(PyTuple_GET_ITEM(args[4], 0))))) {
        PyErr_SetString(PyExc_TypeError,
                        "staging(stored, removed, stored_meta: dict, removed_meta: dict, "
                        "numpy: (ndarray, int64, uint64) | None)");
        return NULL;
    }
    PyObject *np = args[4] == Py_None ? NULL : args[4];
    Py_XSETREF(p->ndarray, np ? Py_NewRef(PyTuple_GET_ITEM(np, 0)) : NULL);
    Py_XSETREF(p->dt_int64, np ? Py_NewRef(PyTuple_GET_ITEM(np, 1)) : NULL);
    Py_XSETREF(p->dt_uint64, np ? Py_NewRef(PyTuple_GET_ITEM(np, 2)) : NULL);
    Py_INCREF(args[0]);
    Py_XSETREF(p->slow_stored, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(p->slow_removed, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(p->stored_meta, args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(p->removed_meta, args[3]);
    Py_RETURN_NONE;
}

static PyMethodDef pub_methods[] = {
    {"flush", (PyCFunction)(void (*)(void))pub_flush, METH_FASTCALL | METH_KEYWORDS,
     "flush(wait=False) -> records accepted (the hook's flush)"},
    {"release", (PyCFunction)pub_release, METH_NOARGS,
     "let go of the ring's buffers (before the segment closes); later flushes are slow()'s"},
    {"stored", (PyCFunction)(void (*)(void))pub_stored, METH_FASTCALL | METH_KEYWORDS,
     "stored(keys, group=0, medium=None): the hook's stored() (its common call in C)"},
    {"removed", (PyCFunction)(void (*)(void))pub_removed, METH_FASTCALL | METH_KEYWORDS,
     "removed(keys, group=0, medium=None): the hook's removed() (its common call in C)"},
    {"staging", (PyCFunction)(void (*)(void))pub_staging, METH_FASTCALL,
     "staging(stored, removed, stored_meta, removed_meta, numpy): what stored()/removed() "
     "stand in for"},
    {NULL},
};

static PyMemberDef pub_members[] = {
    {"queue", T_OBJECT, offsetof(Publisher, queue), 0, "the resident set's RunQueue, or None"},
    {"fast", T_INT, offsetof(Publisher, fast), 0, "0: every flush is slow()'s"},
    {"flushes", T_LONGLONG, offsetof(Publisher, flushes), 0, "publishes made here"},
    {"busy", T_LONGLONG, offsetof(Publisher, busy), 0, "flushes that found the token taken"},
    {"fold_post_at", T_LONGLONG, offsetof(Publisher, fold_post_at), 0,
     "queued records at which a flush posts the flusher (then NEVER until reset)"},
    {"fold_at", T_LONGLONG, offsetof(Publisher, fold_at), 0,
     "queued records at which a flush asks after() to fold"},
    {"run", T_OBJECT, offsetof(Publisher, run), 0,
     "the run single stored() keys grow: (array('Q'), meta), the hook's"},
    {"stage", T_INT, offsetof(Publisher, stage), 0,
     "1: the hook's staging append is the staged list's own (stored/removed may append)"},
    {NULL},
};

static PyTypeObject PublisherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.shm_ring._accel.Publisher",
    .tp_basicsize = sizeof(Publisher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Publisher(staged, token, words, hdr, slow, after): the hook's flush in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pub_init,
    .tp_traverse = (traverseproc)pub_traverse,
    .tp_clear = (inquiry)pub_clear,
    .tp_dealloc = (destructor)pub_dealloc,
    .tp_methods = pub_methods,
    .tp_members = pub_members,
};

/* words(keys: list) -> array('Q'): the keys as u64 words of KVCM's signed bit pattern (a
 * negative key wraps). Each item must be an int (not a bool) in [-2^63, 2^64): TypeError or
 * OverflowError otherwise. What a hook call converts an engine's list with, in one call
 * (METH_O, no argument parsing): array('Q', keys) took a bool as 0 or 1, and a negative key
 * made it fail. On cold caches the cost is the engine's ints themselves (about the same as
 * array('Q', keys) in an A/B at 5 k events/s). */
static PyObject *words(PyObject *self, PyObject *list) {
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "words: keys must be a list");
        return NULL;
    }
    const Py_ssize_t k = PyList_GET_SIZE(list);
    PyObject *arr = PySequence_Repeat(word_array, k);
    if (arr == NULL) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(arr, &v, PyBUF_CONTIG) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    uint64_t *dst = v.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; v.len == 8 * k && i < k; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(o)) { /* no repr of the key: it may be huge, or raise */
            PyErr_Format(PyExc_TypeError, "key %zd of the list is not an int", i);
            ok = 0;
            break;
        }
        if (!key_word(o, &dst[i])) {
            PyErr_Format(PyExc_OverflowError, "key %zd of the list does not fit in 64 bits", i);
            ok = 0;
            break;
        }
    }
    PyBuffer_Release(&v);
    if (ok && v.len != 8 * k) {
        PyErr_SetString(PyExc_SystemError, "words: array('Q') items are not 8 bytes");
        ok = 0;
    }
    if (!ok) {
        Py_DECREF(arr);
        return NULL;
    }
    return arr;
}

/* rolling(tokens, block_size, h, pending, out) -> (h, pending, keys written): KVCM's rolling
 * hash (engine_hook/rolling_hash.py is the reference) over int64 tokens, continuing from state
 * h with `pending` tokens since the last block boundary; out[k] = h (signed) after every token
 * that completes a block. out must hold (pending + len(tokens)) / block_size items. */
static PyObject *rolling(PyObject *self, PyObject *args) {
    PyObject *o_tok, *o_out;
    Py_ssize_t bs, pending;
    long long h0;
    if (!PyArg_ParseTuple(args, "OnLnO", &o_tok, &bs, &h0, &pending, &o_out)) return NULL;
    if (bs <= 0 || pending < 0 || pending >= bs) {
        PyErr_SetString(PyExc_ValueError, "rolling: need block_size > 0, 0 <= pending < it");
        return NULL;
    }
    Py_buffer vt, vo;
    if (kvcm_view(o_tok, &vt, 8, 0, "tokens") < 0) return NULL;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) {
        PyBuffer_Release(&vt);
        return NULL;
    }
    Py_ssize_t nt = vt.len / 8, room = vo.len / 8;
    if ((pending + nt) / bs > room) {
        PyBuffer_Release(&vt);
        PyBuffer_Release(&vo);
        PyErr_SetString(PyExc_ValueError, "rolling: out is too short");
        return NULL;
    }
    const uint64_t *t = (const uint64_t *)vt.buf;
    int64_t *out = (int64_t *)vo.buf;
    uint64_t h = (uint64_t)h0;
    Py_ssize_t k = 0, p = pending, i = 0;
    for (; i < nt && p; i++) { /* the rest of a partial block */
        h = kvcm_roll_step(h, t[i]);
        if (++p == bs) {
            out[k++] = (int64_t)h;
            p = 0;
        }
    }
    for (; i + bs <= nt; i += bs) { /* whole blocks: no boundary test per token */
        h = kvcm_roll_block(h, t + i, bs);
        out[k++] = (int64_t)h;
    }
    for (; i < nt; i++, p++) h = kvcm_roll_step(h, t[i]); /* a partial last block */
    PyBuffer_Release(&vt);
    PyBuffer_Release(&vo);
    return Py_BuildValue("Lnn", (long long)(int64_t)h, p, k);
}

/* roll_list(tokens: list[int], block_size, h, pending) -> (h, pending, [keys]): rolling() for a
 * list of ints as msgspec decodes it (no array on the way); a token must fit in 64 bits. */
static PyObject *roll_list(PyObject *self, PyObject *args) {
    PyObject *o_tok;
    Py_ssize_t bs, pending;
    long long h0;
    if (!PyArg_ParseTuple(args, "O!nLn", &PyList_Type, &o_tok, &bs, &h0, &pending)) return NULL;
    if (bs <= 0 || pending < 0 || pending >= bs) {
        PyErr_SetString(PyExc_ValueError, "roll_list: need block_size > 0, 0 <= pending < it");
        return NULL;
    }
    Py_ssize_t nt = PyList_GET_SIZE(o_tok);
    PyObject *keys = PyList_New((pending + nt) / bs);
    if (keys == NULL) return NULL;
    uint64_t h = (uint64_t)h0;
    Py_ssize_t k = 0, p = pending;
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *o = PyList_GET_ITEM(o_tok, i);
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        uint64_t t = (uint64_t)v;
        if (overflow > 0) { /* >= 2^63: the low 64 bits */
            t = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
        } else if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "roll_list: a token below -2^63");
            Py_DECREF(keys);
            return NULL;
        }
        h = kvcm_roll_step(h, t);
        if (++p == bs) {
            PyObject *key = PyLong_FromLongLong((long long)(int64_t)h);
            if (key == NULL) {
                Py_DECREF(keys);
                return NULL;
            }
            PyList_SET_ITEM(keys, k++, key);
            p = 0;
        }
    }
    PyObject *out = Py_BuildValue("LnN", (long long)(int64_t)h, p, keys);
    return out;
}

/* ---- the sidecar's key-state fold (key_state.py _Tier.apply_records) --------------------- */
/* fold_apply(pos, metas, masks, required, out) -> (changed, published delta), or None (nothing
 * done: a kind other than stored/removed, or a group >= 61, which the numpy fold handles).
 * masks is the int64 group-mask column; for each record in order, its group's bit in
 * masks[pos[i]] is set (stored) or cleared (removed), which equals the numpy fold (the last op
 * per (key, group) wins). out receives each position whose published state ((mask & required)
 * == required) differs from before the call, once, in the order of first appearance. Bits 61
 * and 62 of a mask mark, during the call, "touched" and "was published". The numpy fold costs
 * ~30 numpy calls per read (~100 us for the ~100 records of an engine at a low pace). */
#define FOLD_TOUCHED ((int64_t)1 << 62)
#define FOLD_WAS ((int64_t)1 << 61)

/* The fold's first pass: each record's group bit set (stored) or cleared (removed) in order;
 * a key's mask is marked touched, and was-published, at its first record. metas[i * stride]
 * is record i's meta (1: a metas column; 4: the meta word of (n, 4) ring records). */
static inline void fold_mark(int64_t *masks, const int64_t *pos, const uint64_t *metas,
                             Py_ssize_t stride, Py_ssize_t m, int64_t req) {
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint64_t meta = metas[i * stride];
        int64_t v = masks[pos[i]];
        if (!(v & FOLD_TOUCHED)) v |= FOLD_TOUCHED | (((v & req) == req) ? FOLD_WAS : 0);
        const int64_t bit = (int64_t)1 << ((meta >> 8) & 0xFF);
        if ((meta & 0xFF) == KIND_STORED)
            v |= bit;
        else
            v &= ~bit;
        masks[pos[i]] = v;
    }
}

/* The second pass: each touched key settled once (its marks dropped); one whose published
 * state flipped counts in *delta and goes to out, first appearance first; with `queued`, only
 * if not queued yet, and it is marked queued (mark_dirty's filter). Returns how many went. */
static inline Py_ssize_t fold_settle(int64_t *masks, const int64_t *pos, Py_ssize_t m,
                                     int64_t req, uint8_t *queued, int64_t *out,
                                     long long *delta) {
    Py_ssize_t n_out = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t p = pos[i], v = masks[p];
        if (!(v & FOLD_TOUCHED)) continue; /* a repeat, already settled */
        const int64_t low = v & ~(FOLD_TOUCHED | FOLD_WAS);
        const int was = (v & FOLD_WAS) != 0, now = (low & req) == req;
        masks[p] = low;
        if (was != now) {
            *delta += now - was;
            if (queued == NULL) {
                out[n_out++] = p;
            } else if (!queued[p]) {
                queued[p] = 1;
                out[n_out++] = p;
            }
        }
    }
    return n_out;
}
static PyObject *fold_apply(PyObject *self, PyObject *args) {
    PyObject *o_pos, *o_metas, *o_masks, *o_out;
    long long required;
    if (!PyArg_ParseTuple(args, "OOOLO", &o_pos, &o_metas, &o_masks, &required, &o_out))
        return NULL;
    Py_buffer vp, vm, vk, vo;
    if (kvcm_view(o_pos, &vp, 8, 0, "pos") < 0) return NULL;
    if (kvcm_view(o_metas, &vm, 8, 0, "metas") < 0) goto f1;
    if (kvcm_view(o_masks, &vk, 8, 1, "masks") < 0) goto f2;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) goto f3;
    Py_ssize_t m = vp.len / 8, cols = vk.len / 8;
    const int64_t *pos = vp.buf;
    const uint64_t *metas = vm.buf;
    int64_t *masks = vk.buf, *out = vo.buf;
    const int64_t req = (int64_t)required;
    PyObject *result = NULL;
    if (vm.len / 8 != m || vo.len / 8 < m) {
        PyErr_SetString(PyExc_ValueError, "fold_apply: arrays do not fit");
        goto f4;
    }
    if ((req & (FOLD_TOUCHED | FOLD_WAS)) || req < 0) { /* a required group >= 61 */
        Py_INCREF(Py_None);
        result = Py_None;
        goto f4;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const unsigned kind = (unsigned)(metas[i] & 0xFF);
        if (pos[i] < 0 || pos[i] >= cols) {
            PyErr_SetString(PyExc_IndexError, "fold_apply: a position beyond the masks");
            goto f4;
        }
        if ((kind != KIND_STORED && kind != KIND_REMOVED) || ((metas[i] >> 8) & 0xFF) >= 61 ||
            (masks[pos[i]] & (FOLD_TOUCHED | FOLD_WAS))) {
            Py_INCREF(Py_None);
            result = Py_None;
            goto f4;
        }
    }
    fold_mark(masks, pos, metas, 1, m, req);
    long long delta = 0;
    const Py_ssize_t n_out = fold_settle(masks, pos, m, req, NULL, out, &delta);
    result = Py_BuildValue("nL", n_out, delta);
f4:
    PyBuffer_Release(&vo);
f3:
    PyBuffer_Release(&vk);
f2:
    PyBuffer_Release(&vm);
f1:
    PyBuffer_Release(&vp);
    return result;
}

/* ---- the delta encoder's key digits (kvcm_client/wire.py _fill_keys) -------------------- */
/* digits(buf, at, width, col, keys): for each key i, its unsigned 64-bit value as exactly 20
 * zero-padded decimal digits at buf[at + i * width + col]. The numpy form costs ~25 numpy calls
 * per request, tens of microseconds for the ~100-key requests of an engine at a low pace. */
static PyObject *digits(PyObject *self, PyObject *args) {
    PyObject *o_buf, *o_keys;
    Py_ssize_t at, width, col;
    if (!PyArg_ParseTuple(args, "OnnnO", &o_buf, &at, &width, &col, &o_keys)) return NULL;
    Py_buffer vb, vk;
    if (kvcm_view(o_buf, &vb, 1, 1, "buf") < 0) return NULL;
    if (kvcm_view(o_keys, &vk, 8, 0, "keys") < 0) {
        PyBuffer_Release(&vb);
        return NULL;
    }
    Py_ssize_t n = vk.len / 8;
    if (at < 0 || col < 0 || width < col + 20 || (n && at + (n - 1) * width + col + 20 > vb.len)) {
        PyErr_SetString(PyExc_ValueError, "digits: rows do not fit the buffer");
        PyBuffer_Release(&vk);
        PyBuffer_Release(&vb);
        return NULL;
    }
    const uint64_t *keys = vk.buf;
    char *row = (char *)vb.buf + at + col;
    for (Py_ssize_t i = 0; i < n; i++, row += width) kvcm_put20(row, keys[i]);
    PyBuffer_Release(&vk);
    PyBuffer_Release(&vb);
    Py_RETURN_NONE;
}

/* ==== ZMQ source: fold of decoded batches ===================================================
 * The ZMQ source's flush in two C passes instead of ~60 numpy calls (zmq_events.py BlockReader,
 * block_counts.py _apply_one; their numpy forms are the reference and the fallback):
 * zmq_keys reads every pending segment's block_hashes (msgpack arrays, as msgspec.Raw) into
 * per-block keys / places / signs and counts the events; zmq_count walks the store counts in
 * arrival order. Anything zmq_keys does not read exactly as the general path would (an element
 * that is no msgpack int or bin, an array that is not exactly one array) makes it answer None,
 * and the caller runs the general path (which finds and repairs malformed events). */

static PyObject *str_hashes = NULL, *str_codes = NULL, *str_medium = NULL, *str_group_idx = NULL,
                *str_block_size = NULL, *str_block_hashes = NULL;

static inline uint64_t zmq_be(const unsigned char *p, Py_ssize_t k) {
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < k; i++) v = v << 8 | p[i];
    return v;
}

/* One msgpack array of ints / bins at b[0:len] -> its elements' low 64 bits into out (at most
 * room of them): the count, -1 if not exactly such an array, -2 - count if room is short. */
static Py_ssize_t zmq_array(const unsigned char *b, Py_ssize_t len, int64_t *out,
                            Py_ssize_t room) {
    if (len < 1) return -1;
    Py_ssize_t at, n;
    const unsigned t = b[0];
    if ((t & 0xF0) == 0x90) {
        n = t & 0x0F;
        at = 1;
    } else if (t == 0xDC && len >= 3) {
        n = (Py_ssize_t)zmq_be(b + 1, 2);
        at = 3;
    } else if (t == 0xDD && len >= 5) {
        n = (Py_ssize_t)zmq_be(b + 1, 4);
        at = 5;
    } else {
        return -1;
    }
    if (n > len) return -1; /* every element takes a byte at least */
    if (n > room) return -2 - n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at >= len) return -1;
        const unsigned e = b[at++];
        uint64_t v;
        Py_ssize_t k = 0, blen = -1;
        if (e <= 0x7F) {
            v = e;
        } else if (e >= 0xE0) {
            v = (uint64_t)(int64_t)(int8_t)e;
        } else {
            switch (e) {
            case 0xCC: k = 1; break;
            case 0xCD: k = 2; break;
            case 0xCE: k = 4; break;
            case 0xCF: k = 8; break;
            case 0xD0: k = -1; break;
            case 0xD1: k = -2; break;
            case 0xD2: k = -4; break;
            case 0xD3: k = -8; break;
            case 0xC4: blen = 1; break;
            case 0xC5: blen = 2; break;
            case 0xC6: blen = 4; break;
            default: return -1; /* str, float, nil, bool, nested, ext: the general path */
            }
            if (blen > 0) { /* bin: big-endian, its last 8 bytes */
                if (at + blen > len) return -1;
                const Py_ssize_t bl = (Py_ssize_t)zmq_be(b + at, blen);
                at += blen;
                if (bl > len - at) return -1;
                const Py_ssize_t w = bl < 8 ? bl : 8;
                v = zmq_be(b + at + bl - w, w);
                at += bl;
            } else {
                const Py_ssize_t w = k < 0 ? -k : k;
                if (at + w > len) return -1;
                v = zmq_be(b + at, w);
                if (k < 0 && w < 8 && (v >> (8 * w - 1)) & 1) v |= ~(uint64_t)0 << (8 * w);
                at += w;
            }
        }
        out[i] = (int64_t)v;
    }
    return at == len ? n : -1;
}

/* zmq_keys(pend, out, events) -> (blocks, place), None, or the room needed.
 * pend: segments (.hashes: msgpack arrays, .codes: ints, medium << 8 | group << 1 | stored);
 * out: int64, C order, (3, room): rows keys, places, signs. Per block i: keys[i], places[i] =
 * medium << 8 | group, signs[i] = +1 / -1; place
 * is the one place of every block, or -1. events[2 * medium + stored] += 1 per event, only when
 * the whole call succeeds. An int (> the arrays' room): nothing done, grow them and call again. */
static PyObject *zmq_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "zmq_keys(pend: list, out, events)");
        return NULL;
    }
    PyObject *pend = args[0];
    Py_buffer vo, ve;
    if (kvcm_view(args[1], &vo, 8, 1, "out") < 0) return NULL;
    if (kvcm_view(args[2], &ve, 8, 1, "events") < 0) goto e1;
    PyObject *result = NULL;
    const Py_ssize_t room = vo.len / 24;
    int64_t *keys = vo.buf, *places = keys + room, *signs = keys + 2 * room, *events = ve.buf;
    if (ve.len / 8 < 512 || vo.len % 24) {
        PyErr_SetString(PyExc_ValueError, "zmq_keys: out is (3, room), events 512 entries");
        goto e4;
    }
    Py_ssize_t nb = 0, need = 0;
    int64_t place = -2;
    int fallback = 0;
    const Py_ssize_t ns = PyList_GET_SIZE(pend);
    for (Py_ssize_t s = 0; s < ns && !fallback; s++) {
        PyObject *seg = PyList_GET_ITEM(pend, s);
        PyObject *hashes = PyObject_GetAttr(seg, str_hashes);
        if (hashes == NULL) goto e4;
        PyObject *codes = PyObject_GetAttr(seg, str_codes);
        if (codes == NULL) {
            Py_DECREF(hashes);
            goto e4;
        }
        if (!PyList_Check(hashes) || !PyList_Check(codes) ||
            PyList_GET_SIZE(hashes) != PyList_GET_SIZE(codes)) {
            fallback = 1;
        }
        for (Py_ssize_t i = 0; !fallback && i < PyList_GET_SIZE(codes); i++) {
            const long long code = PyLong_AsLongLong(PyList_GET_ITEM(codes, i));
            if (code == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                fallback = 1;
                break;
            }
            if (code < 0 || code >= (1LL << 16)) {
                fallback = 1;
                break;
            }
            Py_buffer vh;
            if (PyObject_GetBuffer(PyList_GET_ITEM(hashes, i), &vh, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                fallback = 1;
                break;
            }
            Py_ssize_t got = zmq_array(vh.buf, vh.len, need ? NULL : keys + nb,
                                       need ? 0 : room - nb);
            if (got <= -2) { /* the arrays are short: count what is needed, write no more */
                need = need ? need - 2 - got : nb - 2 - got;
                got = 0;
            } else if (got == -1) {
                fallback = 1;
            } else if (need) {
                need += got;
                got = 0;
            }
            PyBuffer_Release(&vh);
            if (fallback) break;
            const int64_t p = (code >> 8) << 8 | ((code >> 1) & 0x7F);
            const int64_t sign = (code & 1) ? 1 : -1;
            for (Py_ssize_t j = 0; j < got; j++) {
                places[nb + j] = p;
                signs[nb + j] = sign;
            }
            if (got) place = place == -2 || place == p ? p : -1;
            nb += got;
        }
        Py_DECREF(hashes);
        Py_DECREF(codes);
    }
    if (fallback) {
        result = Py_NewRef(Py_None);
    } else if (need) {
        result = PyLong_FromSsize_t(need);
    } else {
        for (Py_ssize_t s = 0; s < ns; s++) { /* every code was read above: no error now */
            PyObject *codes = PyObject_GetAttr(PyList_GET_ITEM(pend, s), str_codes);
            if (codes == NULL) goto e4;
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(codes); i++) {
                const long long code = PyLong_AsLongLong(PyList_GET_ITEM(codes, i));
                events[((code >> 7) & ~1LL) | (code & 1)] += 1;
            }
            Py_DECREF(codes);
        }
        result = Py_BuildValue("nL", nb, (long long)(place == -2 ? -1 : place));
    }
e4:
    PyBuffer_Release(&ve);
e1:
    PyBuffer_Release(&vo);
    return result;
}

/* zmq_count(pos, signs, col, flags, out, bit) -> (flips, held delta): each event in order,
 * col[pos[i]] <- max(0, col[pos[i]] + signs[i]); then every position whose count went from 0
 * to positive or back, once, in first-touch order, into out[0][0:flips] (out: int64, C order,
 * (3, >= len(pos))) with out[1] / out[2] (set / clear masks) = bit / 0 (now held) or 0 / bit
 * (no longer). flags (u8, zeroed, >= len(col)) is scratch and left zeroed. */
static PyObject *zmq_count(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "zmq_count(pos, signs, col, flags, out, bit)");
        return NULL;
    }
    const long long bit = PyLong_AsLongLong(args[5]);
    if (bit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer vp, vs, vc, vf, vo;
    PyObject *result = NULL;
    if (kvcm_view(args[0], &vp, 8, 0, "pos") < 0) return NULL;
    if (kvcm_view(args[1], &vs, 8, 0, "signs") < 0) goto e1;
    if (kvcm_view(args[2], &vc, 8, 1, "col") < 0) goto e2;
    if (kvcm_view(args[3], &vf, 1, 1, "flags") < 0) goto e3;
    if (kvcm_view(args[4], &vo, 8, 1, "out") < 0) goto e4;
    const Py_ssize_t m = vp.len / 8, cols = vc.len / 8, row = vo.len / 24;
    const int64_t *pos = vp.buf, *sg = vs.buf;
    int64_t *col = vc.buf, *out = vo.buf, *set_m = out + row, *clr_m = out + 2 * row;
    uint8_t *flags = vf.buf;
    if (vs.len / 8 != m || vo.len % 24 || row < m || vf.len < cols) {
        PyErr_SetString(PyExc_ValueError, "zmq_count: arrays do not fit");
        goto e7;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (pos[i] < 0 || pos[i] >= cols) {
            PyErr_SetString(PyExc_IndexError, "zmq_count: a position beyond the counts");
            goto e7;
        }
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t p = pos[i];
        if (!flags[p]) {
            flags[p] = (uint8_t)(1 | (col[p] > 0) << 1);
            out[k++] = p;
        }
        const int64_t c = col[p] + sg[i];
        col[p] = c > 0 ? c : 0;
    }
    Py_ssize_t j = 0, held = 0;
    for (Py_ssize_t t = 0; t < k; t++) {
        const int64_t p = out[t];
        const int was = flags[p] >> 1, now = col[p] > 0;
        flags[p] = 0;
        if (was != now) {
            out[j] = p;
            set_m[j] = now ? bit : 0;
            clr_m[j] = now ? 0 : bit;
            held += now ? 1 : -1;
            j++;
        }
    }
    result = Py_BuildValue("nn", j, held);
e7:
    PyBuffer_Release(&vo);
e4:
    PyBuffer_Release(&vf);
e3:
    PyBuffer_Release(&vc);
e2:
    PyBuffer_Release(&vs);
e1:
    PyBuffer_Release(&vp);
    return result;
}

/* zmq_fold(events, known, hashes, codes, kept) -> how many events it took: EventDecoder._fold's
 * loop over a decoded batch's events while each is a block event whose (type, medium, group_idx,
 * block_size) `known` maps to a code >= 0: ev.block_hashes onto hashes, the code onto codes, the
 * event onto kept (unless None). It stops at the first other one (a clear, a drop, one not
 * seen yet): the caller goes on from there. */
static PyObject *zmq_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) ||
        !PyList_Check(args[2]) || !PyList_Check(args[3]) ||
        (args[4] != Py_None && !PyList_Check(args[4]))) {
        PyErr_SetString(PyExc_TypeError,
                        "zmq_fold(events: list, known: dict, hashes: list, codes: list, kept)");
        return NULL;
    }
    PyObject *events = args[0], *known = args[1], *hashes = args[2], *codes = args[3];
    PyObject *kept = args[4] == Py_None ? NULL : args[4];
    const Py_ssize_t n = PyList_GET_SIZE(events);
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        PyObject *what = PyTuple_New(4);
        if (what == NULL) return NULL;
        Py_INCREF(Py_TYPE(ev));
        PyTuple_SET_ITEM(what, 0, (PyObject *)Py_TYPE(ev));
        PyObject *const names[3] = {str_medium, str_group_idx, str_block_size};
        for (int k = 0; k < 3; k++) {
            PyObject *v = PyObject_GetAttr(ev, names[k]);
            if (v == NULL) {
                Py_DECREF(what);
                return NULL;
            }
            PyTuple_SET_ITEM(what, k + 1, v);
        }
        PyObject *code = PyDict_GetItemWithError(known, what); /* borrowed */
        Py_DECREF(what);
        if (code == NULL) {
            if (PyErr_Occurred()) return NULL;
            break;
        }
        const long cv = PyLong_Check(code) ? PyLong_AsLong(code) : -1;
        if (cv == -1 && PyErr_Occurred()) PyErr_Clear();
        if (cv < 0) break;
        Py_INCREF(code); /* owned while anything else runs */
        PyObject *h = PyObject_GetAttr(ev, str_block_hashes);
        if (h == NULL) {
            Py_DECREF(code);
            return NULL;
        }
        const int bad = PyList_Append(hashes, h) < 0 || PyList_Append(codes, code) < 0 ||
                        (kept != NULL && PyList_Append(kept, ev) < 0);
        Py_DECREF(h);
        Py_DECREF(code);
        if (bad) return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* zmtp_messages(buf, limit, max_frame) -> ([message: [frame: bytes]], [end: int]): the whole
 * ZMTP 3 messages at the start of `buf` (a bytearray), at most `limit`, each a list of its
 * frames, and the offset in `buf` where each ends (the caller drops the bytes of those it
 * handed over: all, or up to one whose handling raised). source/zmtp.py ZmtpSub._parse's loop
 * goes on from where this stops: before the message that holds a command frame, a frame over
 * `max_frame` bytes, or the end of `buf`. Nothing is consumed here; `buf` is only read. */
static PyObject *zmtp_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyByteArray_Check(args[0]) || !PyLong_Check(args[1]) ||
        !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "zmtp_messages(buf: bytearray, limit: int, max_frame: int)");
        return NULL;
    }
    const Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    const unsigned long long max_frame = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    const unsigned char *b = (const unsigned char *)PyByteArray_AS_STRING(args[0]);
    const Py_ssize_t end = PyByteArray_GET_SIZE(args[0]);
    PyObject *out = PyList_New(0), *ends = PyList_New(0);
    if (out == NULL || ends == NULL) goto fail;
    Py_ssize_t pos = 0; /* the end of the last whole message taken */
    while (PyList_GET_SIZE(out) < limit) {
        PyObject *frames = PyList_New(0);
        if (frames == NULL) goto fail;
        Py_ssize_t p = pos;
        int whole = 0;
        while (end - p >= 2) {
            const unsigned char flags = b[p];
            if (flags & 0x04) break; /* a command: the Python loop's */
            unsigned long long size;
            Py_ssize_t head;
            if (flags & 0x02) {
                if (end - p < 9) break;
                size = 0;
                for (int k = 1; k <= 8; k++) size = size << 8 | b[p + k];
                head = 9;
            } else {
                size = b[p + 1];
                head = 2;
            }
            if (size > max_frame || (unsigned long long)(end - p - head) < size) break;
            PyObject *f = PyBytes_FromStringAndSize((const char *)b + p + head, (Py_ssize_t)size);
            if (f == NULL || PyList_Append(frames, f) < 0) {
                Py_XDECREF(f);
                Py_DECREF(frames);
                goto fail;
            }
            Py_DECREF(f);
            p += head + (Py_ssize_t)size;
            if (!(flags & 0x01)) {
                whole = 1;
                break;
            }
        }
        if (!whole) {
            Py_DECREF(frames);
            break;
        }
        PyObject *end_at = PyLong_FromSsize_t(p);
        const int bad = end_at == NULL || PyList_Append(out, frames) < 0 ||
                        PyList_Append(ends, end_at) < 0;
        Py_XDECREF(end_at);
        Py_DECREF(frames);
        if (bad) goto fail;
        pos = p;
    }
    return Py_BuildValue("(NN)", out, ends);
fail:
    Py_XDECREF(out);
    Py_XDECREF(ends);
    return NULL;
}

static PyMethodDef zmq_methods[] = {
    {"zmtp_messages", (PyCFunction)(void (*)(void))zmtp_messages, METH_FASTCALL,
     "zmtp_messages(buf, limit, max_frame) -> (messages, their end offsets)"},
    {"zmq_keys", (PyCFunction)(void (*)(void))zmq_keys, METH_FASTCALL,
     "zmq_keys(pend, out, events) -> (blocks, place), None, or room needed"},
    {"zmq_count", (PyCFunction)(void (*)(void))zmq_count, METH_FASTCALL,
     "zmq_count(pos, signs, col, flags, out, bit) -> (flips, held delta)"},
    {"zmq_fold", (PyCFunction)(void (*)(void))zmq_fold, METH_FASTCALL,
     "zmq_fold(events, known, hashes, codes, kept) -> events taken"},
    {NULL, NULL, 0, NULL},
};

/* Adds the functions above to the module (PyInit__accel). */
static int kvcm_zmq_add(PyObject *mod) {
    if (str_hashes == NULL) {
        str_hashes = PyUnicode_InternFromString("hashes");
        str_codes = PyUnicode_InternFromString("codes");
        str_medium = PyUnicode_InternFromString("medium");
        str_group_idx = PyUnicode_InternFromString("group_idx");
        str_block_size = PyUnicode_InternFromString("block_size");
        str_block_hashes = PyUnicode_InternFromString("block_hashes");
        if (str_hashes == NULL || str_codes == NULL || str_medium == NULL ||
            str_group_idx == NULL || str_block_size == NULL || str_block_hashes == NULL)
            return -1;
    }
    return PyModule_AddFunctions(mod, zmq_methods);
}
/* ==== end of ZMQ source: fold of decoded batches ============================================ */

/* ---- ring read and key-state take/confirm (issue #26) ----------------------------------- */
/* At an engine's pace the sidecar reads ~130 records per flush window; with numpy the ring
 * read, the fold and the dirty queue's take and confirm cost ~40 numpy calls and ~20 Python
 * frames per window, each several microseconds on the cold caches of a wake-up. These do the
 * common case in one call each; reader.py / key_state.py keep the numpy forms as the
 * reference and the fallback (a case these decline, or a build without them). */
#define KIND_CLEARED 3

/* ring_copy(slots, start, n, base, out) -> (good, clears, max_medium)
 * Copies the n records at slot indexes start, start + 1, ... (wrapping at the capacity) into
 * out ((n, 4) u64), checking that record i carries seq base + i; stops at the first that does
 * not (good = records copied). Each slot's seq is loaded first (acquire), then its payload: the
 * producer writes the payload, then the seq (release), so a matching seq proves the payload.
 * clears: 1 if a copied record is a clear; max_medium: the highest medium index of the copied
 * records that are not clears (0 if none). */
static PyObject *ring_copy(PyObject *self, PyObject *args) {
    PyObject *o_slots, *o_out;
    Py_ssize_t start, n;
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "OnnKO", &o_slots, &start, &n, &base, &o_out)) return NULL;
    Py_buffer vs, vo;
    if (kvcm_view(o_slots, &vs, 8, 0, "slots") < 0) return NULL;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) {
        PyBuffer_Release(&vs);
        return NULL;
    }
    const Py_ssize_t cap = vs.len / 32;
    if (cap < 1 || (cap & (cap - 1)) || start < 0 || start >= cap || n < 0 || n > cap ||
        vo.len / 32 < n) {
        PyErr_SetString(PyExc_ValueError, "ring_copy: arrays do not fit the ring");
        PyBuffer_Release(&vo);
        PyBuffer_Release(&vs);
        return NULL;
    }
    uint64_t *slots = vs.buf, *out = vo.buf;
    const Py_ssize_t mask = cap - 1;
    Py_ssize_t good = 0;
    int clears = 0;
    unsigned max_medium = 0;
    for (Py_ssize_t i = 0; i < n; i += 2) /* two slots a line: the misses overlap */
        __builtin_prefetch(slots + 4 * ((start + i) & mask));
    for (; good < n; good++) {
        uint64_t *s = slots + 4 * ((start + good) & mask);
        const uint64_t seq = __atomic_load_n(&s[0], __ATOMIC_ACQUIRE);
        if (seq != base + (uint64_t)good) break;
        uint64_t *o = out + 4 * good;
        const uint64_t meta = s[2];
        o[0] = seq;
        o[1] = s[1];
        o[2] = meta;
        o[3] = s[3];
        if ((meta & 0xFF) == KIND_CLEARED)
            clears = 1;
        else if (((meta >> 16) & 0xFF) > max_medium)
            max_medium = (unsigned)((meta >> 16) & 0xFF);
    }
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vs);
    return Py_BuildValue("nii", good, clears, (int)max_medium);
}

/* fold_records(records, tkeys, tpos, dense, n, masks, acked, queued, required, out)
 *   -> None, or (new n, queued, published delta)
 * KeyTable.find(keys, insert=True) then fold_apply then mark_dirty, for (m, 4) u64 ring
 * records that are all stored/removed of medium 0 with groups < 61 (else None, before any
 * change; also None if an array is short or not contiguous: the caller's numpy path). New keys
 * take positions n, n + 1, ... in first-seen order with zeroed masks/acked/queued (the caller
 * made sure the index stays below its re-index point). The positions whose published state
 * changed and were not queued are queued and written to out, in order of first appearance.
 * queued = -1: a mask carried the fold's marks (bits 61, 62): the keys are in (new n is
 * right), nothing else changed, the caller folds with numpy. */
/* fold_records' checks of the records: all stored/removed, of medium 0, groups < 61. */
static inline int fold_records_ok(const uint64_t *rec, Py_ssize_t m) {
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint64_t meta = rec[4 * i + 2];
        const unsigned kind = (unsigned)(meta & 0xFF);
        if ((kind != KIND_STORED && kind != KIND_REMOVED) || ((meta >> 8) & 0xFF) >= 61 ||
            ((meta >> 16) & 0xFF) != 0)
            return 0;
    }
    return 1;
}

/* KeyTable.find(keys, insert=True) for keys[i * stride], i < m, into pos, with n + m below the
 * index's slots (so a slot is free for each): a new key's columns are zeroed (masks, acked,
 * queued and, when given, col). The index is cold after the event loop's sleep: a probe per
 * key in turn would wait for one cache miss after another, so every home slot is fetched
 * first. */
static void find_insert(const int64_t *keys, Py_ssize_t stride, Py_ssize_t m, int64_t *tkeys,
                        int64_t *tpos, int64_t *dense, Py_ssize_t *n, Py_ssize_t cap,
                        int64_t *masks, uint8_t *acked, uint8_t *queued, int64_t *col,
                        int64_t *pos) {
    int shift = 64;
    for (Py_ssize_t c = cap; c > 1; c >>= 1) shift--;
    const uint64_t smask = (uint64_t)cap - 1;
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint64_t h = ((uint64_t)keys[i * stride] * GOLDEN) >> shift;
        __builtin_prefetch(&tpos[h]);
        __builtin_prefetch(&tkeys[h]);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const Py_ssize_t before = *n;
        pos[i] = index_probe(keys[i * stride], tkeys, tpos, dense, n, smask, shift, 1);
        if (*n != before) {
            masks[before] = 0;
            acked[before] = 0;
            queued[before] = 0;
            if (col != NULL) col[before] = 0;
        }
    }
}

/* The fold of fold_records / ring_fold, for m checked records (fold_records_ok) and an index
 * with room (n + m < cap): 0 done (*n, *n_out, *delta set), 1 declined with the keys in (a
 * mask carried the fold's marks: *n set, nothing else changed), -1 out of memory (raised). */
static int fold_core(const uint64_t *rec, Py_ssize_t m, int64_t *tkeys, int64_t *tpos,
                     int64_t *dense, Py_ssize_t *n, Py_ssize_t cap, int64_t *masks,
                     uint8_t *acked, uint8_t *queued, int64_t req, int64_t *out,
                     Py_ssize_t *n_out, long long *delta) {
    int64_t *pos = PyMem_Malloc(m ? (size_t)m * 8 : 8);
    if (pos == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    find_insert((const int64_t *)rec + 1, 4, m, tkeys, tpos, dense, n, cap, masks, acked, queued,
                NULL, pos);
    for (Py_ssize_t i = 0; i < m; i++) { /* the keys' columns, fetched as the index was */
        __builtin_prefetch(&masks[pos[i]]);
        __builtin_prefetch(&queued[pos[i]]);
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (masks[pos[i]] & (FOLD_TOUCHED | FOLD_WAS)) {
            PyMem_Free(pos);
            return 1;
        }
    fold_mark(masks, pos, rec + 2, 4, m, req); /* fold_apply's passes */
    *delta = 0;
    *n_out = fold_settle(masks, pos, m, req, queued, out, delta);
    PyMem_Free(pos);
    return 0;
}

static PyObject *fold_records(PyObject *self, PyObject *args) {
    PyObject *o_rec, *o_tkeys, *o_tpos, *o_dense, *o_masks, *o_acked, *o_queued, *o_out;
    Py_ssize_t n;
    long long required;
    if (!PyArg_ParseTuple(args, "OOOOnOOOLO", &o_rec, &o_tkeys, &o_tpos, &o_dense, &n, &o_masks,
                          &o_acked, &o_queued, &required, &o_out))
        return NULL;
    Py_buffer vr;
    if (PyObject_GetBuffer(o_rec, &vr, PyBUF_CONTIG_RO) < 0) { /* a strided view: numpy's */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer vt, vp, vd, vk, va, vq, vo;
    PyObject *result = NULL;
    if (vr.itemsize != 8 || vr.len % 32) goto none0;
    if (kvcm_view(o_tkeys, &vt, 8, 1, "tkeys") < 0) goto r0;
    if (kvcm_view(o_tpos, &vp, 8, 1, "tpos") < 0) goto r1;
    if (kvcm_view(o_dense, &vd, 8, 1, "dense") < 0) goto r2;
    if (kvcm_view(o_masks, &vk, 8, 1, "masks") < 0) goto r3;
    if (kvcm_view(o_acked, &va, 1, 1, "acked") < 0) goto r4;
    if (kvcm_view(o_queued, &vq, 1, 1, "queued") < 0) goto r5;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) goto r6;
    const Py_ssize_t m = vr.len / 32, cap = vt.len / 8;
    const uint64_t *rec = vr.buf;
    const int64_t req = (int64_t)required;
    if (vp.len != vt.len || (cap & (cap - 1)) || cap < 2 || n < 0 || n + m >= cap ||
        vd.len / 8 < n + m || vk.len / 8 < n + m || va.len < n + m || vq.len < n + m ||
        vo.len / 8 < m || (req & (FOLD_TOUCHED | FOLD_WAS)) || req < 0 ||
        !fold_records_ok(rec, m))
        goto none;
    Py_ssize_t n_out = 0;
    long long delta = 0;
    const int r = fold_core(rec, m, vt.buf, vp.buf, vd.buf, &n, cap, vk.buf, va.buf, vq.buf,
                            req, vo.buf, &n_out, &delta);
    if (r >= 0) result = Py_BuildValue("nnL", n, r ? (Py_ssize_t)-1 : n_out, r ? 0LL : delta);
    goto r7;
none:
    result = Py_None;
    Py_INCREF(result);
r7:
    PyBuffer_Release(&vo);
r6:
    PyBuffer_Release(&vq);
r5:
    PyBuffer_Release(&va);
r4:
    PyBuffer_Release(&vk);
r3:
    PyBuffer_Release(&vd);
r2:
    PyBuffer_Release(&vp);
r1:
    PyBuffer_Release(&vt);
r0:
    PyBuffer_Release(&vr);
    return result;
none0:
    PyBuffer_Release(&vr);
    Py_RETURN_NONE;
}

/* The buffers of ring_fold / count_fold, taken in order: on a failure those taken are released
 * and -1 returned (raised); views_release gives back all n. */
typedef struct {
    Py_ssize_t itemsize;
    int writable;
    const char *what;
} ViewSpec;

static int views_take(PyObject *const *objs, const ViewSpec *spec, Py_buffer *v, int n) {
    for (int i = 0; i < n; i++)
        if (kvcm_view(objs[i], &v[i], spec[i].itemsize, spec[i].writable, spec[i].what) < 0) {
            while (i-- > 0) PyBuffer_Release(&v[i]);
            return -1;
        }
    return 0;
}

static void views_release(Py_buffer *v, int n) {
    while (n-- > 0) PyBuffer_Release(&v[n]);
}

/* More ring header words (layout.py; tests/unit/test_accel.py compares). */
#define W_DROPPED 9
#define W_READER_LIVENESS_NS 19
#define W_INC_GEN 24

/* ring_fold(hdr, slots, head, base, gen, dropped, room, tkeys, tpos, dense, n, masks, acked,
 *           queued, required, out, res) -> True with res (int64, 4 entries) = (m records
 *           folded, 0: none there; new n; queued; published delta), written in place so that
 *           nothing can fail once the table changed; None: declined, nothing read (the
 *           caller's read() path).
 * A steady-state read of the ring (reader.py RingReader.read) and its fold (fold_records) in
 * one call: the tail is loaded first, then the incarnation generation, which must still be
 * `gen` (even), and the drop counter, still `dropped`; the records from `head` (carrying seqs
 * base, base + 1, ...) must all be valid, stored/removed of medium 0 with groups < 61, at
 * most `room` of them (the index's re-index point) and fit the table (n + m < slots). Then the
 * reader's liveness is stamped and they are folded as fold_records does; the caller advances
 * W_HEAD once it has queued what the fold returned (so nothing can free their slots for the
 * producer before the fold's result is held). Declined after the keys went in (fold_records'
 * queued = -1): (m, new n, -1, 0); the caller reads them again through its own path. out
 * holds at least the ring's capacity (m records at most). */
static PyObject *ring_fold(PyObject *self, PyObject *args) {
    PyObject *o_hdr, *o_slots, *o_tkeys, *o_tpos, *o_dense, *o_masks, *o_acked, *o_queued,
        *o_out, *o_res;
    unsigned long long head, base, gen, dropped;
    Py_ssize_t room, n;
    long long required;
    if (!PyArg_ParseTuple(args, "OOKKKKnOOOnOOOLOO", &o_hdr, &o_slots, &head, &base, &gen,
                          &dropped, &room, &o_tkeys, &o_tpos, &o_dense, &n, &o_masks, &o_acked,
                          &o_queued, &required, &o_out, &o_res))
        return NULL;
    enum { HDR, SLOTS, TKEYS, TPOS, DENSE, MASKS, ACKED, QUEUED, OUT, RES, NV };
    static const ViewSpec spec[NV] = {
        {8, 1, "hdr"},
        {8, 0, "slots"},
        {8, 1, "tkeys"},
        {8, 1, "tpos"},
        {8, 1, "dense"},
        {8, 1, "masks"},
        {1, 1, "acked"},
        {1, 1, "queued"},
        {8, 1, "out"},
        {8, 1, "res"},
    };
    PyObject *const objs[NV] = {o_hdr,   o_slots, o_tkeys,  o_tpos, o_dense,
                                o_masks, o_acked, o_queued, o_out,  o_res};
    Py_buffer v[NV];
    PyObject *result = NULL;
    if (views_take(objs, spec, v, NV) < 0) return NULL;
    volatile uint64_t *hdr = v[HDR].buf;
    const uint64_t *slots = v[SLOTS].buf;
    const Py_ssize_t rcap = v[SLOTS].len / 32, cap = v[TKEYS].len / 8;
    const int64_t req = (int64_t)required;
    int64_t *res = v[RES].buf;
    if (v[HDR].len / 8 <= W_INC_GEN || rcap < 1 || (rcap & (rcap - 1)) ||
        v[OUT].len / 8 < rcap || v[RES].len / 8 < 4 || v[TPOS].len != v[TKEYS].len ||
        (cap & (cap - 1)) || cap < 2 || n < 0 || (req & (FOLD_TOUCHED | FOLD_WAS)) || req < 0 ||
        base < 1 || (gen & 1))
        goto none;
    /* The tail before the incarnation (reader.py's invariant), each load an acquire. */
    const uint64_t tail = __atomic_load_n((uint64_t *)&hdr[W_TAIL], __ATOMIC_ACQUIRE);
    if (__atomic_load_n((uint64_t *)&hdr[W_INC_GEN], __ATOMIC_ACQUIRE) != gen ||
        __atomic_load_n((uint64_t *)&hdr[W_DROPPED], __ATOMIC_ACQUIRE) != dropped)
        goto none;
    const uint64_t m64 = tail - head;
    if (m64 > (uint64_t)rcap || (Py_ssize_t)m64 > room) goto none; /* also tail < head */
    const Py_ssize_t m = (Py_ssize_t)m64;
    if (n + m >= cap || v[DENSE].len / 8 < n + m || v[MASKS].len / 8 < n + m ||
        v[ACKED].len < n + m || v[QUEUED].len < n + m)
        goto none;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns(): the reader is alive */
    if (m == 0) {
        hdr[W_READER_LIVENESS_NS] = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        res[0] = 0;
        res[1] = n;
        res[2] = 0;
        res[3] = 0;
        result = Py_True;
        Py_INCREF(result);
        goto done;
    }
    uint64_t *rec = PyMem_Malloc((size_t)m * 32);
    if (rec == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const Py_ssize_t mask = rcap - 1, start = (Py_ssize_t)(head & (uint64_t)mask);
    for (Py_ssize_t i = 0; i < m; i += 2) /* two slots a line: the misses overlap */
        __builtin_prefetch(slots + 4 * ((start + i) & mask));
    for (Py_ssize_t i = 0; i < m; i++) { /* ring_copy: the seq (acquire), then the payload */
        const uint64_t *sl = slots + 4 * ((start + i) & mask);
        const uint64_t seq = __atomic_load_n(&sl[0], __ATOMIC_ACQUIRE);
        if (seq != base + (uint64_t)i) {
            PyMem_Free(rec);
            goto none;
        }
        uint64_t *o = rec + 4 * i;
        o[0] = seq;
        o[1] = sl[1];
        o[2] = sl[2];
        o[3] = sl[3];
    }
    if (!fold_records_ok(rec, m)) {
        PyMem_Free(rec);
        goto none;
    }
    Py_ssize_t n_out = 0;
    long long delta = 0;
    const int r = fold_core(rec, m, v[TKEYS].buf, v[TPOS].buf, v[DENSE].buf, &n, cap,
                            v[MASKS].buf, v[ACKED].buf, v[QUEUED].buf, req, v[OUT].buf, &n_out,
                            &delta);
    PyMem_Free(rec);
    if (r < 0) goto done;
    hdr[W_READER_LIVENESS_NS] = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    res[0] = m;
    res[1] = n;
    res[2] = r ? -1 : n_out;
    res[3] = r ? 0 : delta;
    result = Py_True;
    Py_INCREF(result);
    goto done;
none:
    result = Py_None;
    Py_INCREF(result);
done:
    views_release(v, NV);
    return result;
}

/* count_fold(keys, signs, tkeys, tpos, dense, n, room, col, flags, masks, acked, queued,
 *            required, bit, out, res) -> None, or True with res (int64, 4 entries) = (new n,
 *            queued, held delta, published delta): written in place, so once the tables have
 *            changed nothing can fail (no object to build)
 * The ZMQ source's fold of one (medium, group)'s block events (block_counts.py _apply_one) in
 * one call: KeyTable.find(keys, insert=True), zmq_count's clamped walk of `col` (the group's
 * store counts) in arrival order, then bits_apply of the positions whose count went from 0 to
 * positive (set `bit` in masks) or back (clear it): each such position whose published state
 * ((mask & required) == required) flipped counts in the delta and, if not queued yet, is
 * queued and written to out, in first-touch order. None, before any change: at most `room`
 * keys may be new (the index's re-index point), the table must hold n + len(keys) (index and
 * every column), `required` must not carry the marks' bits. flags (u8, zeroed, >= the table's
 * columns) is scratch and left zeroed; out holds len(keys). */
static PyObject *count_fold(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_signs, *o_tkeys, *o_tpos, *o_dense, *o_col, *o_flags, *o_masks,
        *o_acked, *o_queued, *o_out, *o_res;
    Py_ssize_t n, room;
    long long required, bit;
    if (!PyArg_ParseTuple(args, "OOOOOnnOOOOOLLOO", &o_keys, &o_signs, &o_tkeys, &o_tpos,
                          &o_dense, &n, &room, &o_col, &o_flags, &o_masks, &o_acked, &o_queued,
                          &required, &bit, &o_out, &o_res))
        return NULL;
    enum { KEYS, SIGNS, TKEYS, TPOS, DENSE, COL, FLAGS, MASKS, ACKED, QUEUED, OUT, RES, NV };
    static const ViewSpec spec[NV] = {
        {8, 0, "keys"},
        {8, 0, "signs"},
        {8, 1, "tkeys"},
        {8, 1, "tpos"},
        {8, 1, "dense"},
        {8, 1, "col"},
        {1, 1, "flags"},
        {8, 1, "masks"},
        {1, 1, "acked"},
        {1, 1, "queued"},
        {8, 1, "out"},
        {8, 1, "res"},
    };
    PyObject *const objs[NV] = {o_keys, o_signs, o_tkeys, o_tpos,   o_dense, o_col,
                                o_flags, o_masks, o_acked, o_queued, o_out, o_res};
    Py_buffer v[NV];
    PyObject *result = NULL;
    if (views_take(objs, spec, v, NV) < 0) return NULL;
    const Py_ssize_t m = v[KEYS].len / 8, cap = v[TKEYS].len / 8, need = n + m;
    const int64_t req = (int64_t)required;
    if (v[SIGNS].len / 8 != m || v[OUT].len / 8 < m || v[RES].len / 8 < 4 || m > room ||
        v[TPOS].len != v[TKEYS].len || (cap & (cap - 1)) || cap < 2 || n < 0 || need >= cap ||
        v[DENSE].len / 8 < need || v[COL].len / 8 < need || v[FLAGS].len < need ||
        v[MASKS].len / 8 < need || v[ACKED].len < need || v[QUEUED].len < need ||
        (req & (FOLD_TOUCHED | FOLD_WAS)) || req < 0 || bit <= 0 || (bit & (bit - 1)) ||
        (bit & (FOLD_TOUCHED | FOLD_WAS)))
        goto none;
    const int64_t *keys = v[KEYS].buf, *sg = v[SIGNS].buf;
    int64_t *tkeys = v[TKEYS].buf, *tpos = v[TPOS].buf, *dense = v[DENSE].buf;
    int64_t *col = v[COL].buf, *masks = v[MASKS].buf;
    int64_t *out = v[OUT].buf;
    uint8_t *flags = v[FLAGS].buf, *acked = v[ACKED].buf, *queued = v[QUEUED].buf;
    int64_t *pos = PyMem_Malloc(m ? (size_t)m * 8 : 8);
    if (pos == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    find_insert(keys, 1, m, tkeys, tpos, dense, &n, cap, masks, acked, queued, col, pos);
    /* zmq_count's walk: touched positions in first-touch order, each count clamped at 0 */
    Py_ssize_t touched = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t p = pos[i];
        if (!flags[p]) {
            flags[p] = (uint8_t)(1 | (col[p] > 0) << 1);
            out[touched++] = p;
        }
        const int64_t c = col[p] + sg[i];
        col[p] = c > 0 ? c : 0;
    }
    PyMem_Free(pos);
    /* bits_apply of the flipped ones (each once): set or clear `bit`, queue a published flip */
    Py_ssize_t k = 0, held = 0;
    long long delta = 0;
    for (Py_ssize_t t = 0; t < touched; t++) {
        const int64_t p = out[t];
        const int was = flags[p] >> 1, now = col[p] > 0;
        flags[p] = 0;
        if (was == now) continue;
        held += now ? 1 : -1;
        const int64_t old = masks[p], nm = now ? (old | bit) : (old & ~bit);
        const int was_pub = (old & req) == req, now_pub = (nm & req) == req;
        masks[p] = nm;
        delta += now_pub - was_pub;
        if (was_pub != now_pub && !queued[p]) {
            queued[p] = 1;
            out[k++] = p; /* k <= t: written behind the read */
        }
    }
    int64_t *res = v[RES].buf;
    res[0] = n;
    res[1] = k;
    res[2] = held;
    res[3] = delta;
    result = Py_True;
    Py_INCREF(result);
    goto done;
none:
    result = Py_None;
    Py_INCREF(result);
done:
    views_release(v, NV);
    return result;
}

/* take_queue(queue, masks, acked, queued, dense, required, limit, out_pos, out_keys, out_pub,
 *            split) -> (taken, adds, chunks done, offset in the next chunk, consumed)
 * (out_pub may be None with `split`: the first `adds` taken are the adds)
 * _Tier.take: the dirty queue (a list of int64 position arrays, oldest first) is consumed
 * position by position (queued[p] = 0) until `limit` positions whose published state
 * ((masks[p] & required) == required) differs from acked[p] are taken, or it ends. The taken
 * go to out_pos / out_keys (dense[p]) / out_pub in queue order; with `split`, adds first then
 * deletes, each in queue order (take_batch's stable order). The caller drops the chunks done
 * and the first `offset` positions of the next one. The list is not changed here. */
static PyObject *take_queue(PyObject *self, PyObject *args) {
    PyObject *o_queue, *o_masks, *o_acked, *o_queued, *o_dense, *o_pos, *o_keys, *o_pub;
    long long required;
    Py_ssize_t limit;
    int split;
    if (!PyArg_ParseTuple(args, "O!OOOOLnOOOp", &PyList_Type, &o_queue, &o_masks, &o_acked,
                          &o_queued, &o_dense, &required, &limit, &o_pos, &o_keys, &o_pub,
                          &split))
        return NULL;
    Py_buffer vk, va, vq, vd, vp, vy, vb;
    PyObject *result = NULL;
    if (kvcm_view(o_masks, &vk, 8, 0, "masks") < 0) return NULL;
    if (kvcm_view(o_acked, &va, 1, 0, "acked") < 0) goto t1;
    if (kvcm_view(o_queued, &vq, 1, 1, "queued") < 0) goto t2;
    if (kvcm_view(o_dense, &vd, 8, 0, "dense") < 0) goto t3;
    if (kvcm_view(o_pos, &vp, 8, 1, "out_pos") < 0) goto t4;
    if (kvcm_view(o_keys, &vy, 8, 1, "out_keys") < 0) goto t5;
    int no_pub = o_pub == Py_None && split; /* the caller knows: the first `adds` are adds */
    if (no_pub) {
        vb.buf = NULL;
        vb.len = limit;
        vb.obj = NULL;
    } else if (kvcm_view(o_pub, &vb, 1, 1, "out_pub") < 0)
        goto t6;
    const int64_t *masks = vk.buf, *dense = vd.buf;
    const uint8_t *acked = va.buf;
    uint8_t *queued = vq.buf, *opub = vb.buf;
    int64_t *opos = vp.buf, *okeys = vy.buf;
    const int64_t req = (int64_t)required;
    Py_ssize_t cols = vk.len / 8;
    if (va.len < cols) cols = va.len;
    if (vq.len < cols) cols = vq.len;
    if (vd.len / 8 < cols) cols = vd.len / 8;
    if (limit < 0 || vp.len / 8 < limit || vy.len / 8 < limit || vb.len < limit) {
        PyErr_SetString(PyExc_ValueError, "take_queue: outputs shorter than the limit");
        goto t7;
    }
    int64_t *dels = NULL; /* split: the deletes' positions, until the adds are all out */
    if (split && limit) {
        dels = PyMem_Malloc((size_t)limit * 8);
        if (dels == NULL) {
            PyErr_NoMemory();
            goto t7;
        }
    }
    Py_ssize_t got = 0, adds = 0, ndel = 0, consumed = 0, done = 0, offset = 0;
    const Py_ssize_t chunks = PyList_GET_SIZE(o_queue);
    int bad = 0;
    while (done < chunks && got < limit) {
        Py_buffer vc;
        if (kvcm_view(PyList_GET_ITEM(o_queue, done), &vc, 8, 0, "queue") < 0) {
            bad = 1;
            break;
        }
        const int64_t *c = vc.buf;
        const Py_ssize_t len = vc.len / 8;
        for (Py_ssize_t j = 0; j < len && j < 2 * (limit - got); j++) { /* the misses overlap */
            const int64_t p = c[j];
            if (p >= 0 && p < cols) {
                __builtin_prefetch(&masks[p]);
                __builtin_prefetch(&acked[p]);
                __builtin_prefetch(&queued[p]);
                __builtin_prefetch(&dense[p]);
            }
        }
        Py_ssize_t i = 0;
        for (; i < len && got < limit; i++) {
            const int64_t p = c[i];
            if (p < 0 || p >= cols) {
                PyErr_SetString(PyExc_IndexError, "take_queue: a queued position beyond the columns");
                bad = 1;
                break;
            }
            queued[p] = 0;
            consumed++;
            const int pub = (masks[p] & req) == req;
            if (pub == (acked[p] != 0)) continue; /* never re-send an unchanged key */
            got++;
            if (!split) {
                opos[got - 1] = p;
                okeys[got - 1] = dense[p];
                opub[got - 1] = (uint8_t)pub;
            } else if (pub) {
                opos[adds] = p;
                okeys[adds] = dense[p];
                if (opub) opub[adds] = 1;
                adds++;
            } else {
                dels[ndel++] = p;
            }
        }
        PyBuffer_Release(&vc);
        if (bad) break;
        if (i < len) {
            offset = i;
            break;
        }
        done++;
    }
    if (!bad) {
        for (Py_ssize_t j = 0; j < ndel; j++) {
            opos[adds + j] = dels[j];
            okeys[adds + j] = dense[dels[j]];
            if (opub) opub[adds + j] = 0;
        }
        result = Py_BuildValue("nnnnn", got, split ? adds : (Py_ssize_t)0, done, offset, consumed);
    }
    PyMem_Free(dels);
t7:
    if (!no_pub) PyBuffer_Release(&vb);
t6:
    PyBuffer_Release(&vy);
t5:
    PyBuffer_Release(&vp);
t4:
    PyBuffer_Release(&vd);
t3:
    PyBuffer_Release(&vq);
t2:
    PyBuffer_Release(&va);
t1:
    PyBuffer_Release(&vk);
    return result;
}

/* confirm_run(pos, adds, masks, acked, queued, required, out) -> (queued, acked delta)
 * _Tier.confirm_all for a batch whose first `adds` positions were sent as adds and the rest
 * as deletes: acked[p] = sent state; a position whose published state differs from what was
 * sent (it changed again in flight) and is not queued is queued and written to out, in order. */
static PyObject *confirm_run(PyObject *self, PyObject *args) {
    PyObject *o_pos, *o_masks, *o_acked, *o_queued, *o_out;
    Py_ssize_t adds;
    long long required;
    if (!PyArg_ParseTuple(args, "OnOOOLO", &o_pos, &adds, &o_masks, &o_acked, &o_queued,
                          &required, &o_out))
        return NULL;
    Py_buffer vp, vk, va, vq, vo;
    PyObject *result = NULL;
    if (kvcm_view(o_pos, &vp, 8, 0, "pos") < 0) return NULL;
    if (kvcm_view(o_masks, &vk, 8, 0, "masks") < 0) goto c1;
    if (kvcm_view(o_acked, &va, 1, 1, "acked") < 0) goto c2;
    if (kvcm_view(o_queued, &vq, 1, 1, "queued") < 0) goto c3;
    if (kvcm_view(o_out, &vo, 8, 1, "out") < 0) goto c4;
    const Py_ssize_t m = vp.len / 8;
    const int64_t *pos = vp.buf, *masks = vk.buf;
    uint8_t *acked = va.buf, *queued = vq.buf;
    int64_t *out = vo.buf;
    const int64_t req = (int64_t)required;
    Py_ssize_t cols = vk.len / 8;
    if (va.len < cols) cols = va.len;
    if (vq.len < cols) cols = vq.len;
    if (vo.len / 8 < m || adds < 0 || adds > m) {
        PyErr_SetString(PyExc_ValueError, "confirm_run: arrays do not fit");
        goto c5;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (pos[i] < 0 || pos[i] >= cols) {
            PyErr_SetString(PyExc_IndexError, "confirm_run: a position beyond the columns");
            goto c5;
        }
        __builtin_prefetch(&masks[pos[i]]);
        __builtin_prefetch(&acked[pos[i]]);
        __builtin_prefetch(&queued[pos[i]]);
    }
    Py_ssize_t n_out = 0;
    long long delta = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t p = pos[i];
        const int pub = i < adds;
        delta += pub - (acked[p] != 0);
        acked[p] = (uint8_t)pub;
        if (((masks[p] & req) == req) != pub && !queued[p]) {
            queued[p] = 1;
            out[n_out++] = p;
        }
    }
    result = Py_BuildValue("nL", n_out, delta);
c5:
    PyBuffer_Release(&vo);
c4:
    PyBuffer_Release(&vq);
c3:
    PyBuffer_Release(&va);
c2:
    PyBuffer_Release(&vk);
c1:
    PyBuffer_Release(&vp);
    return result;
}
/* ---- end of ring read and key-state take/confirm ---------------------------------------- */

static PyMethodDef methods[] = {
    {"words", words, METH_O, "words(keys: list) -> array('Q') of KVCM's signed bit pattern"},
    {"put_runs", (PyCFunction)(void (*)(void))put_runs, METH_FASTCALL,
     "put_runs(runs, words, hdr, start, room, seq, attempted, tail) -> records"},
    {"find", find, METH_VARARGS, "find(ukeys, tkeys, tpos, dense, out, n, insert) -> new n, or -1 - n if full"},
    {"apply", apply, METH_VARARGS, "apply(pos, metas, masks): group bits set/cleared in order"},
    {"rolling", rolling, METH_VARARGS, "rolling(tokens, block_size, h, pending, out) -> (h, pending, keys)"},
    {"roll_list", roll_list, METH_VARARGS, "roll_list(tokens, block_size, h, pending) -> (h, pending, [keys])"},
    {"fold_apply", fold_apply, METH_VARARGS,
     "fold_apply(pos, metas, masks, required, out) -> (changed, published delta) or None"},
    {"digits", digits, METH_VARARGS, "digits(buf, at, width, col, keys): 20 decimal digits per key"},
    /* ring read and key-state take/confirm */
    {"ring_copy", ring_copy, METH_VARARGS, "ring_copy(slots, start, n, base, out) -> (good, clears, max_medium)"},
    {"fold_records", fold_records, METH_VARARGS,
     "fold_records(records, tkeys, tpos, dense, n, masks, acked, queued, required, out) -> (n, queued, delta) or None"},
    {"ring_fold", ring_fold, METH_VARARGS,
     "ring_fold(hdr, slots, head, base, gen, dropped, room, tkeys, tpos, dense, n, masks, acked, queued, required, out, res) -> True (res: m, n, queued, delta) or None"},
    {"count_fold", count_fold, METH_VARARGS,
     "count_fold(keys, signs, tkeys, tpos, dense, n, room, col, flags, masks, acked, queued, required, bit, out, res) -> True (res: n, queued, held, delta) or None"},
    {"take_queue", take_queue, METH_VARARGS,
     "take_queue(queue, masks, acked, queued, dense, required, limit, pos, keys, pub, split) -> (taken, adds, done, offset, consumed)"},
    {"confirm_run", confirm_run, METH_VARARGS, "confirm_run(pos, adds, masks, acked, queued, required, out) -> (queued, delta)"},
    {NULL, NULL, 0, NULL},
};

/* The rolling key table and the re-keying (issue #22 §5) live in _rekey.c, compiled into this
 * module: it adds its type here. */
int kvcm_rekey_add(PyObject *mod);
/* A delta request's body (kvcm_client/wire.py encode_batch) lives in _wire.c. */
int kvcm_wire_add(PyObject *mod);
/* A key-state tier's group bits at known positions (key_state.py apply_bits_at): _bits.c. */
int kvcm_bits_add(PyObject *mod);

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_accel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__accel(void) {
    if (two_to_64 == NULL) {
        two_to_64 = PyLong_FromString("18446744073709551616", NULL, 10);
        if (two_to_64 == NULL) return NULL;
    }
    if (array_type == NULL) { /* array.array, and array('Q', [0]) to repeat */
        PyObject *array = PyImport_ImportModule("array");
        if (array == NULL) return NULL;
        array_type = (PyTypeObject *)PyObject_GetAttrString(array, "array");
        word_array = array_type ? PyObject_CallFunction((PyObject *)array_type, "s[i]", "Q", 0)
                                : NULL;
        Py_DECREF(array);
        if (word_array == NULL) {
            Py_CLEAR(array_type);
            return NULL;
        }
        /* array.append's C function, if it is the plain METH_O one (else: called by name) */
        PyObject *d = PyObject_GetAttrString((PyObject *)array_type, "append");
        if (d == NULL) return NULL;
        if (Py_IS_TYPE(d, &PyMethodDescr_Type) &&
            ((PyMethodDescrObject *)d)->d_method->ml_flags == METH_O)
            array_append_fn = ((PyMethodDescrObject *)d)->d_method->ml_meth;
        Py_DECREF(d);
    }
    if (str_append == NULL) {
        str_append = PyUnicode_InternFromString("append");
        kw_group = PyUnicode_InternFromString("group");
        kw_medium = PyUnicode_InternFromString("medium");
        int_zero = PyLong_FromLong(0);
        str_dtype = PyUnicode_InternFromString("dtype");
        str_ravel = PyUnicode_InternFromString("ravel");
        str_view = PyUnicode_InternFromString("view");
        str_copy = PyUnicode_InternFromString("copy");
        str_astype = PyUnicode_InternFromString("astype");
        if (str_append == NULL || kw_group == NULL || kw_medium == NULL || int_zero == NULL ||
            str_dtype == NULL || str_ravel == NULL || str_view == NULL || str_copy == NULL ||
            str_astype == NULL)
            return NULL;
    }
    if (PyType_Ready(&RunQueueType) < 0 || PyType_Ready(&PublisherType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "RunQueue", (PyObject *)&RunQueueType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
#ifndef Py_GIL_DISABLED /* Publisher.flush needs the GIL's exclusion (see above) */
    if (PyModule_AddObjectRef(mod, "Publisher", (PyObject *)&PublisherType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
#endif
    if (PyModule_AddIntConstant(mod, "KIND_STORED", KIND_STORED) < 0 ||
        PyModule_AddIntConstant(mod, "KIND_REMOVED", KIND_REMOVED) < 0 ||
        PyModule_AddIntConstant(mod, "KIND_CLEARED", KIND_CLEARED) < 0 ||
        PyModule_AddIntConstant(mod, "W_TAIL", W_TAIL) < 0 ||
        PyModule_AddIntConstant(mod, "W_LAST_SEQ", W_LAST_SEQ) < 0 ||
        PyModule_AddIntConstant(mod, "W_ATTEMPTED", W_ATTEMPTED) < 0 ||
        PyModule_AddIntConstant(mod, "HEADER_WORDS", HEADER_WORDS) < 0 ||
        PyModule_AddIntConstant(mod, "W_CAPACITY", W_CAPACITY) < 0 ||
        PyModule_AddIntConstant(mod, "W_HEAD", W_HEAD) < 0 ||
        PyModule_AddIntConstant(mod, "W_DROPPED", W_DROPPED) < 0 ||
        PyModule_AddIntConstant(mod, "W_READER_LIVENESS_NS", W_READER_LIVENESS_NS) < 0 ||
        PyModule_AddIntConstant(mod, "W_INC_GEN", W_INC_GEN) < 0 ||
        PyModule_AddIntConstant(mod, "W_HEAD_SEEN", W_HEAD_SEEN) < 0 ||
        PyModule_AddIntConstant(mod, "W_READER_IDLE", W_READER_IDLE) < 0 ||
        PyModule_AddIntConstant(mod, "AFTER_RING", AFTER_RING) < 0 ||
        PyModule_AddIntConstant(mod, "AFTER_POST", AFTER_POST) < 0 ||
        PyModule_AddIntConstant(mod, "AFTER_FOLD", AFTER_FOLD) < 0 ||
        PyModule_AddIntConstant(mod, "ABI", ACCEL_ABI) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    if (kvcm_rekey_add(mod) < 0 || kvcm_wire_add(mod) < 0 || kvcm_bits_add(mod) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    if (kvcm_zmq_add(mod) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
