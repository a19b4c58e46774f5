"""Keep glibc from holding on to the memory of freed large arrays.

Imports: stdlib (ctypes) only. glibc serves big allocations with mmap and returns them on free,
but after the first such free it raises its mmap threshold (up to 32 MiB), so later arrays of
several MiB (the key state's columns, a snapshot's temporaries) come from the heap, where freed
holes stay resident. For the sidecar that doubled RSS after one 1M-key snapshot (bench/README.md).
Setting the threshold turns the adjustment off. Arrays below it (a small cache's key tables,
0.5-4 MiB, rebuilt as keys churn) still leave holes in the heap that glibc only returns from its
top: `trim()` (malloc_trim, ~1 ms) gives the free pages inside it back, on a timer (the daemon).
Without it a ZMQ sidecar's RSS crept up 30-55 MB/h with its live heap flat (docs/testing.md).
No-op where mallopt / malloc_trim is missing (musl, macOS).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
# Request bodies (a 4096-key delta is ~600 KiB) stay below this and reuse heap memory: served by
# mmap, each would pay its page faults again (3x the encode time). Key-state columns and
# snapshot bodies of large caches are above it, and go back to the kernel when freed.
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def pin_mmap_threshold() -> bool:
    """True if glibc accepted the fixed threshold."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    log.debug("mallopt M_MMAP_THRESHOLD=%d ok=%s", MMAP_THRESHOLD_BYTES, ok)
    return ok


def trim() -> bool:
    """Return the heap's free pages to the kernel (glibc malloc_trim(0)); True if it released
    any, False if none or not glibc."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
