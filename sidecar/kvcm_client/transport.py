"""A lean HTTP/1.1 POST over keep-alive connections for the reporter's hot path.

Imports: stdlib only. At engine pace the sidecar posts ~50 small requests a second (one per flush
window); each aiohttp request costs ~0.5 ms of CPU after a quiet 20 ms, most of it Python that
runs on caches gone cold (bench.pace), this path ~0.15 ms (of which ~0.1 is the wake-up itself).
It speaks exactly what the manager needs: `POST` with a body, an answer with Content-Length,
chunked or read-to-close, and keeps one idle connection per concurrent caller (heartbeats and
data requests overlap). Any failure closes that connection: a late answer can never be taken for
the next request's. Only plain `http://` endpoints; the client uses aiohttp for anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import select
import socket
import time
from typing import Any
from urllib.parse import urlsplit


class ConnectFailed(OSError):
    """The manager could not be reached (refused, unreachable, DNS)."""


class TransportFailed(OSError):
    """The connection broke or the answer was not HTTP/1.x as expected."""


def supported(endpoint: str) -> bool:
    u = urlsplit(endpoint)
    return u.scheme == "http" and bool(u.hostname) and not u.query and not u.username


_READ = 1 << 18  # bytes per recv: an answer is small; a snapshot's fits in a few


class _Conn:
    """One keep-alive connection: a non-blocking socket that the client reads and writes
    itself, not an asyncio transport. Nothing watches it while it is idle or its answer is
    held, so an answer's arrival never wakes the process; a read first takes what the socket
    holds (at engine pace the answer is there: one recv, no turn of the loop), and only when
    nothing is there does it wait for the socket to become readable."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        # recv_into this, not recv(_READ): that allocates _READ bytes per read and shrinks
        # them to the answer's size, which glibc served from the heap's top and gave back
        # (two brk calls and fresh pages per window at engine pace, strace)
        self._rx = bytearray(_READ)
        self.closed = False
        # loop.time() by which the request in progress must end (None: no bound): only a wait
        # that really suspends sets a timer for it (at engine pace none does: one timer fewer
        # per request)
        self.deadline: float | None = None
        # Asked once per request whether the idle connection is still good: a poll(0), not a
        # MSG_PEEK recv, whose usual answer (nothing there) is a BlockingIOError built with its
        # strerror every flush window (~4 % of the sidecar's CPU at engine pace, perf).
        self._idle_poll = select.poll()
        self._idle_poll.register(sock, select.POLLIN)

    def reusable(self) -> bool:
        """An idle connection may carry the next request: nothing unread, not closed or reset
        by the peer meanwhile. Any readiness of an idle socket (EOF, an error, stray bytes)
        means no: none of them is the next request's answer."""
        if self.closed or self.buf:
            return False
        return not self._idle_poll.poll(0)

    def send(self, head: bytes, body: bytes | memoryview) -> memoryview | None:
        """Write what the socket takes now; the rest (None: all sent) for `sock_sendall`."""
        try:
            n = self.sock.sendmsg([head, body])
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise TransportFailed(f"send failed: {exc!r}") from None
        if n == len(head) + len(body):
            return None
        if n >= len(head):  # a body larger than the socket takes (a snapshot): no copy of it
            return memoryview(body)[n - len(head) :]
        return memoryview(head[n:] + bytes(body))

    async def more(self) -> bool:
        """Read more bytes, waiting for them if none are there; False once the peer closed
        (or reset) and nothing new came."""
        if self.closed:
            return False
        while True:
            try:
                n = self.sock.recv_into(self._rx)
            except BlockingIOError:
                async with asyncio.timeout_at(self.deadline):
                    await _readable(self.sock)
                continue
            except OSError:
                self.closed = True
                return False
            if not n:
                self.closed = True
                return False
            self.buf += memoryview(self._rx)[:n]
            return True

    def close(self) -> None:
        """Close now, also after a failure: what this process has not handed to the kernel is
        dropped, the kernel's share goes with the orphaned socket, so no fd or body is kept (a
        peer that stops reading, a hung manager or a partition, once kept every abandoned
        request's connection and body: issue #25's soak)."""
        self.closed = True
        self.sock.close()


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _wake, fut)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


class Hold:
    """Where a data request's answer waits unread, so its arrival does not wake the process.

    On this kind of VM each wake-up of the event loop costs ~0.2 ms of CPU however little it
    does, and at engine pace a flush window took two: the source's read at the window's end
    (which sends the delta) and the answer ~1 ms later. A held request's answer stays in its
    socket, unwatched (_Conn), once the request is sent; it is read at the next `poke()` (the
    daemon pokes on every `work` signal: the next window's source read, which wakes the loop
    anyway) or after `hold_s`, whichever comes first. Only the moment KVCM's answer is read
    moves (acked, the next delta after it); KVCM gets every request as soon as before."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._waiter: asyncio.Future[None] | None = None
        self.conn: _Conn | None = None  # the connection whose answer is held (while held)
        self.signals = 0  # pokes so far, held or not (a request skips its hold if one came
        self.since = 0  # after it started: the loop woke for new work while it connected)
        self.deadline = float("inf")  # monotonic: no hold past it (set per request)
        self.held = 0  # requests held (for metrics)
        self.poked = 0  # of those, read at a poke (the others at hold_s)
        self.last_s = 0.0  # how long the last held answer waited unread (at most)

    def start(self, deadline: float) -> None:
        """A request begins: a poke from now on ends its hold (even one before it waits);
        its hold ends by `deadline` (monotonic) at the latest."""
        self.since, self.deadline, self.last_s = self.signals, deadline, 0.0

    def poke(self) -> None:
        self.signals += 1
        w = self._waiter
        if w is not None and not w.done():
            self.poked += 1
            w.set_result(None)

    async def wait(self, conn: _Conn) -> None:
        t0 = time.monotonic()
        hold_s = min(self.hold_s, self.deadline - t0)
        if conn.closed or hold_s <= 0 or self.signals != self.since:
            return
        loop = asyncio.get_running_loop()
        self.held += 1
        self._waiter = w = loop.create_future()
        self.conn = conn
        timer = loop.call_later(hold_s, _wake, w)  # cheaper than asyncio.timeout here
        try:
            await w
        finally:
            timer.cancel()
            self._waiter, self.conn = None, None
            self.last_s = time.monotonic() - t0


def _wake(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_result(None)


class Http1:
    """`await Http1("http://kvcm:6382").post("/api/reportEvent", body, max_bytes)` ->
    (status, body[: max_bytes + 1]). Raises ConnectFailed / TransportFailed; cancellation (the
    caller's timeout) closes the connection in use."""

    def __init__(self, endpoint: str) -> None:
        u = urlsplit(endpoint)
        self.host = u.hostname or ""
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        netloc = self.host if u.port is None else f"{self.host}:{u.port}"
        if ":" in self.host:
            netloc = f"[{self.host}]" if u.port is None else f"[{self.host}]:{u.port}"
        self._host_header = f"Host: {netloc}\r\n"
        self._idle: list[_Conn] = []
        self._closed = False
        self._literal: list[tuple[Any, ...]] = []  # an IP address needs no resolver thread
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(self.host)
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            self._literal = [(family, socket.SOCK_STREAM, 0, "", (self.host, self.port))]

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its request ends."""
        self._closed = True
        for c in self._idle:
            c.close()
        self._idle.clear()

    async def _connect(self, deadline: float | None) -> _Conn:
        while self._idle:
            c = self._idle.pop()
            if c.reusable():
                return c
            c.close()
        async with asyncio.timeout_at(deadline):
            return await self._open()

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        infos = self._literal
        if not infos:  # a name: resolved per connection (the manager's address may move)
            try:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ConnectFailed(str(exc)) from None
        error: OSError = ConnectFailed(f"no address for {self.host}")
        for family, kind, proto, _name, addr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:  # cancelled (the caller's timeout) while connecting
                sock.close()
                raise
            return _Conn(sock)
        raise ConnectFailed(str(error)) from None

    async def post(
        self,
        path: str,
        body: bytes | memoryview,
        max_bytes: int,
        hold: Hold | None = None,
        deadline: float | None = None,
    ) -> tuple[int, bytes]:
        """`hold`: leave the answer unread until the hold ends (Hold). `deadline` (loop.time(),
        None: none): TimeoutError once it passes (a hold ends by its own deadline, Hold.start)."""
        conn = await self._connect(deadline)
        conn.deadline = deadline
        try:
            head = (
                f"POST {self.prefix}{path} HTTP/1.1\r\n{self._host_header}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            rest = conn.send(head, body)
            if rest is not None:
                async with asyncio.timeout_at(deadline):
                    await asyncio.get_running_loop().sock_sendall(conn.sock, rest)
            if hold is not None:
                await hold.wait(conn)
            status, out, keep = await _response(conn, max_bytes)
        except BaseException:
            conn.close()
            raise
        if keep and not conn.closed and not conn.buf and not self._closed:
            self._idle.append(conn)
        else:
            conn.close()
        return status, out


async def _response(conn: _Conn, max_bytes: int) -> tuple[int, bytes, bool]:
    buf = conn.buf
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > 65536 or not await conn.more():
            raise TransportFailed("connection closed before the answer's headers")
    lines = bytes(buf[:end]).split(b"\r\n")
    del buf[: end + 4]
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise TransportFailed(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(parts[1])
    keep = parts[0] == b"HTTP/1.1"
    length = -1
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                raise TransportFailed("bad Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
    if status in (204, 304) or 100 <= status < 200:
        return status, b"", keep
    if chunked:
        return status, await _chunked(conn, max_bytes), keep
    if length < 0:  # read to close
        while await conn.more():
            if len(buf) > max_bytes:
                break
        out = bytes(buf[: max_bytes + 1])
        return status, out, False
    if length > max_bytes:  # what the caller reads: max_bytes + 1, then the connection goes
        while len(buf) <= max_bytes:
            if not await conn.more():
                raise TransportFailed("connection closed inside the answer's body")
        return status, bytes(buf[: max_bytes + 1]), False
    while len(buf) < length:
        if not await conn.more():
            raise TransportFailed("connection closed inside the answer's body")
    out = bytes(buf[:length])
    del buf[:length]
    return status, out, keep


async def _chunked(conn: _Conn, max_bytes: int) -> bytes:
    buf = conn.buf
    out = bytearray()
    while True:
        while (eol := buf.find(b"\r\n")) < 0:
            if not await conn.more():
                raise TransportFailed("connection closed inside a chunked answer")
        size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise TransportFailed("bad chunk size") from None
        del buf[: eol + 2]
        if size == 0:
            while (end := buf.find(b"\r\n")) != 0:  # trailers, then the final empty line
                if end > 0:
                    del buf[: end + 2]
                elif not await conn.more():
                    raise TransportFailed("connection closed inside a chunked answer")
            del buf[:2]
            return bytes(out[: max_bytes + 1])
        while len(buf) < size + 2:
            if not await conn.more():
                raise TransportFailed("connection closed inside a chunked answer")
        if len(out) <= max_bytes:
            out += buf[:size]
        del buf[: size + 2]
