"""bench.pace stays runnable: `--quick` runs both sources at 20 k events/s, idle and the
single-key loop once, small (~12 s). Skipped without the vLLM wheel (a benchmark dependency
only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vllm_real


@pytest.mark.skipif(vllm_real.wheel() is None, reason="vllm wheel not downloaded (bench only)")
def test_bench_pace_quick_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "pace.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pace", "--quick", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for rate in ("20000",):
        summary = result["rates"][rate]["summary"]
        assert summary["none_engine_ns_per_event"] > 0
        for source in ("ring", "zmq"):
            row = summary[source]
            assert row["delivered"] is True
            assert row["events_per_sidecar_cpu_s"] > 0
            assert row["requests_per_s"] > 0 and row["bytes_per_event"] > 0
            assert row["latency_p99_ms"] >= row["latency_p50_ms"] > 0
        assert "engine_ratio_vllm_over_hook" in summary
    for source in ("ring", "zmq"):
        assert result["idle"][source]["requests_per_s"] > 0  # heartbeats
    assert result["single_key"]["hook"]["ns_per_call"] > 0
    assert "goals" in result
