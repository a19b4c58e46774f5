"""The router query client (sidecar/kvcm_client/query.py) against the KVCM-compatible server on
127.0.0.1 (port 0), and the replay's kvcm policy deciding from its answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from sidecar.kvcm_client.query import QueryClient, QueryError
from sidecar.kvcm_server.app import KvcmServer
from sidecar.replay.router import CostModel, Router
from sidecar.replay.trace import Request
from tests.integration.test_kvcm_server import HEARTBEAT, IID, REG, REGISTER, Api, add, code, start

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
KEYS = [11, -12, 13, 14]


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    server = KvcmServer(bootstrap=True)
    async with aiohttp.ClientSession() as session:
        a, runner = await start(server, session)
        assert code(await a("registerInstance", REG)) == "OK"
        # Host A holds the first three keys, host B only the first.
        assert code(await a.report(REGISTER, HEARTBEAT, *map(add, KEYS[:3]), host=A)) == "OK"
        assert code(await a.report(REGISTER, HEARTBEAT, add(KEYS[0]), host=B)) == "OK"
        yield a
        await runner.cleanup()


async def test_query_host_cache_state_gives_each_hosts_prefix(api: Api) -> None:
    q = QueryClient(api.session, api.base)
    state = await q.get_host_cache_state(IID, KEYS)
    assert set(state) == {A, B}
    assert (state[A].local, state[B].local) == (3, 1)
    assert state[A].p2p_1_total_match == 3


async def test_query_host_cache_state_omits_hosts_without_the_first_key(api: Api) -> None:
    q = QueryClient(api.session, api.base)
    assert await q.get_host_cache_state(IID, [99, *KEYS]) == {}


async def test_query_cache_location_prefix_stops_at_the_first_miss(api: Api) -> None:
    q = QueryClient(api.session, api.base)
    rows = await q.get_cache_location(IID, KEYS)
    assert len(rows) == 3
    assert rows[0].type == "ST_EVENT_REPORT_L1P5"  # the storage the block was reported to
    assert rows[0].spec_size == len(rows[0].location_specs) == 2  # on A and on B
    assert rows[0].location_specs[0].uri.startswith("event_report://h/hbm")
    batch = await q.get_cache_location(IID, KEYS, query_type="QT_BATCH_GET")
    assert [r.spec_size for r in batch] == [2, 1, 1, 0]


async def test_query_unknown_instance_is_a_query_error_naming_the_code(api: Api) -> None:
    q = QueryClient(api.session, api.base)
    with pytest.raises(QueryError, match="INSTANCE_NOT_EXIST"):
        await q.get_host_cache_state("nope", KEYS)


async def test_query_unreachable_server_is_a_query_error() -> None:
    async with aiohttp.ClientSession() as s:
        q = QueryClient(s, "http://127.0.0.1:9", timeout_s=2)
        with pytest.raises(QueryError, match="getHostCacheState"):
            await q.get_host_cache_state(IID, KEYS)


async def test_query_kvcm_policy_routes_to_the_host_with_the_longest_prefix(api: Api) -> None:
    cost = CostModel(block_tokens=512)
    r = Router(
        "kvcm", [B, A], cost, seed=1, query=QueryClient(api.session, api.base), instance_id=IID
    )
    d = await r.decide(Request(0, 0.0, 4 * 512, 1, tuple(KEYS)), 0.0)
    assert (d.engine, d.predicted_blocks) == (1, 3)


async def test_query_kvcm_policy_counts_a_failed_query_and_routes_on_load_alone() -> None:
    async with aiohttp.ClientSession() as s:
        q = QueryClient(s, "http://127.0.0.1:9", timeout_s=2)
        r = Router("kvcm", [A, B], CostModel(block_tokens=512), seed=1, query=q, instance_id=IID)
        r.started(0, 99, end=5.0)  # A is busy: with no cache view, B's empty queue wins
        d = await r.decide(Request(0, 0.0, 4 * 512, 1, tuple(KEYS)), 0.0)
        assert (d.engine, d.predicted_blocks, r.query_errors) == (1, 0, 1)
