"""Engine-side load for bench/sidecar.py: `python -m bench.producer MODE JSON`.

raw   RingWriter: `rate` events/s in batches of `batch` for `seconds`; prints accepted/dropped
hook  engine_hook: `rate` stored(one new key)/s for `seconds`, flush per 1 ms step; prints
      sampled (key, monotonic ns) pairs; then stays attached until stdin closes. With `burst`
      and `pause_s`: bursts of `burst` keys separated by `pause_s` of quiet instead
fill  engine_hook: store `keys` keys at once, print done, stay attached until stdin closes
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def raw(a: dict[str, Any]) -> None:
    from sidecar.shm_ring import layout as L
    from sidecar.shm_ring.segment import Segment
    from sidecar.shm_ring.writer import RingWriter

    w = RingWriter(Segment(a["ring"], a["capacity"]))
    _emit({"ready": True})
    sys.stdin.readline()
    batch = a["batch"]
    meta = L.pack_meta(L.KIND_STORED, 0)
    rng = np.random.default_rng(1)
    pool = rng.integers(-(2**62), 2**62, size=batch * 64, dtype=np.int64)
    n = int(a["rate"] * a["seconds"])
    t0 = time.perf_counter()
    sent = 0
    i = 0
    while sent < n:
        keys = pool[(i % 64) * batch : (i % 64 + 1) * batch]
        w.write(keys, meta)
        sent += batch
        i += 1
        lag = t0 + sent / a["rate"] - time.perf_counter()
        if lag > 0:
            time.sleep(lag)  # pace the offered rate
    _emit({"sent": sent, "dropped": w.dropped, "seconds": time.perf_counter() - t0})


def _hook(a: dict[str, Any]) -> Any:
    import engine_hook

    return engine_hook.attach(
        strict=True,
        env={},
        instance_id=a["instance_id"],
        ring_name=a["ring"],
        ring_capacity_slots=a.get("capacity", 1 << 18),
    )


def hook(a: dict[str, Any]) -> None:
    h = _hook(a)
    _emit({"ready": True})
    sys.stdin.readline()
    rate = a["rate"]
    step = 0.001
    per_step = max(int(rate * step), 1)
    n = int(rate * a["seconds"])
    samples: list[tuple[str, int]] = []
    key = 1
    # Bursty mode: `burst` keys in one engine step, then `pause_s` of quiet; the sample is each
    # burst's first key (what an idle sidecar used to delay by up to its poll interval).
    burst, pause = a.get("burst", 0), a.get("pause_s", 0.0)
    t0 = time.perf_counter()
    while key < n:
        now = time.monotonic_ns()
        if burst:
            samples.append((str(key), now))
            h.stored(np.arange(key, key + burst, dtype=np.int64))
            key += burst
            h.flush()
            time.sleep(pause)
            continue
        for _ in range(per_step):
            h.stored(key)
            if key % 97 == 0:
                samples.append((str(key), now))
            key += 1
        h.flush()  # one engine step
        lag = t0 + key / rate - time.perf_counter()
        if lag > 0:
            time.sleep(lag)
    h.flush(wait=True)
    _emit({"samples": samples, "sent": key - 1, "dropped": h.stats()["dropped"]})
    sys.stdin.read()
    h.close()


def fill(a: dict[str, Any]) -> None:
    h = _hook(a)
    h.stored(np.arange(1, a["keys"] + 1, dtype=np.int64))
    h.flush(wait=True)
    _emit({"done": True, "dropped": h.stats()["dropped"]})
    sys.stdin.read()
    h.close()


if __name__ == "__main__":
    {"raw": raw, "hook": hook, "fill": fill}[sys.argv[1]](json.loads(sys.argv[2]))
