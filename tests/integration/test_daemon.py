"""The daemon end to end: real engine process, real sidecar process, KVCM server on loopback.

Every test ends with the oracle: KVCM's visible set for the reporter == the engine's published
set (which also means nothing the engine removed is visible).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from pathlib import Path

import pytest

from tests.integration.harness import Harness

pytestmark = pytest.mark.slow


async def test_daemon_steady_state_converges(h: Harness) -> None:
    await h.start_converged(300)
    h.engine_cmd(op="work", n=300)
    await h.converge()
    assert len(h.published) > 50
    status = await h.status()
    assert status["state"] == "READY" and status["published"] == len(h.published)


def _block_doorbell(ring: str) -> Path:
    blocker = Path("/dev/shm/sem." + ring.lstrip("/") + ".bell")
    blocker.mkdir()  # sem_open cannot create or open a semaphore there
    return blocker


async def test_daemon_without_a_doorbell_polls_and_converges(h: Harness) -> None:
    """A doorbell that cannot be opened is only an optimisation lost: the sidecar polls."""
    blocker = _block_doorbell(h.ring)
    try:
        h.start_engine()
        side = h.start_sidecar()
        h.engine_cmd(op="work", n=300)
        await h.converge()
        assert len(h.published) > 50
        assert "doorbell unavailable" in "".join(side.log)  # the path this test is about
    finally:
        os.rmdir(blocker)


def _metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# The fault matrix runs on both snapshot paths: the BlockCache's provider, and the hook's own
# resident set for an engine that only calls stored()/removed()/cleared() (issue #11).
SNAPSHOT_PATHS = pytest.mark.parametrize("engine_mode", ["cache", "plain"])


@SNAPSHOT_PATHS
async def test_daemon_ring_overflow_resyncs_and_converges(tmp_path: Path, engine_mode: str) -> None:
    h = Harness(tmp_path, capacity=256)
    h.engine_mode = engine_mode
    await h.start_server()
    try:
        h.start_engine(blocks=8192)
        h.start_sidecar()
        h.engine_cmd(op="work", n=50)
        await h.converge()
        out = h.engine_cmd(op="flood", n=3000)  # >= 10x the ring in one flush
        assert out["stats"]["dropped"] >= 10 * 256
        await h.converge()
        m = await h.metrics()
        assert _metric(m, "kvcm_sidecar_resyncs_total", 'reason="dropped"') >= 1
        assert _metric(m, "kvcm_sidecar_ring_dropped_records_total") >= 10 * 256
    finally:
        await h.close()


@SNAPSHOT_PATHS
async def test_daemon_sidecar_sigkill_and_restart_converges(h: Harness, engine_mode: str) -> None:
    h.engine_mode = engine_mode
    side = await h.start_converged(200)
    side.kill()
    h.engine_cmd(op="work", n=300)  # changes while no sidecar runs, incl. evictions
    out = h.engine_cmd(op="flood", n=2 * h.capacity)  # and the ring overflows meanwhile
    assert out["stats"]["dropped"] > 0
    h.start_sidecar()
    await h.converge()


@SNAPSHOT_PATHS
async def test_daemon_engine_sigkill_hides_keys_then_new_engine_converges(
    h: Harness, engine_mode: str
) -> None:
    import time

    h.engine_mode = engine_mode
    await h.start_converged(200)
    assert h.engine is not None
    h.engine.kill()
    t0 = time.monotonic()
    h.published = set()
    await h.converge(within_s=2.0)  # the reporter's keys disappear within 2 s
    assert time.monotonic() - t0 < 2.0
    h.start_engine()  # a new incarnation on the same ring
    h.engine_cmd(op="work", n=200)
    await h.converge()


async def test_daemon_kvcm_503_for_a_while_converges(h: Harness) -> None:
    await h.start_converged(100)
    await h.faults(routes={"reportEvent": {"status": 503, "count": 15}})
    h.engine_cmd(op="work", n=200)
    await h.converge()
    m = await h.metrics()
    assert _metric(m, "kvcm_sidecar_requests_total", 'outcome="retry"') >= 1


async def test_daemon_request_timeouts_converge(h: Harness) -> None:
    """A timed-out delta is still applied by the server after its retry (a straggler carrying
    older state); the sidecar treats the outcome as unknown and re-snapshots."""
    await h.start_converged(100)
    await h.faults(routes={"reportEvent": {"delay_ms": 800, "count": 4}})
    h.engine_cmd(op="work", n=200)
    await h.converge()
    m = await h.metrics()
    assert _metric(m, "kvcm_sidecar_ambiguous_deltas_total") >= 1


async def test_daemon_kvcm_restart_converges(h: Harness) -> None:
    await h.start_converged(200)
    await h.restart_server()  # reporter state lost, blocks persisted
    h.engine_cmd(op="work", n=200)
    await h.converge()
    await h.reporter_until(lambda r: r["strict"])  # a fresh authoritative snapshot committed
    await h.converge()


async def test_daemon_partial_item_failures_retry_only_failed(h: Harness) -> None:
    await h.start_converged(50)
    await h.faults(fail_items=25)
    h.engine_cmd(op="work", n=200)
    await h.converge()


async def test_daemon_snapshot_rate_limited_still_converges(tmp_path: Path) -> None:
    h = Harness(tmp_path, event_report={"snapshot_min_interval_ms": 60_000})
    await h.start_server()
    try:
        h.start_engine()
        side = h.start_sidecar()
        h.engine_cmd(op="work", n=100)
        await h.converge()
        side.kill()  # a restarted sidecar re-registers (resets the limit) and snapshots again;
        h.start_sidecar()  # KVCM restart below keeps the limit, so the next one is limited
        await h.converge()
        h.engine_cmd(op="flood", n=0)
        await h.restart_server()
        h.engine_cmd(op="work", n=100)
        await h.converge()
    finally:
        await h.close()


async def test_daemon_heartbeats_keep_cadence_while_snapshot_stalls(h: Harness) -> None:
    await h.start_converged(50)
    await h.faults(commit_delay_ms=5000)
    await h.restart_server()  # forces a new snapshot, which now stalls 5 s
    await h.faults(commit_delay_ms=5000)
    import asyncio

    await asyncio.sleep(0)  # nothing to wait for yet: the check below is bounded by the stall
    t_end = asyncio.get_running_loop().time() + 6
    while asyncio.get_running_loop().time() < t_end:
        r = await h.reporter()
        if r and len(r["heartbeat_times"]) >= 25:
            break
        await asyncio.sleep(0.1)
    r = await h.reporter()
    assert r is not None
    times = r["heartbeat_times"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) >= 20 and max(gaps) <= 2 * 0.2 + 0.05, gaps
    await h.converge()


async def test_daemon_sigterm_sends_host_down_and_exits_0(h: Harness) -> None:
    import time

    side = await h.start_converged(100)
    t0 = time.monotonic()
    side.terminate()
    # waited in a thread: the in-process KVCM must go on answering (HOST_DOWN)
    assert await asyncio.to_thread(side.p.wait, 10) == 0
    assert time.monotonic() - t0 < 5.0  # within shutdown.grace_s
    r = await h.reporter()
    tail = side.log[-12:]  # what the sidecar said of its shutdown, should this fail
    assert r is not None and r["liveness"] == "tombstoned" and r["visible_keys"] == [], tail


async def test_daemon_sigterm_right_after_failed_request_still_host_down(h: Harness) -> None:
    side = await h.start_converged(50)
    await h.faults(fail_items=10_000)  # every delta item fails; heartbeats and HOST_DOWN pass
    h.engine_cmd(op="work", n=100)
    side.wait_line("delta failed")
    side.terminate()
    # waited in a thread: the in-process KVCM must go on answering (HOST_DOWN)
    assert await asyncio.to_thread(side.p.wait, 10) == 0
    r = await h.reporter_until(lambda r: r["liveness"] == "tombstoned")
    assert r["visible_keys"] == []


async def test_daemon_second_sidecar_for_same_identity_refused(h: Harness) -> None:
    h.start_engine()
    h.start_sidecar()
    from tests.integration.harness import SidecarProc

    second = SidecarProc(h.sidecar_env(), h.settings)
    try:
        assert second.p.wait(timeout=20) == 3
        assert any("another kvcm-sidecar already reports" in line for line in second.log) or any(
            "another process already reads ring" in line for line in second.log
        )
    finally:
        second.close()


# ---- the rest of the end-to-end fault matrix ----------------------------------------------
async def test_daemon_refuses_corrupt_ring_engine_unaffected(h: Harness) -> None:
    from sidecar.shm_ring import layout as L
    from sidecar.shm_ring.segment import Segment

    h.start_engine()
    h.engine_cmd(op="work", n=20)
    seg = Segment(h.ring)
    seg.hdr[L.W_VERSION_SLOT] = (L.LAYOUT_VERSION + 1) | (L.SLOT_SIZE << 32)
    try:
        from tests.integration.harness import SidecarProc

        side = SidecarProc(h.sidecar_env(), h.settings)
        assert side.p.wait(timeout=20) == 4
        assert any("upgrade the sidecar" in line for line in side.log)
        side.close()
        seg.hdr[L.W_VERSION_SLOT] = 0  # now garbage: bad version and slot size
        seg.hdr[L.W_MAGIC] = 0xDEAD
        out = h.engine_cmd(op="work", n=50)  # the engine keeps serving, never raises
        assert out["published"]
    finally:
        seg.close()


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        '{"header":' + '{"a":' * 80 + "1" + "}" * 81,
        '{"header":{"status":{"code":"OK"}},"extra_info":"' + "x" * (2 << 20) + '"}',
    ],
    ids=["malformed", "deep", "oversized"],
)
async def test_daemon_kvcm_bad_bodies_retry_and_converge(h: Harness, body: str) -> None:
    await h.start_converged(50)
    await h.faults(routes={"reportEvent": {"body": body, "count": 4}})
    h.engine_cmd(op="work", n=100)
    await h.converge()
    m = await h.metrics()
    assert _metric(m, "kvcm_sidecar_requests_total", 'outcome="retry"') >= 1


async def test_daemon_kvcm_unreachable_at_start_then_converges(h: Harness) -> None:
    await h.stop_server()  # the port is known and now closed
    h.start_engine()
    side = h.start_sidecar()
    h.engine_cmd(op="work", n=100)
    side.wait_line("register failed")
    await h.start_server()  # same port
    await h.converge()


async def test_daemon_engine_restart_while_kvcm_down_converges(h: Harness) -> None:
    await h.start_converged(100)
    await h.stop_server()
    assert h.engine is not None
    h.engine.kill()
    h.start_engine()  # new incarnation while KVCM is unreachable
    h.engine_cmd(op="work", n=100)
    await h.start_server()
    await h.converge()


async def test_daemon_sigterm_during_snapshot_exits_0_and_hides_keys(h: Harness) -> None:
    side = await h.start_converged(100)
    await h.restart_server()  # the reporter is new to KVCM: the sidecar resnapshots ...
    await h.faults(commit_delay_ms=3000)  # ... and that snapshot now stalls
    async with asyncio.timeout(10):
        await h.server.report.snapshot_started.wait()
    side.terminate()
    # waited in a thread: the in-process KVCM must go on answering (HOST_DOWN)
    assert await asyncio.to_thread(side.p.wait, 10) == 0
    r = await h.reporter_until(lambda r: r["liveness"] == "tombstoned")
    assert r["visible_keys"] == []


async def test_daemon_started_before_engine_waits_then_converges(h: Harness) -> None:
    # The sidecar creates the ring (same capacity as the engine asks for: a mismatch is refused).
    side = h.start_sidecar(**{"ring.capacity_slots": str(h.capacity)})
    status = await h.status()
    assert status["state"] == "STARTING" and status["registered"] is False
    h.start_engine()  # the engine attaches to the sidecar's segment
    h.engine_cmd(op="work", n=100)
    await h.converge()
    assert (await h.status())["state"] == "READY"
    assert side.p.poll() is None


async def test_e2e_ring_mediums_kvcm_holds_each_key_per_medium(h: Harness) -> None:
    """The ring carries each record's medium index; KVCM's (key, medium) pairs == the engine's,
    also after the sidecar restarts and resyncs from the engine's snapshot (medium column)."""
    from sidecar.testbed.proc import EngineProc

    async def pairs() -> set[tuple[int, str]]:
        r = await h.reporter()
        return {(int(k), m) for k, m in r["visible"]} if r else set()

    async def converge(want: set[tuple[int, str]]) -> None:
        deadline = time.monotonic() + 20
        while (seen := await pairs()) != want:
            tail = "".join(h.sidecar.log[-20:]) if h.sidecar else ""
            assert time.monotonic() < deadline, (len(want - seen), len(seen - want), tail)
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    eng = EngineProc("tiers", {"ring": h.ring, "instance_id": h.instance_id, "seed": 3})
    try:
        eng.recv()
        side = h.start_sidecar()
        eng.send(json.dumps({"op": "work", "n": 3000}))
        held = {(k, m) for k, m in eng.recv()["held"]}
        assert {m for _, m in held} == {"hbm", "mem", "disk"}
        await converge(held)
        side.kill()  # the restarted sidecar resyncs from the hook's resident set
        eng.send(json.dumps({"op": "work", "n": 500}))
        held = {(k, m) for k, m in eng.recv()["held"]}
        h.start_sidecar()
        await converge(held)
        r = await h.reporter()
        assert r is not None and set(r["mediums"]) >= {"hbm", "mem", "disk"}
    finally:
        eng.close()


async def test_daemon_straggling_delta_is_corrected_by_a_snapshot(tmp_path: Path) -> None:
    """KVCM applies a timed-out DELETE after its retry and after the key was stored again (an
    older state landing last). The sidecar counted the delta as ambiguous, and its reconciling
    snapshot, sent after report.ambiguous_snapshot_delay_s, restores the key."""
    h = Harness(tmp_path, settings={"report.ambiguous_snapshot_delay_s": "2.5"})
    h.engine_mode = "plain"
    await h.start_server()
    try:
        h.start_engine()
        h.start_sidecar()
        h.engine_cmd(op="store", keys=[1, 2, 3])
        await h.converge()
        before = (await h.reporter_until(lambda r: r["snapshot_commits"] >= 1))["snapshot_commits"]
        # The next DELETE is held 1.5 s: the sidecar (request timeout 0.5 s) retries it first.
        hold = {"event": "EVENT_BLOCK_DELETE", "count": 1, "delay_ms": 1500}
        await h.faults(routes={"reportEvent": hold})
        h.engine_cmd(op="remove", keys=[2])
        await h.converge()  # the retry took effect
        h.engine_cmd(op="store", keys=[2])
        await h.converge()  # 2 is back in KVCM ... until the held DELETE lands
        await h.reporter_until(lambda r: r["snapshot_commits"] > before, within_s=15)
        await h.converge()
        assert await h.visible() == {1, 2, 3}
        m = await h.metrics()
        assert _metric(m, "kvcm_sidecar_ambiguous_deltas_total") >= 1
    finally:
        await h.close()


async def test_daemon_keys_removed_while_a_big_first_snapshot_is_in_flight_are_deleted(
    h: Harness,
) -> None:
    """Issue #24 §1 end to end: an engine holds 40 000 keys when its sidecar starts, KVCM holds
    the first snapshot, and the engine removes 2 % meanwhile. Before the fix the commit re-indexed
    the key table and acked nothing: every key was sent again as an ADD and the removed ones
    stayed in KVCM until the periodic snapshot (300 s)."""
    h.engine_mode = "plain"
    h.capacity = 1 << 17
    h.start_engine()
    keys = list(range(1, 40_001))
    h.engine_cmd(op="store", keys=keys)
    hold = {"event": "EVENT_BLOCK_SNAPSHOT", "count": 1, "delay_ms": 1500}
    await h.faults(routes={"reportEvent": hold})
    h.server.faults.taken.clear()
    h.start_sidecar()
    async with asyncio.timeout(20):
        await h.server.faults.taken.wait()  # the snapshot is held by KVCM now
    h.engine_cmd(op="remove", keys=keys[::50])  # 800 keys, 2 %
    await h.faults(clear=True)
    await h.converge(within_s=20)  # far below the periodic snapshot: the deltas did it
    st = await h.status()
    assert st["published"] == 39_200 and st["acked"] == 39_200 and st["dirty"] == 0
