"""Where a flush window's CPU goes, at engine pace (issue #26).

    python -m bench.pace_split [--source ring|zmq] [--rate 5000] [--seconds 12]
                               [--functions module:Qual.name,...] [--out FILE]

One bench.pace paced run (the engine in its own process, the real `kvcm-sidecar run`, the null
manager), with the sidecar started under this module's `--as-sidecar` role: it wraps the named
functions with thread-CPU timers (time.thread_time_ns, ~1.5 us a call itself) and writes their
totals when it exits. Printed: the bench's own figures for the run, the sidecar's process CPU,
and per function its calls, us per call and us per flush window (per KeyState.take_batch call,
always timed). Nested functions are each timed whole (a parent includes its children). The
timers inflate the total a little; what is compared is each function's share, before/after.
JSON to bench/results/pace_split.json.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RING = [
    "sidecar.source.engine_sync:EngineSync.step",
    "sidecar.shm_ring.reader:RingReader.read",
    "sidecar.key_state:KeyState.apply",
]
ZMQ = [
    "sidecar.source.zmq:ZmqSource._read_live",
    "sidecar.source.zmq:Stream.on_live",
    "sidecar.source.zmq_events:EventDecoder.decode",
    "sidecar.source.zmq:Stream.flush",
    "sidecar.key_state:KeyState.apply_bits_at",
    "sidecar.shm_ring.key_table:KeyTable.find",
]
REPORT = [
    "sidecar.key_state:KeyState.take_batch",
    "sidecar.kvcm_client.wire:encode_batch",
    "sidecar.kvcm_client.client:interpret",
    "sidecar.key_state:KeyState.confirm",
    "sidecar.metrics.registry:Metrics.observe",
    "sidecar.source.base:FlushPolicy.read_at",
]
WINDOW = "key_state.KeyState.take_batch"


def _wrap(spec: str, totals: dict[str, list[int]]) -> None:
    modname, qual = spec.split(":")
    obj: Any = importlib.import_module(modname)
    *owners, name = qual.split(".")
    for part in owners:
        obj = getattr(obj, part)
    f = getattr(obj, name)
    key = f"{modname.rsplit('.', 1)[-1]}.{qual}"
    clock = time.thread_time_ns

    @functools.wraps(f)
    def timed(*args: Any, **kw: Any) -> Any:
        t = clock()
        try:
            return f(*args, **kw)
        finally:
            d = totals.setdefault(key, [0, 0])
            d[0] += clock() - t
            d[1] += 1

    setattr(obj, name, timed)


def as_sidecar() -> None:
    """The sidecar with timers: `kvcm-sidecar run` after wrapping $PACE_SPLIT_FUNCTIONS."""
    totals: dict[str, list[int]] = {}
    for spec in os.environ["PACE_SPLIT_FUNCTIONS"].split(","):
        _wrap(spec, totals)
    t0 = time.process_time()

    def dump() -> None:
        totals["_process_ns"] = [int((time.process_time() - t0) * 1e9), 1]
        Path(os.environ["PACE_SPLIT_OUT"]).write_text(json.dumps(totals))

    atexit.register(dump)
    if os.environ.get("PACE_SPLIT_CALLS"):
        _count_calls(totals, float(os.environ["PACE_SPLIT_CALLS"]))
    from sidecar.cli import main

    sys.argv = ["kvcm-sidecar", "run"]
    main()


def _count_calls(totals: dict[str, list[int]], after_s: float) -> None:
    """From `after_s` into the run, for 2 s, count every Python and C call on the event loop's
    thread (sys.setprofile): the steady state's inventory of what a window runs. Calls are
    counted, not timed (the profiler's own cost would swamp the times)."""
    import asyncio

    counts: dict[str, int] = {}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            c = frame.f_code
            k = f"{c.co_filename.rsplit('/', 2)[-2:][-1]}:{c.co_firstlineno} {c.co_qualname}"
        elif event == "c_call":
            k = f"C {getattr(arg, '__qualname__', arg)}"
        else:
            return
        counts[k] = counts.get(k, 0) + 1

    async def window() -> None:
        await asyncio.sleep(after_s)
        sys.setprofile(prof)
        await asyncio.sleep(2.0)
        sys.setprofile(None)
        for k, n in counts.items():
            totals[f"_calls {k}"] = [n, 1]

    import uvloop

    real_run = uvloop.run

    def run_with(main: Any, **kw: Any) -> Any:
        async def both() -> Any:
            task = asyncio.ensure_future(window())
            try:
                return await main
            finally:
                task.cancel()

        return real_run(both(), **kw)

    uvloop.run = run_with  # the CLI runs the daemon under uvloop.run


def run(a: argparse.Namespace) -> dict[str, Any]:
    from bench import pace

    totals_file = Path(a.out).with_suffix(".totals.json")
    functions = [*(a.functions.split(",") if a.functions else []), *REPORT]
    if not a.functions:
        functions[:0] = RING if a.source == "ring" else ZMQ
    proc_init = pace.Proc.__init__

    def init(self: Any, argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> None:
        if "sidecar.cli" in argv:  # the sidecar: under the timers
            argv = [argv[0], "-m", "bench.pace_split", "--as-sidecar"]
            env = {
                **(env or {}),
                "PACE_SPLIT_FUNCTIONS": ",".join(dict.fromkeys(functions)),
                "PACE_SPLIT_OUT": str(totals_file),
                "PACE_SPLIT_CALLS": str(a.calls_after if a.calls else ""),
            }
        proc_init(self, argv, env, **kw)

    pace.Proc.__init__ = init  # type: ignore[method-assign,assignment]
    null = pace.Proc([pace.PY, "-m", "bench.null_server", "--record"])
    assert null.p.stdout is not None
    url = null.p.stdout.readline().rsplit(" ", 1)[1].strip()
    ns = argparse.Namespace(seconds=a.seconds, warm_seconds=0.5, base=url, baseline_env=[])
    try:
        figures = pace.paced("hook" if a.source == "ring" else "vllm", a.rate, ns, None)
    finally:
        null.stop()
    deadline = time.monotonic() + 30
    while not totals_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the sidecar writes its totals at exit (another process)
    totals = json.loads(totals_file.read_text())
    totals_file.unlink()
    windows = max(totals.get(WINDOW, [0, 1])[1], 1)
    rows = {
        k: {
            "ms": ns / 1e6,
            "calls": c,
            "us_per_call": ns / c / 1e3,
            "us_per_window": ns / windows / 1e3,
        }
        for k, (ns, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])
        if not k.startswith("_")
    }
    calls = {
        k.split(" ", 1)[1]: n
        for k, (n, _c) in sorted(totals.items(), key=lambda kv: -kv[1][0])
        if k.startswith("_calls ")
    }
    return {
        "calls_2s": calls,
        "source": a.source,
        "rate": a.rate,
        "seconds": a.seconds,
        "figures": figures,
        "process_cpu_ms": totals["_process_ns"][0] / 1e6,
        "windows": windows,
        "functions": rows,
    }


def main() -> None:
    if "--as-sidecar" in sys.argv:
        as_sidecar()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", choices=["ring", "zmq"], default="ring")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--functions", default="", help="module:Qual.name,... (default: the source's)")
    ap.add_argument(
        "--calls",
        action="store_true",
        help="also count every call on the loop's thread for 2 s of the steady state",
    )
    ap.add_argument("--calls-after", type=float, default=5.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pace_split.json"))
    a = ap.parse_args()
    out = run(a)
    f = out["figures"]
    print(
        f"{a.source} at {a.rate}/s: {f['sidecar_pct_core']:.2f} % of a core, "
        f"{f['events_per_sidecar_cpu_s'] / 1e3:.0f} k events per CPU-s, {out['windows']} windows, "
        f"process CPU {out['process_cpu_ms']:.0f} ms (whole life, timers included)"
    )
    for k, r in out["functions"].items():
        print(
            f"  {k:45s} {r['calls']:6d} calls {r['us_per_call']:8.1f} us/call "
            f"{r['us_per_window']:8.1f} us/window"
        )
    if out["calls_2s"]:
        total = sum(out["calls_2s"].values())
        w = 2.0 * out["windows"] / a.seconds
        print(
            f"calls in 2 s of the steady state (~{w:.0f} windows): {total} ({total / w:.0f}/window)"
        )
        for k, n in list(out["calls_2s"].items())[:80]:
            print(f"  {n / w:7.1f}/window  {k}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
