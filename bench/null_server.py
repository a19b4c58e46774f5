"""A minimal null KVCM for bench/sidecar.py: `python -m bench.null_server`.

Answers every POST /api/<route> with OK after reading the body, in its own process (so the
figures measure the sidecar's pipeline, not a server sharing its core). Prints its URL.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop
from aiohttp import web

OK = b'{"header":{"status":{"code":"OK","message":""}},"retry_after_ms":"0"}'


async def handle(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=OK, content_type="application/json")


async def main() -> None:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/api/{route}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    sys.stdout.write(f"null server listening on http://127.0.0.1:{runner.addresses[0][1]}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until terminated


if __name__ == "__main__":
    uvloop.run(main())
