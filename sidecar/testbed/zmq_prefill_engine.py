"""Prefill-only engine for `kvcm-sidecar replay --source zmq`: the queue of prefill_engine.py
before an LRU block cache that publishes vLLM-format KV events (PUB + replay ROUTER, the zmq
publisher's) with each block's tokens, parent and hash, hashed from its tokens as vLLM does.

Imports: stdlib, numpy, sidecar.keys, sidecar.replay.trace, sidecar.testbed.*. `python -m
sidecar.testbed.zmq_prefill_engine JSON`; the JSON-line protocol of prefill_engine.py, and the
ready event names the endpoints. A block's tokens come from its trace chain key
(trace.block_tokens), so the router can compute the same token ids.
"""

from __future__ import annotations

import faulthandler
import json
import queue
import signal
import sys
import threading
from collections import OrderedDict
from typing import Any

from sidecar import keys as K
from sidecar.replay.trace import block_tokens
from sidecar.testbed.prefill_engine import Cost, PrefillEngine, _emit
from sidecar.testbed.zmq_publisher import Publisher, PublisherConfig


class ZmqBlocks:
    """The block cache and the engine's event publisher in one (PrefillEngine's cache + hook)."""

    def __init__(self, pub: Publisher, capacity: int, bs: int, key_mode: str) -> None:
        self.pub = pub
        self.capacity = capacity
        self.bs = bs
        self.key_mode = key_mode
        self.lru: OrderedDict[int, None] = OrderedDict()  # chain keys cached, oldest first
        self.hashes: dict[int, int | bytes] = {}  # chain key -> engine hash (memo)
        self.states: dict[int, int] = {}  # chain key -> KVCM rolling key (memo)
        self.evictions = 0

    # ---- the cache ---------------------------------------------------------------------------
    def prefix_blocks(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        return n

    def insert_keys(self, keys: list[int]) -> None:
        """A prefill done: every block cached; the new ones stored in runs, each run's parent
        the block before it; then the least recently used beyond capacity removed."""
        run: list[int] = []
        parent: int | bytes | None = None
        prev: int | None = None
        for k in keys:
            if k in self.lru:
                self.lru.move_to_end(k)
                self._store(run, parent)
                run = []
            else:
                if not run:
                    parent = None if prev is None else self._hash(prev, None)
                run.append(k)
                self.lru[k] = None
            prev = k
        self._store(run, parent)
        gone: list[int | bytes] = []
        while len(self.lru) > self.capacity:
            k, _ = self.lru.popitem(last=False)
            gone.append(self.hashes[k])
            self.evictions += 1
        if gone:
            self.pub.remove(gone)

    def _hash(self, k: int, parent: int | bytes | None) -> int | bytes:
        h = self.hashes.get(k)
        if h is None:
            assert self.pub.hasher is not None
            h = self.hashes[k] = self.pub.hasher.hashes(block_tokens(k, self.bs), self.bs, parent)[
                0
            ]
        return h

    def _store(self, run: list[int], parent: int | bytes | None) -> None:
        if not run:
            return
        hs, toks, p = [], [], parent
        for k in run:
            p = self._hash(k, p)
            hs.append(p)
            toks += block_tokens(k, self.bs)
        self.pub.store(hs, parent=parent, token_ids=toks)

    def published(self) -> set[int]:
        """What KVCM should show: the rolling keys (key_mode rolling) or the engine keys."""
        if self.key_mode == "engine":
            return {K.engine_key(self.hashes[k]) for k in self.lru}
        out = {self._rolling(k) for k in self.lru}
        if self.key_mode == "both":
            out |= {K.engine_key(self.hashes[k]) for k in self.lru}
        return out

    def _rolling(self, k: int) -> int:
        got = self.states.get(k)
        if got is None:
            raise KeyError(k)
        return got

    def learn(self, keys: list[int]) -> None:
        """The rolling key of every block of a request (published() reads them)."""
        h = 0
        for k in keys:
            got = self.states.get(k)
            if got is None:
                h, _p, ks = K.roll(block_tokens(k, self.bs), self.bs, h, 0)
                self.states[k] = ks[-1]
            else:
                h = got

    def clear(self) -> None:
        self.lru.clear()
        self.pub.clear()

    # ---- the hook ----------------------------------------------------------------------------
    def flush(self, wait: bool = False) -> None:
        self.pub.step()
        if wait:
            self.pub.flush()

    def stats(self) -> dict[str, int]:
        return {"dropped": 0}

    def close(self) -> None:
        self.pub.close()


class _Engine(PrefillEngine):
    blocks: ZmqBlocks

    def step(self, msg: dict[str, Any]) -> bool:
        if msg["op"] == "req":
            self.blocks.learn([int(k) for k in msg["keys"]])
        return super().step(msg)


def main(args: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR1)
    bs = int(args["block_tokens"])
    pub = Publisher(
        PublisherConfig(
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            block_size=bs,
            dp_rank=int(args["dp_rank"]),
            buffer_steps=100_000,
            engine_hash=str(args["engine_hash"]),
        )
    )
    blocks = ZmqBlocks(pub, int(args["capacity_blocks"]), bs, str(args["key_mode"]))
    engine = _Engine(blocks, blocks, Cost(**args.get("cost", {})), bs)  # type: ignore[arg-type]
    engine.blocks = blocks
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                inbox.put(json.loads(line))
        inbox.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    _emit({"ev": "ready", "pub": pub.endpoints["pub"], "replay": pub.endpoints["replay"]})
    while True:
        due = engine.due_wall()
        try:
            msg = inbox.get(timeout=None if due is None else max(0.0, due))
        except queue.Empty:
            engine.advance(engine.now_v())
            continue
        if msg is None or not engine.step(msg):
            break
    blocks.flush(wait=True)
    blocks.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
