"""Leader discovery for a KVCM cluster: seeds, getClusterInfo, and which URL the client uses.

Imports: stdlib, aiohttp, msgspec, kvcm_client.client. `Discovery.step()` runs one round (asks
the current leader, then the seeds in turn) and returns; the daemon's loop calls it at start,
every `manager.discovery_interval_s` and at once when `note()` saw SERVER_NOT_LEADER, a refused
connection or a timeout. Rounds after a failure back off (full jitter) and are bounded. Only a
valid reply whose leader confirms itself moves the client; an older KVCM without the route
(404, UNSUPPORTED) keeps the seed; a malformed or inconsistent reply is counted and ignored.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from sidecar.kvcm_client.client import KvcmClient, Result, code_name

log = logging.getLogger(__name__)

ROUTE = "getClusterInfo"
BACKOFF_BASE_S = 0.1  # between rounds after a failure: full jitter, doubling up to the cap
BACKOFF_CAP_S = 1.0
MAX_ROUNDS = 30  # rounds per trigger (~15 s at the cap); the next failure starts again
_HOST = re.compile(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*")


class Outcome(enum.StrEnum):
    """One per seed asked (label `outcome` of kvcm_sidecar_manager_discovery_total)."""

    OK = "ok"  # a valid leader (changed or not)
    UNSUPPORTED = "unsupported"  # 404 / UNSUPPORTED: an older KVCM, the seed is used as is
    MALFORMED = "malformed"  # undecodable, no leader_endpoint, bad host or port, ids disagree
    FALSE_LEADER = "false_leader"  # names a node that just answered SERVER_NOT_LEADER
    STALE = "stale"  # names a leader that does not answer as one (no election yet, wrong port)
    ERROR = "error"  # another KVCM code (SERVICE_NOT_READY: no leader elected, ...)
    UNREACHABLE = "unreachable"  # refused, timed out, HTTP 5xx


class Trigger(enum.StrEnum):
    START = "start"
    INTERVAL = "interval"
    NOT_LEADER = "not_leader"
    UNREACHABLE = "unreachable"


class ClusterInfoRequest(msgspec.Struct):
    trace_id: str


_decoder = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


def _field(d: dict[str, Any], snake: str) -> Any:
    """A proto3-JSON field in snake_case or lowerCamelCase."""
    if snake in d:
        return d[snake]
    head, *rest = snake.split("_")
    return d.get(head + "".join(p.title() for p in rest))


def _port(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and 0 < value <= 65535 else None


class Leader(msgspec.Struct, frozen=True):
    url: str  # http://host:meta_http_port, or a seed as configured (older KVCM)
    node_id: str  # "" when it came from a seed


def parse(body: bytes) -> tuple[Outcome, Leader | None, bool, str]:
    """(outcome, leader, the answering node named itself, why) of a getClusterInfo body."""
    try:
        raw = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Outcome.MALFORMED, None, False, f"not a JSON object: {str(exc)[:80]}"
    header = raw.get("header")
    status = header.get("status") if isinstance(header, dict) else None
    code = code_name(status.get("code", "UNSPECIFIED")) if isinstance(status, dict) else "OK"
    if code == "UNSUPPORTED":
        return Outcome.UNSUPPORTED, None, False, "getClusterInfo is UNSUPPORTED"
    if code != "OK":
        return Outcome.ERROR, None, False, f"getClusterInfo answered {code}"
    ep = _field(raw, "leader_endpoint")
    if not isinstance(ep, dict):
        return Outcome.MALFORMED, None, False, "no leader_endpoint"
    host = ep.get("host")
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        return Outcome.MALFORMED, None, False, f"leader_endpoint.host {host!r} is not a host"
    port = _port(_field(ep, "meta_http_port"))
    if port is None:
        bad = _field(ep, "meta_http_port")
        return Outcome.MALFORMED, None, False, f"leader_endpoint.meta_http_port {bad!r} invalid"
    leader_id = _field(raw, "leader_node_id")
    ep_id = _field(ep, "node_id")
    if not isinstance(leader_id, str) or not leader_id:
        leader_id = ep_id if isinstance(ep_id, str) else ""
    if isinstance(ep_id, str) and ep_id and ep_id != leader_id:
        return Outcome.MALFORMED, None, False, f"leader_node_id {leader_id!r} != {ep_id!r}"
    self_id = _field(raw, "self_node_id")
    named_self = bool(leader_id) and self_id == leader_id
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address, as a URL writes it
    return Outcome.OK, Leader(f"http://{host}:{port}", leader_id), named_self, ""


class Discovery:
    """Which URL the KVCM client sends to; owns `client.base`."""

    def __init__(
        self,
        seeds: tuple[str, ...],
        session: aiohttp.ClientSession,
        client: KvcmClient,
        *,
        timeout_s: float,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_change: Callable[[Leader], None] | None = None,
    ) -> None:
        self.seeds = seeds
        self.session = session
        self.client = client
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_change = on_change
        self.leader = Leader(seeds[0], "")
        self.from_cluster_info = False  # the leader came from getClusterInfo, not a seed
        client.base = self.leader.url
        self.outcomes: Counter[Outcome] = Counter({o: 0 for o in Outcome})
        self.leader_changes = 0
        self.rounds = 0
        self.last_round_at = 0.0
        self.last_ok_at = 0.0
        self.wanted: Trigger | None = Trigger.START
        self.wake = asyncio.Event()  # set by note(): the loop runs a round at once
        self.wake.set()
        self.first_round = asyncio.Event()  # set when the start round has ended, either way
        # The URL that just failed and how: a reply naming it again is not news.
        self.suspect: tuple[str, Trigger] | None = None
        self.failed_rounds = 0
        self.next_round_at = 0.0
        self._n = 0

    # ---- what the publisher saw ------------------------------------------------------------
    def note(self, result: Result) -> None:
        """Called with every KVCM result: SERVER_NOT_LEADER, refused or timed out -> a round."""
        if result.reason == "SERVER_NOT_LEADER":
            trigger = Trigger.NOT_LEADER
        elif result.reason in ("connect", "timeout", "transport"):  # transport: a reset
            trigger = Trigger.UNREACHABLE
        else:
            return
        url = result.endpoint or self.client.base
        if url != self.leader.url:
            return  # an answer from a leader already left behind
        if self.suspect is None or self.suspect[1] is not Trigger.NOT_LEADER:
            self.suspect = (url, trigger)  # SERVER_NOT_LEADER is the stronger statement
        if self.wanted is None:
            self.wanted = trigger
            self.failed_rounds = 0
            self.next_round_at = 0.0
        self.wake.set()

    # ---- one round ---------------------------------------------------------------------------
    def due_in_s(self) -> float:
        """Seconds until the next round should run (0: now)."""
        now = self.clock()
        if self.wanted is not None:
            return max(self.next_round_at - now, 0.0)
        return max(self.last_round_at + self.interval_s - now, 0.0)

    def _order(self) -> list[str]:
        """The current leader first (authoritative when healthy), then the seeds in turn. A
        node that just answered SERVER_NOT_LEADER is up and knows the leader: it goes first; one
        that did not answer goes last."""
        urls = [self.leader.url, *self.seeds]
        seen: list[str] = []
        for u in urls:
            if u not in seen:
                seen.append(u)
        if self.suspect is not None and self.suspect[0] in seen:
            seen.remove(self.suspect[0])
            if self.suspect[1] is Trigger.NOT_LEADER:
                seen.insert(0, self.suspect[0])
            else:
                seen.append(self.suspect[0])
        return seen

    async def _ask(self, url: str) -> tuple[Outcome, Leader | None, bool, str]:
        self._n += 1
        body = _encoder.encode(ClusterInfoRequest(f"kvcm-sidecar-discovery-{self._n}"))
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(
                    f"{url}/api/{ROUTE}", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    raw = await resp.content.read(self.client.max_response_bytes + 1)
                    status = resp.status
        except TimeoutError:
            return Outcome.UNREACHABLE, None, False, "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            return Outcome.UNREACHABLE, None, False, type(exc).__name__
        if status == 404:
            return Outcome.UNSUPPORTED, None, False, "no getClusterInfo route (HTTP 404)"
        if status // 100 != 2:
            return Outcome.UNREACHABLE, None, False, f"http_{status}"
        if len(raw) > self.client.max_response_bytes:
            return Outcome.MALFORMED, None, False, "oversize reply"
        return parse(raw)

    async def _confirms(self, candidate: Leader) -> bool:
        """Does the node another one named answer, naming itself the leader?"""
        outcome, leader, named_self, _ = await self._ask(candidate.url)
        if outcome is Outcome.UNREACHABLE:
            self.outcomes[outcome] += 1
        if outcome is not Outcome.OK or leader is None or not named_self:
            return False
        if candidate.node_id:
            return leader.node_id == candidate.node_id
        return leader.url == candidate.url

    async def step(self) -> bool:
        """One round. Returns True when a leader (or a seed, for an older KVCM) was settled."""
        trigger = self.wanted or Trigger.INTERVAL
        self.rounds += 1
        self.last_round_at = self.clock()
        found: Leader | None = None
        unsupported: str | None = None
        for url in self._order():
            outcome, leader, named_self, why = await self._ask(url)
            if outcome is Outcome.OK and leader is not None and self.suspect is not None:
                bad_url, how = self.suspect
                if leader.url == bad_url and how is Trigger.UNREACHABLE and url == bad_url:
                    pass  # the leader that had not answered answers again, as the leader
                elif leader.url == bad_url:
                    # A leader that just said SERVER_NOT_LEADER (a follower naming itself, or a
                    # follower's stale view) or that did not answer (no election yet).
                    outcome = Outcome.FALSE_LEADER if how is Trigger.NOT_LEADER else Outcome.STALE
                    why = f"names {leader.url}, which just failed ({how})"
                    if named_self and how is Trigger.NOT_LEADER:
                        why = f"{url} names itself leader but answered SERVER_NOT_LEADER"
            if (
                outcome is Outcome.OK
                and leader is not None
                and not named_self
                and leader.url != self.leader.url
                and not await self._confirms(leader)
            ):
                # Named by another node, but not reachable as the leader (a wrong port, a
                # dead node no election has replaced yet, a follower): not news.
                outcome = Outcome.STALE
                why = f"names {leader.url}, which does not answer as the leader"
            self.outcomes[outcome] += 1
            if outcome is Outcome.OK and leader is not None:
                found = leader
                break
            if outcome is Outcome.UNSUPPORTED and unsupported is None:
                unsupported = url
            if outcome in (Outcome.MALFORMED, Outcome.FALSE_LEADER):
                log.warning(
                    "kvcm discovery reply ignored seed=%s outcome=%s why=%s", url, outcome, why
                )
            else:
                log.debug("kvcm discovery seed=%s outcome=%s why=%s", url, outcome, why)
        if found is None and unsupported is not None and not self.from_cluster_info:
            found = Leader(unsupported, "")  # an older KVCM: the seed as it is
        if found is not None:
            self._settle(found, trigger)
            return True
        self.failed_rounds += 1
        if self.failed_rounds >= MAX_ROUNDS:
            log.warning(
                "kvcm discovery gave up rounds=%d trigger=%s leader=%s",
                self.failed_rounds,
                trigger,
                self.leader.url,
            )
            self.wanted = None
            self.suspect = None
            return False
        self.wanted = trigger
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(self.failed_rounds - 1, 30))
        self.next_round_at = self.clock() + self.rng.uniform(0, ceiling)
        return False

    def _settle(self, leader: Leader, trigger: Trigger) -> None:
        self.wanted = None
        self.suspect = None
        self.failed_rounds = 0
        self.last_ok_at = self.clock()
        self.from_cluster_info = bool(leader.node_id) or self.from_cluster_info
        if leader.url == self.leader.url and leader.node_id == self.leader.node_id:
            return
        old = self.leader
        self.leader = leader
        self.client.base = leader.url
        if old.url != leader.url:
            self.leader_changes += 1
            log.info(
                "kvcm leader changed from=%s to=%s node_id=%s trigger=%s",
                old.url,
                leader.url,
                leader.node_id,
                trigger,
            )
            if self.on_change is not None:
                self.on_change(leader)

    async def run(self) -> None:
        """The daemon's loop: a round when due, then wait for a trigger or the next due time."""
        while True:
            wait = self.due_in_s()
            if wait > 0:
                self.wake.clear()
                try:
                    async with asyncio.timeout(wait):
                        await self.wake.wait()
                except TimeoutError:
                    pass
                continue
            if self.wanted is None:
                self.wanted = Trigger.INTERVAL
            try:
                await self.step()
            finally:
                self.first_round.set()

    # ---- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "manager_leader": self.leader.url,
            "manager_leader_node_id": self.leader.node_id,
            "manager_seeds": len(self.seeds),
            "manager_discovery": "getClusterInfo" if self.from_cluster_info else "seed",
        }
