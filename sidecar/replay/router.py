"""Routing policies for the replay and the router's ledger of each engine's queue.

Imports: stdlib, sidecar.kvcm_client.query, sidecar.replay.trace. A policy sees only what a real
router could: its own ledger of what it sent (updated from the engines' start/done events) and,
for `kvcm`, KVCM's getHostCacheState; `oracle` alone reads the engines' true caches (the upper
bound). Score-based policies pick the lowest predicted TTFT; ties rotate so idle engines share load.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from sidecar.kvcm_client.query import QueryClient, QueryError
from sidecar.replay.trace import Request

POLICIES = ("random", "round_robin", "least_loaded", "kvcm", "oracle")
Probe = Callable[[int, list[int], float], Awaitable[int]]


@dataclass(frozen=True)
class CostModel:
    """The router's model of an engine's prefill time (the same formula the engines run, see
    sidecar/testbed/prefill_engine.py `Cost`; tests pin that they agree). Written again, not
    imported: a router runs without the engine side (tests pin that it imports no
    engine_hook)."""

    overhead_s: float = 0.015
    per_token_s: float = 4e-5
    per_token_ctx_s: float = 2e-9
    block_tokens: int = 512

    def prefill_s(self, input_tokens: int, cached_tokens: int) -> float:
        new = input_tokens - cached_tokens
        return (
            self.overhead_s
            + self.per_token_s * new
            + self.per_token_ctx_s * new * (cached_tokens + new / 2)
        )

    def cached(self, prefix_blocks: int, input_tokens: int) -> int:
        return min(prefix_blocks * self.block_tokens, input_tokens - 1)


@dataclass
class Load:
    """What the router knows of one engine's queue (virtual seconds)."""

    running_end: float = 0.0
    queued: dict[int, float] = field(default_factory=dict)  # sent, not started: predicted prefill

    def wait_s(self, now: float) -> float:
        return max(0.0, self.running_end - now) + sum(self.queued.values())


@dataclass
class Decision:
    engine: int
    predicted_blocks: int | None = None  # the chosen host's prefix as the policy saw it


class Router:
    def __init__(
        self,
        policy: str,
        hosts: Sequence[str],
        cost: CostModel,
        seed: int,
        *,
        query: QueryClient | None = None,
        instance_id: str = "",
        probe: Probe | None = None,
        keys_for: Callable[[Request], Sequence[int]] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        self.policy = policy
        self.hosts = list(hosts)
        self.cost = cost
        self.rng = random.Random(seed)
        self.query = query
        self.instance_id = instance_id
        self.probe = probe
        self.keys_for = keys_for  # the keys KVCM is asked for (None: the trace's chain keys)
        self.loads = [Load() for _ in hosts]
        self.turn = 0
        self.query_errors = 0

    def started(self, engine: int, rid: int, end: float) -> None:
        load = self.loads[engine]
        load.queued.pop(rid, None)
        load.running_end = max(load.running_end, end)

    def _best(self, scores: Sequence[float]) -> int:
        n = len(scores)
        order = [(self.turn + i) % n for i in range(n)]
        self.turn += 1
        return min(order, key=lambda e: scores[e])  # first of equal scores in rotating order

    async def _prefixes(self, req: Request, now: float) -> list[int]:
        if self.policy == "oracle":
            assert self.probe is not None
            return list(
                await asyncio.gather(
                    *(self.probe(e, list(req.keys), now) for e in range(len(self.hosts)))
                )
            )
        assert self.query is not None
        try:
            keys = req.keys if self.keys_for is None else self.keys_for(req)
            state = await self.query.get_host_cache_state(self.instance_id, keys)
        except QueryError:
            self.query_errors += 1  # a failed query is a miss everywhere: route on load alone
            return [0] * len(self.hosts)
        return [state[h].local if h in state else 0 for h in self.hosts]

    async def decide(self, req: Request, now: float) -> Decision:
        """Choose an engine for `req` arriving at virtual time `now` and book it in the ledger."""
        n = len(self.hosts)
        full = self.cost.prefill_s(req.input_tokens, 0)
        blocks: list[int] | None = None
        if self.policy == "random":
            e = self.rng.randrange(n)
        elif self.policy == "round_robin":
            e = self.turn % n
            self.turn += 1
        elif self.policy == "least_loaded":
            e = self._best([ld.wait_s(now) for ld in self.loads])
        else:
            blocks = await self._prefixes(req, now)
            prefill = [
                self.cost.prefill_s(req.input_tokens, self.cost.cached(b, req.input_tokens))
                for b in blocks
            ]
            e = self._best([ld.wait_s(now) + p for ld, p in zip(self.loads, prefill, strict=True)])
            full = prefill[e]
        self.loads[e].queued[req.rid] = full
        return Decision(e, None if blocks is None else blocks[e])
