"""End to end, ZMQ source: the zmq publisher process (vLLM / SGLang wire) -> real `kvcm-sidecar
run --set source.kind=zmq` -> the KVCM-compatible server. Oracle: at quiet, KVCM's visible
(key, medium) pairs == the publisher's truth (store count > 0 per key and medium), key for key;
after a forget, KVCM holds nothing the engine dropped and everything stored since.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine_hook.zmq_publisher import PublisherProcess
from tests.integration.harness import Harness, SidecarProc

# engine medium -> KVCM medium (the default medium map)
KVCM_MEDIUM = {
    "GPU": "hbm",
    "CPU": "mem",
    "CPU_PINNED": "mem",
    "STORAGE": "disk",
    "DISK": "disk",
    "EXTERNAL": "remote",
}
ZMQ_SETTINGS = {
    "source.kind": "zmq",
    "source.zmq.bind": "false",
    "source.zmq.replay_timeout_s": "2",
    "source.zmq.checkpoint_interval_s": "0.2",
    "source.zmq.health_interval_s": "0.05",
    "source.zmq.health_fail_after": "3",
}


class ZmqHarness:
    def __init__(self, h: Harness, tmp: Path) -> None:
        self.h = h
        self.state_dir = tmp / "state"
        self.pub: PublisherProcess | None = None

    def start_engine(self, **cfg: Any) -> PublisherProcess:
        self.pub = PublisherProcess(**cfg)
        return self.pub

    def start_sidecar(self, **settings: str) -> SidecarProc:
        assert self.pub is not None
        r = self.pub.ready
        extra = {
            **ZMQ_SETTINGS,
            "source.zmq.endpoint": r["pub"],
            "source.state_dir": str(self.state_dir),
        }
        if r.get("replay"):
            extra["source.zmq.replay_endpoint"] = r["replay"]
        if r.get("health"):
            extra["source.zmq.health_url"] = r["health"]
        side = self.h.start_sidecar(**{**extra, **settings})
        self.pub.call("wait_subscribers", n=1)
        return side

    def truth(self) -> set[tuple[int, str]]:
        assert self.pub is not None
        return {(k, KVCM_MEDIUM[m]) for k, m in self.pub.truth(group=0)}

    async def visible(self) -> set[tuple[int, str]]:
        r = await self.h.reporter()
        return {(int(k), m) for k, m in r["visible"]} if r else set()

    async def converge(self, within_s: float = 20.0) -> set[tuple[int, str]]:
        """Wait (bounded) until KVCM shows exactly the publisher's truth."""
        want = self.truth()
        deadline = time.monotonic() + within_s
        while True:
            seen = await self.visible()
            if seen == want:
                return seen
            if time.monotonic() > deadline:
                tail = "".join(self.h.sidecar.log[-20:]) if self.h.sidecar else ""
                raise AssertionError(
                    f"no convergence: missing={len(want - seen)} extra={len(seen - want)}\n{tail}"
                )
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    async def settle(self, pred: Any, within_s: float = 20.0) -> dict[str, Any]:
        """Wait (bounded) until the sidecar's /status satisfies `pred`."""
        deadline = time.monotonic() + within_s
        while True:
            st = await self.h.status()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"status never matched: {json.dumps(st)}"
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    def workload(self, events: int = 2000, **kw: Any) -> None:
        assert self.pub is not None
        kw.setdefault("mediums", ["GPU", "CPU"])
        self.pub.call("workload", events=events, wait=True, dup_prob=0.3, **kw)

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()


@pytest.fixture
async def z(h: Harness, tmp_path: Path) -> AsyncIterator[ZmqHarness]:
    zh = ZmqHarness(h, tmp_path)
    yield zh
    zh.close()


def _forgets(st: dict[str, Any]) -> dict[str, int]:
    return dict(st.get("zmq_forgets", {}))


@pytest.mark.parametrize(
    ("flavour", "encoding", "hash_kind", "mediums"),
    [
        ("vllm", "map", "int", ["GPU", "CPU"]),
        ("vllm", "positional", "bytes", ["GPU", "STORAGE"]),
        ("sglang", "positional", "int", ["GPU", "CPU_PINNED", "DISK"]),
        ("vllm", "positional_v0", "int", ["GPU"]),
    ],
)
async def test_zmq_source_steady_state_with_duplicates_matches_truth(
    z: ZmqHarness, flavour: str, encoding: str, hash_kind: str, mediums: list[str]
) -> None:
    z.start_engine(flavour=flavour, encoding=encoding, hash_kind=hash_kind)
    z.start_sidecar()
    z.workload(3000, mediums=mediums)
    seen = await z.converge()
    assert {m for _, m in seen} == {KVCM_MEDIUM[m] for m in mediums}
    st = await z.settle(lambda s: s["state"] == "READY")
    assert _forgets(st) == {}


async def test_zmq_source_covered_gap_is_replayed_without_a_forget(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    z.workload(1000)
    await z.converge()
    pub.call("gap", batches=5)  # dropped on the PUB socket, kept in the replay buffer
    z.workload(1000, seed=2)
    await z.converge()
    st = await z.settle(lambda s: s["zmq_gaps"] >= 1 and s["zmq_replays"].get("covered", 0) >= 2)
    assert _forgets(st) == {}


async def test_zmq_source_uncovered_gap_forgets_and_rebuilds(z: ZmqHarness) -> None:
    pub = z.start_engine()
    z.start_sidecar()
    first = pub.call("store", n=20, medium="GPU", step=True)
    await z.converge()
    pub.call("gap", batches=1, evict=True)  # the removal never arrives and is not replayable
    pub.call("remove", hashes=first["hashes"][:10], medium="GPU", step=True)
    later = pub.call("store", n=5, medium="CPU", step=True)["keys"]
    st = await z.settle(lambda s: _forgets(s).get("replay_uncovered", 0) >= 1)
    want_later = {(k, "mem") for k in later}
    deadline = time.monotonic() + 20
    while not want_later <= (seen := await z.visible()):
        assert time.monotonic() < deadline, f"stored-after-forget keys never arrived: {seen}"
        await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline
    assert seen <= z.truth()  # nothing the engine dropped stays visible
    assert not {(k, "hbm") for k in first["keys"][:10]} & seen
    assert st["zmq_gaps"] >= 1
