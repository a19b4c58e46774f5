/* A delta request's body in one C call (kvcm_client/wire.py encode_batch), compiled into the
 * _accel extension beside _accel.c (which only calls kvcm_wire_add at its init).
 *
 * wire.py's numpy form (_body: one buffer, each part's fixed-width rows broadcast, then the key
 * digits) is the reference and the fallback; tests/unit/test_wire.py pins that both give the
 * same bytes. At engine pace a flush window carries ~100-300 keys and the numpy form's ~20
 * calls (and the batch's four boolean selections before it) run on caches gone cold: tens of
 * microseconds per window, where this is one pass over the keys. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "digits.h"


/* Copy the rows of keys [lo, hi) whose publish flag equals `want` (every one of them when
 * `pub` is NULL), each `row` with the key's digits at `col`; returns the write position. */
static char *put_rows(char *at, const uint64_t *keys, const uint8_t *pub, Py_ssize_t lo,
                      Py_ssize_t hi, int want, const char *row, Py_ssize_t width,
                      Py_ssize_t col) {
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (pub != NULL && (pub[i] != 0) != want) continue;
        memcpy(at, row, (size_t)width);
        kvcm_put20(at + col, keys[i]);
        at += width;
    }
    return at;
}

/* delta_body(prefix, add_row, add_col, del_row, del_col, keys, publish, suffix) -> bytes:
 * prefix, then one add row per key whose publish flag is set and one delete row per key whose
 * flag is clear (adds first, each in the given order), without the last row's comma, then
 * suffix. `publish` is one byte per key, or an int n: the first n keys are the adds, the rest
 * the deletes. Each row ends with its comma; `*_col` is where its 20 digits go. keys: 8-byte
 * words (int64 bit patterns, read unsigned). */
static PyObject *delta_body(PyObject *self, PyObject *args) {
    Py_buffer pre, add, del, vk, suf, vp = {0};
    Py_ssize_t add_col, del_col;
    PyObject *o_pub;
    if (!PyArg_ParseTuple(args, "y*y*ny*ny*Oy*", &pre, &add, &add_col, &del, &del_col, &vk,
                          &o_pub, &suf))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = vk.len / 8, n_add = -1;
    const uint8_t *pub = NULL;
    if (PyLong_Check(o_pub)) {
        n_add = PyLong_AsSsize_t(o_pub);
        if (n_add == -1 && PyErr_Occurred()) goto done;
    } else {
        if (PyObject_GetBuffer(o_pub, &vp, PyBUF_SIMPLE) < 0) goto done;
        pub = vp.buf;
    }
    if (vk.len % 8 || (pub != NULL ? vp.len != n : (n_add < 0 || n_add > n)) || add_col < 0 ||
        add_col + 20 > add.len - 1 || del_col < 0 || del_col + 20 > del.len - 1) {
        PyErr_SetString(PyExc_ValueError, "delta_body: keys, flags or rows do not fit");
        goto done;
    }
    const uint64_t *keys = vk.buf;
    if (pub != NULL) {
        n_add = 0;
        for (Py_ssize_t i = 0; i < n; i++) n_add += pub[i] != 0;
    }
    Py_ssize_t rows = n_add * add.len + (n - n_add) * del.len;
    Py_ssize_t size = pre.len + rows - (n ? 1 : 0) + suf.len;
    out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) goto done;
    char *at = PyBytes_AS_STRING(out);
    memcpy(at, pre.buf, (size_t)pre.len);
    at += pre.len;
    if (pub != NULL) {
        at = put_rows(at, keys, pub, 0, n, 1, add.buf, add.len, add_col);
        at = put_rows(at, keys, pub, 0, n, 0, del.buf, del.len, del_col);
    } else {
        at = put_rows(at, keys, NULL, 0, n_add, 1, add.buf, add.len, add_col);
        at = put_rows(at, keys, NULL, n_add, n, 0, del.buf, del.len, del_col);
    }
    if (n) at--; /* the last row's comma */
    memcpy(at, suf.buf, (size_t)suf.len);
done:
    if (vp.obj != NULL) PyBuffer_Release(&vp);
    PyBuffer_Release(&suf);
    PyBuffer_Release(&vk);
    PyBuffer_Release(&del);
    PyBuffer_Release(&add);
    PyBuffer_Release(&pre);
    return out;
}

static PyMethodDef wire_methods[] = {
    {"delta_body", delta_body, METH_VARARGS,
     "delta_body(prefix, add_row, add_col, del_row, del_col, keys, publish, suffix) -> bytes"},
    {NULL, NULL, 0, NULL},
};

int kvcm_wire_add(PyObject *mod) { return PyModule_AddFunctions(mod, wire_methods); }
