"""ZMQ source, the flush's C fold (zmq_events.BlockReader, block_counts' C walk) against the
general numpy path (to_blocks + the vectorised clamped walk): the same counts, key state, dirty
keys and counters, over mixed batches, repeats, removes of unknown blocks, clears, unreadable
hashes, several mediums and groups, and hashes in every msgpack int / bin encoding."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.key_state import KeyState
from sidecar.shm_ring import compiled
from sidecar.source.block_counts import BlockCounts
from sidecar.source.zmq import Stream
from sidecar.source.zmq_events import BlockReader, EventDecoder, Segment, to_blocks

MEDIUMS = {"GPU": 0, "CPU": 1, "DISK": 2}
M64 = (1 << 64) - 1
needs_c = pytest.mark.skipif(compiled.accel is None, reason="the C loops were not built")

# Few distinct hashes, every encoding msgpack gives them: fixints, uint8..64, negative ints,
# int8..64, 32-byte digests, other byte lengths; a string or a float makes an event unreadable.
INTS = [0, 1, 127, 128, 300, 70_000, 2**32, 2**63, M64, 2**63 - 1, -1, -33, -200, -40_000]
HASH = st.sampled_from(
    [*INTS, -(2**31) - 5, -(2**63), bytes([7]) * 32, b"\x01" * 16, b"", b"\xff" * 3]
)
BAD = st.sampled_from(["x", 1.5, None, [1]])
BLOCK_OP = st.tuples(
    st.sampled_from(["s", "s", "r", "r", "c", "bad"]),
    st.lists(HASH, max_size=40),
    st.sampled_from([None, "GPU", "GPU", "CPU", "DISK", "TAPE"]),
    st.sampled_from([None, 0, 0, 1, 2]),
    st.sampled_from([16, 16, 16, 32]),
)
BATCH = st.lists(BLOCK_OP, min_size=1, max_size=6)
RUN = st.lists(st.tuples(BATCH, st.booleans()), max_size=14)  # (batch, flush after it)


def event(op: tuple[str, list[Any], str | None, int | None, int], bad: Any) -> Any:
    kind, hashes, medium, group, bs = op
    if kind == "c":
        return ["AllBlocksCleared"]
    if kind == "bad":
        return ["BlockRemoved", [*hashes, bad], medium, group]
    if kind == "s":
        return ["BlockStored", hashes, None, list(range(bs)), bs, None, medium, None]
    return ["BlockRemoved", hashes, medium, group]


def run(batches: list[tuple[list[Any], bool]], bad: Any, use_c: bool) -> dict[str, Any]:
    built = compiled.accel
    compiled.accel = built if use_c else None
    try:
        ks = KeyState((0, 1))
        s = Stream(
            EventDecoder(MEDIUMS, 16, 0),
            BlockCounts(ks),
            dp_rank=0,
            can_replay=True,
            replay_timeout_s=2.0,
        )
        for seq, (ops, flush) in enumerate(batches):
            p = msgspec.msgpack.encode([1.0, [event(op, bad) for op in ops], 0])
            s.on_live(seq, p)
            if flush:
                s.flush(repair=True)
            while s.replay is not None:  # a repair asked for the batch again: serve it
                s.want_replay = None
                for q in range(s.replay.start, seq + 1):
                    ops_q = batches[q][0]
                    s.on_replayed(q, msgspec.msgpack.encode([1.0, [event(o, 0) for o in ops_q], 0]))
                s.on_replay_end()
        s.flush()
        dirty = ks.take_batch(1 << 20)
        return {
            "counts": s.counts.counts(),
            "held": s.counts.held(),
            "keys": [ks.as_dict(m) for m in range(ks.mediums)],
            "published": ks.published_count,
            "dirty": sorted(zip(dirty.keys.tolist(), dirty.mediums.tolist(), strict=True)),
            "events": s.events.tolist(),
            "blocks": s.blocks,
            "batches": dict(s.batches),
            "errors": dict(s.decode_errors),
            "forgets": dict(s.forgets),
            "gaps": s.gaps,
        }
    finally:
        compiled.accel = built


@needs_c
@settings(max_examples=300, deadline=None)
@given(batches=RUN, bad=BAD)
def test_zmq_fold_c_and_general_paths_agree(batches: list[Any], bad: Any) -> None:
    assert run(batches, bad, use_c=True) == run(batches, bad, use_c=False)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    segments=st.lists(
        st.lists(st.tuples(st.lists(HASH, max_size=20), st.integers(0, 3))), max_size=5
    )
)
def test_zmq_block_reader_reads_what_to_blocks_reads(segments: list[Any]) -> None:
    segs = []
    for events in segments:
        seg = Segment()
        for hashes, place in events:
            seg.hashes.append(msgspec.Raw(msgspec.msgpack.encode(hashes)))
            seg.codes.append((place >> 1) << 8 | (place & 1) << 1 | (len(hashes) & 1))
        segs.append(seg)
    counted = np.zeros(512, np.int64)
    reader = BlockReader()
    reader._buf = np.empty((3, 1), np.int64)  # grows on the way
    got = reader.read(segs, counted)
    assert got is not None
    keys, places, signs, place = got
    f = to_blocks(segs)
    assert f.bad == []
    b = f.blocks
    assert keys.tolist() == b.keys.tolist()
    assert places.tolist() == (b.mediums.astype(np.int64) << 8 | b.groups).tolist()
    assert signs.tolist() == b.signs.tolist()
    assert counted.tolist() == f.events().tolist()
    distinct = set(places.tolist())
    assert place == (distinct.pop() if len(distinct) == 1 else -1)


@needs_c
def test_zmq_block_reader_leaves_unreadable_hashes_to_the_general_path() -> None:
    seg = Segment()
    seg.hashes += [msgspec.Raw(msgspec.msgpack.encode([1, 2])), msgspec.Raw(b"\x92\x01\xa1x")]
    seg.codes += [1, 0]
    counted = np.zeros(512, np.int64)
    assert BlockReader().read([seg], counted) is None
    assert not counted.any()  # nothing counted: the general path counts
    assert to_blocks([seg]).bad == [1]
