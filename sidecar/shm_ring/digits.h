/* A block key as KVCM reads it: its unsigned 64-bit value as exactly 20 zero-padded decimal
 * digits (contract §4.2). Shared by _accel.c's digits() and _wire.c's delta_body(). */
#ifndef KVCM_DIGITS_H
#define KVCM_DIGITS_H
#include <stdint.h>

static inline void kvcm_put20(char *out, uint64_t v) {
    for (int d = 19; d >= 0; d--) {
        out[d] = (char)('0' + (v % 10));
        v /= 10;
    }
}
#endif
