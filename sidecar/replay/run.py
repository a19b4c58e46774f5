"""`kvcm-sidecar replay`: one trace, the same engines, one run per routing policy, one report.

Imports: stdlib, aiohttp, sidecar.kvcm_client.query, sidecar.replay.*. Per policy: engines are
reset (and KVCM seen empty), trace time 0 is set, requests are sent at wall t0 + arrival / speed
(so the sidecar pipeline's real delay is what the router sees), then every request must be done
once and KVCM must match every engine's cache. Config is validated before any process starts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import aiohttp

from sidecar.kvcm_client.query import QueryClient
from sidecar.replay.report import Outcome, PolicyRun, document, table
from sidecar.replay.router import POLICIES, CostModel, Router
from sidecar.replay.router_keys import RouterKeys
from sidecar.replay.stack import Stack, StackError
from sidecar.replay.trace import Request, theoretical_hit_rate


@dataclass(frozen=True)
class Settings:
    ranks: int = 4
    capacity_blocks: int = 4000
    speed: float = 20.0
    policies: tuple[str, ...] = POLICIES
    seed: int = 1
    cost: CostModel = field(default_factory=CostModel)
    lead_in_s: float = 0.3  # wall seconds between setting trace time 0 and the first arrival
    source: str = "ring"  # zmq: vLLM-format ZMQ engines (one row per key mode x engine hash)
    engine_hash: str = "random_seed"
    key_mode: str = "engine"

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError("--ranks must be >= 1")
        if self.capacity_blocks < 1:
            raise ValueError("--capacity-blocks must be >= 1")
        if self.cost.block_tokens < 1:
            raise ValueError("--block-tokens must be >= 1")
        if not self.speed > 0:
            raise ValueError("--speed must be > 0")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"--policies: unknown {bad}, choose from {','.join(POLICIES)}")
        if self.source not in ("ring", "zmq"):
            raise ValueError("--source must be ring or zmq")
        if self.key_mode not in ("engine", "rolling", "both"):
            raise ValueError("--key-mode: engine, rolling or both")
        if self.engine_hash not in ("vllm_default", "sha256_cbor_seed0", "random_seed"):
            raise ValueError("--engine-hash: vllm_default, sha256_cbor_seed0 or random_seed")


class Replay:
    def __init__(self, requests: list[Request], cfg: Settings, endpoint: str = "") -> None:
        self.requests = requests
        self.cfg = cfg
        cost = {k: v for k, v in asdict(cfg.cost).items() if k != "block_tokens"}
        self.stack = Stack(
            cfg.ranks,
            cfg.capacity_blocks,
            cfg.cost.block_tokens,
            cost,
            self._on_event,
            endpoint,
            source=cfg.source,
            engine_hash=cfg.engine_hash,
            key_mode=cfg.key_mode,
        )
        self.keys_for: RouterKeys | None = None
        if cfg.source == "zmq":  # the router hashes token ids as the key mode needs
            how = "flexlb" if cfg.key_mode == "engine" else "rolling"
            self.keys_for = RouterKeys(how, cfg.cost.block_tokens)
        self.key_check: list[int | None] = []
        self.run: PolicyRun | None = None
        self.router: Router | None = None
        self.remaining = 0
        self.all_done = asyncio.Event()
        self.runs: list[PolicyRun] = []

    def _on_event(self, engine: int, msg: dict[str, Any]) -> None:
        run, router = self.run, self.router
        if run is None or router is None:
            return
        o = run.outcomes[int(msg["id"])]
        ev = msg["ev"]
        if ev == "arrive":
            o.truth_blocks = int(msg["prefix"])
        elif ev == "start":
            o.cached, o.end_s = int(msg["cached"]), float(msg["end"])
            router.started(engine, int(msg["id"]), o.end_s)
        elif ev == "done":
            o.done_on.append(engine)
            self.remaining -= 1
            if self.remaining <= 0:
                self.all_done.set()

    async def _one(self, name: str, s: aiohttp.ClientSession) -> PolicyRun:
        cfg, st = self.cfg, self.stack
        engines = st.engines()
        run = PolicyRun(
            name, [Outcome(r.input_tokens, r.arrival_s) for r in self.requests], cfg.ranks
        )
        router = Router(
            name,
            [rk.host for rk in st.rk],
            cfg.cost,
            cfg.seed,
            query=QueryClient(s, st.endpoint),
            instance_id=st.instance_id,
            probe=lambda e, keys, at: engines[e].probe(keys, at),
            keys_for=self.keys_for,
        )
        self.remaining = len(self.requests)
        self.all_done.clear()
        t0 = time.monotonic() + cfg.lead_in_s
        for eng in engines:
            await eng.call({"op": "epoch", "t0": t0, "speed": cfg.speed})
        self.run, self.router = run, router
        for req in self.requests:
            due = t0 + req.arrival_s / cfg.speed
            if (ahead := due - time.monotonic()) > 0:
                await asyncio.sleep(ahead)  # pacing the trace (the clock is the workload)
            d = await router.decide(req, req.arrival_s)
            o = run.outcomes[req.rid]
            o.engine, o.predicted_blocks = d.engine, d.predicted_blocks
            eng = engines[d.engine]
            eng.send_nowait(
                {
                    "op": "req",
                    "id": req.rid,
                    "at": req.arrival_s,
                    "keys": list(req.keys),
                    "tokens": req.input_tokens,
                }
            )
            assert eng.p.stdin is not None
            await eng.p.stdin.drain()
            run.dispatch_late_s.append(time.monotonic() - due)
        span = self.requests[-1].arrival_s / cfg.speed
        try:
            async with asyncio.timeout(60 + span):
                await self.all_done.wait()
        except TimeoutError:
            raise StackError(f"{name}: {self.remaining} requests never finished") from None
        want: dict[str, set[str]] = {}
        for rk, eng in zip(st.rk, engines, strict=True):
            dump = await eng.call({"op": "dump"})
            want[rk.host] = set(dump["published"])
            run.evictions += int(dump["evictions"])
            run.ring_dropped += int(dump["dropped"])
        run.consistent = await st.converge(s, want)
        if cfg.source == "zmq":
            self.key_check = await st.key_check(s)
        run.query_errors = router.query_errors
        self.run = self.router = None
        for eng in engines:
            await eng.call({"op": "reset"})
        if not await st.converge(s, {rk.host: set() for rk in st.rk}):
            raise StackError(f"after {name}: KVCM did not forget the engines' caches")
        return run

    async def execute(self, out: TextIO) -> dict[str, Any]:
        cfg = self.cfg
        try:
            await self.stack.start()
            out.write(
                f"  {cfg.ranks} engines (capacity {cfg.capacity_blocks} blocks of "
                f"{cfg.cost.block_tokens} tokens), {cfg.ranks} sidecars, KVCM at "
                f"{self.stack.endpoint}; {len(self.requests)} requests at speed {cfg.speed:g}\n"
            )
            out.flush()
            runs: list[PolicyRun] = []
            async with aiohttp.ClientSession() as s:
                for name in cfg.policies:
                    t = time.monotonic()
                    runs.append(await self._one(name, s))
                    out.write(f"  {name}: done in {time.monotonic() - t:.1f} s\n")
                    out.flush()
        finally:
            await self.stack.close()
        self.runs = runs
        theo = theoretical_hit_rate(self.requests, cfg.cost.block_tokens)
        meta = {
            "requests": len(self.requests),
            "trace_span_s": self.requests[-1].arrival_s,
            "ranks": cfg.ranks,
            "capacity_blocks": cfg.capacity_blocks,
            "block_tokens": cfg.cost.block_tokens,
            "speed": cfg.speed,
            "seed": cfg.seed,
            "cost_model": {k: v for k, v in asdict(cfg.cost).items() if k != "block_tokens"},
        }
        if cfg.source == "zmq":
            meta |= {
                "source": "zmq",
                "key_mode": cfg.key_mode,
                "engine_hash": cfg.engine_hash,
                "key_check_vllm_sha256_cbor": self.key_check,
            }
        return document(runs, theo, meta)


def replay(
    requests: list[Request], cfg: Settings, endpoint: str = "", out: TextIO = sys.stdout
) -> tuple[dict[str, Any], list[PolicyRun]]:
    """Run it (on uvloop); returns the JSON document and the per-policy runs."""
    import uvloop

    r = Replay(requests, cfg, endpoint)
    doc = uvloop.run(r.execute(out))
    out.write(table(doc) + "\n")
    return doc, r.runs


def keys_table(docs: list[dict[str, Any]]) -> str:
    """One row per (key mode, engine hash) of `replay --source zmq`: hit rates and the ratios
    the issue's goals name."""
    head = f"  {'key mode':<9}{'engine hash':<19}{'key check':>10}"
    names = list(docs[0]["policies"]) if docs else []
    head += "".join(f"{n:>13}" for n in names) + f"{'kvcm/oracle':>13}{'kvcm/rr':>9}"
    rows = [head]
    for d in docs:
        p = d["policies"]
        kc = d.get("key_check_vllm_sha256_cbor") or []
        check = "-" if not kc or None in kc else str(min(x for x in kc if x is not None))
        line = f"  {d['key_mode']:<9}{d['engine_hash']:<19}{check:>10}"
        line += "".join(f"{p[n]['hit_rate']:>12.1%} " for n in names)
        kv = p.get("kvcm", {}).get("hit_rate")
        orc = p.get("oracle", {}).get("hit_rate")
        rr = p.get("round_robin", {}).get("hit_rate")
        line += f"{kv / orc:>13.2f}" if kv is not None and orc else f"{'-':>13}"
        line += f"{kv / rr:>9.2f}" if kv is not None and rr else f"{'-':>9}"
        rows.append(line)
    rows.append(
        "  key check 1: FlexLB's keys (vLLM sha256_cbor, seed 0) match the engine's; 0: they do "
        "not, so in key mode engine KVCM is asked for keys no engine reported"
    )
    return "\n".join(rows)
