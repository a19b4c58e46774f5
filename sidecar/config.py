"""The sidecar's one frozen configuration struct and how it is loaded.

Imports: stdlib + msgspec. Sources in rising precedence: defaults, TOML file, environment
(`KV_CACHE_EVENT_*`; the seed's five names kept), CLI `--set section.field=value`. Converted once;
a bad value raises ConfigError naming the source and the field path, before anything touches shm
or sockets. Only the CLI reads the environment; it passes it in here.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PosInt = Annotated[int, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]


class ConfigError(Exception):
    """One line naming the source and the field path; the CLI prints it and exits 2."""


class Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ManagerConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # One URL, or a comma-separated list of seed URLs of a KVCM cluster: the sidecar asks them
    # for the leader (getClusterInfo) and sends everything there (docs/operations.md, KVCM cluster).
    endpoint: str = ""
    instance_group: str = "default"
    request_timeout_s: PosFloat = 1.5
    snapshot_timeout_s: PosFloat = 30.0
    max_response_bytes: PosInt = 1 << 20
    discovery_interval_s: PosFloat = 30.0  # getClusterInfo again this often (and on failures)

    @property
    def seeds(self) -> tuple[str, ...]:
        """The seed URLs of `endpoint`, in order, without a trailing slash."""
        return tuple(s.strip().rstrip("/") for s in self.endpoint.split(",") if s.strip())


class IdentityConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    instance_id: str = ""
    dp_rank: Annotated[int, Meta(ge=0)] = 0
    host_ip_port: str = ""  # explicit identity; must differ per dp_rank
    host_ip: str = ""  # with base_port: host_ip:(base_port + dp_rank * port_stride)
    base_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    port_stride: PosInt = 1
    storage_type: Literal["ST_EVENT_REPORT_L1P5", "ST_EVENT_REPORT_L2"] = "ST_EVENT_REPORT_L1P5"
    spec_name: str = "full"
    uri_template: str = "event_report://{host_ip_port}/{medium}?size={block_bytes}"
    lock_dir: str = "/dev/shm"  # noqa: S108 - flock files for the one-sidecar-per-identity rule


class RingConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = ""  # default: derived from instance_id and dp_rank, as the engine does
    capacity_slots: Annotated[int, Meta(ge=0)] = 0  # 0: accept the segment's / default
    poll_interval_s: PosFloat = 0.002
    idle_poll_interval_s: PosFloat = 0.1  # the poll period backs off to this when idle (the
    # engine's doorbell wakes the sidecar sooner: shm_ring/doorbell.py)
    # While the backed-off period is below this, the sidecar polls without asking for the
    # doorbell: an engine stepping faster than that never pays a post (a syscall and a wake-up
    # that competes with its flush) per step; a longer quiet spell sleeps on the doorbell.
    bell_after_s: NonNegFloat = 0.016
    engine_snapshot_timeout_s: PosFloat = 30.0


DEFAULT_MEDIUM_MAP = "GPU=hbm,CPU=mem,CPU_PINNED=mem,DISK=disk,STORAGE=disk,EXTERNAL=remote"


class ZmqConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A vLLM / SGLang KV-event stream (`--kv-events-config`); env KV_CACHE_EVENT_ZMQ_*."""

    endpoint: str = ""  # the engine's `endpoint`, as given to it (tcp://*:5557, ipc://...)
    replay_endpoint: str = ""  # the engine's `replay_endpoint`; empty: no replay (gaps forget)
    bind: bool | None = None  # None: connect if the engine binds (tcp://*:P, ipc), else bind
    topic: str = ""  # the engine's `topic` (a prefix filter; empty: every topic)
    engine: Literal["vllm", "sglang", "auto"] = "auto"
    block_size: PosInt = 16  # tokens per block; events with another block_size are dropped
    model_name: str = "model"
    dtype: str = "auto"
    tp_size: PosInt = 1
    dp_size: PosInt = 1
    block_bytes: PosInt = 4096  # KV bytes per block (the spec size registered with KVCM)
    required_groups: str = "0"  # kv cache groups (group_idx) that must all hold a block
    medium_map: str = DEFAULT_MEDIUM_MAP  # engine medium=KVCM medium; absent medium = GPU
    health_url: str = ""  # e.g. http://127.0.0.1:8000/health; empty: no probe
    health_interval_s: PosFloat = 1.0
    health_timeout_s: PosFloat = 1.0
    health_fail_after: PosInt = 3  # consecutive failed probes that mean ENGINE_DOWN
    replay_timeout_s: PosFloat = 2.0  # no reply (or no end marker) in time: a forget
    # ... that a later replay may undo: timed recovery attempts (backoff from replay_timeout_s,
    # capped), and one at once whenever a stream that was silent comes back
    replay_retries: Annotated[int, Meta(ge=0)] = 8
    replay_retry_cap_s: PosFloat = 30.0
    # quiet this long after live batches: one replay from the last applied seq catches batches
    # lost at the end of a burst, which no later seq would reveal (0: never)
    tail_check_s: NonNegFloat = 1.0
    checkpoint_interval_s: PosFloat = 5.0
    # Keys (docs/operations.md "Keys"): engine = the engine's hash (low 64 bits); rolling =
    # KVCM's rolling hash of the block's token prefix, at kvcm_block_size; both = both keys
    # (doubles KVCM's metadata and snapshot size)
    key_mode: Literal["engine", "rolling", "both"] = "engine"
    # The live stream's receiver: libzmq (pyzmq's SUB: a thread receives each batch as it
    # comes), or zmtp (ZMTP 3.0 read on the sidecar's own loop once per flush window, no
    # thread: ~0.3-0.4 % of a core less at 5 k events/s; connect mode only, tcp:// or ipc://);
    # auto: zmtp where it can (the sidecar connects to tcp:// or ipc://), else libzmq
    transport: Literal["auto", "libzmq", "zmtp"] = "auto"
    # KVCM's tokens per block in rolling/both (0: block_size): block_size * n or block_size / n
    kvcm_block_size: Annotated[int, Meta(ge=0)] = 0
    key_table_entries: PosInt = 4_194_304  # rolling: (group, engine hash) -> state; bound (~LRU)
    router_hash_seed: str = "0"  # the key check's vllm_sha256_cbor seed (FlexLB's default "0")
    # rolling: report only this LoRA adapter's blocks (its lora_name, or its lora_id), under
    # this sidecar's own instance id; empty: the base model's blocks (LoRA ones are not reported)
    lora_adapter: str = ""

    @property
    def kvcm_block_tokens(self) -> int:
        """The block size KVCM sees: the engine's in `engine` mode, else kvcm_block_size."""
        if self.key_mode == "engine" or not self.kvcm_block_size:
            return self.block_size
        return self.kvcm_block_size


class SourceConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["ring", "zmq"] = "ring"
    state_dir: str = "/dev/shm/kvcm-sidecar"  # noqa: S108 - the ZMQ source's checkpoint
    zmq: ZmqConfig = msgspec.field(default_factory=ZmqConfig)


class ReportConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # A delta is sent when flush_window_s has passed since its oldest change, or as soon as
    # flush_at_keys keys are waiting (rtp-llm's publisher: 1000 events or 20 ms), so at high
    # rates a change waits ~flush_at_keys / rate, not the whole window. One request carries up to
    # batch_max_keys: a backlog (a request in flight, a retry) drains in fewer, bigger requests,
    # since each costs this sidecar ~0.5 ms of CPU (aiohttp) whatever its size. A flush_at_keys
    # above batch_max_keys acts as batch_max_keys (a full request is always sent at once).
    flush_window_s: NonNegFloat = 0.02
    # The adaptive window (source/base.py FlushPolicy): while fewer than flush_min_keys keys
    # wait, the window stretches up to flush_window_max_s, so that at low rates a request carries
    # more keys (each costs the sidecar ~0.3 ms of CPU, far more than its keys). No change waits
    # longer than flush_window_max_s; a value at or below flush_window_s (or flush_min_keys 0)
    # keeps the plain window. 45 ms: ~11 % fewer requests (and wake-ups) at 5 k events/s than
    # 40 ms, with event -> KVCM p99 ~45 ms, 5 ms inside issue #26's 50 ms bound for the
    # network and the manager.
    flush_window_max_s: NonNegFloat = 0.045
    flush_min_keys: NonNegInt = 512
    # A delta's answer may wait unread this long (kvcm_client/transport.py Hold): it is read at
    # the sidecar's next wake-up for another reason (the next window's source read), so a flush
    # window costs one wake-up of the process rather than two (~0.2 ms of CPU each on a VM).
    # KVCM gets every request as soon as before; only the moment its answer is read (acked)
    # moves, by at most this. 0: read every answer as it comes. Below manager.request_timeout_s.
    response_hold_s: NonNegFloat = 0.1
    flush_at_keys: PosInt = 1000
    batch_max_keys: PosInt = 4096
    heartbeat_interval_s: PosFloat = 1.0
    periodic_snapshot_s: PosFloat = 300.0
    # After a delta got no answer (timeout, broken connection), KVCM may still apply it later
    # with older state than its retry; the reconciling snapshot waits this long so that such a
    # straggler lands first (docs/wire.md).
    ambiguous_snapshot_delay_s: NonNegFloat = 5.0
    backoff_base_s: PosFloat = 0.5
    backoff_cap_s: PosFloat = 30.0
    retry_after_cap_s: PosFloat = 300.0
    circuit_retry_s: PosFloat = 60.0


class EngineConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    watch_interval_s: PosFloat = 0.25
    stale_after_s: PosFloat = 5.0
    dead_after_checks: PosInt = 2


class ShutdownConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    grace_s: PosFloat = 10.0
    host_down_budget_s: PosFloat = 0.5


class HttpConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    metrics_addr: str = "127.0.0.1:9400"


class LogConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["auto", "text", "json"] = "auto"
    repeat_interval_s: PosFloat = 60.0


class MemoryConfig(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Give the heap's free pages back to the kernel this often (glibc malloc_trim; 0: never):
    # freed key-table columns otherwise stay resident as holes (sidecar/malloc.py).
    trim_interval_s: NonNegFloat = 30.0


class Config(Frozen, frozen=True, forbid_unknown_fields=True, kw_only=True):
    publisher_type: Literal["none", "kvcm"] = "kvcm"
    manager: ManagerConfig = msgspec.field(default_factory=ManagerConfig)
    identity: IdentityConfig = msgspec.field(default_factory=IdentityConfig)
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    ring: RingConfig = msgspec.field(default_factory=RingConfig)
    report: ReportConfig = msgspec.field(default_factory=ReportConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    shutdown: ShutdownConfig = msgspec.field(default_factory=ShutdownConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        if self.publisher_type != "kvcm":
            return
        if self.source.kind == "zmq":
            _check_zmq(self.source.zmq)
        if not self.manager.endpoint:
            raise ValueError("manager.endpoint is required when publisher_type=kvcm")
        for seed in self.manager.endpoint.split(","):
            if not _ENDPOINT.fullmatch(seed.strip()):
                raise ValueError(
                    f"manager.endpoint entry {seed.strip()!r} must be http(s)://host:port"
                    " (one URL, or seed URLs separated by commas)"
                )
        if not self.identity.instance_id:
            raise ValueError("identity.instance_id is required when publisher_type=kvcm")
        if not self.identity.host_ip_port and not (
            self.identity.host_ip and self.identity.base_port
        ):
            raise ValueError(
                "identity.host_ip_port (or identity.host_ip + identity.base_port) is required "
                "when publisher_type=kvcm"
            )
        if "#" in self.host_ip_port():
            raise ValueError("identity.host_ip_port must not contain '#'")
        if _HOST_PORT.fullmatch(self.host_ip_port()) is None:
            raise ValueError(f"identity.host_ip_port {self.host_ip_port()!r} must be host:port")
        if self.report.backoff_cap_s < self.report.backoff_base_s:
            raise ValueError("report.backoff_cap_s must be >= report.backoff_base_s")
        if self.report.response_hold_s >= self.manager.request_timeout_s:
            raise ValueError("report.response_hold_s must be < manager.request_timeout_s")
        if self.shutdown.host_down_budget_s >= self.shutdown.grace_s:
            raise ValueError("shutdown.host_down_budget_s must be < shutdown.grace_s")
        parse_addr(self.http.metrics_addr)

    def host_ip_port(self) -> str:
        """The reporter identity for this dp_rank: explicit, or derived from a base port."""
        i = self.identity
        if i.host_ip_port:
            return i.host_ip_port.replace("{dp_rank}", str(i.dp_rank))
        return f"{i.host_ip}:{i.base_port + i.dp_rank * i.port_stride}"


_ZMQ_ENDPOINT = re.compile(r"(tcp://[^\s/]+:\d{1,5}|ipc://\S+|inproc://\S+)")
_HTTP_URL = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/\S*)?")


def medium_map(text: str) -> dict[str, str]:
    """`GPU=hbm,CPU=mem` -> {"GPU": "hbm", "CPU": "mem"}; ValueError names the bad entry."""
    out: dict[str, str] = {}
    for item in text.split(","):
        engine, sep, kvcm = (p.strip() for p in item.partition("="))
        if not sep or not engine or not kvcm or "#" in kvcm:
            raise ValueError(f"source.zmq.medium_map entry {item!r} must be ENGINE=KVCM (no '#')")
        out[engine] = kvcm
    return out


def group_list(text: str) -> tuple[int, ...]:
    try:
        groups = tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"source.zmq.required_groups {text!r}: comma list of ints") from None
    if not groups or any(not 0 <= g < 63 for g in groups):
        raise ValueError(f"source.zmq.required_groups {text!r}: groups 0..62, at least one")
    return groups


def _check_zmq(z: ZmqConfig) -> None:
    if not z.endpoint:
        raise ValueError("source.zmq.endpoint is required when source.kind=zmq")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(z, name)
        if value and not _ZMQ_ENDPOINT.fullmatch(value):
            raise ValueError(
                f"source.zmq.{name} {value!r} must be tcp://host:port, ipc://path or inproc://name"
            )
    if z.transport == "zmtp":
        connects = z.bind is False or (
            z.bind is None and ("*" in z.endpoint or z.endpoint.startswith("ipc://"))
        )
        if not connects or not z.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(
                f"source.zmq.transport zmtp connects to a tcp:// or ipc:// endpoint the engine "
                f"binds (tcp://*:P, ipc://path, or source.zmq.bind=false), not {z.endpoint!r}"
                + (" with source.zmq.bind=true" if z.bind else "")
            )
    if z.health_url and not _HTTP_URL.fullmatch(z.health_url):
        raise ValueError(f"source.zmq.health_url {z.health_url!r} must be http(s)://host[:port]/")
    medium_map(z.medium_map)
    group_list(z.required_groups)
    e, k = z.block_size, z.kvcm_block_tokens
    if z.key_mode != "engine" and max(e, k) % min(e, k):
        raise ValueError(
            f"source.zmq.kvcm_block_size {k} must be the engine's block size {e} times or "
            "divided by a whole number"
        )
    if z.key_mode != "engine" and k > 16_777_215:  # rekey.PENDING_MAX: an entry's 24 bits
        raise ValueError(f"source.zmq.kvcm_block_size {k} must be at most 16777215 tokens")
    if z.lora_adapter and z.key_mode != "rolling":
        raise ValueError(
            f"source.zmq.lora_adapter {z.lora_adapter!r} needs source.zmq.key_mode=rolling (an "
            "adapter's blocks are reported under their own instance's token keys), not "
            f"{z.key_mode}"
        )
    if z.lora_adapter and z.engine != "vllm":
        raise ValueError(
            f"source.zmq.lora_adapter {z.lora_adapter!r} needs source.zmq.engine=vllm, not "
            f"{z.engine} (SGLang's events carry no LoRA field: an adapter's sidecar would "
            "report nothing)"
        )


_ENDPOINT = re.compile(r"https?://([^@/\s]+@)?[A-Za-z0-9.\-\[\]:]+:\d{1,5}/?")
_HOST_PORT = re.compile(r"[^\s:]+(:[^\s:]+)*:\d{1,5}")


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"http.metrics_addr {addr!r} must be host:port")
    return host or "127.0.0.1", int(port)


# Seed names (kept exactly) and other documented aliases -> field paths.
ENV_ALIASES = {
    "KV_CACHE_EVENT_PUBLISHER_TYPE": "publisher_type",
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "manager.endpoint",
    "KV_CACHE_EVENT_INSTANCE_GROUP": "manager.instance_group",
    "KV_CACHE_EVENT_INSTANCE_ID": "identity.instance_id",
    "KV_CACHE_EVENT_HOST_IP_PORT": "identity.host_ip_port",
    "KV_CACHE_EVENT_DP_RANK": "identity.dp_rank",
    "KV_CACHE_EVENT_RING_NAME": "ring.name",
    "KV_CACHE_EVENT_RING_CAPACITY_SLOTS": "ring.capacity_slots",
    "KV_CACHE_EVENT_METRICS_ADDR": "http.metrics_addr",
    "KV_CACHE_EVENT_SOURCE": "source.kind",
    "KV_CACHE_EVENT_STATE_DIR": "source.state_dir",
    "KV_CACHE_EVENT_KVCM_BLOCK_SIZE": "source.zmq.kvcm_block_size",
}


def field_paths() -> list[tuple[str, Any, Any]]:
    """(path, type, default) for every leaf field, for docs and the generic env names."""
    out: list[tuple[str, Any, Any]] = []

    def walk(struct: type, prefix: str) -> None:
        for f in msgspec.structs.fields(struct):
            if isinstance(f.default_factory, type) and issubclass(f.default_factory, Frozen):
                walk(f.default_factory, f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", f.type, f.default))

    walk(Config, "")
    return out


def env_name(path: str) -> str:
    for name, p in ENV_ALIASES.items():
        if p == path:
            return name
    if path.startswith("source.zmq."):  # KV_CACHE_EVENT_ZMQ_ENDPOINT, ..._ZMQ_HEALTH_URL, ...
        return "KV_CACHE_EVENT_ZMQ_" + path.removeprefix("source.zmq.").upper()
    return "KV_CACHE_EVENT_" + path.replace(".", "_").upper()


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: {p} is not a section")
    node[parts[-1]] = value


def load(
    *,
    env: Mapping[str, str],
    toml_path: Path | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Config:
    """Merge the sources and convert once; every error names its source and field."""
    tree: dict[str, Any] = {}
    source: dict[str, str] = {}
    known = {p for p, _t, _d in field_paths()}
    if toml_path is not None:
        try:
            data = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {toml_path}: {exc}") from None
        for path, value in _flatten(data):
            if path not in known:
                raise ConfigError(f"config file {toml_path}: unknown field {path}")
            _set(tree, path, value)
            source[path] = f"config file {toml_path}"
    for path, _t, _d in field_paths():
        name = env_name(path)
        if name in env:
            raw = env[name]
            if path in _LOWERED:
                raw = raw.strip().lower()
            if path == "source.zmq.bind" and not raw.strip():
                continue  # unset: infer
            _set(tree, path, raw)
            source[path] = f"env {name}"
    for raw_path, text in (overrides or {}).items():
        path = raw_path.replace("-", "_")
        if path not in known:
            raise ConfigError(f"--set {raw_path}: unknown field")
        _set(tree, path, text.strip().lower() if path in _LOWERED else text)
        source[path] = f"--set {raw_path}"
    try:
        return msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = re.search(r"at `\$\.([\w.]+)`", msg)
        path = m.group(1) if m else ""
        where = source.get(path, "")
        if not where:
            named = re.match(r"([\w.]+) ", msg)
            where = source.get(named.group(1), "defaults") if named else "defaults"
        raise ConfigError(f"{where}: {path}: {msg}" if path else f"{where}: {msg}") from None


_LOWERED = ("publisher_type", "source.kind", "source.zmq.engine", "source.zmq.key_mode")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out += _flatten(v, path + ".")
        else:
            out.append((path, v))
    return out


def redacted(cfg: Config) -> dict[str, Any]:
    """The effective config for logs and `check-config`; credentials in URLs are masked."""
    data: dict[str, Any] = msgspec.to_builtins(cfg)
    ep = data["manager"]["endpoint"]
    data["manager"]["endpoint"] = re.sub(r"//[^@/]+@", "//***@", ep)
    return data
