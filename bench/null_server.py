"""A minimal null KVCM for bench/sidecar.py: `python -m bench.null_server`.

Answers every HTTP/1.1 POST with a fixed OK reportEvent response once the body (Content-Length)
has arrived, in its own process. It is a bare asyncio protocol that counts body bytes without
keeping them, so the figures measure the sidecar's pipeline rather than a web framework on the
other end of the socket. Prints its URL.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import uvloop

BODY = b'{"header":{"status":{"code":"OK","message":""}},"retry_after_ms":"0"}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


class NullHttp(asyncio.Protocol):
    def __init__(self) -> None:
        self.head = b""
        self.body_left = -1  # -1: reading headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport  # uvloop's transports are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            if self.body_left < 0:
                self.head += bytes(view)
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                headers, rest = self.head[:end].lower(), self.head[end + 4 :]
                self.head = b""
                length = 0
                for line in headers.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.body_left = length
                view = memoryview(rest)
            take = min(self.body_left, len(view))
            self.body_left -= take
            view = view[take:]
            if self.body_left == 0:
                self.transport.write(RESPONSE)
                self.body_left = -1


async def main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(NullHttp, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sys.stdout.write(f"null server listening on http://127.0.0.1:{port}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until terminated


if __name__ == "__main__":
    uvloop.run(main())
