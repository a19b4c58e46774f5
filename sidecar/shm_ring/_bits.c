/* Group bits set and cleared at known positions of a key-state tier in one C call
 * (key_state.py _Tier.apply_bits_at), compiled into the _accel extension beside _accel.c (which
 * only calls kvcm_bits_add at its init).
 *
 * apply_bits_at's numpy form (the masks read, the new masks, published() twice, a count delta,
 * mark_dirty's filter of the queued) is the reference and the fallback; tests/unit/
 * test_key_state_bits.py pins that both leave the same masks, queued flags, queue and counts.
 * The ZMQ source calls it once or twice per flush window with ~30-60 positions, and each of the
 * numpy form's ~15 calls runs on caches gone cold: ~100 us per window, where this is two short
 * passes. Anything but the common case (int64 masks and bit arrays, a bool queued column,
 * contiguous arrays, every position inside both columns, a required mask that fits int64) is
 * answered None before anything is written, and the caller runs the numpy form. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A contiguous buffer of `itemsize`-byte items of one of the `formats` (struct codes), or 0 with
 * no error set (the caller answers None: the numpy form takes anything else). */
static int bits_view(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                     const char *formats) {
    const int flags = (writable ? PyBUF_CONTIG : PyBUF_CONTIG_RO) | PyBUF_FORMAT;
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    if (f[0] == '=' || f[0] == '@') f++;
    if (view->itemsize != itemsize || f[0] == '\0' || f[1] != '\0' || !strchr(formats, f[0])) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

#define BITS_STACK 512 /* new masks of up to this many positions on the stack */

/* bits_apply(pos, set_m, clr_m, masks, queued, required, out) -> (k, published delta) or None.
 * The numpy form, exactly, repeats in pos included: every new mask is (old & ~clr) | set of
 * the mask before the call (the last write of a repeated position wins), the delta counts each
 * entry whose published state ((mask & required) == required) differs between its old and new
 * mask, and out[0:k] receives, in order, each such entry's position whose queued flag was clear
 * before the call; queued is then set at those positions. out: int64, >= len(pos) entries. */
static PyObject *bits_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "bits_apply(pos, set_m, clr_m, masks, queued, required, out)");
        return NULL;
    }
    int overflow = 0;
    const long long required = PyLong_AsLongLongAndOverflow(args[5], &overflow);
    if (required == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (overflow) Py_RETURN_NONE;
    Py_buffer vp, vs, vc, vm, vq, vo;
    PyObject *result = Py_None;
    static const char i64[] = "lq";
    if (!bits_view(args[0], &vp, 8, 0, i64)) Py_RETURN_NONE;
    if (!bits_view(args[1], &vs, 8, 0, i64)) goto e1;
    if (!bits_view(args[2], &vc, 8, 0, i64)) goto e2;
    if (!bits_view(args[3], &vm, 8, 1, i64)) goto e3;
    if (!bits_view(args[4], &vq, 1, 1, "?")) goto e4;
    if (!bits_view(args[6], &vo, 8, 1, i64)) goto e5;
    const Py_ssize_t m = vp.len / 8, nmask = vm.len / 8;
    const Py_ssize_t room = nmask < vq.len ? nmask : vq.len;
    const int64_t *pos = vp.buf, *set_m = vs.buf, *clr_m = vc.buf;
    int64_t *masks = vm.buf, *out = vo.buf;
    uint8_t *queued = vq.buf;
    const int64_t req = (int64_t)required;
    if (vs.len / 8 != m || vc.len / 8 != m || vo.len / 8 < m) goto e6; /* numpy broadcasts */
    for (Py_ssize_t i = 0; i < m; i++)
        if (pos[i] < 0 || pos[i] >= room) goto e6; /* numpy wraps or raises */
    int64_t stack[BITS_STACK], *fresh = stack;
    if (m > BITS_STACK) {
        fresh = PyMem_Malloc((size_t)m * sizeof(int64_t));
        if (fresh == NULL) {
            result = PyErr_NoMemory();
            goto e6;
        }
    }
    /* Reads only: every entry sees the masks and queued flags from before the call. */
    Py_ssize_t k = 0;
    long long delta = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const int64_t p = pos[i], old = masks[p], now = (old & ~clr_m[i]) | set_m[i];
        const int was_pub = (old & req) == req, now_pub = (now & req) == req;
        fresh[i] = now;
        delta += now_pub - was_pub;
        if (was_pub != now_pub && !queued[p]) out[k++] = p;
    }
    /* The answer before the writes: once the columns change, nothing may fail. */
    result = Py_BuildValue("nL", k, delta);
    if (result != NULL) {
        for (Py_ssize_t i = 0; i < m; i++) masks[pos[i]] = fresh[i];
        for (Py_ssize_t j = 0; j < k; j++) queued[out[j]] = 1;
    }
    if (fresh != stack) PyMem_Free(fresh);
e6:
    PyBuffer_Release(&vo);
e5:
    PyBuffer_Release(&vq);
e4:
    PyBuffer_Release(&vm);
e3:
    PyBuffer_Release(&vc);
e2:
    PyBuffer_Release(&vs);
e1:
    PyBuffer_Release(&vp);
    if (result == Py_None) Py_INCREF(result);
    return result;
}

static PyMethodDef bits_methods[] = {
    {"bits_apply", (PyCFunction)(void (*)(void))bits_apply, METH_FASTCALL,
     "bits_apply(pos, set_m, clr_m, masks, queued, required, out) -> (k, delta) or None"},
    {NULL, NULL, 0, NULL},
};

int kvcm_bits_add(PyObject *mod) { return PyModule_AddFunctions(mod, bits_methods); }
