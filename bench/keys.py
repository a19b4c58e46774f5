"""What do the keys cost? (issue #22 §5) One run; writes bench/results/keys.json.

rolling     KVCM's rolling hash in C (sidecar/shm_ring/_accel.c `rolling`), ns per token on tokens
            in cache (as the re-keying hashes them) and streamed from memory (4 M tokens), and
            the Python reference for scale
table       the rolling key table's memory: RSS growth per entry at 1 M and 4 M entries (a child
            process each, filled through the real re-keying of stored events), and SGLang's page
            size 1 against KVCM 16 with 1 M tokens cached (one entry per page)
key_check   the key check's CPU as a share of the fold's, on the fold benchmark's payloads
            (bench/zmq_source.py): the sample's time / the whole fold's

  python -m bench.keys [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def rolling_ns_per_token(n: int) -> dict[str, float]:
    """The C loop over tokens in cache (as the re-keying hashes them: one event's tokens, just
    decoded), best of many short runs (a shared machine's other load inflates long ones); and
    the same over n tokens streamed from memory (32 MB at 4 M tokens: DRAM bandwidth, which the
    machine's other load shares, not the hash)."""
    from sidecar import keys as K
    from sidecar.shm_ring import compiled
    from sidecar.shm_ring.rolling_hash import roll as roll_reference

    assert compiled.accel is not None, "the C extension is not built"
    toks = np.random.default_rng(1).integers(0, 150_000, n, dtype=np.int64)
    out = np.empty(n // 16, np.int64)
    hot = toks[: 1 << 15]  # 256 KB: in L2
    best_hot = float("inf")
    for _ in range(2000):
        t0 = time.perf_counter()
        compiled.accel.rolling(hot, 16, 0, 0, out)
        best_hot = min(best_hot, time.perf_counter() - t0)
    best = float("inf")
    chunk = 1 << 18
    for i in range(200):
        lo = (i * chunk) % (n - chunk + 1)
        t0 = time.perf_counter()
        compiled.accel.rolling(toks[lo : lo + chunk], 16, 0, 0, out)
        best = min(best, time.perf_counter() - t0)
    best *= n / chunk
    small = toks[:200_000].tolist()
    t0 = time.perf_counter()
    roll_reference(small, 16)
    py = time.perf_counter() - t0
    # through sidecar.keys.roll, per 16-token event as the re-keying calls it
    ev = toks[:16]
    t0 = time.perf_counter()
    for _ in range(100_000):
        K.roll(ev, 16, 0, 0)
    per_call = (time.perf_counter() - t0) / 100_000
    return {
        "rolling_c_ns_per_token": best_hot / len(hot) * 1e9,
        "rolling_c_ns_per_token_from_memory": best / n * 1e9,
        "rolling_python_ns_per_token": py / len(small) * 1e9,
        "rolling_keys_roll_call_us_per_16_token_block": per_call * 1e6,
    }


_CHILD = r"""
import json, sys
import msgspec, numpy as np
from sidecar.source.rekey import Rekey
from sidecar.source.zmq_events import EventDecoder, to_blocks

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

n, e, k = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
r = Rekey(e, k, capacity=n + 1)
dec = EventDecoder({"GPU": 0}, e, 0, full=True)
enc = msgspec.msgpack.Encoder()
before = rss()
parent = None
chunk = 4096  # blocks per event: one long chain, as a long prompt (or SGLang's pages) makes
h = 1
done = 0
while done < n:
    m = min(chunk, n - done)
    hashes = list(range(h, h + m))
    toks = list(range(done * e, (done + m) * e))
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
          "token_ids": toks, "block_size": e}
    d = dec.decode(enc.encode([0.0, [ev], 0]))
    f = to_blocks([p for p in d.parts])
    r.apply(f, 0, len(f.codes), [x for p in d.parts for x in p.events])
    parent = hashes[-1]
    h += m
    done += m
    del d, f
after = rss()
print(json.dumps({"entries": r.table.n, "rss_bytes": after - before}))
"""


def table_bytes(n: int, e: int, k: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n), str(e), str(k)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    got = json.loads(out.stdout)
    return {"entries": got["entries"], "bytes_per_entry": got["rss_bytes"] / got["entries"]}


def key_check_share(n_blocks: int) -> dict[str, float]:
    """The fold with the key check on: the sampled checks' CPU (timed per sample only, so the
    timer does not cost more than what it times), plus the step every flush pays (timed in a
    loop), over the whole fold's CPU."""
    import timeit

    from bench.zmq_source import FLUSH_EVERY, MEDIUMS, payloads
    from sidecar.key_state import KeyState
    from sidecar.source.block_counts import BlockCounts
    from sidecar.source.key_check import KeyCheck
    from sidecar.source.zmq import Stream
    from sidecar.source.zmq_events import EventDecoder

    batches = payloads(n_blocks)
    spent = [0.0]

    class Timed(KeyCheck):
        def check_payload(self, payload: bytes) -> None:
            t0 = time.process_time()
            try:
                super().check_payload(payload)
            finally:
                spent[0] += time.process_time() - t0

    def fold(check: bool) -> tuple[float, Stream]:
        s = Stream(
            EventDecoder(MEDIUMS, 16, 0),
            BlockCounts(KeyState((0,))),
            dp_rank=0,
            can_replay=False,
            replay_timeout_s=1.0,
        )
        s.key_check = Timed(16, warn=False) if check else None
        t0 = time.process_time()
        for seq, p in enumerate(batches):
            s.on_live(seq, p)
            if seq % FLUSH_EVERY == FLUSH_EVERY - 1:
                s.flush()
        s.flush()
        return time.process_time() - t0, s

    total, s = fold(True)
    kc = s.key_check
    assert isinstance(kc, Timed)
    # what a flush pays when it samples nothing: a subtraction and a test (zmq.py flush)
    probe = KeyCheck(16, warn=False)
    probe.credit = 1 << 62
    n = 1_000_000
    stmt = (
        "kc = probe\nif kc is not None:\n    kc.credit -= 3\n    if kc.credit <= 0:\n        pass"
    )
    per_flush = timeit.timeit(stmt, number=n, globals={"probe": probe}) / n
    bookkeeping = per_flush * (len(batches) // FLUSH_EVERY + 1)
    without, _ = min(fold(False) for _ in range(2))
    return {
        "key_check_cpu_share_of_fold": (spent[0] + bookkeeping) / total,
        "key_check_sampled_cpu_s": spent[0],
        "key_check_per_flush_bookkeeping_ns": per_flush * 1e9,
        "key_check_batches_sampled": float(kc.batches),
        "key_check_blocks_checked": float(sum(kc.checked.values())),
        "fold_with_key_check_block_events_per_s": s.blocks / total,
        "fold_without_key_check_block_events_per_s": s.blocks / without,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    out.update(rolling_ns_per_token(1 << 20 if a.quick else 1 << 22))
    sizes = [100_000] if a.quick else [1_000_000, 4_000_000]
    for n in sizes:
        t = table_bytes(n, 16, 16)
        out[f"table_{n // 1000}k_bytes_per_entry"] = t["bytes_per_entry"]
    t = table_bytes(100_000 if a.quick else 1_000_000, 1, 16)  # SGLang page 1, KVCM 16
    out["table_sglang_page1_kvcm16_1m_tokens_entries"] = t["entries"]
    out["table_sglang_page1_kvcm16_1m_tokens_bytes_per_entry"] = t["bytes_per_entry"]
    out.update(key_check_share(200_000 if a.quick else 2_000_000))
    out["goals"] = {
        "rolling hash <= 1.5 ns/token in C": out["rolling_c_ns_per_token"] <= 1.5,
        "key table <= 40 B/entry": all(
            v <= 40 for k, v in out.items() if k.startswith("table_") and k.endswith("_per_entry")
        ),
        "key check <= 1% of the fold's CPU": out["key_check_cpu_share_of_fold"] <= 0.01,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "keys_quick.json" if a.quick else "keys.json"
    (RESULTS / name).write_text(json.dumps(out, indent=2) + "\n")
    sys.stdout.write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
