"""Routing policies and the router's ledger (oracle probes are plain coroutines here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.replay.router import CostModel, Router
from sidecar.replay.trace import Request

COST = CostModel(overhead_s=0.0, per_token_s=0.001, per_token_ctx_s=0.0, block_tokens=10)
HOSTS = ["a:1", "b:1", "c:1"]


def req(rid: int, blocks: int = 10) -> Request:
    return Request(rid, 0.0, blocks * 10, 1, tuple(range(blocks)))


def oracle(prefix: list[int]) -> Router:
    async def probe(engine: int, keys: list[int], at: float) -> int:
        return prefix[engine]

    return Router("oracle", HOSTS, COST, seed=1, probe=probe)


async def test_router_round_robin_cycles_through_engines() -> None:
    r = Router("round_robin", HOSTS, COST, seed=1)
    assert [(await r.decide(req(i), 0.0)).engine for i in range(4)] == [0, 1, 2, 0]


async def test_router_least_loaded_books_full_prefills_and_picks_the_shortest_queue() -> None:
    r = Router("least_loaded", HOSTS, COST, seed=1)
    first = [(await r.decide(req(i), 0.0)).engine for i in range(3)]
    assert sorted(first) == [0, 1, 2]  # equal queues: the rotation spreads them
    r.started(first[0], 0, end=0.05)  # that engine's running prefill ends soon
    r.started(first[1], 1, end=5.0)
    r.started(first[2], 2, end=5.0)
    assert (await r.decide(req(3), 0.0)).engine == first[0]


async def test_router_oracle_scores_the_cache_hit_into_predicted_ttft() -> None:
    r = oracle([0, 8, 3])
    d = await r.decide(req(0), 0.0)
    assert (d.engine, d.predicted_blocks) == (1, 8)
    # Its queue now holds 0.02 s; still the best (the others would prefill 0.1 / 0.07 s).
    assert r.loads[1].wait_s(0.0) == pytest.approx(COST.prefill_s(100, 80))
    assert (await r.decide(req(1), 0.0)).engine == 1


async def test_router_oracle_leaves_a_cached_host_whose_queue_costs_more_than_the_hit() -> None:
    r = oracle([0, 8, 0])
    r.started(1, 99, end=10.0)  # host b is busy for 10 s
    assert (await r.decide(req(0), 0.0)).engine in (0, 2)


def test_router_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Router("fastest", HOSTS, COST, seed=1)


def test_router_replay_and_demo_do_not_import_engine_hook() -> None:
    code = (
        "import sys, sidecar.replay.cli, sidecar.demo\n"
        "print(','.join(m for m in sys.modules if m.split('.')[0] == 'engine_hook'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""  # engines are child processes (DESIGN §2)
