"""The engine's health endpoint (vLLM and SGLang serve GET /health): one probe, 2xx = alive.

Imports: stdlib only (asyncio streams: a bare HTTP/1.0 GET needs no client library here).
"""

from __future__ import annotations

import asyncio
import urllib.parse


async def probe(url: str, timeout_s: float) -> bool:
    """True if `url` answers a 2xx status line within `timeout_s`; never raises."""
    u = urllib.parse.urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                u.hostname, port, ssl=u.scheme == "https" or None
            )
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {u.netloc}\r\n\r\n".encode())
            await writer.drain()
            line = await reader.readline()
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
    parts = line.split()
    return len(parts) >= 2 and parts[1][:1] == b"2"
