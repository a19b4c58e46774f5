"""`kvcm-sidecar demo`: the whole system on one machine, with faults, a check and a replay.

Starts the KVCM-compatible server, then per dp rank an engine simulator and a sidecar; shows live
counters; restarts one sidecar and overflows another rank's ring; checks that KVCM shows exactly
each engine's published keys; ends with a short replay (round_robin vs kvcm) on the same KVCM.
Exit 0 only if all converged and the replay was consistent. With `--cluster`: a real
redis-server and three cluster-mode servers instead, the sidecars given all three as seeds, and
the leader SIGKILLed mid-run instead of a sidecar (no replay). Imports: stdlib, aiohttp, sidecar.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.child import PY, Proc, await_ready, start_kvcm_server, start_sidecar
from sidecar.child import spawn as _spawn
from sidecar.replay.report import table
from sidecar.replay.router import CostModel
from sidecar.replay.run import Replay, Settings
from sidecar.replay.trace import CONVERSATIONS, generated
from sidecar.shm_ring.segment import unlink


@dataclass
class Rank:
    r: int
    ring: str
    host: str
    engine: Proc | None = None
    sidecar: Proc | None = None
    metrics_port: int = 0
    final: dict[str, Any] = field(default_factory=dict)


class Demo:
    def __init__(
        self,
        duration_s: float,
        ranks: int,
        seed: int,
        out: Any = sys.stdout,
        *,
        cluster: bool = False,
    ) -> None:
        self.cluster = cluster
        self.redis: Proc | None = None
        self.nodes: list[tuple[Proc, str]] = []  # (process, base URL)
        self.seeds = ""
        self.duration_s = duration_s
        self.n = ranks
        self.seed = seed
        self.out = out
        self.tty = out.isatty()
        self.instance = f"demo-{uuid.uuid4().hex[:6]}"
        self.ranks = [
            Rank(r, f"/kvcm-demo-{os.getpid()}-{r}", f"127.0.0.1:{18000 + r}") for r in range(ranks)
        ]
        self.overflow_rank = self.ranks[-1]
        self.tasks: list[asyncio.Task[None]] = []
        self.server: Proc | None = None
        self.base = ""
        self.tmp = Path(tempfile.mkdtemp(prefix="kvcm-demo-"))

    def say(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()

    async def start_sidecar(self, rk: Rank) -> None:
        rk.sidecar, rk.metrics_port = await start_sidecar(
            self.tasks,
            endpoint=self.seeds or self.base,
            instance_id=self.instance,
            dp_rank=rk.r,
            host=rk.host,
            ring=rk.ring,
            env={"KV_CACHE_EVENT_REPORT_HEARTBEAT_INTERVAL_S": "0.5"},
        )

    async def get(self, s: aiohttp.ClientSession, url: str) -> Any:
        async with s.get(url) as r:
            return await r.json(content_type=None)

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            for rk in self.ranks:
                for proc in (rk.sidecar, rk.engine):
                    if proc is not None and proc.p.returncode is None:
                        proc.p.kill()
                        await proc.p.wait()
                unlink(rk.ring)
            if self.server is not None and self.server.p.returncode is None:
                await self.server.stop()
            for node, _ in self.nodes:
                if node.p.returncode is None:
                    await node.stop()
            if self.redis is not None and self.redis.p.returncode is None:
                await self.redis.stop(signal.SIGKILL)
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _run(self) -> int:
        self.say(f"kvcm-sidecar demo: {self.n} dp ranks, {self.duration_s:.0f} s, seed {self.seed}")
        if self.cluster:
            await self._start_cluster()
        else:
            self.server, self.base = await start_kvcm_server(
                self.tasks, "--state-file", str(self.tmp / "kvcm.json")
            )
            self.say(f"  KVCM-compatible server at {self.base} (bootstrapped group 'default')")
        for rk in self.ranks:
            args = {
                "instance_id": self.instance,
                "dp_rank": rk.r,
                "dp_size": self.n,
                "seed": self.seed,
                "ring_name": rk.ring,
            }
            if rk is self.overflow_rank:
                # No snapshot provider (the hook's resident set answers resyncs) and a small
                # ring, so stopping its sidecar for a moment overflows it.
                args.update(provider=False, capacity=2048)
            env = {**os.environ, "KV_CACHE_EVENT_RING_NAME": rk.ring}
            rk.engine = await _spawn(
                f"engine{rk.r}",
                PY,
                "-m",
                "sidecar.testbed.simulator",
                json.dumps(args),
                env=env,
                tasks=self.tasks,
            )
            await rk.engine.expect(lambda x: isinstance(x, dict) and x.get("ready"))
            await self.start_sidecar(rk)
            self.say(
                f"  rank {rk.r}: engine pid {rk.engine.p.pid}, sidecar pid "
                f"{rk.sidecar.p.pid if rk.sidecar else 0}, reporter {rk.host}"
            )
        async with aiohttp.ClientSession() as s:
            for rk in self.ranks:
                await await_ready(s, rk.metrics_port)
            for rk in self.ranks:
                assert rk.engine is not None
                await rk.engine.send("go")
            await self._progress(s)
            for rk in self.ranks:
                assert rk.engine is not None
                await rk.engine.send("quiet")
                rk.final = await rk.engine.expect(
                    lambda x: isinstance(x, dict) and x.get("final"), within_s=60
                )
            self.say("  engines quiet; waiting for KVCM to match every engine ...")
            ok = await self._converge(s)
            await self._report(s, ok)
            for rk in self.ranks:
                assert rk.engine is not None and rk.sidecar is not None
                await rk.engine.send("exit")
                await rk.sidecar.stop()
        replayed = await self._replay() if not self.cluster else True
        self.say("")
        self.say(
            "  RESULT: "
            + (
                "every rank converged: KVCM matches each engine exactly"
                if all(ok.values())
                else "NOT converged"
            )
            + ("" if replayed else "; the replay FAILED")
        )
        return 0 if all(ok.values()) and replayed else 1

    async def _overflow(self, rk: Rank) -> None:
        """SIGSTOP the rank's sidecar until its engine reports ring drops, then SIGCONT."""
        assert rk.engine is not None and rk.sidecar is not None
        before = rk.engine.last.get("dropped", 0)
        self.say(
            f"  fault: SIGSTOP the sidecar of rank {rk.r} (engine without a snapshot provider)"
            " until its ring overflows"
        )
        rk.sidecar.p.send_signal(signal.SIGSTOP)
        try:
            async with asyncio.timeout(20):
                while rk.engine.last.get("dropped", 0) <= before:
                    rk.engine.new_stats.clear()
                    await rk.engine.new_stats.wait()  # the engine reports every 0.5 s
        finally:
            rk.sidecar.p.send_signal(signal.SIGCONT)
        dropped = rk.engine.last.get("dropped", 0) - before
        self.say(f"  rank {rk.r}: ring dropped {dropped} records; SIGCONT, the sidecar resyncs")

    async def _progress(self, s: aiohttp.ClientSession) -> None:
        t0 = time.monotonic()
        restarted = overflowed = False
        # Both faults always happen: on a loaded machine the restart alone may outlast the
        # duration, and the overflow (which the demo promises) must not be skipped then.
        while (elapsed := time.monotonic() - t0) < self.duration_s or not overflowed:
            if not restarted and elapsed >= self.duration_s / 2 and self.cluster:
                restarted = True
                await self._kill_leader(s)
            if not restarted and elapsed >= self.duration_s / 2:
                restarted = True
                rk = self.ranks[0]
                assert rk.sidecar is not None
                self.say("  fault: SIGKILL the sidecar of rank 0 and start a new one")
                await rk.sidecar.stop(signal.SIGKILL)
                await self.start_sidecar(rk)
            if not overflowed and elapsed >= self.duration_s * 0.75:
                overflowed = True
                await self._overflow(self.overflow_rank)
            events = sum(rk.engine.last.get("events", 0) for rk in self.ranks if rk.engine)
            pub = sum(rk.engine.last.get("published", 0) for rk in self.ranks if rk.engine)
            drops = sum(rk.engine.last.get("dropped", 0) for rk in self.ranks if rk.engine)
            try:
                dbg = await self.get(s, f"{self.base}/debug/reporters")
                reqs = sum(dbg["requests"].values())
            except aiohttp.ClientError:
                reqs = -1
            resyncs = 0
            for rk in self.ranks:
                try:
                    st = await self.get(s, f"http://127.0.0.1:{rk.metrics_port}/status")
                    resyncs += sum(st.get("resyncs", {}).values())
                except aiohttp.ClientError:
                    pass
            bar = "#" * min(int(30 * elapsed / self.duration_s), 30)
            text = (
                f"  [{bar:<30}] {elapsed:4.0f}s events={events} published={pub} "
                f"requests={reqs} drops={drops} resyncs={resyncs}"
            )
            if self.tty:
                self.out.write("\r\033[K" + text)
                self.out.flush()
            elif int(elapsed * 2) % 6 == 0:
                self.say(text)
            await asyncio.sleep(0.5)  # the progress display's refresh period
        if self.tty:
            self.out.write("\n")

    # ---- --cluster ------------------------------------------------------------------------
    async def _start_cluster(self) -> None:
        redis = shutil.which("redis-server")
        if redis is None:
            raise SystemExit("demo --cluster needs redis-server (apt-get install redis-server)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.redis = await _spawn(
            "redis",
            redis,
            *("--bind", "127.0.0.1", "--port", str(port), "--dir", str(self.tmp)),
            *("--save", "", "--appendonly", "no", "--logfile", ""),
            tasks=self.tasks,
        )
        await self.redis.expect(lambda x: isinstance(x, str) and "Ready to accept" in x)
        url = f"redis://127.0.0.1:{port}/0"
        for i in range(3):
            node, base = await start_kvcm_server(
                self.tasks,
                *("--meta-storage", url, "--node-id", f"kvcm-{i}", "--lease-ms", "2000"),
            )
            self.nodes.append((node, base))
        self.seeds = ",".join(base for _, base in self.nodes)
        self.base = await self._leader()
        self.say(
            f"  KVCM cluster: redis-server at {url}, 3 nodes (2 s lease), leader {self.base};"
            " the sidecars get all three as seeds"
        )

    async def _leader(self, within_s: float = 15.0) -> str:
        """The base URL of the node that leads (polled, bounded)."""
        async with aiohttp.ClientSession() as s, asyncio.timeout(within_s):
            while True:
                for node, base in self.nodes:
                    if node.p.returncode is not None:
                        continue
                    try:
                        if (await self.get(s, f"{base}/debug/cluster"))["is_leader"]:
                            return base
                    except aiohttp.ClientError:
                        pass
                await asyncio.sleep(0.05)  # polling other processes, bounded by the timeout

    async def _kill_leader(self, s: aiohttp.ClientSession) -> None:
        node = next(n for n, base in self.nodes if base == self.base)
        self.say(f"  fault: SIGKILL the KVCM leader ({self.base}) while the engines work")
        t0 = time.monotonic()
        await node.stop(signal.SIGKILL)
        self.base = await self._leader()
        self.say(
            f"  a follower took the lease after {time.monotonic() - t0:.1f} s: new leader"
            f" {self.base}; the sidecars find it and resnapshot"
        )

    async def _visible(self, s: aiohttp.ClientSession, host: str) -> set[str]:
        dbg = await self.get(s, f"{self.base}/debug/reporters")
        for r in dbg["reporters"]:
            if r["host_ip_port"] == host and r["instance_id"] == self.instance:
                return set(r["visible_keys"])
        return set()

    async def _converge(self, s: aiohttp.ClientSession) -> dict[int, bool]:
        deadline = time.monotonic() + 30
        ok = {rk.r: False for rk in self.ranks}
        while time.monotonic() < deadline and not all(ok.values()):
            for rk in self.ranks:
                ok[rk.r] = await self._visible(s, rk.host) == set(rk.final["published"])
            await asyncio.sleep(0.1)  # polling other processes, bounded by the deadline
        return ok

    async def _report(self, s: aiohttp.ClientSession, ok: dict[int, bool]) -> None:
        self.say("")
        self.say(
            f"  {'rank':>4} {'published':>9} {'in KVCM':>8} {'diff':>5} {'drops':>6} "
            f"{'resyncs':>7} {'p50 ms':>7} {'p99 ms':>7}  converged"
        )
        for rk in self.ranks:
            vis = await self._visible(s, rk.host)
            pub = set(rk.final["published"])
            arrivals = await self.get(s, f"{self.base}/debug/arrivals?host={rk.host}")
            lat = []
            for k, t, removed in rk.final["samples"]:
                # The first arrival after the key was published; a key evicted before it was
                # sent was coalesced away (correctly), so it has no latency to measure.
                after = [a for a in arrivals.get(k, []) if a * 1e9 >= t]
                if after and not (removed and removed < min(after) * 1e9):
                    lat.append((min(after) - t / 1e9) * 1000)
            lat.sort()
            p50 = statistics.median(lat) if lat else float("nan")
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
            try:
                st = await self.get(s, f"http://127.0.0.1:{rk.metrics_port}/status")
                resyncs = sum(st.get("resyncs", {}).values())
            except aiohttp.ClientError:
                resyncs = -1
            self.say(
                f"  {rk.r:>4} {len(pub):>9} {len(vis):>8} {len(pub ^ vis):>5} "
                f"{rk.final['dropped']:>6} {resyncs:>7} {p50:>7.1f} {p99:>7.1f}  "
                f"{'yes' if ok[rk.r] else 'NO'}"
            )
        self.say("")
        if self.cluster:
            self.say(
                "  (latency: engine step -> first arrival at the current leader; keys"
                " published before the failover count until the resnapshot reached it)"
            )
        else:
            self.say(
                "  (latency: engine step -> first arrival at KVCM; rank 0 includes the restart,"
                f" rank {self.overflow_rank.r} the overflow)"
            )
        self.say("")

    async def _replay(self) -> bool:
        """A short replay on this KVCM: what the cache state is worth to a router."""
        w = CONVERSATIONS
        self.say("")
        self.say(
            f"  replay: {w.requests} requests of multi-turn conversations on {self.n} prefill "
            "engines (+ sidecars), routed round_robin, then by KVCM's view (kvcm)"
        )
        cfg = Settings(
            ranks=self.n,
            capacity_blocks=400,
            speed=5.0,
            policies=("round_robin", "kvcm"),
            seed=self.seed,
            cost=CostModel(block_tokens=16),
        )
        r = Replay(generated(w, self.seed, 16), cfg, endpoint=self.base)
        doc = await r.execute(self.out)
        self.say(table(doc))
        rr, kv = doc["policies"]["round_robin"], doc["policies"]["kvcm"]
        ok = all(x.served_once() and x.consistent for x in r.runs)
        self.say(
            f"  kvcm-aware routing: hit rate {kv['hit_rate']:.0%} vs {rr['hit_rate']:.0%}, mean "
            f"TTFT {kv['ttft_mean_s'] * 1000:.0f} ms vs {rr['ttft_mean_s'] * 1000:.0f} ms "
            "(trace time); every request served once and KVCM matched every engine: "
            + ("yes" if ok else "NO")
        )
        return ok


def run(duration_s: float, ranks: int, seed: int, cluster: bool = False) -> int:
    import uvloop

    return uvloop.run(Demo(duration_s, ranks, seed, cluster=cluster).run())
