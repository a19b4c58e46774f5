"""msgspec structs for the KVCM requests the sidecar sends and the responses it reads.

Imports: msgspec only. Requests are proto3-JSON in snake_case with enum names and block keys as
decimal text (contract §3-§4). Responses are decoded leniently: 64-bit numbers may be strings or
numbers, codes names or numbers, unknown fields ignored. `docs/wire.md` documents both.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec


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


class Response(msgspec.Struct, rename="camel"):
    """Field names are matched in camelCase here; `decode_response` accepts either spelling."""

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


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def decode_response(body: bytes) -> Response:
    """Decode a KVCM response written with snake_case (the server's) or camelCase names."""
    raw = _snake_decoder.decode(body)
    norm = {(_camel(k) if "_" in k else k): v for k, v in raw.items()}
    return msgspec.convert(norm, Response, strict=False)


# ---- fast paths for large requests --------------------------------------------------------
# One Struct per key costs ~3 us here; a 1M-key snapshot would take seconds to build. These
# build exactly the same JSON by joining msgspec-encoded fragments: keys are decimal digits,
# so nothing in them needs escaping. tests/unit/test_wire.py pins the equality.
def _fragments(event: Event, key_field: str) -> tuple[str, str]:
    """Split the encoding of `event` around its block_key value "0"."""
    text = encode(event).decode()
    marker = f'"{key_field}":"0"'
    head, tail = text.split(marker)
    return head + f'"{key_field}":"', '"' + tail


def _join(keys: list[int], head: str, tail: str, before: str = "", after: str = "") -> str:
    """before + head k1 tail , head k2 tail ... + after, with a single copy of the bulk.

    The outer text rides on the first and last elements, so the big join is the only
    allocation of the whole body (a 100 MB snapshot pays its page faults once).
    """
    if not keys:
        return before + after
    parts = list(map(str, keys))
    parts[0] = before + head + parts[0]
    parts[-1] = parts[-1] + tail + after
    return (tail + "," + head).join(parts)


@functools.lru_cache(maxsize=64)
def _delta_fragments(medium: str, name: str, uri: str) -> tuple[str, str, str, str]:
    """ADD and DELETE event text around the key; the same for every request of a reporter."""
    spec = Spec(name, uri)
    a_head, a_tail = _fragments(ev_add(0, medium, spec), "block_key")
    d_head, d_tail = _fragments(ev_delete(0, medium, name), "block_key")
    return a_head, a_tail, d_head, d_tail


@functools.lru_cache(maxsize=64)
def _snapshot_fragments(medium: str, name: str, uri: str) -> tuple[str, str, str, str]:
    """Snapshot event text: (event head, block head, block tail, event tail)."""
    b_head, b_tail = _fragments(
        Event(
            "EVENT_BLOCK_SNAPSHOT",
            block_snapshot=BlockSnapshot([SnapshotBlock("0", medium, [Spec(name, uri)])]),
        ),
        "block_key",
    )
    # b_head = '{"event_type":"EVENT_BLOCK_SNAPSHOT","block_snapshot":{"blocks":[{"block_key":"'
    ev_head, blk_head = b_head.rsplit("[", 1)
    blk_tail, ev_tail = b_tail.rsplit("]", 1)
    return ev_head, blk_head, blk_tail, ev_tail


def _envelope_head(trace_id: str, instance_id: str, host_ip_port: str, storage_type: str) -> str:
    text = encode(
        ReportEventRequest(trace_id, instance_id, host_ip_port, storage_type, [])
    ).decode()
    assert text.endswith('"events":[]}')
    return text[: -len("]}")]


def encode_deltas(
    trace_id: str,
    instance_id: str,
    host_ip_port: str,
    storage_type: str,
    adds: list[int],
    deletes: list[int],
    medium: str,
    spec: Spec,
) -> bytes:
    """A reportEvent with one BLOCK_ADD per key in `adds` and one BLOCK_DELETE per `deletes`."""
    a_head, a_tail, d_head, d_tail = _delta_fragments(medium, spec.name, spec.uri)
    parts = [p for p in (_join(adds, a_head, a_tail), _join(deletes, d_head, d_tail)) if p]
    head = _envelope_head(trace_id, instance_id, host_ip_port, storage_type)
    return (head + ",".join(parts) + "]}").encode()


def encode_snapshot(
    trace_id: str,
    instance_id: str,
    host_ip_port: str,
    storage_type: str,
    keys: list[int],
    medium: str,
    spec: Spec,
) -> bytes:
    """A reportEvent with one BLOCK_SNAPSHOT listing every key in `keys`."""
    ev_head, blk_head, blk_tail, ev_tail = _snapshot_fragments(medium, spec.name, spec.uri)
    head = _envelope_head(trace_id, instance_id, host_ip_port, storage_type)
    return _join(keys, blk_head, blk_tail, head + ev_head + "[", "]" + ev_tail + "]}").encode()
