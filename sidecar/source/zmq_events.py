"""vLLM / SGLang KV-event payloads (msgpack) decoded into per-block arrays; never raises.

Imports: stdlib, numpy, msgspec. `[ts, events, dp_rank?]`; events are tagged maps (`type`) or,
from older releases, positional arrays (tag first, trailing fields optional); unknown fields are
ignored, absent ones tolerated, unknown event types skipped. Typed decoders first, generic as a
fallback; each event's hashes stay msgpack (msgspec.Raw) until the flush reads a whole loop
turn's at once (hash_arrays.py: ints or byte digests, their low 64 bits as int64 patterns; in
the common case BlockReader, one C pass over every segment, whose result must equal to_blocks').
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sidecar.shm_ring import compiled
from sidecar.source.hash_arrays import read_keys

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
KNOWN = frozenset((STORED, REMOVED, CLEARED))

# Decode-error reasons (labels of kvcm_sidecar_zmq_decode_errors_total).
ERR_NOT_MSGPACK = "not_msgpack"  # not msgpack, or not [ts, events, dp_rank?]
ERR_EVENT = "malformed_event"  # a known event type with unreadable fields
# Per-event drops (labels of kvcm_sidecar_zmq_dropped_total), besides whole-batch dp_rank drops.
DROP_UNKNOWN_EVENT = "unknown_event"
DROP_BLOCK_SIZE = "block_size"
DROP_MEDIUM = "unknown_medium"


# An absent Raw field: one shared empty Raw (immutable), not a new one per event and field.
_ABSENT = msgspec.Raw()


def _structs(positional: bool, full: bool = False) -> tuple[Any, Any, Any]:
    """(BlockStored, BlockRemoved, AllBlocksCleared) for one encoding; `full`: BlockStored
    keeps what re-keying reads (tokens, parent, LoRA, extra keys, the group's kind) as Raw."""
    raw = msgspec.Raw  # decoded lazily, never materialised (token_ids is the bulk of a batch)
    opts: dict[str, Any] = {"tag": True, "array_like": positional, "gc": False}
    if not positional:
        opts["tag_field"] = "type"
    if positional:
        stored_fields: list[Any] = [
            ("block_hashes", raw),
            ("parent_block_hash", raw, _ABSENT),
            ("token_ids", raw, _ABSENT),
            ("block_size", int | None, None),
            ("lora_id", raw, _ABSENT),
            ("medium", str | None, None),
            ("lora_name", raw, _ABSENT),
            ("extra_keys", raw, _ABSENT),
            ("group_idx", int | None, None),
        ]
        if full:
            stored_fields.append(("kv_cache_spec_kind", str | None, None))
    elif full:  # by name, with what re-keying reads
        stored_fields = [
            ("block_hashes", raw),
            ("parent_block_hash", raw, _ABSENT),
            ("token_ids", raw, _ABSENT),
            ("block_size", int | None, None),
            ("lora_id", raw, _ABSENT),
            ("medium", str | None, None),
            ("lora_name", raw, _ABSENT),
            ("extra_keys", raw, _ABSENT),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
        ]
    else:  # by name: undeclared fields (token_ids, parent_block_hash, ...) are skipped
        stored_fields = [
            ("block_hashes", raw),
            ("block_size", int | None, None),
            ("medium", str | None, None),
            ("group_idx", int | None, None),
        ]
    removed_fields: list[Any] = [
        ("block_hashes", raw),
        ("medium", str | None, None),
        ("group_idx", int | None, None),
    ]
    # Class attributes, not fields (the decoder neither reads nor wants them): every event
    # answers the four attributes the fold looks up its code by.
    none = {"block_size": None, "medium": None, "group_idx": None, "block_hashes": None}
    return (
        msgspec.defstruct(STORED, stored_fields, **opts),
        msgspec.defstruct(REMOVED, removed_fields, namespace={"block_size": None}, **opts),
        msgspec.defstruct(CLEARED, [], namespace=none, **opts),
    )


def _batch_decoder(events_t: Any) -> msgspec.msgpack.Decoder[Any]:
    batch = msgspec.defstruct(
        "EventBatch",
        [("ts", float), ("events", events_t), ("dp_rank", int | None, None)],
        array_like=True,
        gc=False,
    )
    return msgspec.msgpack.Decoder(batch)


class _Variant:
    """One typed decoding (an encoding: maps or positional) -> batch and single-event decoders."""

    def __init__(self, positional: bool, full: bool = False) -> None:
        s, r, c = _structs(positional, full)
        self.stored, self.removed, self.cleared = s, r, c
        self.batch = _batch_decoder(list[s | r | c])  # type: ignore[valid-type]
        self.event = msgspec.msgpack.Decoder(s | r | c)


_VARIANTS = [_Variant(False), _Variant(True)]
_FULL_VARIANTS = [_Variant(False, True), _Variant(True, True)]  # key modes rolling / both
_TAG: dict[type, str] = {
    cls: name
    for v in _VARIANTS + _FULL_VARIANTS
    for cls, name in ((v.stored, STORED), (v.removed, REMOVED), (v.cleared, CLEARED))
}
_RAW_BATCH = _batch_decoder(list[msgspec.Raw])
# Event codes that are no block events: a clear, or a drop (by reason).
_CLEAR, _DROP_SIZE, _DROP_MEDIUM, _DROP_GROUP = -1, -2, -3, -4
_DROPPED = {_DROP_SIZE: DROP_BLOCK_SIZE, _DROP_MEDIUM: DROP_MEDIUM, _DROP_GROUP: ERR_EVENT}
_CODES_MAX = 1024
_GENERIC = msgspec.msgpack.Decoder()


@dataclass
class Blocks:
    """Block events in order, between clears: one entry per block hash."""

    keys: np.ndarray  # int64 bit patterns
    mediums: np.ndarray  # uint8 index into the medium table
    groups: np.ndarray  # uint8 group_idx
    signs: np.ndarray  # int8: +1 stored, -1 removed


class Segment(msgspec.Struct):
    """Block events of one batch between clears, one entry per event in each list: its hashes
    as they came (msgpack, read at the flush) and its code (medium index << 8 | group << 1 |
    stored). A Struct: built once per batch, on the hot path, with no Python frame."""

    hashes: list[Any] = msgspec.field(default_factory=list)  # msgspec.Raw: one array per event
    codes: list[int] = msgspec.field(default_factory=list)
    origin: Any = None  # the owner's note of the batch it came from
    events: list[Any] = msgspec.field(default_factory=list)  # key modes rolling / both: structs


class Decoded(msgspec.Struct):
    """A decoded payload: `parts` alternates Segments and the string CLEARED, in event order."""

    ok: bool
    dp_rank: int | None = None
    error: str = ""  # why not ok
    parts: list[Segment | str] = msgspec.field(default_factory=list)


class Folded:
    """Several segments' block events as arrays, and per event its code, its number of hashes
    and whether they were unreadable (`bad`: event indexes, ascending; such events hold none)."""

    __slots__ = ("bad", "blocks", "codes", "counts")

    def __init__(self, blocks: Blocks, codes: np.ndarray, counts: np.ndarray, bad: list[int]):
        self.blocks, self.codes, self.counts, self.bad = blocks, codes, counts, bad

    def events(self, first: int = 0, end: int | None = None) -> np.ndarray:
        """Events [first, end) per medium index and type: [2 * medium + 1] stored,
        [2 * medium] removed (512 entries); unreadable ones not counted."""
        c = self.codes[first:end]
        ok = np.ones(len(c), np.bool_)
        ok[
            [i - first for i in self.bad if first <= i < (len(self.codes) if end is None else end)]
        ] = False
        return np.bincount(((c >> 7 & ~1) | (c & 1))[ok], minlength=512)

    def block(self, event: int) -> int:
        """Index of the first block of event `event`."""
        return int(self.counts[:event].sum())


def to_blocks(segments: list[Segment]) -> Folded:
    """One set of arrays for several segments' block events."""
    if len(segments) == 1:
        hashes, codes = segments[0].hashes, segments[0].codes
    else:
        hashes, codes = [], []
        for seg in segments:
            hashes += seg.hashes
            codes += seg.codes
    keys, n, bad = read_keys(hashes)
    c = np.array(codes, np.int64)
    stored = c & 1
    blocks = Blocks(
        keys,
        np.repeat((c >> 8).astype(np.uint8), n),
        np.repeat(((c >> 1) & 0x7F).astype(np.uint8), n),
        np.repeat((2 * stored - 1).astype(np.int8), n),
    )
    return Folded(blocks, c, n, bad)


class BlockReader:
    """to_blocks' common case in one C pass (compiled.accel.zmq_keys): segments whose hashes
    are all msgpack ints / bins -> per-block keys, places (medium << 8 | group) and signs,
    and their events counted. Scratch arrays reused from flush to flush: what it returns is
    valid until its next read."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = np.empty((3, 4096), np.int64)

    def read(
        self, segments: list[Segment], events: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        """(keys, places, signs, the one place of them all or -1), `events` ([2 * medium +
        stored], int64) counted; None (nothing done): no C loops, or an event that the
        general path must read (to_blocks: unreadable or unusual hashes)."""
        accel = compiled.accel
        if accel is None:
            return None
        buf = self._buf
        got = accel.zmq_keys(segments, buf, events)
        if type(got) is int:  # the scratch is short: grow it, read again
            self._buf = buf = np.empty((3, max(got, 2 * buf.shape[1])), np.int64)
            got = accel.zmq_keys(segments, buf, events)
        if got is None:
            return None
        n, place = got
        return buf[0, :n], buf[1, :n], buf[2, :n], place


class EventDecoder:
    """Payload bytes -> Decoded, for one replica's medium map and expected block size."""

    def __init__(
        self,
        medium_index: Mapping[str, int],
        block_size: int,
        dp_rank: int | None = None,
        full: bool = False,
    ) -> None:
        self.medium_index = dict(medium_index)  # engine medium name -> medium table index
        self.default_medium = "GPU"  # what an absent medium means (vLLM and SGLang)
        self.block_size = block_size
        self.dp_rank = dp_rank  # batches of another rank are not folded (None: fold all)
        # Running totals (metrics): clears and per-event drops; events and blocks applied are
        # counted per flush by the Stream (to_blocks).
        self.cleared = 0
        self.drops: dict[str, int] = {}
        self.dropped_recently = False  # the owner logs drops (once per interval) and clears
        self.full = full  # keep each event (re-keying reads its tokens at the flush)
        self._variants = _FULL_VARIANTS if full else _VARIANTS
        self._order = list(range(len(_VARIANTS)))  # the variant that worked last goes first
        self._codes: dict[tuple[type, Any, Any, Any], int] = {}  # see _code()

    def decode(self, payload: bytes) -> Decoded:
        try:
            try:  # the variant that worked last, at once (the common case: one frame less)
                batch = self._variants[self._order[0]].batch.decode(payload)
            except msgspec.ValidationError:
                return self._decode(payload)
            return self._fold(batch.dp_rank, batch.events)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            return Decoded(False, error=f"{ERR_NOT_MSGPACK}: {exc}")
        except (OverflowError, RecursionError, MemoryError) as exc:  # hostile nesting or sizes
            return Decoded(False, error=f"{ERR_NOT_MSGPACK}: {type(exc).__name__}")

    def _decode(self, payload: bytes) -> Decoded:
        for n, i in enumerate(self._order):
            v = self._variants[i]
            try:
                batch = v.batch.decode(payload)
            except msgspec.ValidationError:
                continue
            if n:
                self._order.insert(0, self._order.pop(n))
            return self._fold(batch.dp_rank, batch.events)
        # No typed decoding reads the whole batch: decode event by event.
        raw = _RAW_BATCH.decode(payload)  # raises DecodeError / ValidationError: not a batch
        events: list[Any] = []
        unknown = 0
        for item in raw.events:
            ev = self._one(item)
            if ev is None:
                return Decoded(False, raw.dp_rank, error=ERR_EVENT)
            if ev is _UNKNOWN:
                unknown += 1
                continue
            events.append(ev)
        out = self._fold(raw.dp_rank, events)
        for _ in range(unknown):
            self._drop(DROP_UNKNOWN_EVENT)
        return out

    def _one(self, item: msgspec.Raw) -> Any:
        """One event: a typed struct, _UNKNOWN (a type we do not know), or None (malformed)."""
        for v in self._variants:
            try:
                return v.event.decode(item)
            except msgspec.ValidationError:
                continue
        try:
            obj = _GENERIC.decode(item)
        except msgspec.DecodeError:
            return None
        tag = obj.get("type") if isinstance(obj, dict) else obj[0] if obj else None
        if isinstance(obj, list | dict) and isinstance(tag, str) and tag not in KNOWN:
            return _UNKNOWN
        return None

    def _fold(self, dp_rank: int | None, events: list[Any]) -> Decoded:
        # The hot loop of the ZMQ source: per event one lookup of what its (type, medium,
        # group, block size) means, cached, and two appends (three in key modes rolling /
        # both: the event is kept); nothing per hash. The C loop takes the events while they
        # are block events already known; this loop goes on from the first other one. Events
        # and blocks are counted per flush from the codes (to_blocks), drops (rare) here.
        out = Decoded(True, dp_rank)
        if dp_rank is not None and self.dp_rank is not None and dp_rank != self.dp_rank:
            return out  # another rank's batch: the caller counts it, nothing to fold
        seg = Segment()
        full = self.full
        known = self._codes
        first = 0
        accel = compiled.accel
        if accel is not None:
            first = accel.zmq_fold(
                events, known, seg.hashes, seg.codes, seg.events if full else None
            )
            if first == len(events):
                if first:
                    out.parts.append(seg)
                return out
        hashes, codes, kept = seg.hashes, seg.codes, seg.events
        for ev in events[first:] if first else events:
            cls = type(ev)
            what = (cls, ev.medium, ev.group_idx, ev.block_size)
            code = known.get(what)
            if code is None:
                code = self._code(what)
            if code >= 0:
                hashes.append(ev.block_hashes)
                codes.append(code)
                if full:
                    kept.append(ev)
            elif code == _CLEAR:
                if codes:
                    out.parts.append(seg)
                    seg = Segment()
                    hashes, codes, kept = seg.hashes, seg.codes, seg.events
                out.parts.append(CLEARED)
                self.cleared += 1
            else:
                self._drop(_DROPPED[code])
        if codes:
            out.parts.append(seg)
        return out

    def _code(self, what: tuple[type, Any, Any, Any]) -> int:
        """What an event of this (type, medium, group, block size) is: its code (>= 0),
        _CLEAR, or a drop (a key of _DROPPED); remembered (at most _CODES_MAX of them)."""
        cls, medium, group, size = what
        name = _TAG[cls]
        if name is CLEARED:
            code = _CLEAR
        elif name is STORED and size is not None and size != self.block_size:
            code = _DROP_SIZE
        elif (mi := self.medium_index.get(medium or self.default_medium)) is None:
            code = _DROP_MEDIUM
        elif group and not 0 < group < 63:  # group bits live in an int64 mask
            code = _DROP_GROUP
        else:
            code = mi << 8 | (group or 0) << 1 | (name is STORED)
        if len(self._codes) >= _CODES_MAX:  # a stream of ever new mediums or groups
            self._codes.clear()
        self._codes[what] = code
        return code

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.dropped_recently = True


class _Unknown:
    pass


_UNKNOWN = _Unknown()
