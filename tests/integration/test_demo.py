"""`kvcm-sidecar demo` as a user runs it: short, two ranks, must exit 0 having converged."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.proc import ROOT

pytestmark = pytest.mark.slow


def test_demo_two_ranks_converges_and_exits_0() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--duration", "4", "--ranks", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every rank converged" in out.stdout
    assert "fault: SIGKILL the sidecar of rank 0" in out.stdout
    assert "router view" in out.stdout
