/* KVCM's rolling hash step in C, shared by _accel.c (`rolling`, `roll_list`) and _rekey.c (the
 * key table's re-keying). sidecar/shm_ring/rolling_hash.py is the reference (a test holds them
 * equal on the golden vectors): h ^= t + C + (h << 12) + (h >> 32), signed 64-bit, arithmetic
 * shift, sums mod 2^64. The sum is grouped so the dependency chain through h is four operations
 * (the two shifts in parallel, two adds, the xor; t + C is computed off the chain), where the
 * left-to-right sum GCC made of it was five (shift, + C, + t, + the other shift, xor). */
#ifndef KVCM_ROLLING_H
#define KVCM_ROLLING_H
#include <stdint.h>

#define KVCM_ROLL_C 0x9E3779B97F4A7C15ULL

static inline uint64_t kvcm_roll_step(uint64_t h, uint64_t t) {
    uint64_t a = t + KVCM_ROLL_C;
#if defined(__GNUC__)
    __asm__("" : "+r"(a)); /* keeps t + C one value: GCC re-associated it into the chain */
#endif
    uint64_t s = (h << 12) + (uint64_t)((int64_t)h >> 32);
    return h ^ (a + s);
}

/* h after the n tokens t[0..n) (one block, no boundary test inside). */
static inline uint64_t kvcm_roll_block(uint64_t h, const uint64_t *t, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) h = kvcm_roll_step(h, t[j]);
    return h;
}
/* A contiguous buffer of `itemsize`-byte items (read-only unless `writable`), or -1 with
 * TypeError naming `what`; both modules' argument arrays go through it. Needs Python.h first. */
#ifdef Py_PYTHON_H
static int kvcm_view(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
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
#endif

#endif
