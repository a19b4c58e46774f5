"""What libzmq costs the ZMQ source at engine pace, against reading ZMTP off the socket (issue #26).

    python -m bench.zmtp_probe [--rate 5000] [--seconds 15] [--reps 2] [--window-ms 45]
                               [--out bench/results/zmtp_probe.json]

A measurement for a design decision, not a part of the product. vLLM 0.33's real
`ZmqEventPublisher` (bench/vllm_real.py; `pip download --no-deps vllm==0.33.0 -d
~/.cache/kvcm-bench`) publishes bench.pace's workload (one KVEventBatch of 32 stored blocks with
their 512 token ids and 32 removed ones per step, paced) in its own process. A reader process,
in turn and alternated:
  pyzmq  a SUB socket read like the ZMQ source's `_read_live`: once per flush window, three
         recv(NOBLOCK) per message until zmq.Again. libzmq's IO thread receives each batch as
         it arrives and hands it over (a wake-up of that thread per batch).
  pyzmq_events  the same, asking the socket (getsockopt EVENTS) before each message instead
         of a recv that raises zmq.Again at the end of the drain
  zmtp   the same messages read off a plain TCP socket speaking ZMTP 3.0, once per window,
         by the ZMQ source's own reader (sidecar/source/zmtp.py, `source.zmq.transport`). No
         thread; a batch's arrival wakes nobody.
Reported per reader: its process CPU (every thread, schedstat ns) per message and per second,
from its first message to its last; messages and bytes seen. Both readers only take the
messages (no decode): the difference is what the transport costs the source.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
K, BLOCK_SIZE = 32, 16
KINDS = ("pyzmq", "pyzmq_events", "zmtp")


def _cpu_ns() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def engine(port: int, rate: int, seconds: float, lead_s: float) -> None:
    import random

    from bench import vllm_real

    m = vllm_real.load()
    pub = m.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=None)
    tokens = list(range(K * BLOCK_SIZE))
    rng = random.Random(7)
    live = [[rng.getrandbits(64) for _ in range(K)] for _ in range(128)]
    print("bound", flush=True)
    time.sleep(lead_s)  # the reader connects and subscribes (a PUB drops what none asked for)
    period = 2 * K / rate
    next_t = time.monotonic()
    end = next_t + seconds
    while next_t < end:
        new = [rng.getrandbits(64) for _ in range(K)]
        old = live.pop(0)
        live.append(new)
        events: list[Any] = [
            m.BlockStored(
                block_hashes=new,
                parent_block_hash=None,
                token_ids=tokens,
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            m.BlockRemoved(block_hashes=old, medium="GPU"),
        ]
        pub.publish(m.KVEventBatch(ts=time.time(), events=events))
        next_t += period
        d = next_t - time.monotonic()
        if d > 0:
            time.sleep(d)
    time.sleep(0.5)
    pub.shutdown()


class Tally:
    def __init__(self) -> None:
        self.msgs = 0
        self.bytes = 0
        self.cpu0 = self.cpu1 = 0
        self.t0 = self.t1 = 0.0

    def got(self, n: int, nbytes: int) -> None:
        if not n:
            return
        if not self.msgs:
            self.cpu0, self.t0 = _cpu_ns(), time.monotonic()
            n -= 1  # the first message opens the measured span
        self.msgs += n
        self.bytes += nbytes
        self.cpu1, self.t1 = _cpu_ns(), time.monotonic()


def read_pyzmq(port: int, until: float, window_s: float, tally: Tally, kind: str) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    nb = int(zmq.NOBLOCK)
    recv = sock.recv
    get, events, pollin = sock.get, int(zmq.EVENTS), int(zmq.POLLIN)
    ask = kind == "pyzmq_events"
    print("ready", flush=True)
    while time.monotonic() < until:
        time.sleep(window_s)
        n = nbytes = 0
        while True:
            if ask:  # ask the socket, instead of a recv that raises zmq.Again
                if not int(get(events)) & pollin:
                    break
                recv(nb)
            else:
                try:
                    recv(nb)
                except zmq.Again:
                    break
            recv(nb)
            frame = recv(nb, copy=False)
            n += 1
            nbytes += len(frame.bytes)
        tally.got(n, nbytes)
    sock.close(0)
    ctx.term()


def read_zmtp(port: int, until: float, window_s: float, tally: Tally, kind: str) -> None:
    """The product's reader (sidecar/source/zmtp.py), connected once, then read per window."""
    import asyncio

    from sidecar.source.zmtp import ZmtpSub

    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    asyncio.run(sub.connect(5.0))
    got: list[list[bytes]] = []
    print("ready", flush=True)
    while time.monotonic() < until:
        time.sleep(window_s)
        sub.read(got.append, 1024)
        tally.got(len(got), sum(len(m[-1]) for m in got))
        got.clear()
    sub.close()


def reader(kind: str, port: int, seconds: float, window_s: float) -> None:
    tally = Tally()
    until = time.monotonic() + seconds
    (read_zmtp if kind == "zmtp" else read_pyzmq)(port, until, window_s, tally, kind)
    span = tally.t1 - tally.t0
    cpu = (tally.cpu1 - tally.cpu0) / 1e9
    print(
        json.dumps(
            {
                "messages": tally.msgs,
                "bytes": tally.bytes,
                "seconds": span,
                "cpu_s": cpu,
                "us_per_message": 1e6 * cpu / tally.msgs if tally.msgs else None,
                "pct_core": 100 * cpu / span if span > 0 else None,
            }
        ),
        flush=True,
    )


def one(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    from bench.vllm_real import free_port

    port = free_port()
    py = [sys.executable, "-m", "bench.zmtp_probe"]
    eng = subprocess.Popen(
        [*py, "--engine", str(port), "--rate", str(a.rate), "--seconds", str(a.seconds)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert eng.stdout is not None
        if eng.stdout.readline().strip() != "bound":
            raise SystemExit("the engine did not start")
        rd = subprocess.Popen(
            [
                *py,
                "--reader",
                kind,
                "--port",
                str(port),
                "--seconds",
                str(a.seconds + 1.5),
                "--window-ms",
                str(a.window_ms),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert rd.stdout is not None
        lines = rd.stdout.read().splitlines()
        rd.wait()
        return dict(json.loads(lines[-1]))
    finally:
        eng.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", type=int, default=0)
    ap.add_argument("--reader", choices=KINDS)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--window-ms", type=float, default=45.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "zmtp_probe.json"))
    a = ap.parse_args()
    if a.engine:
        engine(a.engine, a.rate, a.seconds, lead_s=1.0)
        return
    if a.reader:
        reader(a.reader, a.port, a.seconds, a.window_ms / 1e3)
        return
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for rep in range(a.reps):
        for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
            r = one(kind, a)
            runs[kind].append(r)
            print(
                f"rep {rep} {kind:12s} {r['messages']:6d} msgs  {r['us_per_message']:6.1f} us/msg"
                f"  {r['pct_core']:5.2f} % of a core",
                flush=True,
            )
    med = {k: statistics.median(r["pct_core"] for r in v) for k, v in runs.items()}
    print(
        "median % of a core: "
        + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
        + f" (pyzmq / zmtp = {med['pyzmq'] / med['zmtp']:.2f}x)"
    )
    out = {
        "rate": a.rate,
        "seconds": a.seconds,
        "window_ms": a.window_ms,
        "runs": runs,
        "median_pct_core": med,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
