"""ReportEvent: the six event types, generations, snapshots, the delta gate and the rate limit.

Imports: stdlib, asyncio, state, proto. One instance per server; the only awaits are the delta
gate (deltas wait for an in-flight snapshot up to `snapshot_delta_drain_timeout_ms`) and the
injectable snapshot commit delay used by tests to hold a snapshot open.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from sidecar.kvcm_server import proto as P
from sidecar.kvcm_server.state import (
    ApiError,
    KeyMap,
    KeySet,
    Loc,
    Reporter,
    Specs,
    State,
    intern_loc,
    stamp,
    untracked,
    valid_uri,
)

REGISTER, HOST_DOWN, HEARTBEAT = "EVENT_NODE_REGISTER", "EVENT_HOST_DOWN", "EVENT_HEARTBEAT"
ADD, DELETE, SNAPSHOT = P.ADD, P.DELETE, P.SNAPSHOT


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

    # ---- the request envelope (shared by the dict and the typed path) --------------------------
    def _reply(self, iid: Any) -> dict[str, Any]:
        st = self.state
        out: dict[str, Any] = {
            "extra_info": "",
            "committed_snapshot_version": "",
            "retry_after_ms": "0",
            "snapshot_required": False,
        }
        inst = st.instances.get(iid) if isinstance(iid, str) else None
        if inst is not None:
            out["extra_info"] = st.groups.get(inst["instance_group"], {}).get("extra_info", "")
        return out

    @staticmethod
    def _check_envelope(iid: Any, host: Any, events: Any) -> None:
        if not isinstance(iid, str) or not isinstance(host, str):
            raise ApiError("INVALID_ARGUMENT", "instance_id and host_ip_port must be strings")
        if not iid or not host or "#" in host:
            raise ApiError(
                "INVALID_ARGUMENT",
                "instance_id and host_ip_port are required; host_ip_port must not contain '#'",
            )
        if not isinstance(events, list):
            raise ApiError("INVALID_ARGUMENT", "events must be a list")

    async def _open(
        self, iid: str, host: str, storage_type: Any, types: list[str | None]
    ) -> tuple[Reporter, bool, bool]:
        """The reporter the events apply to: (reporter, created, had a generation before)."""
        st = self.state
        stype = P.enum_name(storage_type, P.STORAGE_TYPES)
        if stype is None:
            raise ApiError(
                "INVALID_ARGUMENT", f"storage_type {storage_type!r} is missing or unknown"
            )
        storage = st.storage_for(iid, stype)
        n_snap = types.count(SNAPSHOT)
        if n_snap > 1 or (n_snap and (ADD in types or DELETE in types)):
            raise ApiError(
                "INVALID_ARGUMENT",
                "a snapshot must not be mixed with another snapshot, ADD or DELETE",
            )
        host_down = HOST_DOWN in types
        if host_down and len(types) > 1:
            raise ApiError("INVALID_ARGUMENT", "HOST_DOWN must be the only event")
        key = (iid, stype, host)
        r = st.reporters.get(key)
        if r is not None:  # counted whatever the answer (a new reporter's: below)
            r.snapshot_requests += n_snap
            r.host_down_requests += host_down
        now = st.clock()
        if r is not None and st.liveness(r, now) == "tombstoned":
            if types == [HOST_DOWN]:
                pass  # idempotent: it stays tombstoned, and the answer is OK
            elif types[0] != REGISTER:
                raise ApiError(
                    "NODE_NOT_REGISTERED", "reporter is tombstoned: send NODE_REGISTER first"
                )
            else:
                r = None
        had_generation = r is not None and r.version is not None
        created = r is None
        if r is None:
            r = Reporter(iid, stype, host, storage["global_unique_name"], now, now)
            st.reporters[key] = r
            r.snapshot_requests += n_snap
            r.host_down_requests += host_down
        if (ADD in types or DELETE in types) and r.snapshot_busy:
            await self._wait_gate(r, storage)
        return r, created, had_generation

    def _close(
        self,
        r: Reporter,
        created: bool,
        had_generation: bool,
        snapshot: bool,
        results: list[str],
        messages: list[str],
        out: dict[str, Any],
    ) -> dict[str, Any]:
        st = self.state
        failed = [c for c in results if c != "OK"]
        useful = len(failed) < len(results)
        if created and not useful:
            del st.reporters[r.key]  # an invalid-only first request creates nothing
        # HOST_DOWN's answer already reflects the ended generation (contract §12).
        out["snapshot_required"] = r.tombstoned or (
            not had_generation and not (snapshot and useful)
        )
        # The generation's version is in every answer once it exists, committed or not.
        if r.version:
            out["committed_snapshot_version"] = r.version
        if failed:
            out["item_results"] = results
            out["_code"] = failed[0]
            out["_message"] = "ReportEvent partially failed; see item_results: " + "; ".join(
                messages[:3]
            )
        st.save_blocks_later()
        return out

    # ---- the dict path: any spelling, any event type ----------------------------------------
    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        iid = req.get("instance_id") or ""
        host = req.get("host_ip_port") or ""
        events = req.get("events") or []
        out = self._reply(iid)
        self._check_envelope(iid, host, events)
        if not events:
            return out
        types = [
            P.enum_name(e.get("event_type") if isinstance(e, dict) else None, P.EVENT_TYPES)
            for e in events
        ]
        r, created, had_generation = await self._open(iid, host, req.get("storage_type"), types)
        results: list[str] = []
        messages: list[str] = []
        puts = _Puts(self.state, r)
        for ev, etype in zip(events, types, strict=True):
            try:
                if etype == SNAPSHOT:
                    await self._commit(r, self._snapshot_blocks(r, ev.get("block_snapshot")))
                elif etype in (ADD, DELETE) and self.fail_items > 0:
                    self.fail_items -= 1
                    raise ItemError("INTERNAL_ERROR", "injected item failure")
                else:
                    self._apply(r, etype, ev, puts)
                results.append("OK")
            except ItemError as exc:
                results.append(exc.code)
                messages.append(str(exc))
        puts.log_arrivals()
        return self._close(r, created, had_generation, SNAPSHOT in types, results, messages, out)

    def _apply(self, r: Reporter, etype: str | None, ev: dict[str, Any], puts: _Puts) -> None:
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
            loc = puts.loc(medium)
            puts.add_keys((key,), loc, puts.stamped(_specs(payload)))
            r.mediums.add(medium)
        elif etype == DELETE:
            key, medium = _key_medium(payload)
            names = payload.get("spec_names") or []
            if (
                not isinstance(names, list)
                or not names
                or any(not isinstance(n, str) or not n for n in names)
            ):
                raise ItemError("INVALID_ARGUMENT", "spec_names must be a non-empty list of names")
            puts.delete_keys((key,), puts.loc(medium), tuple(names))
        elif etype == HOST_DOWN:
            st.tombstone(r)

    # ---- the typed path: snake_case ADD/DELETE batches and snapshots --------------------------
    async def handle_typed(self, req: P.TReport, types: list[str]) -> dict[str, Any]:
        out = self._reply(req.instance_id)
        self._check_envelope(req.instance_id, req.host_ip_port, req.events)
        if not req.events:
            return out
        typed: list[str | None] = list(types)
        r, created, had_generation = await self._open(
            req.instance_id, req.host_ip_port, req.storage_type, typed
        )
        results: list[str] = []
        messages: list[str] = []
        if types[0] == SNAPSHOT:  # then it is the only event (_open)
            snap = req.events[0].block_snapshot
            assert snap is not None  # decode_report checked
            try:
                await self._commit(r, self._typed_snapshot_blocks(r, snap))
                results.append("OK")
            except ItemError as exc:
                results.append(exc.code)
                messages.append(str(exc))
            return self._close(r, created, had_generation, True, results, messages, out)
        puts = _Puts(self.state, r)
        events = req.events
        n_add = types.count(ADD)
        # The publisher's usual body: ADDs sharing one medium and spec list, then DELETEs sharing
        # one medium and spec-name list. Each run is applied in one go when every item in it is
        # valid (add_run / delete_run check); otherwise item by item, which names each invalid
        # item. Injected item failures always go item by item.
        if self.fail_items <= 0 and (n_add == len(types) or types.index(DELETE) == n_add):
            # (decode_report checked that every event has its payload)
            adds = cast("list[P.TAdd]", [ev.block_add for ev in events[:n_add]])
            dels = cast("list[P.TDelete]", [ev.block_delete for ev in events[n_add:]])
            if adds and not puts.add_run(adds):
                self._items(puts, r, events[:n_add], types[:n_add], results, messages)
            elif adds:
                results.extend(["OK"] * len(adds))
            if dels and not puts.delete_run(dels):
                self._items(puts, r, events[n_add:], types[n_add:], results, messages)
            elif dels:
                results.extend(["OK"] * len(dels))
        else:
            self._items(puts, r, events, types, results, messages)
        puts.log_arrivals()
        return self._close(r, created, had_generation, False, results, messages, out)

    def _items(
        self,
        puts: _Puts,
        r: Reporter,
        events: list[P.TEvent],
        types: list[str],
        results: list[str],
        messages: list[str],
    ) -> None:
        """Typed ADD/DELETE events one by one, each with its own result."""
        ok = "OK"
        # The publisher repeats one medium and one spec list: resolve them when they change.
        medium: str | None = None
        specs: msgspec.Raw | None = None
        loc: Loc = ("", "", "")
        stamped: Specs = ()
        inject = self.fail_items > 0  # (only this loop decrements it)
        for ev, etype in zip(events, types, strict=True):
            try:
                if inject and self.fail_items > 0:
                    self.fail_items -= 1
                    raise ItemError("INTERNAL_ERROR", "injected item failure")
                if etype == ADD:
                    a = ev.block_add
                    assert a is not None  # decode_report checked
                    key = _typed_key(a.block_key)
                    if a.medium != medium:
                        loc = puts.loc(a.medium)
                        medium = a.medium
                        r.mediums.add(medium)
                    if a.specs != specs:
                        stamped = puts.stamped(_typed_specs(a.specs))
                        specs = a.specs
                    puts.add_keys((key,), loc, stamped)
                else:
                    d = ev.block_delete
                    assert d is not None
                    key, dloc = _typed_key(d.block_key), puts.loc(d.medium)
                    if not d.spec_names or not all(d.spec_names):
                        raise ItemError(
                            "INVALID_ARGUMENT", "spec_names must be a non-empty list of names"
                        )
                    puts.delete_keys((key,), dloc, d.spec_names)
                results.append(ok)
            except ItemError as exc:
                results.append(exc.code)
                messages.append(str(exc))

    async def _wait_gate(self, r: Reporter, storage: dict[str, Any]) -> None:
        gate = self.gates.setdefault(r.key, asyncio.Event())
        timeout = storage["event_report"]["snapshot_delta_drain_timeout_ms"] / 1000
        try:
            async with asyncio.timeout(timeout):
                await gate.wait()
        except TimeoutError:
            raise ApiError(
                "SNAPSHOT_IN_PROGRESS", "a snapshot is committing; retry the deltas", **_now(r)
            ) from None

    def _may_snapshot(self, r: Reporter) -> None:
        """The rate limit and the one-at-a-time rule; called once the payload is valid."""
        if r.snapshot_busy:
            raise ApiError("SNAPSHOT_IN_PROGRESS", "another snapshot is committing", **_now(r))
        left = self.state.snapshot_interval_left_ms(r)
        if left > 0:
            raise ApiError(
                "SNAPSHOT_RATE_LIMITED",
                f"snapshot allowed again in {left} ms",
                retry_after_ms=str(left),
                **_now(r),
            )

    def _snapshot_blocks(self, r: Reporter, payload: Any) -> dict[tuple[int, str], dict[str, str]]:
        if not isinstance(payload, dict):
            raise ItemError("INVALID_ARGUMENT", "EVENT_BLOCK_SNAPSHOT needs block_snapshot")
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
        self._may_snapshot(r)  # after validation: an invalid snapshot is INVALID_ARGUMENT
        return blocks

    def _typed_snapshot_blocks(
        self, r: Reporter, snap: P.TSnapshot
    ) -> dict[tuple[int, str], dict[str, str]]:
        blocks: dict[tuple[int, str], dict[str, str]] = {}
        outer = snap.medium
        checked: str | None = None
        specs: msgspec.Raw | None = None
        spec_dict: dict[str, str] = {}
        for b in snap.blocks:
            key = _typed_key(b.block_key)
            medium = b.medium if b.medium is not None else outer or ""
            if medium != checked:
                if not medium or "#" in medium:
                    raise ItemError("INVALID_ARGUMENT", f"medium {medium!r} is invalid")
                checked = medium
            if (key, medium) in blocks:
                raise ItemError("INVALID_ARGUMENT", f"block {key} medium {medium} appears twice")
            if b.specs != specs:
                spec_dict = _typed_specs(b.specs)
                specs = b.specs
            blocks[(key, medium)] = spec_dict
        self._may_snapshot(r)  # after validation, as _snapshot_blocks
        return blocks

    async def _commit(self, r: Reporter, blocks: dict[tuple[int, str], dict[str, str]]) -> None:
        st = self.state
        r.snapshot_busy = True
        gate = self.gates.setdefault(r.key, asyncio.Event())
        gate.clear()
        self.snapshot_started.set()
        try:
            if self.commit_delay_s:
                await asyncio.sleep(self.commit_delay_s)  # fault injection: a slow commit
            version = P.new_version()
            inst_blocks = st.blocks.setdefault(r.instance_id, KeyMap())
            st.owned.setdefault(r.key, KeySet()).update(key for key, _ in blocks)
            stamped = _Stamper(version)
            locs: dict[str, Loc] = {}
            now = st.clock()
            for (key, medium), specs in blocks.items():
                loc = locs.get(medium)
                if loc is None:
                    loc = locs[medium] = intern_loc(r.storage_type, medium, r.host_ip_port)
                    r.mediums.add(medium)
                at = inst_blocks.get(key)
                inst_blocks[key] = (
                    {loc: stamped(specs)} if at is None else {**at, loc: stamped(specs)}
                )
            st.note_arrivals(r, (key for key, _ in blocks), now)
            st.gc_reporter(r, keep_version=version)  # omitted blocks vanish at once
            r.version = version
            r.stamper = stamped
            r.strict = True
            r.last_commit = st.clock()
            r.snapshot_commits += 1
        finally:
            r.snapshot_busy = False
            gate.set()


def _now(r: Reporter) -> dict[str, Any]:
    """The generation fields of an answer that an ApiError cuts short (contract §12)."""
    return {"committed_snapshot_version": r.version or "", "snapshot_required": r.version is None}


class _Stamper:
    """Stamped specs, one Specs object per distinct spec dict, shared by every block using it.

    Block entries are never mutated in place (every writer replaces them), so sharing is safe;
    it saves the specs and their URI strings per block. The cache holds the spec dict itself,
    so its id cannot be reused while cached.
    """

    __slots__ = ("cache", "version")

    def __init__(self, version: str) -> None:
        self.version = version
        self.cache: dict[int, tuple[dict[str, str], Specs]] = {}

    def __call__(self, specs: dict[str, str]) -> Specs:
        hit = self.cache.get(id(specs))
        if hit is None or hit[0] is not specs:
            stamped = untracked(tuple((n, stamp(u, self.version)) for n, u in specs.items()))
            hit = self.cache[id(specs)] = (specs, stamped)
        return hit[1]


class _Puts:
    """ADD and DELETE of one request against one reporter (last op wins per key/medium/spec)."""

    __slots__ = (
        "arrived",
        "block_shards",
        "blocks",
        "locs",
        "now",
        "owned",
        "r",
        "remaining",
        "st",
        "stamper",
    )

    def __init__(self, st: State, r: Reporter) -> None:
        self.st = st
        self.r = r
        self.blocks = st.blocks.setdefault(r.instance_id, KeyMap())
        self.block_shards = self.blocks.shards  # add_keys picks shards itself: the hot loop
        self.now = st.clock()  # one arrival time per request: its events arrived together
        self.arrived: list[Sequence[int]] = []
        # names -> id(specs) -> (specs, what a delete of names leaves); holds specs: ids stay
        self.remaining: dict[tuple[str, ...], dict[int, tuple[Specs, Specs]]] = {}
        self.owned = st.owned.setdefault(r.key, KeySet()).shards
        self.locs: dict[str, Loc] = {}
        self.stamper: _Stamper | None = None

    def loc(self, medium: str) -> Loc:
        """The location key of `medium` for this reporter (checked once per request)."""
        loc = self.locs.get(medium)
        if loc is None:
            if not medium or "#" in medium:
                raise ItemError("INVALID_ARGUMENT", f"medium {medium!r} is invalid")
            r = self.r
            loc = self.locs[medium] = intern_loc(r.storage_type, medium, r.host_ip_port)
        return loc

    def _version(self) -> _Stamper:
        r = self.r
        if r.version is None:
            r.version = P.new_version()  # the first delta opens a (soft) generation
        stamper: _Stamper | None = r.stamper
        if stamper is None or stamper.version != r.version:
            stamper = r.stamper = _Stamper(r.version)
        self.stamper = stamper
        return stamper

    def stamped(self, specs: dict[str, str]) -> Specs:
        return (self.stamper or self._version())(specs)

    def add_run(self, adds: list[P.TAdd]) -> bool:
        """Apply a run of ADDs that share one medium and one spec list and whose keys are all
        plain decimals; otherwise apply nothing and return False (the caller then goes item by
        item, which names each invalid item). Same effect as adding them one by one."""
        first = adds[0]
        medium, raw = first.medium, first.specs
        if not all(a.medium == medium for a in adds) or not all(a.specs == raw for a in adds):
            return False
        keys = _plain_keys([a.block_key for a in adds])
        if keys is None:
            return False
        try:
            loc, specs = self.loc(medium), _typed_specs(raw)
        except ItemError:
            return False
        self.r.mediums.add(medium)
        self.add_keys(keys, loc, self.stamped(specs))
        return True

    def delete_run(self, dels: list[P.TDelete]) -> bool:
        """Apply a run of DELETEs that share one medium and one list of spec names and whose
        keys are all plain decimals; otherwise apply nothing and return False, as add_run."""
        first = dels[0]
        medium, names = first.medium, first.spec_names
        if not all(d.medium == medium for d in dels) or not all(
            d.spec_names == names for d in dels
        ):
            return False
        keys = _plain_keys([d.block_key for d in dels])
        if keys is None or not names or not all(names):
            return False
        try:
            loc = self.loc(medium)
        except ItemError:
            return False
        self.delete_keys(keys, loc, names)
        return True

    def add_keys(self, keys: Sequence[int], loc: Loc, stamped: Specs) -> None:
        """Store `stamped` (from `stamped()`) at `loc` (from `loc()`) of every block in `keys`."""
        block_shards, owned = self.block_shards, self.owned
        for key in keys:  # the hot loop: shards are picked here, not through KeyMap
            shard = _ROUTE[key & _ROUTE_MASK]
            blocks = block_shards[shard]
            at = blocks.get(key)
            if at is None:
                blocks[key] = {loc: stamped}
            else:
                old = at.get(loc)
                if old is not stamped:
                    merged = (
                        stamped if old is None else tuple({**dict(old), **dict(stamped)}.items())
                    )
                    blocks[key] = {**at, loc: merged}  # entries are replaced, never mutated
            owned[shard].add(key)
        self.arrived.append(keys)

    def log_arrivals(self) -> None:
        """Once per request, after its ADDs: their keys arrived at `now`."""
        if self.arrived:
            self.st.note_arrivals(self.r, itertools.chain.from_iterable(self.arrived), self.now)

    def delete_keys(self, keys: Sequence[int], loc: Loc, names: tuple[str, ...]) -> None:
        """Remove the specs named `names` at `loc` (from `loc()`) of every block in `keys`;
        a block with nothing left goes. Idempotent: nothing stored there, nothing to do."""
        self._version()
        block_shards = self.block_shards
        remaining = self.remaining.setdefault(names, {})
        for key in keys:
            blocks = block_shards[_ROUTE[key & _ROUTE_MASK]]
            at = blocks.get(key)
            old = at.get(loc) if at is not None else None
            if at is None or old is None:
                continue
            hit = remaining.get(id(old))
            if hit is None:  # once per stored spec list and names: blocks share their Specs
                left = tuple((n, u) for n, u in old if n not in names)
                hit = remaining[id(old)] = (old, untracked(left) if left else left)
            if hit[1]:
                blocks[key] = {**at, loc: hit[1]}
            elif len(at) > 1:
                blocks[key] = {other: v for other, v in at.items() if other != loc}
            else:
                del blocks[key]


def _typed_specs(raw: msgspec.Raw) -> dict[str, str]:
    """The checked spec dict of a raw spec list (both steps cache: publishers repeat one list,
    and the same dict object keeps the stamped Specs shared)."""
    return _specs({"specs": [{"name": s.name, "uri": s.uri} for s in P.typed_specs(raw)]})


_I63, _U64 = 1 << 63, 1 << 64
_ROUTE, _ROUTE_MASK = KeyMap.ROUTE, KeyMap.MASK


def _plain_keys(texts: list[str]) -> list[int] | None:
    """int64 patterns of `texts` if every one is 1-20 ASCII digits below 2**64, else None."""
    digits = "".join(texts).encode()  # non-ASCII digits are not plain decimals
    if min(map(len, texts)) < 1 or max(map(len, texts)) > 20 or not digits.isdigit():
        return None
    keys = list(map(int, texts))
    top = max(keys)
    if top >= _U64:
        return None
    if top >= _I63:  # unsigned text of a negative int64 (contract §4.2)
        keys = [k - _U64 if k >= _I63 else k for k in keys]
    return keys


def _typed_key(text: str) -> int:
    """block_key text -> int64 pattern; first the usual case: unsigned, at most 20 digits."""
    if len(text) <= 20 and text.isdigit() and text.isascii():
        v = int(text)
        if v < _I63:
            return v
        if v < _U64:
            return v - _U64
    key = P.parse_block_key(text)
    if key is None:
        raise ItemError("INVALID_ARGUMENT", f"block_key {text!r} is invalid")
    return key
