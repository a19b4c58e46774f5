"""The floor under a flush window at engine pace (issue #26): what the event loop's wake-up and
one delta's socket I/O cost by themselves, with none of the sidecar's code.

    python -m bench.wake_floor [--wakes 270] [--period-s 0.037]

Loops in this process, one after the other. Under uvloop: `sleep` wakes every period (one
asyncio.sleep in a task, as a source's coalesced read does) and does nothing else; `sock` also
writes one delta-sized POST (29 KB, the 5 k/s window's) to bench.null_server and reads the
previous answer with one non-blocking recv (as the lean client does); `callback` is a chain of
loop.call_later callbacks (no task, no future). Without an event loop: `time_sleep` is plain
Python calling time.sleep. Printed: process CPU per wake-up. The sidecar's own cost per window
is its figure (bench.pace_split) less `sock`'s; `sleep` less `time_sleep` is the event loop's
own share of a wake-up. JSON to bench/results/wake_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import uvloop

BODY = b"x" * 29_000
HEAD = (
    b"POST /api/reportEvent HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
)


async def _loop(mode: str, wakes: int, period_s: float, port: int) -> float:
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.process_time()
    for i in range(wakes):
        await asyncio.sleep(period_s)
        if mode == "sock":
            if i:
                with contextlib.suppress(BlockingIOError):  # the answer: there by now
                    s.recv(65536)
            s.sendmsg([HEAD, BODY])
    cpu = time.process_time() - t0
    s.close()
    return cpu / wakes * 1e6


async def _callbacks(wakes: int, period_s: float) -> float:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    left = [wakes]
    t0 = time.process_time()

    def tick() -> None:
        left[0] -= 1
        if left[0]:
            loop.call_later(period_s, tick)
        else:
            done.set_result((time.process_time() - t0) / wakes * 1e6)

    loop.call_later(period_s, tick)
    return await done


def _time_sleep(wakes: int, period_s: float) -> float:
    t0 = time.process_time()
    for _ in range(wakes):
        time.sleep(period_s)
    return (time.process_time() - t0) / wakes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wakes", type=int, default=270)
    ap.add_argument("--period-s", type=float, default=0.037)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "wake_floor.json"))
    a = ap.parse_args()
    null = subprocess.Popen(
        [sys.executable, "-m", "bench.null_server"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert null.stdout is not None
        port = int(null.stdout.readline().rsplit(":", 1)[1])
        out = {
            mode: uvloop.run(_loop(mode, a.wakes, a.period_s, port)) for mode in ("sleep", "sock")
        }
        out["callback"] = uvloop.run(_callbacks(a.wakes, a.period_s))
        out["time_sleep"] = _time_sleep(a.wakes, a.period_s)
    finally:
        null.terminate()
        null.wait(10)
    for mode, us in out.items():
        print(f"{mode:10s} {us:6.0f} us of process CPU per wake-up ({a.wakes} every {a.period_s}s)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"us_per_wake": out, "period_s": a.period_s}) + "\n")


if __name__ == "__main__":
    main()
