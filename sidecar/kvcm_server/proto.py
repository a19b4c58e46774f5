"""Proto3-JSON conventions of KVCM's HTTP API, for the stand-in server.

Imports: stdlib + msgspec. Requests accept snake_case or lowerCamelCase keys and enums by name or
number; responses use snake_case, enum names and 64-bit integers as strings (contract §1).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import msgspec

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
_KEY_TEXT = re.compile(r"-?[0-9]+")
I64_MIN = -(1 << 63)
U64_END = 1 << 64


class BadRequest(Exception):
    """The body is not valid JSON for the message: HTTP 400 with body `{}`."""


def snake(obj: Any) -> Any:
    """Recursively convert lowerCamelCase keys to snake_case (proto3-JSON accepts both)."""
    if isinstance(obj, dict):
        return {
            _CAMEL.sub(r"_\1", k).lower() if isinstance(k, str) else k: snake(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [snake(v) for v in obj]
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
    if _depth(obj, max_depth) > max_depth:
        raise BadRequest(f"nesting deeper than {max_depth}")
    out: dict[str, Any] = snake(obj)
    return out


def _depth(obj: Any, limit: int, d: int = 1) -> int:
    if d > limit:
        return d
    if isinstance(obj, dict):
        return max((_depth(v, limit, d + 1) for v in obj.values()), default=d)
    if isinstance(obj, list):
        return max((_depth(v, limit, d + 1) for v in obj), default=d)
    return d


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
