"""Leader discovery: `Discovery.step()` against real aiohttp nodes on 127.0.0.1:0, each with a
scripted getClusterInfo answer; `parse()` on the reply shapes; seeds in the config.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar import config as C
from sidecar.kvcm_client.client import Action, KvcmClient, Result
from sidecar.kvcm_client.discovery import (
    MAX_ROUNDS,
    Discovery,
    Outcome,
    Trigger,
    parse,
)

OK_HEADER = {"status": {"code": "OK", "message": ""}}


def reply(self_id: str, leader_id: str, port: int, **over: Any) -> dict[str, Any]:
    ep = {"node_id": leader_id, "host": "127.0.0.1", "meta_rpc_port": 0, "meta_http_port": port}
    return {
        "header": OK_HEADER,
        "self_node_id": self_id,
        "leader_node_id": leader_id,
        "leader_endpoint": ep,
        **over,
    }


class FakeNode:
    """A real HTTP server whose getClusterInfo answer (status, JSON) the test sets."""

    def __init__(self) -> None:
        self.answer: tuple[int, Any] = (404, {})
        self.asked = 0
        self.port = 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/getClusterInfo", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    async def _handle(self, request: web.Request) -> web.Response:
        self.asked += 1
        status, body = self.answer
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, content_type="application/json")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


Make = Callable[..., Awaitable[tuple[Discovery, list[FakeNode]]]]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    nodes: list[FakeNode] = []
    sessions: list[aiohttp.ClientSession] = []

    async def build(n: int, *extra_seeds: str) -> tuple[Discovery, list[FakeNode]]:
        fresh = [FakeNode() for _ in range(n)]
        for f in fresh:
            await f.start()
        nodes.extend(fresh)
        session = aiohttp.ClientSession()
        sessions.append(session)
        seeds = (*extra_seeds, *(f.url for f in fresh))
        client = KvcmClient(session, seeds[0], 1 << 16)
        d = Discovery(seeds, session, client, timeout_s=2.0, interval_s=30.0, rng=random.Random(1))
        return d, fresh

    yield build
    for s in sessions:
        await s.close()
    for f in nodes:
        await f.stop()


def failed(d: Discovery, reason: str) -> Result:
    return Result(Action.RETRY, reason, endpoint=d.client.base)


async def test_discovery_moves_the_client_to_the_leader_a_seed_names(make: Make) -> None:
    d, (a, b) = await make(2)
    a.answer = (200, reply("a", "b", b.port))
    b.answer = (200, reply("b", "b", b.port))
    changes: list[str] = []
    d.on_change = lambda leader: changes.append(leader.url)
    assert await d.step()
    assert d.client.base == b.url and d.leader.node_id == "b"
    assert changes == [b.url] and d.leader_changes == 1
    assert d.outcomes[Outcome.OK] == 1 and d.wanted is None
    assert d.status()["manager_leader"] == b.url


async def test_discovery_older_kvcm_404_keeps_the_seed(make: Make) -> None:
    d, (a,) = await make(1)
    a.answer = (404, {})
    assert await d.step()
    assert d.client.base == a.url and d.leader_changes == 0
    assert d.outcomes[Outcome.UNSUPPORTED] == 1
    assert d.status()["manager_discovery"] == "seed"


async def test_discovery_unsupported_code_keeps_the_seed(make: Make) -> None:
    d, (a,) = await make(1)
    a.answer = (200, {"header": {"status": {"code": "UNSUPPORTED"}}})
    assert await d.step()
    assert d.client.base == a.url and d.outcomes[Outcome.UNSUPPORTED] == 1


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        {"header": OK_HEADER, "leader_node_id": "b"},  # no leader_endpoint
        reply("a", "b", 0),  # port 0
        reply("a", "b", 70000),  # port out of range
        reply("a", "b", 1, leader_endpoint={"node_id": "b", "host": "h/x", "meta_http_port": 1}),
        reply("a", "b", 1, leader_endpoint={"node_id": "c", "host": "h", "meta_http_port": 1}),
    ],
)
async def test_discovery_malformed_reply_is_counted_and_ignored(make: Make, body: Any) -> None:
    d, (a,) = await make(1)
    a.answer = (200, body)
    assert not await d.step()
    assert d.client.base == a.url and d.leader_changes == 0
    assert d.outcomes[Outcome.MALFORMED] == 1
    assert d.wanted is Trigger.START and d.next_round_at > 0  # retried, after a backoff


async def test_discovery_not_leader_asks_that_node_first_and_ignores_its_self_claim(
    make: Make,
) -> None:
    d, (a, b) = await make(2)
    a.answer = (200, reply("a", "a", a.port))  # a follower that names itself
    b.answer = (200, reply("b", "b", b.port))
    assert await d.step()  # believed at first: nothing contradicts it yet
    assert d.client.base == a.url
    d.note(failed(d, "SERVER_NOT_LEADER"))
    assert d.wanted is Trigger.NOT_LEADER
    asked = a.asked
    assert await d.step()
    assert a.asked == asked + 1  # asked first: it is up, and may know the leader
    assert d.outcomes[Outcome.FALSE_LEADER] == 1
    assert d.client.base == b.url


async def test_discovery_stale_leader_retries_with_backoff_then_gives_up(make: Make) -> None:
    d, (a, b) = await make(2)
    a.answer = b.answer = (200, reply("x", "a", a.port))
    assert await d.step()
    d.note(failed(d, "connect"))  # the leader stopped answering; followers still name it
    a.answer = (500, {})
    delays = []
    for _ in range(MAX_ROUNDS):
        before = d.clock()
        assert not await d.step()
        delays.append(d.next_round_at - before)
    assert d.outcomes[Outcome.STALE] == MAX_ROUNDS  # b, every round
    assert d.outcomes[Outcome.UNREACHABLE] == MAX_ROUNDS  # a itself, asked last
    assert all(0 <= x <= 1.0 + 0.1 for x in delays)
    assert d.wanted is None and d.suspect is None  # bounded: given up until the next trigger
    assert d.client.base == a.url


async def test_discovery_finds_the_new_leader_after_an_election(make: Make) -> None:
    d, (a, b, c) = await make(3)
    for n in (a, b, c):
        n.answer = (200, reply("x", "a", a.port))
    assert await d.step()
    d.note(failed(d, "connect"))
    a.answer = (500, {})
    assert not await d.step()  # no election yet: b and c name a
    c.answer = (200, reply("c", "c", c.port))  # c took the lease; b has not noticed yet
    assert await d.step()
    assert d.client.base == c.url and d.leader_changes == 1


async def test_discovery_named_leader_that_does_not_confirm_is_not_taken(make: Make) -> None:
    """A seed names a leader at a port where nothing answers (or a node that is no leader):
    the client stays where it works."""
    d, (a, b) = await make(2)
    a.answer = (200, reply("a", "z", 9))  # nothing listens on the discard port
    b.answer = (200, reply("b", "a", a.port))  # b names a, but a names z
    assert await d.step()  # b's answer names a, the leader in use
    assert d.client.base == a.url and d.leader_changes == 0
    assert d.outcomes[Outcome.STALE] == 1 and d.outcomes[Outcome.UNREACHABLE] == 1


async def test_discovery_dead_first_seed_is_skipped(make: Make) -> None:
    d, (b,) = await make(1, "http://127.0.0.1:9")  # nothing listens on the discard port
    b.answer = (200, reply("b", "b", b.port))
    assert await d.step()
    assert d.client.base == b.url
    assert d.outcomes[Outcome.UNREACHABLE] == 1 and d.outcomes[Outcome.OK] == 1


async def test_discovery_ignores_failures_of_a_leader_already_left(make: Make) -> None:
    d, (a, b) = await make(2)
    a.answer = (200, reply("a", "b", b.port))
    b.answer = (200, reply("b", "b", b.port))
    assert await d.step()
    d.note(Result(Action.RETRY, "SERVER_NOT_LEADER", endpoint=a.url))  # an old request's answer
    assert d.wanted is None
    d.note(failed(d, "INTERNAL_ERROR"))  # not a leader problem
    assert d.wanted is None


def test_discovery_parse_accepts_camel_case_and_string_ports() -> None:
    body = json.dumps(
        {
            "header": {"status": {"code": 1}},
            "selfNodeId": "a",
            "leaderNodeId": "b",
            "leaderEndpoint": {"nodeId": "b", "host": "10.0.0.2", "metaHttpPort": "6382"},
        }
    ).encode()
    outcome, leader, named_self, _ = parse(body)
    assert outcome is Outcome.OK and leader is not None and not named_self
    assert leader.url == "http://10.0.0.2:6382" and leader.node_id == "b"


def test_discovery_parse_ipv6_host_is_bracketed() -> None:
    ep = {"node_id": "a", "host": "::1", "meta_http_port": 6382}
    _, leader, _, _ = parse(json.dumps(reply("a", "a", 6382) | {"leader_endpoint": ep}).encode())
    assert leader is not None and leader.url == "http://[::1]:6382"


# ---- config ------------------------------------------------------------------------------
GOOD = {
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "10.0.0.1:80",
}


def test_config_endpoint_takes_a_comma_separated_seed_list() -> None:
    cfg = C.load(
        env={**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": " http://a:1/, https://b:2 ,http://c:3"}
    )
    assert cfg.manager.seeds == ("http://a:1", "https://b:2", "http://c:3")
    assert cfg.manager.discovery_interval_s == 30.0


def test_config_one_endpoint_is_one_seed() -> None:
    cfg = C.load(env={**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://kvcm:6382"})
    assert cfg.manager.seeds == ("http://kvcm:6382",)


@pytest.mark.parametrize("bad", ["http://a:1,ftp://b:2", "http://a:1,,http://b:2", "http://a:1,b"])
def test_config_bad_seed_names_the_field(bad: str) -> None:
    with pytest.raises(
        C.ConfigError, match=r"env KV_CACHE_EVENT_MANAGER_ENDPOINT.*manager\.endpoint"
    ):
        C.load(env={**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": bad})


def test_config_discovery_interval_must_be_positive() -> None:
    env = {**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://a:1"}
    with pytest.raises(C.ConfigError, match=r"manager\.discovery_interval_s"):
        C.load(env={**env, "KV_CACHE_EVENT_MANAGER_DISCOVERY_INTERVAL_S": "0"})


def test_config_redacts_credentials_of_every_seed() -> None:
    cfg = C.load(env={**GOOD, "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://u:p@a:1,http://v:q@b:2"})
    assert C.redacted(cfg)["manager"]["endpoint"] == "http://***@a:1,http://***@b:2"


def test_redis_is_imported_only_in_cluster_mode() -> None:
    """redis-py is the optional `cluster` extra: the sidecar and a standalone server never
    load it."""
    code = (
        "import sys, sidecar.cli, sidecar.daemon, sidecar.kvcm_server.app, "
        "sidecar.kvcm_client.discovery; print('redis' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
