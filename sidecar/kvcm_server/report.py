"""ReportEvent: the six event types, generations, snapshots, the delta gate and the rate limit.

Imports: stdlib, asyncio, state, proto. One instance per server; the only awaits are the delta
gate (deltas wait for an in-flight snapshot up to `snapshot_delta_drain_timeout_ms`) and the
injectable snapshot commit delay used by tests to hold a snapshot open.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sidecar.kvcm_server import proto as P
from sidecar.kvcm_server.state import ApiError, Reporter, State, stamp, valid_uri

REGISTER, ADD, DELETE, HOST_DOWN, HEARTBEAT, SNAPSHOT = (
    "EVENT_NODE_REGISTER",
    "EVENT_BLOCK_ADD",
    "EVENT_BLOCK_DELETE",
    "EVENT_HOST_DOWN",
    "EVENT_HEARTBEAT",
    "EVENT_BLOCK_SNAPSHOT",
)


class ItemError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_SPEC_CACHE: dict[tuple[tuple[Any, Any], ...], dict[str, str]] = {}


def _specs(payload: dict[str, Any]) -> dict[str, str]:
    specs = payload.get("specs") or []
    if not isinstance(specs, list) or not specs:
        raise ItemError("INVALID_ARGUMENT", "specs must be a non-empty list")
    try:
        ident = tuple((s["name"], s["uri"]) for s in specs)
        cached = _SPEC_CACHE.get(ident)
        if cached is not None:
            return cached  # publishers repeat the same spec list for every block
    except (TypeError, KeyError):
        ident = ()
    out: dict[str, str] = {}
    for s in specs:
        name, uri = (s.get("name"), s.get("uri")) if isinstance(s, dict) else (None, None)
        if not isinstance(name, str) or not name or name in out:
            raise ItemError("INVALID_ARGUMENT", f"spec name {name!r} is empty or duplicated")
        if not isinstance(uri, str) or not valid_uri(uri):
            raise ItemError("INVALID_ARGUMENT", f"spec {name} uri {uri!r} is invalid")
        out[name] = uri
    if ident and len(_SPEC_CACHE) < 1024:
        _SPEC_CACHE[ident] = out
    return out


def _key_medium(payload: dict[str, Any]) -> tuple[int, str]:
    key = P.parse_block_key(payload.get("block_key"))
    if key is None:
        raise ItemError("INVALID_ARGUMENT", f"block_key {payload.get('block_key')!r} is invalid")
    medium = payload.get("medium")
    if not isinstance(medium, str) or not medium or "#" in medium:
        raise ItemError("INVALID_ARGUMENT", f"medium {medium!r} is invalid")
    return key, medium


class EventReport:
    def __init__(self, state: State) -> None:
        self.state = state
        self.gates: dict[tuple[str, str, str], asyncio.Event] = {}
        self.commit_delay_s = 0.0  # fault injection: hold snapshot commits open
        self.snapshot_started = asyncio.Event()  # set when a commit begins (tests wait on it)
        self.fail_items = 0  # fault injection: the next N ADD/DELETE items fail, not applied

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        iid = req.get("instance_id") or ""
        host = req.get("host_ip_port") or ""
        events = req.get("events") or []
        out: dict[str, Any] = {
            "extra_info": "",
            "committed_snapshot_version": "",
            "retry_after_ms": "0",
            "snapshot_required": False,
        }
        inst = st.instances.get(iid) if isinstance(iid, str) else None
        if inst is not None:
            out["extra_info"] = st.groups.get(inst["instance_group"], {}).get("extra_info", "")
        if not isinstance(iid, str) or not isinstance(host, str):
            raise ApiError("INVALID_ARGUMENT", "instance_id and host_ip_port must be strings")
        if not iid or not host or "#" in host:
            raise ApiError(
                "INVALID_ARGUMENT",
                "instance_id and host_ip_port are required; host_ip_port must not contain '#'",
            )
        if not isinstance(events, list):
            raise ApiError("INVALID_ARGUMENT", "events must be a list")
        if not events:
            return out
        stype = P.enum_name(req.get("storage_type"), P.STORAGE_TYPES)
        if stype is None:
            raise ApiError(
                "INVALID_ARGUMENT",
                f"storage_type {req.get('storage_type')!r} is missing or unknown",
            )
        storage = st.storage_for(iid, stype)
        types = [
            P.enum_name(e.get("event_type") if isinstance(e, dict) else None, P.EVENT_TYPES)
            for e in events
        ]
        n_snap = types.count(SNAPSHOT)
        if n_snap > 1 or (n_snap and (ADD in types or DELETE in types)):
            raise ApiError(
                "INVALID_ARGUMENT",
                "a snapshot must not be mixed with another snapshot, ADD or DELETE",
            )
        if HOST_DOWN in types and len(events) > 1:
            raise ApiError("INVALID_ARGUMENT", "HOST_DOWN must be the only event")
        key = (iid, stype, host)
        r = st.reporters.get(key)
        now = st.clock()
        if r is not None and st.liveness(r, now) == "tombstoned":
            if types[0] != REGISTER:
                raise ApiError(
                    "NODE_NOT_REGISTERED", "reporter is tombstoned: send NODE_REGISTER first"
                )
            r = None
        had_generation = r is not None and r.version is not None
        created = r is None
        if r is None:
            r = Reporter(iid, stype, host, storage["global_unique_name"], now, now)
            st.reporters[key] = r
        if (ADD in types or DELETE in types) and r.snapshot_busy:
            await self._wait_gate(r, storage)
        results: list[str] = []
        useful = False
        for ev, etype in zip(events, types, strict=True):
            try:
                if etype == SNAPSHOT:
                    await self._snapshot(r, ev.get("block_snapshot"), out)
                elif etype in (ADD, DELETE) and self.fail_items > 0:
                    self.fail_items -= 1
                    raise ItemError("INTERNAL_ERROR", "injected item failure")
                else:
                    self._apply(r, etype, ev)
                results.append("OK")
                useful = True
            except ItemError as exc:
                results.append(exc.code)
                out.setdefault("_messages", []).append(str(exc))
        if created and not useful:
            del st.reporters[key]  # an invalid-only first request creates nothing
        out["snapshot_required"] = not had_generation and not (n_snap and useful)
        if r.version and r.strict:
            out["committed_snapshot_version"] = r.version
        failed = [c for c in results if c != "OK"]
        msgs = out.pop("_messages", [])
        if failed:
            out["item_results"] = results
            out["_code"] = failed[0]
            out["_message"] = "ReportEvent partially failed; see item_results: " + "; ".join(
                msgs[:3]
            )
        st.save_blocks_later()
        return out

    def _apply(self, r: Reporter, etype: str | None, ev: dict[str, Any]) -> None:
        st = self.state
        if etype is None:
            raise ItemError("INVALID_ARGUMENT", "unknown event_type")
        payload = ev.get(P.PAYLOAD_OF[etype])
        if not isinstance(payload, dict):
            raise ItemError("INVALID_ARGUMENT", f"{etype} needs its {P.PAYLOAD_OF[etype]} payload")
        now = st.clock()
        if etype == REGISTER:
            mediums = payload.get("mediums") or []
            if any(not isinstance(m, str) or not m or "#" in m for m in mediums):
                raise ItemError("INVALID_ARGUMENT", "mediums must be non-empty without '#'")
            r.mediums.update(mediums)
            r.last_heartbeat = now
            r.last_commit = None  # re-registration resets the snapshot rate limit
        elif etype == HEARTBEAT:
            ss = payload.get("system_status") or {}
            r.system_status = (
                {str(k): str(v) for k, v in ss.items()} if isinstance(ss, dict) else {}
            )
            r.last_heartbeat = now
            r.heartbeat_times.append(now)
        elif etype == ADD:
            key, medium = _key_medium(payload)
            specs = _specs(payload)
            if r.version is None:
                r.version = P.new_version()
            loc = (
                st.blocks.setdefault(r.instance_id, {})
                .setdefault(key, {})
                .setdefault((r.storage_type, medium, r.host_ip_port), {})
            )
            for name, uri in specs.items():
                loc[name] = stamp(uri, r.version)
            r.mediums.add(medium)
            st.note_arrival(r, key, now)
        elif etype == DELETE:
            key, medium = _key_medium(payload)
            names = payload.get("spec_names") or []
            if (
                not isinstance(names, list)
                or not names
                or any(not isinstance(n, str) or not n for n in names)
            ):
                raise ItemError("INVALID_ARGUMENT", "spec_names must be a non-empty list of names")
            if r.version is None:
                r.version = P.new_version()
            locs = st.blocks.get(r.instance_id, {}).get(key)
            loc_key = (r.storage_type, medium, r.host_ip_port)
            if locs and loc_key in locs:
                for n in names:
                    locs[loc_key].pop(n, None)
                if not locs[loc_key]:
                    del locs[loc_key]
                if not locs:
                    del st.blocks[r.instance_id][key]
        elif etype == HOST_DOWN:
            st.tombstone(r)

    async def _wait_gate(self, r: Reporter, storage: dict[str, Any]) -> None:
        gate = self.gates.setdefault(r.key, asyncio.Event())
        timeout = storage["event_report"]["snapshot_delta_drain_timeout_ms"] / 1000
        try:
            async with asyncio.timeout(timeout):
                await gate.wait()
        except TimeoutError:
            raise ApiError(
                "SNAPSHOT_IN_PROGRESS", "a snapshot is committing; retry the deltas"
            ) from None

    async def _snapshot(self, r: Reporter, payload: Any, out: dict[str, Any]) -> None:
        st = self.state
        if not isinstance(payload, dict):
            raise ItemError("INVALID_ARGUMENT", "EVENT_BLOCK_SNAPSHOT needs block_snapshot")
        if r.snapshot_busy:
            raise ApiError("SNAPSHOT_IN_PROGRESS", "another snapshot is committing")
        left = st.snapshot_interval_left_ms(r)
        if left > 0:
            raise ApiError(
                "SNAPSHOT_RATE_LIMITED",
                f"snapshot allowed again in {left} ms",
                retry_after_ms=str(left),
                committed_snapshot_version=r.version if r.strict and r.version else "",
            )
        outer_medium = payload.get("medium")
        blocks: dict[tuple[int, str], dict[str, str]] = {}
        for b in payload.get("blocks") or []:
            if not isinstance(b, dict):
                raise ItemError("INVALID_ARGUMENT", "snapshot blocks must be objects")
            if "medium" not in b and outer_medium:
                b = {**b, "medium": outer_medium}
            key, medium = _key_medium(b)
            if (key, medium) in blocks:
                raise ItemError("INVALID_ARGUMENT", f"block {key} medium {medium} appears twice")
            blocks[(key, medium)] = _specs(b)
        r.snapshot_busy = True
        gate = self.gates.setdefault(r.key, asyncio.Event())
        gate.clear()
        self.snapshot_started.set()
        try:
            if self.commit_delay_s:
                await asyncio.sleep(self.commit_delay_s)  # fault injection: a slow commit
            version = P.new_version()
            inst_blocks = st.blocks.setdefault(r.instance_id, {})
            for (key, medium), specs in blocks.items():
                inst_blocks.setdefault(key, {})[(r.storage_type, medium, r.host_ip_port)] = {
                    n: stamp(u, version) for n, u in specs.items()
                }
                r.mediums.add(medium)
                st.note_arrival(r, key, st.clock())
            st.gc_reporter(r, keep_version=version)  # omitted blocks vanish at once
            r.version = version
            r.strict = True
            r.last_commit = st.clock()
        finally:
            r.snapshot_busy = False
            gate.set()
