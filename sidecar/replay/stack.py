"""The replay's processes: the KVCM-compatible server, one prefill engine and one sidecar per rank.

Imports: stdlib, aiohttp, sidecar.child, sidecar.shm_ring.segment. Every process is a real child
(`python -m sidecar.testbed.prefill_engine`, `python -m sidecar.cli run`, `... kvcm-server`);
engines speak JSON lines (sidecar/testbed/prefill_engine.py). Waits on other processes are bounded
polls.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sidecar.child import PY, Proc, await_ready, start_kvcm_server, start_sidecar
from sidecar.shm_ring.segment import unlink

EngineEvent = Callable[[int, dict[str, Any]], None]


class StackError(RuntimeError):
    """A child process did not come up, answer or converge in time."""


class Engine:
    """One prefill engine process; `start`/`done`/`arrive` events go to `on_event`."""

    def __init__(self, rank: int, p: asyncio.subprocess.Process, on_event: EngineEvent) -> None:
        self.rank = rank
        self.p = p
        self.on_event = on_event
        self.control: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.probes: dict[int, asyncio.Future[int]] = {}
        self._ids = itertools.count()

    async def pump(self) -> None:
        assert self.p.stdout is not None
        async for raw in self.p.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                sys.stderr.write(f"engine{self.rank}: {raw.decode(errors='replace')}")
                continue
            ev = msg.get("ev")
            if ev in ("arrive", "start", "done"):
                self.on_event(self.rank, msg)
            elif ev == "probe":
                fut = self.probes.pop(int(msg["id"]), None)
                if fut is not None and not fut.done():
                    fut.set_result(int(msg["prefix"]))
            else:
                await self.control.put(msg)

    def send_nowait(self, msg: dict[str, Any]) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    async def call(self, msg: dict[str, Any], within_s: float = 60.0) -> dict[str, Any]:
        """Send a control command and wait for its answer (answers come in order)."""
        self.send_nowait(msg)
        assert self.p.stdin is not None
        await self.p.stdin.drain()
        try:
            async with asyncio.timeout(within_s):
                return await self.control.get()
        except TimeoutError:
            raise StackError(f"engine{self.rank}: no answer to {msg['op']}") from None

    async def probe(self, keys: list[int], at: float) -> int:
        """The engine's true cached prefix (blocks) of `keys` at virtual time `at`."""
        rid = next(self._ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.probes[rid] = fut
        self.send_nowait({"op": "probe", "id": rid, "keys": keys, "at": at})
        try:
            async with asyncio.timeout(10):
                return await fut
        except TimeoutError:
            raise StackError(f"engine{self.rank}: no answer to a probe in 10 s") from None


@dataclass
class Rank:
    r: int
    ring: str
    host: str
    engine: Engine | None = None
    sidecar: Proc | None = None
    metrics_port: int = 0


@dataclass
class Stack:
    ranks: int
    capacity_blocks: int
    block_tokens: int
    cost: dict[str, float]
    on_event: EngineEvent
    endpoint: str = ""  # an already running KVCM-compatible server (the demo's); else our own
    # ring: engine_hook engines; zmq: vLLM-format ZMQ engines (testbed/zmq_prefill_engine.py)
    # hashing as `engine_hash` says, each sidecar in `key_mode`
    source: str = "ring"
    engine_hash: str = "random_seed"
    key_mode: str = "engine"
    state_dir: str = ""
    instance_id: str = field(default_factory=lambda: f"replay-{uuid.uuid4().hex[:6]}")
    rk: list[Rank] = field(default_factory=list)
    server: Proc | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        if not self.endpoint:
            self.server, self.endpoint = await start_kvcm_server(self.tasks)
        tag = uuid.uuid4().hex[:6]
        self.rk = [
            Rank(r, f"/kvcm-replay-{os.getpid()}-{tag}-{r}", f"127.0.0.1:{19000 + r}")
            for r in range(self.ranks)
        ]
        for rk in self.rk:  # engines first: each creates its ring
            args = {
                "instance_id": self.instance_id,
                "dp_rank": rk.r,
                "dp_size": self.ranks,
                "capacity_blocks": self.capacity_blocks,
                "block_tokens": self.block_tokens,
                "cost": self.cost,
            }
            module = "sidecar.testbed.prefill_engine"
            if self.source == "zmq":
                module = "sidecar.testbed.zmq_prefill_engine"
                args |= {"engine_hash": self.engine_hash, "key_mode": self.key_mode}
            p = await asyncio.create_subprocess_exec(
                PY,
                "-m",
                module,
                json.dumps(args),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "KV_CACHE_EVENT_RING_NAME": rk.ring},
                limit=64 * 1024 * 1024,  # a dump lists every cached key
            )
            rk.engine = Engine(rk.r, p, self.on_event)
            self.tasks.append(asyncio.create_task(rk.engine.pump()))
        for rk in self.rk:
            assert rk.engine is not None
            try:
                async with asyncio.timeout(30):
                    ready = await rk.engine.control.get()
            except TimeoutError:
                raise StackError(f"engine{rk.r} did not start") from None
            if ready.get("ev") != "ready":
                raise StackError(f"engine{rk.r}: {ready}")
            env = None
            if self.source == "zmq":
                env = {
                    "KV_CACHE_EVENT_SOURCE": "zmq",
                    "KV_CACHE_EVENT_ZMQ_ENDPOINT": ready["pub"],
                    "KV_CACHE_EVENT_ZMQ_REPLAY_ENDPOINT": ready["replay"],
                    "KV_CACHE_EVENT_ZMQ_BIND": "false",
                    "KV_CACHE_EVENT_ZMQ_ENGINE": "vllm",
                    "KV_CACHE_EVENT_ZMQ_BLOCK_SIZE": str(self.block_tokens),
                    "KV_CACHE_EVENT_ZMQ_KEY_MODE": self.key_mode,
                    "KV_CACHE_EVENT_ZMQ_REPLAY_TIMEOUT_S": "10",
                    "KV_CACHE_EVENT_STATE_DIR": self.state_dir or f"/tmp/kvcm-replay-{rk.ring[1:]}",  # noqa: S108
                }
            rk.sidecar, rk.metrics_port = await start_sidecar(
                self.tasks,
                endpoint=self.endpoint,
                instance_id=self.instance_id,
                dp_rank=rk.r,
                host=rk.host,
                ring=rk.ring,
                env=env,
            )
        async with aiohttp.ClientSession() as s:
            for rk in self.rk:
                try:
                    await await_ready(s, rk.metrics_port)
                except TimeoutError:
                    raise StackError(f"sidecar{rk.r} not ready in 30 s") from None

    async def key_check(self, s: aiohttp.ClientSession) -> list[int | None]:
        """Each sidecar's key check for vllm_sha256_cbor (ZMQ: can FlexLB recompute its keys)."""
        out: list[int | None] = []
        for rk in self.rk:
            async with s.get(f"http://127.0.0.1:{rk.metrics_port}/status") as r:
                st = await r.json(content_type=None)
            out.append(st.get("key_check", {}).get("vllm_sha256_cbor"))
        return out

    def engines(self) -> list[Engine]:
        return [rk.engine for rk in self.rk if rk.engine is not None]

    async def visible(self, s: aiohttp.ClientSession) -> dict[str, set[str]]:
        """KVCM's view: the keys it shows for each of this stack's hosts."""
        async with s.get(f"{self.endpoint}/debug/reporters") as r:
            dbg = await r.json(content_type=None)
        out: dict[str, set[str]] = {rk.host: set() for rk in self.rk}
        for rep in dbg["reporters"]:
            if rep["instance_id"] == self.instance_id and rep["host_ip_port"] in out:
                out[rep["host_ip_port"]] = set(rep["visible_keys"])
        return out

    async def converge(self, s: aiohttp.ClientSession, want: dict[str, set[str]]) -> bool:
        """Bounded wait until KVCM shows exactly `want` (host -> unsigned key text) per host."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            if await self.visible(s) == want:
                return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.1)  # polling another process, bounded by the deadline

    async def close(self) -> None:
        for rk in self.rk:
            if rk.engine is not None and rk.engine.p.returncode is None:
                rk.engine.p.kill()
                await rk.engine.p.wait()
            if rk.sidecar is not None and rk.sidecar.p.returncode is None:
                await rk.sidecar.stop()
            unlink(rk.ring)
        if self.server is not None and self.server.p.returncode is None:
            await self.server.stop()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
