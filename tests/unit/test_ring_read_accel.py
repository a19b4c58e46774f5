"""The C ring read, fold, take and confirm (_accel.c, issue #26) equal their reference forms.

The reference is the build without those four functions (a stale one: key_state and reader then
run the numpy forms around the older C probe and fold), so positions, queue order and batches
must match exactly; the numpy-only form (no build) is compared key by key (its probe gives new
keys other positions, its fold another queue order).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sidecar import key_state
from sidecar.key_state import Batch, KeyState
from sidecar.shm_ring import compiled, key_table
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.shm_ring.writer import RingWriter

BUILT = compiled.accel
NEW = ("ring_copy", "fold_records", "take_queue", "confirm_run", "ring_fold", "count_fold")
pytestmark = pytest.mark.skipif(
    BUILT is None or not all(hasattr(BUILT, f) for f in NEW), reason="the C loops were not built"
)


def _stale(mod: ModuleType | None, missing: tuple[str, ...] = NEW) -> Any:
    """The module as a build from before issue #26 would be: the new functions missing."""
    return SimpleNamespace(**{k: getattr(mod, k) for k in dir(mod) if k not in missing})


@contextmanager
def backend(which: str) -> Iterator[None]:
    saved = compiled.accel
    compiled.accel = {
        "c": BUILT,
        "stale": _stale(BUILT),
        "no_ring_fold": _stale(BUILT, ("ring_fold",)),
        "no_count_fold": _stale(BUILT, ("count_fold",)),
        "numpy": None,
    }[which]
    try:
        yield
    finally:
        compiled.accel = saved


def _records(ops: list[tuple[int, int, int, int]], seq: int) -> np.ndarray:
    out = np.zeros((len(ops), 4), np.uint64)
    for i, (kind, group, medium, key) in enumerate(ops):
        meta = L.pack_meta(kind, group, medium)
        out[i] = (seq + i, np.int64(key).view(np.uint64), meta, 0)
    return out


def _state(ks: KeyState) -> list[Any]:
    """Everything a take or confirm depends on, per medium, positions included."""
    out: list[Any] = [ks.published_count, ks._ndirty, ks._nacked, ks.dirty_since, ks._next]
    for t in ks._tiers:
        n = t.n
        queue = np.concatenate(t.queue).tolist() if t.queue else []
        out.append(
            (
                t.medium,
                n,
                t.keys[:n].tolist(),
                t.masks[:n].tolist(),
                t.acked[:n].tolist(),
                t.queued[:n].tolist(),
                queue,
                t.ndirty,
                t.nacked,
                t.published_count,
                t.t.epoch,
            )
        )
    return out


def _batch(b: Batch) -> list[Any]:
    pos = None if b.pos is None else b.pos.tolist()
    return [
        b.triples(),
        pos,
        b.epochs,
        b.adds.tolist(),
        b.deletes.tolist(),
        b.add_mediums.tolist(),
        b.delete_mediums.tolist(),
    ]


def _key_view(ks: KeyState) -> list[Any]:
    """What the numpy-only form must agree on: per medium, masks and acked by key, dirty keys."""
    out: list[Any] = [ks.published_count, ks._nacked]
    for m in range(ks.mediums):
        t = ks._tiers[m]
        n = t.n
        queued = set(t.keys[:n][t.queued[:n]].tolist())
        out.append((ks.as_dict(m), ks.acked_keys(m), queued))
    return out


def _clock() -> Callable[[], float]:
    ticks = iter(range(1, 1 << 30))
    return lambda: float(next(ticks))


def _required(ks: KeyState, groups: tuple[int, ...]) -> None:
    """A new descriptor's required groups (the resync that follows marks what now differs)."""
    ks.set_required(groups)
    for t in ks._tiers:
        t.mark_differing()


OP = st.one_of(
    st.tuples(
        st.just("apply"),
        st.lists(
            st.tuples(
                st.sampled_from([L.KIND_STORED] * 6 + [L.KIND_REMOVED] * 4 + [L.KIND_CLEARED]),
                st.integers(0, 1),  # group
                st.sampled_from([0] * 8 + [1, 2]),  # medium
                st.integers(-6, 40),  # key: repeats within and across batches
            ),
            max_size=40,
        ),
        st.booleans(),  # keys never seen before (the table grows, re-indexes stepwise)
    ),
    st.tuples(st.just("take"), st.integers(0, 12), st.just(False)),
    st.tuples(st.just("confirm"), st.lists(st.integers(0, 11), max_size=4), st.just(False)),
    st.tuples(st.just("requeue"), st.lists(st.integers(-6, 40), max_size=4), st.just(False)),
    st.tuples(st.just("required"), st.sampled_from([(0,), (1,), (0, 1)]), st.just(False)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OP, max_size=40), tiny=st.booleans(), step=st.integers(1, 6))
def test_accel_key_state_equals_the_reference_through_reindexes(
    ops: list[tuple[Any, Any, bool]], tiny: bool, step: int
) -> None:
    """apply (clears, several mediums), take, confirm (with failures), requeues and required
    group changes, on a table that re-indexes stepwise (`tiny`) between a take and its
    confirm: the C forms leave the state, positions and queue order exactly as the reference."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    if tiny:
        key_state._MIN_CAP, key_table.REBUILD_STEP = 4, step
    try:
        states = {w: KeyState((0,), clock=_clock()) for w in ("c", "stale")}
        flight: dict[str, Batch | None] = {"c": None, "stale": None}
        numpy_ks = KeyState((0,))
        numpy_flight: Batch | None = None
        seq = 1
        for op, arg0, fresh in ops:
            arg: Any = [(k, g, m, key + 100 * seq) for k, g, m, key in arg0] if fresh else arg0
            for w, ks in states.items():
                with backend(w):
                    if op == "apply":
                        ks.apply(_records(arg, seq))
                    elif op == "take":  # one request in flight: the previous one answered
                        b = flight[w]
                        if b is not None:
                            ks.confirm(b)
                        flight[w] = ks.take_batch(arg)
                    elif op == "confirm" and flight[w] is not None:
                        b = flight[w]
                        assert b is not None
                        if w == "c" and any(e != ks._tier(m).t.epoch for m, e in b.epochs.items()):
                            event("re-indexed between take and confirm")
                        ks.confirm(b, [i for i in arg if i < len(b)])
                        flight[w] = None
                    elif op == "requeue":
                        ks.requeue_front(np.array(arg, np.int64))
                    elif op == "required":
                        _required(ks, arg)
            with backend("numpy"):
                if op == "apply":
                    numpy_ks.apply(_records(arg, seq))
                elif op == "take":
                    if numpy_flight is not None:
                        numpy_ks.confirm(numpy_flight)
                    numpy_flight = numpy_ks.take_batch(arg)
                elif op == "confirm" and numpy_flight is not None:
                    failed = [i for i in arg if i < len(numpy_flight)]
                    numpy_ks.confirm(numpy_flight, failed)
                    numpy_flight = None
                elif op == "required":
                    _required(numpy_ks, arg)
            if op == "apply":
                seq += len(arg)
            assert _state(states["c"]) == _state(states["stale"])
            fc, fs = flight["c"], flight["stale"]
            assert (fc is None) == (fs is None)
            if fc is not None and fs is not None:
                assert _batch(fc) == _batch(fs)
            if op in ("apply", "required"):
                assert _key_view(numpy_ks)[:1] == _key_view(states["c"])[:1]
                got = [v[0] for v in _key_view(states["c"])[2:]]
                assert [v[0] for v in _key_view(numpy_ks)[2:]] == got[: numpy_ks.mediums]
        # Drained, every form ends with KVCM's copy equal to the engine's truth.
        for w, ks in [*states.items(), ("numpy", numpy_ks)]:
            with backend(w):
                b = flight.get(w) if w != "numpy" else numpy_flight
                if b is not None:
                    ks.confirm(b)
                while ks.dirty:
                    ks.confirm(ks.take_batch(5))
                assert ks.in_sync()
        for m in range(numpy_ks.mediums):
            assert numpy_ks.acked_keys(m) == states["c"].acked_keys(m)
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


RECORDS = st.lists(
    st.tuples(
        st.sampled_from([L.KIND_STORED] * 3 + [L.KIND_REMOVED]),
        st.integers(0, 1),
        st.sampled_from([0] * 6 + [1]),
        st.integers(0, 30),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(
    before=RECORDS,
    limit=st.integers(1, 12),
    grow=st.lists(RECORDS, min_size=1, max_size=6),
    failed=st.lists(st.integers(0, 11), max_size=4),
    step=st.integers(1, 8),
)
def test_accel_confirm_after_a_reindex_in_flight_equals_the_reference(
    before: list[tuple[int, int, int, int]],
    limit: int,
    grow: list[list[tuple[int, int, int, int]]],
    failed: list[int],
    step: int,
) -> None:
    """A batch in flight while new keys re-index its table (its positions go stale): the
    confirm, its failures back in front, and every later take equal the reference."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    key_state._MIN_CAP, key_table.REBUILD_STEP = 4, step
    try:
        seen = []
        for w in ("c", "stale"):
            with backend(w):
                ks = KeyState((0,), clock=_clock())
                ks.apply(_records(before, 1))
                batch = ks.take_batch(limit)
                epochs = dict(batch.epochs)
                seq = 1 + len(before)
                for i, recs in enumerate(grow):  # fresh keys: the table grows
                    ks.apply(
                        _records([(k, g, m, key + 100 * (i + 1)) for k, g, m, key in recs], seq)
                    )
                    seq += len(recs)
                moved = any(ks._tier(m).t.epoch != e for m, e in epochs.items())
                ks.confirm(batch, [i for i in failed if i < len(batch)])
                after = _state(ks)
                drained = []
                while ks.dirty:
                    b = ks.take_batch(limit)
                    drained.append(_batch(b))
                    ks.confirm(b)
                seen.append((_batch(batch), after, drained, _state(ks), ks.in_sync()))
        if moved:
            event("re-indexed between take and confirm")
        assert seen[0] == seen[1]
        assert seen[0][-1]
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


@contextmanager
def _ring(capacity: int = 16) -> Iterator[tuple[RingWriter, RingReader]]:
    name = f"/kvcm-rra-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    wseg = Segment(name, capacity)
    rseg = Segment(name, capacity)
    reader = RingReader(rseg)
    try:
        yield RingWriter(wseg), reader
    finally:
        reader.close()
        wseg.close()
        rseg.close()
        unlink(name)


RECORD = st.tuples(
    st.sampled_from([L.KIND_STORED, L.KIND_REMOVED, L.KIND_CLEARED]),
    st.integers(0, 2),  # group
    st.sampled_from([0, 0, 0, 1, 3, 255]),  # medium
    st.integers(-(2**63), 2**63 - 1),
)


@settings(max_examples=100, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.lists(RECORD, min_size=1, max_size=20), st.integers(-1, 20)), max_size=6
    ),
    limit=st.integers(1, 20),
)
def test_accel_ring_read_equals_the_numpy_read(
    batches: list[tuple[list[tuple[int, int, int, int]], int]], limit: int
) -> None:
    """Each read is done twice from the same cursor (C, then numpy): same records, losses,
    gap and anomaly (a torn slot: its seq overwritten), and the C read's flags (any clear, the
    highest medium of the others) say what the records hold; wrapping and drops included."""
    with _ring() as (writer, reader):
        _read_twice(writer, reader, batches, limit)


def _read_twice(
    writer: RingWriter,
    reader: RingReader,
    batches: list[tuple[list[tuple[int, int, int, int]], int]],
    limit: int,
) -> None:
    for recs, torn in batches:
        keys = np.array([k for *_x, k in recs], np.int64)
        metas = np.array([L.pack_meta(kd, g, m) for kd, g, m, _k in recs], np.uint64)
        writer.write(keys, metas)
        lag = reader.lag()
        if 0 <= torn < lag:
            slot = (reader.head + torn) & (reader.capacity - 1)
            writer.seg.slots[slot, L.C_SEQ] = np.uint64(12345678)
        head, dropped_seen = reader.head, reader.dropped_seen
        with backend("numpy"):
            want = reader.read(limit)
        after = reader.head
        reader.head, reader.dropped_seen = head, dropped_seen
        reader.seg.hdr[L.W_HEAD] = head
        with backend("c"):
            got = reader.read(limit)
        assert reader.head == after
        event(f"gap={got.gap} dropped={bool(got.dropped)} clears={got.clears}")
        assert got.records.tolist() == want.records.tolist()
        assert (got.dropped, got.gap, got.anomalies) == (want.dropped, want.gap, want.anomalies)
        assert got.new_incarnation == want.new_incarnation
        if len(got.records):
            assert got.last_seq == want.last_seq == int(got.records[-1, L.C_SEQ])
            kinds = got.records[:, L.C_META] & 0xFF
            meds = (got.records[:, L.C_META] >> np.uint64(16)) & 0xFF
            assert got.clears == bool((kinds == L.KIND_CLEARED).any())
            others = meds[kinds != L.KIND_CLEARED]
            assert got.max_medium == (int(others.max()) if len(others) else 0)


@pytest.mark.parametrize(
    "meta",
    [
        L.pack_meta(L.KIND_CLEARED),
        L.pack_meta(L.KIND_STORED, 0, 1),  # another medium
        L.pack_meta(L.KIND_STORED, 61),  # a group the fold's marks need
        L.pack_meta(7),  # a kind it does not know
    ],
    ids=["clear", "medium", "group", "kind"],
)
def test_accel_fold_records_declines_before_any_change(meta: int) -> None:
    """One record it cannot fold among others: None, and the index and columns untouched (the
    caller's numpy path then folds the whole batch)."""
    ks = KeyState((0,))
    with backend("c"):
        ks.apply(_records([(L.KIND_STORED, 0, 0, k) for k in range(5)], 1))
    t = ks._tiers[0]
    before = (t.n, t.t.idx._tpos.copy(), t.masks.copy(), t.queued.copy(), list(t.queue))
    recs = _records([(L.KIND_STORED, 0, 0, 10), (L.KIND_REMOVED, 0, 0, 1)], 6)
    recs = np.concatenate([recs, np.array([[8, 11, meta, 0]], np.uint64)])
    idx, cols = t.t.idx, t.t.cols
    assert BUILT is not None
    got = BUILT.fold_records(
        recs, idx._tkeys, idx._tpos, idx.keys, idx.n, cols["masks"], cols["acked"],
        cols["queued"], 1, np.empty(3, np.int64),
    )  # fmt: skip
    assert got is None
    assert t.n == before[0] and np.array_equal(t.t.idx._tpos, before[1])
    assert np.array_equal(t.masks, before[2]) and np.array_equal(t.queued, before[3])
    assert [q.tolist() for q in t.queue] == [q.tolist() for q in before[4]]


STEP_RECORD = st.tuples(  # mostly what the one-call read takes, now and then what it declines
    st.sampled_from([L.KIND_STORED] * 18 + [L.KIND_REMOVED] * 12 + [L.KIND_CLEARED]),
    st.sampled_from([0] * 40 + [1, 61]),  # group (61: one the fold's marks need)
    st.sampled_from([0] * 40 + [1, 7]),  # medium (7: outside the table)
    st.integers(-5, 30),  # key: repeats within and across reads
)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(STEP_RECORD, max_size=12),  # one engine write
            st.integers(-1, 150),  # a torn slot among the unread (-1 or beyond the lag: none)
            st.booleans(),  # full step
            st.integers(-1, 8),  # then take a batch of this many and confirm it (-1: none)
            st.integers(0, 15),  # 0: 20 more records first (the ring overflows: drops)
        ),
        max_size=12,
    ),
    tiny=st.booleans(),  # a table that grows and re-indexes stepwise under the steps
    fresh=st.booleans(),  # keys never seen before at every write
    rebuild_step=st.integers(1, 6),
)
def test_accel_ring_fold_step_equals_read_then_fold(
    steps: list[tuple[list[tuple[int, int, int, int]], int, bool, int, int]],
    tiny: bool,
    fresh: bool,
    rebuild_step: int,
) -> None:
    """EngineSync.step over the one-call read and fold (_accel.ring_fold) equals the same step
    over read() then apply() (ring_copy, fold_records), on two rings given the same writes: the
    key state (positions and queue order included), the cursor, last_seq, what the step says,
    and the sync's counters; wrapping, drops (then a snapshot is awaited), torn slots, clears,
    other and unknown mediums, groups the C fold declines, a table growing and re-indexing,
    and batches taken and confirmed between steps included."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    if tiny:
        key_state._MIN_CAP, key_table.REBUILD_STEP = 4, rebuild_step
    try:
        fast, total = _fold_steps(steps, fresh, event)
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old
    event(f"one-call steps: {'none' if not fast else 'all' if fast == total else 'some'}")


def test_accel_ring_fold_takes_the_one_call_path_through_reindexes_and_takes() -> None:
    """The equality above with no drop, torn slot or unusual record: most steps take the
    one-call path (read() not called), also while the table grows and re-indexes stepwise
    and batches are taken and confirmed between steps (so the equality covers that path)."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    key_state._MIN_CAP, key_table.REBUILD_STEP = 4, 2
    try:
        steps = [
            (
                [(L.KIND_STORED, 0, 0, k) for k in range(6)] + [(L.KIND_REMOVED, 0, 0, 2)],
                -1,
                True,
                4,
                1,
            )
            for _ in range(40)
        ]
        with _epochs() as epochs:
            fast, total = _fold_steps(steps, True, lambda _what: None)
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old
    assert total == 40 and fast >= 20 and max(epochs) > 0  # re-indexed under the steps


@contextmanager
def _epochs() -> Iterator[list[int]]:
    """The medium-0 key table epochs seen by take_batch (how often the table re-indexed)."""
    seen: list[int] = [0]
    real = KeyState.take_batch

    def take(self: KeyState, limit: int) -> Batch:
        seen.append(self._tiers[0].t.epoch)
        return real(self, limit)

    KeyState.take_batch = take  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        KeyState.take_batch = real  # type: ignore[method-assign]


def _fold_steps(
    steps: list[tuple[list[tuple[int, int, int, int]], int, bool, int, int]],
    fresh: bool,
    note: Callable[[str], None],
) -> tuple[int, int]:
    """Both paths over the same writes, compared after every step; (steps side "c" read in
    one call, steps)."""
    from sidecar.source.engine_sync import EngineSync, Sync

    with _ring() as (wa, ra), _ring() as (wb, rb):
        syncs = []
        for r, w in ((ra, wa), (rb, wb)):
            sync = EngineSync(r, KeyState((0,), clock=lambda: 1.0))
            sync.status, sync.boot_id, sync.n_mediums, sync._first = (
                Sync.SYNCED,
                w.boot_id,
                2,
                False,
            )
            syncs.append(sync)
        reads = [0]
        real_read = ra.read

        def read(*args: Any) -> Any:
            reads[0] += 1
            return real_read(*args)

        ra.read = read  # type: ignore[method-assign,assignment]
        fast = 0
        for i, (recs, torn, full, take, burst) in enumerate(steps):
            keys = np.array([k + (1000 * i if fresh else 0) for *_x, k in recs], np.int64)
            metas = np.array([L.pack_meta(kd, g, m) for kd, g, m, _k in recs], np.uint64)
            outs = []
            before = reads[0]
            for (sync, w), which in zip(
                ((syncs[0], wa), (syncs[1], wb)), ("c", "no_ring_fold"), strict=True
            ):
                if burst == 0:
                    w.write(np.arange(20, dtype=np.int64) + 5000, L.pack_meta(L.KIND_STORED))
                w.write(keys, metas)
                r = sync.reader
                if 0 <= torn < r.lag():
                    w.seg.slots[(r.head + torn) & (r.capacity - 1), L.C_SEQ] = np.uint64(999)
                with backend(which):
                    res = sync.step(full=full)
                outs.append((res.records, res.resynced))
            fast += reads[0] == before
            a, b = syncs
            note(f"status={a.status.value} records={outs[0][0] > 0}")
            if a.keys._tiers[0].t.epoch:
                note("re-indexed")
            assert outs[0] == outs[1]
            assert _state(a.keys) == _state(b.keys)
            assert a.reader.head == b.reader.head and a.last_seq == b.last_seq
            assert int(a.reader.seg.hdr[L.W_HEAD]) == a.reader.head
            assert (a.status, a.resyncs, a.anomalies, a.dropped_total, a.unknown_medium) == (
                b.status,
                b.resyncs,
                b.anomalies,
                b.dropped_total,
                b.unknown_medium,
            )
            if take >= 0:  # the report side between reads (the same C forms on both)
                with backend("c"):
                    batches = [s.keys.take_batch(take) for s in syncs]
                    assert _batch(batches[0]) == _batch(batches[1])
                    for s, bt in zip(syncs, batches, strict=True):
                        s.keys.confirm(bt)
                assert _state(a.keys) == _state(b.keys)
        return fast, len(steps)


def test_accel_ring_fold_reads_a_steady_step_in_one_call() -> None:
    """The steady state takes the one-call path: read() is not called, the reader's liveness
    is stamped, W_HEAD and last_seq advance, the dirty queue holds the stored keys in order."""
    from sidecar.source.engine_sync import EngineSync, Sync

    with _ring(64) as (w, r):
        sync = EngineSync(r, KeyState((0,)))
        w.write(np.arange(3, dtype=np.int64), L.pack_meta(L.KIND_STORED))
        sync.step()  # the first read sees the incarnation (and asks for a snapshot)
        sync.status = Sync.SYNCED
        calls: list[tuple[Any, ...]] = []
        real = r.read

        def read(*a: Any) -> Any:
            calls.append(a)
            return real(*a)

        r.read = read  # type: ignore[method-assign,assignment]
        w.write(np.arange(10, 15, dtype=np.int64), L.pack_meta(L.KIND_STORED))
        r.seg.hdr[L.W_READER_LIVENESS_NS] = 0
        with backend("c"):
            res = sync.step()
        assert calls == [] and res.records == 5
        assert r.head == int(r.seg.hdr[L.W_HEAD]) == 8 and sync.last_seq == 8
        assert int(r.seg.hdr[L.W_READER_LIVENESS_NS]) > 0
        t = sync.keys._tiers[0]
        assert t.keys[np.concatenate(t.queue)].tolist()[-5:] == [10, 11, 12, 13, 14]
        with backend("c"):
            assert sync.step().records == 0 and calls == []  # nothing new: still one call


COUNT_OP: st.SearchStrategy[tuple[Any, Any, Any, Any, bool]] = st.one_of(
    st.tuples(
        st.just("events"),
        st.sampled_from([0] * 6 + [1]),  # medium
        st.sampled_from([0] * 6 + [1, 2]),  # group
        st.lists(st.tuples(st.integers(-4, 24), st.sampled_from([1, 1, -1])), max_size=30),
        st.booleans(),  # int8 signs (the general fold's): never the one-call path
    ),
    st.tuples(st.just("take"), st.integers(0, 10), st.just(0), st.just([]), st.just(False)),
    st.tuples(
        st.just("required"),
        st.sampled_from([(0,), (0, 1)]),
        st.just(0),
        st.just([]),
        st.just(False),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(COUNT_OP, max_size=30),
    tiny=st.booleans(),
    fresh=st.booleans(),
    rebuild_step=st.integers(1, 6),
)
def test_accel_count_fold_equals_find_count_and_bits(
    ops: list[tuple[Any, Any, Any, Any, bool]], tiny: bool, fresh: bool, rebuild_step: int
) -> None:
    """BlockCounts' fold of one (medium, group)'s block events in one C call
    (_accel.count_fold) equals find + zmq_count + bits_apply: the key state (positions, queue
    order), the counts and the held total, through repeats, removes below 0, several groups
    and mediums, required-group changes, batches taken and confirmed, and a table that grows
    and re-indexes stepwise."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    if tiny:
        key_state._MIN_CAP, key_table.REBUILD_STEP = 4, rebuild_step
    try:
        used = _count_steps(ops, fresh, event)
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old
    event(f"one-call folds: {'none' if not used else 'some'}")


def test_accel_count_fold_takes_the_one_call_path_and_declines_int8_signs() -> None:
    """The equality above, with the one-call fold shown to run: int64 signs take it (also
    while the table grows and re-indexes stepwise, between takes), int8 signs never."""
    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    key_state._MIN_CAP, key_table.REBUILD_STEP = 4, 2
    try:
        events = [(k, 1) for k in range(8)] + [(3, -1), (3, -1), (5, 1)]
        ops: list[tuple[Any, Any, Any, Any, bool]] = []
        for _ in range(30):
            ops += [("events", 0, 0, events, False), ("take", 5, 0, [], False)]
        with _epochs() as epochs:
            assert _count_steps(ops, True, lambda _what: None) >= 15
        assert max(epochs) > 0  # it re-indexed under the folds
        small = [("events", 0, 1, events, True)] * 5
        assert _count_steps(small, True, lambda _what: None) == 0
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


def _count_steps(
    ops: list[tuple[Any, Any, Any, Any, bool]], fresh: bool, note: Callable[[str], None]
) -> int:
    """Both paths over the same ops, compared after each; how many folds side "c" did in one
    call."""
    from sidecar.source.block_counts import BlockCounts

    sides = {w: BlockCounts(KeyState((0,), clock=lambda: 1.0)) for w in ("c", "no_count_fold")}
    used = 0
    real = sides["c"].keys.fold_counts

    def fold_counts(*args: Any) -> int | None:
        nonlocal used
        got = real(*args)
        used += got is not None
        return got

    sides["c"].keys.fold_counts = fold_counts  # type: ignore[method-assign,assignment]
    for i, (op, a0, a1, a2, small) in enumerate(ops):
        for w, bc in sides.items():
            with backend(w):
                if op == "events":
                    keys = np.array([k + (1000 * i if fresh else 0) for k, _s in a2], np.int64)
                    signs = np.array([sg for _k, sg in a2], np.int8 if small else np.int64)
                    bc.apply_at(a0, a1, keys, signs)
                elif op == "take":
                    bc.keys.confirm(bc.keys.take_batch(a0))
                else:
                    _required(bc.keys, a0)
        a, b = sides["c"], sides["no_count_fold"]
        if a.keys._tiers[0].t.epoch:
            note("re-indexed")
        assert _state(a.keys) == _state(b.keys)
        assert a.counts() == b.counts() and a.held() == b.held()
        assert not a._flags.any()  # the scratch is left zeroed
    return used
