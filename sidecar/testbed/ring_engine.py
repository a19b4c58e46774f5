"""A real engine-side process for tests: `python -m sidecar.testbed.ring_engine MODE JSON-ARGS`.

It prints one JSON line `{"ready": ...}` once attached (tests wait on it instead of sleeping) and
one JSON result line when done. Modes:
  burst     raw RingWriter: write `bursts` x `burst` records whose keys count up; report accepted
  forever   raw RingWriter: write until killed (for SIGKILL tests); waits for "go" on stdin
  workload  Hook: seeded random stored/removed/cleared; report the engine's truth at the end
  cache     the reference BlockCache (answers snapshots with its provider) under commands
  plain     the README's integration: attach() + stored()/removed()/cleared(), no provider, so
            snapshots come from the hook's own resident set; same commands as `cache`
  tiers     attach() with mediums hbm, mem, disk: random stored/removed per (key, medium),
            snapshots from the resident set; commands work / exit; replies the (key, medium) truth
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import numpy as np


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def burst(a: dict[str, Any]) -> None:
    from sidecar.shm_ring import layout as L
    from sidecar.shm_ring.segment import Segment
    from sidecar.shm_ring.writer import RingWriter

    w = RingWriter(Segment(a["ring"], a.get("capacity")))
    _emit({"ready": True, "boot_id": w.boot_id})
    sys.stdin.readline()  # wait for "go"
    accepted: list[int] = []
    key = 0
    meta = L.pack_meta(L.KIND_STORED, 0)
    for _ in range(a["bursts"]):
        keys = np.arange(key, key + a["burst"], dtype=np.int64)
        m = w.write(keys, meta)
        accepted.extend(range(key, key + m))
        key += a["burst"]
        if a.get("pause_each"):
            _emit({"paused": True})
            sys.stdin.readline()
    _emit({"accepted": accepted, "dropped": w.dropped, "last_seq": w.last_seq})


def forever(a: dict[str, Any]) -> None:
    from sidecar.shm_ring import layout as L
    from sidecar.shm_ring.segment import Segment
    from sidecar.shm_ring.writer import RingWriter

    w = RingWriter(Segment(a["ring"], a.get("capacity")))
    _emit({"ready": True, "boot_id": w.boot_id})
    sys.stdin.readline()
    key = 0
    meta = L.pack_meta(L.KIND_STORED, 0)
    while True:
        w.write(np.arange(key, key + 64, dtype=np.int64), meta)
        key += 64


def workload(a: dict[str, Any]) -> None:
    import engine_hook

    rng = random.Random(a["seed"])
    hook = engine_hook.attach(
        strict=True,
        instance_id="test",
        ring_name=a["ring"],
        ring_capacity_slots=a.get("capacity", 1 << 16),
        group_block_bytes=(64, 64),
        max_stage_delay_ms=1.0,
    )
    truth: dict[int, int] = {}
    _emit({"ready": True, "boot_id": hook.stats()["boot_id"]})
    sys.stdin.readline()
    universe = a.get("universe", 200)
    for i in range(a["ops"]):
        r = rng.random()
        g = rng.randrange(2)
        if r < 0.002:
            hook.cleared()
            truth.clear()
        elif r < 0.6:
            keys = [rng.randrange(universe) for _ in range(rng.randrange(1, 4))]
            hook.stored(keys if len(keys) > 1 else keys[0], g)
            for k in keys:
                truth[k] = truth.get(k, 0) | (1 << g)
        else:
            k = rng.randrange(universe)
            hook.removed(k, g)
            v = truth.get(k, 0) & ~(1 << g)
            if v:
                truth[k] = v
            else:
                truth.pop(k, None)
        if i % a.get("flush_every", 50) == 0:
            hook.flush()
    hook.flush(wait=True)
    _emit({"done": True, "last_seq": hook.stats()["last_seq"]})
    sys.stdin.readline()  # stay alive (answering snapshots) until told to finish
    _emit(
        {
            "truth": sorted(truth.items()),
            "stats": hook.stats(),
        }
    )
    hook.close()


def _attach_ring(a: dict[str, Any], **fields: Any) -> Any:
    """The hook of a command-driven engine: identity and ring from the test's arguments."""
    import engine_hook

    hook = engine_hook.attach(
        strict=True,
        instance_id=a["instance_id"],
        dp_rank=a.get("dp_rank", 0),
        ring_name=a["ring"],
        ring_capacity_slots=a.get("capacity", 0),
        **fields,
    )
    assert not isinstance(hook, engine_hook.NullHook)
    return hook


def cache(a: dict[str, Any]) -> None:
    """The reference BlockCache under commands on stdin: work, flood, truth, exit."""
    from engine_hook.block_cache import BlockCache, GroupSpec

    hook = _attach_ring(
        a,
        block_size_tokens=4,
        group_block_bytes=(4096, 1024),
        required_groups=(0, 1),
        max_stage_delay_ms=2.0,
    )
    cache = BlockCache(
        a.get("blocks", 256),
        4,
        [GroupSpec("full", 4096), GroupSpec("swa", 1024, window_blocks=6)],
        hook,
        required_groups=(0, 1),
    )
    rng = random.Random(a.get("seed", 0))
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(8, 40))] for _ in range(12)]
    _emit({"ready": True, "boot_id": hook.stats()["boot_id"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "work":
            for _ in range(cmd["n"]):
                if rng.random() < 0.05 and cache.published():
                    cache.evict(rng.choice(sorted(cache.published())), rng.choice([None, 0, 1]))
                else:
                    p = rng.choice(prefixes)
                    cache.insert(p + [rng.randrange(50_000) for _ in range(rng.randrange(0, 24))])
        elif op == "flood":
            # Hold the flush lock so the whole burst lands in one flush: >= 10x the ring.
            with hook._flush_lock:
                for i in range(cmd["n"]):
                    cache.insert([10**6 + i * 7 + j for j in range(4)])
        elif op == "exit":
            hook.close()
            _emit({"bye": True})
            return
        hook.flush(wait=True)
        _emit({"published": sorted(cache.published()), "stats": hook.stats()})


def plain(a: dict[str, Any]) -> None:
    """An engine that cannot enumerate its cache, exactly as the README shows the hook."""
    hook = _attach_ring(
        a,
        tp_rank=0,
        tp_size=8,
        model_name="llama-70b",
        block_size_tokens=16,
        group_block_bytes=(2_621_440,),
        required_groups=(0,),
        max_stage_delay_ms=2.0,
    )
    rng = random.Random(a.get("seed", 0))
    held: set[int] = set()
    universe = a.get("blocks", 256) * 4
    next_flood = 10**7
    _emit({"ready": True, "boot_id": hook.stats()["boot_id"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "work":
            for _ in range(cmd["n"]):
                r = rng.random()
                if r < 0.003:
                    hook.cleared()
                    held.clear()
                elif r < 0.55:
                    keys = [rng.randrange(universe) for _ in range(rng.randrange(1, 6))]
                    hook.stored(keys if len(keys) > 1 else keys[0])
                    held.update(keys)
                elif held:
                    gone = rng.sample(sorted(held), min(len(held), rng.randrange(1, 4)))
                    hook.removed(np.array(gone, np.int64) if len(gone) > 1 else gone[0])
                    held.difference_update(gone)
        elif op in ("store", "remove"):  # exact keys, for tests that need a given history
            (hook.stored if op == "store" else hook.removed)(cmd["keys"])
            (held.update if op == "store" else held.difference_update)(cmd["keys"])
        elif op == "flood":
            # The shape: one big stored(ndarray) burst (>= 10x the ring), then half of
            # all held keys removed, in one flush.
            with hook._flush_lock:
                burst = np.arange(next_flood, next_flood + cmd["n"], dtype=np.int64)
                next_flood += cmd["n"]
                hook.stored(burst)
                held.update(burst.tolist())
                gone = rng.sample(sorted(held), len(held) // 2)
                hook.removed(np.array(gone, np.int64))
                held.difference_update(gone)
        elif op == "exit":
            hook.close()
            _emit({"bye": True})
            return
        hook.flush(wait=True)
        _emit({"published": sorted(held), "stats": hook.stats()})


def tiers(a: dict[str, Any]) -> None:
    """Keys per (key, medium) through the ring: `stored(keys, medium=...)` on three tiers."""
    import engine_hook

    mediums = ("hbm", "mem", "disk")
    hook = engine_hook.attach(
        strict=True,
        instance_id=a["instance_id"],
        ring_name=a["ring"],
        ring_capacity_slots=a.get("capacity", 0),
        medium="hbm",
        mediums=mediums,
        max_stage_delay_ms=2.0,
    )
    rng = random.Random(a.get("seed", 0))
    held: set[tuple[int, str]] = set()
    _emit({"ready": True, "boot_id": hook.stats()["boot_id"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            hook.close()
            _emit({"bye": True})
            return
        for _ in range(cmd["n"]):
            k, m = rng.randrange(500), rng.choice(mediums)
            if rng.random() < 0.6:
                hook.stored(k, medium=None if m == "hbm" else m)
                held.add((k, m))
            else:
                hook.removed(k, medium=m)
                held.discard((k, m))
        hook.flush(wait=True)
        _emit({"held": sorted(held), "stats": hook.stats()})


if __name__ == "__main__":
    modes = {
        "burst": burst,
        "forever": forever,
        "workload": workload,
        "cache": cache,
        "plain": plain,
        "tiers": tiers,
    }
    modes[sys.argv[1]](json.loads(sys.argv[2]))
