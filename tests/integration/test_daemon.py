"""The daemon end to end: real engine process, real sidecar process, KVCM server on loopback.

Every test ends with the oracle: KVCM's visible set for the reporter == the engine's published
set (which also means nothing the engine removed is visible).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.harness import Harness

pytestmark = pytest.mark.slow


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    await harness.start_server()
    yield harness
    await harness.close()


async def test_daemon_steady_state_converges(h: Harness) -> None:
    h.start_engine()
    h.start_sidecar()
    h.engine_cmd(op="work", n=300)
    await h.converge()
    h.engine_cmd(op="work", n=300)
    await h.converge()
    assert len(h.published) > 50
    status = await h.status()
    assert status["state"] == "READY" and status["published"] == len(h.published)
