"""`kvcm-sidecar demo --source zmq`: the demo with vLLM-format ZMQ engines instead of the ring.

Imports: stdlib, aiohttp, sidecar.child, sidecar.testbed.zmq_publisher (engines as child processes).
Rank 0 publishes int hashes, rank 1 32-byte digests, both on GPU and CPU; rank 0 loses batches
on its PUB socket (the replay covers them), rank 1's sidecar is SIGKILLed and restarted (it
replays from its checkpoint). Exit 0 only if KVCM shows each engine's (key, medium) truth.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.child import Proc, start_kvcm_server, start_sidecar
from sidecar.testbed.zmq_publisher import PublisherProcess

KVCM_MEDIUM = {"GPU": "hbm", "CPU": "mem"}
RATE = 4000.0  # block events/s per engine


@dataclass
class ZRank:
    r: int
    host: str
    hash_kind: str
    engine_hash: str  # how the engine hashes its blocks (testbed/engine_hash.py)
    pub: PublisherProcess | None = None
    sidecar: Proc | None = None
    metrics_port: int = 0
    status: dict[str, Any] = field(default_factory=dict)


class ZmqDemo:
    def __init__(self, duration_s: float, seed: int, out: Any = sys.stdout) -> None:
        self.duration_s = duration_s
        self.seed = seed
        self.out = out
        self.instance = f"demo-zmq-{uuid.uuid4().hex[:6]}"
        self.ranks = [
            ZRank(0, "127.0.0.1:18100", "int", "sha256_cbor_seed0"),
            ZRank(1, "127.0.0.1:18101", "bytes", "vllm_default"),
        ]
        self.tasks: list[asyncio.Task[None]] = []
        self.server: Proc | None = None
        self.base = ""
        self.tmp = Path(tempfile.mkdtemp(prefix="kvcm-demo-zmq-"))

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    async def call(self, rk: ZRank, cmd: str, **kw: Any) -> dict[str, Any]:
        assert rk.pub is not None
        return await asyncio.to_thread(rk.pub.call, cmd, **kw)

    async def start_sidecar(self, rk: ZRank) -> None:
        assert rk.pub is not None
        ready = rk.pub.ready
        rk.sidecar, rk.metrics_port = await start_sidecar(
            self.tasks,
            endpoint=self.base,
            instance_id=self.instance,
            dp_rank=rk.r,
            host=rk.host,
            ring="",  # unused: the source is the engine's ZMQ stream
            env={
                "KV_CACHE_EVENT_REPORT_HEARTBEAT_INTERVAL_S": "0.5",
                "KV_CACHE_EVENT_SOURCE": "zmq",
                "KV_CACHE_EVENT_ZMQ_ENDPOINT": ready["pub"],
                "KV_CACHE_EVENT_ZMQ_REPLAY_ENDPOINT": ready["replay"],
                "KV_CACHE_EVENT_ZMQ_BIND": "false",  # the engine binds (as vLLM does, tcp://*:P)
                "KV_CACHE_EVENT_ZMQ_CHECKPOINT_INTERVAL_S": "0.5",
                "KV_CACHE_EVENT_STATE_DIR": str(self.tmp / f"state{rk.r}"),
            },
        )
        await self.call(rk, "wait_subscribers", n=1)

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            for rk in self.ranks:
                if rk.sidecar is not None and rk.sidecar.p.returncode is None:
                    rk.sidecar.p.kill()
                    await rk.sidecar.p.wait()
                if rk.pub is not None:
                    await asyncio.to_thread(rk.pub.close)
            if self.server is not None and self.server.p.returncode is None:
                await self.server.stop()
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            shutil.rmtree(self.tmp, ignore_errors=True)

    async def _run(self) -> int:
        self.say(f"kvcm-sidecar demo --source zmq: 2 dp ranks, {self.duration_s:.0f} s")
        self.server, self.base = await start_kvcm_server(self.tasks)
        self.say(f"  KVCM-compatible server at {self.base}")
        for rk in self.ranks:
            rk.pub = await asyncio.to_thread(
                PublisherProcess,
                flavour="vllm",
                hash_kind=rk.hash_kind,
                dp_rank=rk.r,
                engine_hash=rk.engine_hash,
            )
            await self.start_sidecar(rk)
            self.say(
                f"  rank {rk.r}: vLLM-format engine ({rk.hash_kind} hashes, {rk.engine_hash}) on "
                f"{rk.pub.ready['pub']} (replay {rk.pub.ready['replay']}), sidecar pid "
                f"{rk.sidecar.p.pid if rk.sidecar else 0}, reporter {rk.host}"
            )
        async with aiohttp.ClientSession() as s:
            for rk in self.ranks:
                await self.call(
                    rk,
                    "workload",
                    events=0,
                    rate=RATE,
                    mediums=["GPU", "CPU"],
                    dup_prob=0.2,
                    max_held=4000,
                    seed=self.seed + rk.r,
                )
            await self._faults(s)
            for rk in self.ranks:
                await self.call(rk, "stop")
            self.say("  engines quiet; waiting for KVCM to match every engine ...")
            ok = await self._converge(s)
            await self._report(s, ok)
            for rk in self.ranks:
                if rk.sidecar is not None:
                    await rk.sidecar.stop()
        return 0 if all(ok.values()) else 1

    async def _faults(self, s: aiohttp.ClientSession) -> None:
        third = self.duration_s / 3
        await asyncio.sleep(third)  # the workload runs meanwhile
        self.say(
            "  fault: rank 0's engine drops 20 batches on its PUB socket (the replay has them)"
        )
        await self.call(self.ranks[0], "gap", batches=20)
        await asyncio.sleep(third)  # the workload runs meanwhile
        rk = self.ranks[1]
        assert rk.sidecar is not None
        self.say(
            "  fault: SIGKILL the sidecar of rank 1, restart it (it replays from its checkpoint)"
        )
        await rk.sidecar.stop(signal.SIGKILL)
        await self.start_sidecar(rk)
        await asyncio.sleep(third)  # the workload runs meanwhile

    async def _truth(self, rk: ZRank) -> set[tuple[int, str]]:
        rows = (await self.call(rk, "truth", group=0))["held"]
        return {(k, KVCM_MEDIUM[m]) for k, m, _g in rows}

    async def _visible(self, s: aiohttp.ClientSession, host: str) -> set[tuple[int, str]]:
        async with s.get(f"{self.base}/debug/reporters") as r:
            dbg = await r.json(content_type=None)
        for rep in dbg["reporters"]:
            if rep["host_ip_port"] == host and rep["instance_id"] == self.instance:
                return {(int(k), m) for k, m in rep["visible"]}
        return set()

    async def _converge(self, s: aiohttp.ClientSession) -> dict[int, bool]:
        deadline = time.monotonic() + 30
        ok = {rk.r: False for rk in self.ranks}
        truth = {rk.r: await self._truth(rk) for rk in self.ranks}
        while time.monotonic() < deadline and not all(ok.values()):
            for rk in self.ranks:
                ok[rk.r] = await self._visible(s, rk.host) == truth[rk.r]
            await asyncio.sleep(0.1)  # polling other processes, bounded by the deadline
        return ok

    async def _report(self, s: aiohttp.ClientSession, ok: dict[int, bool]) -> None:
        self.say("")
        self.say(
            f"  {'rank':>4} {'hashes':>6} {'truth':>6} {'in KVCM':>8} {'hbm':>5} {'mem':>5} "
            f"{'gaps':>5} {'replays':>7} {'forgets':>7}  {'key check':<22} converged"
        )
        for rk in self.ranks:
            truth = await self._truth(rk)
            vis = await self._visible(s, rk.host)
            async with s.get(f"http://127.0.0.1:{rk.metrics_port}/status") as r:
                st = await r.json(content_type=None)
            replays = sum(st.get("zmq_replays", {}).values())
            forgets = sum(st.get("zmq_forgets", {}).values())
            kc = st.get("key_check", {}).get("vllm_sha256_cbor")
            check = f"vllm_sha256_cbor={'-' if kc is None else kc}"
            self.say(
                f"  {rk.r:>4} {rk.hash_kind:>6} {len(truth):>6} {len(vis):>8} "
                f"{sum(1 for _, m in vis if m == 'hbm'):>5} "
                f"{sum(1 for _, m in vis if m == 'mem'):>5} {st.get('zmq_gaps', 0):>5} "
                f"{replays:>7} {forgets:>7}  {check:<22} {'yes' if ok[rk.r] else 'NO'}"
            )
        self.say(
            "  key check: 1 = a router hashing prompts as FlexLB does (sha256_cbor, seed 0) "
            "finds these keys; 0 = it cannot (vLLM's default sha256 over pickle): run that "
            "engine with --prefix-caching-hash-algo sha256_cbor and PYTHONHASHSEED=0, or the "
            "sidecar with KV_CACHE_EVENT_ZMQ_KEY_MODE=rolling"
        )
        self.say("")
        self.say(
            "  RESULT: "
            + (
                "every rank converged: KVCM matches each engine's (key, medium) truth exactly"
                if all(ok.values())
                else "NOT converged"
            )
        )


def run(duration_s: float, seed: int) -> int:
    import uvloop

    return uvloop.run(ZmqDemo(duration_s, seed).run())
