"""vLLM / SGLang KV-event payloads (msgpack) decoded into per-block arrays; never raises.

Imports: stdlib, numpy, msgspec. A payload is `[ts, events, dp_rank?]`; events are tagged maps
(`type` = BlockStored | BlockRemoved | AllBlocksCleared, fields by name) or, from older releases,
positional arrays (the tag first, then the fields in declaration order, trailing ones optional).
Unknown fields are ignored, absent ones tolerated; block hashes are ints or byte digests, folded
to their low 64 bits (bytes read big-endian) and kept as int64 bit patterns. Typed decoders are
tried in turn (the last one that worked first); a payload none of them reads is decoded generically
so that one event of an unknown type is skipped (counted) rather than failing the whole batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

M64 = (1 << 64) - 1
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
KNOWN = frozenset((STORED, REMOVED, CLEARED))

# Decode-error reasons (labels of kvcm_sidecar_zmq_decode_errors_total).
ERR_NOT_MSGPACK = "not_msgpack"  # not msgpack, or not [ts, events, dp_rank?]
ERR_EVENT = "malformed_event"  # a known event type with unreadable fields
# Per-event drops (labels of kvcm_sidecar_zmq_dropped_total), besides whole-batch dp_rank drops.
DROP_UNKNOWN_EVENT = "unknown_event"
DROP_BLOCK_SIZE = "block_size"
DROP_MEDIUM = "unknown_medium"


def _structs(hash_t: Any, positional: bool) -> tuple[Any, Any, Any]:
    """(BlockStored, BlockRemoved, AllBlocksCleared) for one hash type and encoding."""
    raw = msgspec.Raw  # decoded lazily, never materialised (token_ids is the bulk of a batch)
    opts: dict[str, Any] = {"tag": True, "array_like": positional, "gc": False}
    if not positional:
        opts["tag_field"] = "type"
    if positional:
        stored_fields: list[Any] = [
            ("block_hashes", list[hash_t]),
            ("parent_block_hash", raw, msgspec.field(default_factory=raw)),
            ("token_ids", raw, msgspec.field(default_factory=raw)),
            ("block_size", int | None, None),
            ("lora_id", raw, msgspec.field(default_factory=raw)),
            ("medium", str | None, None),
            ("lora_name", raw, msgspec.field(default_factory=raw)),
            ("extra_keys", raw, msgspec.field(default_factory=raw)),
            ("group_idx", int | None, None),
        ]
    else:  # by name: undeclared fields (token_ids, parent_block_hash, ...) are skipped
        stored_fields = [
            ("block_hashes", list[hash_t]),
            ("block_size", int | None, None),
            ("medium", str | None, None),
            ("group_idx", int | None, None),
        ]
    removed_fields: list[Any] = [
        ("block_hashes", list[hash_t]),
        ("medium", str | None, None),
        ("group_idx", int | None, None),
    ]
    return (
        msgspec.defstruct(STORED, stored_fields, **opts),
        msgspec.defstruct(REMOVED, removed_fields, **opts),
        msgspec.defstruct(CLEARED, [], **opts),
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
    """One typed decoding: (hash type, encoding) -> batch and single-event decoders."""

    def __init__(self, hash_t: Any, positional: bool) -> None:
        s, r, c = _structs(hash_t, positional)
        self.stored, self.removed, self.cleared = s, r, c
        self.batch = _batch_decoder(list[s | r | c])  # type: ignore[valid-type]
        self.event = msgspec.msgpack.Decoder(s | r | c)


_VARIANTS = [
    _Variant(int, False),
    _Variant(bytes, False),
    _Variant(int, True),
    _Variant(bytes, True),
    _Variant(int | bytes, False),
    _Variant(int | bytes, True),
]
_RAW_BATCH = _batch_decoder(list[msgspec.Raw])
_GENERIC = msgspec.msgpack.Decoder()


@dataclass
class Blocks:
    """Block events of one batch, in order, between clears: one entry per block hash."""

    keys: np.ndarray  # int64 bit patterns
    mediums: np.ndarray  # uint8 index into the medium table
    groups: np.ndarray  # uint8 group_idx
    signs: np.ndarray  # int8: +1 stored, -1 removed


@dataclass
class Decoded:
    """A decoded payload: `parts` alternates Blocks and the string CLEARED, in event order."""

    ok: bool
    dp_rank: int | None = None
    parts: list[Blocks | str] = field(default_factory=list)
    events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (type, medium) -> n
    blocks: int = 0
    drops: Counter[str] = field(default_factory=Counter)  # per-event drop reasons
    error: str = ""  # why not ok


def fold_hashes(hashes: list[Any]) -> np.ndarray:
    """Block hashes -> int64 bit patterns: ints keep their low 64 bits; bytes are big-endian,
    low 64 bits (a 32-byte digest keeps its last 8 bytes)."""
    if not hashes:
        return np.zeros(0, np.int64)
    first = hashes[0]
    if type(first) is int:
        try:
            out: np.ndarray = np.array(hashes, np.uint64).view(np.int64)
            return out
        except (OverflowError, TypeError, ValueError):
            pass  # negative ints, or a mix: one by one below
    elif type(first) is bytes and all(type(h) is bytes and len(h) == 32 for h in hashes):
        rows = np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, 32)
        tail = np.ascontiguousarray(rows[:, 24:]).view(">u8").ravel()
        out = tail.astype(np.uint64).view(np.int64)
        return out
    vals = [(int.from_bytes(h, "big") if isinstance(h, bytes) else int(h)) & M64 for h in hashes]
    return np.array(vals, np.uint64).view(np.int64)


class EventDecoder:
    """Payload bytes -> Decoded, for one replica's medium map and expected block size."""

    def __init__(self, medium_index: Mapping[str, int], block_size: int) -> None:
        self.medium_index = dict(medium_index)  # engine medium name -> medium table index
        self.default_medium = "GPU"  # what an absent medium means (vLLM and SGLang)
        self.block_size = block_size
        self._order = list(range(len(_VARIANTS)))  # the variant that worked last goes first

    def decode(self, payload: bytes) -> Decoded:
        try:
            return self._decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            return Decoded(False, error=f"{ERR_NOT_MSGPACK}: {exc}")
        except (OverflowError, RecursionError, MemoryError) as exc:  # hostile nesting or sizes
            return Decoded(False, error=f"{ERR_NOT_MSGPACK}: {type(exc).__name__}")

    def _decode(self, payload: bytes) -> Decoded:
        for n, i in enumerate(self._order):
            v = _VARIANTS[i]
            try:
                batch = v.batch.decode(payload)
            except msgspec.ValidationError:
                continue
            if n:
                self._order.insert(0, self._order.pop(n))
            return self._fold(batch.dp_rank, batch.events, v)
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
        out = self._fold(raw.dp_rank, events, None)
        if unknown:
            out.drops[DROP_UNKNOWN_EVENT] += unknown
        return out

    def _one(self, item: msgspec.Raw) -> Any:
        """One event: a typed struct, _UNKNOWN (a type we do not know), or None (malformed)."""
        for v in _VARIANTS:
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

    def _fold(self, dp_rank: int | None, events: list[Any], v: _Variant | None) -> Decoded:
        out = Decoded(True, dp_rank)
        hashes: list[Any] = []
        counts: list[int] = []
        meds: list[int] = []
        groups: list[int] = []
        signs: list[int] = []
        index, default, bs = self.medium_index, self.default_medium, self.block_size

        def cut() -> None:
            if counts:
                out.parts.append(_blocks(hashes, counts, meds, groups, signs))
                for lst in (hashes, counts, meds, groups, signs):
                    lst.clear()

        for ev in events:
            name = type(ev).__name__
            if name == CLEARED:
                cut()
                out.parts.append(CLEARED)
                out.events[(CLEARED, "")] += 1
                continue
            medium = ev.medium or default
            out.events[(name, medium)] += 1
            n = len(ev.block_hashes)
            out.blocks += n
            mi = index.get(medium)
            if mi is None:
                out.drops[DROP_MEDIUM] += 1
                continue
            if name == STORED and ev.block_size is not None and ev.block_size != bs:
                out.drops[DROP_BLOCK_SIZE] += 1
                continue
            g = ev.group_idx or 0
            if not 0 <= g < 63:  # group bits live in an int64 mask
                out.drops[ERR_EVENT] += 1
                continue
            signs.append(1 if name == STORED else -1)
            hashes.extend(ev.block_hashes)
            counts.append(n)
            meds.append(mi)
            groups.append(g)
        cut()
        return out


class _Unknown:
    pass


_UNKNOWN = _Unknown()


def _blocks(
    hashes: list[Any], counts: list[int], meds: list[int], groups: list[int], signs: list[int]
) -> Blocks:
    n = np.array(counts, np.int64)
    if len(counts) == 1:
        c = counts[0]
        return Blocks(
            fold_hashes(hashes),
            np.full(c, meds[0], np.uint8),
            np.full(c, groups[0], np.uint8),
            np.full(c, signs[0], np.int8),
        )
    return Blocks(
        fold_hashes(hashes),
        np.repeat(np.array(meds, np.uint8), n),
        np.repeat(np.array(groups, np.uint8), n),
        np.repeat(np.array(signs, np.int8), n),
    )
