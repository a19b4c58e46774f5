"""A C engine (kvcm_ring.h) under the real sidecar and the KVCM-compatible server, end to end.

The engine is sidecar/testbed/c/kvcm_test_engine.c in `cache` mode, compiled with the system
compiler and run as a separate process; its snapshot callback enumerates its own table. Each test
ends with the oracle: KVCM's visible keys for the reporter == the keys the C engine holds in every
required group. Both ways of running the chores are covered: the helper thread and poll().
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from queue import Queue
from typing import Any

import pytest

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.segment import Segment
from sidecar.testbed.proc import EngineProc
from tests import cbuild
from tests.integration.harness import Harness
from tests.integration.test_daemon import _metric

pytestmark = pytest.mark.slow


class CEngineProc(EngineProc):
    """sidecar/testbed/c/kvcm_test_engine.c as the engine process (EngineProc's line protocol)."""

    def __init__(self, binary: Path, argv: list[str]) -> None:
        self.p = subprocess.Popen(
            [str(binary), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._lines: Queue[str] = Queue()
        threading.Thread(target=self._pump, daemon=True).start()


class CHarness(Harness):
    threaded = True

    def start_engine(self, blocks: int = 256) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.close()
        binary = cbuild.build("kvcm_test_engine.c")
        argv = ["cache", self.ring, self.instance_id, str(self.capacity), str(self.seed)]
        self.engine = CEngineProc(binary, [*argv, "1" if self.threaded else "0"])
        self.seed += 1
        ready = self.engine.recv()
        assert ready["ready"], ready
        return ready


@pytest.fixture(params=["thread", "poll"])
async def ch(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    cbuild.compiler()  # skip with the reason when there is no compiler
    # A C engine reports a 300-request burst (~30k records) faster than any reader drains a
    # 4096-slot ring: give the non-overflow tests room so that they test what they say.
    h = CHarness(tmp_path, capacity=1 << 16)
    h.threaded = request.param == "thread"
    await h.start_server()
    yield h
    await h.close()


async def test_c_producer_steady_state_converges(ch: CHarness) -> None:
    await ch.start_converged(300)
    out = ch.engine_cmd(op="work", n=300)
    await ch.converge()
    assert len(ch.published) > 50
    assert any(k < 0 for k in ch.published)  # the signed 64-bit pattern made it through
    status = await ch.status()
    assert status["state"] == "READY" and status["published"] == len(ch.published)
    assert out["stats"]["snapshots"] >= 1 and out["stats"]["dropped"] == 0


async def test_c_producer_ring_overflow_resyncs_and_converges(tmp_path: Path) -> None:
    cbuild.compiler()
    h = CHarness(tmp_path, capacity=256)
    await h.start_server()
    try:
        h.start_engine()
        h.start_sidecar()
        h.engine_cmd(op="work", n=50)
        await h.converge()
        out = h.engine_cmd(op="flood", n=3000)  # one array call per group: >= 10x the ring
        assert out["stats"]["dropped"] >= 10 * 256
        await h.converge()
        m = await h.metrics()
        assert _metric(m, "kvcm_sidecar_resyncs_total", 'reason="dropped"') >= 1
        assert _metric(m, "kvcm_sidecar_ring_dropped_records_total") >= 10 * 256
    finally:
        await h.close()


async def test_c_producer_snapshot_after_sidecar_restart_converges(ch: CHarness) -> None:
    side = await ch.start_converged(200)
    side.kill()
    before = ch.engine_cmd(op="work", n=300)  # changes while no sidecar runs, incl. evictions
    ch.start_sidecar()
    await ch.converge()
    after = ch.engine_cmd(op="truth")
    assert after["stats"]["snapshots"] > before["stats"]["snapshots"]  # the callback answered


async def test_c_producer_engine_sigkill_then_new_incarnation_converges(ch: CHarness) -> None:
    await ch.start_converged(200)
    assert ch.engine is not None
    seg = Segment(ch.ring)
    try:
        first_boot = int(seg.hdr[L.W_BOOT_ID])
        ch.engine.kill()
        ch.published = set()
        await ch.converge(within_s=5.0)  # the dead engine's keys disappear
        ready = ch.start_engine()  # a new incarnation on the same ring
        assert ready["boot_id"] == int(seg.hdr[L.W_BOOT_ID]) != first_boot
        assert int(seg.hdr[L.W_INC_START_POS]) == int(seg.hdr[L.W_TAIL])
        ch.engine_cmd(op="work", n=200)
        await ch.converge()
    finally:
        seg.close()


async def test_c_producer_close_withdraws_keys_then_reattach_converges(tmp_path: Path) -> None:
    cbuild.compiler()
    h = CHarness(tmp_path, capacity=1 << 16)
    await h.start_server()
    try:
        await h.start_converged(200)
        assert h.engine is not None
        h.engine.send('{"op":"exit"}')
        bye = h.engine.recv()
        assert bye["bye"] and bye["stats"]["closed"] == 1
        assert h.engine.wait() == 0
        h.published = set()
        side = h.sidecar
        assert side is not None
        side.wait_line("reason=closed")  # a clean close, not a timeout
        await h.converge(within_s=5.0)
        h.start_engine()
        h.engine_cmd(op="work", n=100)
        await h.converge()
    finally:
        await h.close()
