"""`kvcm-sidecar demo` as a user runs it: short, two ranks, must exit 0 having converged."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from sidecar.testbed.proc import ROOT

pytestmark = pytest.mark.slow


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the demo as a user does; it must exit 0 having converged."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every rank converged" in out.stdout
    return out


def test_demo_two_ranks_converges_and_exits_0() -> None:
    out = _demo("--duration", "4", "--ranks", "2")
    assert "fault: SIGKILL the sidecar of rank 0" in out.stdout
    # Issue #11: a ring overflow on the rank whose engine has no snapshot provider still ends
    # converged (the hook's resident set holds the dropped transitions).
    dropped = re.search(r"rank 1: ring dropped (\d+) records", out.stdout)
    assert dropped is not None and int(dropped.group(1)) > 0, out.stdout[-3000:]
    # The demo ends with a short replay on the same KVCM: routing by KVCM's view must reuse
    # clearly more of the cache than round_robin, with every request served once and KVCM
    # matching every replay engine at the end.
    m = re.search(
        r"kvcm-aware routing: hit rate (\d+)% vs (\d+)%, mean TTFT (\d+) ms vs (\d+) ms .*"
        r"KVCM matched every engine: (\w+)",
        out.stdout,
    )
    assert m is not None, out.stdout[-3000:]
    kvcm_hit, rr_hit = int(m[1]), int(m[2])
    assert kvcm_hit >= 1.25 * rr_hit and m[5] == "yes", out.stdout[-3000:]


def test_demo_source_zmq_converges_after_a_gap_and_a_sidecar_restart() -> None:
    """`demo --source zmq`: vLLM-format engines (int hashes, 32-byte digests; GPU and CPU)."""
    out = _demo("--source", "zmq", "--duration", "3")
    assert "fault: rank 0's engine drops 20 batches" in out.stdout
    assert "fault: SIGKILL the sidecar of rank 1" in out.stdout
    rows = re.findall(
        r"^\s+(\d) +(int|bytes) +(\d+) +(\d+) +(\d+) +(\d+) .* yes$", out.stdout, re.M
    )
    assert [(r[0], r[1]) for r in rows] == [("0", "int"), ("1", "bytes")], out.stdout[-3000:]
    for _rank, _kind, truth, kvcm, hbm, mem in rows:
        assert truth == kvcm and int(hbm) > 0 and int(mem) > 0  # two mediums on each rank
    # rank 0 hashes as FlexLB expects (sha256_cbor, seed 0), rank 1 as vLLM does by default
    assert re.findall(r"vllm_sha256_cbor=(\S+) +yes$", out.stdout, re.M) == ["1", "0"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_demo_cluster_survives_a_leader_sigkill() -> None:
    """`demo --cluster` (issue #23): redis-server, three cluster-mode servers, seeds."""
    out = _demo("--cluster", "--duration", "4")
    assert "fault: SIGKILL the KVCM leader" in out.stdout
    assert re.search(r"a follower took the lease after [\d.]+ s: new leader", out.stdout)
