"""The ZMTP 3.0 SUB peer (sidecar/source/zmtp.py) against libzmq's real PUB socket (pyzmq)."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
import zmq

from sidecar.source.zmtp import ZmtpClosed, ZmtpSub, address


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
            sub.read(got.append)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    await sub.connect(5.0)
    got: list[list[bytes]] = []
    await _until(sub, 1, got, lambda: pub.send_multipart([b"t", b"probe"]))
    got.clear()
    sizes = [0, 1, 255, 256, 70_000, 3, 1 << 20]
    for i, n in enumerate(sizes):
        pub.send_multipart([b"topic", i.to_bytes(8, "big"), bytes([i]) * n])
    await _until(sub, len(sizes), got)
    assert [m[1] for m in got] == [i.to_bytes(8, "big") for i in range(len(sizes))]
    assert [len(m[2]) for m in got] == sizes and all(m[0] == b"topic" for m in got)
    sub.close()


async def test_the_subscription_is_a_prefix_filter(pub: zmq.Socket[bytes]) -> None:
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"kv")
    await sub.connect(5.0)
    got: list[list[bytes]] = []
    await _until(sub, 1, got, lambda: pub.send_multipart([b"kv-probe", b""]))
    got.clear()
    pub.send_multipart([b"other", b"x"])
    pub.send_multipart([b"kv@0", b"y"])
    await _until(sub, 1, got)
    assert got == [[b"kv@0", b"y"]]
    sub.close()


async def test_ipc_and_a_publisher_that_goes_away(pub: zmq.Socket[bytes]) -> None:
    path = os.path.join(tempfile.mkdtemp(), "pub.sock")
    pub.bind(f"ipc://{path}")
    sub = ZmtpSub(f"ipc://{path}", b"")
    await sub.connect(5.0)
    got: list[list[bytes]] = []
    await _until(sub, 1, got, lambda: pub.send_multipart([b"a", b"b", b"c"]))
    assert got[0] == [b"a", b"b", b"c"]
    pub.close(0)
    with pytest.raises(ZmtpClosed):
        async with asyncio.timeout(10):
            while True:  # EOF comes once libzmq has closed its side
                sub.read(got.append)
                await asyncio.sleep(0.01)
    assert sub.sock is None  # closed: the caller reconnects


async def test_a_peer_that_is_not_zmtp_is_refused() -> None:
    async def speak(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n" + b"x" * 80)
        await writer.drain()

    server = await asyncio.start_server(speak, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sub = ZmtpSub(f"tcp://127.0.0.1:{port}", b"")
    with pytest.raises(ZmtpClosed, match="not a ZMTP 3"):
        await sub.connect(5.0)
    assert sub.sock is None
    server.close()


def test_endpoints() -> None:
    assert address("tcp://*:5557")[1] == ("127.0.0.1", 5557)
    assert address("ipc:///tmp/x")[1] == "/tmp/x"
    with pytest.raises(ValueError, match="endpoint"):
        address("inproc://x")
