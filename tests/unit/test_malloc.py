"""The sidecar pins glibc's mmap threshold and trims its heap (where glibc is the allocator)."""

from __future__ import annotations

import asyncio
import ctypes
import platform

import pytest

from sidecar import config as C
from sidecar import daemon
from sidecar.malloc import pin_mmap_threshold, trim


def test_pin_mmap_threshold_is_accepted_by_glibc_and_harmless_twice() -> None:
    glibc = platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallopt")
    assert pin_mmap_threshold() is glibc
    assert pin_mmap_threshold() is glibc


def test_trim_gives_freed_heap_holes_back_where_glibc_is_the_allocator() -> None:
    glibc = platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "malloc_trim")
    pin_mmap_threshold()  # 1 MiB blocks then come from the heap, as a small key table's do
    blocks = [ctypes.create_string_buffer(1 << 20) for _ in range(16)]
    del blocks[::2]  # holes between live blocks: glibc keeps them resident until trimmed
    assert trim() is glibc
    del blocks


async def test_daemon_trims_the_heap_once_per_trim_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[float] = []
    slept: list[float] = []

    def fake_trim() -> bool:
        trims.append(slept[-1])
        return True

    monkeypatch.setattr(daemon, "trim", fake_trim)
    env = {
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
        "KV_CACHE_EVENT_INSTANCE_ID": "i",
        "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
    }
    cfg = C.load(env=env, overrides={"memory.trim_interval_s": "12.5"})

    async def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) > 3:
            raise asyncio.CancelledError

    d = daemon.Daemon(cfg, asyncio.Event(), sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        await d._trim_loop()
    assert slept == [12.5] * 4
    assert trims == [12.5] * 3  # after each full interval, never before the first
