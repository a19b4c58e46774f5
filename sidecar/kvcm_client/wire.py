"""msgspec structs for the KVCM requests the sidecar sends and the responses it reads.

Imports: msgspec, numpy, and sidecar.shm_ring.compiled (the optional C loops, stdlib only: its
digit writer for the key fields; the numpy form stays the reference). Requests are proto3-JSON
in snake_case with enum names and block keys as decimal text (contract §3-§4). Responses are
decoded leniently: 64-bit numbers may be strings or numbers, codes names or numbers, unknown
fields ignored. `docs/wire.md` documents both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from sidecar.shm_ring import compiled


class Spec(msgspec.Struct, omit_defaults=True):
    name: str
    uri: str


class LocationSpecInfo(msgspec.Struct):
    name: str
    size: int


class LocationSpecGroup(msgspec.Struct):
    name: str
    spec_names: list[str]


class ModelDeployment(msgspec.Struct):
    model_name: str
    dtype: str
    use_mla: bool
    tp_size: int
    dp_size: int
    pp_size: int


class RegisterInstanceRequest(msgspec.Struct):
    trace_id: str
    instance_group: str
    instance_id: str
    block_size: int
    location_spec_infos: list[LocationSpecInfo]
    model_deployment: ModelDeployment
    location_spec_groups: list[LocationSpecGroup]
    default_query_type: str = "QT_PREFIX_MATCH"


class NodeRegister(msgspec.Struct):
    mediums: list[str]


class BlockAdd(msgspec.Struct):
    block_key: str
    medium: str
    specs: list[Spec]


class BlockDelete(msgspec.Struct):
    block_key: str
    medium: str
    spec_names: list[str]


class Heartbeat(msgspec.Struct):
    system_status: dict[str, str]


class HostDown(msgspec.Struct):
    pass


class SnapshotBlock(msgspec.Struct):
    block_key: str
    medium: str
    specs: list[Spec]


class BlockSnapshot(msgspec.Struct):
    blocks: list[SnapshotBlock]


class Event(msgspec.Struct, omit_defaults=True):
    event_type: str
    node_register: NodeRegister | None = None
    block_add: BlockAdd | None = None
    block_delete: BlockDelete | None = None
    host_down: HostDown | None = None
    heartbeat: Heartbeat | None = None
    block_snapshot: BlockSnapshot | None = None


class ReportEventRequest(msgspec.Struct):
    trace_id: str
    instance_id: str
    host_ip_port: str
    storage_type: str
    events: list[Event]


def ev_register(mediums: list[str]) -> Event:
    return Event("EVENT_NODE_REGISTER", node_register=NodeRegister(mediums))


def ev_add(key: int, medium: str, spec: Spec) -> Event:
    return Event("EVENT_BLOCK_ADD", block_add=BlockAdd(str(key), medium, [spec]))


def ev_delete(key: int, medium: str, spec_name: str) -> Event:
    return Event("EVENT_BLOCK_DELETE", block_delete=BlockDelete(str(key), medium, [spec_name]))


def ev_heartbeat(status: dict[str, str]) -> Event:
    return Event("EVENT_HEARTBEAT", heartbeat=Heartbeat(status))


def ev_host_down() -> Event:
    return Event("EVENT_HOST_DOWN", host_down=HostDown())


def ev_snapshot(blocks: list[SnapshotBlock]) -> Event:
    return Event("EVENT_BLOCK_SNAPSHOT", block_snapshot=BlockSnapshot(blocks))


# ---- responses (lenient) ------------------------------------------------------------------
class Status(msgspec.Struct):
    code: str | int = "UNSPECIFIED"
    message: str = ""


class Header(msgspec.Struct):
    status: Status = msgspec.field(default_factory=Status)
    request_id: str = ""


class Response(msgspec.Struct, forbid_unknown_fields=True):
    """Field names as KVCM's server writes them (snake_case); `decode_response` also reads
    camelCase and ignores names it does not know (unknown here: they take its dict path)."""

    header: Header = msgspec.field(default_factory=Header)
    item_results: list[str | int] = msgspec.field(default_factory=list)
    committed_snapshot_version: str = ""
    retry_after_ms: str | int = 0
    snapshot_required: bool = False
    extra_info: str = ""
    storage_configs: str = ""


_snake_decoder = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _field_of(f: msgspec.structs.FieldInfo) -> Any:
    if f.default_factory is not msgspec.NODEFAULT:
        return msgspec.field(default_factory=f.default_factory)
    return f.default


# Response's fields under their camelCase names (decode_response's dict path); a subclass with
# rename= would keep the parent's names.
_CamelResponse = msgspec.defstruct(
    "_CamelResponse",
    [(f.name, f.type, _field_of(f)) for f in msgspec.structs.fields(Response)],
    rename="camel",
)


_typed_decoder = msgspec.json.Decoder(Response, strict=False)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def decode_response(body: bytes) -> Response:
    """Decode a KVCM response written with snake_case (the server's) or camelCase names.

    A body whose top-level names are all Response's own is decoded straight into the Struct
    (one C call: an answer is read on every flush window); any other name (camelCase, or one
    this client does not know) fails that decode, and the body goes through a dict whose names
    are put in camelCase first, as ever."""
    try:
        out: Response = _typed_decoder.decode(body)
    except msgspec.ValidationError:
        return _via_dict(body)  # a bad value fails there too, as it always did
    return out


def _via_dict(body: bytes) -> Response:
    raw = _snake_decoder.decode(body)
    norm = {(_camel(k) if "_" in k else k): v for k, v in raw.items()}
    c = msgspec.convert(norm, _CamelResponse, strict=False)
    return Response(**msgspec.structs.asdict(c))


# ---- fast paths for large requests --------------------------------------------------------
# One Struct per key costs ~3 us here; a 1M-key snapshot would take seconds to build, and even
# one Python int and str per key leaves ~100 B/key of allocator arenas behind. These build the
# same JSON straight from the key arrays: KVCM reads block_key as unsigned decimal text and
# canonicalises leading zeros (contract §4.2, §12), so every key is written as exactly 20
# digits, every block's JSON has one fixed width, and a whole body is one (n, width) byte array
# filled column-wise. tests/unit/test_wire.py pins that the result decodes to the Struct form.
KEY_DIGITS = 20
# "0000".."9999" as one little-endian uint32 word each: a 4-digit group is one gather.
_LUT = np.frombuffer("".join(f"{i:04d}" for i in range(10_000)).encode(), np.uint32)
_E16, _E8, _E4 = np.uint64(10**16), np.uint64(10**8), np.uint64(10**4)


def _fill_keys(rows: np.ndarray, col: int, keys: np.ndarray) -> None:
    """rows[:, col:col+20] = each key's unsigned 64-bit value as 20 zero-padded digits."""
    u = keys.view(np.uint64)  # the int64 bit pattern, read unsigned
    hi, lo = np.divmod(u, _E16)  # hi < 1845: four digits
    a, b = np.divmod(lo, _E8)
    groups = np.empty((len(keys), 5), np.uint32)
    groups[:, 0] = _LUT[hi]
    groups[:, 1], groups[:, 2] = (_LUT[g] for g in np.divmod(a, _E4))
    groups[:, 3], groups[:, 4] = (_LUT[g] for g in np.divmod(b, _E4))
    rows[:, col : col + KEY_DIGITS] = groups.view(np.uint8)


def _as_keys(keys: np.ndarray | list[int]) -> np.ndarray:
    """int64 bit patterns (Python ints may be given as signed or as unsigned 64-bit values)."""
    if isinstance(keys, np.ndarray):
        return np.ascontiguousarray(keys, np.int64) if keys.dtype != np.int64 else keys
    return np.array([k - (1 << 64) if k >= 1 << 63 else k for k in keys], np.int64)


def _fragments(event: Event, key_field: str) -> tuple[bytes, bytes]:
    """Split the encoding of `event` around its block_key value "0"."""
    text = encode(event)
    marker = b'"' + key_field.encode() + b'":"0"'
    head, tail = text.split(marker)
    return head + marker[:-2], tail  # head ends with `"block_key":"`, tail with the rest


class _Rows:
    """One JSON object per key, fixed width, each followed by a comma."""

    def __init__(self, head: bytes, tail: bytes) -> None:
        """`head` ends with the key's opening quote; `tail` follows its closing quote."""
        self.row = np.frombuffer(head + b"0" * KEY_DIGITS + b'"' + tail + b",", np.uint8)
        self.key_col = len(head)
        self.width = len(self.row)


def _body(prefix: bytes, parts: list[tuple[_Rows, np.ndarray]], suffix: bytes) -> memoryview:
    """prefix + rows of every part (comma-separated) + suffix, built in one buffer.

    Returned as a view of that buffer: a copy into `bytes` would cost as much again (page
    faults of a second 100+ MB allocation for a 1M-key snapshot) and aiohttp sends either.
    """
    n_bytes = sum(r.width * len(k) for r, k in parts)
    buf = np.empty(len(prefix) + n_bytes + len(suffix), np.uint8)
    buf[: len(prefix)] = np.frombuffer(prefix, np.uint8)
    at = len(prefix)
    c = compiled.accel
    digits = getattr(c, "digits", None) if c is not None else None  # None: a stale build
    for r, k in parts:
        rows = buf[at : at + r.width * len(k)].reshape(len(k), r.width)
        rows[:] = r.row
        if digits is not None:
            digits(buf, at, r.width, r.key_col, np.ascontiguousarray(k))
        else:
            _fill_keys(rows, r.key_col, k)
        at += r.width * len(k)
    if n_bytes:
        at -= 1  # the last row's comma
    buf[at : at + len(suffix)] = np.frombuffer(suffix, np.uint8)
    return buf[: at + len(suffix)].data


@functools.lru_cache(maxsize=64)
def _delta_rows(medium: str, name: str, uri: str) -> tuple[_Rows, _Rows]:
    """ADD and DELETE event rows; the same for every request of a reporter."""
    add = _Rows(*_fragments(ev_add(0, medium, Spec(name, uri)), "block_key"))
    delete = _Rows(*_fragments(ev_delete(0, medium, name), "block_key"))
    return add, delete


@functools.lru_cache(maxsize=64)
def _snapshot_rows(medium: str, name: str, uri: str) -> tuple[bytes, _Rows, bytes]:
    """Snapshot event: (event head up to `[`, block rows, `]` and the event tail)."""
    b_head, b_tail = _fragments(
        Event(
            "EVENT_BLOCK_SNAPSHOT",
            block_snapshot=BlockSnapshot([SnapshotBlock("0", medium, [Spec(name, uri)])]),
        ),
        "block_key",
    )
    # b_head = b'{"event_type":"EVENT_BLOCK_SNAPSHOT","block_snapshot":{"blocks":[{"block_key":"'
    ev_head, blk_head = b_head.rsplit(b"[", 1)
    blk_tail, ev_tail = b_tail.rsplit(b"]", 1)
    return ev_head + b"[", _Rows(blk_head, blk_tail), b"]" + ev_tail


_TRACE = b'{"trace_id":'


@functools.lru_cache(maxsize=16)
def _envelope_rest(instance_id: str, host_ip_port: str, storage_type: str) -> bytes:
    """The envelope after the trace id, up to the events' `[` (the same for every request of a
    reporter: formatted once)."""
    text = encode(ReportEventRequest("", instance_id, host_ip_port, storage_type, []))
    assert text.startswith(_TRACE + b'""') and text.endswith(b'"events":[]}')
    return text[len(_TRACE) + 2 : -len(b"]}")]


def _envelope_head(trace_id: str, instance_id: str, host_ip_port: str, storage_type: str) -> bytes:
    return _TRACE + encode(trace_id) + _envelope_rest(instance_id, host_ip_port, storage_type)


Mediums = str | Sequence[str]
Specs = Spec | Sequence[Spec]


def _runs(
    rows_of: Callable[[str, Spec], _Rows],
    keys: np.ndarray | list[int],
    medium: Mediums,
    spec: Specs,
    idx: np.ndarray | None,
) -> list[tuple[_Rows, np.ndarray]]:
    """One (rows, keys) part per run of equal medium index (one fixed-width row each)."""
    k = _as_keys(keys)
    if isinstance(medium, str):
        assert isinstance(spec, Spec)
        return [(rows_of(medium, spec), k)]
    specs = [spec] * len(medium) if isinstance(spec, Spec) else list(spec)
    if len(medium) == 1:  # one medium: every index is 0
        return [(rows_of(medium[0], specs[0]), k)] if len(k) else []
    if idx is None:
        idx = np.zeros(len(k), np.uint8)
    if not len(k):
        return []
    cut = np.flatnonzero(idx[1:] != idx[:-1]) + 1
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), len(k)]
    return [
        (rows_of(medium[int(idx[a])], specs[int(idx[a])]), k[a:b])
        for a, b in zip(starts, ends, strict=True)
    ]


def _add_rows(medium: str, spec: Spec) -> _Rows:
    return _delta_rows(medium, spec.name, spec.uri)[0]


def _delete_rows(medium: str, spec: Spec) -> _Rows:
    return _delta_rows(medium, spec.name, spec.uri)[1]


def _snap_rows(medium: str, spec: Spec) -> _Rows:
    return _snapshot_rows(medium, spec.name, spec.uri)[1]


def encode_deltas(
    trace_id: str,
    instance_id: str,
    host_ip_port: str,
    storage_type: str,
    adds: np.ndarray | list[int],
    deletes: np.ndarray | list[int],
    medium: Mediums,
    spec: Specs,
    add_mediums: np.ndarray | None = None,
    delete_mediums: np.ndarray | None = None,
) -> memoryview:
    """A reportEvent with one BLOCK_ADD per key in `adds` and one BLOCK_DELETE per `deletes`.

    `medium` is one name for every key, or the medium table: then `add_mediums` /
    `delete_mediums` give each key's index into it (and `spec` may be one Spec per medium, its
    URI naming the medium). Items keep the given order: adds, then deletes.
    """
    head = _envelope_head(trace_id, instance_id, host_ip_port, storage_type)
    parts = _runs(_add_rows, adds, medium, spec, add_mediums)
    parts += _runs(_delete_rows, deletes, medium, spec, delete_mediums)
    return _body(head, parts, b"]}")


def encode_batch(
    trace_id: str,
    instance_id: str,
    host_ip_port: str,
    storage_type: str,
    keys: np.ndarray,
    publish: np.ndarray | int,
    medium: str,
    spec: Spec,
) -> bytes | memoryview:
    """encode_deltas of one medium's keys: a BLOCK_ADD for each key whose `publish` is set,
    then a BLOCK_DELETE for each other, each in the given order (so for a batch already
    ordered adds first, item_results indexes are the batch's); `publish` an int n: the first n
    keys are the adds. One C call (_wire.c) when the extension has it, else encode_deltas."""
    keys = np.ascontiguousarray(keys, np.int64)
    c = compiled.accel
    body = getattr(c, "delta_body", None) if c is not None else None  # None: a stale build
    if body is None:
        if isinstance(publish, int):
            adds, deletes = keys[:publish], keys[publish:]
        else:
            adds, deletes = keys[publish], keys[~publish]
        who = (trace_id, instance_id, host_ip_port, storage_type)
        return encode_deltas(*who, adds, deletes, medium, spec)
    add, delete = _delta_rows(medium, spec.name, spec.uri)
    head = _envelope_head(trace_id, instance_id, host_ip_port, storage_type)
    flags = publish if isinstance(publish, int) else np.ascontiguousarray(publish, np.bool_)
    out: bytes = body(head, add.row, add.key_col, delete.row, delete.key_col, keys, flags, b"]}")
    return out


def encode_snapshot(
    trace_id: str,
    instance_id: str,
    host_ip_port: str,
    storage_type: str,
    keys: np.ndarray | list[int],
    medium: Mediums,
    spec: Specs,
    key_mediums: np.ndarray | None = None,
) -> memoryview:
    """A reportEvent with one BLOCK_SNAPSHOT listing every (key, medium) given (`medium` and
    `spec` as for encode_deltas, `key_mediums` each key's medium index)."""
    first_medium = medium if isinstance(medium, str) else (medium[0] if medium else "")
    first_spec = spec if isinstance(spec, Spec) else spec[0]
    ev_head, _rows, ev_tail = _snapshot_rows(first_medium, first_spec.name, first_spec.uri)
    head = _envelope_head(trace_id, instance_id, host_ip_port, storage_type)
    parts = _runs(_snap_rows, keys, medium, spec, key_mediums)
    return _body(head + ev_head, parts, ev_tail + b"]}")
