"""Cluster mode of the stand-in KVCM: metadata in Redis, one leader by lease, fencing.

Imports: stdlib, msgspec, redis.asyncio (redis-py, the `cluster` extra; only the CLI imports
this module, and only with --meta-storage redis://). Redis holds what KVCM persists: storages,
instance groups, instances (written through before the answer), block metadata (written behind,
within half a second, like --state-file) and each node's endpoint. Reporter tables, generations
and tombstones stay in the leader's memory: a new leader starts without them, as a restarted
KVCM does. Invariant (fencing): a node answers as the leader only while its local
lease deadline, counted from when the acquiring or renewing command was *sent*, lies ahead, and
its metadata writes are compare-and-set on the lease, so two leaders never both accept a write.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sidecar.kvcm_server.state import ApiError

log = logging.getLogger(__name__)
Clock = Callable[[], float]
# The local deadline stops short of the Redis expiry by this share of the lease (clock rates of
# two processes differ by far less; a node across a network would also subtract its RTT bound).
DRIFT = 0.02
_URL = re.compile(r"redis://(?P<host>[^:/\s]+)(:(?P<port>\d{1,5}))?(/(?P<db>\d{1,2}))?/?")

# KEYS[1] lease; ARGV[1] token, ARGV[2] lease ms. Renew only a lease this node still holds.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS[1] lease, KEYS[2] metadata hash; ARGV[1] token, then field, value pairs.
FENCED_HSET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""
# KEYS[1] lease, KEYS[2] key; ARGV[1] token, ARGV[2] value.
FENCED_SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def parse_url(url: str) -> tuple[str, int, int]:
    """redis://HOST[:PORT][/DB] -> (host, port, db); ValueError names what is wrong."""
    m = _URL.fullmatch(url)
    if m is None:
        raise ValueError(f"--meta-storage {url!r} must be redis://HOST[:PORT][/DB]")
    port = int(m.group("port") or 6379)
    if not 0 < port <= 65535:
        raise ValueError(f"--meta-storage {url!r}: port out of range")
    return m.group("host"), port, int(m.group("db") or 0)


class Endpoint(msgspec.Struct, frozen=True):
    node_id: str
    host: str
    meta_rpc_port: int
    meta_http_port: int


Meta = dict[str, dict[str, dict[str, Any]]]  # kind -> name -> record
KINDS = ("storages", "groups", "instances")


class Cluster:
    """One node's view: the lease it holds (or who holds it) and the persisted metadata."""

    def __init__(
        self,
        url: str,
        node: Endpoint,
        *,
        lease_s: float = 10.0,
        prefix: str = "kvcm",
        clock: Clock = time.monotonic,
    ) -> None:
        host, port, db = parse_url(url)
        self.redis = aioredis.Redis(
            host=host,
            port=port,
            db=db,
            socket_timeout=lease_s / 3,
            socket_connect_timeout=lease_s / 3,
        )
        self.node = node
        self.token = f"{node.node_id}#{secrets.token_hex(8)}"  # this incarnation's lease value
        self.lease_s = lease_s
        self.clock = clock
        self.lease_key = f"{prefix}:leader"
        self.nodes_key = f"{prefix}:nodes"
        self.meta_key = f"{prefix}:meta"
        self.blocks_key = f"{prefix}:blocks"
        self._renew = self.redis.register_script(RENEW)
        self._fenced = self.redis.register_script(FENCED_HSET)
        self._release = self.redis.register_script(RELEASE)
        self._fenced_set = self.redis.register_script(FENCED_SET)
        self.deadline = 0.0  # local: answer as leader only before this
        self.leading = False  # what this node last acted on (elected / deposed callbacks ran)
        self.leader: Endpoint | None = None  # who holds the lease, as last read
        self.expires_in_s: float | None = None  # the holder's lease, as last read (followers)
        self.persisted: dict[str, bytes] = {}
        self.elections = 0
        self.elected_at = 0.0  # clock() when this node last took the lease
        self.redis_errors = 0
        self.on_elected: Callable[[Meta, bytes | None], Awaitable[None]] | None = None
        self.on_deposed: Callable[[], None] | None = None

    def is_leader(self) -> bool:
        return self.leading and self.clock() < self.deadline

    def lease_left_s(self) -> float:
        return max(self.deadline - self.clock(), 0.0) if self.leading else 0.0

    # ---- the lease -------------------------------------------------------------------------
    async def step(self) -> None:
        """One lease iteration: renew (leader) or try to acquire (follower), then read who
        leads. Called every lease/3; a Redis error leaves the deadline to run out."""
        if self.leading and not self.is_leader():
            self._depose("lease deadline passed without a renewal")
        lease_ms = int(self.lease_s * 1000)
        sent = self.clock()
        try:
            if self.leading:
                if await self._renew(keys=[self.lease_key], args=[self.token, lease_ms]):
                    self.deadline = sent + self.lease_s * (1 - DRIFT)
                else:
                    self._depose("the lease is held by another node")
            elif await self.redis.set(
                self.lease_key, self.token, nx=True, px=lease_ms
            ) or await self._renew(keys=[self.lease_key], args=[self.token, lease_ms]):
                # Taken now, or still ours from an election whose metadata load failed.
                await self.redis.hset(
                    self.nodes_key, self.node.node_id, msgspec.json.encode(self.node)
                )
                meta = await self.load_meta()
                blocks = await self.redis.get(self.blocks_key)
                if self.clock() < sent + self.lease_s * (1 - DRIFT):
                    self.deadline = sent + self.lease_s * (1 - DRIFT)
                    self.leading = True
                    self.elections += 1
                    self.elected_at = self.clock()
                    log.info("kvcm cluster elected node_id=%s", self.node.node_id)
                    if self.on_elected is not None:
                        await self.on_elected(meta, blocks if isinstance(blocks, bytes) else None)
            await self._read_leader()
        except RedisError as exc:
            self.redis_errors += 1
            log.warning("kvcm cluster redis error=%r leading=%s", exc, self.leading)
        except ApiError as exc:  # the elected leader's bootstrap write failed: retried later
            log.warning("kvcm cluster metadata write failed error=%s", exc)

    def _depose(self, why: str) -> None:
        self.leading = False
        self.deadline = 0.0
        self.persisted.clear()
        log.warning("kvcm cluster stepped down node_id=%s why=%s", self.node.node_id, why)
        if self.on_deposed is not None:
            self.on_deposed()

    async def _read_leader(self) -> None:
        holder = await self.redis.get(self.lease_key)
        if holder is None:
            self.leader = None
            self.expires_in_s = None
            return
        if not self.leading:
            pttl = await self.redis.pttl(self.lease_key)
            self.expires_in_s = pttl / 1000 if pttl >= 0 else None
        text = holder.decode() if isinstance(holder, bytes) else holder
        node_id = text.rpartition("#")[0]
        if node_id == self.node.node_id and self.leading:
            self.leader = self.node
            return
        raw = await self.redis.hget(self.nodes_key, node_id)
        self.leader = msgspec.json.decode(raw, type=Endpoint) if raw else None

    async def run(self) -> None:
        """Announce this node, then a lease iteration every third of the lease."""
        while True:
            try:
                await self.redis.hset(
                    self.nodes_key, self.node.node_id, msgspec.json.encode(self.node)
                )
                break
            except RedisError as exc:
                log.warning("kvcm cluster cannot announce node error=%r", exc)
                await asyncio.sleep(self.lease_s / 3)  # a retry period, not a synchronization
        while True:
            t0 = self.clock()
            await self.step()
            period = self.lease_s / 3
            if not self.leading and self.expires_in_s is not None:
                # Try again right when the holder's lease runs out, not up to a period later.
                period = min(period, self.expires_in_s + 0.002)
            await asyncio.sleep(max(period - (self.clock() - t0), 0.0))

    async def release(self) -> None:
        """At shutdown: give the lease up so that another node need not wait it out."""
        if self.leading:
            self.leading = False
            try:
                await self._release(keys=[self.lease_key], args=[self.token])
            except RedisError as exc:
                log.warning("kvcm cluster release failed error=%r", exc)
        await self.redis.aclose()

    # ---- metadata ----------------------------------------------------------------------------
    async def load_meta(self) -> Meta:
        raw = await self.redis.hgetall(self.meta_key)
        meta: Meta = {k: {} for k in KINDS}
        self.persisted = {}
        for f, v in raw.items():
            field = f.decode() if isinstance(f, bytes) else f
            value = v if isinstance(v, bytes) else v.encode()
            kind, _, name = field.partition("/")
            if kind in meta:
                meta[kind][name] = msgspec.json.decode(value)
                self.persisted[field] = value
        return meta

    async def save_blocks(self, blob: bytes) -> bool:
        """Store the block metadata, compare-and-set on the lease. False: not leader."""
        if not self.is_leader():
            return False
        try:
            ok = await self._fenced_set(
                keys=[self.lease_key, self.blocks_key], args=[self.token, blob]
            )
        except RedisError as exc:
            self.redis_errors += 1
            log.warning("kvcm cluster block save failed error=%r", exc)
            return False
        if not ok:
            self._depose("a block save found the lease held by another node")
        return bool(ok)

    async def persist(self, meta: Meta) -> bool:
        """Write the records that changed, compare-and-set on the lease. False: not leader."""
        if not self.is_leader():
            return False
        args: list[str | bytes] = [self.token]
        changed: dict[str, bytes] = {}
        for kind in KINDS:
            for name, record in meta[kind].items():
                field, value = f"{kind}/{name}", msgspec.json.encode(record)
                if self.persisted.get(field) != value:
                    changed[field] = value
                    args += [field, value]
        if not changed:
            return True
        try:
            written = await self._fenced(keys=[self.lease_key, self.meta_key], args=args)
        except RedisError as exc:
            self.redis_errors += 1
            raise ApiError("IO_ERROR", f"meta storage write failed: {exc!r}") from None
        if not written:
            self._depose("a metadata write found the lease held by another node")
            return False
        self.persisted.update(changed)
        return True
