"""Proto3-JSON conventions of KVCM's HTTP API, for the stand-in server.

Imports: stdlib + msgspec. Requests accept snake_case or lowerCamelCase keys and enums by name or
number; responses use snake_case, enum names and 64-bit integers as strings (contract §1).
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

import msgspec
import numpy as np

CODES = {
    "UNSPECIFIED": 0,
    "OK": 1,
    "UNSUPPORTED": 2,
    "INTERNAL_ERROR": 3,
    "SERVICE_NOT_READY": 4,
    "INVALID_ARGUMENT": 5,
    "DUPLICATE_ENTITY": 6,
    "REACH_MAX_ENTITY_CAPACITY": 7,
    "INSTANCE_NOT_EXIST": 8,
    "SERVER_NOT_LEADER": 9,
    "NODE_NOT_REGISTERED": 10,
    "SNAPSHOT_IN_PROGRESS": 11,
    "SNAPSHOT_RATE_LIMITED": 13,
    "SNAPSHOT_REQUIRED": 14,
    "IO_ERROR": 20,
    "UNKNOWN_ERROR": 100,
}
EVENT_TYPES = {
    "EVENT_UNSPECIFIED": 0,
    "EVENT_NODE_REGISTER": 1,
    "EVENT_BLOCK_ADD": 2,
    "EVENT_BLOCK_DELETE": 3,
    "EVENT_HOST_DOWN": 4,
    "EVENT_HEARTBEAT": 5,
    "EVENT_BLOCK_SNAPSHOT": 6,
}
PAYLOAD_OF = {
    "EVENT_NODE_REGISTER": "node_register",
    "EVENT_BLOCK_ADD": "block_add",
    "EVENT_BLOCK_DELETE": "block_delete",
    "EVENT_HOST_DOWN": "host_down",
    "EVENT_HEARTBEAT": "heartbeat",
    "EVENT_BLOCK_SNAPSHOT": "block_snapshot",
}
STORAGE_TYPES = {"ST_EVENT_REPORT_L1P5": 7, "ST_EVENT_REPORT_L2": 8}  # event-report storages
# Every StorageType (queries name backends with them; write locations are of a data storage).
ALL_STORAGE_TYPES = {
    "ST_UNSPECIFIED": 0,
    "ST_3FS": 1,
    "ST_MOONCAKE": 2,
    "ST_TAIRMEMPOOL": 3,
    "ST_NFS": 4,
    "ST_VCNS_3FS": 5,
    **STORAGE_TYPES,
}
QUERY_TYPES = {
    "QT_UNSPECIFIED": 0,
    "QT_BATCH_GET": 1,
    "QT_PREFIX_MATCH": 2,
    "QT_REVERSE_ROLL_SW_MATCH": 3,
    "QT_PREFIX_MATCH_WITH_MAMBA": 4,
}

_CAMEL = re.compile(r"(?<!^)([A-Z])")
I64_MIN = -(1 << 63)
U64_END = 1 << 64


class BadRequest(Exception):
    """The body is not valid JSON for the message: HTTP 400 with body `{}`."""


_SNAKE_CACHE: dict[str, str] = {}
_CONTAINERS = (dict, list)


def _snake_key(k: str) -> str:
    nk = _SNAKE_CACHE.get(k)
    if nk is None:
        nk = _CAMEL.sub(r"_\1", k).lower()
        if len(_SNAKE_CACHE) < 4096:  # field names repeat; bound the cache against junk keys
            _SNAKE_CACHE[k] = nk
    return nk


def snake(obj: Any, depth: int = 1, limit: int = 64) -> Any:
    """lowerCamelCase keys -> snake_case, recursively, refusing nesting deeper than `limit`."""
    if depth > limit:
        raise BadRequest(f"nesting deeper than {limit}")
    if type(obj) is dict:
        return {
            (_snake_key(k) if type(k) is str else k): (
                snake(v, depth + 1, limit) if type(v) in _CONTAINERS else v
            )
            for k, v in obj.items()
        }
    if type(obj) is list:
        return [snake(v, depth + 1, limit) if type(v) in _CONTAINERS else v for v in obj]
    return obj


def camel(obj: Any) -> Any:
    """snake_case keys -> lowerCamelCase, recursively: the other spelling proto3 JSON accepts
    (tests and benchmarks use it to send a message down the generic dict path)."""
    if isinstance(obj, dict):
        return {
            k.split("_")[0] + "".join(p.title() for p in k.split("_")[1:]): camel(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [camel(v) for v in obj]
    return obj


_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def decode(body: bytes, max_depth: int = 64, *, lazy_events: bool = False) -> dict[str, Any]:
    """Parse a request body; keys become snake_case.

    With `lazy_events` (reportEvent), only the envelope and the event items that actually
    carry a camelCase key are rewritten: for the usual all-snake_case publisher the cost of
    key normalisation is a few `str.islower()` calls per event instead of a rewrite of the body.
    """
    try:
        obj = _decoder.decode(body) if body.strip() else {}
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(str(exc)) from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    if not _depth_ok(body, max_depth):
        raise BadRequest(f"nesting deeper than {max_depth}")
    if not lazy_events:
        out: dict[str, Any] = snake(obj, 1, max_depth)
        return out
    env = {(_snake_key(k) if type(k) is str else k): v for k, v in obj.items()}
    events = env.get("events")
    if type(events) is list:
        env["events"] = [snake(e) if type(e) is dict and _camelish(e) else e for e in events]
    return env


def _has_upper(d: dict[Any, Any]) -> bool:
    return any(type(k) is str and not k.islower() for k in d)


def _camelish(event: dict[str, Any]) -> bool:
    """Does this event item (its payload, its specs) use any camelCase key?"""
    if _has_upper(event):
        return True
    for payload in event.values():
        if type(payload) is dict:
            if _has_upper(payload):
                return True
            for v in payload.values():
                if type(v) is list:
                    for item in v:
                        if type(item) is dict and _has_upper(item):
                            return True
    return False


def _depth_ok(body: bytes, limit: int) -> bool:
    """Nesting depth of the JSON text (brackets inside strings excluded), vectorised.

    A quote preceded by a backslash counts as escaped; a string ending in an escaped backslash
    flips that guess, which can only make this check stricter or looser by the brackets inside
    that one string.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    a = np.frombuffer(body, np.uint8)
    quotes = np.flatnonzero(a == 34)
    if len(quotes):
        quotes = quotes[(quotes == 0) | (a[np.maximum(quotes - 1, 0)] != 92)]
    opens = np.flatnonzero((a == 123) | (a == 91))
    closes = np.flatnonzero((a == 125) | (a == 93))
    opens = opens[np.searchsorted(quotes, opens) % 2 == 0]  # outside strings only
    closes = closes[np.searchsorted(quotes, closes) % 2 == 0]
    pos = np.concatenate([opens, closes])
    step = np.concatenate([np.ones(len(opens), np.int32), -np.ones(len(closes), np.int32)])
    depth = np.cumsum(step[np.argsort(pos, kind="stable")])
    return int(depth.max(initial=0)) <= limit


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def enum_name(value: Any, table: dict[str, int]) -> str | None:
    """Enum by name (case-sensitive) or number; None when unknown."""
    if isinstance(value, str):
        if value in table:
            return value
        if value.lstrip("-").isdigit():
            value = int(value)
        else:
            return None
    if isinstance(value, int) and not isinstance(value, bool):
        for k, v in table.items():
            if v == value:
                return k
    return None


def parse_block_key(value: Any, *, allow_number: bool = False) -> int | None:
    """Decimal text (leading zeros allowed, no '+' or spaces) in [-2^63, 2^64) -> int64 pattern."""
    if type(value) is str:
        digits = value[1:] if value[:1] == "-" else value
        if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > 20:
            return None  # (also keeps int() away from CPython's 4300-digit limit)
        v = int(value)
    elif isinstance(value, int) and not isinstance(value, bool) and allow_number:
        v = value
    else:
        return None
    if not I64_MIN <= v < U64_END:
        return None
    return v - U64_END if v >= 1 << 63 else v


def new_version() -> str:
    return secrets.token_hex(16)


def header(code: str = "OK", message: str = "", request_id: str = "") -> dict[str, Any]:
    return {
        "header": {
            "status": {"code": code, "message": message},
            "request_id": request_id,
            "tracer_result": "",
        }
    }


# ---- reportEvent's typed fast path ------------------------------------------------------------
# A publisher's hot requests are ADD/DELETE batches and snapshots in snake_case: msgspec decodes
# those straight into these Structs at a fraction of the cost of dicts. Anything else (camelCase,
# an unknown field, another event type, a wrong JSON type) fails validation here and takes the
# generic dict path, which owns every error message, so both paths answer identically.
class TSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    name: str
    uri: str


# A spec list stays raw JSON until it differs from the previous event's: publishers repeat one
# list for every block, so comparing bytes replaces decoding four objects per event.
# `decode_report` checks every distinct list against this type before it answers.
TSpecs = tuple[TSpec, ...]
_specs_decoder = msgspec.json.Decoder(TSpecs)
_SPECS: dict[bytes, TSpecs] = {}


def typed_specs(raw: msgspec.Raw) -> TSpecs:
    """The spec list `raw` (which `decode_report` has checked) as Structs."""
    text = bytes(raw)
    out = _SPECS.get(text)
    if out is None:
        out = _specs_decoder.decode(text)
        if len(_SPECS) < 1024:
            _SPECS[text] = out
    return out


class TAdd(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    block_key: str
    medium: str
    specs: msgspec.Raw  # TSpecs


class TDelete(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    block_key: str
    medium: str
    spec_names: tuple[str, ...]


class TBlock(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    block_key: str
    specs: msgspec.Raw  # TSpecs
    medium: str | None = None


class TSnapshot(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    blocks: list[TBlock]
    medium: str | None = None


ADD, DELETE, SNAPSHOT = "EVENT_BLOCK_ADD", "EVENT_BLOCK_DELETE", "EVENT_BLOCK_SNAPSHOT"
_FAST_TYPES: dict[str | int, str] = {ADD: ADD, 2: ADD, DELETE: DELETE, 3: DELETE}
_FAST_TYPES.update({SNAPSHOT: SNAPSHOT, 6: SNAPSHOT})


class TEvent(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    # A Literal decodes to the one shared object instead of a new string per event.
    event_type: Literal["EVENT_BLOCK_ADD", "EVENT_BLOCK_DELETE", "EVENT_BLOCK_SNAPSHOT", 2, 3, 6]
    block_add: TAdd | None = None
    block_delete: TDelete | None = None
    block_snapshot: TSnapshot | None = None


class TReport(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    instance_id: str
    host_ip_port: str
    storage_type: str | int
    events: list[TEvent]
    trace_id: str = ""


_report_decoder = msgspec.json.Decoder(TReport)


def _specs_ok(items: list[Any]) -> bool:
    """Every spec list among `items` (TAdd or TBlock) decodes as TSpecs."""
    last: msgspec.Raw | None = None
    try:
        for it in items:
            if it.specs != last:
                typed_specs(it.specs)
                last = it.specs
    except msgspec.DecodeError:
        return False
    return True


def decode_report(body: bytes) -> tuple[TReport, list[str]] | None:
    """The typed request and its event type names, or None: use `decode` and the dict path."""
    try:
        req = _report_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    events = req.events
    types = [_FAST_TYPES[e.event_type] for e in events]
    if types.count(ADD) == len(types):  # the usual batch: no per-event branching
        adds = [e.block_add for e in events]
        if None in adds:
            return None  # the dict path names the missing payload
        return (req, types) if _specs_ok(adds) else None
    payloads: list[Any] = []
    for e, t in zip(events, types, strict=True):
        payload = e.block_add if t == ADD else e.block_delete if t == DELETE else e.block_snapshot
        if payload is None:
            return None
        payloads.append(payload)
    with_specs: list[TAdd | TBlock] = [p for p in payloads if isinstance(p, TAdd)]
    with_specs += [b for p in payloads if isinstance(p, TSnapshot) for b in p.blocks]
    return (req, types) if _specs_ok(with_specs) else None
