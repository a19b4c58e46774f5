"""Operations surface of a running daemon: metrics, /readyz, `kvcm-sidecar status`, docs."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import docgen
from sidecar.logs import RateLimit
from sidecar.metrics.registry import METRICS, ZMQ_ONLY
from sidecar.testbed.proc import ROOT
from tests.integration.harness import Harness

pytestmark = pytest.mark.slow


async def test_metrics_every_documented_metric_exported_with_its_type(h: Harness) -> None:
    await h.start_converged(50)
    families = {f.name: f.type for f in text_string_to_metric_families(await h.metrics())}
    for name, (kind, _help) in METRICS.items():
        if name not in ZMQ_ONLY:  # tests/integration/test_zmq_source.py checks those
            assert families.get(name) == kind, (name, families.get(name))


def test_docs_generated_tables_match_code() -> None:
    text = docgen.DOC.read_text()
    assert docgen.render(text) == text, "run: python -m sidecar.docgen"


async def _readyz(h: Harness) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{h.metrics_port}/readyz") as r,
    ):
        return r.status


async def _until(pred: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)  # polling another process, bounded by the deadline


async def test_readyz_503_before_registration_200_ready_503_while_draining(h: Harness) -> None:
    await h.faults(routes={"registerInstance": {"status": 503, "count": -1}})
    h.start_engine()
    side = h.start_sidecar(**{"shutdown.grace_s": "8", "shutdown.host_down_budget_s": "3"})
    h.engine_cmd(op="work", n=20)
    side.wait_line("register failed")
    assert await _readyz(h) == 503  # not registered
    await h.faults(clear=True)

    async def ready() -> bool:
        return await _readyz(h) == 200

    await _until(ready)
    await h.faults(routes={"reportEvent": {"delay_ms": 2000, "count": -1}})
    side.terminate()
    side.wait_line("shutdown: draining")

    async def draining() -> bool:
        return await _readyz(h) == 503

    await _until(draining, 2.0)
    await h.faults(clear=True)
    # waited in a thread: the in-process KVCM must go on answering (HOST_DOWN)
    assert await asyncio.to_thread(side.p.wait, 15) == 0


def _status(h: Harness, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        **{k: v for k, v in h.sidecar_env().items() if k.startswith("KV_CACHE_EVENT_")},
    }
    env["KV_CACHE_EVENT_METRICS_ADDR"] = f"127.0.0.1:{h.metrics_port}"
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "status", *extra],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _shape(text: str) -> list[str]:
    shape = [
        line.split()[0] if line.startswith("  ") else line.split(":")[0]
        for line in text.strip().splitlines()
    ]
    # One "last ok <op>" line per operation that has succeeded so far: how many depends on
    # when the status is read (a heartbeat or report may or may not have gone out yet).
    return [x for i, x in enumerate(shape) if not (x == "last" and shape[i - 1 : i] == ["last"])]


async def test_status_command_output_matches_docs_example(h: Harness) -> None:
    await h.start_converged(50)
    await h.reporter_until(lambda r: r["liveness"] == "live")
    out = _status(h)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("kvcm-sidecar: READY")
    doc = docgen.DOC.read_text()
    block = f"<!-- generated:status-example -->\n```\n{out.stdout}```\n<!-- end:status-example -->"
    if os.environ.get("KVCM_SIDECAR_UPDATE_DOCS"):
        doc = re.sub(
            r"<!-- generated:status-example -->.*?<!-- end:status-example -->",
            lambda _m: block,
            doc,
            flags=re.DOTALL,
        )
        docgen.DOC.write_text(doc)
    shown = re.search(r"<!-- generated:status-example -->\n```\n(.*?)```", doc, re.DOTALL)
    assert shown is not None
    assert _shape(shown.group(1)) == _shape(out.stdout)
    js = _status(h, "--json")
    assert js.returncode == 0 and '"state": "READY"' in js.stdout


async def test_status_command_when_daemon_down_reads_ring(h: Harness) -> None:
    side = await h.start_converged(20)
    side.kill()
    out = _status(h)
    assert out.returncode == 1
    assert "DAEMON_DOWN" in out.stdout and "engine_liveness_age_s" in out.stdout


def test_log_rate_limit_once_per_interval_then_counts_suppressed() -> None:
    f = RateLimit(interval_s=3600)
    rec = [
        logging.LogRecord("x", logging.WARNING, "p", 1, "kvcm %s failed", ("delta",), None)
        for _ in range(5)
    ]
    assert [f.filter(r) for r in rec] == [True, False, False, False, False]
    info = logging.LogRecord("x", logging.INFO, "p", 1, "state change", (), None)
    assert f.filter(info) and f.filter(info)
    f.interval_s = 0
    again = logging.LogRecord("x", logging.WARNING, "p", 1, "kvcm %s failed", ("delta",), None)
    assert f.filter(again) and again.getMessage() == "kvcm delta failed suppressed=4"
