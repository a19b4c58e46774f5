"""One flush window of the ZMQ source's read, in this process: the ZMTP messages of `--batches`
vLLM-shaped engine batches (BlockStored of 32 fresh keys with their 512 token ids, BlockRemoved
of the 32 oldest of a 4 096-key live set) read off a socket pair by the source's own reader
(`ZmqSource._read_zmtp`), then the flush into the counts and key state (`Stream.flush`).

    python -m bench.zmq_read [--windows 1000] [--batches 4] [--out FILE]

(Another checkout: copy this file into its bench/ and run it there, with --out.)

Each window is timed twice over (thread CPU): `hot`, windows back to back, and `cold`, with a
64 MiB write between windows (what 40 ms of an engine and a manager on the same cores do to
the caches, roughly). Printed: median us per window for the read and read + flush, and the
cold / hot ratio. JSON to bench/results/zmq_read.json. The difference between the two is why
a window at engine pace costs several times what the throughput benchmarks suggest.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from sidecar.config import Config, IdentityConfig, SourceConfig, ZmqConfig
from sidecar.key_state import KeyState
from sidecar.source.zmq import ZmqSource
from sidecar.source.zmtp import ZmtpSub, _frame_head

OUT = Path(__file__).parent / "results" / "zmq_read.json"


class _Poller:
    def unregister(self, _sock: object) -> None:  # (only on a lost connection)
        pass


def _window(temperature: str, windows: int, batches: int, tmp: str) -> dict[str, float]:
    z = ZmqConfig(endpoint="tcp://127.0.0.1:1", bind=False, transport="zmtp")
    cfg = Config(
        publisher_type="none",
        identity=IdentityConfig(instance_id="bench"),
        source=SourceConfig(kind="zmq", state_dir=tmp, zmq=z),
    )
    keys = KeyState((0,))
    src = ZmqSource(cfg, keys)
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = ZmtpSub(z.endpoint, b"")
    conn.sock, conn._ready = a, True  # connected and past the handshake
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(1)
    live = [rng.getrandbits(63) for _ in range(4096)]
    tokens = list(range(512))
    seq = 0

    def batch() -> bytes:
        nonlocal seq
        new = [rng.getrandbits(63) for _ in range(32)]
        old = live[:32]
        del live[:32]
        live.extend(new)
        events = [["BlockStored", new, None, tokens, 16, None, "GPU"], ["BlockRemoved", old, "GPU"]]
        frames = (b"", seq.to_bytes(8, "big"), enc.encode([time.time(), events, 0]))
        seq += 1
        return b"".join(_frame_head(1 if i < 2 else 0, len(f)) + f for i, f in enumerate(frames))

    thrash = np.zeros(64 << 17)  # 64 MiB
    poller: Any = _Poller()
    reads, totals = [], []
    for w in range(windows + 50):
        b.sendall(b"".join(batch() for _ in range(batches)))
        if temperature == "cold":
            thrash += 1.0
        t0 = time.thread_time_ns()
        n = src._read_zmtp(conn, poller)
        t1 = time.thread_time_ns()
        src.stream.flush(repair=True)
        t2 = time.thread_time_ns()
        assert n == batches, n
        if w >= 50:  # past the tables' growth
            reads.append(t1 - t0)
            totals.append(t2 - t0)
    a.close()
    b.close()
    return {
        "read_us": float(np.median(reads)) / 1e3,
        "read_flush_us": float(np.median(totals)) / 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    out: dict[str, Any] = {"windows": a.windows, "batches": a.batches}
    with tempfile.TemporaryDirectory() as tmp:
        for temperature in ("hot", "cold", "hot", "cold"):  # alternated: the machine drifts
            r = _window(temperature, a.windows, a.batches, tmp)
            out.setdefault(temperature, []).append(r)
            print(
                f"{temperature:<4} read {r['read_us']:7.1f} us, read + flush "
                f"{r['read_flush_us']:7.1f} us per window of {a.batches} batches",
                flush=True,
            )
    hot = min(r["read_flush_us"] for r in out["hot"])
    cold = min(r["read_flush_us"] for r in out["cold"])
    out["cold_over_hot"] = cold / hot
    print(f"cold / hot (read + flush, best of each): {cold / hot:.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
