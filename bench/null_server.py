"""A minimal null KVCM for bench/sidecar.py: `python -m bench.null_server [--record]`.

Answers every HTTP/1.1 POST with a fixed OK reportEvent response once the body (Content-Length)
has arrived, in its own process (getClusterInfo: itself as the leader, so leader discovery
settles in one round, as against a real KVCM). It is a bare asyncio protocol, so the figures
measure the sidecar's pipeline rather than a web framework on the other end of the socket.
Prints its URL.

With `--delay-ms N` it answers each POST N ms after its body arrived (the arrival is still noted
at once): a manager across a network, for bench.pace's `--manager-delay-ms`.

With `--record` it also notes when each block key first arrived (one regex over each body) and
serves (and forgets) them on `GET /debug/arrivals` in the stand-in's format (`GET
/debug/arrival?key=K`: one key's arrival, kept; `GET /debug/stats`: requests and body bytes
received so far, for bench.pace's requests/s and bytes per event): the latency
benchmark then measures engine -> ring -> sidecar -> bytes at the manager, without the Python
stand-in's own processing time (which, sharing this 2-vCPU VM with the engine simulator and
the sidecar, saturates at 100k events/s).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from typing import Any

import uvloop

BODY = b'{"header":{"status":{"code":"OK","message":""}},"retry_after_ms":"0"}'
KEY = re.compile(rb'"block_key":"(\d+)"')
U64 = 1 << 64


def _response(body: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    return head + str(len(body)).encode() + b"\r\n\r\n" + body


OK = _response(BODY)
CLUSTER_INFO = b""  # getClusterInfo's answer, naming this server the leader (set in main)
ARRIVALS: dict[str, float] = {}  # bare floats: a list per key made the collector pause this
STATS = {"requests": 0, "body_bytes": 0}


class NullHttp(asyncio.Protocol):
    record = False
    delay_s = 0.0  # --delay-ms: answer POSTs this much later (a manager across a network)

    def __init__(self) -> None:
        self.head = b""
        self.body_left = -1  # -1: reading headers
        self.request_line = b""
        self.chunks: list[bytes] = []

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
                headers, rest = self.head[:end], self.head[end + 4 :]
                self.head = b""
                self.request_line = headers.split(b"\r\n", 1)[0]
                length = 0
                for line in headers.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.body_left = length
                if not self.request_line.startswith(b"GET "):
                    STATS["requests"] += 1
                    STATS["body_bytes"] += length
                view = memoryview(rest)
            take = min(self.body_left, len(view))
            if self.record and take:
                self.chunks.append(bytes(view[:take]))
            self.body_left -= take
            view = view[take:]
            if self.body_left == 0:
                self.body_left = -1
                if self.delay_s and not self.request_line.startswith(b"GET "):
                    answer = self._answer()
                    asyncio.get_running_loop().call_later(self.delay_s, self._write, answer)
                else:
                    self.transport.write(self._answer())

    def _write(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)

    def _answer(self) -> bytes:
        if self.request_line.startswith(b"GET /debug/arrivals"):
            body = json.dumps({k: [t] for k, t in ARRIVALS.items()}).encode()
            ARRIVALS.clear()  # one read per latency run: the next run starts afresh
            return _response(body)
        if self.request_line.startswith(b"GET /debug/arrival?key="):
            self._record()
            key = self.request_line.split(b"=", 1)[1].split(b" ", 1)[0].decode()
            return _response(json.dumps(ARRIVALS.get(key)).encode())
        if self.request_line.startswith(b"GET /debug/stats"):
            return _response(json.dumps(STATS).encode())
        if self.request_line.startswith(b"POST /api/getClusterInfo"):
            self.chunks = []
            return CLUSTER_INFO
        self._record()
        return OK

    def _record(self) -> None:
        if self.chunks:
            now = time.monotonic()
            for text in KEY.findall(b"".join(self.chunks)):
                v = int(text)
                ARRIVALS.setdefault(str(v - U64 if v >= 1 << 63 else v), now)
            self.chunks = []


async def main() -> None:
    NullHttp.record = "--record" in sys.argv[1:]
    if "--delay-ms" in sys.argv:
        NullHttp.delay_s = float(sys.argv[sys.argv.index("--delay-ms") + 1]) / 1e3
    loop = asyncio.get_running_loop()
    server = await loop.create_server(NullHttp, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    global CLUSTER_INFO  # set once, before the first request
    ep = {"node_id": "null", "host": "127.0.0.1", "meta_rpc_port": 0, "meta_http_port": port}
    info = {"header": {"status": {"code": "OK"}}, "self_node_id": "null"}
    CLUSTER_INFO = _response(
        json.dumps({**info, "leader_node_id": "null", "leader_endpoint": ep}).encode()
    )
    sys.stdout.write(f"null server listening on http://127.0.0.1:{port}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until terminated


if __name__ == "__main__":
    uvloop.run(main())
