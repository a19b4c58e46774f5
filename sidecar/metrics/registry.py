"""Prometheus metrics of one sidecar: its own registry, no globals, labels bounded.

Imports: prometheus-client. Request counts and latencies are observed as requests finish; every
other gauge and counter (ring, key state, resyncs, states, heartbeats, engine) is read from the
publisher at scrape time by a collector, so no loop pushes them. METRICS is the catalogue that
docs/operations.md and a test check against the registry.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.kvcm_client.client import Result
from sidecar.kvcm_client.discovery import Discovery
from sidecar.publisher import Publisher, State
from sidecar.shm_ring import layout as L
from sidecar.source.key_check import CHECK_SCHEMES
from sidecar.source.rekey import REASONS
from sidecar.source.ring import RingSource
from sidecar.source.zmq import ZmqSource
from sidecar.wakeups import Rides

# name -> (type, help). Counters are listed without the _total suffix, as Prometheus families.
METRICS: dict[str, tuple[str, str]] = {
    "kvcm_sidecar_publisher_state": ("gauge", "Publisher state code (DESIGN §7 numbering)."),
    "kvcm_sidecar_publisher_state_info": ("gauge", "1 for the current publisher state name."),
    "kvcm_sidecar_state_changes": ("counter", "Publisher state transitions, by new state."),
    "kvcm_sidecar_ring_capacity_slots": ("gauge", "Ring capacity in records."),
    "kvcm_sidecar_ring_lag_records": ("gauge", "Records published by the engine, not yet read."),
    "kvcm_sidecar_ring_accepted_records": ("counter", "Records the producer accepted (tail)."),
    "kvcm_sidecar_ring_dropped_records": ("counter", "Records the producer dropped (ring full)."),
    "kvcm_sidecar_records_read": ("counter", "Records this sidecar read from the ring."),
    "kvcm_sidecar_resyncs": ("counter", "Engine snapshot requests, by reason."),
    "kvcm_sidecar_keys_published": ("gauge", "Keys the engine publishes (all required groups)."),
    "kvcm_sidecar_keys_acked": ("gauge", "Keys KVCM has confirmed."),
    "kvcm_sidecar_keys_dirty": ("gauge", "Keys whose KVCM state may differ from the engine's."),
    "kvcm_sidecar_requests": ("counter", "KVCM requests by operation and outcome."),
    "kvcm_sidecar_request_duration_seconds": (
        "histogram",
        "KVCM request latency by operation, of answers read as they came (a held answer's is"
        " not known: it came sometime in the hold).",
    ),
    "kvcm_sidecar_held_answers": (
        "counter",
        "Answers left unread until the next wake-up (report.response_hold_s), by operation.",
    ),
    "kvcm_sidecar_periodic_runs": (
        "counter",
        "Heartbeat and engine-watch runs, by how they woke: shared (a source's wake-up, none of"
        " their own) or alone (their own timer: the engine was silent).",
    ),
    "kvcm_sidecar_retries": ("counter", "Backed-off retries, by operation."),
    "kvcm_sidecar_circuit_open": ("counter", "Circuit-open events, by reason."),
    "kvcm_sidecar_heartbeat_failures": ("gauge", "Consecutive heartbeat failures."),
    "kvcm_sidecar_heartbeat_age_seconds": ("gauge", "Seconds since the last good heartbeat."),
    "kvcm_sidecar_snapshots_committed": ("counter", "Authoritative snapshots KVCM committed."),
    "kvcm_sidecar_ambiguous_deltas": (
        "counter",
        "Deltas with no answer after sending (timeout, broken connection): KVCM may still apply"
        " them after their retry, so a snapshot follows.",
    ),
    "kvcm_sidecar_snapshot_keys": ("counter", "Keys sent in snapshots."),
    "kvcm_sidecar_snapshot_bytes": ("counter", "Request bytes sent in snapshots."),
    "kvcm_sidecar_snapshot_rate_limited": ("counter", "Snapshots answered SNAPSHOT_RATE_LIMITED."),
    "kvcm_sidecar_snapshot_last_success_timestamp_seconds": (
        "gauge",
        "Unix time of the last committed snapshot.",
    ),
    "kvcm_sidecar_delta_keys": ("counter", "Key changes KVCM confirmed through deltas."),
    "kvcm_sidecar_manager_leader_changes": (
        "counter",
        "Times leader discovery moved the client to another KVCM node.",
    ),
    "kvcm_sidecar_manager_discovery": (
        "counter",
        "getClusterInfo answers by outcome (ok, unsupported, malformed, false_leader, stale,"
        " error, unreachable), one per node asked.",
    ),
    "kvcm_sidecar_engine_up": ("gauge", "1 while the engine is attached and alive."),
    "kvcm_sidecar_engine_incarnation_changes": (
        "counter",
        "New engine incarnations seen on the ring (engine restarts).",
    ),
    "kvcm_sidecar_engine_anomalies": ("counter", "Ring records rejected as torn or foreign."),
    "kvcm_sidecar_ring_unknown_medium_records": (
        "counter",
        "Ring records and snapshot entries dropped: medium index outside the medium table.",
    ),
    "kvcm_sidecar_zmq_batches": (
        "counter",
        "ZMQ event batches by outcome (applied, replayed, duplicate, stale, dp_rank, malformed).",
    ),
    "kvcm_sidecar_zmq_events": ("counter", "ZMQ events applied, by type and KVCM medium."),
    "kvcm_sidecar_zmq_block_events": ("counter", "Block hashes in the ZMQ events applied."),
    "kvcm_sidecar_zmq_dropped_events": (
        "counter",
        "ZMQ events dropped, by reason (block_size, unknown_medium, unknown_event, ...).",
    ),
    "kvcm_sidecar_zmq_decode_errors": (
        "counter",
        "ZMQ frames or payloads that could not be read, by reason.",
    ),
    "kvcm_sidecar_zmq_gaps": ("counter", "ZMQ seq gaps (and damaged batches) seen live."),
    "kvcm_sidecar_zmq_replays": (
        "counter",
        "ZMQ replays by outcome (covered, uncovered, timeout, restart, recovered) and recovery"
        " attempts by trigger (recovery_retry, recovery_stream_back, recovery_engine_recovered;"
        " recovery_given_up, recovery_refuted).",
    ),
    "kvcm_sidecar_zmq_recovery_pending": (
        "gauge",
        "1 while a forget may still be undone: a replay that rebuilds the state exactly is"
        " being retried (docs/operations.md, 'When a replay goes unanswered').",
    ),
    "kvcm_sidecar_zmq_forgets": (
        "counter",
        "Times the ZMQ source emptied its key state and made KVCM forget it, by reason.",
    ),
    "kvcm_sidecar_zmq_last_seq": ("gauge", "The last ZMQ batch seq applied (-1: none)."),
    "kvcm_sidecar_zmq_seq_lag_batches": (
        "gauge",
        "ZMQ live batches held beyond the last one applied (waiting for a replay).",
    ),
    "kvcm_sidecar_zmq_held_blocks": (
        "gauge",
        "(key, medium, group)s with a positive store count.",
    ),
    "kvcm_sidecar_zmq_checkpoint_age_seconds": (
        "gauge",
        "Seconds since the checkpoint last matched the key state (-1: none yet).",
    ),
    "kvcm_sidecar_zmq_checkpoint_errors": (
        "counter",
        "Checkpoints not written or not loaded, by reason.",
    ),
    "kvcm_sidecar_zmq_health_failures": ("gauge", "Consecutive failed engine health probes."),
    "kvcm_sidecar_zmq_connections": (
        "counter",
        "The ZMTP transport's live connection: connected, lost, connect_failed (libzmq: none).",
    ),
    "kvcm_sidecar_key_check": (
        "gauge",
        "Per router scheme: 1 every sampled engine block hash reproduced, 0 one did not.",
    ),
    "kvcm_sidecar_blocks_unkeyed": (
        "counter",
        "Stored blocks not reported under a rolling key (key_mode rolling/both), by reason.",
    ),
    "kvcm_sidecar_key_table_entries": ("gauge", "Engine hash -> rolling state entries."),
    "kvcm_sidecar_key_table_evictions": (
        "counter",
        "Key table entries evicted (by epochs, approximately LRU).",
    ),
}
# Exported only with that source (source.kind); the rest always.
RING_ONLY = frozenset(
    {
        "kvcm_sidecar_ring_capacity_slots",
        "kvcm_sidecar_ring_lag_records",
        "kvcm_sidecar_ring_accepted_records",
        "kvcm_sidecar_ring_dropped_records",
        "kvcm_sidecar_records_read",
        "kvcm_sidecar_engine_anomalies",
        "kvcm_sidecar_ring_unknown_medium_records",
    }
)
ZMQ_ONLY = frozenset(
    name for name in METRICS if name.startswith(("kvcm_sidecar_zmq_", "kvcm_sidecar_key"))
) | {"kvcm_sidecar_blocks_unkeyed"}

OUTCOMES = ("ok", "retry", "resnapshot", "reregister", "circuit_open")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Request and held-answer counts are plain ints, exported at scrape time (_Requests): a
        # prometheus Counter's inc() takes a lock and runs its checks on every request, which
        # at engine pace is one per flush window.
        self.request_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.held_counts: collections.Counter[str] = collections.Counter()
        self.registry.register(_Requests(self))
        self._latency: dict[str, Any] = {}  # op -> the histogram's child (labels() once per op)
        self.latency = Histogram(
            "kvcm_sidecar_request_duration_seconds",
            METRICS["kvcm_sidecar_request_duration_seconds"][1],
            ["op"],
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
            ),
            registry=self.registry,
        )

    def observe(self, op: str, result: Result) -> None:
        self.request_counts[(op, OUTCOMES[int(result.action)])] += 1
        if result.held_s > 0:  # its latency is not known: it came sometime in the hold
            self.held_counts[op] += 1
            return
        child = self._latency.get(op)
        if child is None:
            child = self._latency[op] = self.latency.labels(op)
        child.observe(result.latency_s)

    def attach(self, publisher: Publisher) -> None:
        self.registry.register(_PublisherCollector(publisher))

    def attach_discovery(self, discovery: Discovery) -> None:
        self.registry.register(_DiscoveryCollector(discovery))

    def attach_rides(self, rides: Rides) -> None:
        self.registry.register(_RidesCollector(rides))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Requests(Collector):
    def __init__(self, m: Metrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        name = "kvcm_sidecar_requests"
        req = CounterMetricFamily(name, METRICS[name][1], labels=["op", "outcome"])
        for (op, outcome), n in sorted(self.m.request_counts.items()):
            req.add_metric([op, outcome], n)
        yield req
        name = "kvcm_sidecar_held_answers"
        held = CounterMetricFamily(name, METRICS[name][1], labels=["op"])
        for op, n in sorted(self.m.held_counts.items()):
            held.add_metric([op], n)
        yield held


class _PublisherCollector(Collector):
    def __init__(self, p: Publisher) -> None:
        self.p = p

    def collect(self) -> Iterator[Metric]:
        p = self.p

        def gauge(name: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, METRICS[name][1], value=value)

        def counter(name: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, METRICS[name][1], value=value)

        yield gauge("kvcm_sidecar_publisher_state", int(p.state))
        info = GaugeMetricFamily(
            "kvcm_sidecar_publisher_state_info",
            METRICS["kvcm_sidecar_publisher_state_info"][1],
            labels=["state"],
        )
        for s in State:
            info.add_metric([s.name], 1.0 if s == p.state else 0.0)
        yield info
        changes = CounterMetricFamily(
            "kvcm_sidecar_state_changes", METRICS["kvcm_sidecar_state_changes"][1], labels=["state"]
        )
        for s in State:
            changes.add_metric([s.name], p.state_changes.get(s.name, 0))
        yield changes
        src = p.source
        if isinstance(src, RingSource):
            reader = src.reader
            hdr = reader.seg.hdr
            yield gauge("kvcm_sidecar_ring_capacity_slots", reader.capacity)
            yield gauge("kvcm_sidecar_ring_lag_records", reader.lag())
            yield counter("kvcm_sidecar_ring_accepted_records", int(hdr[L.W_TAIL]))
            yield counter("kvcm_sidecar_ring_dropped_records", int(hdr[L.W_DROPPED]))
            yield counter("kvcm_sidecar_records_read", reader.records_read)
            yield counter("kvcm_sidecar_engine_anomalies", src.sync.anomalies)
            yield counter("kvcm_sidecar_ring_unknown_medium_records", src.sync.unknown_medium)
        elif isinstance(src, ZmqSource):
            yield from _zmq_families(src)
        resyncs = CounterMetricFamily(
            "kvcm_sidecar_resyncs", METRICS["kvcm_sidecar_resyncs"][1], labels=["reason"]
        )
        for reason, n in sorted(src.resyncs.items()):
            resyncs.add_metric([reason], n)
        yield resyncs
        yield gauge("kvcm_sidecar_keys_published", p.keys.published_count)
        yield gauge("kvcm_sidecar_keys_acked", len(p.keys.acked))
        yield gauge("kvcm_sidecar_keys_dirty", len(p.keys.dirty))
        for name, prefix in (
            ("kvcm_sidecar_retries", "retry:"),
            ("kvcm_sidecar_circuit_open", "circuit_open:"),
        ):
            fam = CounterMetricFamily(
                name, METRICS[name][1], labels=["op" if prefix == "retry:" else "reason"]
            )
            for key, n in sorted(p.counters.items()):
                if key.startswith(prefix):
                    fam.add_metric([key[len(prefix) :]], n)
            yield fam
        yield gauge("kvcm_sidecar_heartbeat_failures", p.heartbeat_failures)
        age = p.clock() - p.heartbeat_ok_at if p.heartbeat_ok_at else -1.0
        yield gauge("kvcm_sidecar_heartbeat_age_seconds", age)
        yield counter("kvcm_sidecar_snapshots_committed", p.counters["snapshots_committed"])
        yield counter("kvcm_sidecar_ambiguous_deltas", p.counters["ambiguous_deltas"])
        yield counter("kvcm_sidecar_snapshot_keys", p.counters["snapshot_keys"])
        yield counter("kvcm_sidecar_snapshot_bytes", p.counters["snapshot_bytes"])
        yield counter("kvcm_sidecar_snapshot_rate_limited", p.counters["snapshot_rate_limited"])
        yield gauge(
            "kvcm_sidecar_snapshot_last_success_timestamp_seconds",
            p.last_success.get("snapshot", 0.0),
        )
        yield counter("kvcm_sidecar_delta_keys", p.counters["delta_keys"])
        alive = src.incarnation != 0 and not p.engine_down
        yield gauge("kvcm_sidecar_engine_up", 1.0 if alive else 0.0)
        yield counter(
            "kvcm_sidecar_engine_incarnation_changes", src.resyncs.get("new_incarnation", 0)
        )


class _DiscoveryCollector(Collector):
    def __init__(self, d: Discovery) -> None:
        self.d = d

    def collect(self) -> Iterator[Metric]:
        name = "kvcm_sidecar_manager_leader_changes"
        yield CounterMetricFamily(name, METRICS[name][1], value=self.d.leader_changes)
        yield _by(
            "kvcm_sidecar_manager_discovery",
            "outcome",
            {o.value: n for o, n in self.d.outcomes.items()},
        )


class _RidesCollector(Collector):
    def __init__(self, rides: Rides) -> None:
        self.rides = rides

    def collect(self) -> Iterator[Metric]:
        r = self.rides
        yield _by("kvcm_sidecar_periodic_runs", "how", {"shared": r.shared, "alone": r.alone})


def _labelled(
    name: str, labels: list[str], rows: Iterable[tuple[tuple[str, ...], float]]
) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, METRICS[name][1], labels=labels)
    for values, n in sorted(rows):
        fam.add_metric(list(values), n)
    return fam


def _by(name: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    return _labelled(name, [label], [((k,), n) for k, n in counts.items()])


def _zmq_families(src: ZmqSource) -> Iterator[Metric]:
    s = src.stream

    def gauge(name: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, METRICS[name][1], value=value)

    def counter(name: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, METRICS[name][1], value=value)

    yield _by("kvcm_sidecar_zmq_batches", "outcome", s.batches)
    dec = s.decoder
    events: list[tuple[tuple[str, str], float]] = [(("AllBlocksCleared", "all"), dec.cleared)]
    for mi, medium in enumerate(src.mediums):  # bounded: the medium table
        events.append((("BlockStored", medium), int(s.events[2 * mi + 1])))
        events.append((("BlockRemoved", medium), int(s.events[2 * mi])))
    yield _labelled("kvcm_sidecar_zmq_events", ["type", "medium"], events)
    yield counter("kvcm_sidecar_zmq_block_events", s.blocks)
    yield _by("kvcm_sidecar_zmq_dropped_events", "reason", dec.drops)
    yield _by("kvcm_sidecar_zmq_decode_errors", "reason", s.decode_errors)
    yield counter("kvcm_sidecar_zmq_gaps", s.gaps)
    yield _by("kvcm_sidecar_zmq_replays", "outcome", s.replays)
    yield _by("kvcm_sidecar_zmq_forgets", "reason", s.forgets)
    yield gauge("kvcm_sidecar_zmq_recovery_pending", int(s.pending_basis() is not None))
    yield gauge("kvcm_sidecar_zmq_last_seq", s.last_seq)
    yield gauge("kvcm_sidecar_zmq_seq_lag_batches", src.lag())
    yield gauge("kvcm_sidecar_zmq_held_blocks", src.counts.held())
    yield gauge("kvcm_sidecar_zmq_checkpoint_age_seconds", src.checkpoint_age_s())
    yield _by("kvcm_sidecar_zmq_checkpoint_errors", "reason", src.ckpt_errors)
    yield gauge("kvcm_sidecar_zmq_health_failures", src.health_failures)
    yield _by(
        "kvcm_sidecar_zmq_connections",
        "event",
        {e: src.zmtp_events[e] for e in ("connected", "lost", "connect_failed")},
    )
    check = GaugeMetricFamily(
        "kvcm_sidecar_key_check", METRICS["kvcm_sidecar_key_check"][1], labels=["scheme"]
    )
    for scheme, ok in src.key_check.status().items():
        if scheme in CHECK_SCHEMES and ok is not None:  # absent until a block was checked
            check.add_metric([scheme], ok)
    yield check
    r = src.rekey
    unkeyed = dict.fromkeys(REASONS, 0) if r is None else {x: r.unkeyed[x] for x in REASONS}
    yield _by("kvcm_sidecar_blocks_unkeyed", "reason", unkeyed)
    yield gauge("kvcm_sidecar_key_table_entries", 0 if r is None else r.table.n)
    yield counter("kvcm_sidecar_key_table_evictions", 0 if r is None else r.table.evictions)
