"""A vLLM-style KV-event publisher for benchmarks: the baseline bench.hotpath measures against.

Imports: stdlib, msgspec, pyzmq. Shaped as vLLM's ZmqEventPublisher (facts, not its code): the
engine thread builds one batch of typed event structs per step and `Queue.put`s it; one thread
takes batches (`get(timeout=0.1)`, so it also wakes 10 times a second when idle), numbers them,
msgpack-encodes, sends [topic, seq, payload] on a PUB socket, keeps them for replay and polls a
ROUTER replay socket between batches.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


class Publisher:
    """PUB on `endpoint` (bound), replay ROUTER on `replay_endpoint`; `publish()` never blocks."""

    def __init__(self, endpoint: str, replay_endpoint: str, buffer_steps: int = 10_000) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=100_000)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._running = True
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        with contextlib.suppress(queue.Full):  # vLLM drops (and logs) when its queue is full
            self._queue.put_nowait(batch)

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        topic = b"kv-events"
        seq = 0
        while self._running or not self._queue.empty():
            if self._replay.poll(0):
                self._replay.recv_multipart()  # not exercised by the benchmark
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            payload = enc.encode(batch)
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1
            self.sent += 1

    def close(self) -> None:
        self._running = False
        self._thread.join(5.0)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()


def step_batch(
    new: list[int], old: list[int], parent: int | None, tokens: list[int], block_size: int
) -> KVEventBatch:
    """One engine step's events: the blocks it cached (with their tokens, as vLLM sends them)
    and the blocks it evicted."""
    return KVEventBatch(
        time.time(),
        [
            BlockStored(new, parent, tokens[: len(new) * block_size], block_size, None, "GPU"),
            BlockRemoved(old, "GPU"),
        ],
        0,
    )
