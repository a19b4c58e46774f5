"""The C producer (kvcm_ring.h) and the Python hook, fed the same operations, write the same ring.

Hypothesis drives both (the C one as a process) with stores/removes over groups and mediums, bad
ones included, clears, partial drains (wrap, head reloads), overflow and snapshots; after every
step both rings give the same records and drops, at the end the same header words and bytes.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine_hook
from engine_hook.hook import Hook
from sidecar.shm_ring import layout as L
from sidecar.shm_ring import snapshot
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from tests import cbuild
from tests.unit.test_c_header import Ops

MEDIUM_NAMES = (None, "mem", "disk", "tape")  # index 3 is not in the table: bad_medium
CAPACITY = 16
# Header words that hold ids or times (or the reader's identity) and so differ between runs.
NOT_COMPARED = {
    L.W_CREATED_NS,
    L.W_LIVENESS_NS,
    L.W_READER_PID,
    L.W_READER_INCARNATION,
    L.W_READER_LIVENESS_NS,
    L.W_BOOT_ID,
    L.W_PID,
    L.W_START_NS,
    L.W_SNAP_BOOT_ID,
    # The Python resident set exports removed keys as mask-0 entries, the C test engine skips
    # them: the held entries are compared instead.
    L.W_SNAP_COUNT,
}
COMPARED = [w for w in range(L.W_SNAP_BYTES + 1) if w not in NOT_COMPARED]

keys = st.lists(
    st.one_of(st.integers(-3, 12), st.integers(-(1 << 63), (1 << 63) - 1)), min_size=1, max_size=6
)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["stored", "removed"]),
            st.sampled_from([0, 1, 0, 1, 2]),
            st.sampled_from([0, 0, 1, 2, 3]),
            keys,
        ),
        st.just(("cleared",)),
        st.tuples(st.just("drain"), st.integers(1, 2 * CAPACITY)),
        st.just(("snapshot",)),
    ),
    max_size=40,
)


@pytest.fixture(scope="module")
def engine() -> Path:
    return cbuild.build("kvcm_test_engine.c")


def _python_hook(ring: str) -> Hook:
    hook = engine_hook.attach(
        strict=True,
        start_flusher=False,
        instance_id="conformance",
        ring_name=ring,
        ring_capacity_slots=CAPACITY,
        group_block_bytes=(64, 64),
        medium="hbm",
        mediums=("mem", "disk"),
        max_stage_delay_ms=1.0,
        extra={"role": "test"},
    )
    assert isinstance(hook, Hook)
    return hook


def _held(snap: snapshot.Snapshot) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for k, m, med in zip(
        snap.keys.tolist(), snap.masks.tolist(), snap.mediums.tolist(), strict=True
    ):
        out[(k, med)] = out.get((k, med), 0) | m
    return {km: m for km, m in out.items() if m}


class Pair:
    """The same ring twice: Python hook -> `py`, C engine -> `c`, one reader on each."""

    def __init__(self, engine: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.names = {"py": f"/kvcm-conf-py-{tag}", "c": f"/kvcm-conf-c0-{tag}"}
        self.hook = _python_hook(self.names["py"])
        self.c = Ops(engine, self.names["c"], CAPACITY)
        assert self.c.ready["code"] == 0
        self.segs = {side: Segment(name) for side, name in self.names.items()}
        self.readers = {side: RingReader(seg, exclusive=False) for side, seg in self.segs.items()}
        self.c_stats: dict[str, Any] = {}

    def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind in ("stored", "removed"):
            _, group, medium, ks = op
            arg: Any = ks[0] if len(ks) == 1 else ks
            getattr(self.hook, kind)(arg, group, MEDIUM_NAMES[medium])
            self.c_stats = self.c(f"{kind} {group} {medium} " + " ".join(map(str, ks)))
        elif kind == "cleared":
            self.hook.cleared()
            self.c_stats = self.c("cleared")
        elif kind == "drain":
            got = {side: r.read(max_records=op[1]) for side, r in self.readers.items()}
            rp, rc = got["py"], got["c"]
            assert not rp.gap and not rc.gap and not rp.anomalies and not rc.anomalies
            assert rp.records[:, :3].tolist() == rc.records[:, :3].tolist()  # seq, key, meta
            assert rp.dropped == rc.dropped
        elif kind == "snapshot":
            reqs = {side: snapshot.request(seg) for side, seg in self.segs.items()}
            self.hook.flush(wait=True)  # without a flusher thread the flush answers
            self.c_stats = self.c("poll")
            snaps = {side: snapshot.poll(self.segs[side], reqs[side]) for side in reqs}
            py, c = snaps["py"], snaps["c"]
            assert py is not None and c is not None
            assert (py.seq, py.dropped_at) == (c.seq, c.dropped_at)
            assert _held(py) == _held(c)
        self.hook.flush(wait=True)

    def compare_headers(self) -> None:
        hp, hc = self.segs["py"].hdr, self.segs["c"].hdr
        diff = {w: (int(hp[w]), int(hc[w])) for w in COMPARED if hp[w] != hc[w]}
        assert not diff, f"header words (index: (python, c)) differ: {diff}"
        dp = self.segs["py"].read_descriptor().replace(self.names["py"].encode(), b"RING")
        dc = self.segs["c"].read_descriptor().replace(self.names["c"].encode(), b"RING")
        assert dp == dc
        problems = self.hook.stats()["problems"]
        for reason in ("bad_group", "bad_medium"):
            assert problems.get(reason, 0) == self.c_stats.get(reason, 0), reason

    def close(self) -> None:
        self.hook.close()
        self.c("close")
        self.c.close()
        for seg in self.segs.values():
            seg.close()
        for name in self.names.values():
            unlink(name)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_c_conformance_same_records_and_header_as_python(engine: Path, ops: list[Any]) -> None:
    pair = Pair(engine)
    try:
        for op in ops:
            pair.step(op)
        pair.step(("drain", 2 * CAPACITY))
        pair.step(("snapshot",))
        pair.compare_headers()
        pair.hook.close()
        pair.c_stats = pair.c("close")
        pair.compare_headers()  # producer_state CLOSED on both
        assert int(pair.segs["c"].hdr[L.W_PRODUCER_STATE]) == L.PRODUCER_CLOSED
    finally:
        pair.close()


def test_c_conformance_overflow_and_wrap_example(engine: Path) -> None:
    """A fixed sequence that overflows, wraps and resnapshots (hypothesis may not find it fast)."""
    pair = Pair(engine)
    try:
        for i in range(6):
            pair.step(("stored", i % 2, i % 3, list(range(i * 10, i * 10 + 7))))
            pair.step(("drain", 5))
            pair.step(("removed", 0, 0, [i * 10]))
        pair.step(("stored", 0, 0, list(range(100, 140))))  # 40 records into <= 16 free slots
        pair.step(("snapshot",))
        pair.step(("drain", 32))
        pair.step(("cleared",))
        pair.step(("snapshot",))
        pair.compare_headers()
        assert int(pair.segs["c"].hdr[L.W_DROPPED]) > 0
        assert int(pair.segs["c"].hdr[L.W_TAIL]) > CAPACITY  # wrapped
    finally:
        pair.close()
