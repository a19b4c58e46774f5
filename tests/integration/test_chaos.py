"""The chaos run on every commit: a few short seeds over every kind of engine (issue #25).

Each seed is `python -m sidecar.testbed.chaos` as a real process tree (KVCM-compatible server
with a state file, engines, sidecars, fault proxies). It must end with no violation: no stale
key beyond the bound, no key back after its removal showed, every host converged exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.testbed.proc import ROOT

pytestmark = pytest.mark.slow

# Two seeds, each over some of the kinds (together all of them), to stay within ~60 s.
SEEDS = [(11, "ring,c,vllm"), (12, "plain,sglang,vllm")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("seed", "sources"), SEEDS)
def test_chaos_short_seed_has_no_violation(seed: int, sources: str, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "sidecar.testbed.chaos", "--seed", str(seed)]
    argv += ["--duration", "6", "--sources", sources, "--json", str(out)]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=140, check=False)
    lines = p.stdout.splitlines()
    assert lines and json.loads(lines[0])["seed"] == seed  # the schedule is printed first
    assert any('"fault"' in line for line in lines[1:4])
    summary = json.loads(out.read_text())
    assert summary["violations"] == [], p.stdout[-4000:]
    assert p.returncode == 0, p.stderr[-2000:]
    assert set(summary["converged_s"]) == set(sources.split(","))
    assert sum(summary["faults"].values()) >= 4
