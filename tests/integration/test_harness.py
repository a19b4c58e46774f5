"""The harness's in-loop KVCM server: stopping it closes every connection it accepted."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tests.integration.harness import Harness


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 5])
async def test_stop_server_closes_connections_accepted_just_before(
    tmp_path: Path, turns: int
) -> None:
    """A sidecar's connection accepted a loop turn or two before the stop (the loop is often
    blocked on a child meanwhile, so accepts come in bursts) must be closed by it. On Python
    3.11 such a connection's transport failed to attach to the closed server and its socket
    stayed open for the GC: the peer hung and CI failed on an unraisable ResourceWarning. The
    peers here stay open, so only the server can end them."""
    h = Harness(tmp_path)
    await h.start_server()
    peers = [socket.create_connection(("127.0.0.1", h.port)) for _ in range(20)]
    try:
        for _ in range(turns):
            await asyncio.sleep(0)  # let the loop accept without finishing the handshake
        await h.stop_server()
        still_open = 0
        for peer in peers:
            peer.settimeout(2)
            try:
                if peer.recv(1) != b"":
                    still_open += 1
            except TimeoutError:
                still_open += 1
            except ConnectionResetError:
                pass  # closed by the server, abruptly: also closed
        assert still_open == 0
    finally:
        for peer in peers:
            peer.close()
        await h.close()
