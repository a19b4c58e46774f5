"""Proto3-JSON conventions of KVCM's HTTP API, for the stand-in server.

Imports: stdlib + msgspec. Requests accept snake_case or lowerCamelCase keys and enums by name or
number; responses use snake_case, enum names and 64-bit integers as strings (contract §1).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

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
STORAGE_TYPES = {"ST_EVENT_REPORT_L1P5": 7, "ST_EVENT_REPORT_L2": 8}
QUERY_TYPES = {
    "QT_UNSPECIFIED": 0,
    "QT_BATCH_GET": 1,
    "QT_PREFIX_MATCH": 2,
    "QT_REVERSE_ROLL_SW_MATCH": 3,
    "QT_PREFIX_MATCH_WITH_MAMBA": 4,
}

_CAMEL = re.compile(r"(?<!^)([A-Z])")
# A JSON object key with an upper-case letter after a lower-case start ("blockKey":).
_CAMEL_KEY = re.compile(rb'"[a-z][a-z0-9_]*[A-Z][A-Za-z0-9_]*"\s*:')
_KEY_TEXT = re.compile(r"-?[0-9]+")
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


_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def decode(body: bytes, max_depth: int = 64) -> dict[str, Any]:
    try:
        obj = _decoder.decode(body) if body.strip() else {}
    except msgspec.DecodeError as exc:
        raise BadRequest(str(exc)) from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    if _CAMEL_KEY.search(body) is None and _depth_ok(body, max_depth):
        return obj  # already snake_case: skip the rewrite, the costliest step for big requests
    out: dict[str, Any] = snake(obj, 1, max_depth)
    return out


def _depth_ok(body: bytes, limit: int) -> bool:
    """Nesting depth of the JSON text, brackets inside strings excluded, in a few numpy passes.

    A quote preceded by a backslash counts as escaped; a string ending in an escaped backslash
    (`"\\\\"`) flips that guess, and then the request just takes the slow exact path below.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    a = np.frombuffer(body, np.uint8)
    quote = a == 34
    quote[1:] &= a[:-1] != 92
    outside = (np.cumsum(quote) & 1) == 0
    step = ((a == 123) | (a == 91)).astype(np.int32) - ((a == 125) | (a == 93))
    step *= outside
    return int(np.cumsum(step).max(initial=0)) <= limit


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
    if isinstance(value, int) and not isinstance(value, bool) and allow_number:
        v = value
    elif isinstance(value, str) and _KEY_TEXT.fullmatch(value):
        v = int(value)
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
