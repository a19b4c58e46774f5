"""The demo's and the test bed's child processes: a child that dies before the line a caller
waits for fails that wait at once, with what it printed, instead of at the timeout."""

from __future__ import annotations

import asyncio
import sys

import pytest

from sidecar.child import ChildExited, spawn


async def test_expect_fails_at_once_when_the_child_exits_first() -> None:
    tasks: list[asyncio.Task[None]] = []
    code = "print('starting'); print('cannot bind: Address already in use'); raise SystemExit(3)"
    p = await spawn("kvcm", sys.executable, "-c", code, tasks=tasks)
    try:
        with pytest.raises(ChildExited, match=r"kvcm exited \(rc=3\).*Address already in use"):
            await p.expect(lambda x: x == "listening on", within_s=60)
    finally:
        for t in tasks:
            t.cancel()


async def test_expect_returns_the_matching_line_and_keeps_later_ones() -> None:
    tasks: list[asyncio.Task[None]] = []
    p = await spawn("c", sys.executable, "-c", "print('a'); print('b'); print('c')", tasks=tasks)
    try:
        assert await p.expect(lambda x: x == "b", within_s=60) == "b"
        assert await p.expect(lambda x: x == "c", within_s=60) == "c"
        with pytest.raises(ChildExited):
            await p.expect(lambda x: False, within_s=60)
    finally:
        for t in tasks:
            t.cancel()
