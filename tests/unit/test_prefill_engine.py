"""The prefill engine's virtual-time queue, driven through step()/advance() (no process)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from engine_hook.block_cache import BlockCache, GroupSpec
from sidecar.replay.router import CostModel
from sidecar.testbed.prefill_engine import Cost, PrefillEngine, cached_tokens


class Hook:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def stored(self, keys: Any, group: int = 0) -> None:
        self.calls.append(("stored", keys))

    def removed(self, keys: Any, group: int = 0) -> None:
        self.calls.append(("removed", keys))

    def cleared(self) -> None:
        self.calls.append(("cleared", 0))

    def set_snapshot_provider(self, provider: Any) -> None:
        pass

    def flush(self, wait: bool = False) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {"dropped": 0}


COST = Cost(overhead_s=1.0, per_token_s=0.1, per_token_ctx_s=0.0)


def engine(capacity: int = 8) -> tuple[PrefillEngine, Hook]:
    hook = Hook()
    cache = BlockCache(capacity, 4, [GroupSpec("full")], hook)
    return PrefillEngine(cache, hook, COST, block_tokens=4), hook


def events(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_prefill_engine_queues_fifo_and_ttft_is_wait_plus_prefill(
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, _ = engine()
    e.step({"op": "req", "id": 0, "at": 0.0, "keys": [1, 2], "tokens": 8})
    e.step({"op": "req", "id": 1, "at": 1.0, "keys": [3], "tokens": 4})
    e.advance(100.0)
    starts = {m["id"]: m for m in events(capsys) if m["ev"] == "start"}
    assert starts[0]["start"] == 0.0 and starts[0]["end"] == pytest.approx(1.0 + 0.8)
    # The second waits for the first (1.8 > 1.0), then prefills 4 tokens.
    assert starts[1]["start"] == pytest.approx(1.8)
    assert starts[1]["end"] == pytest.approx(1.8 + 1.4)


def test_prefill_engine_looks_up_the_cache_at_start_and_stores_at_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, hook = engine()
    e.step({"op": "req", "id": 0, "at": 0.0, "keys": [1, 2], "tokens": 8})
    assert hook.calls == []  # nothing is cached before the prefill ends
    # Arrives while 0 runs; starts after 0 ended, so 0's blocks are a hit by then.
    e.step({"op": "req", "id": 1, "at": 0.5, "keys": [1, 2, 3], "tokens": 12})
    e.advance(100.0)
    out = events(capsys)
    arrive = next(m for m in out if m["ev"] == "arrive" and m["id"] == 1)
    start = next(m for m in out if m["ev"] == "start" and m["id"] == 1)
    assert arrive["prefix"] == 0
    assert start["cached"] == 8
    assert [k for op, k in hook.calls if op == "stored"] == [1, 2, 3]
    assert [m["id"] for m in out if m["ev"] == "done"] == [0, 1]


def test_prefill_engine_applies_due_ends_before_a_later_arrival(
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, _ = engine()
    e.step({"op": "req", "id": 0, "at": 0.0, "keys": [1], "tokens": 4})
    # The process is late: the next message arrives without advance() having run in between.
    e.step({"op": "probe", "id": 7, "at": 50.0, "keys": [1, 5]})
    out = events(capsys)
    assert [m["ev"] for m in out] == ["arrive", "start", "done", "probe"]
    assert out[-1]["prefix"] == 1


def test_prefill_engine_lru_evicts_and_reset_clears(capsys: pytest.CaptureFixture[str]) -> None:
    e, hook = engine(capacity=2)
    e.step({"op": "req", "id": 0, "at": 0.0, "keys": [1, 2, 3], "tokens": 12})
    e.step({"op": "reset"})
    out = events(capsys)
    assert ("removed", 1) in hook.calls and hook.calls[-1] == ("cleared", 0)
    assert out[-1] == {"ev": "reset"}
    assert e.cache.published() == set()


def test_prefill_engine_at_least_one_token_is_computed() -> None:
    assert cached_tokens(3, 4, 12) == 11
    assert cached_tokens(2, 4, 10) == 8


@pytest.mark.parametrize(("tokens", "cached"), [(1, 0), (15_000, 0), (15_000, 10_240), (40, 39)])
def test_prefill_engine_cost_equals_the_routers_model(tokens: int, cached: int) -> None:
    engine_cost, router_cost = Cost(), CostModel()
    assert engine_cost.prefill_s(tokens, cached) == router_cost.prefill_s(tokens, cached)


def test_prefill_engine_import_loads_nothing_heavy_and_no_sidecar_core() -> None:
    code = (
        "import sys, sidecar.testbed.prefill_engine\n"
        "bad = [m for m in ('aiohttp', 'uvloop', 'prometheus_client', 'msgspec', 'sidecar.replay')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
