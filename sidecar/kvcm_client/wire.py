"""msgspec structs for the KVCM requests the sidecar sends and the responses it reads.

Imports: msgspec only. Requests are proto3-JSON in snake_case with enum names and block keys as
decimal text (contract §3-§4). Responses are decoded leniently: 64-bit numbers may be strings or
numbers, codes names or numbers, unknown fields ignored. `docs/wire.md` documents both.
"""

from __future__ import annotations

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
