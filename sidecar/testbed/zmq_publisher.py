"""A vLLM/SGLang-compatible ZMQ KV-event publisher: the engine in the ZMQ source's tests and demo.
Imports stdlib, msgspec, pyzmq (part of the test bed, never of what an engine imports: `import
engine_hook` loads no zmq, tested). As in vLLM, the engine thread Queue.puts one batch of typed
structs per step; one publisher thread owns the sockets, assigns seq (from 0 per life), msgpacks,
sends and serves replay. `truth()` is what a correct sidecar holds. Process mode and its JSON-lines
protocol: `serve()` below and docs/zmq.md.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

if TYPE_CHECKING:
    from sidecar.testbed.engine_hash import EngineHasher

log = logging.getLogger(__name__)

FLAVOURS = ("vllm", "sglang")
# How blocks are hashed (sidecar/testbed/engine_hash.py, imported only when one is asked for:
# this file runs as a script with stdlib, msgspec and pyzmq).
ENGINE_HASHES = ("random", "vllm_default", "sha256_cbor_seed0", "random_seed")
HASH_KINDS = ("int", "bytes")
ENCODINGS = ("map", "positional", "positional_v0")
MEDIUMS: dict[str, tuple[str, ...]] = {
    "vllm": ("GPU", "CPU", "STORAGE"),
    "sglang": ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"),
}
# Mediums a sidecar with the default medium map accepts; events on others must be dropped.
KNOWN_MEDIUMS = frozenset(MEDIUMS["vllm"] + MEDIUMS["sglang"])
MALFORMED_KINDS = (
    "frame_count",  # [topic, payload]: no seq frame
    "seq_bytes",  # [topic, 3-byte seq, payload]
    "not_msgpack",  # payload is not msgpack at all
    "shape",  # msgpack, but not [ts, events, dp_rank]
    "unknown_event",  # a batch whose only event has an unknown `type`
    "field_types",  # a BlockStored whose fields have the wrong types
)
_FRAME_KINDS = ("frame_count", "seq_bytes")
END_SEQ = b"\xff" * 8  # seq -1, 8 bytes big-endian: the replay end marker
_M64 = (1 << 64) - 1
_TOKENS = [(i * 7919) % 32000 for i in range(1 << 16)]


def key_of(block_hash: int | bytes) -> int:
    """The key codec: ints keep their low 64 bits; bytes are big-endian, low 64 bits; as int64."""
    v = (int.from_bytes(block_hash, "big") if isinstance(block_hash, bytes) else block_hash) & _M64
    return v - (1 << 64) if v >= 1 << 63 else v


def offset_endpoint_port(endpoint: str, dp_rank: int | None) -> str:
    """vLLM's rule: tcp ports move up by the dp rank, inproc gets a suffix, `*` ports stay."""
    if not dp_rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{head}:{int(port) + dp_rank}"
    return endpoint


def infer_bind(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to a concrete host."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class PublisherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One publisher (one engine dp rank). `replay_topic=None`: vLLM's replies carry the topic
    frame, SGLang's do not. `dp_rank=None`: vLLM omits the batch's rank, SGLang sends nil."""

    endpoint: str = "tcp://127.0.0.1:*"
    replay_endpoint: str | None = "tcp://127.0.0.1:*"
    bind: bool | None = None
    topic: str = ""
    flavour: str = "vllm"
    hash_kind: str = "int"
    encoding: str = "map"
    buffer_steps: int = 10_000
    dp_rank: int | None = 0
    block_size: int = 16
    hwm: int = 100_000
    max_queue_size: int = 100_000
    replay_topic: bool | None = None
    health: bool = False
    # random: hashes unrelated to tokens (the default); else hashed from the tokens as the
    # engine does (sidecar/testbed/engine_hash.py): vllm_default, sha256_cbor_seed0, random_seed
    engine_hash: str = "random"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("flavour", self.flavour, FLAVOURS),
            ("hash_kind", self.hash_kind, HASH_KINDS),
            ("encoding", self.encoding, ENCODINGS),
            ("engine_hash", self.engine_hash, ENGINE_HASHES),
        ):
            if value not in allowed:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
        for name, n in (
            ("buffer_steps", self.buffer_steps),
            ("block_size", self.block_size),
            ("hwm", self.hwm),
            ("max_queue_size", self.max_queue_size),
        ):
            if n < 1:
                raise ValueError(f"{name}: must be >= 1, got {n}")
        if self.dp_rank is not None and self.dp_rank < 0:
            raise ValueError(f"dp_rank: must be >= 0, got {self.dp_rank}")
        if "://" not in self.endpoint:
            raise ValueError(f"endpoint: {self.endpoint!r} is not a zmq endpoint")
        if self.replay_endpoint is not None and "://" not in self.replay_endpoint:
            raise ValueError(f"replay_endpoint: {self.replay_endpoint!r} is not a zmq endpoint")


class PublisherError(ValueError):
    """A request the publisher cannot honour (bad hash, medium the encoding cannot carry, ...)."""


# --- wire structs ---------------------------------------------------------------------------
# Field orders are the engines' declaration orders (docs/zmq.md names the sources). msgspec's
# omit_defaults drops defaulted fields at None from maps and trailing ones from arrays, as the
# engines' own structs do.

_OPT_INT = int | None
_OPT_STR = str | None


def _struct(name: str, fields: list[Any], *, array_like: bool, omit: bool = True) -> Any:
    return msgspec.defstruct(
        name, fields, tag=True, array_like=array_like, omit_defaults=omit, gc=False
    )


class _Schema:
    """Event and batch constructors for one (flavour, encoding)."""

    def __init__(self, flavour: str, encoding: str) -> None:
        arr = encoding != "map"
        head: list[Any] = [
            ("block_hashes", list[Any]),
            ("parent_block_hash", Any),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", _OPT_INT),
        ]
        self.has_medium = encoding != "positional_v0"
        self.has_group = flavour == "vllm" and self.has_medium
        if encoding == "positional_v0":  # vLLM 0.9 / early SGLang: no medium, no dp rank
            stored = _struct("BlockStored", head, array_like=True)
            removed = _struct("BlockRemoved", [("block_hashes", list[Any])], array_like=True)
            self.stored: Callable[..., Any] = lambda h, p, t, bs, lo, m, g, *_: stored(
                h, p, t, bs, lo
            )
            self.removed: Callable[..., Any] = lambda h, m, g: removed(h)
            batch = msgspec.defstruct(
                "EventBatch", [("ts", float), ("events", list[Any])], array_like=True, gc=False
            )
            self.batch: Callable[[float, list[Any], int | None], Any] = lambda ts, ev, dp: batch(
                ts, ev
            )
        elif flavour == "vllm":
            stored = _struct(
                "BlockStored",
                [
                    *head,
                    ("medium", _OPT_STR),
                    ("lora_name", _OPT_STR),
                    ("extra_keys", Any, None),
                    ("group_idx", _OPT_INT, None),
                    ("kv_cache_spec_kind", _OPT_STR, None),
                    ("kv_cache_spec_sliding_window", _OPT_INT, None),
                ],
                array_like=arr,
            )
            removed = _struct(
                "BlockRemoved",
                [("block_hashes", list[Any]), ("medium", _OPT_STR), ("group_idx", _OPT_INT, None)],
                array_like=arr,
            )
            # (lora_name, extra_keys): vLLM 0.33 puts an adapter's name first in every block's
            self.stored = lambda h, p, t, bs, lo, m, g, ln=None, ek=None: stored(
                h, p, t, bs, lo, m, ln, ek, g
            )
            self.removed = lambda h, m, g: removed(h, m, g)
            vbatch = msgspec.defstruct(
                "EventBatch",
                [("ts", float), ("events", list[Any]), ("data_parallel_rank", _OPT_INT, None)],
                array_like=True,
                omit_defaults=True,
                gc=False,
            )
            self.batch = lambda ts, ev, dp: vbatch(ts, ev, dp)
        else:
            stored = _struct("BlockStored", [*head, ("medium", _OPT_STR, None)], array_like=arr)
            removed = _struct(
                "BlockRemoved",
                [("block_hashes", list[Any]), ("medium", _OPT_STR, None)],
                array_like=arr,
            )
            self.stored = lambda h, p, t, bs, lo, m, g, *_: stored(h, p, t, bs, lo, m)
            self.removed = lambda h, m, g: removed(h, m)
            # SGLang's EventBatch has no omit_defaults: attn_dp_rank is always there, nil or int.
            sbatch = msgspec.defstruct(
                "EventBatch",
                [("ts", float), ("events", list[Any]), ("attn_dp_rank", _OPT_INT, None)],
                array_like=True,
                gc=False,
            )
            self.batch = lambda ts, ev, dp: sbatch(ts, ev, dp)
        cleared = _struct("AllBlocksCleared", [], array_like=arr)
        self.cleared: Callable[[], Any] = cleared
        self.array_like = arr


def lora_extra_keys(
    lora_name: str | None, extra_keys: list[Any] | None, token_ids: list[int] | None, bs: int
) -> list[Any] | None:
    """Each block's extra keys as vLLM 0.33 sends them: an adapter's name first (its hash
    includes it), then whatever else the block has (a salt, an image)."""
    if lora_name is None:
        return extra_keys
    n = len(token_ids or ()) // bs
    rest = list(extra_keys or []) + [None] * n
    return [[lora_name, *(rest[j] or [])] for j in range(n)]


def _with_extra(event: Any, extra: dict[str, Any], array_like: bool) -> Any:
    """An event plus fields its decoder does not know (newer engines add them all the time)."""
    plain = msgspec.to_builtins(event, builtin_types=(bytes,))
    if array_like:
        return [*plain, *extra.values()]
    return {**plain, **extra}


class _Ctl:
    """A control item on the publisher queue, so faults apply in order with the batches."""

    __slots__ = ("args", "done", "kind")

    def __init__(self, kind: str, *args: Any, done: threading.Event | None = None) -> None:
        self.kind = kind
        self.args = args
        self.done = done


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = getattr(self.server, "healthy", True)
        code = (200 if ok else 503) if self.path == "/health" else 404
        body = b"ok\n" if code == 200 else b"unhealthy\n" if code == 503 else b"not found\n"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


def _thread_cpu_s(t: threading.Thread | None) -> float:
    if t is None or t.ident is None or not t.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    except (OSError, AttributeError):
        return 0.0


class Publisher:
    """PUB (an XPUB, indistinguishable to a SUB, so waits for subscribers need no sleep),
    optional ROUTER replay, bounded replay buffer, fault switches and the truth model."""

    def __init__(self, cfg: PublisherConfig) -> None:
        self.cfg = cfg
        self._schema = _Schema(cfg.flavour, cfg.encoding)
        self.hasher = self._hasher()
        self._topic = cfg.topic.encode()
        self._replay_topic = cfg.flavour == "vllm" if cfg.replay_topic is None else cfg.replay_topic
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(cfg.hwm)
        endpoint = offset_endpoint_port(cfg.endpoint, cfg.dp_rank)
        self.bind = infer_bind(endpoint) if cfg.bind is None else cfg.bind
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if self.bind:
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            replay_ep = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(offset_endpoint_port(cfg.replay_endpoint, cfg.dp_rank))
                replay_ep = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._health: http.server.ThreadingHTTPServer | None = None
        health_url = None
        if cfg.health:
            self._health = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
            self._health.daemon_threads = True
            self._health.healthy = True  # type: ignore[attr-defined]
            health_url = f"http://127.0.0.1:{self._health.server_address[1]}/health"
            threading.Thread(target=self._health.serve_forever, name="health", daemon=True).start()
        self.endpoints: dict[str, Any] = {
            "pub": endpoint,
            "replay": replay_ep,
            "health": health_url,
            "bind": self.bind,
        }
        # Engine side (callers' threads), under _lock.
        # Re-entrant: a burst workload holds it from generation to hand-off, so no other step
        # can slip in between and the seqs it counted stay the ones the thread assigns.
        self._lock = threading.RLock()
        self._collect: list[Any] | None = None
        self._pending: list[Any] = []
        self._pending_truth: list[tuple[str, str, int, list[int]] | None] = []
        self._counts: dict[tuple[int, str, int], int] = {}
        self._next_seq = 0
        self.life = 0
        self.truth_valid = True
        self.events_queued = 0
        self.block_events_queued = 0
        self.excluded_events = 0
        # Publisher-thread side.
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._skip = 0
        self._skip_evicts = False
        self.replay_mode = "normal"
        self.replay_delay_s = 0.0
        self.stats_sent = 0
        self.stats_dropped_live = 0
        self.stats_malformed = 0
        self.stats_replay_requests = 0
        self.stats_replay_batches = 0
        self.stats_replay_ignored = 0
        self.last_burst_send_s = 0.0
        self._subscribers = 0
        self._sub_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    # --- engine side ------------------------------------------------------------------------
    def _hasher(self) -> EngineHasher | None:
        c = self.cfg
        if c.engine_hash == "random":
            return None
        from sidecar.testbed.engine_hash import EngineHasher

        return EngineHasher(c.engine_hash, flavour=c.flavour, hash_kind=c.hash_kind)

    def normalize_hash(self, h: Any) -> int | bytes:
        """A block hash of this publisher's kind (bytes also from hex, or an int as 32 bytes)."""
        if self.cfg.hash_kind == "int":
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= _M64:
                raise PublisherError(f"block hash {h!r} is not an unsigned 64-bit int")
            return h
        if isinstance(h, bytes | bytearray):
            return bytes(h)
        if isinstance(h, str):
            try:
                return bytes.fromhex(h)
            except ValueError:
                raise PublisherError(f"block hash {h!r} is not hex") from None
        if isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _M64:
            return h.to_bytes(32, "big")
        raise PublisherError(f"block hash {h!r} is not bytes, hex or an unsigned int")

    def new_hashes(self, n: int, rng: random.Random | None = None) -> list[int | bytes]:
        """Fresh random hashes of this publisher's kind (ints are uniform, so half are >= 2^63)."""
        r = rng or random
        if self.cfg.hash_kind == "int":
            return [r.getrandbits(64) for _ in range(n)]
        return [r.randbytes(32) for _ in range(n)]

    def _check_place(self, medium: str | None, group: int | None) -> None:
        if medium not in (None, "GPU") and not self._schema.has_medium:
            raise PublisherError(f"encoding {self.cfg.encoding} carries no medium")
        if group not in (None, 0) and not self._schema.has_group:
            raise PublisherError(f"{self.cfg.flavour}/{self.cfg.encoding} events carry no group")

    def store(
        self,
        hashes: Iterable[Any],
        *,
        medium: str | None = "GPU",
        group: int | None = 0,
        parent: Any = None,
        token_ids: list[int] | None = None,
        block_size: int | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """Add a BlockStored to the current step; returns the keys (codec applied). With an
        engine hash and no hashes given, the blocks are hashed from `token_ids` after `parent`.
        A LoRA adapter's blocks (`lora_name`) carry its name in their extra keys, as vLLM's do,
        and so hash apart from the base model's."""
        bs = self.cfg.block_size if block_size is None else block_size
        hashes = list(hashes)
        p = None if parent is None else self.normalize_hash(parent)
        extra_keys = lora_extra_keys(lora_name, (extra or {}).get("extra_keys"), token_ids, bs)
        if not hashes and self.hasher is not None and token_ids:
            hashes = self.hasher.hashes(token_ids, bs, p, extra_keys)
        hs = self._event_hashes(hashes, "BlockStored", medium, group)
        if token_ids is None:
            token_ids = _TOKENS[: len(hs) * bs]
        if lora_name is not None and extra and "extra_keys" in extra:
            extra = {k: v for k, v in extra.items() if k != "extra_keys"}  # in the event itself
        ek = extra_keys if lora_name is not None else None
        ev = self._schema.stored(hs, p, token_ids, bs, lora_id, medium, group, lora_name, ek)
        counted = bs == self.cfg.block_size
        return self._add_blocks(ev, extra, "s", medium, group, hs, counted)

    def remove(
        self,
        hashes: Iterable[Any],
        *,
        medium: str | None = "GPU",
        group: int | None = 0,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """Add a BlockRemoved (one physical block per hash) to the current step."""
        hs = self._event_hashes(hashes, "BlockRemoved", medium, group)
        ev = self._schema.removed(hs, medium, group)
        return self._add_blocks(ev, extra, "r", medium, group, hs, True)

    def _event_hashes(
        self, hashes: Iterable[Any], what: str, medium: str | None, group: int | None
    ) -> list[int | bytes]:
        hs = [self.normalize_hash(h) for h in hashes]
        if not hs:
            raise PublisherError(f"a {what} needs at least one block hash")
        self._check_place(medium, group)
        return hs

    def _add_blocks(
        self,
        ev: Any,
        extra: dict[str, Any] | None,
        op: str,
        medium: str | None,
        group: int | None,
        hs: list[int | bytes],
        counted: bool,
    ) -> list[int]:
        if extra:
            ev = _with_extra(ev, extra, self._schema.array_like)
        keys = [key_of(h) for h in hs]
        counted = counted and (medium is None or medium in KNOWN_MEDIUMS)
        self._add(ev, (op, medium or "GPU", group or 0, keys) if counted else None, len(hs))
        return keys

    def clear(self) -> None:
        """Add an AllBlocksCleared (every medium and group) to the current step."""
        self._add(self._schema.cleared(), ("c", "", 0, []), 0)

    def _add(self, ev: Any, delta: tuple[str, str, int, list[int]] | None, blocks: int) -> None:
        with self._lock:
            self._pending.append(ev)
            self._pending_truth.append(delta)
            self.block_events_queued += blocks
            if delta is None:
                self.excluded_events += 1

    def step(self, *, dp_rank: Any = ..., force: bool = False) -> int | None:
        """End the engine step: queue the pending events as one batch. Returns its seq, or None
        when there was nothing to send (vLLM publishes no empty batches unless `force`).
        `dp_rank` overrides the batch's rank; a foreign rank leaves the truth unchanged."""
        with self._lock:
            if not self._pending and not force:
                return None
            events, self._pending = self._pending, []
            deltas, self._pending_truth = self._pending_truth, []
            rank = self.cfg.dp_rank if dp_rank is ... else dp_rank
            if rank == self.cfg.dp_rank or rank is None:
                for d in deltas:
                    if d is not None:
                        self._apply(*d)
            seq = self._next_seq
            self._next_seq += 1
            self.events_queued += len(events)
            batch = self._schema.batch(time.time(), events, rank)
            if self._collect is not None:
                self._collect.append(batch)
            else:
                self._queue.put(batch)
            return seq

    def _apply(self, op: str, medium: str, group: int, keys: list[int]) -> None:
        c = self._counts
        if op == "c":
            c.clear()
            return
        for k in keys:
            t = (k, medium, group)
            n = c.get(t, 0)
            if op == "s":
                c[t] = n + 1
            elif n > 1:  # a remove of a count already at 0 changes nothing (never negative)
                c[t] = n - 1
            elif n == 1:
                del c[t]

    def truth(self) -> dict[tuple[int, str, int], int]:
        """Store count per (key, medium, group) after every queued step; held = count > 0."""
        with self._lock:
            if not self.truth_valid:
                raise PublisherError("truth was not tracked (a workload ran with truth=false)")
            return dict(self._counts)

    def held(self, group: int | None = None) -> set[tuple[int, str]]:
        """(key, medium) pairs held in `group` (None: any group)."""
        return {(k, m) for (k, m, g) in self.truth() if group is None or g == group}

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # --- faults (ordered with the batches through the queue) --------------------------------

    def gap(self, batches: int, *, evict: bool = False) -> None:
        """The next `batches` batches take their seqs but never reach the PUB socket. They stay
        in the replay buffer (a covered gap) unless `evict`: then they and everything older are
        gone from it, as when buffer_steps batches passed (an uncoverable gap)."""
        if batches < 1:
            raise PublisherError("gap: batches must be >= 1")
        self._queue.put(_Ctl("gap", batches, evict))

    def restart(self) -> None:
        """A new engine life on the same endpoints: seq back to 0, empty cache and buffer."""
        with self._lock:
            self._pending.clear()
            self._pending_truth.clear()
            self._counts.clear()
            self._next_seq = 0
            self.life += 1
            self.hasher = self._hasher()  # a new process (random_seed: a new seed)
            self.truth_valid = True
            self._queue.put(_Ctl("restart"))

    def malformed(self, kind: str, *, replay_as: str = "empty") -> int | None:
        """Send one bad message. Frame-level kinds carry no valid seq and take none; payload-level
        kinds take the next seq, and the replay buffer then holds a valid empty batch under it
        (`replay_as="empty"`: a transit error replay repairs) or the same bad bytes ("same")."""
        if kind not in MALFORMED_KINDS:
            raise PublisherError(f"malformed: kind {kind!r} is not one of {MALFORMED_KINDS}")
        if replay_as not in ("empty", "same"):
            raise PublisherError("malformed: replay_as must be empty or same")
        takes = kind not in _FRAME_KINDS
        with self._lock:
            seq = None
            if takes:
                seq = self._next_seq
                self._next_seq += 1
            good = self._schema.batch(time.time(), [], self.cfg.dp_rank)
            self._queue.put(_Ctl("malformed", kind, takes, replay_as, good))
        return seq

    def set_replay(self, mode: str, delay_s: float = 0.0) -> None:
        """normal | slow (each reply waits delay_s, stalling the publisher thread as a big
        replay would in vLLM) | never (requests are read and dropped)."""
        if mode not in ("normal", "slow", "never"):
            raise PublisherError("replay: mode must be normal, slow or never")
        self.replay_delay_s = float(delay_s)
        self.replay_mode = mode

    def set_health(self, ok: bool) -> None:
        if self._health is None:
            raise PublisherError("health endpoint not enabled (start with health=True)")
        self._health.healthy = bool(ok)  # type: ignore[attr-defined]

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the publisher thread has handled everything queued so far."""
        done = threading.Event()
        self._queue.put(_Ctl("barrier", done=done))
        if not done.wait(timeout):
            raise TimeoutError("publisher thread did not drain its queue in time")

    def wait_subscribers(self, n: int = 1, timeout: float = 10.0) -> int:
        """Block until at least n SUB subscriptions reached the PUB socket."""
        with self._sub_cond:
            if not self._sub_cond.wait_for(lambda: self._subscribers >= n, timeout):
                raise TimeoutError(f"{self._subscribers} subscribers after {timeout}s, want {n}")
            return self._subscribers

    def stats(self) -> dict[str, Any]:
        return {
            "life": self.life,
            "next_seq": self._next_seq,
            "sent": self.stats_sent,
            "dropped_live": self.stats_dropped_live,
            "malformed": self.stats_malformed,
            "events_queued": self.events_queued,
            "block_events_queued": self.block_events_queued,
            "excluded_events": self.excluded_events,
            "buffered": len(self._buffer),
            "replay_requests": self.stats_replay_requests,
            "replay_batches": self.stats_replay_batches,
            "replay_ignored": self.stats_replay_ignored,
            "subscribers": self._subscribers,
            "queue": self._queue.qsize(),
            "held": len(self._counts),
            "truth_valid": self.truth_valid,
            "cpu_s": time.process_time(),
            "publisher_thread_cpu_s": _thread_cpu_s(self._thread),
        }

    def close(self) -> None:
        """Send what is queued (bounded), stop the thread, close the sockets."""
        if self._health is not None:
            self._health.shutdown()
            self._health.server_close()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            # Sockets are not thread-safe: leave them to the daemon thread and process exit.
            log.warning("publisher thread still busy after 5 s; sockets left open")
            return
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publisher thread -------------------------------------------------------------------

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        pub, rep, topic, q = self._pub, self._replay, self._topic, self._queue
        while True:
            # Like vLLM: replay is served between queue waits, at most one request per turn.
            if rep is not None and rep.poll(0):
                self._serve_replay(rep)
            if int(pub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._read_subscriptions(pub)
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            if type(item) is _Ctl:
                self._control(item, enc)
                continue
            self._send(pub, topic, enc.encode(item))

    def _send(self, pub: zmq.Socket[bytes], topic: bytes, payload: bytes) -> None:
        seq = self._seq
        self._seq = seq + 1
        if self._skip:
            self._skipped(seq, payload)
            return
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats_sent += 1

    def _skipped(self, seq: int, payload: bytes) -> None:
        self._skip -= 1
        self.stats_dropped_live += 1
        if self._skip_evicts:
            self._buffer.clear()
        else:
            self._buffer.append((seq, payload))

    def _read_subscriptions(self, pub: zmq.Socket[bytes]) -> None:
        while int(pub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            msg = pub.recv()
            delta = 1 if msg[:1] == b"\x01" else -1 if msg[:1] == b"\x00" else 0
            with self._sub_cond:
                self._subscribers += delta
                self._sub_cond.notify_all()

    def _control(self, item: _Ctl, enc: msgspec.msgpack.Encoder) -> None:
        if item.kind == "barrier":
            pass
        elif item.kind == "gap":
            self._skip, self._skip_evicts = item.args
        elif item.kind == "restart":
            self._seq = 0
            self._skip = 0
            self._buffer.clear()
        elif item.kind == "malformed":
            self._send_malformed(*item.args, enc=enc)
        elif item.kind == "burst":
            (payloads,) = item.args
            t0 = time.perf_counter()
            for payload in payloads:
                self._send(self._pub, self._topic, payload)
            self.last_burst_send_s = time.perf_counter() - t0
        if item.done is not None:
            item.done.set()

    def _send_malformed(
        self, kind: str, takes: bool, replay_as: str, good: Any, *, enc: msgspec.msgpack.Encoder
    ) -> None:
        self.stats_malformed += 1
        pub, topic = self._pub, self._topic
        dp = self.cfg.dp_rank
        if kind == "frame_count":
            pub.send_multipart((topic, enc.encode(good)))
            return
        if kind == "seq_bytes":
            pub.send_multipart((topic, b"\x00\x00\x01", enc.encode(good)))
            return
        bad: bytes
        if kind == "not_msgpack":
            bad = b"\xc1\xc1 this is not msgpack"
        elif kind == "shape":
            bad = enc.encode({"ts": time.time(), "events": "none", "dp": dp})
        elif kind == "unknown_event":
            ev: Any = {"type": "BlockMoved", "block_hashes": [1, 2]}
            if self._schema.array_like:
                ev = ["BlockMoved", [1, 2]]
            bad = enc.encode([time.time(), [ev], dp])
        else:  # field_types
            ev = {
                "type": "BlockStored",
                "block_hashes": "not-a-list",
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": "sixteen",
                "lora_id": None,
                "medium": 3,
            }
            if self._schema.array_like:
                ev = ["BlockStored", "not-a-list", None, [1, 2], "sixteen", None, 3]
            bad = enc.encode([time.time(), [ev], dp])
        seq = self._seq
        self._seq = seq + 1
        pub.send_multipart((topic, seq.to_bytes(8, "big"), bad))
        self._buffer.append((seq, bad if replay_as == "same" else enc.encode(good)))

    def _serve_replay(self, rep: zmq.Socket[bytes]) -> None:
        frames = rep.recv_multipart()
        self.stats_replay_requests += 1
        if len(frames) != 3 or self.replay_mode == "never":
            self.stats_replay_ignored += 1
            log.debug("replay request ignored frames=%d mode=%s", len(frames), self.replay_mode)
            return
        if self.replay_mode == "slow":
            time.sleep(self.replay_delay_s)  # the fault itself: vLLM's thread is busy this long
        ident, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        head: tuple[bytes, ...] = (ident, b"", self._topic) if self._replay_topic else (ident, b"")
        for seq, payload in list(self._buffer):
            if seq >= start:
                rep.send_multipart((*head, seq.to_bytes(8, "big"), payload))
                self.stats_replay_batches += 1
        end: tuple[bytes, ...] = (ident, b"", b"") if self._replay_topic else (ident, b"")
        rep.send_multipart((*end, END_SEQ, b""))

    # --- workload ---------------------------------------------------------------------------

    def workload(self, spec: Workload, stop: threading.Event | None = None) -> dict[str, Any]:
        """Run `spec` on the calling thread (the engine thread); returns what it did."""
        self.check_workload(spec)
        if not spec.truth:
            with self._lock:
                self.truth_valid = False
        if not spec.burst:
            return self._generate(spec, stop or threading.Event())
        with self._lock:
            self._collect = []
            try:
                out = self._generate(spec, stop or threading.Event())
                batches = self._collect
            finally:
                self._collect = None
            enc = msgspec.msgpack.Encoder()
            payloads = [enc.encode(b) for b in batches]
            done = threading.Event()
            self._queue.put(_Ctl("burst", payloads, done=done))
        if not done.wait(600):
            raise TimeoutError("burst was not sent within 600 s")
        out["send_s"] = self.last_burst_send_s
        out["bytes"] = sum(len(p) for p in payloads)
        return out

    def check_workload(self, spec: Workload) -> None:
        """Raise PublisherError if this publisher's encoding cannot carry the spec's places."""
        for m in spec.mediums or ():
            self._check_place(m, 0)
        for g in spec.groups:
            self._check_place("GPU", g)

    def _generate(self, w: Workload, stop: threading.Event) -> dict[str, Any]:
        if self.hasher is not None:
            return self._generate_hashed(w, stop, self.hasher)
        rng = random.Random(w.seed)
        meds = list(w.mediums or MEDIUMS[self.cfg.flavour][:2])
        places = [(m, g) for m in meds for g in w.groups]
        held: dict[tuple[str, int], list[int | bytes]] = {p: [] for p in places}
        n_held = 0
        schema, bs, n_blocks = self._schema, self.cfg.block_size, w.blocks_per_event
        tokens = _TOKENS[: n_blocks * bs]
        fresh = (
            (lambda: rng.getrandbits(64))
            if self.cfg.hash_kind == "int"
            else (lambda: rng.randbytes(32))
        )
        done = steps = 0
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        while (w.events == 0 or done < w.events) and not stop.is_set():
            for _ in range(w.batch_events):
                m, g = places[rng.randrange(len(places))]
                lst = held[(m, g)]
                if lst and (n_held >= w.max_held or rng.random() < w.remove_prob):
                    hs: list[int | bytes] = []
                    for _ in range(min(n_blocks, len(lst))):
                        i = rng.randrange(len(lst))
                        lst[i], lst[-1] = lst[-1], lst[i]
                        hs.append(lst.pop())
                    n_held -= len(hs)
                    ev = schema.removed(hs, m, g)
                    op = "r"
                else:
                    hs = [
                        lst[rng.randrange(len(lst))]
                        if lst and rng.random() < w.dup_prob
                        else fresh()
                        for _ in range(n_blocks)
                    ]
                    lst.extend(hs)
                    n_held += len(hs)
                    parent = lst[-len(hs) - 1] if len(lst) > len(hs) else None
                    ev = schema.stored(hs, parent, tokens[: len(hs) * bs], bs, None, m, g)
                    op = "s"
                self._enqueue(ev, hs, (op, m, g) if w.truth else None)
                done += len(hs)
            steps += 1
            self._step_paced(w, done, t0, stop)
        return _summary(done, steps, t0, cpu0, n_held)

    def _enqueue(self, ev: Any, hs: list[int | bytes], truth: tuple[str, str, int] | None) -> None:
        """One event of `hs` for the next step, with its change to the truth (None: untracked)."""
        delta = None if truth is None else (*truth, [key_of(h) for h in hs])
        with self._lock:
            self._pending.append(ev)
            self._pending_truth.append(delta)
            self.block_events_queued += len(hs)

    def _step_paced(self, w: Workload, done: int, t0: float, stop: threading.Event) -> None:
        """Publish the step, then wait until `done` events are due at `w.rate` (0: no wait)."""
        self.step()
        if w.rate > 0:
            ahead = done / w.rate - (time.monotonic() - t0)
            if ahead > 0:
                stop.wait(ahead)

    def _generate_hashed(
        self, w: Workload, stop: threading.Event, hasher: EngineHasher
    ) -> dict[str, Any]:
        """_generate with blocks hashed from their tokens: a store starts a chain or continues
        one from a held block (its parent), with fresh tokens; a duplicate re-stores a held
        block with its parent and tokens; a remove takes held blocks."""
        rng = random.Random(w.seed)
        meds = list(w.mediums or MEDIUMS[self.cfg.flavour][:2])
        places = [(m, g) for m in meds for g in w.groups]
        held: dict[tuple[str, int], list[int | bytes]] = {p: [] for p in places}
        made: dict[int | bytes, tuple[int | bytes | None, list[int]]] = {}  # hash -> its store
        n_held = 0
        schema, bs, n_blocks = self._schema, self.cfg.block_size, w.blocks_per_event
        done = steps = 0
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        while (w.events == 0 or done < w.events) and not stop.is_set():
            for _ in range(w.batch_events):
                m, g = places[rng.randrange(len(places))]
                lst = held[(m, g)]
                parent: int | bytes | None
                if lst and (n_held >= w.max_held or rng.random() < w.remove_prob):
                    hs: list[int | bytes] = []
                    for _ in range(min(n_blocks, len(lst))):
                        i = rng.randrange(len(lst))
                        lst[i], lst[-1] = lst[-1], lst[i]
                        hs.append(lst.pop())
                    n_held -= len(hs)
                    ev = schema.removed(hs, m, g)
                    op = "r"
                elif lst and rng.random() < w.dup_prob:
                    h = lst[rng.randrange(len(lst))]
                    parent, toks = made[h]
                    hs = [h]
                    lst.append(h)
                    n_held += 1
                    ev = schema.stored(hs, parent, toks, bs, None, m, g)
                    op = "s"
                else:
                    parent = lst[rng.randrange(len(lst))] if lst and rng.random() < 0.7 else None
                    toks = [rng.randrange(32000) for _ in range(n_blocks * bs)]
                    hs = hasher.hashes(toks, bs, parent)
                    prev = parent
                    for j, h in enumerate(hs):
                        made[h] = (prev, toks[j * bs : (j + 1) * bs])
                        prev = h
                    lst.extend(hs)
                    n_held += len(hs)
                    ev = schema.stored(hs, parent, toks, bs, None, m, g)
                    op = "s"
                self._enqueue(ev, hs, (op, m, g) if w.truth else None)
                done += len(hs)
            steps += 1
            self._step_paced(w, done, t0, stop)
        return _summary(done, steps, t0, cpu0, n_held)


def _summary(done: int, steps: int, t0: float, cpu0: float, held: int) -> dict[str, Any]:
    return {
        "block_events": done,
        "steps": steps,
        "elapsed_s": time.monotonic() - t0,
        "engine_thread_cpu_s": time.thread_time() - cpu0,
        "held": held,
    }


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Random stores/removes (duplicate stores of held hashes included) over several mediums.
    `events` counts block events (hashes), 0 = until stopped; `rate` is block events/s, 0 = as
    fast as the engine thread goes. Removes only hit held blocks, one count each. `burst`:
    generate and encode every batch first, then send them flat out, timed as `send_s` (for a
    consumer's benchmark, so the send rate is not bounded by generating)."""

    events: int = 10_000
    rate: float = 0.0
    batch_events: int = 8
    blocks_per_event: int = 4
    mediums: list[str] | None = None
    groups: list[int] = msgspec.field(default_factory=lambda: [0])
    dup_prob: float = 0.1
    remove_prob: float = 0.4
    max_held: int = 10_000
    seed: int = 0
    truth: bool = True
    burst: bool = False

    def __post_init__(self) -> None:
        if self.events < 0 or self.rate < 0:
            raise ValueError("events and rate must be >= 0")
        if self.batch_events < 1 or self.blocks_per_event < 1 or not self.groups:
            raise ValueError("batch_events and blocks_per_event must be >= 1, groups non-empty")
        if not (0 <= self.dup_prob <= 1 and 0 <= self.remove_prob <= 1):
            raise ValueError("dup_prob and remove_prob must be in [0, 1]")
        if self.burst and (self.events == 0 or self.rate > 0):
            raise ValueError("burst needs events > 0 and rate 0")


# --- process mode ---------------------------------------------------------------------------


def _hash_json(h: int | bytes) -> int | str:
    return h.hex() if isinstance(h, bytes) else h


class _Server:
    """The JSON-lines command loop of process mode (one reply line per command, in order)."""

    def __init__(self, pub: Publisher, out: Any) -> None:
        self.pub = pub
        self.out = out
        self._wl: threading.Thread | None = None
        self._wl_stop = threading.Event()
        self._wl_result: dict[str, Any] | None = None
        self._wl_error: str | None = None
        self._rng = random.Random(int.from_bytes(os.urandom(8), "big"))

    def reply(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def handle(self, line: str) -> bool:
        """Handle one command line; False when the loop should end."""
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
                raise PublisherError('a command is a JSON object with a string "cmd"')
            cmd: str = req.pop("cmd")
            fn = getattr(self, "cmd_" + cmd, None)
            if fn is None:
                raise PublisherError(f"unknown command {cmd!r}")
            out: dict[str, Any] = fn(**req)
        except (PublisherError, TimeoutError, TypeError, ValueError) as exc:
            self.reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return True
        self.reply({"ok": True, **out})
        return cmd != "quit"

    def _maybe_step(self, step: bool, wait: bool = True) -> dict[str, Any]:
        if not step:
            return {}
        seq = self.pub.step()
        if wait:
            self.pub.flush()
        return {"seq": seq}

    def cmd_store(
        self,
        hashes: list[Any] | None = None,
        n: int | None = None,
        step: bool = False,
        **kw: Any,
    ) -> dict[str, Any]:
        hs: list[Any] = list(hashes or [])
        if n:
            hs += self.pub.new_hashes(n, self._rng)
        pub = self.pub
        if not hs and pub.hasher is not None and kw.get("token_ids"):  # hashed from the tokens
            p = kw.get("parent")
            bs = kw.get("block_size") or pub.cfg.block_size
            hs = pub.hasher.hashes(
                kw["token_ids"],
                bs,
                None if p is None else pub.normalize_hash(p),
                lora_extra_keys(
                    kw.get("lora_name"),
                    (kw.get("extra") or {}).get("extra_keys"),
                    kw["token_ids"],
                    bs,
                ),
            )
        norm = [self.pub.normalize_hash(h) for h in hs]
        keys = self.pub.store(norm, **kw)
        return {"hashes": [_hash_json(h) for h in norm], "keys": keys, **self._maybe_step(step)}

    def cmd_remove(self, hashes: list[Any], step: bool = False, **kw: Any) -> dict[str, Any]:
        keys = self.pub.remove(hashes, **kw)
        return {"keys": keys, **self._maybe_step(step)}

    def cmd_clear(self, step: bool = False) -> dict[str, Any]:
        self.pub.clear()
        return self._maybe_step(step)

    def cmd_step(
        self, dp_rank: Any = ..., force: bool = False, wait: bool = True
    ) -> dict[str, Any]:
        seq = self.pub.step(dp_rank=dp_rank, force=force)
        if wait:
            self.pub.flush()
        return {"seq": seq}

    def cmd_flush(self) -> dict[str, Any]:
        self.pub.flush()
        return {}

    def cmd_truth(self, group: int | None = None) -> dict[str, Any]:
        t = self.pub.truth()
        rows = sorted((k, m, g, c) for (k, m, g), c in t.items() if group is None or g == group)
        return {
            "held": [[k, m, g] for k, m, g, _ in rows],
            "counts": [list(r) for r in rows],
            "next_seq": self.pub.next_seq,
            "life": self.pub.life,
        }

    def cmd_gap(self, batches: int = 1, evict: bool = False) -> dict[str, Any]:
        self.pub.gap(batches, evict=evict)
        return {}

    def cmd_restart(self) -> dict[str, Any]:
        self.pub.restart()
        self.pub.flush()
        return {"life": self.pub.life}

    def cmd_malformed(self, kind: str, replay_as: str = "empty") -> dict[str, Any]:
        seq = self.pub.malformed(kind, replay_as=replay_as)
        self.pub.flush()
        return {"seq": seq}

    def cmd_replay(self, mode: str = "normal", delay_s: float = 0.0) -> dict[str, Any]:
        self.pub.set_replay(mode, delay_s)
        return {}

    def cmd_health(self, ok: bool = True) -> dict[str, Any]:
        self.pub.set_health(ok)
        return {}

    def cmd_wait_subscribers(self, n: int = 1, timeout_s: float = 10.0) -> dict[str, Any]:
        return {"subscribers": self.pub.wait_subscribers(n, timeout_s)}

    def cmd_stats(self) -> dict[str, Any]:
        s = self.pub.stats()
        s["workload_running"] = self._wl is not None and self._wl.is_alive()
        s["workload"] = self._wl_result
        s["engine_thread_cpu_s"] = _thread_cpu_s(self._wl)
        return s

    def cmd_workload(self, wait: bool = False, **kw: Any) -> dict[str, Any]:
        if self._wl is not None and self._wl.is_alive():
            raise PublisherError("a workload is already running (send stop first)")
        self._wl_stop = threading.Event()
        self._wl_result = None
        self._wl_error = None

        try:
            spec = msgspec.convert(kw, Workload)
        except msgspec.ValidationError as exc:
            raise PublisherError(f"workload: {exc}") from None
        self.pub.check_workload(spec)

        def run() -> None:
            try:
                self._wl_result = self.pub.workload(spec, self._wl_stop)
            except (PublisherError, TimeoutError) as exc:
                self._wl_error = f"{type(exc).__name__}: {exc}"

        self._wl = threading.Thread(target=run, name="engine-workload", daemon=True)
        self._wl.start()
        if not wait:
            return {"started": True}
        return self._finish_workload(stop=False)

    def _finish_workload(self, *, stop: bool) -> dict[str, Any]:
        if self._wl is None:
            raise PublisherError("no workload was started")
        if stop:
            self._wl_stop.set()
        self._wl.join()
        if self._wl_error is not None:
            raise PublisherError(self._wl_error)
        self.pub.flush()
        return {"workload": self._wl_result}

    def cmd_stop(self) -> dict[str, Any]:
        return self._finish_workload(stop=True)

    def cmd_quit(self) -> dict[str, Any]:
        if self._wl is not None and self._wl.is_alive():
            self._wl_stop.set()
            self._wl.join()
        return {}


def serve(pub: Publisher, inp: Any = None, out: Any = None) -> None:
    """Process mode: one JSON object per stdin line, one JSON reply per line on stdout.

    Start: `python -m sidecar.testbed.zmq_publisher [--flavour vllm|sglang] [--hash-kind int|bytes]
    [--encoding map|positional|positional_v0] [--endpoint tcp://127.0.0.1:*] [--replay-endpoint
    EP|none] [--bind|--connect] [--topic T] [--buffer-steps N] [--dp-rank N|none]
    [--block-size N] [--replay-topic auto|yes|no] [--health]`. First line on stdout:
    {"ready": true, "pid", "pub", "replay", "health", "bind", "flavour", "hash_kind", ...}.
    Replies are {"ok": true, ...} or {"ok": false, "error": "..."} (the loop goes on).
    Hashes in JSON: ints (int kind) or hex strings (bytes kind); keys are the codec's int64.

      store    {hashes?, n?, medium?, group?, parent?, block_size?, lora_id?, lora_name?,
                token_ids?, extra?, step?}         -> {hashes, keys, seq?} (n: fresh random hashes)
      remove   {hashes, medium?, group?, extra?, step?}           -> {keys, seq?}
      clear    {step?}                                            -> {seq?}
      step     {dp_rank?, force?, wait?=true}                     -> {seq}  (null: nothing)
      flush    {}                                                 -> {}
      truth    {group?}        -> {held: [[key, medium, group]], counts: [[k, m, g, n]], ...}
      gap      {batches=1, evict?=false}                          -> {}
      restart  {}                                                 -> {life}
      malformed {kind, replay_as?="empty"|"same"}   -> {seq} (null: no seq taken)
      replay   {mode="normal"|"slow"|"never", delay_s?}           -> {}
      health   {ok}                                               -> {}
      wait_subscribers {n=1, timeout_s=10}                        -> {subscribers}
      stats    {}                                                 -> counters, cpu_s, ...
      workload {events, rate, batch_events, blocks_per_event, mediums, groups, dup_prob,
                remove_prob, max_held, seed, truth, burst, wait?=false} -> {started} | {workload}
      stop     {}                                       -> {workload} (stops and joins it)
      quit     {}                                                 -> {} and exit 0
    """
    inp = sys.stdin if inp is None else inp
    srv = _Server(pub, sys.stdout if out is None else out)
    for line in inp:
        if line.strip() and not srv.handle(line):
            break
    else:
        srv.cmd_quit()


def _parse(argv: Sequence[str] | None) -> PublisherConfig:
    ap = argparse.ArgumentParser(
        prog="python -m sidecar.testbed.zmq_publisher",
        description="A vLLM/SGLang-compatible ZMQ KV-event publisher driven by JSON lines.",
        epilog="Commands: see sidecar.testbed.zmq_publisher.serve and docs/zmq.md.",
    )
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:*")
    ap.add_argument("--replay-endpoint", default="tcp://127.0.0.1:*", help="or none")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--bind", dest="bind", action="store_const", const=True, default=None)
    g.add_argument("--connect", dest="bind", action="store_const", const=False)
    ap.add_argument("--topic", default="")
    ap.add_argument("--flavour", default="vllm")
    ap.add_argument("--hash-kind", default="int")
    ap.add_argument("--encoding", default="map")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--dp-rank", default="0", help="an int or none")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hwm", type=int, default=100_000)
    ap.add_argument("--max-queue-size", type=int, default=100_000)
    ap.add_argument("--replay-topic", default="auto", choices=("auto", "yes", "no"))
    ap.add_argument("--health", action="store_true")
    ap.add_argument("--engine-hash", default="random", choices=ENGINE_HASHES)
    a = ap.parse_args(argv)
    try:
        dp = None if a.dp_rank == "none" else int(a.dp_rank)
    except ValueError:
        raise ValueError(f"dp_rank: {a.dp_rank!r} is not an int or none") from None
    return PublisherConfig(
        endpoint=a.endpoint,
        replay_endpoint=None if a.replay_endpoint == "none" else a.replay_endpoint,
        bind=a.bind,
        topic=a.topic,
        flavour=a.flavour,
        hash_kind=a.hash_kind,
        encoding=a.encoding,
        buffer_steps=a.buffer_steps,
        dp_rank=dp,
        block_size=a.block_size,
        hwm=a.hwm,
        max_queue_size=a.max_queue_size,
        replay_topic={"auto": None, "yes": True, "no": False}[a.replay_topic],
        health=a.health,
        engine_hash=a.engine_hash,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        cfg = _parse(argv)
    except ValueError as exc:
        sys.stderr.write(f"zmq_publisher: invalid config: {exc}\n")
        return 2
    try:
        pub = Publisher(cfg)
    except zmq.ZMQError as exc:
        sys.stderr.write(f"zmq_publisher: cannot open sockets: {exc}\n")
        return 1
    # The effective config, then the endpoints as bound (`bind` as decided, ports resolved).
    ready = {"ready": True, "pid": os.getpid(), **msgspec.structs.asdict(cfg), **pub.endpoints}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    try:
        serve(pub)
    finally:
        pub.close()
    return 0


# --- client ---------------------------------------------------------------------------------


class PublisherProcess:
    """Runs process mode as a real child process and drives it (tests, demo, benchmarks).

    `PublisherProcess(flavour="sglang", hash_kind="bytes", replay_endpoint=None, health=True)`:
    keyword args are PublisherConfig fields. `call("store", n=3, step=True)` returns the reply
    and raises PublisherError on {"ok": false}. `ready` holds the endpoints it printed."""

    def __init__(self, *, timeout: float = 30.0, **cfg: Any) -> None:
        # Run the file itself, not `-m`: no package is imported on the way (this module needs
        # stdlib, msgspec and pyzmq only), which keeps its start short.
        argv = [sys.executable, str(Path(__file__).resolve()), *self.args(**cfg)]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self._recv(timeout)

    @staticmethod
    def args(**cfg: Any) -> list[str]:
        out: list[str] = []
        for k, v in cfg.items():
            if k not in PublisherConfig.__struct_fields__:
                raise TypeError(f"unknown publisher option {k!r}")
            flag = "--" + k.replace("_", "-")
            if k == "bind":
                out += [] if v is None else ["--bind" if v else "--connect"]
            elif k == "health":
                out += ["--health"] if v else []
            elif k == "replay_topic":
                out += [flag, {None: "auto", True: "yes", False: "no"}[v]]
            else:
                out += [flag, "none" if v is None else str(v)]
        return out

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _recv(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("zmq publisher process said nothing") from None
        if not line:
            raise EOFError(f"zmq publisher process exited rc={self.p.wait()}")
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.p.stdin.flush()
        out = self._recv(timeout)
        if not out.get("ok"):
            raise PublisherError(str(out.get("error")))
        return out

    def truth(self, group: int | None = None) -> set[tuple[int, str]]:
        """Held (key, medium) pairs, optionally of one group."""
        rows = self.call("truth", group=group)["held"]
        return {(k, m) for k, m, _ in rows}

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.call("quit", timeout=10)
                self.p.wait(timeout=10)
            except (TimeoutError, EOFError, BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        for f in (self.p.stdin, self.p.stdout):
            if f is not None:
                f.close()

    def __enter__(self) -> PublisherProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
