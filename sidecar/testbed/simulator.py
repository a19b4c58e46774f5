"""Engine simulator for the demo: the reference block cache under a synthetic chat workload.

Imports: stdlib, numpy, engine_hook. Run as `python -m sidecar.testbed.simulator JSON`; it prints
JSON lines on stdout: `ready`; after "go" on stdin, periodic `stats`; after "quiet", the final
`published` set plus sampled (key, stored-at, unpublished-at) for latency measurement.
Requests share a few long system prompts (so prefixes repeat across requests) and the cache is
smaller than the working set (so LRU evictions happen all the time).
"""

from __future__ import annotations

import faulthandler
import json
import random
import signal
import sys
import threading
import time
from typing import Any

import engine_hook
from engine_hook.block_cache import BlockCache, GroupSpec
from engine_hook.rolling_hash import block_keys

BLOCK = 16


COMMON_BLOCKS = 4  # every tenant's prompt starts with the same system preamble


def prompts(seed: int, n: int = 8) -> list[list[int]]:
    """One prompt per tenant: a preamble common to all, then the tenant's own instructions.
    Tenant i is served by dp rank i % dp_size; the demo uses the same seed for its router
    queries, so each prompt matches fully on its own rank and only the preamble elsewhere."""
    rng = random.Random(seed)
    common = [rng.randrange(32_000) for _ in range(COMMON_BLOCKS * BLOCK)]
    return [
        common + [rng.randrange(32_000) for _ in range(rng.randrange(64, 448))] for _ in range(n)
    ]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Tap:
    """Passes every call to the hook; notes when a watched key is first removed afterwards.
    With `provider=False` the cache's snapshot provider is not installed, so the hook answers
    resyncs from its own resident set (an engine that cannot enumerate its cache)."""

    def __init__(self, hook: Any, provider: bool = True) -> None:
        self.hook = hook
        self.provider = provider
        self.watched: set[int] = set()
        self.removed_at: dict[int, int] = {}

    def stored(self, keys: Any, group: int = 0) -> None:
        self.hook.stored(keys, group)

    def removed(self, keys: Any, group: int = 0) -> None:
        if keys in self.watched and keys not in self.removed_at:
            self.removed_at[keys] = time.monotonic_ns()
        self.hook.removed(keys, group)

    def cleared(self) -> None:
        self.hook.cleared()

    def set_snapshot_provider(self, provider: Any) -> None:
        if self.provider:
            self.hook.set_snapshot_provider(provider)


def main(args: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    hook = engine_hook.attach(
        strict=True,
        instance_id=args["instance_id"],
        dp_rank=args["dp_rank"],
        dp_size=args.get("dp_size", 1),
        model_name="demo-model",
        block_size_tokens=BLOCK,
        group_block_bytes=(65536, 16384),
        required_groups=(0, 1),
        ring_capacity_slots=args.get("capacity", 1 << 14),
    )
    tap = _Tap(hook, provider=args.get("provider", True))
    cache = BlockCache(
        args.get("blocks", 2048),
        BLOCK,
        [GroupSpec("full", 65536), GroupSpec("swa", 16384, window_blocks=64)],
        tap,
        required_groups=(0, 1),
    )
    rng = random.Random(args["seed"] * 1000 + args["dp_rank"])
    system = prompts(args["seed"])
    dp_size = args.get("dp_size", 1)
    own = [t for i, t in enumerate(system) if i % dp_size == args["dp_rank"]] or system
    go = threading.Event()
    quiet = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                go.set()
            if line.strip() == "quiet":
                go.set()
                quiet.set()
                return

    threading.Thread(target=watch_stdin, daemon=True).start()
    _emit({"ready": True})
    go.wait()  # the demo starts the workload once every sidecar is ready
    samples: list[tuple[int, int]] = []
    requests = 0
    next_stats = time.monotonic()
    rate = args.get("requests_per_s", 150)
    t0 = time.monotonic()
    while not quiet.is_set():
        p = rng.choice(own)  # this rank's tenants (a router sent their requests here)
        tokens = p + [rng.randrange(32_000) for _ in range(rng.randrange(16, 256))]
        before = cache.published() if requests % 10 == 0 else None
        cache.insert(tokens)
        if before is not None:
            now = time.monotonic_ns()
            after = cache.published()
            # Only keys this request made published: their ADD is what KVCM should see next.
            fresh = [k for k in block_keys(tokens, BLOCK) if k in after and k not in before]
            samples.extend((k, now) for k in fresh)
            tap.watched.update(fresh)
        if rng.random() < 0.02 and cache.published():
            cache.evict(rng.choice(sorted(cache.published())))
        requests += 1
        hook.flush()  # once per engine step
        if time.monotonic() >= next_stats:
            next_stats += 0.5
            st = hook.stats()
            _emit(
                {
                    "stats": True,
                    "requests": requests,
                    "events": st["last_seq"],
                    "published": len(cache.published()),
                    "dropped": st["dropped"],
                }
            )
        lag = t0 + requests / rate - time.monotonic()
        if lag > 0:
            time.sleep(lag)  # pace the synthetic workload
    hook.flush(wait=True)
    st = hook.stats()
    _emit(
        {
            "final": True,
            "published": [str(k) for k in sorted(cache.published())],
            "samples": [[str(k), t, tap.removed_at.get(k, 0)] for k, t in samples[:5000]],
            "requests": requests,
            "events": st["last_seq"],
            "dropped": st["dropped"],
            "evictions": cache.evictions,
        }
    )
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    hook.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
