"""Result classification: every transport failure and KVCM code maps to one action.

Against a real aiohttp server on 127.0.0.1:0 that answers each route with a scripted response.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from sidecar.kvcm_client.client import CODE_NAMES, Action, KvcmClient, classify_code
from sidecar.kvcm_client.transport import Hold, Http1
from sidecar.publisher import Backoff

SCRIPT: dict[str, tuple[int, bytes, float]] = {}


async def _handler(request: web.Request) -> web.Response:
    status, body, delay = SCRIPT[request.match_info["route"]]
    if delay:
        await asyncio.sleep(delay)
    return web.Response(status=status, body=body, content_type="application/json")


async def _chunked(request: web.Request) -> web.StreamResponse:
    """The same script, answered with Transfer-Encoding: chunked (in small chunks)."""
    status, body, delay = SCRIPT[request.match_info["route"]]
    if delay:
        await asyncio.sleep(delay)
    resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(0, len(body), 7):
        await resp.write(body[i : i + 7])
    await resp.write_eof()
    return resp


# lean: the daemon's transport (kvcm_client/transport.py) instead of aiohttp's; chunked: the
# server answers in chunks
@pytest.fixture(params=["aiohttp", "lean", "lean_chunked"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[KvcmClient]:
    app = web.Application()
    app.router.add_post("/api/{route}", _handler)
    app.router.add_post("/chunked/api/{route}", _chunked)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}" + ("/chunked" if request.param == "lean_chunked" else "")
    async with aiohttp.ClientSession() as session:
        c = KvcmClient(session, base, max_response_bytes=4096, lean_http=request.param != "aiohttp")
        yield c
        c.close()
    await runner.cleanup()


def _ok(extra: str = "") -> bytes:
    return (
        b'{"header":{"status":{"code":"OK","message":""}},"retry_after_ms":"0"'
        + extra.encode()
        + b"}"
    )


CASES: list[tuple[str, int, bytes, Action, str]] = [
    ("ok", 200, _ok(), Action.OK, "OK"),
    ("ok_numeric_code", 200, b'{"header":{"status":{"code":1}}}', Action.OK, "OK"),
    (
        "camel_case",
        200,
        b'{"header":{"status":{"code":"OK"}},"snapshotRequired":true}',
        Action.OK,
        "OK",
    ),
    ("http_503", 503, b"{}", Action.RETRY, "http_503"),
    ("http_500", 500, b"oops", Action.RETRY, "http_500"),
    ("http_429", 429, b"{}", Action.RETRY, "http_429"),
    ("http_400_empty", 400, b"{}", Action.CIRCUIT_OPEN, "http_400"),
    ("http_404", 404, b"not found", Action.CIRCUIT_OPEN, "http_404"),
    ("http_413", 413, b"{}", Action.CIRCUIT_OPEN, "http_413"),
    ("malformed", 200, b"{not json", Action.RETRY, "malformed_response"),
    ("wrong_types", 200, b'{"header":{"status":{"code":[1]}}}', Action.RETRY, "malformed_response"),
    (
        "bad_retry_after",
        200,
        b'{"header":{"status":{"code":"OK"}},"retry_after_ms":"soon"}',
        Action.RETRY,
        "malformed_response",
    ),
    (
        "bad_version",
        200,
        _ok(',"committed_snapshot_version":"xyz"'),
        Action.RETRY,
        "malformed_response",
    ),
    ("oversize", 200, _ok(',"extra_info":"' + "x" * 5000 + '"'), Action.RETRY, "oversize_response"),
    ("deep", 200, b'{"a":' * 70 + b"1" + b"}" * 70, Action.RETRY, "malformed_response"),
    (
        "rate_limited",
        200,
        b'{"header":{"status":{"code":"SNAPSHOT_RATE_LIMITED"}},"retry_after_ms":"1500"}',
        Action.RETRY,
        "SNAPSHOT_RATE_LIMITED",
    ),
    (
        "not_registered",
        200,
        b'{"header":{"status":{"code":"NODE_NOT_REGISTERED"}}}',
        Action.REREGISTER,
        "NODE_NOT_REGISTERED",
    ),
    (
        "invalid",
        200,
        b'{"header":{"status":{"code":"INVALID_ARGUMENT"}}}',
        Action.CIRCUIT_OPEN,
        "INVALID_ARGUMENT",
    ),
    (
        "partial",
        200,
        b'{"header":{"status":{"code":"INTERNAL_ERROR"}},'
        b'"item_results":["OK","INTERNAL_ERROR","OK","SNAPSHOT_IN_PROGRESS"]}',
        Action.RETRY,
        "INTERNAL_ERROR",
    ),
    (
        "partial_worst_wins",
        200,
        b'{"header":{"status":{"code":"INTERNAL_ERROR"}},'
        b'"item_results":["INTERNAL_ERROR","INVALID_ARGUMENT"]}',
        Action.CIRCUIT_OPEN,
        "INTERNAL_ERROR",
    ),
]


@pytest.mark.parametrize(
    ("route", "status", "body", "action", "reason"), CASES, ids=[c[0] for c in CASES]
)
async def test_client_classifies_response(
    client: KvcmClient, route: str, status: int, body: bytes, action: Action, reason: str
) -> None:
    SCRIPT[route] = (status, body, 0.0)
    result = await client.post(route, b"{}", timeout_s=2)
    assert (result.action, result.reason) == (action, reason)


async def test_client_partial_failure_lists_failed_items_in_order(client: KvcmClient) -> None:
    SCRIPT["p"] = (CASES[18][1], CASES[18][2], 0.0)
    result = await client.post("p", b"{}", timeout_s=2)
    assert result.failed_items == [1, 3]


async def test_client_retry_after_and_snapshot_required_parsed(client: KvcmClient) -> None:
    SCRIPT["r"] = (
        200,
        b'{"header":{"status":{"code":"SNAPSHOT_RATE_LIMITED"}},'
        b'"retry_after_ms":2500,"snapshot_required":true}',
        0.0,
    )
    result = await client.post("r", b"{}", timeout_s=2)
    assert result.retry_after_s == 2.5
    assert result.response is not None and result.response.snapshot_required


async def test_client_timeout_is_retry(client: KvcmClient) -> None:
    SCRIPT["slow"] = (200, _ok(), 1.0)
    result = await client.post("slow", b"{}", timeout_s=0.05)
    assert (result.action, result.reason) == (Action.RETRY, "timeout")


@pytest.mark.parametrize("lean", [False, True])
async def test_client_connection_refused_is_retry(lean: bool) -> None:
    async with aiohttp.ClientSession() as session:
        c = KvcmClient(session, "http://127.0.0.1:9", max_response_bytes=4096, lean_http=lean)
        result = await c.post("x", b"{}", timeout_s=2)
        c.close()
    assert (result.action, result.reason) == (Action.RETRY, "connect")


async def test_client_lean_keeps_one_connection_and_survives_a_timeout(
    client: KvcmClient,
) -> None:
    """Keep-alive: requests reuse the connection; a timed-out request's late answer is never
    read as the next request's (its connection is closed)."""
    SCRIPT["slow"] = (200, b'{"header":{"status":{"code":"SERVER_BUSY"}}}', 0.2)
    SCRIPT["fast"] = (200, _ok(), 0.0)
    assert (await client.post("slow", b"{}", timeout_s=0.05)).reason == "timeout"
    for _ in range(3):
        assert (await client.post("fast", b"{}", timeout_s=2)).ok
    lean = client._lean_for(client.base)
    if lean is not None:
        assert len(lean._idle) == 1


async def test_client_lean_follows_the_base_to_a_new_leader() -> None:
    """Discovery moves `base`: requests go to the new endpoint, and the connections to the old
    one are closed, not reused."""
    seen: list[int] = []
    runners = []
    for n in (1, 2):

        async def handler(request: web.Request, n: int = n) -> web.Response:
            seen.append(n)
            return web.Response(body=_ok(), content_type="application/json")

        app = web.Application()
        app.router.add_post("/api/{route}", handler)
        r = web.AppRunner(app)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", 0).start()
        runners.append(r)
    bases = [f"http://127.0.0.1:{r.addresses[0][1]}" for r in runners]
    async with aiohttp.ClientSession() as session:
        c = KvcmClient(session, bases[0], max_response_bytes=4096, lean_http=True)
        assert (await c.post("x", b"{}", timeout_s=2)).ok
        old = c._lean_for(bases[0])
        c.base = bases[1]
        result = await c.post("x", b"{}", timeout_s=2)
        assert result.ok and result.endpoint == bases[1] and seen == [1, 2]
        assert old is not None and not old._idle
        c.close()
    for r in runners:
        await r.cleanup()


@pytest.mark.parametrize("code", sorted(set(CODE_NAMES.values()) - {"OK"}))
def test_every_kvcm_code_has_a_non_ok_action(code: str) -> None:
    assert classify_code(code, "reportEvent") != Action.OK


def test_instance_not_exist_depends_on_route() -> None:
    assert classify_code("INSTANCE_NOT_EXIST", "registerInstance") == Action.CIRCUIT_OPEN
    assert classify_code("INSTANCE_NOT_EXIST", "reportEvent") == Action.REREGISTER


@given(
    base=st.floats(0.01, 5),
    cap=st.floats(0.01, 60),
    retry_after=st.floats(0, 400),
    attempts=st.integers(1, 40),
    seed=st.integers(),
)
def test_backoff_capped_jittered_never_below_retry_after(
    base: float, cap: float, retry_after: float, attempts: int, seed: int
) -> None:
    cap = max(cap, base)
    b = Backoff(base, cap, retry_after_cap_s=300.0, rng=random.Random(seed))
    for _ in range(attempts):
        d = b.next_delay(retry_after)
        assert d >= min(retry_after, 300.0)
        assert d <= max(cap, min(retry_after, 300.0))
    b.reset()
    assert b.attempt == 0


def _open_client_sockets(port: int) -> int:
    """Sockets to 127.0.0.1:port still held open by a file descriptor (a socket closed with
    unsent bytes lingers in the kernel as an orphan, inode 0, holding nothing of ours)."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[2].rsplit(":", 1)[1], 16) == port and int(f[9]) != 0:
            n += 1
    return n


class _Deaf(asyncio.Protocol):
    """A manager that accepts and never reads (hung, or a partition holding the bytes)."""

    accepted: list[asyncio.Transport] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self.accepted.append(transport)


async def test_client_lean_timeout_against_a_peer_that_stops_reading_frees_the_connection() -> None:
    """A snapshot body that cannot be sent is dropped with its connection when the request
    times out: a graceful close would wait for the peer to read it, keeping the fd and the body
    of every retry (the soak's sidecar: six 5.8 MB bodies, fds 17 -> 26)."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Deaf, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    body = b"x" * (16 << 20)  # far more than the socket buffers take
    lean = Http1(f"http://127.0.0.1:{port}")
    for _ in range(3):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await lean.post("/api/reportEvent", body, 4096)
    await asyncio.sleep(0)  # the aborted transports' close callbacks
    assert _open_client_sockets(port) == 0  # no connection (fd) kept with a retry's body
    lean.close()
    for t in _Deaf.accepted:
        t.abort()
    _Deaf.accepted.clear()
    server.close()
    await server.wait_closed()


class _Prompt(asyncio.Protocol):
    """A manager that answers each request at once and says when its answer is written."""

    BODY = b'{"header":{"status":{"code":"OK"}}}'
    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)

    def __init__(self, wrote: asyncio.Event, close: bool = False) -> None:
        self.wrote = wrote
        self.close = close  # close the connection right after the answer
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, body = self.buf.partition(b"\r\n\r\n")
        if sep and len(body) >= int(head.lower().split(b"content-length: ")[1].split(b"\r")[0]):
            self.buf = b""
            self.transport.write(self.ANSWER)
            if self.close:
                self.transport.close()
            self.wrote.set()


async def _prompt_server(close: bool = False) -> tuple[asyncio.Server, str, asyncio.Event]:
    wrote = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Prompt(wrote, close), "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", wrote


async def test_lean_held_answer_is_read_at_the_poke_not_when_it_comes() -> None:
    """A held request's answer, already on the socket, stays unread (its arrival does not
    wake the process) until the hold is poked; then it is read whole, and the connection
    serves the next request."""
    server, url, wrote = await _prompt_server()
    lean, hold = Http1(url), Hold(60.0)
    try:
        task = asyncio.create_task(lean.post("/api/reportEvent", b"{}", 4096, hold))
        await asyncio.wait_for(wrote.wait(), 10)
        for _ in range(50):  # turns of the loop in which an unpaused answer would be read
            await asyncio.sleep(0)
        assert not task.done() and hold.held == 1 and hold.poked == 0
        assert hold.conn is not None and not hold.conn.buf  # still in the socket: unread
        hold.poke()
        assert await asyncio.wait_for(task, 10) == (200, _Prompt.BODY)
        assert hold.poked == 1 and hold.last_s > 0
        wrote.clear()
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096), 10)
        assert got == (200, _Prompt.BODY)
        assert len(lean._idle) == 1  # one connection, kept alive throughout
    finally:
        lean.close()
        server.close()
        await server.wait_closed()


async def test_lean_held_answer_of_a_peer_that_closed_meanwhile_is_still_read() -> None:
    """The manager answered and closed the connection while the answer was held: the answer
    is read whole at the poke, and the next request does not go out on the closed one."""
    server, url, wrote = await _prompt_server(close=True)
    lean, hold = Http1(url), Hold(60.0)
    try:
        task = asyncio.create_task(lean.post("/api/reportEvent", b"{}", 4096, hold))
        await asyncio.wait_for(wrote.wait(), 10)
        for _ in range(50):
            await asyncio.sleep(0)
        hold.poke()
        assert await asyncio.wait_for(task, 10) == (200, _Prompt.BODY)
        wrote.clear()
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096), 10)
        assert got == (200, _Prompt.BODY)  # on a new connection (this one is closed too)
    finally:
        lean.close()
        server.close()
        await server.wait_closed()


async def test_lean_held_answer_is_read_after_hold_s_without_a_poke() -> None:
    server, url, _wrote = await _prompt_server()
    lean, hold = Http1(url), Hold(0.02)
    try:
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096, hold), 10)
        assert got == (200, _Prompt.BODY) and hold.held == 1 and hold.poked == 0
    finally:
        lean.close()
        server.close()
        await server.wait_closed()


async def test_client_held_post_reports_the_hold_apart_from_latency() -> None:
    """KvcmClient.post(hold=True): the Result says how long the answer sat unread (held_s);
    the request latency histogram leaves it out and counts it as held."""
    from sidecar.metrics.registry import Metrics

    server, url, _wrote = await _prompt_server()
    async with aiohttp.ClientSession() as session:
        c = KvcmClient(session, url, max_response_bytes=4096, lean_http=True, hold_s=0.02)
        try:
            held = await c.post("reportEvent", b"{}", 10.0, hold=True)
            plain = await c.post("reportEvent", b"{}", 10.0)
        finally:
            c.close()
            server.close()
            await server.wait_closed()
    assert held.ok and plain.ok
    assert held.held_s > 0 and plain.held_s == 0
    m = Metrics()
    m.observe("delta", held)
    m.observe("delta", plain)
    reg = m.registry
    assert reg.get_sample_value("kvcm_sidecar_held_answers_total", {"op": "delta"}) == 1
    count = reg.get_sample_value("kvcm_sidecar_request_duration_seconds_count", {"op": "delta"})
    assert count == 1


async def test_daemon_work_signal_pokes_a_held_answer() -> None:
    from sidecar.wakeups import Work

    w, calls = Work(), []
    w.set()  # nothing attached yet
    w.also = lambda: calls.append(1)
    w.set()
    assert w.is_set() and calls == [1]


async def test_lean_hold_skipped_after_a_poke_since_the_request_began() -> None:
    """A poke that came while the request was still connecting (the loop woke for new work)
    ends its hold before it begins; so does a deadline already past (the request's timeout
    keeps at least half for the answer): the answer is read as it comes."""
    server, url, wrote = await _prompt_server()
    lean, hold = Http1(url), Hold(60.0)
    try:
        hold.start(time.monotonic() + 60)
        hold.poke()  # before the request waits
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096, hold), 10)
        assert got == (200, _Prompt.BODY) and hold.held == 0
        hold.start(time.monotonic() - 1)  # no time left to hold
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096, hold), 10)
        assert got == (200, _Prompt.BODY) and hold.held == 0
        hold.start(time.monotonic() + 60)
        wrote.clear()
        task = asyncio.create_task(lean.post("/api/reportEvent", b"{}", 4096, hold))
        await asyncio.wait_for(wrote.wait(), 10)  # sent (the hold begins as it is sent)
        for _ in range(50):
            await asyncio.sleep(0)
        assert not task.done() and hold.held == 1  # held as usual once nothing poked
        hold.poke()
        assert await asyncio.wait_for(task, 10) == (200, _Prompt.BODY)
    finally:
        lean.close()
        server.close()
        await server.wait_closed()


async def test_lean_closed_client_keeps_no_connection_of_a_request_in_flight() -> None:
    """close() (the leader moved) closes the idle connections; one in use by a request then
    in flight is closed when that request ends, not kept idle to the old leader."""
    server, url, wrote = await _prompt_server()
    lean, hold = Http1(url), Hold(60.0)
    try:
        hold.start(time.monotonic() + 60)
        task = asyncio.create_task(lean.post("/api/reportEvent", b"{}", 4096, hold))
        await asyncio.wait_for(wrote.wait(), 10)  # sent (the hold begins as it is sent)
        assert hold.conn is not None
        conn = hold.conn
        lean.close()
        hold.poke()
        assert await asyncio.wait_for(task, 10) == (200, _Prompt.BODY)
        assert lean._idle == [] and conn.closed
    finally:
        server.close()
        await server.wait_closed()


class _Counted(_Prompt):
    """_Prompt that keeps every connection it accepted, and says when one is lost."""

    conns: list[_Counted] = []

    def __init__(self, wrote: asyncio.Event) -> None:
        super().__init__(wrote)
        self.lost = asyncio.Event()
        _Counted.conns.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


@pytest.mark.parametrize("meanwhile", ["peer_closed", "stray_bytes"])
async def test_lean_idle_connection_spoiled_meanwhile_is_not_reused(meanwhile: str) -> None:
    """An idle connection that the manager closed, or on which bytes nobody asked for came,
    is not the next request's: that one goes out on a new connection and gets its own answer
    (a reused one would read the stray 503 as its answer, or fail on the closed socket)."""
    _Counted.conns.clear()
    wrote = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Counted(wrote), "127.0.0.1", 0)
    lean = Http1(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        assert await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096), 10) == (
            200,
            _Prompt.BODY,
        )
        assert len(lean._idle) == 1 and len(_Counted.conns) == 1
        first = _Counted.conns[0]
        if meanwhile == "peer_closed":
            first.transport.close()
            await asyncio.wait_for(first.lost.wait(), 10)  # its FIN is on the client's socket
        else:  # written at once on loopback: on the client's socket when write() returns
            first.transport.write(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
        got = await asyncio.wait_for(lean.post("/api/reportEvent", b"{}", 4096), 10)
        assert got == (200, _Prompt.BODY)
        assert len(_Counted.conns) == 2  # a new connection
        assert len(lean._idle) == 1  # the spoiled one closed, not kept
    finally:
        lean.close()
        server.close()
        await server.wait_closed()
