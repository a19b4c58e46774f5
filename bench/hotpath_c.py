"""What does reporting a transition cost a C/C++ engine? kvcm_ring.h beside the Python hook.

Compiles sidecar/testbed/c/kvcm_bench.c (gcc -O2) and reports ns per single event (goal <= 10), per
key in 1024-key arrays (goal <= 2) and per poll(), a 1M-entry snapshot's stall, syscalls per event
under strace (goal 0), and the Python hook in the same run; JSON to bench/results/hotpath_c.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.hotpath import bench_hook
from sidecar.shm_ring.segment import unlink
from sidecar.testbed import cbuild

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_SINGLE_NS = 10.0
GOAL_ARRAY_NS_PER_KEY = 2.0


def _run(binary: Path, events: int, reps: int, prefix: list[str] | None = None) -> dict[str, Any]:
    ring = f"/kvcm-bench-c-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        res = subprocess.run(
            [*(prefix or []), str(binary), ring, str(events), str(reps)],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        unlink(ring)
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def _syscalls(binary: Path, events: int) -> int:
    strace = shutil.which("strace")
    assert strace is not None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as f:
        _run(binary, events, 1, [strace, "-f", "-qq", "-c", "-o", f.name])
        text = f.read()
    m = re.search(r"^-+.*\n\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?total", text, re.M)
    assert m, text
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=262_144, help="events per repetition")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--python-events", type=int, default=200_000)
    args = ap.parse_args()
    if cbuild.find_compiler() is None:
        raise SystemExit("no C compiler (gcc, cc or clang) found: nothing to measure")
    binary = cbuild.build("kvcm_bench.c", opt="-O2")
    c = _run(binary, args.events, args.reps)
    py = bench_hook(args.python_events)
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "compiler": cbuild.find_compiler(),
        **c,
        **{f"python_{k}": v for k, v in py.items()},
        "goal_single_ns": GOAL_SINGLE_NS,
        "goal_array_ns_per_key": GOAL_ARRAY_NS_PER_KEY,
        "meets_single_goal": c["c_single_ns"] <= GOAL_SINGLE_NS,
        "meets_array_goal": c["c_array1024_ns_per_key"] <= GOAL_ARRAY_NS_PER_KEY,
        "python_staged_over_c_single": round(py["hook_staged_ns"] / c["c_single_ns"], 1),
        "python_array_over_c_array": round(
            py["hook_array1024_ns_per_key"] / c["c_array1024_ns_per_key"], 1
        ),
    }
    if shutil.which("strace"):
        n = 200_000
        base = _syscalls(binary, 0)
        loaded = _syscalls(binary, n)
        # Per repetition: n single stores, n single removes, n keys in 1024-key arrays, and
        # 1000 polls (not counted as events; a poll reads the vDSO clock, no syscall either).
        out["syscalls_attach_close"] = base
        out["syscalls_per_event"] = (loaded - base) / (3 * n)
    else:
        out["syscalls_per_event"] = None
        out["syscalls_note"] = "strace not installed: not counted"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hotpath_c.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
