"""A SUB peer speaking ZMTP 3.0 on a plain socket: the ZMQ source's live stream without libzmq.

Imports: stdlib only (and the project's optional C loops, sidecar/shm_ring/compiled.py, which
are too). With libzmq, a thread of its own receives every engine batch as it arrives
(at engine pace, one wake-up of that thread per batch: ~0.4 % of a core at 5 k events/s,
bench.zmtp_probe); here the batches wait in the kernel's socket buffer until the source reads
them, once per flush window, on its own event loop. `source.zmq.transport = zmtp` (connect
mode only: the engine binds, as vLLM does for tcp://*:P and ipc://).

What it speaks (ZMTP 3.0, NULL mechanism): our greeting (version 3.0, so the publisher takes
subscriptions as messages), READY with Socket-Type SUB, then one subscription message (0x01 +
topic). Frames are flags (MORE 0x01, LONG 0x02, COMMAND 0x04) + a 1- or 8-byte size + body;
commands (the peer's READY, PING) are not message frames; a PING gets its PONG. Any protocol
error or EOF ends the connection (ZmtpClosed); the caller reconnects, as libzmq would, and the
seq gap it leaves is the source's to repair (replay), as after a libzmq reconnect.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from sidecar.shm_ring import compiled

_SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"
_GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
_READ = 1 << 18  # bytes per recv_into
_TURN_BYTES = 8 << 20  # at most this much read per call (the event loop's other work waits)
MAX_FRAME = 256 << 20  # a larger frame is a broken or hostile peer: the connection ends
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
_REREAD_FRAMES = 16  # a message cut by a read is parsed again whole (up to this many frames)
_PUBLISHERS = (b"PUB", b"XPUB")  # the peers a SUB speaks to


class ZmtpClosed(OSError):
    """The connection ended: EOF, a reset, or the peer broke the protocol."""


def address(endpoint: str) -> tuple[int, str | tuple[str, int]]:
    """(family, address) of a tcp://host:port or ipc://path endpoint; ValueError otherwise."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path.startswith("@"):  # Linux's abstract namespace, as libzmq spells it
            path = "\0" + path[1:]
        return socket.AF_UNIX, path
    u = urlsplit(endpoint.replace("://*:", "://127.0.0.1:"))
    if u.scheme != "tcp" or not u.hostname or u.port is None:
        raise ValueError(f"not a tcp://host:port or ipc:// endpoint: {endpoint!r}")
    family = socket.AF_INET6 if ":" in u.hostname else socket.AF_INET
    return family, (u.hostname, u.port)


def _command(name: bytes, body: bytes = b"") -> bytes:
    payload = bytes([len(name)]) + name + body
    return bytes([COMMAND, len(payload)]) + payload  # short: every command this peer sends


class ZmtpSub:
    """One connection to a publisher. `await connect()`, then `read(on_message)` whenever the
    socket may hold data; `close()`. A message is a list of frames (bytes)."""

    def __init__(self, endpoint: str, topic: bytes) -> None:
        self.family, self.addr = address(endpoint)
        self.topic = topic
        self.sock: socket.socket | None = None
        self._buf = bytearray()
        self._rx = bytearray(_READ)
        self._ready = False  # ... and its READY command
        self._frames: list[bytes] = []  # the message being read (frames so far)
        self._more = False  # the last parse stopped at its limit (whole messages may wait)

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    async def connect(self, timeout_s: float) -> None:
        """Connect and send our greeting, READY and subscription; OSError if it cannot."""
        self.close()
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if self.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, self.addr)
                # READY only once the peer's greeting is in: libzmq (4.3) fails the handshake
                # (an unexpected command) when it comes in the greeting's segment
                await loop.sock_sendall(sock, _GREETING)
                greeting = b""
                while len(greeting) < 64:
                    chunk = await loop.sock_recv(sock, 64 - len(greeting))
                    if not chunk:
                        raise ZmtpClosed("closed by the publisher during the greeting")
                    greeting += chunk
            if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
                raise ZmtpClosed("the peer is not a ZMTP 3 publisher")
            if greeting[12:32].rstrip(b"\0") != b"NULL":
                raise ZmtpClosed("the peer asks for a security mechanism (only NULL is spoken)")
            ready = _command(b"READY", _property(b"Socket-Type", b"SUB"))
            sub = b"\x01" + self.topic
            hello = ready + _frame_head(0, len(sub)) + sub
            if sock.send(hello) != len(hello):  # a fresh socket's buffer takes ~100 bytes
                raise ZmtpClosed("could not send READY and the subscription")
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._buf.clear()
        self._ready = self._more = False
        self._frames = []

    @property
    def backlog(self) -> bool:
        """Bytes read but not parsed yet (a read that stopped at its limit): the socket may
        not turn readable again for them, so the caller reads again without a poll."""
        return bool(self._buf) and self._more

    def read(self, on_message: Callable[[list[bytes]], None], limit: int) -> int:
        """Hand each complete message to `on_message`, at most `limit`: first those already
        read, then what the socket holds (without waiting, at most ~8 MiB); the number of
        messages. ZmtpClosed when the connection ended (what was complete before it was
        handed over)."""
        sock = self.sock
        if sock is None:
            raise ZmtpClosed("not connected")
        if self._more:
            count = self._parsed(on_message, limit)
            if count >= limit:
                return count
        else:
            count = 0
        buf, rx = self._buf, self._rx
        got = 0
        ended: str | None = None
        while got < _TURN_BYTES:
            try:
                n = sock.recv_into(rx)
            except BlockingIOError:
                break
            except OSError as exc:
                ended = f"recv failed: {exc!r}"
                break
            if not n:
                ended = "closed by the publisher"
                break
            buf += memoryview(rx)[:n]
            got += n
        count += self._parsed(on_message, limit - count)
        if ended is not None and not self._more:
            self.close()
            raise ZmtpClosed(ended)
        return count

    def _parsed(self, on_message: Callable[[list[bytes]], None], limit: int) -> int:
        try:
            return self._parse(on_message, limit)
        except ZmtpClosed:
            self.close()
            raise

    def _parse(self, on_message: Callable[[list[bytes]], None], limit: int) -> int:
        buf = self._buf
        count = 0
        self._more = False
        accel = compiled.accel
        if accel is not None and self._ready and not self._frames and buf:
            # The steady state in one C call: the whole messages of data frames at the front
            # (~5 us of this loop per message, cold); it stops where this loop has work (a
            # command, an oversized frame, a message not all here), which goes on from there.
            messages, ends = accel.zmtp_messages(buf, limit, MAX_FRAME)
            done = 0
            try:
                for message in messages:
                    done += 1
                    on_message(message)
            finally:  # (one that raised is taken, as below; those after it stay)
                if done:
                    del buf[: ends[done - 1]]
            count = len(messages)
        pos, end = 0, len(buf)
        frames = self._frames
        start = -1 if frames else 0  # where the message being read began (-1: not in buf)
        view = memoryview(buf)
        try:
            while pos + 2 <= end:
                if count >= limit:
                    self._more = True  # whole messages may wait in the buffer
                    break
                flags = buf[pos]
                if flags & LONG:
                    if pos + 9 > end:
                        break
                    size = int.from_bytes(view[pos + 1 : pos + 9], "big")
                    head = 9
                else:
                    size, head = buf[pos + 1], 2
                if size > MAX_FRAME:
                    raise ZmtpClosed(f"a frame of {size} bytes (at most {MAX_FRAME})")
                if pos + head + size > end:
                    break
                body = bytes(view[pos + head : pos + head + size])
                pos += head + size
                if flags & COMMAND:
                    self._on_command(body)
                    start = -1 if frames else pos  # (one inside a message is not read twice)
                    continue
                if not self._ready:
                    raise ZmtpClosed("a message before the peer's READY")
                frames.append(body)
                if not flags & MORE:
                    self._frames = []
                    on_message(frames)
                    frames = self._frames
                    count += 1
                    start = pos
            if frames and start >= 0 and len(frames) <= _REREAD_FRAMES:
                # A message not all here yet stays in the buffer, whole: the next read takes
                # it with what follows, in C, instead of going on frame by frame here.
                frames.clear()
                pos = start
        finally:
            view.release()
            del buf[:pos]
        return count

    def _on_command(self, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ZmtpClosed("a malformed command")
        name = body[1 : 1 + body[0]]
        if name == b"READY":
            kind = _properties(body[1 + body[0] :]).get(b"socket-type", b"")
            if kind.upper() not in _PUBLISHERS:
                raise ZmtpClosed(f"the peer is a {kind.decode(errors='replace')!r} socket, not PUB")
            self._ready = True
        elif name == b"ERROR":
            raise ZmtpClosed(f"the publisher sent ERROR {body[2 + body[0] :][:80]!r}")
        elif name == b"PING" and self.sock is not None:
            # PONG carries the PING's context (after its 2-byte TTL)
            context = body[1 + body[0] + 2 :][:16]
            pong = _command(b"PONG", context)
            try:
                sent = self.sock.send(pong)
            except OSError as exc:
                raise ZmtpClosed(f"could not answer a PING: {exc!r}") from None
            if sent != len(pong):  # half a frame would corrupt what follows
                raise ZmtpClosed("could not answer a PING: the send buffer is full")


def _properties(data: bytes) -> dict[bytes, bytes]:
    """A READY's metadata: name (1-byte size), value (4-byte size), ...; lower-cased names."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        n = data[pos]
        name = data[pos + 1 : pos + 1 + n]
        size = int.from_bytes(data[pos + 1 + n : pos + 5 + n], "big")
        out[name.lower()] = data[pos + 5 + n : pos + 5 + n + size]
        pos += 5 + n + size
    return out


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value


def _frame_head(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | LONG]) + size.to_bytes(8, "big")
    return bytes([flags, size])
