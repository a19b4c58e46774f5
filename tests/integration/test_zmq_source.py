"""End to end, ZMQ source: the zmq publisher process (vLLM / SGLang wire) -> real `kvcm-sidecar
run --set source.kind=zmq` -> the KVCM-compatible server. Oracle: at quiet, KVCM's visible
(key, medium) pairs == the publisher's truth (store count > 0 per key and medium), key for key;
after a forget, KVCM holds nothing the engine dropped and everything stored since.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.testbed.zmq_publisher import PublisherProcess
from tests.integration.harness import Harness, SidecarProc

# engine medium -> KVCM medium (the default medium map)
KVCM_MEDIUM = {
    "GPU": "hbm",
    "CPU": "mem",
    "CPU_PINNED": "mem",
    "STORAGE": "disk",
    "DISK": "disk",
    "EXTERNAL": "remote",
}
ZMQ_SETTINGS = {
    "source.kind": "zmq",
    "source.zmq.bind": "false",
    "source.zmq.replay_timeout_s": "2",
    "source.zmq.checkpoint_interval_s": "0.2",
    "source.zmq.health_interval_s": "0.05",
    "source.zmq.health_fail_after": "3",
}


class ZmqHarness:
    def __init__(self, h: Harness, tmp: Path, transport: str = "libzmq") -> None:
        self.h = h
        self.state_dir = tmp / "state"
        self.pub: PublisherProcess | None = None
        self.settings = {**ZMQ_SETTINGS, "source.zmq.transport": transport}

    def start_engine(self, **cfg: Any) -> PublisherProcess:
        self.pub = PublisherProcess(**cfg)
        return self.pub

    def start_sidecar(self, wait: bool = True, **settings: Any) -> SidecarProc:
        """`wait`: until the engine sees the subscription (not with the engine stopped)."""
        assert self.pub is not None
        r = self.pub.ready
        extra = {
            **self.settings,
            "source.zmq.endpoint": r["pub"],
            "source.state_dir": str(self.state_dir),
        }
        if r.get("replay"):
            extra["source.zmq.replay_endpoint"] = r["replay"]
        if r.get("health"):
            extra["source.zmq.health_url"] = r["health"]
        side = self.h.start_sidecar(**{**extra, **settings})
        if wait:
            self.pub.call("wait_subscribers", n=1)
        return side

    def truth(self) -> set[tuple[int, str]]:
        assert self.pub is not None
        return {(k, KVCM_MEDIUM[m]) for k, m in self.pub.truth(group=0)}

    async def visible(self) -> set[tuple[int, str]]:
        r = await self.h.reporter()
        return {(int(k), m) for k, m in r["visible"]} if r else set()

    async def converge(self, within_s: float = 20.0) -> set[tuple[int, str]]:
        """Wait (bounded) until KVCM shows exactly the publisher's truth."""
        want = self.truth()
        deadline = time.monotonic() + within_s
        while True:
            seen = await self.visible()
            if seen == want:
                return seen
            if time.monotonic() > deadline:
                tail = "".join(self.h.sidecar.log[-20:]) if self.h.sidecar else ""
                raise AssertionError(
                    f"no convergence: missing={len(want - seen)} extra={len(seen - want)}\n{tail}"
                )
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    async def settle(self, pred: Any, within_s: float = 20.0) -> dict[str, Any]:
        """Wait (bounded) until the sidecar's /status satisfies `pred`."""
        deadline = time.monotonic() + within_s
        while True:
            st = await self.h.status()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"status never matched: {json.dumps(st)}"
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    async def rebuilt(self, later: set[tuple[int, str]], within_s: float = 20.0) -> set[Any]:
        """After a forget: wait (bounded) until `later` (stored since) is visible; then KVCM
        must hold nothing the engine does not (the forget dropped what it could not vouch for)."""
        deadline = time.monotonic() + within_s
        while not later <= (seen := await self.visible()):
            assert time.monotonic() < deadline, f"stored-after-forget keys never arrived: {seen}"
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline
        assert seen <= self.truth()
        return seen

    async def health_outage(self) -> PublisherProcess:
        """An engine with a health endpoint, converged, whose health then fails: ENGINE_DOWN."""
        pub = self.start_engine(health=True)
        self.start_sidecar()
        self.workload(500)
        await self.converge()
        pub.call("health", ok=False)
        await self.settle(lambda s: s["state"] == "ENGINE_DOWN")
        return pub

    def workload(self, events: int = 2000, **kw: Any) -> None:
        assert self.pub is not None
        kw.setdefault("mediums", ["GPU", "CPU"])
        self.pub.call("workload", events=events, wait=True, dup_prob=0.3, **kw)

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()


@pytest.fixture
async def z(h: Harness, tmp_path: Path) -> AsyncIterator[ZmqHarness]:
    zh = ZmqHarness(h, tmp_path)
    yield zh
    zh.close()


def _forgets(st: dict[str, Any]) -> dict[str, int]:
    return dict(st.get("zmq_forgets", {}))


@pytest.mark.parametrize(
    ("flavour", "encoding", "hash_kind", "mediums"),
    [
        ("vllm", "map", "int", ["GPU", "CPU"]),
        ("vllm", "positional", "bytes", ["GPU", "STORAGE"]),
        ("sglang", "positional", "int", ["GPU", "CPU_PINNED", "DISK"]),
        ("vllm", "positional_v0", "int", ["GPU"]),
    ],
)
async def test_zmq_source_steady_state_with_duplicates_matches_truth(
    z: ZmqHarness, flavour: str, encoding: str, hash_kind: str, mediums: list[str]
) -> None:
    z.start_engine(flavour=flavour, encoding=encoding, hash_kind=hash_kind)
    z.start_sidecar()
    z.workload(3000, mediums=mediums)
    seen = await z.converge()
    assert {m for _, m in seen} == {KVCM_MEDIUM[m] for m in mediums}
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st) == {}


async def test_zmq_source_covered_gap_is_replayed_without_a_forget(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(1000)
    await z.converge()
    pub.call("gap", batches=5)  # dropped on the PUB socket, kept in the replay buffer
    z.workload(1000, seed=2)
    await z.converge()
    st = await z.settle(lambda s: s["zmq_gaps"] >= 1 and s["zmq_replays"].get("covered", 0) >= 2)
    assert _forgets(st) == {}


async def test_zmq_source_uncovered_gap_forgets_and_rebuilds(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    first = pub.call("store", n=20, medium="GPU", step=True)
    await z.converge()
    pub.call("gap", batches=1, evict=True)  # the removal never arrives and is not replayable
    pub.call("remove", hashes=first["hashes"][:10], medium="GPU", step=True)
    later = pub.call("store", n=5, medium="CPU", step=True)["keys"]
    st = await z.settle(lambda s: _forgets(s).get("replay_uncovered", 0) >= 1)
    seen = await z.rebuilt({(k, "mem") for k in later})  # nothing the engine dropped stays
    assert not {(k, "hbm") for k in first["keys"][:10]} & seen
    assert st["zmq_gaps"] >= 1


async def test_zmq_source_engine_restart_with_seq_reset_forgets(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(1000)
    await z.converge()
    pub.call("restart")  # seq back to 0, empty cache, empty replay buffer
    z.workload(500, seed=3)
    await z.converge()
    # The forget's snapshot may come within the stand-in's snapshot_min_interval_ms of the
    # first one: rate limited (DEGRADED), it is sent again after retry_after. It ends READY.
    await z.settle(lambda s: _forgets(s).get("engine_restart", 0) >= 1 and s["state"] == "READY")


async def test_zmq_source_all_blocks_cleared_forgets(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(1000)
    await z.converge()
    pub.call("clear", step=True)
    pub.call("store", n=7, medium="CPU", step=True)
    seen = await z.converge()
    assert len(seen) == 7
    await z.settle(lambda s: _forgets(s).get("all_blocks_cleared", 0) >= 1)


async def test_zmq_source_dp_rank_and_block_size_mismatches_are_dropped(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    pub.call("store", n=5, medium="GPU", step=False)
    pub.call("step", dp_rank=3)  # another rank's batch on our socket: none of it is ours
    pub.call("store", n=4, medium="GPU", block_size=32, step=True)  # not our block size
    pub.call("store", n=3, medium="GPU", step=True)
    seen = await z.converge()
    assert len(seen) == 3
    st = await z.settle(lambda s: s["zmq_drops"].get("block_size", 0) >= 1)
    assert _forgets(st) == {}
    text = await z.h.metrics()
    assert 'kvcm_sidecar_zmq_batches_total{outcome="dp_rank"} 1.0' in text


async def test_zmq_source_malformed_frames_and_payloads_never_stop_it(z: ZmqHarness) -> None:
    pub = z.start_engine(flavour="vllm", encoding="positional")
    z.start_sidecar()
    z.workload(500)
    for n, kind in enumerate(("frame_count", "seq_bytes", "not_msgpack", "shape", "unknown_event")):
        pub.call("malformed", kind=kind)  # payload kinds: replay gives a good copy
        z.workload(100, seed=n)
        await z.converge()
    st = await z.settle(
        lambda s: (
            s["zmq_decode_errors"].get("frame_shape", 0) == 2
            and s["zmq_decode_errors"].get("not_msgpack", 0) == 2
            and s["zmq_drops"].get("unknown_event", 0) == 1
        )
    )
    assert _forgets(st) == {}  # every damaged batch was fetched again
    pub.call("malformed", kind="field_types", replay_as="same")  # damaged in the buffer too
    later = pub.call("store", n=4, medium="CPU", step=True)["keys"]
    await z.settle(lambda s: _forgets(s).get("malformed_replay", 0) >= 1)
    await z.rebuilt({(k, "mem") for k in later})  # the lost batch's changes: forgotten
    assert z.h.sidecar is not None and z.h.sidecar.p.poll() is None


@pytest.mark.parametrize("checkpoint", [True, False])
async def test_zmq_source_sidecar_sigkill_restart_replays_without_forgetting(
    z: ZmqHarness, checkpoint: bool
) -> None:
    """With a checkpoint: replay from its seq proves continuity; without: replay from 0."""
    z.start_engine()
    side = z.start_sidecar()
    z.workload(1500)
    await z.converge()
    if checkpoint:
        await z.settle(lambda s: 0 <= s["checkpoint_age_s"] < 1 and s["last_seq"] > 0)
    side.kill()  # SIGKILL: no shutdown checkpoint, no HOST_DOWN
    if not checkpoint:
        for f in z.state_dir.glob("*"):
            f.unlink()
    z.workload(700, seed=4)  # the engine goes on while the sidecar is down
    z.start_sidecar()
    await z.converge()
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st) == {}
    assert st["zmq_replays"].get("covered", 0) >= 1


async def test_zmq_source_engine_restarted_while_sidecar_down_is_caught(z: ZmqHarness) -> None:
    """The checkpoint's seq exists in the new life too: its digest differs, so forget."""
    pub = z.start_engine()
    side = z.start_sidecar()
    z.workload(600)
    await z.converge()
    await z.settle(lambda s: 0 <= s["checkpoint_age_s"] < 1 and s["last_seq"] > 0)
    last = (await z.h.status())["last_seq"]
    side.kill()
    pub.call("restart")
    while pub.call("stats")["next_seq"] <= last + 3:  # the new life passes the checkpoint seq
        z.workload(200, seed=pub.call("stats")["next_seq"])
    z.start_sidecar()
    await z.converge()  # the whole new life was still in the buffer: exact again
    st = await z.settle(lambda s: _forgets(s).get("checkpoint_unproven", 0) >= 1)
    assert st["zmq_replays"].get("restart", 0) >= 1


async def test_zmq_source_health_failing_is_engine_down_then_recovers(z: ZmqHarness) -> None:
    pub = await z.health_outage()
    await z.h.reporter_until(lambda r: not r["visible"])  # HOST_DOWN: KVCM hides our keys
    pub.call("health", ok=True)
    z.workload(200, seed=5)
    await z.converge()
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st) == {}  # the same engine life: the replay proved it


async def test_zmq_source_without_replay_endpoint_forgets_on_a_gap(z: ZmqHarness) -> None:
    pub = z.start_engine(replay_endpoint=None)
    z.start_sidecar()
    first = pub.call("store", n=10, medium="GPU", step=True)
    await z.converge()
    pub.call("gap", batches=1)
    pub.call("remove", hashes=first["hashes"], medium="GPU", step=True)
    pub.call("store", n=3, medium="GPU", step=True)
    await z.converge()
    st = await z.settle(lambda s: _forgets(s).get("no_replay_endpoint", 0) >= 1)
    assert st["zmq_gaps"] >= 1


async def test_zmq_source_metrics_every_documented_metric_exported(z: ZmqHarness) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from sidecar.metrics.registry import METRICS, RING_ONLY

    z.start_engine()
    z.start_sidecar()
    z.workload(300)
    await z.converge()
    families = {f.name: f.type for f in text_string_to_metric_families(await z.h.metrics())}
    for name, (kind, _help) in METRICS.items():
        if name not in RING_ONLY:
            assert families.get(name) == kind, (name, families.get(name))
    text = await z.h.metrics()
    assert 'kvcm_sidecar_zmq_events_total{medium="mem",type="BlockStored"}' in text


async def test_zmq_source_engine_restarted_during_health_outage_is_a_new_life(
    z: ZmqHarness,
) -> None:
    pub = await z.health_outage()
    pub.call("restart")  # the engine came back as a new process: empty cache, seq from 0
    z.workload(300, seed=6)
    pub.call("health", ok=True)
    await z.converge()  # exactly the new life: nothing of the old one stays in KVCM
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st).get("engine_restart", 0) >= 1


async def test_zmq_source_endpoint_conflict_exits_1_naming_the_endpoint(z: ZmqHarness) -> None:
    z.start_engine()  # the engine binds its PUB endpoint
    assert z.pub is not None
    settings = {
        **ZMQ_SETTINGS,
        "source.zmq.endpoint": z.pub.ready["pub"],
        "source.zmq.bind": "true",  # wrong: both sides bind
        "source.state_dir": str(z.state_dir),
    }
    side = z.h.start_sidecar(**settings)
    line = side.wait_line("cannot bind")
    assert z.pub.ready["pub"] in line and "source.zmq.bind" in line
    assert side.p.wait(timeout=20) == 1


async def test_zmq_source_sidecar_started_before_its_engine_forgets_nothing(
    z: ZmqHarness,
) -> None:
    """As a Kubernetes native sidecar starts: before the engine binds its ports."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(sk.getsockname()[1])
    pub_ep, rep_ep = (f"tcp://127.0.0.1:{p}" for p in ports)
    z.h.start_sidecar(
        **{
            **z.settings,
            "source.zmq.endpoint": pub_ep,
            "source.zmq.replay_endpoint": rep_ep,
            "source.zmq.replay_timeout_s": "0.3",
            "source.state_dir": str(z.state_dir),
        }
    )
    await z.settle(lambda s: s["zmq_replays"].get("timeout", 0) >= 1)  # nobody answered
    pub = z.start_engine(endpoint=pub_ep, replay_endpoint=rep_ep, bind=True)
    pub.call("wait_subscribers", n=1)
    z.workload(800)
    await z.converge()
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st) == {}


WINDOW: dict[
    str, Any
] = {  # issue #24 §2: a window of 16 384 live keys, 8 stored and 8 removed per batch
    "events": 0,
    "rate": 20_000,
    "batch_events": 16,
    "blocks_per_event": 1,
    "max_held": 16_384,
    "remove_prob": 0.0,  # stores until the window is full, then a remove for every store
    "dup_prob": 0.0,
    "mediums": ["GPU"],
}


async def _paused_engine_while_the_sidecar_restarts(z: ZmqHarness, **settings: Any) -> Any:
    """The engine is SIGSTOPped with a full window; the sidecar is SIGKILLed and restarted
    while it stays stopped, so the replay from the checkpoint goes unanswered."""
    pub = z.start_engine()
    side = z.start_sidecar(**settings)
    pub.call("workload", **WINDOW)
    await z.settle(lambda s: s["zmq_held_blocks"] >= 16_000 and 0 <= s["checkpoint_age_s"] < 1)
    os.kill(pub.p.pid, signal.SIGSTOP)
    side.kill()
    z.start_sidecar(wait=False, **settings)
    await z.settle(lambda s: _forgets(s).get("replay_timeout", 0) >= 1)
    return pub


async def test_zmq_source_replay_timeout_while_the_engine_is_paused_is_not_final(
    z: ZmqHarness,
) -> None:
    """Issue #24 §2: the sidecar restarted from its checkpoint while the engine was stopped for
    longer than the replay timeout forgot the replica for good (14 488 of 16 384 keys missing
    from KVCM for as long as the engine kept them). The forget is undone once the engine is
    back: its buffer still holds the life since the checkpoint."""
    pub = await _paused_engine_while_the_sidecar_restarts(z)
    os.kill(pub.p.pid, signal.SIGCONT)
    pub.call("stop")  # the engine goes on a little, then stops publishing: its truth is final
    await z.converge()
    st = await z.settle(lambda s: s["state"] == "READY" and not s["zmq_recovery"]["pending"])
    assert _forgets(st) == {"replay_timeout": 1} and st["zmq_replays"]["recovered"] == 1


async def test_zmq_source_engine_stopped_past_the_whole_retry_budget_still_converges(
    z: ZmqHarness,
) -> None:
    budget = {"source.zmq.replay_retries": "2", "source.zmq.replay_retry_cap_s": "0.5"}
    pub = await _paused_engine_while_the_sidecar_restarts(z, **budget)
    await z.settle(  # the timed attempts' budget spent, the engine still stopped
        lambda s: (
            s.get("zmq_recovery", {}).get("attempts", 0) >= 3 and not s["zmq_recovery"]["in_flight"]
        ),
        within_s=30,
    )
    os.kill(pub.p.pid, signal.SIGCONT)
    pub.call("stop")  # it may stay idle now: the stream, or a slow timed attempt, finds it
    await z.converge()
    st = await z.settle(lambda s: not s["zmq_recovery"]["pending"])
    assert st["zmq_replays"]["recovery_retry"] >= 3 and st["zmq_replays"]["recovered"] == 1


async def test_zmq_source_batches_lost_at_the_end_of_a_burst_reach_kvcm(z: ZmqHarness) -> None:
    """Found by the chaos run (seed 2007, a cut PUB link): the last batches of a burst were
    lost on the way and no later batch revealed the gap while the engine idled."""
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(500)
    await z.converge()
    pub.call("gap", batches=2)  # the next two batches never reach the SUB socket
    pub.call("store", n=3, medium="GPU", step=True)
    pub.call("store", n=2, medium="CPU", step=True)
    await z.converge()  # and nothing after them: only the tail check can find them
    st = await z.settle(lambda s: s["zmq_replays"].get("tail_check", 0) >= 1)
    assert _forgets(st) == {}


async def test_zmq_source_a_quiet_engine_restart_whose_first_batches_were_lost_is_caught(
    z: ZmqHarness,
) -> None:
    """Found by the chaos run (seed 3101): the engine restarted right after a burst, and its
    first batches were lost while the SUB reconnected; nothing later revealed the new life."""
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(300)
    pub.call("store", n=4, medium="GPU", step=True)  # seen live: the tail check is due
    pub.call("restart")  # a new life, seq from 0 ...
    pub.call("gap", batches=2)  # ... whose first two batches never reach the SUB
    pub.call("store", n=3, medium="GPU", step=True)
    pub.call("store", n=2, medium="CPU", step=True)
    await z.converge()  # exactly the new life's five blocks
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st).get("engine_restart", 0) >= 1


@pytest.fixture
async def zt(h: Harness, tmp_path: Path) -> AsyncIterator[ZmqHarness]:
    zh = ZmqHarness(h, tmp_path, transport="zmtp")
    yield zh
    zh.close()


async def _steady_vllm(z: ZmqHarness) -> None:
    await test_zmq_source_steady_state_with_duplicates_matches_truth(
        z, "vllm", "map", "int", ["GPU", "CPU"]
    )


async def _steady_sglang(z: ZmqHarness) -> None:
    await test_zmq_source_steady_state_with_duplicates_matches_truth(
        z, "sglang", "positional", "int", ["GPU", "CPU_PINNED", "DISK"]
    )


# source.zmq.transport=zmtp (sidecar/source/zmtp.py): the same outcomes over the sidecar's own
# ZMTP connection as over libzmq's SUB, for the cases its reading changes (the live stream's
# frames, gaps, a publisher gone and back, one not there yet).
ZMTP_CASES = [
    _steady_vllm,
    _steady_sglang,
    test_zmq_source_covered_gap_is_replayed_without_a_forget,
    test_zmq_source_engine_restart_with_seq_reset_forgets,
    test_zmq_source_malformed_frames_and_payloads_never_stop_it,
    test_zmq_source_sidecar_started_before_its_engine_forgets_nothing,
]


@pytest.mark.parametrize("case", ZMTP_CASES, ids=lambda f: f.__name__.removeprefix("test_"))
async def test_zmtp_transport(zt: ZmqHarness, case: Any) -> None:
    await case(zt)
    st = await zt.h.status()
    assert st["zmq_transport"] == "zmtp" and st["zmtp"]["connected"] >= 1


async def test_zmtp_transport_reconnects_to_an_engine_started_again(zt: ZmqHarness) -> None:
    """The engine's process ends (EOF on the connection) and another binds the same
    endpoints: the connection is counted lost, made again (backing off while refused), and
    KVCM ends on the new life's truth."""
    pub = zt.start_engine()
    zt.start_sidecar()
    zt.workload(500)
    await zt.converge()
    ep, rep = pub.ready["pub"], pub.ready.get("replay")
    pub.close()
    await zt.settle(lambda s: s["zmtp"].get("lost", 0) >= 1)
    await zt.settle(lambda s: s["zmtp"].get("connect_failed", 0) >= 1)  # refused meanwhile
    zt.start_engine(endpoint=ep, replay_endpoint=rep, bind=True)
    assert zt.pub is not None
    zt.pub.call("wait_subscribers", n=1)
    zt.workload(500, seed=5)
    await zt.converge()
    st = await zt.settle(lambda s: s["zmtp"]["connected"] >= 2 and s["state"] == "READY")
    assert st["zmtp"]["lost"] >= 1
    text = await zt.h.metrics()
    lost = f'kvcm_sidecar_zmq_connections_total{{event="lost"}} {float(st["zmtp"]["lost"])}'
    assert lost in text
