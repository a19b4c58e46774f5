"""The sidecar pins glibc's mmap threshold (where glibc is the allocator)."""

from __future__ import annotations

import ctypes
import platform

from sidecar.malloc import pin_mmap_threshold


def test_pin_mmap_threshold_is_accepted_by_glibc_and_harmless_twice() -> None:
    glibc = platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallopt")
    assert pin_mmap_threshold() is glibc
    assert pin_mmap_threshold() is glibc
