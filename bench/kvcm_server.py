"""Is the KVCM-compatible server ever the bottleneck? One run, over real loopback HTTP.

Measures: single-ADD requests/s from 100 concurrent clients; time to apply one 20,000-event
request, and the same in lowerCamelCase (the generic dict path: the baseline, as a ratio); time
to commit a 50,000-block snapshot. The server runs in a child process (its own
core), the clients here. Goal: >= 200,000 events/s applied. Writes bench/results/kvcm_server.json.

    python -m bench.kvcm_server
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from sidecar.kvcm_server import proto as P

RESULTS = Path(__file__).resolve().parent / "results"
REG = {
    "instance_group": "default",
    "instance_id": "bench",
    "block_size": 16,
    "location_spec_infos": [{"name": "full", "size": 1 << 20}],
    "model_deployment": {"model_name": "m", "dtype": "fp16"},
}


def _add(k: int) -> dict[str, Any]:
    return {
        "event_type": "EVENT_BLOCK_ADD",
        "block_add": {
            "block_key": str(k),
            "medium": "hbm",
            "specs": [{"name": "full", "uri": "event_report://h/hbm"}],
        },
    }


def _req(host: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "instance_id": "bench",
        "host_ip_port": host,
        "storage_type": "ST_EVENT_REPORT_L1P5",
        "events": events,
    }


async def run(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as s:

        async def post(route: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
            # Bodies are encoded before the clock starts where it matters: the figure is the
            # server's, not this client's JSON encoder's.
            payload = body if isinstance(body, bytes) else msgspec.json.encode(body)
            async with s.post(f"{base}/api/{route}", data=payload) as r:
                data: dict[str, Any] = await r.json()
                assert data["header"]["status"]["code"] == "OK", data["header"]
                return data

        await post("registerInstance", REG)
        # 1. single-ADD requests from 100 concurrent clients
        n_per = 40

        async def client(c: int) -> None:
            for i in range(n_per):
                await post("reportEvent", _req(f"h{c}:1", [_add(c * 1000 + i)]))

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(100)))
        dt = time.perf_counter() - t0
        out["single_add_requests_per_s_c100"] = 100 * n_per / dt

        # 2. one 20,000-event request
        # Fresh keys every time (new blocks are the costly case), encoded before timing.
        async def timed(host: str, runs: int, spell: Any = lambda body: body) -> list[float]:
            bodies = [
                msgspec.json.encode(
                    spell(_req(host, [_add(i * 20_000 + k) for k in range(20_000)]))
                )
                for i in range(runs)
            ]
            times = []
            for body in bodies:
                t0 = time.perf_counter()
                await post("reportEvent", body)
                times.append(time.perf_counter() - t0)
            return times

        times = await timed("big:1", 7)
        med = statistics.median(times)
        out["apply_20k_event_request_s"] = med
        out["apply_20k_event_request_best_s"] = min(times)
        out["events_per_s_in_20k_request"] = 20_000 / med
        # Baseline: the same requests in lowerCamelCase, which the generic dict path decodes
        # and applies event by event (what every request cost before the typed path).
        slow = statistics.median(await timed("camel:1", 3, P.camel))
        out["apply_20k_event_request_dict_path_s"] = slow
        out["ratio_typed_vs_dict_path"] = slow / med
        # 3. a 50,000-block snapshot
        blocks = [
            {
                "block_key": str(k),
                "medium": "hbm",
                "specs": [{"name": "full", "uri": "event_report://h/hbm"}],
            }
            for k in range(50_000)
        ]
        snap = {"event_type": "EVENT_BLOCK_SNAPSHOT", "block_snapshot": {"blocks": blocks}}
        snap_body = msgspec.json.encode(_req("snap:1", [snap]))
        t0 = time.perf_counter()
        await post("reportEvent", snap_body)
        out["commit_50k_block_snapshot_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    from bench.sidecar import _kvcm_server

    server, base = _kvcm_server(("--snapshot-min-interval-ms", "0"))
    try:
        result = asyncio.run(run(base))
    finally:
        server.stop()
    result["goal_200k_events_per_s_met"] = float(result["events_per_s_in_20k_request"] >= 200_000)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvcm_server.json").write_text(json.dumps(result, indent=2) + "\n")
    for k, v in result.items():
        print(f"{k:40s} {v:14.3f}")


if __name__ == "__main__":
    main()
