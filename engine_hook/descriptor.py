"""The replica's identity and deployment descriptor, from arguments over `KV_CACHE_EVENT_*` env.

Imports: stdlib only. The descriptor is written into the ring segment as JSON so the sidecar can
register the replica with KVCM without a second copy of the engine's configuration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ENV_PREFIX = "KV_CACHE_EVENT_"
MAX_MEDIUMS = 255


class DescriptorError(ValueError):
    """A descriptor field is missing or malformed; the message names the field and its source."""


@dataclass(frozen=True)
class Descriptor:
    publisher_type: str = "kvcm"
    instance_id: str = ""
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    model_name: str = "model"
    dtype: str = "fp16"
    use_mla: bool = False
    block_size_tokens: int = 16
    group_block_bytes: tuple[int, ...] = (4096,)
    required_groups: tuple[int, ...] = (0,)
    medium: str = "hbm"
    # Further tiers the engine may report (`stored(..., medium=name)`); see medium_table().
    mediums: tuple[str, ...] = ()
    cp_sharded_kv: bool = False
    prefix_reuse: bool = True
    ring_name: str = ""
    ring_capacity_slots: int = 0  # 0: use the segment's (or the default when creating)
    max_stage_delay_ms: float = 5.0
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Descriptor:
        raw = json.loads(data)
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        for k in ("group_block_bytes", "required_groups", "mediums"):
            if k in raw:
                raw[k] = tuple(raw[k])
        return cls(**raw)

    def medium_table(self) -> tuple[str, ...]:
        """Medium names by ring index: index 0 is always the default `medium`, so records and
        snapshots written before mediums existed (all index 0) keep their meaning."""
        return (self.medium, *(m for m in dict.fromkeys(self.mediums) if m != self.medium))

    def block_bytes(self) -> int:
        """Bytes of one published block across required groups and TP shards (KVCM spec size)."""
        return sum(self.group_block_bytes[g] for g in self.required_groups) * self.tp_size


def _parse(name: str, typ: Any, raw: str, source: str) -> Any:
    try:
        if typ == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
        if typ == "tuple[int, ...]":
            return tuple(int(x) for x in raw.split(",") if x.strip())
        if typ == "tuple[str, ...]":
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if typ == "dict[str, str]":
            return dict(kv.split("=", 1) for kv in raw.split(",") if kv)
        return raw
    except ValueError:
        raise DescriptorError(f"{source}: {name}={raw!r} is not a valid {typ}") from None


def build(args: Mapping[str, Any], env: Mapping[str, str]) -> Descriptor:
    """Arguments win over environment; every field is validated, never silently defaulted."""
    values: dict[str, Any] = {}
    for f in fields(Descriptor):
        key = ENV_PREFIX + f.name.upper()
        if args.get(f.name) is not None:
            v = args[f.name]
            if f.type == "tuple[int, ...]" and not isinstance(v, tuple):
                v = tuple(int(x) for x in v)
            elif f.type == "tuple[str, ...]" and not isinstance(v, tuple):
                v = (v,) if isinstance(v, str) else tuple(v)
            values[f.name] = v
        elif key in env:
            values[f.name] = _parse(f.name, f.type, env[key], f"env {key}")
    d = Descriptor(**values)
    _validate(d)
    return d


def _validate(d: Descriptor) -> None:
    pt = d.publisher_type.strip().lower()
    if pt not in ("none", "kvcm"):
        raise DescriptorError(f"publisher_type={d.publisher_type!r}: expected none or kvcm")
    if pt == "kvcm" and not d.instance_id:
        raise DescriptorError("instance_id is required when publisher_type=kvcm")
    for name in ("dp_rank", "tp_rank"):
        if getattr(d, name) < 0:
            raise DescriptorError(f"{name} must be >= 0")
    for name in ("tp_size", "dp_size", "pp_size", "block_size_tokens"):
        if getattr(d, name) <= 0:
            raise DescriptorError(f"{name} must be > 0")
    if not d.group_block_bytes or any(b <= 0 for b in d.group_block_bytes):
        raise DescriptorError("group_block_bytes must list one positive size per cache group")
    if len(d.group_block_bytes) > 32:
        raise DescriptorError("group_block_bytes: at most 32 cache groups")
    if not d.required_groups or any(
        not 0 <= g < len(d.group_block_bytes) for g in d.required_groups
    ):
        raise DescriptorError("required_groups must name existing cache groups")
    for m in (d.medium, *d.mediums):
        if not isinstance(m, str) or not m or "#" in m:
            raise DescriptorError(f"medium {m!r}: must be a non-empty name without '#'")
    if len(d.medium_table()) > MAX_MEDIUMS:
        raise DescriptorError(f"mediums: at most {MAX_MEDIUMS} mediums (a u8 index on the ring)")
    if not math.isfinite(d.max_stage_delay_ms) or d.max_stage_delay_ms <= 0:
        raise DescriptorError("max_stage_delay_ms must be a finite number > 0")
