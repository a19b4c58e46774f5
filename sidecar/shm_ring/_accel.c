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
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* Raised with every change to a signature or behaviour here; compiled.py uses the module only
 * if it equals its own ACCEL_ABI, so a stale in-place build is never called with the wrong
 * arguments (it falls back to the numpy / Python forms instead). */
#define ACCEL_ABI 5
#define GOLDEN 0x9E3779B97F4A7C15ULL
/* Must equal sidecar/shm_ring/layout.py's KIND_STORED / KIND_REMOVED (a test compares). */
#define KIND_STORED 1
#define KIND_REMOVED 2

static int get(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
               const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_CONTIG : PyBUF_CONTIG_RO) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", what,
                     view->itemsize, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
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
    if (get(o_keys, &vk, 8, 0, "keys") < 0) return NULL;
    if (get(o_tkeys, &vt, 8, 1, "tkeys") < 0) goto e1;
    if (get(o_tpos, &vp, 8, 1, "tpos") < 0) goto e2;
    if (get(o_dense, &vd, 8, 1, "dense") < 0) goto e3;
    if (get(o_out, &vo, 8, 1, "out") < 0) goto e4;
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
        const int64_t key = keys[i];
        uint64_t s = ((uint64_t)key * GOLDEN) >> shift;
        Py_ssize_t probes = 0;
        for (;;) {
            const int64_t p = tpos[s];
            if (p == 0) {
                if (!insert) {
                    out[i] = -1;
                } else { /* an empty slot: fewer than cap keys, room for one more */
                    tpos[s] = n + 1;
                    tkeys[s] = key;
                    dense[n] = key;
                    out[i] = n++;
                }
                break;
            }
            if (tkeys[s] == key) {
                out[i] = p - 1;
                break;
            }
            if (++probes >= cap) { /* every slot used and none holds the key */
                full = 1;
                break;
            }
            s = (s + 1) & mask;
        }
        if (full) break;
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
    if (get(o_pos, &vp, 8, 0, "pos") < 0) return NULL;
    if (get(o_metas, &vm, 8, 0, "metas") < 0) goto e1;
    if (get(o_masks, &vk, 4, 1, "masks") < 0) goto e2;
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
#define W_TAIL 8
#define W_LAST_SEQ 10
#define W_ATTEMPTED 12
#define HEADER_WORDS 512

/* An exact int key in [-2^63, 2^64) as its u64 word (KVCM's signed bit pattern: a negative
 * key wraps): 1, or 0 with no exception set if out of range. */
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

/* put_runs(runs, words, hdr, start, room, seq, attempted, tail) -> records written, -1 or
 * -2 - records. runs: the hook's staged list of (keys, meta int), keys an array('Q') or one
 * int key in [-2^63, 2^64) (a negative one, KVCM's signed spelling, wraps). If every item is
 * one of those and their records fit in `room` slots from slot `start` (the caller rules out a
 * wrap and a full ring), record i goes to slot start + i of `words` (the ring's slots as u64
 * words: seq, key, meta, parent) with seq = seq + 1 + i, the seq words after the payload (a
 * slot is valid once its seq matches), then the header: attempted and last seq, and last the
 * tail (the publishing store). -1: an item is something else; -2 - n: n records do not fit;
 * in both cases nothing is written. METH_FASTCALL: argument tuples and format parsing cost
 * microseconds on the caches an engine's step leaves cold. */
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
    const unsigned long long seq = word[0], attempted = word[1], tail = word[2];
    const Py_ssize_t nr = PyList_GET_SIZE(runs);
    Py_buffer small_views[8];
    uint64_t small_metas[8], small_keys[8];
    Py_buffer *views = small_views;
    uint64_t *metas = small_metas, *keys = small_keys; /* keys: of single-key items */
    if (nr > 8) {
        views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)nr);
        metas = PyMem_Malloc(sizeof(uint64_t) * (size_t)nr);
        keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)nr);
        if (views == NULL || metas == NULL || keys == NULL) {
            PyMem_Free(views);
            PyMem_Free(metas);
            PyMem_Free(keys);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t got = 0, total = 0;
    int bad = 0;
    for (; got < nr; got++) {
        PyObject *it = PyList_GET_ITEM(runs, got);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 2) {
            bad = 1;
            break;
        }
        PyObject *kw = PyTuple_GET_ITEM(it, 0), *mo = PyTuple_GET_ITEM(it, 1);
        const uint64_t meta = PyLong_CheckExact(mo) ? PyLong_AsUnsignedLongLong(mo) : 0;
        if (!PyLong_CheckExact(mo) || (meta == (uint64_t)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            bad = 1;
            break;
        }
        Py_buffer *v = &views[got];
        if (PyLong_CheckExact(kw)) { /* one key staged alone (not a bool: not exact) */
            if (!key_word(kw, &keys[got])) {
                bad = 1;
                break;
            }
            v->obj = NULL; /* nothing to release */
            v->buf = &keys[got];
            v->len = 8;
        } else if (!Py_IS_TYPE(kw, array_type)) { /* as writer.py's form */
            bad = 1;
            break;
        } else if (PyObject_GetBuffer(kw, v, PyBUF_CONTIG_RO | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            bad = 1;
            break;
        } else if (v->itemsize != 8 || v->format == NULL || strcmp(v->format, "Q") != 0) {
            PyBuffer_Release(v);
            bad = 1;
            break;
        }
        metas[got] = meta;
        total += v->len / 8;
    }
    PyObject *result = NULL;
    if (bad) {
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
                    uint64_t *const base = (uint64_t *)w.buf + 4 * start;
                    uint64_t *sw = base;
                    for (Py_ssize_t r = 0; r < nr; r++) {
                        const uint64_t *kw = views[r].buf, meta = metas[r];
                        const Py_ssize_t k = views[r].len / 8;
                        for (Py_ssize_t i = 0; i < k; i++, sw += 4) {
                            sw[1] = kw[i];
                            sw[2] = meta;
                            sw[3] = 0;
                        }
                    }
                    /* Stores in this order (x86-64 keeps them in order; the fences keep the
                     * compiler from reordering or merging them): payload, seq words, header,
                     * tail last. */
                    atomic_signal_fence(memory_order_seq_cst);
                    for (Py_ssize_t j = 0; j < total; j++) base[4 * j] = seq + 1 + (uint64_t)j;
                    volatile uint64_t *hw = h.buf;
                    atomic_signal_fence(memory_order_seq_cst);
                    hw[W_ATTEMPTED] = attempted + (uint64_t)total;
                    hw[W_LAST_SEQ] = seq + (uint64_t)total;
                    atomic_signal_fence(memory_order_seq_cst);
                    hw[W_TAIL] = tail + (uint64_t)total;
                    result = PyLong_FromSsize_t(total);
                }
                PyBuffer_Release(&h);
            }
            PyBuffer_Release(&w);
        }
    }
    for (Py_ssize_t r = 0; r < got; r++) {
        if (views[r].obj != NULL) PyBuffer_Release(&views[r]);
    }
    if (views != small_views) {
        PyMem_Free(views);
        PyMem_Free(metas);
        PyMem_Free(keys);
    }
    return result;
}

/* array('Q', [0]): `word_array * k` (sq_repeat) makes a k-word array without parsing. */
static PyObject *word_array = NULL;

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

static PyMethodDef methods[] = {
    {"words", words, METH_O, "words(keys: list) -> array('Q') of KVCM's signed bit pattern"},
    {"put_runs", (PyCFunction)(void (*)(void))put_runs, METH_FASTCALL,
     "put_runs(runs, words, hdr, start, room, seq, attempted, tail) -> records"},
    {"find", find, METH_VARARGS, "find(ukeys, tkeys, tpos, dense, out, n, insert) -> new n, or -1 - n if full"},
    {"apply", apply, METH_VARARGS, "apply(pos, metas, masks): group bits set/cleared in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_accel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__accel(void) {
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
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddIntConstant(mod, "KIND_STORED", KIND_STORED) < 0 ||
        PyModule_AddIntConstant(mod, "KIND_REMOVED", KIND_REMOVED) < 0 ||
        PyModule_AddIntConstant(mod, "W_TAIL", W_TAIL) < 0 ||
        PyModule_AddIntConstant(mod, "W_LAST_SEQ", W_LAST_SEQ) < 0 ||
        PyModule_AddIntConstant(mod, "W_ATTEMPTED", W_ATTEMPTED) < 0 ||
        PyModule_AddIntConstant(mod, "HEADER_WORDS", HEADER_WORDS) < 0 ||
        PyModule_AddIntConstant(mod, "ABI", ACCEL_ABI) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
