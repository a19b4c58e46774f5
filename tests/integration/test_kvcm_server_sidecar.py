"""The real sidecar process against the server's current reply rules (issue #12).

A fresh generation answers snapshot_required=true (the first delta after a KVCM restart, and
heartbeats until a snapshot commits); every reply then carries the generation's version even
before a snapshot committed; HOST_DOWN answers OK with snapshot_required=true, also on a
tombstone. The sidecar must turn each such answer into at most one snapshot and send HOST_DOWN
once. Counts come from the server's /debug/reporters view of the reporter.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sidecar.kvcm_server.app import KvcmServer
from tests.integration.harness import Harness

pytestmark = pytest.mark.slow

# What KVCM answers a heartbeat while the reporter has no generation.
NO_GENERATION = json.dumps(
    {
        "header": {"status": {"code": "OK", "message": ""}, "request_id": "", "tracer_result": ""},
        "extra_info": "",
        "committed_snapshot_version": "",
        "retry_after_ms": "0",
        "snapshot_required": True,
    }
)


async def test_sidecar_first_delta_after_kvcm_restart_leads_to_one_snapshot(
    tmp_path: Path,
) -> None:
    """After a KVCM restart the first event is a delta (no heartbeat is due): its reply says
    snapshot_required=true and carries a fresh version before any snapshot committed. The
    sidecar sends exactly one snapshot, then only deltas."""
    h = Harness(
        tmp_path,
        event_report={"heartbeat_timeout_ms": 600_000},
        settings={"report.heartbeat_interval_s": "300"},  # one heartbeat, at start
    )
    await h.start_server()
    try:
        await h.start_converged(100)
        await h.restart_server()  # generations lost, blocks kept
        h.engine_cmd(op="work", n=100)
        r = await h.reporter_until(lambda r: r["snapshot_commits"] >= 1)
        assert r["heartbeat_times"] == []  # the trigger was the delta's reply
        await h.converge()
        h.engine_cmd(op="work", n=100)  # more deltas: the snapshot has no successor
        await h.converge()
        r = await h.reporter_until(lambda r: True)
        assert (r["snapshot_requests"], r["snapshot_commits"]) == (1, 1)
        assert r["strict"] and len(r["stored_versions"]) >= 1
        assert (await h.status())["state"] == "READY"
        assert "malformed_response" not in await h.metrics()  # every version was 32 hex
    finally:
        await h.close()


async def test_sidecar_heartbeat_answer_older_than_a_commit_does_not_resnapshot(
    tmp_path: Path,
) -> None:
    """After a KVCM restart the first heartbeat is answered "no generation" but that answer
    arrives only after the delta it raced has led to a committed snapshot: the sidecar must
    not take it as a reason for a second snapshot."""
    h = Harness(tmp_path, settings={"manager.request_timeout_s": "5"})  # outlasts the hold
    await h.start_server()
    try:
        await h.start_converged(100)
        await h.stop_server()
        h.server = KvcmServer(
            bootstrap=True, event_report=h.event_report, state_file=tmp_path / "kvcm.json"
        )
        hold = {"event": "EVENT_HEARTBEAT", "count": 1, "delay_ms": 2000, "body": NO_GENERATION}
        h.server.faults.rules["reportEvent"] = hold
        await h.start_server()
        async with asyncio.timeout(10):
            await h.server.faults.taken.wait()  # the heartbeat is in flight, held
        h.engine_cmd(op="work", n=100)  # a delta answers snapshot_required=true: one snapshot
        r = await h.reporter_until(lambda r: r["snapshot_commits"] >= 1)
        # The held answer lands meanwhile; heartbeats go on after it.
        r = await h.reporter_until(lambda r: len(r["heartbeat_times"]) >= 5)
        await h.converge()
        r = await h.reporter_until(lambda r: True)
        assert (r["snapshot_requests"], r["snapshot_commits"]) == (1, 1)
    finally:
        await h.close()


async def test_sidecar_host_down_at_shutdown_is_sent_once(h: Harness) -> None:
    """HOST_DOWN answers OK with snapshot_required=true: that is success, not retried."""
    side = await h.start_converged(50)
    side.terminate()
    # Waited for off the loop: the server runs in this loop and must answer meanwhile.
    assert await asyncio.to_thread(side.p.wait, 10) == 0
    r = await h.reporter_until(lambda r: r["liveness"] == "tombstoned")
    assert r["host_down_requests"] == 1 and r["visible_keys"] == []
    side.wait_line("host_down sent ok=True")  # (its log, read to the end)


async def test_sidecar_host_down_after_engine_death_then_shutdown_not_retried(
    h: Harness,
) -> None:
    """The engine dies (HOST_DOWN tombstones the reporter), then the sidecar stops: its second
    HOST_DOWN lands on the tombstone, which answers OK, so it is sent once, not retried."""
    side = await h.start_converged(50)
    assert h.engine is not None
    h.engine.kill()
    await h.reporter_until(lambda r: r["liveness"] == "tombstoned")
    side.terminate()
    # Waited for off the loop: the server runs in this loop and must answer meanwhile.
    assert await asyncio.to_thread(side.p.wait, 10) == 0
    r = await h.reporter_until(lambda r: True)
    assert r["host_down_requests"] == 2 and r["visible_keys"] == []
    side.wait_line("host_down sent ok=True")  # (its log, read to the end)
