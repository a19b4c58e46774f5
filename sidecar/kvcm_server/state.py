"""The stand-in KVCM's state and rules: storages, groups, instances, reporters, block metadata.

Imports: stdlib, msgspec, proto. Pure and synchronous (the HTTP layer adds only the snapshot
delta gate's waiting and the stepwise saver), driven by an injected clock so liveness tests need
no long sleeps. Rules follow `shared/kvcm_contract.md` §3-§6 and §12 (which wins where they
differ).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import tempfile
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import msgspec

from sidecar.kvcm_server import proto as P

Clock = Callable[[], float]
Loc = tuple[str, str, str]  # (storage_type, medium, host_ip_port)
# A location's stamped specs: ((spec name, uri with s_version), ...). Tuples, not dicts: a block
# entry holding only untracked tuples and strings is never tracked by the garbage collector, so
# millions of blocks cost nothing in collections (dict values would make every entry tracked,
# and collecting them paused requests for ~50 ms).
Specs = tuple[tuple[str, str], ...]
SAVE_STEP = 1024  # blocks encoded per step of State.save_steps (~10 ms here)
ARRIVALS_MAX = 4_000_000  # key arrivals logged per reporter for /debug/arrivals (8 bytes each)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+._-]*://")  # KVCM accepts event_report://

DEFAULT_EVENT_REPORT = {
    "heartbeat_timeout_ms": 30000,
    "cleanup_grace_ms": 300000,
    "liveness_check_interval_ms": 5000,
    "snapshot_min_interval_ms": 30000,
    "snapshot_delta_drain_timeout_ms": 10000,
}


class ApiError(Exception):
    """A request-level outcome: header code, message, and extra response fields."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra


V = TypeVar("V")


def _staggered_route(shards: int, buckets: int) -> list[int]:
    """bucket -> shard, shard s taking a share proportional to 2 ** (s / shards)."""
    weights = [2 ** (s / shards) for s in range(shards)]
    total = sum(weights)
    route: list[int] = []
    acc = 0.0
    for s, w in enumerate(weights):
        acc += w
        route += [s] * (round(acc / total * buckets) - len(route))
    return route


class KeyMap(Generic[V]):
    """A dict keyed by block key, split in SHARDS dicts whose sizes differ on purpose.

    A dict grows by copying all of itself: at 350 k keys one such copy held requests ~20 ms (the
    block map and the arrival times grew at the same moment). Equal shards would all reach their
    growth point in the same request, which costs the same; here shard s holds a share
    proportional to 2 ** (s / SHARDS), so over any doubling of the key count each shard grows
    once, at its own moment. Hot loops route a key themselves: `shards[ROUTE[key & MASK]]`.
    """

    SHARDS = 64
    MASK = 4095
    ROUTE = _staggered_route(SHARDS, MASK + 1)
    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[int, V]] = [{} for _ in range(self.SHARDS)]

    def shard(self, key: int) -> dict[int, V]:
        return self.shards[self.ROUTE[key & self.MASK]]

    def get(self, key: int) -> V | None:
        return self.shard(key).get(key)

    def __getitem__(self, key: int) -> V:
        return self.shard(key)[key]

    def __setitem__(self, key: int, value: V) -> None:
        self.shard(key)[key] = value

    def __delitem__(self, key: int) -> None:
        del self.shard(key)[key]

    def __contains__(self, key: int) -> bool:
        return key in self.shard(key)

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __iter__(self) -> Iterator[int]:
        for d in self.shards:
            yield from d

    def items(self) -> Iterator[tuple[int, V]]:
        for d in self.shards:
            yield from d.items()

    def values(self) -> Iterator[V]:
        for d in self.shards:
            yield from d.values()


class KeySet:
    """A set of block keys split like KeyMap, for the same reason (one set of 530 k keys took
    ~90 ms to grow). Hot loops add through `shards[KeyMap.ROUTE[key & KeyMap.MASK]]`."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[set[int]] = [set() for _ in range(KeyMap.SHARDS)]

    def add(self, key: int) -> None:
        self.shards[KeyMap.ROUTE[key & KeyMap.MASK]].add(key)

    def update(self, keys: Iterable[int]) -> None:
        shards, route, mask = self.shards, KeyMap.ROUTE, KeyMap.MASK
        for key in keys:
            shards[route[key & mask]].add(key)

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __iter__(self) -> Iterator[int]:
        for s in self.shards:
            yield from s


@dataclass
class Reporter:
    instance_id: str
    storage_type: str
    host_ip_port: str
    storage_name: str
    created: float
    last_heartbeat: float
    mediums: set[str] = field(default_factory=set)
    version: str | None = None  # generation; None until the first valid delta or snapshot
    strict: bool = False  # a snapshot committed: only its version (and later deltas) is visible
    tombstoned: bool = False
    last_commit: float | None = None  # for the snapshot rate limit
    snapshot_busy: bool = False
    # Requests seen and commits made, for /debug/reporters (tests count resnapshots with them).
    snapshot_requests: int = 0
    snapshot_commits: int = 0
    host_down_requests: int = 0
    system_status: dict[str, str] = field(default_factory=dict)
    # When keys arrived (for the demo's event->KVCM latency): one (time, keys) entry per request,
    # folded per key only when /debug/arrivals asks, so applying a request costs no work per key.
    arrivals: list[tuple[float, array[int]]] = field(default_factory=list)
    arrivals_left: int = ARRIVALS_MAX  # key arrivals the log may still take
    heartbeat_times: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    stamper: Any = None  # report._Stamper of `version`: blocks of one spec list share Specs

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.instance_id, self.storage_type, self.host_ip_port)


_LOCS: dict[Loc, Loc] = {}


Tup = TypeVar("Tup", bound=tuple[Any, ...])


def untracked(t: Tup) -> Tup:
    """`t` (a new tuple of strings, or of such tuples), made invisible to the garbage collector.

    CPython stops tracking such a tuple only when a collection examines it, and until then
    every dict it is stored in is tracked for good: block entries are millions of dicts that
    each full collection would walk. A young-generation collection examines the new tuples:
    the flat ones are untracked, a nested one is not (its items were still tracked when it was
    looked at), so it is rebuilt from its now-untracked items and examined again. For the few
    shared tuples only (locations, stamped spec lists).
    """
    gc.collect(0)
    if gc.is_tracked(t):
        t = cast(Tup, tuple(list(t)))
        gc.collect(0)
    return t


def intern_loc(storage_type: str, medium: str, host: str) -> Loc:
    """One tuple object per location, shared by every block stored there (see Specs)."""
    t = (storage_type, medium, host)
    if len(_LOCS) >= 65_536:
        return t
    known = _LOCS.get(t)
    if known is None:
        known = _LOCS[t] = untracked(t)
    return known


def valid_uri(uri: Any) -> bool:
    return isinstance(uri, str) and bool(_SCHEME.match(uri)) and "s_version" not in uri


def stamp(uri: str, version: str) -> str:
    return f"{uri}{'&' if '?' in uri else '?'}s_version={version}"


def uri_version(uri: str) -> str | None:
    found = re.findall(r"[?&]s_version=([0-9a-f]*)", uri)
    return found[0] if len(found) == 1 and len(found[0]) == 32 else None


class State:
    def __init__(self, clock: Clock, state_file: Path | None = None) -> None:
        self.clock = clock
        self.state_file = state_file
        self.storages: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, dict[str, Any]] = {}
        self.instances: dict[str, dict[str, Any]] = {}
        # blocks[instance][key][loc] = stamped specs; one Specs (and one Loc) object is shared by
        # every block stored with it (report._Stamper, report.intern_loc).
        self.blocks: dict[str, KeyMap[dict[Loc, Specs]]] = {}
        # (instance, storage_type, host) -> keys with a location of that reporter (a superset:
        # deletes may leave keys behind; gc_reporter prunes). A snapshot commit or a tombstone
        # then walks the reporter's keys, not every block of the instance.
        self.owned: dict[tuple[str, str, str], KeySet] = {}
        self.reporters: dict[tuple[str, str, str], Reporter] = {}
        self.dirty = False
        self._save_started = self._save_landed = 0  # save_steps tickets: the newest lands
        self._loaded_specs: dict[Specs, Specs] = {}
        if state_file is not None and state_file.exists():
            self._load(state_file)
            self._loaded_specs.clear()

    # ---- persistence (instances and block metadata survive; reporters do not) ----------
    def save(self) -> None:
        """Write the state file in one go (shutdown, tests)."""
        for _ in self.save_steps():
            pass

    def save_steps(self) -> Generator[None, None, None]:
        """Write the state file, yielding after every SAVE_STEP blocks so that the event loop
        serves requests meanwhile (written in one go, 4 k blocks held it ~85 ms and 100 k
        blocks ~1.8 s, every half second while blocks changed). It saves the state as it was
        when this started: block entries are replaced, never mutated, so copies of the shard
        dicts (not of the entries) are a consistent snapshot."""
        path = self.state_file
        if path is None:
            return
        head = msgspec.json.encode(
            {"storages": self.storages, "groups": self.groups, "instances": self.instances}
        )
        snap = [(inst, [dict(s) for s in keys.shards]) for inst, keys in self.blocks.items()]
        self.dirty = False
        # An admin request (registerInstance, ...) saves in one go while the periodic saver's
        # steps may be half way through their file: each save has a file of its own (sharing
        # one truncated the other's and left a torn state file that no restart could load),
        # and one that finishes after a later-started save has landed is dropped (it is older).
        self._save_started += 1
        mine = self._save_started
        fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        done = False
        try:
            with os.fdopen(fd, "wb") as f:  # written piece by piece: no whole-file buffer
                f.write(head[:-1] + b',"blocks":{')
                for i, (inst, shards) in enumerate(snap):
                    f.write(b"," * (i > 0) + msgspec.json.encode(inst) + b":[")
                    sep = b""
                    for shard in shards:
                        items = iter(shard.items())
                        while chunk := list(itertools.islice(items, SAVE_STEP)):
                            rows = [
                                [str(k), [[*loc, dict(specs)] for loc, specs in locs.items()]]
                                for k, locs in chunk
                            ]
                            f.write(sep + msgspec.json.encode(rows)[1:-1])
                            sep = b","
                            yield
                    f.write(b"]")
                f.write(b"}}")
            if mine > self._save_landed:
                tmp.replace(path)
                self._save_landed = mine
            done = True
        finally:
            tmp.unlink(missing_ok=True)  # replaced (gone), superseded, or abandoned
            if not done:
                self.dirty = True  # abandoned (shutdown): the final save() writes it

    def save_blocks_later(self) -> None:
        """Block writes are persisted by the server's periodic saver and at shutdown."""
        self.dirty = True

    def _load(self, path: Path) -> None:
        data = json.loads(path.read_text())
        self.storages = data["storages"]
        self.groups = data["groups"]
        self.instances = data["instances"]
        self.load_blocks(data["blocks"])

    def block_pieces(self) -> Generator[bytes, None, None]:
        """The block metadata as JSON (`{instance: [[key, [[type, medium, host, specs]]]]}`,
        the state file's "blocks"), in pieces of SAVE_STEP blocks: cluster mode stores it in
        Redis, serving requests between pieces. Consistent as of the first piece (entries
        are replaced, never mutated)."""
        snap = [(inst, [dict(s) for s in keys.shards]) for inst, keys in self.blocks.items()]
        yield b"{"
        for i, (inst, shards) in enumerate(snap):
            yield b"," * (i > 0) + msgspec.json.encode(inst) + b":["
            sep = b""
            for shard in shards:
                items = iter(shard.items())
                while chunk := list(itertools.islice(items, SAVE_STEP)):
                    rows = [
                        [str(k), [[*loc, dict(specs)] for loc, specs in locs.items()]]
                        for k, locs in chunk
                    ]
                    yield sep + msgspec.json.encode(rows)[1:-1]
                    sep = b","
            yield b"]"
        yield b"}"

    def load_blocks(self, blocks: dict[str, Any]) -> None:
        for inst, keys in blocks.items():
            d = self.blocks.setdefault(inst, KeyMap())
            for k, locs in keys:
                d[int(k)] = {
                    intern_loc(st, med, host): self._shared_specs(specs)
                    for st, med, host, specs in locs
                }
                for st, _, host, _ in locs:
                    self.owned.setdefault((inst, st, host), KeySet()).add(int(k))

    def _shared_specs(self, specs: dict[str, str]) -> Specs:
        """One untracked Specs object per distinct spec list read from the state file."""
        t = tuple(specs.items())
        known = self._loaded_specs.get(t)
        if known is None:
            known = self._loaded_specs[t] = untracked(t)
        return known

    # ---- admin -------------------------------------------------------------------------
    def add_storage(self, req: dict[str, Any], *, update: bool = False) -> None:
        st = req.get("storage") or {}
        name = st.get("global_unique_name")
        stype = P.enum_name(st.get("storage_type"), P.STORAGE_TYPES)
        if not name or not stype:
            raise ApiError(
                "INVALID_ARGUMENT",
                "storage needs global_unique_name and an event report storage_type",
            )
        if update and name not in self.storages:
            raise ApiError("INSTANCE_NOT_EXIST", f"storage {name} does not exist")
        if not update and name in self.storages:
            raise ApiError("DUPLICATE_ENTITY", f"storage {name} exists")
        er = dict(DEFAULT_EVENT_REPORT)
        for k, v in (st.get("event_report") or {}).items():
            if k in er:
                er[k] = int(v)
        self.storages[name] = {
            "global_unique_name": name,
            "storage_type": stype,
            "event_report": er,
        }
        self.save()

    def create_group(self, req: dict[str, Any]) -> None:
        g = req.get("instance_group") or {}
        name = g.get("name")
        if not name:
            raise ApiError("INVALID_ARGUMENT", "instance_group.name is required")
        if name in self.groups:
            raise ApiError("DUPLICATE_ENTITY", f"instance group {name} exists")
        cands = (
            g.get("event_report_storage_candidates")
            or g.get("event_reporting_storage_candidates")
            or []
        )
        self.groups[name] = {
            "name": name,
            "event_report_storage_candidates": list(cands),
            "extra_info": g.get("extra_info", ""),
        }
        self.save()

    # ---- registerInstance ----------------------------------------------------------------
    _IDENTITY = ("block_size", "location_spec_infos", "model_deployment", "location_spec_groups")

    def register_instance(self, req: dict[str, Any]) -> dict[str, Any]:
        group = req.get("instance_group")
        iid = req.get("instance_id")
        md = req.get("model_deployment") or {}
        if not group or not iid:
            raise ApiError("INVALID_ARGUMENT", "instance_group and instance_id are required")
        bs = req.get("block_size")
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            raise ApiError("INVALID_ARGUMENT", "block_size must be a positive integer")
        specs = req.get("location_spec_infos") or []
        if not specs or any(not s.get("name") for s in specs):
            raise ApiError("INVALID_ARGUMENT", "location_spec_infos must be non-empty and named")
        if not md.get("model_name") or not md.get("dtype"):
            raise ApiError("INVALID_ARGUMENT", "model_deployment needs model_name and dtype")
        if group not in self.groups:
            raise ApiError("INSTANCE_NOT_EXIST", f"instance group {group} does not exist")
        md_id = {k: v for k, v in md.items() if k != "user_data"}
        record = {
            "instance_group": group,
            "instance_id": iid,
            "block_size": bs,
            "location_spec_infos": [
                {"name": s["name"], "size": int(s.get("size", 0))} for s in specs
            ],
            "model_deployment": md_id,
            "location_spec_groups": req.get("location_spec_groups") or [],
            "default_query_type": P.enum_name(req.get("default_query_type", 0), P.QUERY_TYPES)
            or "QT_UNSPECIFIED",
        }
        old = self.instances.get(iid)
        if old is not None:
            bad = [k for k in self._IDENTITY if old[k] != record[k]]
            if old["instance_group"] != group:
                bad.insert(0, "instance_group")
            if bad:
                raise ApiError(
                    "DUPLICATE_ENTITY", "instance exists with different " + ", ".join(bad)
                )
        else:
            self.instances[iid] = record
            self.save()
        g = self.groups[group]
        return {
            "storage_configs": json.dumps(
                [
                    self.storages[s]
                    for s in g["event_report_storage_candidates"]
                    if s in self.storages
                ]
            ),
            "extra_info": g.get("extra_info", ""),
        }

    # ---- reporters -----------------------------------------------------------------------
    def storage_for(self, iid: str, storage_type: str) -> dict[str, Any]:
        inst = self.instances.get(iid)
        if inst is None:
            raise ApiError("INSTANCE_NOT_EXIST", f"instance {iid} does not exist")
        g = self.groups.get(inst["instance_group"], {})
        for name in g.get("event_report_storage_candidates", []):
            st = self.storages.get(name)
            if st and st["storage_type"] == storage_type:
                return st
        raise ApiError(
            "INSTANCE_NOT_EXIST", f"instance {iid} has no {storage_type} event-report storage"
        )

    def liveness(self, r: Reporter, now: float | None = None) -> str:
        """live | unavailable | tombstoned, applying timeouts lazily (and GC on tombstone)."""
        if r.tombstoned:
            return "tombstoned"
        now = self.clock() if now is None else now
        er = self.storages.get(r.storage_name, {}).get("event_report", DEFAULT_EVENT_REPORT)
        idle_ms = (now - r.last_heartbeat) * 1000
        if idle_ms > er["cleanup_grace_ms"]:
            self.tombstone(r)
            return "tombstoned"
        if idle_ms > er["heartbeat_timeout_ms"]:
            return "unavailable"
        return "live"

    def tombstone(self, r: Reporter) -> None:
        r.tombstoned = True
        r.version = None
        r.strict = False
        r.last_commit = None
        self.gc_reporter(r)

    def gc_reporter(self, r: Reporter, keep_version: str | None = None) -> None:
        """Drop the reporter's metadata (all of it, or every spec not stamped keep_version)."""
        keys = self.blocks.get(r.instance_id) or KeyMap()
        suffix = f"s_version={keep_version}"
        shards, route, mask = keys.shards, KeyMap.ROUTE, KeyMap.MASK
        # Blocks share their Specs objects, so filter each distinct one once (the memo holds
        # it, so its id cannot be reused meanwhile).
        memo: dict[int, tuple[Specs, Specs]] = {}
        kept = KeySet()
        for k in self.owned.pop(r.key, KeySet()):
            shard = shards[route[k & mask]]
            at = shard.get(k)
            if at is None:
                continue
            locs = at  # copied before the first change: entries are replaced, never mutated
            for loc in [loc for loc in at if loc[0] == r.storage_type and loc[2] == r.host_ip_port]:
                if keep_version is not None:
                    old = at[loc]
                    hit = memo.get(id(old))
                    if hit is None:
                        # stamp() puts s_version last, and publishers' URIs never carry one.
                        new = tuple((n, u) for n, u in old if u.endswith(suffix))
                        kept_specs = old if len(new) == len(old) else untracked(new)
                        hit = memo[id(old)] = (old, kept_specs)
                    if hit[1]:
                        kept.add(k)
                        if hit[1] is not old:
                            locs = dict(locs) if locs is at else locs
                            locs[loc] = hit[1]
                        continue
                locs = dict(locs) if locs is at else locs
                del locs[loc]
            if locs is not at:
                if locs:
                    shard[k] = locs
                else:
                    del shard[k]
        if kept:
            self.owned[r.key] = kept

    def visible(self, storage_type: str, host: str, iid: str, specs: Specs) -> bool:
        r = self.reporters.get((iid, storage_type, host))
        if r is None or self.liveness(r) != "live":
            return False
        versions = [uri_version(u) for _, u in specs]
        if any(v is None for v in versions):
            return False
        return not (r.strict and r.version not in versions)

    def note_arrivals(self, r: Reporter, keys: Iterable[int], now: float) -> None:
        """Log that `keys` arrived from `r` at `now` (while the log has room)."""
        if r.arrivals_left > 0:
            logged = array("q", itertools.islice(keys, r.arrivals_left))
            r.arrivals_left -= len(logged)
            r.arrivals.append((now, logged))

    def arrival_times(self, host: str) -> dict[int, list[float]]:
        """Per key reported by `host`: the times requests carrying it arrived (up to 16)."""
        out: dict[int, list[float]] = {}
        for r in self.reporters.values():
            if r.host_ip_port != host:
                continue
            for now, keys in r.arrivals:
                for k in keys:
                    times = out.get(k)
                    if times is None:
                        out[k] = [now]
                    elif len(times) < 16:
                        times.append(now)
        return out

    def snapshot_interval_left_ms(self, r: Reporter) -> int:
        if r.last_commit is None:
            return 0
        er = self.storages[r.storage_name]["event_report"]
        left = er["snapshot_min_interval_ms"] - (self.clock() - r.last_commit) * 1000
        return max(int(left + 0.999), 0)
