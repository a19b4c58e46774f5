"""The KVCM-compatible HTTP server: meta and admin routes, queries, debug view, fault injection.

Imports: stdlib, aiohttp, msgspec (via proto), state, report. Every route is POST /api/<name>
with a proto3-JSON body; an unparseable body is HTTP 400 `{}`, an oversized one HTTP 413 `{}`;
every other outcome is HTTP 200 with `header.status.code` (contract §1). `/debug/*` is this
stand-in's own: a read-only view for tests and the demo, and fault injection.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from sidecar.keys import rolling_keys
from sidecar.kvcm_server import proto as P
from sidecar.kvcm_server.report import EventReport
from sidecar.kvcm_server.state import ApiError, KeyMap, Loc, State, uri_version

if TYPE_CHECKING:
    from sidecar.kvcm_server.cluster import Cluster, Meta

log = logging.getLogger(__name__)
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
DEFAULT_MAX_BODY = 64 * 1024 * 1024
# Routes that change what Redis holds in cluster mode (written through before the answer).
META_WRITES = frozenset({"addStorage", "updateStorage", "createInstanceGroup", "registerInstance"})
STATE_KEY = web.AppKey("state", State)


def _int(value: Any) -> int:
    """A proto3-JSON integer (a number or decimal text); 0 when absent or malformed."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return 0


class Faults:
    """Test-controlled misbehaviour: per route, the next `count` requests get the fault (with
    `event`, only requests whose body names that event type, e.g. "EVENT_HEARTBEAT")."""

    def __init__(self) -> None:
        self.rules: dict[str, dict[str, Any]] = {}
        self.taken = asyncio.Event()  # set when a request got a fault (in-process tests wait)
        self.delaying = 0  # requests inside a delay fault right now
        self.settled = asyncio.Event()  # set while no request is inside a delay fault
        self.settled.set()

    async def delay(self, seconds: float) -> None:
        """A delay fault; tests await `settled` before stopping the server, so no handler is
        left sleeping on a connection that the shutdown would abandon."""
        self.delaying += 1
        self.settled.clear()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.delaying -= 1
            if not self.delaying:
                self.settled.set()

    def take(self, route: str, body: bytes) -> dict[str, Any] | None:
        for name in (route, "*"):
            rule = self.rules.get(name)
            if rule and rule.get("event") and f'"{rule["event"]}"'.encode() not in body:
                continue
            if rule and rule.get("count", 0) != 0:
                if rule["count"] > 0:
                    rule["count"] -= 1
                self.taken.set()
                return rule
        return None


class KvcmServer:
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        state_file: Path | None = None,
        bootstrap: bool = False,
        group: str = "default",
        max_body: int = DEFAULT_MAX_BODY,
        event_report: dict[str, int] | None = None,
        cluster: Cluster | None = None,
        node_id: str = "kvcm-standin",
    ) -> None:
        self.state = State(clock, state_file)
        self.report = EventReport(self.state)
        self.cluster = cluster
        self.node_id = cluster.node.node_id if cluster is not None else node_id
        self.bootstrap_args = (group, event_report or {}) if bootstrap else None
        if cluster is not None:
            cluster.on_elected = self._elected
            cluster.on_deposed = self._deposed
        self.faults = Faults()
        self.max_body = max_body
        self.requests: dict[str, int] = {}
        # Write sessions (no data is stored): id -> (instance, keys handed a location, expiry),
        # and per instance and key the writes finished successfully (they count as replicas).
        self.sessions: dict[str, tuple[str, list[int], float]] = {}
        self.written: dict[str, dict[int, int]] = {}
        if bootstrap and cluster is None:  # a cluster's leader bootstraps when elected
            self.bootstrap(group, event_report or {})

    # ---- cluster mode ----------------------------------------------------------------------
    def _reset(self, meta: Meta | None, blocks: bytes | None = None) -> None:
        """Start over as a restarted KVCM does: persisted metadata only (or nothing)."""
        self.state = State(self.state.clock)
        if meta is not None:
            self.state.storages = meta["storages"]
            self.state.groups = meta["groups"]
            self.state.instances = meta["instances"]
        if blocks:
            self.state.load_blocks(msgspec.json.decode(blocks))
        self.report = EventReport(self.state)
        self.sessions.clear()
        self.written.clear()

    def _meta(self) -> Meta:
        st = self.state
        return {"storages": st.storages, "groups": st.groups, "instances": st.instances}

    async def _elected(self, meta: Meta, blocks: bytes | None) -> None:
        self._reset(meta, blocks)
        if self.bootstrap_args is not None:
            self.bootstrap(*self.bootstrap_args)
        assert self.cluster is not None
        await self.cluster.persist(self._meta())

    def _deposed(self) -> None:
        self._reset(None)  # a follower holds no reporters and answers nothing from memory

    async def save_blocks(self) -> None:
        """Cluster mode: the block metadata into Redis, encoded between requests."""
        st = self.state
        if not st.dirty or self.cluster is None or not self.cluster.is_leader():
            return
        st.dirty = False
        pieces = []
        for piece in st.block_pieces():
            pieces.append(piece)
            await asyncio.sleep(0)  # serve requests between pieces
        if not await self.cluster.save_blocks(b"".join(pieces)) and st is self.state:
            st.dirty = True

    def leader_now(self) -> bool:
        return self.cluster is None or self.cluster.is_leader()

    def bootstrap(self, group: str, event_report: dict[str, int]) -> None:
        st = self.state
        for name, stype in (
            ("events_l1p5", "ST_EVENT_REPORT_L1P5"),
            ("events_l2", "ST_EVENT_REPORT_L2"),
        ):
            if name not in st.storages:
                st.add_storage(
                    {
                        "storage": {
                            "global_unique_name": name,
                            "storage_type": stype,
                            "event_report": event_report,
                        }
                    }
                )
        if group not in st.groups:
            st.create_group(
                {
                    "instance_group": {
                        "name": group,
                        "event_report_storage_candidates": ["events_l1p5", "events_l2"],
                        "extra_info": "",
                    }
                }
            )

    # ---- plumbing ------------------------------------------------------------------------
    def app(self, *, admin: bool = True, meta: bool = True) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app[STATE_KEY] = self.state
        routes: dict[str, Handler] = {}
        if meta:
            routes.update(
                {
                    "registerInstance": self.register_instance,
                    "reportEvent": self.report_event,
                    "getInstanceInfo": self.get_instance_info,
                    "getCacheLocation": self.get_cache_location,
                    "getCacheLocationLen": self.get_cache_location_len,
                    "getCacheLocationsByBackend": self.get_cache_locations_by_backend,
                    "getHostCacheState": self.get_host_cache_state,
                    "startWriteCache": self.start_write_cache,
                    "finishWriteCache": self.finish_write_cache,
                }
            )
            app.router.add_post("/api/getClusterInfo", self.get_cluster_info)
        if admin:
            routes.update(
                {
                    "addStorage": self.add_storage,
                    "updateStorage": self.update_storage,
                    "listStorage": self.list_storage,
                    "createInstanceGroup": self.create_instance_group,
                    "getInstanceGroup": self.get_instance_group,
                }
            )
        for name, fn in routes.items():
            app.router.add_post(f"/api/{name}", self._wrap(name, fn))
        app.router.add_get("/debug/reporters", self.debug_reporters)
        app.router.add_post("/debug/faults", self.debug_faults)
        app.router.add_get("/debug/arrivals", self.debug_arrivals)
        app.router.add_get("/debug/cluster", self.debug_cluster)
        app.cleanup_ctx.append(self._saver)
        return app

    async def _saver(self, app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(0.5)
                if self.cluster is not None:
                    await self.save_blocks()
                elif self.state.dirty:
                    steps = self.state.save_steps()
                    try:
                        for _ in steps:
                            await asyncio.sleep(0)  # serve requests between pieces
                    except OSError as exc:  # a full or read-only disk: retried while dirty
                        log.warning("kvcm-server: state file not saved: %s", exc)
                    finally:
                        steps.close()  # cancelled at shutdown: drop the partial file now

        task = asyncio.create_task(loop())  # owned by this cleanup context, cancelled below
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.state.save()

    def _wrap(self, name: str, fn: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            self.requests[name] = self.requests.get(name, 0) + 1
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return web.Response(status=413, body=b"{}", content_type="application/json")
            if not self.leader_now():
                return self._not_leader()
            # The term this request is served in: deposed and elected again while it awaited,
            # the node replaced its state, and a write that went into the old one was lost.
            term = self.cluster.elections if self.cluster is not None else 0
            fault = self.faults.take(name, raw)
            if fault:
                if fault.get("delay_ms"):
                    await self.faults.delay(fault["delay_ms"] / 1000)
                if fault.get("status"):
                    return web.Response(
                        status=fault["status"], body=b"{}", content_type="application/json"
                    )
                if fault.get("body") is not None:
                    return web.Response(
                        body=io.BytesIO(fault["body"].encode()),  # streamed: bodies may be large
                        content_type="application/json",
                    )
            typed = P.decode_report(raw) if name == "reportEvent" else None
            trace_id: Any = typed[0].trace_id if typed else ""
            try:
                if typed is None:
                    req = P.decode(raw, lazy_events=name == "reportEvent")
                    trace_id = req.get("trace_id", "")
            except P.BadRequest:
                return web.Response(status=400, body=b"{}", content_type="application/json")
            try:
                out = await (self.report.handle_typed(*typed) if typed else fn(req))
                code, message = out.pop("_code", "OK"), out.pop("_message", "")
                if self.cluster is not None and name in META_WRITES:
                    await self._persist()
            except (TypeError, ValueError, AttributeError, KeyError) as exc:
                # A field of the wrong JSON type deep in the body: the message was not valid
                # for its proto, which the real server answers with HTTP 400 `{}`.
                log.info("bad request route=%s error=%r", name, exc)
                return web.Response(status=400, body=b"{}", content_type="application/json")
            except ApiError as exc:
                code, message, out = exc.code, str(exc), dict(exc.extra)
                if name == "reportEvent":
                    # The group's extra_info is echoed on error answers too (contract §12).
                    iid = typed[0].instance_id if typed else req.get("instance_id")
                    out = {**self.report._reply(iid), **out}
            if not self.leader_now() or (
                self.cluster is not None and self.cluster.elections != term
            ):
                return self._not_leader()  # the lease ended meanwhile: this was not accepted
            body = {**P.header(code, message, trace_id), **out}
            return web.Response(body=P.encode(body), content_type="application/json")

        return handler

    async def _persist(self) -> None:
        assert self.cluster is not None
        if not await self.cluster.persist(self._meta()):
            raise ApiError("SERVER_NOT_LEADER", "lost the leader lease")

    def _not_leader(self) -> web.Response:
        leader = self.cluster.leader if self.cluster is not None else None
        where = f"; leader is {leader.node_id}" if leader is not None else ""
        body = P.header("SERVER_NOT_LEADER", f"node {self.node_id} is not the leader{where}")
        return web.Response(body=P.encode(body), content_type="application/json")

    async def get_cluster_info(self, request: web.Request) -> web.Response:
        """`{self_node_id, leader_node_id, leader_endpoint}`. A standalone server is its own
        leader, at the address the client reached it by (its Host header: behind a proxy or a
        Service that is not the socket's own address, and a client told the socket's would
        leave the path it was given); a cluster node answers from the lease."""
        await request.read()
        if self.cluster is None:
            sock = request.transport.get_extra_info("sockname") if request.transport else None
            host, port = (sock[0], sock[1]) if sock else ("127.0.0.1", 0)
            named, _, named_port = request.host.rpartition(":")
            if named and named_port.isdigit():
                host, port = named.strip("[]"), int(named_port)
            ep: dict[str, Any] | None = {
                "node_id": self.node_id,
                "host": host,
                "meta_rpc_port": 0,
                "meta_http_port": port,
            }
        elif self.cluster.is_leader():
            ep = msgspec.structs.asdict(self.cluster.node)
        else:
            leader = self.cluster.leader
            ep = msgspec.structs.asdict(leader) if leader is not None else None
        if ep is None:
            body = {
                **P.header("SERVICE_NOT_READY", "no leader elected"),
                "self_node_id": self.node_id,
                "leader_node_id": "",
            }
        else:
            body = {
                **P.header("OK"),
                "self_node_id": self.node_id,
                "leader_node_id": ep["node_id"],
                "leader_endpoint": ep,
            }
        return web.Response(body=P.encode(body), content_type="application/json")

    # ---- admin ---------------------------------------------------------------------------
    async def add_storage(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.add_storage(req)
        return {}

    async def update_storage(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.add_storage(req, update=True)
        return {}

    async def list_storage(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"storages": list(self.state.storages.values())}

    async def create_instance_group(self, req: dict[str, Any]) -> dict[str, Any]:
        self.state.create_group(req)
        return {}

    async def get_instance_group(self, req: dict[str, Any]) -> dict[str, Any]:
        g = self.state.groups.get(req.get("name") or req.get("instance_group_name") or "")
        if g is None:
            raise ApiError("INSTANCE_NOT_EXIST", "no such instance group")
        return {"instance_group": g}

    # ---- meta ----------------------------------------------------------------------------
    async def report_event(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self.report.handle(req)  # self.report is replaced when leadership changes

    async def register_instance(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.state.register_instance(req)

    async def get_instance_info(self, req: dict[str, Any]) -> dict[str, Any]:
        inst = self._instance(req)
        return {"instance_group": inst["instance_group"], "instance_info": inst}

    def _instance(self, req: dict[str, Any]) -> dict[str, Any]:
        inst = self.state.instances.get(req.get("instance_id") or "")
        if inst is None:
            raise ApiError("INSTANCE_NOT_EXIST", f"instance {req.get('instance_id')!r} not found")
        return inst

    def _query_keys(self, req: dict[str, Any], inst: dict[str, Any], field: str) -> list[int]:
        if req.get("token_ids"):
            return rolling_keys([int(t) for t in req["token_ids"]], inst["block_size"])
        keys = []
        for k in req.get(field) or []:
            v = P.parse_block_key(k, allow_number=True)
            if v is None:
                raise ApiError("INVALID_ARGUMENT", f"{field} entry {k!r} is not an int64")
            keys.append(v)
        return keys

    def _visible_locs(self, iid: str, key: int) -> dict[tuple[str, str, str], dict[str, str]]:
        inst = self.state.blocks.get(iid)
        locs = (inst.get(key) if inst is not None else None) or {}
        return {
            loc: dict(specs)
            for loc, specs in locs.items()
            if self.state.visible(loc[0], loc[2], iid, specs)
        }

    @staticmethod
    def _query_type(
        req: dict[str, Any],
        inst: dict[str, Any],
        fallback: str,
        allowed: tuple[str, ...],
        code: str,
    ) -> str:
        """The request's query type; QT_UNSPECIFIED means the instance's default_query_type."""
        qt = P.enum_name(req.get("query_type", 0), P.QUERY_TYPES) or "QT_UNSPECIFIED"
        if qt == "QT_UNSPECIFIED":
            qt = inst.get("default_query_type") or fallback
        if qt not in (*allowed, "QT_UNSPECIFIED"):
            raise ApiError(code, f"query_type {qt} is not supported here")
        return qt

    @staticmethod
    def _location(storage_type: str, specs: list[dict[str, str]]) -> dict[str, Any]:
        """A CacheLocation: `spec_size` is an int32, so a JSON number (contract §1)."""
        return {"type": storage_type, "spec_size": len(specs), "location_specs": specs}

    async def get_cache_location(self, req: dict[str, Any]) -> dict[str, Any]:
        inst = self._instance(req)
        qt = self._query_type(
            req, inst, "QT_BATCH_GET", ("QT_BATCH_GET", "QT_PREFIX_MATCH"), "UNSUPPORTED"
        )
        names = set(req.get("location_spec_names") or [])
        rows = []
        for key in self._query_keys(req, inst, "block_keys"):
            # One row per key, of one storage type (a CacheLocation has one `type`): the first
            # type (L1P5 before L2) holding a requested spec, its mediums' specs merged.
            by_type: dict[str, list[dict[str, str]]] = {}
            for loc, sp in sorted(self._visible_locs(inst["instance_id"], key).items()):
                specs = [{"name": n, "uri": u} for n, u in sp.items() if not names or n in names]
                if specs:
                    by_type.setdefault(loc[0], []).extend(specs)
            if not by_type and qt == "QT_PREFIX_MATCH":
                break
            stype = min(by_type, default="ST_UNSPECIFIED")
            rows.append(self._location(stype, by_type.get(stype, [])))
        return {"locations": rows}

    async def get_cache_location_len(self, req: dict[str, Any]) -> dict[str, Any]:
        out = await self.get_cache_location({**req, "query_type": "QT_PREFIX_MATCH"})
        return {"cache_location_len": str(len(out["locations"]))}

    async def get_cache_locations_by_backend(self, req: dict[str, Any]) -> dict[str, Any]:
        """BATCH_GET with `backend_selectors[].backend_type` (name or number; none = all):
        per requested key, every visible location of a selected type holding a requested spec
        (`location_spec_names` filters candidates, then projects their specs)."""
        inst = self._instance(req)
        qt = P.enum_name(req.get("query_type", 0), P.QUERY_TYPES)
        if qt not in ("QT_UNSPECIFIED", "QT_BATCH_GET"):
            raise ApiError("UNSUPPORTED", f"query_type {qt} is not supported here")
        selectors = req.get("backend_selectors") or []
        backends = set()
        for sel in selectors:
            raw = sel.get("backend_type", 0) if isinstance(sel, dict) else None
            name = P.enum_name(raw, P.ALL_STORAGE_TYPES)
            if name is None:
                raise ApiError("INVALID_ARGUMENT", f"backend_type {raw!r} is unknown")
            backends.add(name)
        names = set(req.get("location_spec_names") or [])
        rows = []
        for key in self._query_keys(req, inst, "block_keys"):
            locs = []
            for loc, sp in sorted(self._visible_locs(inst["instance_id"], key).items()):
                specs = [{"name": n, "uri": u} for n, u in sp.items() if not names or n in names]
                if specs and (not backends or loc[0] in backends):
                    locs.append(self._location(loc[0], specs))
            rows.append({"locations": locs})
        return {"key_locations": rows}

    async def get_host_cache_state(self, req: dict[str, Any]) -> dict[str, Any]:
        inst = self._instance(req)
        self._query_type(
            req,
            inst,
            "QT_PREFIX_MATCH",
            ("QT_PREFIX_MATCH", "QT_PREFIX_MATCH_WITH_MAMBA"),
            "INVALID_ARGUMENT",
        )
        mediums = set(req.get("medium") or [])
        keys = self._query_keys(req, inst, "block_cache_keys")
        per_key = []
        for key in keys:
            locs = self._visible_locs(inst["instance_id"], key)
            per_key.append({loc for loc in locs if not mediums or loc[1] in mediums})
        hosts = sorted({loc[2] for locs in per_key for loc in locs})
        out = []
        for h in hosts:
            local = 0
            while local < len(keys) and any(loc[2] == h for loc in per_key[local]):
                local += 1
            total = local  # continue the prefix from other hosts' L2 (remote P2P) copies
            while total < len(keys) and any(
                loc[0] == "ST_EVENT_REPORT_L2" or loc[2] == h for loc in per_key[total]
            ):
                total += 1
            if local:
                out.append(
                    {
                        "host_ip_port": h,
                        "local": str(local),
                        "p2p_1_fetch": str(total - local),
                        "p2p_1_total_match": str(total),
                    }
                )
        return {"hosts": out}

    async def start_write_cache(self, req: dict[str, Any]) -> dict[str, Any]:
        """A write location for every key whose visible event-report replicas plus finished
        writes are fewer than `min_replica_count` (at least 1); the others are masked."""
        inst = self._instance(req)
        keys = self._query_keys(req, inst, "block_keys")
        want = max(_int(req.get("min_replica_count")), 1)
        timeout_s = min(_int(req.get("write_timeout_seconds")) or 30, 1800)
        iid = inst["instance_id"]
        written = self.written.setdefault(iid, {})
        masked = [len(self._visible_locs(iid, k)) + written.get(k, 0) >= want for k in keys]
        todo = [k for k, m in zip(keys, masked, strict=True) if not m]
        session = P.new_version()
        now = self.state.clock()
        self.sessions = {s: v for s, v in self.sessions.items() if v[2] > now}  # expired go
        self.sessions[session] = (iid, todo, now + timeout_s)
        specs = [s["name"] for s in inst["location_spec_infos"]]
        locations = [
            self._location(
                "ST_NFS",
                [{"name": n, "uri": f"file://kvcm-standin/{iid}/{k}/{n}"} for n in specs],
            )
            for k in todo
        ]
        return {
            "write_session_id": session,
            "block_mask": {"bool_masks": {"values": masked}},
            "locations": locations,
        }

    async def finish_write_cache(self, req: dict[str, Any]) -> dict[str, Any]:
        """`success_blocks` indexes the session's write locations: `{offset: n}` = the first n,
        `{bool_masks: {values}}` = those marked true; each success counts as one replica."""
        inst = self._instance(req)
        sid = req.get("write_session_id") or ""
        held = self.sessions.get(sid)
        if held is None or held[0] != inst["instance_id"] or held[2] <= self.state.clock():
            self.sessions.pop(sid, None)
            raise ApiError("INVALID_ARGUMENT", f"write session {sid!r} is unknown or expired")
        del self.sessions[sid]
        iid, todo, _ = held
        mask = req.get("success_blocks") or {}
        if "bool_masks" in mask:
            values = (mask.get("bool_masks") or {}).get("values") or []
            done = [k for k, ok in zip(todo, values, strict=False) if ok is True]
        else:
            done = todo[: max(_int(mask.get("offset")), 0)]
        written = self.written.setdefault(iid, {})
        for k in done:
            written[k] = written.get(k, 0) + 1
        return {}

    # ---- debug ---------------------------------------------------------------------------
    async def debug_reporters(self, request: web.Request) -> web.Response:
        st = self.state
        out = []
        for r in st.reporters.values():
            # Blocks share their Specs objects: decide visibility and versions once per object
            # (per block, this held the loop ~70 ms for 8 k blocks, twice a second in the demo).
            seen: dict[tuple[Loc, int], tuple[bool, tuple[str, ...]]] = {}
            keys: list[str] = []
            pairs: list[tuple[str, str]] = []  # (key, medium): one per visible location
            versions: set[str] = set()
            for k, locs in (st.blocks.get(r.instance_id) or KeyMap()).items():
                for loc, specs in locs.items():
                    if loc[2] != r.host_ip_port:
                        continue
                    hit = seen.get((loc, id(specs)))
                    if hit is None:
                        vis = loc[0] == r.storage_type and st.visible(
                            loc[0], loc[2], r.instance_id, specs
                        )
                        found = tuple(v for v in (uri_version(u) for _, u in specs) if v)
                        hit = seen[(loc, id(specs))] = (vis, found)
                    if hit[0]:
                        keys.append(str(k))
                        pairs.append((str(k), loc[1]))
                    versions.update(hit[1])
            out.append(
                {
                    "instance_id": r.instance_id,
                    "storage_type": r.storage_type,
                    "host_ip_port": r.host_ip_port,
                    "liveness": st.liveness(r),
                    "generation": r.version or "",
                    "strict": r.strict,
                    "mediums": sorted(r.mediums),
                    "system_status": r.system_status,
                    "visible_keys": sorted(keys),
                    "visible": sorted(pairs),
                    "heartbeat_times": list(r.heartbeat_times),
                    "stored_versions": sorted(versions),
                    "snapshot_requests": r.snapshot_requests,
                    "snapshot_commits": r.snapshot_commits,
                    "host_down_requests": r.host_down_requests,
                }
            )
        return web.Response(
            body=P.encode({"reporters": out, "requests": self.requests}),
            content_type="application/json",
        )

    async def debug_cluster(self, request: web.Request) -> web.Response:
        c = self.cluster
        leader = c.leader.node_id if c is not None and c.leader is not None else self.node_id
        out = {
            "node_id": self.node_id,
            "is_leader": self.leader_now(),
            "leader_node_id": leader,
            "lease_left_s": c.lease_left_s() if c is not None else None,
            "elections": c.elections if c is not None else 0,
            "elected_at": c.elected_at if c is not None else 0.0,  # time.monotonic()
        }
        return web.Response(body=P.encode(out), content_type="application/json")

    async def debug_arrivals(self, request: web.Request) -> web.Response:
        """Arrival times (server monotonic clock, up to 16) of each key, per reporter host."""
        times = self.state.arrival_times(request.query.get("host", ""))
        return web.Response(body=P.encode(times), content_type="application/json")

    async def debug_faults(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())  # route names stay as written
        if "fail_items" in body:
            self.report.fail_items = int(body["fail_items"])
        if "commit_delay_ms" in body:
            self.report.commit_delay_s = float(body["commit_delay_ms"]) / 1000
        for route, rule in (body.get("routes") or {}).items():
            self.faults.rules[route] = dict(rule)
        if body.get("clear"):
            self.faults.rules.clear()
            self.report.commit_delay_s = 0.0
            self.report.fail_items = 0
        return web.Response(body=b"{}", content_type="application/json")
