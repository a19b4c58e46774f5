"""bench.hotpath stays runnable: `--quick` runs every measurement once, small (~10 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_hotpath_quick_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "hotpath.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.hotpath", "--quick", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    row = result["paced"]["k32_rate20000"]
    for system in ("hook", "vllm"):
        assert len(row[f"{system}_ns_per_event"]) == 1
        assert row[f"{system}_call_p99_us"][0] > 0
    assert row["hook_dropped"] == [0]
    idle = result["idle"]
    for system in ("none", "hook", "vllm"):
        assert f"idle_{system}_cpu_pct" in idle and f"idle_{system}_wakeups_per_s" in idle
    assert idle["snapshot_answer_idle_bell_max_ms"] > 0
    assert result["drop_dropped_total"] > 0  # the overflow measurement really overflowed
    assert "goals_met" in result
