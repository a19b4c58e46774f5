"""How fast is the ZMQ source, and what does it cost? One run; writes bench/results/zmq_source.json.

fold        vLLM-format payloads (msgpack) -> decode -> store counts -> key state, in process, on
            one core: block events/s (maps with int hashes; positional with 32-byte digests;
            8 events of 4 blocks per batch, and 32-block events as prefills send)
end_to_end  a PUB socket blasting the same payloads -> the real daemon (`kvcm-sidecar run`,
            source.kind=zmq) -> the null manager (bench/null_server.py): block events/s until
            KVCM's copy is confirmed, key changes sent per second, and the sidecar's CPU-seconds
            per million block events
idle        the daemon's CPU while the engine is connected but silent

Baseline in the same run (ratio_* = the baseline's time / ours): a straightforward per-event
msgspec decode into dicts, each hash counted in a Python dict keyed by (key, medium, group).

  python -m bench.zmq_source [--quick] [--idle-seconds 20]
  python -m bench.zmq_source --key-mode rolling [--quick]   (bench/results/zmq_source_rolling.json)

--key-mode rolling|both: the same, with stores that chain (a parent, distinct tokens: 16-token
blocks re-keyed to KVCM's rolling keys), fold and end to end only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from bench.sidecar import PY, Child, _null_server, _proc_stats
from sidecar.key_state import KeyState
from sidecar.source.block_counts import BlockCounts
from sidecar.source.zmq import Stream
from sidecar.source.zmq_events import EventDecoder

RESULTS = Path(__file__).resolve().parent / "results"
MEDIUMS = {"GPU": 0, "CPU": 1}
EVENTS_PER_BATCH = 8  # one engine step
BLOCKS_PER_EVENT = 4
BLOCK_SIZE = 16
FLUSH_EVERY = 1024  # batches folded together: what one feed-loop turn of the daemon reads at load


def payloads(
    n_blocks: int,
    *,
    positional: bool = False,
    digests: bool = False,
    blocks_per_event: int = BLOCKS_PER_EVENT,
) -> list[bytes]:
    """vLLM-format batches: stores of fresh hashes (10 % duplicates of held ones) and removes of
    held ones, on GPU and CPU (a block is removed from the medium it was stored on, as vLLM
    does; ~50 000 held per medium); each BlockStored carries its token ids, as vLLM's do."""
    rng = random.Random(7)
    held: dict[str, list[Any]] = {"GPU": [], "CPU": []}
    tokens = list(range(blocks_per_event * BLOCK_SIZE))
    out: list[bytes] = []
    done = 0
    enc = msgspec.msgpack.Encoder()
    while done < n_blocks:
        events: list[Any] = []
        for _ in range(EVENTS_PER_BATCH):
            medium = "GPU" if rng.random() < 0.7 else "CPU"
            pool = held[medium]
            if pool and (len(pool) > 50_000 or rng.random() < 0.4):
                take = min(blocks_per_event, len(pool))
                hs = []
                for _ in range(take):
                    i = rng.randrange(len(pool))
                    pool[i], pool[-1] = pool[-1], pool[i]
                    hs.append(pool.pop())
                fields: dict[str, Any] = {"block_hashes": hs, "medium": medium}
                name = "BlockRemoved"
            else:
                hs = [
                    pool[rng.randrange(len(pool))]
                    if pool and rng.random() < 0.1
                    else (rng.randbytes(32) if digests else rng.getrandbits(64))
                    for _ in range(blocks_per_event)
                ]
                pool.extend(hs)
                fields = {
                    "block_hashes": hs,
                    "parent_block_hash": None,
                    "token_ids": tokens,
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                    "medium": medium,
                }
                name = "BlockStored"
            events.append([name, *fields.values()] if positional else {"type": name, **fields})
            done += len(hs)
        out.append(enc.encode([time.time(), events, 0]))
    return out


def chained_payloads(n_blocks: int) -> list[bytes]:
    """payloads() for key modes rolling / both: a store starts a chain (30 %) or continues one
    from a held block (its parent), with tokens of its own; a duplicate re-stores a held block
    with its parent and tokens, as vLLM does."""
    rng = random.Random(7)
    held: dict[str, list[int]] = {"GPU": [], "CPU": []}
    made: dict[int, tuple[int | None, int]] = {}  # hash -> (parent, first token)
    out: list[bytes] = []
    done = 0
    enc = msgspec.msgpack.Encoder()
    while done < n_blocks:
        events: list[Any] = []
        for _ in range(EVENTS_PER_BATCH):
            medium = "GPU" if rng.random() < 0.7 else "CPU"
            pool = held[medium]
            fields: dict[str, Any]
            if pool and (len(pool) > 50_000 or rng.random() < 0.4):
                hs = []
                for _ in range(min(BLOCKS_PER_EVENT, len(pool))):
                    i = rng.randrange(len(pool))
                    pool[i], pool[-1] = pool[-1], pool[i]
                    hs.append(pool.pop())
                events.append({"type": "BlockRemoved", "block_hashes": hs, "medium": medium})
                done += len(hs)
                continue
            if pool and rng.random() < 0.1:
                h = pool[rng.randrange(len(pool))]
                parent, t0 = made[h]
                hs, toks = [h], list(range(t0, t0 + BLOCK_SIZE))
            else:
                parent = pool[rng.randrange(len(pool))] if pool and rng.random() < 0.7 else None
                hs = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
                t0 = rng.randrange(1 << 20)
                toks = list(range(t0, t0 + BLOCK_SIZE * len(hs)))
                prev = parent
                for j, h in enumerate(hs):
                    made[h] = (prev, t0 + j * BLOCK_SIZE)
                    prev = h
            pool.extend(hs)
            fields = {
                "block_hashes": hs,
                "parent_block_hash": parent,
                "token_ids": toks,
                "block_size": BLOCK_SIZE,
                "lora_id": None,
                "medium": medium,
            }
            events.append({"type": "BlockStored", **fields})
            done += len(hs)
        out.append(enc.encode([time.time(), events, 0]))
    return out


def fold(batches: list[bytes], key_mode: str = "engine") -> tuple[float, int]:
    """CPU seconds to decode and fold every batch into counts and key state; block events."""
    from sidecar.source.rekey import Rekey

    keys = KeyState((0,))
    s = Stream(
        EventDecoder(MEDIUMS, BLOCK_SIZE, 0, full=key_mode != "engine"),
        BlockCounts(keys),
        dp_rank=0,
        can_replay=False,
        replay_timeout_s=1.0,
    )
    if key_mode != "engine":
        s.rekey = Rekey(BLOCK_SIZE, BLOCK_SIZE, both=key_mode == "both")
    t0 = time.process_time()
    for seq, p in enumerate(batches):
        s.on_live(seq, p)
        if seq % FLUSH_EVERY == FLUSH_EVERY - 1:
            s.flush()
    s.flush()
    return time.process_time() - t0, s.blocks


def fold_baseline(batches: list[bytes]) -> float:
    """The straightforward way: decode each batch generically, count hash by hash in a dict."""
    counts: dict[tuple[int, str, int], int] = {}
    t0 = time.process_time()
    for p in batches:
        _ts, events, _dp = msgspec.msgpack.decode(p)
        for ev in events:
            if isinstance(ev, list):
                ev = {"type": ev[0], "block_hashes": ev[1], "medium": ev[-1]}
            typ = ev["type"]
            medium = ev.get("medium") or "GPU"
            group = ev.get("group_idx") or 0
            for h in ev["block_hashes"]:
                k = (int.from_bytes(h, "big") if isinstance(h, bytes) else h) & 0xFFFFFFFFFFFFFFFF
                t = (k, medium, group)
                if typ == "BlockStored":
                    counts[t] = counts.get(t, 0) + 1
                elif counts.get(t, 0) > 1:
                    counts[t] -= 1
                else:
                    counts.pop(t, None)
    return time.process_time() - t0


class Blaster:
    """PUB + ROUTER (replay of what it sent) in this process, sending pre-encoded batches."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.set_hwm(0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rep.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.rep.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sent: list[bytes] = []
        self.stop = threading.Event()
        self._t = threading.Thread(target=self._serve_replay, daemon=True)
        self._t.start()

    def wait_subscriber(self) -> None:
        self.pub.recv()  # XPUB: the subscription message

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.rep.poll(50):
                continue
            ident, _, start = self.rep.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in range(first, len(self.sent)):
                self.rep.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), self.sent[seq]])
            self.rep.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    def send(self, batches: list[bytes]) -> None:
        for p in batches:
            seq = len(self.sent)
            self.sent.append(p)
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), p])

    def close(self) -> None:
        self.stop.set()
        self._t.join()
        self.ctx.destroy(0)


def _sidecar(base: str, b: Blaster, state_dir: str, key_mode: str = "engine") -> Child:
    env = {
        **os.environ,
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": base,
        "KV_CACHE_EVENT_INSTANCE_ID": f"bench-zmq-{uuid.uuid4().hex[:6]}",
        "KV_CACHE_EVENT_HOST_IP_PORT": f"127.0.0.1:{9600 + os.getpid() % 300}",
        "KV_CACHE_EVENT_METRICS_ADDR": "127.0.0.1:0",
        "KV_CACHE_EVENT_LOG_FORMAT": "json",
        "KV_CACHE_EVENT_SOURCE": "zmq",
        "KV_CACHE_EVENT_ZMQ_ENDPOINT": b.endpoint,
        "KV_CACHE_EVENT_ZMQ_REPLAY_ENDPOINT": b.replay_endpoint,
        "KV_CACHE_EVENT_ZMQ_BIND": "false",
        "KV_CACHE_EVENT_STATE_DIR": state_dir,
        "KV_CACHE_EVENT_ZMQ_KEY_MODE": key_mode,
    }
    return Child(PY, "-m", "sidecar.cli", "run", env=env)


def _status_url(side: Child) -> str:
    while True:
        line = side.line()
        msg = str(line.get("msg", ""))
        if "http listening" in msg:
            return f"http://127.0.0.1:{msg.rsplit(':', 1)[1]}/status"


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own loopback URL
        out: dict[str, Any] = json.loads(r.read())
        return out


def _until(url: str, pred: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = _status(url)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"sidecar never reached the state: {st}")
        time.sleep(0.01)  # polling another process, bounded by the deadline


@contextlib.contextmanager
def _running(base: str, tmp: str, key_mode: str = "engine") -> Iterator[tuple[Blaster, Child, str]]:
    """A blaster and a `kvcm-sidecar run` subscribed to it, READY; stopped afterwards."""
    b = Blaster()
    side = _sidecar(base, b, tmp, key_mode)
    try:
        url = _status_url(side)
        b.wait_subscriber()
        _until(url, lambda s: s["state"] == "READY")
        yield b, side, url
    finally:
        side.p.terminate()
        side.p.wait(timeout=20)
        b.close()


def end_to_end(
    base: str, batches: list[bytes], blocks: int, tmp: str, key_mode: str = "engine"
) -> dict[str, float]:
    with _running(base, tmp, key_mode) as (b, side, url):
        cpu0, _ = _proc_stats(side.p.pid)
        t0 = time.monotonic()
        b.send(batches)
        last = len(batches) - 1
        st = _until(
            url, lambda s: s["last_seq"] >= last and s["dirty"] == 0 and s["state"] == "READY"
        )
        elapsed = time.monotonic() - t0
        cpu1, _ = _proc_stats(side.p.pid)
        delta_keys = _delta_keys(url)
    return {
        "e2e_block_events": float(blocks),
        "e2e_seconds": elapsed,
        "e2e_block_events_per_s": blocks / elapsed,
        "e2e_key_changes_sent": float(delta_keys),
        "e2e_key_changes_per_s": delta_keys / elapsed,
        "e2e_sidecar_cpu_s": cpu1 - cpu0,
        "e2e_sidecar_cpu_s_per_million_block_events": (cpu1 - cpu0) / blocks * 1e6,
        "e2e_forgets": float(sum(st.get("zmq_forgets", {}).values())),
    }


def _delta_keys(status_url: str) -> float:
    metrics = status_url.replace("/status", "/metrics")
    with urllib.request.urlopen(metrics, timeout=5) as r:  # noqa: S310 - our own loopback URL
        for line in r.read().decode().splitlines():
            if line.startswith("kvcm_sidecar_delta_keys_total "):
                return float(line.split()[1])
    return 0.0


def idle(base: str, seconds: float, tmp: str) -> dict[str, float]:
    with _running(base, tmp) as (_b, side, _url):
        time.sleep(2.0)  # settle: imports done, first heartbeats sent
        c0, _ = _proc_stats(side.p.pid)
        time.sleep(seconds)  # the measurement window itself
        c1, _ = _proc_stats(side.p.pid)
    return {"idle_seconds": seconds, "idle_cpu_fraction_of_core": (c1 - c0) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--key-mode", default="engine", choices=("engine", "rolling", "both"))
    a = ap.parse_args()
    n = 200_000 if a.quick else 2_000_000
    if a.key_mode != "engine":
        keyed(a.key_mode, n)
        return
    out: dict[str, Any] = {"python": sys.version.split()[0], "block_events": n}
    variants: list[tuple[str, dict[str, Any]]] = [
        ("map_int", {}),
        ("positional_digest", {"positional": True, "digests": True}),
        ("map_int_prefill", {"blocks_per_event": 32}),  # one event per 512-token prompt
    ]
    for label, kw in variants:
        batches = payloads(n, **kw)
        cpu, blocks = min(fold(batches) for _ in range(3))
        base_cpu = min(fold_baseline(batches) for _ in range(2))
        out[f"fold_{label}_block_events_per_s"] = blocks / cpu
        out[f"fold_{label}_baseline_block_events_per_s"] = blocks / base_cpu
        out[f"ratio_fold_{label}_vs_dict"] = base_cpu / cpu
    batches = payloads(n)
    null, base = _null_server()
    tmp = f"/tmp/kvcm-bench-zmq-{os.getpid()}"  # noqa: S108 - a scratch state dir
    try:
        out.update(end_to_end(base, batches, sum(_blocks(p) for p in batches), tmp))
        out.update(idle(base, 5.0 if a.quick else a.idle_seconds, tmp))
    finally:
        null.stop()
    out["goals"] = {
        "fold >= 1 M block events/s on one core": out["fold_map_int_block_events_per_s"] >= 1e6,
        "end to end >= 1 M key changes/s": out["e2e_block_events_per_s"] >= 1e6,
        "idle CPU <= 1% of a core": out["idle_cpu_fraction_of_core"] <= 0.01,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zmq_source.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


def keyed(mode: str, n: int) -> None:
    """Key modes rolling / both: fold and end to end on chained 16-token blocks."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "block_events": n, "key_mode": mode}
    batches = chained_payloads(n)
    blocks = sum(_blocks(p) for p in batches)
    cpu, folded = min(fold(batches, mode) for _ in range(3))
    cpu_engine, _ = min(fold(batches) for _ in range(3))
    out[f"fold_{mode}_block_events_per_s"] = folded / cpu
    out["fold_engine_same_payloads_block_events_per_s"] = folded / cpu_engine
    null, base = _null_server()
    tmp = f"/tmp/kvcm-bench-zmq-{os.getpid()}"  # noqa: S108 - a scratch state dir
    try:
        out.update(end_to_end(base, batches, blocks, tmp, mode))
        # the same payloads in engine mode, same run: what the re-keying adds end to end
        eng = end_to_end(base, batches, blocks, tmp + "-engine")
        out["e2e_engine_same_payloads_sidecar_cpu_s_per_million_block_events"] = eng[
            "e2e_sidecar_cpu_s_per_million_block_events"
        ]
    finally:
        null.stop()
    # CPU-bound (a core of its own): block events/s = 1 / CPU-s per block event
    per_m = out["e2e_sidecar_cpu_s_per_million_block_events"]
    out["e2e_block_events_per_cpu_s"] = 1e6 / per_m
    out["goals"] = {
        f"{mode}: end to end >= 0.8 M block events/s": out["e2e_block_events_per_s"] >= 8e5,
        f"{mode}: end to end <= 1.25 CPU-s per M block events (0.8 M/s on one core)": per_m <= 1.25,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"zmq_source_{mode}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


def _blocks(p: bytes) -> int:
    _ts, events, _dp = msgspec.msgpack.decode(p)
    return sum(len(e["block_hashes"]) for e in events)


if __name__ == "__main__":
    main()
