"""The ZMTP 3.0 SUB peer (sidecar/source/zmtp.py) against libzmq's real PUB socket (pyzmq), over
its message loop in C (sidecar/shm_ring/_accel.c zmtp_messages) and in Python."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading

import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.source import zmtp
from sidecar.source.zmtp import ZmtpClosed, ZmtpSub, address

pytestmark = pytest.mark.usefixtures("accel_backend")


async def _until(sub: ZmtpSub, want: int, got: list[list[bytes]], send: object = None) -> None:
    """Read until `want` messages arrived (the PUB drops what it sends before our subscription
    reaches it, so `send`, when given, re-publishes until the first message lands)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while len(got) < want:
            if send is not None and not got:
                send()  # type: ignore[operator]
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(sub.fileno(), _wake, fut)
            try:
                async with asyncio.timeout(0.05):
                    await fut
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(sub.fileno())
            sub.read(got.append, 1024)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _subscribed(
    pub: zmq.Socket[bytes], endpoint: str, probe: list[bytes], topic: bytes = b""
) -> ZmtpSub:
    """A connected peer whose subscription the PUB has taken: `probe` arrived (the PUB drops
    what it sends before that)."""
    sub = ZmtpSub(endpoint, topic)
    await sub.connect(5.0)
    got: list[list[bytes]] = []
    await _until(sub, 1, got, lambda: pub.send_multipart(probe))
    assert got[0] == probe
    return sub


async def _until_closed(sub: ZmtpSub, match: str | None = None) -> None:
    """Read until the connection ends with ZmtpClosed (matching `match`; bounded)."""
    with pytest.raises(ZmtpClosed, match=match):
        async with asyncio.timeout(10):
            while True:
                sub.read(lambda _m: None, 1024)
                await asyncio.sleep(0.01)
    assert sub.sock is None  # closed: the caller reconnects


@pytest.fixture
def pub() -> object:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    yield sock
    sock.close(0)
    ctx.term()


async def test_messages_of_every_size_arrive_whole_and_in_order(pub: zmq.Socket[bytes]) -> None:
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = await _subscribed(pub, f"tcp://127.0.0.1:{port}", [b"t", b"probe"])
    got: list[list[bytes]] = []
    sizes = [0, 1, 255, 256, 70_000, 3, 1 << 20]
    for i, n in enumerate(sizes):
        pub.send_multipart([b"topic", i.to_bytes(8, "big"), bytes([i]) * n])
    await _until(sub, len(sizes), got)
    assert [m[1] for m in got] == [i.to_bytes(8, "big") for i in range(len(sizes))]
    assert [len(m[2]) for m in got] == sizes and all(m[0] == b"topic" for m in got)
    sub.close()


async def test_the_subscription_is_a_prefix_filter(pub: zmq.Socket[bytes]) -> None:
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = await _subscribed(pub, f"tcp://127.0.0.1:{port}", [b"kv-probe", b""], b"kv")
    got: list[list[bytes]] = []
    pub.send_multipart([b"other", b"x"])
    pub.send_multipart([b"kv@0", b"y"])
    await _until(sub, 1, got)
    assert got == [[b"kv@0", b"y"]]
    sub.close()


async def test_ipc_and_a_publisher_that_goes_away(pub: zmq.Socket[bytes]) -> None:
    path = os.path.join(tempfile.mkdtemp(), "pub.sock")
    pub.bind(f"ipc://{path}")
    sub = await _subscribed(pub, f"ipc://{path}", [b"a", b"b", b"c"])
    pub.close(0)
    await _until_closed(sub)  # EOF (or a reset) once libzmq has closed its side


def _one_peer(answer: bytes, read_first: int) -> tuple[int, threading.Thread]:
    """A TCP peer (a thread) that reads `read_first` bytes, writes `answer`, then waits for
    the client to go: a publisher that is not one, for the client's checks."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            got = b""
            while len(got) < read_first and (chunk := conn.recv(read_first - len(got))):
                got += chunk
            conn.sendall(answer)
            with contextlib.suppress(ConnectionError):  # the client resets what it left unread
                while conn.recv(4096):
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


async def test_a_peer_that_is_not_zmtp_is_refused() -> None:
    port, t = _one_peer(b"HTTP/1.1 400 Bad Request\r\n" + b"x" * 80, 0)
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    with pytest.raises(ZmtpClosed, match="not a ZMTP 3"):
        await sub.connect(5.0)
    assert sub.sock is None
    t.join(10)


def test_endpoints() -> None:
    assert address("tcp://*:5557")[1] == ("127.0.0.1", 5557)
    assert address("ipc:///tmp/x")[1] == "/tmp/x"
    with pytest.raises(ValueError, match="endpoint"):
        address("inproc://x")


async def test_a_read_stops_at_its_limit_and_says_whole_messages_wait(
    pub: zmq.Socket[bytes],
) -> None:
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = await _subscribed(pub, f"tcp://127.0.0.1:{port}", [b"probe"])
    got: list[list[bytes]] = []
    for i in range(5):
        pub.send_multipart([b"t", bytes([i])])
    async with asyncio.timeout(10):  # all five in our buffer, two taken
        while not got:
            sub.read(got.append, 2)
            await asyncio.sleep(0.01)
    while sub.backlog or len(got) < 5:  # the rest without the socket turning readable again
        assert sub.read(got.append, 2) <= 2
        async with asyncio.timeout(10):
            await asyncio.sleep(0)
    assert [m[1] for m in got] == [bytes([i]) for i in range(5)] and not sub.backlog
    sub.close()


async def test_a_peer_that_is_no_publisher_is_refused() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # e.g. the replay endpoint given as the live one
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    try:
        await sub.connect(5.0)
        await _until_closed(sub, "not PUB")
    finally:
        sub.close()
        router.close(0)
        ctx.term()


async def test_a_frame_larger_than_the_bound_ends_the_connection() -> None:
    ready = zmtp._command(b"READY", zmtp._property(b"Socket-Type", b"PUB"))
    long_head = bytes([zmtp.LONG]) + (1 << 40).to_bytes(8, "big")
    port, t = _one_peer(zmtp._GREETING + ready + long_head, 64)
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    await sub.connect(5.0)
    await _until_closed(sub, "at most")
    t.join(10)


async def test_an_abstract_ipc_endpoint_connects(pub: zmq.Socket[bytes]) -> None:
    name = f"kvcm-zmtp-test-{os.getpid()}"
    pub.bind(f"ipc://@{name}")
    sub = await _subscribed(pub, f"ipc://@{name}", [b"x", b"y"])
    sub.close()


async def test_a_kicked_poll_leaves_the_next_poll_its_raw_socket() -> None:
    """What the feed loop relies on (review of 45d5006): pyzmq's asyncio poller removes a raw
    socket's reader in a callback of the turn's end, so a turn ended from outside (the source's
    `_kick`) followed at once by the next poll lost that poll's reader, and data went unseen
    until its timeout. The feed loop yields once after every turn (zmq.py `_feed`)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    poller = zmq.asyncio.Poller()
    poller.register(a, zmq.POLLIN)
    loop = asyncio.get_running_loop()
    try:
        turn = poller.poll(10_000)
        assert isinstance(turn, asyncio.Future)
        loop.call_soon(turn.set_result, [])  # the kick
        assert await turn == []
        await asyncio.sleep(0)  # as the feed loop does (without it, this test fails)
        turn2 = poller.poll(10_000)
        assert isinstance(turn2, asyncio.Future)
        for _ in range(3):
            await asyncio.sleep(0)  # whatever the first turn left queued runs now
        selector = loop._selector  # type: ignore[attr-defined]
        assert a.fileno() in selector.get_map()  # the second poll still watches the socket
        turn2.cancel()
    finally:
        a.close()
        b.close()


_frames = st.lists(st.binary(max_size=300), min_size=1, max_size=4)  # short and LONG frames
_READY = zmtp._command(b"READY", zmtp._property(b"Socket-Type", b"PUB"))
_PING = zmtp._command(b"PING", b"\x00\x10ctx")


class _Refused(Exception):
    """What a message handler raises in the tests below."""


def _encoded(frames: list[bytes], ping_inside: bool = False) -> bytes:
    out = b""
    for i, f in enumerate(frames):
        if ping_inside and i == 1:
            out += _PING  # a command between two frames of one message
        out += zmtp._frame_head(zmtp.MORE if i < len(frames) - 1 else 0, len(f)) + f
    return out


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.tuples(_frames, st.sampled_from(["", "before", "inside"])), max_size=12),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
    limits=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    refuse=st.sets(st.integers(0, 11), max_size=3),
)
def test_any_split_of_the_stream_gives_the_same_messages(
    messages: list[tuple[list[bytes], str]], cuts: list[int], limits: list[int], refuse: set[int]
) -> None:
    """Whole messages, each once and in order, however the bytes arrive, whatever the read
    limit, with PINGs between messages and inside one (commands are the Python loop's: the C
    loop stops at them), and when the handler raises on some (the rest still come)."""
    stream = bytearray(_READY)
    for frames, ping in messages:
        stream += (_PING if ping == "before" else b"") + _encoded(frames, ping == "inside")
    sub = ZmtpSub("tcp://127.0.0.1:1", b"")  # never connected: the parser alone
    got: list[list[bytes]] = []

    def on_message(m: list[bytes]) -> None:
        got.append(m)
        if len(got) - 1 in refuse:
            raise _Refused

    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {len(stream)})
    start, turn = 0, 0
    for end in bounds:
        sub._buf += stream[start:end]
        start = end
        while True:  # read what is whole, `limit` at a time, as read() does
            turn += 1
            try:
                n = sub._parse(on_message, limits[turn % len(limits)])
            except _Refused:
                continue  # that message was taken; what follows it is still there
            if not sub._more or not n:
                break
    assert got == [frames for frames, _ping in messages]
    assert not sub._buf and not sub._frames


def test_a_message_cut_by_a_read_waits_whole_in_the_buffer() -> None:
    """Its first frames are not taken one by one: the next read parses it whole (in C)."""
    sub = ZmtpSub("tcp://127.0.0.1:1", b"")
    msg = _encoded([b"topic", bytes(8), b"x" * 1000])
    sub._buf += _READY + msg[:600]
    got: list[list[bytes]] = []
    assert sub._parse(got.append, 10) == 0
    assert not got and not sub._frames and bytes(sub._buf) == msg[:600]
    sub._buf += msg[600:] + msg
    assert sub._parse(got.append, 10) == 2
    assert got == [[b"topic", bytes(8), b"x" * 1000]] * 2 and not sub._buf


def test_an_oversized_frame_after_good_messages_ends_the_connection_after_them() -> None:
    sub = ZmtpSub("tcp://127.0.0.1:1", b"")
    huge = bytes([zmtp.LONG]) + (zmtp.MAX_FRAME + 1).to_bytes(8, "big")
    sub._buf += _READY + _encoded([b"a"]) + _encoded([b"b", b"c"]) + huge
    got: list[list[bytes]] = []
    with pytest.raises(ZmtpClosed, match="at most"):
        sub._parse(got.append, 10)
    assert got == [[b"a"], [b"b", b"c"]]
