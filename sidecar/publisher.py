"""The publisher: registration, deltas, KVCM snapshots, heartbeats and engine death, as steps.

Imports: stdlib, numpy, kvcm_client, key_state, source.base (never a ring or a socket: the
source gives identity, incarnation, liveness, lag and drop counters and sync state). Each
`*_step()` does one unit of work and returns; the daemon's loops call them and tests drive them
directly. At most one data request (register, snapshot, delta, host-down) is in flight, because
only `data_step` sends them; heartbeats go on their own schedule through `heartbeat_step`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.config import Config
from sidecar.key_state import KeyState
from sidecar.kvcm_client import wire as W
from sidecar.kvcm_client.client import Action, KvcmClient, Result
from sidecar.source.base import Identity, Source, SourceRejected, Watch

log = logging.getLogger(__name__)
# Failures after the request may have reached KVCM: it may still apply them (docs/wire.md).
AMBIGUOUS = frozenset({"timeout", "transport"})


class State(enum.IntEnum):
    """Numbering kept from the seed for dashboards (DESIGN §7)."""

    DISABLED = 0
    STARTING = 1
    REGISTERING = 3
    RESYNCING = 4
    READY = 5
    DEGRADED = 6
    STOPPED = 7
    CIRCUIT_OPEN = 8
    ENGINE_DOWN = 9


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter, never below the server's retry_after."""

    base_s: float
    cap_s: float
    retry_after_cap_s: float
    attempt: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self, retry_after_s: float = 0.0) -> float:
        self.attempt += 1
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.attempt - 1, 30))
        return max(self.rng.uniform(0, ceiling), min(retry_after_s, self.retry_after_cap_s))

    def reset(self) -> None:
        self.attempt = 0


# What a request's outcome may set; while the engine is down, ENGINE_DOWN stands instead.
_LIVE = frozenset({State.READY, State.DEGRADED, State.RESYNCING, State.REGISTERING})


class Publisher:
    def __init__(
        self,
        cfg: Config,
        client: KvcmClient,
        source: Source,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_request: Callable[[str, Result], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.source = source
        self.keys: KeyState = source.keys
        self.clock = clock
        self.on_request = on_request
        self.on_reregister: Callable[[], None] | None = None  # wakes the data loop
        self.epoch = secrets.randbits(32)
        self.host_ip_port = cfg.host_ip_port()
        self.state = State.STARTING
        self.reason = "waiting for the engine to attach"
        self.identity: Identity | None = None
        self.registered = False
        self.ever_registered = False
        self.need_snapshot = False
        self.engine_down = False
        self.host_down_pending = False
        self.stopping = False
        self.backoff = Backoff(
            cfg.report.backoff_base_s, cfg.report.backoff_cap_s, cfg.report.retry_after_cap_s
        )
        self.retry_at = 0.0
        self.circuit_retry_at = 0.0
        self.last_snapshot_at = 0.0
        self.snapshot_not_before = 0.0
        self.last_success: dict[str, float] = {}
        self.heartbeat_ok_at = 0.0
        self.heartbeat_failures = 0
        self.in_flight = 0  # keys of the delta whose answer is awaited (taken, not confirmed)
        self.counters: Counter[str] = Counter()
        self.leader_changes = 0  # KVCM leader switches (a snapshot in flight across one: redone)
        self.state_changes: Counter[str] = Counter()
        self._n = 0
        self._trace_key: tuple[int, int] | None = None
        self._trace_head = ""
        self._spec_cache: tuple[Identity, list[W.Spec]] | None = None

    # ---- small helpers -------------------------------------------------------------------
    def set_state(self, state: State, reason: str) -> None:
        if self.engine_down and state in _LIVE:
            # A request that ends after the engine was found down (a held delta's answer, read
            # when the watch's signal pokes it) must not show the reporter live again.
            return
        if state != self.state or reason != self.reason:
            if state != self.state:
                self.state_changes[state.name] += 1
                log.info("publisher state %s -> %s reason=%s", self.state.name, state.name, reason)
            self.state, self.reason = state, reason

    def trace_id(self, op: str) -> str:
        self._n += 1
        key = (self.epoch, self.source.incarnation)
        if key != self._trace_key:  # the head is formatted once per epoch and engine life
            self._trace_key = key
            self._trace_head = (
                f"kvcm-sidecar-{self.cfg.identity.dp_rank}-{key[0]:08x}-{key[1]:016x}-"
            )
        return f"{self._trace_head}{op}-{self._n}"

    def system_status(self) -> dict[str, str]:
        return {
            "engine": "kvcm-sidecar",
            "dp_rank": str(self.cfg.identity.dp_rank),
            "epoch": f"{self.epoch:08x}",
            "engine_incarnation": f"{self.source.incarnation:016x}",
            "last_seq": str(self.source.last_seq),
            "published": str(self.keys.published_count),
            "ring_lag": str(self.source.lag()),
            "dropped": str(self.source.dropped_total),
            "state": self.state.name,
        }

    def _reporter(self, op: str) -> tuple[str, str, str, str]:
        """(trace_id, instance_id, host_ip_port, storage_type): every reportEvent starts so."""
        i = self.cfg.identity
        return self.trace_id(op), i.instance_id, self.host_ip_port, i.storage_type

    def _envelope(self, op: str, events: list[W.Event]) -> bytes:
        return W.encode(W.ReportEventRequest(*self._reporter(op), events))

    async def _send(
        self,
        route: str,
        op: str,
        payload: bytes | memoryview,
        timeout_s: float,
        *,
        hold: bool = False,
    ) -> Result:
        result = await self.client.post(route, payload, timeout_s, hold=hold)
        self.counters[f"{op}:{result.reason}"] += 1
        if self.on_request is not None:
            self.on_request(op, result)
        if result.ok:
            self.last_success[op] = time.time()
        return result

    def _specs(self) -> list[W.Spec]:
        """One spec per medium of the table (its URI may name the medium); built once per
        engine identity (every request names them)."""
        d = self.identity
        assert d is not None
        if self._spec_cache is not None and self._spec_cache[0] is d:
            return self._spec_cache[1]
        specs = [
            W.Spec(
                self.cfg.identity.spec_name,
                self.cfg.identity.uri_template.format(
                    host_ip_port=self.host_ip_port,
                    medium=medium,
                    block_bytes=d.block_bytes,
                    dp_rank=self.cfg.identity.dp_rank,
                ),
            )
            for medium in d.mediums
        ]
        self._spec_cache = (d, specs)
        return specs

    def _fail(self, op: str, result: Result) -> None:
        """Apply the one action the client classified this outcome as."""
        if result.action == Action.CIRCUIT_OPEN:
            self.registered = False
            self.circuit_retry_at = self.clock() + self.cfg.report.circuit_retry_s
            self.counters[f"circuit_open:{result.reason}"] += 1
            self.set_state(
                State.CIRCUIT_OPEN,
                f"{op} answered {result.reason}: {result.message}"
                " (configuration is wrong; not sending)",
            )
            return
        if result.action == Action.REREGISTER:
            self.registered = False
            self.need_snapshot = True
            if result.reason == "NODE_NOT_REGISTERED":
                self.keys.forget_acked()  # a tombstoned reporter lost its metadata
        elif result.action == Action.RESNAPSHOT:
            self.need_snapshot = True
        delay = self.backoff.next_delay(result.retry_after_s)
        self.retry_at = self.clock() + delay
        self.counters[f"retry:{op}"] += 1
        log.warning(
            "kvcm %s failed reason=%s action=%s attempt=%d delay_s=%.3f",
            op,
            result.reason,
            result.action.name,
            self.backoff.attempt,
            delay,
        )
        self.set_state(State.DEGRADED, f"{op} failed: {result.reason}")

    def _ok(self, result: Result) -> None:
        self.backoff.reset()
        if result.response is not None and result.response.snapshot_required:
            self.need_snapshot = True

    def leader_changed(self) -> None:
        """KVCM's leader moved (kvcm_client.discovery): retry at once instead of waiting out a
        backoff earned against the old one, and resnapshot, since a new leader holds what a
        restarted KVCM holds. The snapshot need not wait for stragglers (ambiguous deltas) or
        a rate limit: those were the old leader's, whose writes the new one never sees."""
        self.backoff.reset()
        self.retry_at = 0.0
        self.circuit_retry_at = 0.0
        self.snapshot_not_before = 0.0
        self.leader_changes += 1
        if self.registered:
            self.need_snapshot = True

    # ---- engine identity and watch --------------------------------------------------------
    def load_identity(self) -> bool:
        try:
            ident = self.source.identity()
        except SourceRejected as exc:
            self.set_state(State.CIRCUIT_OPEN, str(exc))
            return False
        if ident is None:
            return False
        self.identity = ident
        return True

    def watch_step(self) -> None:
        """Engine liveness, judged by the source; acted on here."""
        w = self.source.watch(self.engine_down)
        if w.event is Watch.BACK and self.engine_down:
            # A new incarnation, or the same engine healthy again: register again, resnapshot.
            self.engine_down = False
            self.identity = None
            self.registered = False
            self.need_snapshot = True
        elif w.event is Watch.DOWN and not self.engine_down:
            self.engine_down = True
            self.host_down_pending = self.registered
            self.set_state(State.ENGINE_DOWN, f"engine {w.why}")

    def next_wakeup_s(self) -> float:
        """How long the data loop may sleep when there is no new work: until the next timer."""
        now = self.clock()
        timers = [
            self.retry_at,
            self.circuit_retry_at if self.state == State.CIRCUIT_OPEN else 0.0,
            self.snapshot_not_before if self.need_snapshot else 0.0,
            self.last_snapshot_at + self.cfg.report.periodic_snapshot_s,
        ]
        due = [t - now for t in timers if t > now]
        # New work (ring records, engine events, heartbeat-driven re-registration) sets the
        # work event; 1 s bounds any missed edge.
        return min([1.0, *due])

    # ---- data path -------------------------------------------------------------------------
    async def data_step(self) -> bool:
        """One data request at most. Returns True if it did work (call again soon)."""
        now = self.clock()
        if self.host_down_pending:
            await self.host_down(self.cfg.shutdown.host_down_budget_s)
            return True
        if self.engine_down or self.stopping:
            return False
        if self.state == State.CIRCUIT_OPEN and now < self.circuit_retry_at:
            return False
        if now < self.retry_at:
            return False
        if self.identity is None and not self.load_identity():
            return False
        if self.source.take_forget():
            self.need_snapshot = True  # the source lost the engine's truth: KVCM must forget
        if not self.registered:
            await self.register()
            return True
        if not self.source.synced:
            self.set_state(State.RESYNCING, f"source {self.source.sync_state}")
            return False
        due = now - self.last_snapshot_at >= self.cfg.report.periodic_snapshot_s
        if (self.need_snapshot or due) and now >= self.snapshot_not_before:
            await self.send_snapshot()
            return True
        if self.keys.dirty:
            await self.send_deltas()
            return True
        self.set_state(State.READY, "in sync")
        return False

    async def register(self) -> None:
        d = self.identity
        assert d is not None
        self.set_state(State.REGISTERING, "registering with KVCM")
        spec = self._specs()[0]
        req = W.RegisterInstanceRequest(
            self.trace_id("register"),
            self.cfg.manager.instance_group,
            d.instance_id,
            d.block_size_tokens,
            [W.LocationSpecInfo(spec.name, d.block_bytes)],
            W.ModelDeployment(d.model_name, d.dtype, d.use_mla, d.tp_size, d.dp_size, d.pp_size),
            [W.LocationSpecGroup("default", [spec.name])],
        )
        timeout = self.cfg.manager.request_timeout_s
        result = await self._send("registerInstance", "register", W.encode(req), timeout)
        if not result.ok:
            self._fail("register", result)
            return
        payload = self._envelope(
            "node_register",
            [W.ev_register(list(d.mediums)), W.ev_heartbeat(self.system_status())],
        )
        result = await self._send("reportEvent", "node_register", payload, timeout)
        if not result.ok:
            self._fail("node_register", result)
            return
        self._ok(result)
        self.registered = True
        self.ever_registered = True
        self.need_snapshot = True
        self.heartbeat_ok_at = self.clock()

    async def send_snapshot(self) -> None:
        d = self.identity
        assert d is not None
        self.set_state(State.RESYNCING, "sending the authoritative snapshot")
        keys, mediums = self.keys.published()
        changes = self.leader_changes  # an OK from a leader since deposed commits nothing new
        payload = W.encode_snapshot(
            *self._reporter("snapshot"), keys, d.mediums, self._specs(), mediums
        )
        self.counters["snapshot_keys"] += len(keys)
        self.counters["snapshot_bytes"] += len(payload)
        result = await self._send(
            "reportEvent", "snapshot", payload, self.cfg.manager.snapshot_timeout_s
        )
        if not result.ok:
            if result.reason == "SNAPSHOT_RATE_LIMITED":
                # Wait as told, but keep sending deltas meanwhile: they are correct relative
                # to `acked`, and the snapshot only cleans up what KVCM may hold beyond it.
                self.counters["snapshot_rate_limited"] += 1
                wait = min(
                    max(result.retry_after_s, self.cfg.report.backoff_base_s),
                    self.cfg.report.retry_after_cap_s,
                )
                self.snapshot_not_before = self.clock() + wait * (1 + 0.1 * random.random())
                self.set_state(State.DEGRADED, "snapshot rate limited")
                return
            self._fail("snapshot", result)
            return
        self._ok(result)
        self.keys.commit_snapshot(keys, mediums)
        self.need_snapshot = self.leader_changes != changes
        self.last_snapshot_at = self.clock()
        self.counters["snapshots_committed"] += 1
        self.set_state(State.READY, "snapshot committed")

    async def send_deltas(self) -> None:
        d = self.identity
        assert d is not None
        batch = self.keys.take_batch(self.cfg.report.batch_max_keys)
        if not len(batch):
            return
        # Adds first, then deletes (the batch's own order): item_results indexes map back to it.
        payload: bytes | memoryview
        m = batch.medium
        if 0 <= m < len(d.mediums):  # one medium (the common case): one C call, no selections
            flags = batch.nadd if batch.nadd >= 0 else batch.publish  # adds first: either form
            payload = W.encode_batch(
                *self._reporter("delta"), batch.keys, flags, d.mediums[m], self._specs()[m]
            )
        else:
            payload = W.encode_deltas(
                *self._reporter("delta"),
                batch.adds,
                batch.deletes,
                d.mediums,
                self._specs(),
                batch.add_mediums,
                batch.delete_mediums,
            )
        # Held (kvcm_client/transport.py Hold): its answer is read at the next window's wake-up,
        # not at a wake-up of its own; never while shutting down (the flush must end).
        self.in_flight = len(batch)  # taken from dirty; acked (adds) or not (deletes) at the answer
        try:
            result = await self._send(
                "reportEvent",
                "delta",
                payload,
                self.cfg.manager.request_timeout_s,
                hold=not self.stopping,
            )
        except BaseException:
            # Cancelled in flight (shutdown: most of a window is spent with the answer held):
            # the taken keys go back in front, so the shutdown flush sends them again.
            self.keys.confirm(batch, range(len(batch)))
            raise
        finally:
            self.in_flight = 0
        if result.ok:
            self._ok(result)
            self.keys.confirm(batch)
            self.counters["delta_keys"] += len(batch)
            self.set_state(State.READY, "in sync" if not self.keys.dirty else "sending deltas")
            return
        if result.failed_items and max(result.failed_items) >= len(batch):
            # More item_results than events: the answer cannot be mapped back; retry them all.
            result.failed_items = []
            self.counters["unmappable_item_results"] += 1
        if result.failed_items and result.response is not None:
            # Not transactional: the OK items took effect; retry only the failed, in order.
            self.keys.confirm(batch, result.failed_items)
            self.counters["partial_failures"] += 1
        else:
            self.keys.confirm(batch, range(len(batch)))
        if result.reason in AMBIGUOUS:
            # KVCM may have this request and apply it after its retry (requests carry no order),
            # leaving an older state of these keys last. An authoritative snapshot, sent once
            # such a straggler has had time to land, puts KVCM back on the truth; deltas go on.
            self.counters["ambiguous_deltas"] += 1
            self.need_snapshot = True
            self.snapshot_not_before = max(
                self.snapshot_not_before,
                self.clock() + self.cfg.report.ambiguous_snapshot_delay_s,
            )
        self._fail("delta", result)

    async def host_down(self, budget_s: float) -> bool:
        """Tell KVCM this reporter is gone (it hides our keys at once); retried within budget."""
        self.host_down_pending = False
        deadline = self.clock() + budget_s
        ok = False
        while not ok:
            left = deadline - self.clock()
            if left <= 0.01:
                break
            payload = self._envelope("host_down", [W.ev_host_down()])
            result = await self._send("reportEvent", "host_down", payload, left)
            ok = result.ok
            if not ok and result.action == Action.CIRCUIT_OPEN:
                break
            if not ok:
                await asyncio.sleep(min(0.05, max(deadline - self.clock(), 0)))
        self.registered = False
        self.keys.forget_acked()
        return ok

    # ---- heartbeat -----------------------------------------------------------------------
    async def heartbeat_step(self) -> None:
        if not self.registered or self.engine_down or self.state == State.CIRCUIT_OPEN:
            return
        payload = self._envelope("heartbeat", [W.ev_heartbeat(self.system_status())])
        commits = self.counters["snapshots_committed"]
        result = await self._send(
            "reportEvent", "heartbeat", payload, self.cfg.manager.request_timeout_s
        )
        if result.ok:
            self.heartbeat_ok_at = self.clock()
            self.heartbeat_failures = 0
            # KVCM answers true while this reporter has no generation (after a KVCM restart,
            # and after registering until the snapshot commits). Heartbeats run beside the
            # data requests: a true answer whose heartbeat overlapped a committed snapshot
            # may predate that commit, and acting on it would snapshot twice.
            required = result.response is not None and result.response.snapshot_required
            if required and self.counters["snapshots_committed"] == commits:
                self.need_snapshot = True  # KVCM restarted and lost our generation
                if self.on_reregister is not None:
                    self.on_reregister()
            return
        self.heartbeat_failures += 1
        if result.action == Action.REREGISTER:
            self.registered = False  # the data loop re-registers and resnapshots
            self.need_snapshot = True
            if self.on_reregister is not None:
                self.on_reregister()
            if result.reason == "NODE_NOT_REGISTERED":
                self.keys.forget_acked()
        log.warning(
            "kvcm heartbeat failed reason=%s failures=%d", result.reason, self.heartbeat_failures
        )

    # ---- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "state": self.state.name,
            "state_code": int(self.state),
            "reason": self.reason,
            "epoch": f"{self.epoch:08x}",
            "engine_incarnation": f"{self.source.incarnation:016x}",
            "engine_sync": self.source.sync_state,
            "source": self.source.kind,
            "host_ip_port": self.host_ip_port,
            "instance_id": self.cfg.identity.instance_id,
            "dp_rank": self.cfg.identity.dp_rank,
            "registered": self.registered,
            "published": self.keys.published_count,
            "acked": len(self.keys.acked),
            "dirty": len(self.keys.dirty),
            "in_flight": self.in_flight,
            "ring_lag": self.source.lag(),
            "dropped": self.source.dropped_total,
            "last_seq": self.source.last_seq,
            "resyncs": dict(self.source.resyncs),
            **self.source.status(),
            "last_success": dict(self.last_success),
            "pid": os.getpid(),
        }
