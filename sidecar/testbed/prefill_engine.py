"""Prefill-only engine process for `kvcm-sidecar replay`: a FIFO queue before the reference block
cache (LRU, capacity in blocks) that reports through the real hook and ring.

Imports: stdlib, engine_hook. `python -m sidecar.testbed.prefill_engine JSON`; JSON-line commands on
stdin, events on stdout. Virtual time (wall = t0 + v / speed): a request starts at max(arrival,
previous end), looks up its prefix then, stores its blocks at its end; events apply in v order.
"""

from __future__ import annotations

import faulthandler
import json
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import engine_hook
from engine_hook.block_cache import BlockCache, GroupSpec


@dataclass(frozen=True)
class Cost:
    """Prefill seconds for `new` uncached tokens after `cached` reused ones:
    overhead_s + per_token_s * new + per_token_ctx_s * new * (cached + new / 2)
    (the last term is attention: each new token attends to the context before it)."""

    overhead_s: float = 0.015
    per_token_s: float = 4e-5
    per_token_ctx_s: float = 2e-9

    def prefill_s(self, input_tokens: int, cached_tokens: int) -> float:
        new = input_tokens - cached_tokens
        return (
            self.overhead_s
            + self.per_token_s * new
            + self.per_token_ctx_s * new * (cached_tokens + new / 2)
        )


def cached_tokens(prefix_blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Reused tokens: whole cached blocks, but at least one token is always computed."""
    return min(prefix_blocks * block_tokens, input_tokens - 1)


@dataclass
class _Request:
    rid: int
    at: float
    keys: list[int]
    tokens: int
    start: float = 0.0
    end: float = 0.0
    cached: int = 0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class PrefillEngine:
    """The queue and the cache; `step(msg)` handles one command, `advance(v)` runs the clock."""

    def __init__(self, cache: BlockCache, hook: Any, cost: Cost, block_tokens: int) -> None:
        self.cache = cache
        self.hook = hook
        self.cost = cost
        self.block_tokens = block_tokens
        self.waiting: deque[_Request] = deque()
        self.running: _Request | None = None
        self.last_end = 0.0
        self.t0 = time.monotonic()
        self.speed = 1.0
        self.evictions_before = self.dropped_before = 0  # the counts when this run began

    def now_v(self) -> float:
        return (time.monotonic() - self.t0) * self.speed

    def due_wall(self) -> float | None:
        """Wall seconds until the running prefill ends (None when idle)."""
        if self.running is None:
            return None
        return self.t0 + self.running.end / self.speed - time.monotonic()

    def advance(self, until_v: float) -> None:
        """Finish every prefill that ends at or before `until_v`, starting the next ones."""
        while self.running is not None and self.running.end <= until_v:
            r = self.running
            self.cache.insert_keys(r.keys)  # prefill done: every full block is now cached
            self.hook.flush()  # once per engine step
            self.running = None
            self.last_end = r.end
            _emit({"ev": "done", "id": r.rid, "end": r.end})
            self._start_next()

    def _start_next(self) -> None:
        if self.running is not None or not self.waiting:
            return
        r = self.waiting.popleft()
        r.start = max(r.at, self.last_end)
        r.cached = cached_tokens(self.cache.prefix_blocks(r.keys), self.block_tokens, r.tokens)
        r.end = r.start + self.cost.prefill_s(r.tokens, r.cached)
        self.running = r
        _emit({"ev": "start", "id": r.rid, "start": r.start, "end": r.end, "cached": r.cached})

    def step(self, msg: dict[str, Any]) -> bool:
        """Handle one command; False on `exit`."""
        op = msg["op"]
        if op == "req":
            at = float(msg["at"])
            self.advance(at)
            r = _Request(int(msg["id"]), at, [int(k) for k in msg["keys"]], int(msg["tokens"]))
            # The truth at arrival, for the router's report (how stale KVCM's view was).
            _emit({"ev": "arrive", "id": r.rid, "prefix": self.cache.prefix_blocks(r.keys)})
            self.waiting.append(r)
            self._start_next()
        elif op == "probe":  # the oracle reads the engine's true cache directly
            self.advance(float(msg["at"]))
            keys = [int(k) for k in msg["keys"]]
            _emit({"ev": "probe", "id": msg["id"], "prefix": self.cache.prefix_blocks(keys)})
        elif op == "epoch":  # a new run: its trace time 0 is wall t0 (CLOCK_MONOTONIC)
            self.t0, self.speed = float(msg["t0"]), float(msg["speed"])
            self.last_end = 0.0
            self.evictions_before = self.cache.evictions
            self.dropped_before = self.hook.stats()["dropped"]
            _emit({"ev": "epoch"})
        elif op == "reset":
            self.advance(float("inf"))
            self.cache.clear()
            self.hook.flush()
            _emit({"ev": "reset"})
        elif op == "dump":
            self.advance(float("inf"))
            self.hook.flush(wait=True)
            pub = sorted(self.cache.published())
            _emit(
                {
                    "ev": "dump",
                    "published": [str(k) for k in pub],
                    "evictions": self.cache.evictions - self.evictions_before,
                    "dropped": self.hook.stats()["dropped"] - self.dropped_before,
                }
            )
        elif op == "exit":
            return False
        return True


def main(args: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    block_tokens = int(args["block_tokens"])
    hook = engine_hook.attach(
        strict=True,
        instance_id=args["instance_id"],
        dp_rank=args["dp_rank"],
        dp_size=args.get("dp_size", 1),
        model_name="replay-model",
        block_size_tokens=block_tokens,
        group_block_bytes=(65536,),
        required_groups=(0,),
        ring_capacity_slots=args.get("ring_slots", 1 << 16),
    )
    cache = BlockCache(int(args["capacity_blocks"]), block_tokens, [GroupSpec("full", 65536)], hook)
    engine = PrefillEngine(cache, hook, Cost(**args.get("cost", {})), block_tokens)
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                inbox.put(json.loads(line))
        inbox.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    _emit({"ev": "ready"})
    while True:
        due = engine.due_wall()
        try:
            msg = inbox.get(timeout=None if due is None else max(0.0, due))
        except queue.Empty:
            engine.advance(engine.now_v())
            continue
        if msg is None or not engine.step(msg):
            break
    hook.flush(wait=True)
    hook.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
