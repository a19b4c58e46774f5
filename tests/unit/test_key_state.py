"""Key state properties: snapshot + later records == fold of all records; acked/dirty rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from tests.oracle import fold

# Over KeyIndex's C probe and its numpy fallback (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

OPS = st.lists(
    st.tuples(
        st.sampled_from([L.KIND_STORED] * 6 + [L.KIND_REMOVED] * 3 + [L.KIND_CLEARED]),
        st.integers(0, 1),
        st.integers(-5, 12),
    ),
    max_size=120,
)


def records(ops: list[tuple[int, int, int]], start_seq: int = 1) -> np.ndarray:
    out = np.zeros((len(ops), 4), np.uint64)
    for i, (kind, group, key) in enumerate(ops):
        out[i] = (start_seq + i, np.int64(key).view(np.uint64), L.pack_meta(kind, group), 0)
    return out


@settings(max_examples=300)
@given(ops=OPS, cut=st.integers(0, 120), req=st.sampled_from([(0,), (1,), (0, 1)]))
def test_key_state_snapshot_plus_later_records_equals_fold(
    ops: list[tuple[int, int, int]], cut: int, req: tuple[int, ...]
) -> None:
    cut = min(cut, len(ops))
    truth = fold(ops)
    ks = KeyState(req)
    ks.apply(records(ops[:5]))  # some stale state the snapshot must replace
    snap = fold(ops[:cut])
    ks.replace(np.array(list(snap), np.int64), np.array(list(snap.values()), np.uint32))
    ks.apply(records(ops[cut:], cut + 1))
    assert ks.as_dict() == truth
    mask = sum(1 << g for g in req)
    assert ks.published_count == sum(1 for m in truth.values() if m & mask == mask)


@settings(max_examples=300)
@given(ops=OPS, batch=st.integers(1, 7), fail_every=st.integers(0, 3))
def test_key_state_sending_dirty_makes_acked_equal_published(
    ops: list[tuple[int, int, int]], batch: int, fail_every: int
) -> None:
    ks = KeyState((0,))
    for i in range(0, len(ops), 10):
        ks.apply(records(ops[i : i + 10], i + 1))
        sent = ks.take_batch(batch)
        failed = [j for j in range(len(sent)) if fail_every and j % (fail_every + 1) == 0]
        ks.confirm(sent, failed)
    while ks.dirty:
        ks.confirm(ks.take_batch(batch))
    assert ks.acked_keys() == set(ks.published_keys().tolist())
    assert ks.in_sync()


@settings(max_examples=200)
@given(
    ops=OPS,
    cut=st.integers(0, 120),
    req=st.sampled_from([(0,), (1,), (0, 1)]),
    batch=st.integers(1, 7),
)
def test_key_state_new_required_groups_resend_every_key_whose_verdict_flipped(
    ops: list[tuple[int, int, int]], cut: int, req: tuple[int, ...], batch: int
) -> None:
    # A descriptor with other required groups changes which held keys are published: the
    # keys KVCM has (or lacks) by the old verdict must go out again, not only be recounted.
    ks = KeyState((0,))
    cut = min(cut, len(ops))
    ks.apply(records(ops[:cut]))
    while ks.dirty:
        ks.confirm(ks.take_batch(batch))
    ks.set_required(req)
    ks.apply(records(ops[cut:], cut + 1))
    while ks.dirty:
        ks.confirm(ks.take_batch(batch))
    assert ks.acked_keys() == set(ks.published_keys().tolist())
    assert ks.in_sync()


def test_key_state_unchanged_key_never_resent() -> None:
    ks = KeyState((0,))
    ks.apply(records([(L.KIND_STORED, 0, 1)]))
    ks.confirm(ks.take_batch(10))
    ks.apply(records([(L.KIND_REMOVED, 0, 1), (L.KIND_STORED, 0, 1)], 2))
    assert ks.take_batch(10).pairs() == []  # stored -> removed -> stored: KVCM already has it


def test_key_state_repeated_store_and_other_group_change_nothing() -> None:
    ks = KeyState((0, 1))
    ks.apply(records([(L.KIND_STORED, 0, 7), (L.KIND_STORED, 0, 7)]))
    assert ks.published_count == 0 and ks.take_batch(10).pairs() == []
    ks.apply(records([(L.KIND_STORED, 1, 7)], 3))
    assert ks.take_batch(10).pairs() == [(7, True)]


def test_key_state_commit_snapshot_keeps_changes_made_meanwhile_dirty() -> None:
    ks = KeyState((0,))
    ks.apply(records([(L.KIND_STORED, 0, k) for k in range(5)]))
    sent = ks.published_keys()
    ks.apply(records([(L.KIND_REMOVED, 0, 0), (L.KIND_STORED, 0, 9)], 6))
    ks.commit_snapshot(sent)
    assert sorted(ks.take_batch(10).pairs()) == [(0, False), (9, True)]


def test_key_state_batch_lists_adds_before_deletes() -> None:
    ks = KeyState((0,))
    ks.apply(records([(L.KIND_STORED, 0, k) for k in range(4)]))
    ks.confirm(ks.take_batch(10))
    ks.apply(records([(L.KIND_REMOVED, 0, 1), (L.KIND_STORED, 0, 8), (L.KIND_REMOVED, 0, 2)], 5))
    ks.apply(records([(L.KIND_STORED, 0, 9)], 8))
    batch = ks.take_batch(10)
    assert batch.pairs() == [(8, True), (9, True), (1, False), (2, False)]
    assert batch.adds.tolist() == [8, 9] and batch.deletes.tolist() == [1, 2]


def test_key_state_partial_failure_requeues_failed_in_order_first() -> None:
    ks = KeyState((0,))
    ks.apply(records([(L.KIND_STORED, 0, k) for k in range(6)]))
    sent = ks.take_batch(4)
    ks.confirm(sent, [1, 3])
    assert [k for k, _ in ks.take_batch(10).pairs()] == [1, 3, 4, 5]


@settings(max_examples=200)
@given(ops=OPS, batch=st.integers(1, 7), cut=st.integers(0, 120), step=st.integers(1, 4))
def test_key_state_tiny_index_compacts_and_grows_correctly(
    ops: list[tuple[int, int, int]], batch: int, cut: int, step: int
) -> None:
    """Force stepwise re-indexing (growth; removed, unacked keys dropped) every few ops."""
    from sidecar import key_state
    from sidecar.shm_ring import key_table

    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    key_state._MIN_CAP, key_table.REBUILD_STEP = 4, step
    try:
        ks = KeyState((0, 1))
        in_flight = ks.take_batch(0)
        for i in range(0, len(ops), 5):
            ks.apply(records(ops[i : i + 5], i + 1))  # may compact while a batch is in flight
            if i // 5 % 2:
                ks.confirm(in_flight, [0] if i % 3 == 0 and len(in_flight) else [])
                in_flight = ks.take_batch(batch)
        ks.confirm(in_flight)
        snap = fold(ops[: min(cut, len(ops))])
        ks.replace(np.array(list(snap), np.int64), np.array(list(snap.values()), np.uint32))
        ks.apply(records(ops[min(cut, len(ops)) :], 1))
        assert ks.as_dict() == fold(ops)
        while ks.dirty:
            ks.confirm(ks.take_batch(batch))
        assert ks.acked_keys() == set(ks.published_keys().tolist()) and ks.in_sync()
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


def _rebuilding(ks: KeyState) -> bool:
    return ks._tiers[0].t.rebuild is not None


def test_key_state_keys_changed_during_a_stepwise_reindex_survive_it() -> None:
    from sidecar import key_state
    from sidecar.shm_ring import key_table

    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    key_state._MIN_CAP, key_table.REBUILD_STEP = 16, 2
    try:
        ks = KeyState((0,))
        ks.apply(records([(L.KIND_STORED, 0, k) for k in range(8)]))
        ks.apply(records([(L.KIND_REMOVED, 0, k) for k in (1, 2)], 9))
        ks.confirm(ks.take_batch(100))  # 1 and 2: removed and confirmed, so no longer live
        ks.apply(records([(L.KIND_STORED, 0, 8)], 11))  # 9 of 16 slots: a re-index starts
        assert _rebuilding(ks)
        seq = 12
        for op in [(L.KIND_STORED, 0, 1), (L.KIND_STORED, 0, 20), (L.KIND_REMOVED, 0, 3)]:
            ks.apply(records([op], seq))  # revived, new, and removed while it runs
            seq += 1
        while _rebuilding(ks):
            ks.apply(records([(L.KIND_STORED, 0, 30 + seq)], seq))
            seq += 1
        held = {k for k, m in ks.as_dict().items() if m}
        assert {1, 20, 0, 4, 5, 6, 7, 8} <= held and not {2, 3} & held
        while ks.dirty:
            ks.confirm(ks.take_batch(3))
        assert ks.acked_keys() == held and ks.in_sync()
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


def test_key_state_dirty_since_is_when_the_oldest_unsent_change_arrived() -> None:
    now = [1.0]
    ks = KeyState((0,), clock=lambda: now[0])
    ks.apply(records([(L.KIND_STORED, 0, k) for k in range(4)]))
    assert ks.dirty_since == 1.0
    now[0] = 2.0
    sent = ks.take_batch(2)
    ks.apply(records([(L.KIND_STORED, 0, 9)], 5))  # older changes still wait: unchanged
    assert ks.dirty_since == 1.0
    ks.confirm(sent)
    ks.confirm(ks.take_batch(10))
    assert not ks.dirty
    now[0] = 3.0
    ks.apply(records([(L.KIND_REMOVED, 0, 9)], 6))
    assert ks.dirty_since == 3.0


@settings(max_examples=500)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from([L.KIND_STORED, L.KIND_REMOVED]),
            st.integers(0, 3),
            st.one_of(st.integers(-3, 8), st.sampled_from([-(2**63), 2**63 - 1])),
        ),
        max_size=200,
    )
)
def test_fold_ops_is_the_last_op_per_key_and_group(ops: list[tuple[int, int, int]]) -> None:
    """The fold behind both the key state and the engine's resident set: per distinct key, the
    group bits whose last record stored them and those whose last record removed them."""
    from sidecar.shm_ring.fold import fold_ops

    recs = records(ops)
    keys, setb, clrb = fold_ops(recs[:, 1].view(np.int64), recs[:, 2])
    last: dict[tuple[int, int], int] = {}
    for kind, group, key in ops:
        last[(key, group)] = kind
    want: dict[int, list[int]] = {}
    for (key, group), kind in last.items():
        bits = want.setdefault(key, [0, 0])
        bits[kind != L.KIND_STORED] |= 1 << group
    got = {k: [s, c] for k, s, c in zip(keys.tolist(), setb.tolist(), clrb.tolist(), strict=True)}
    assert got == want
    assert keys.tolist() == sorted(want)  # distinct and ascending


@pytest.mark.parametrize("held", [10_000, 30_000, 40_000])
def test_key_state_commit_snapshot_that_reindexes_still_acks_what_was_sent(held: int) -> None:
    """Issue #24: the commit's lookup of `sent` re-indexed the table and the acks went into the
    discarded column, so every key was sent again as an ADD and the keys removed while the
    snapshot was in flight never got their DELETE."""
    ks = KeyState((0,))
    ks.apply(records([(L.KIND_STORED, 0, k) for k in range(held)]))
    keys, meds = ks.published()
    ks.apply(records([(L.KIND_REMOVED, 0, k) for k in range(100)], held + 1))
    ks.commit_snapshot(keys, meds)
    batch = ks.take_batch(1 << 20)
    assert len(batch.adds) == 0
    assert sorted(batch.deletes.tolist()) == list(range(100))
    assert ks.acked_keys() == set(range(held))


def _bulk(kind: int, keys: np.ndarray, medium: int, seq: int) -> np.ndarray:
    out = np.zeros((len(keys), 4), np.uint64)
    out[:, 0] = np.arange(seq, seq + len(keys), dtype=np.uint64)
    out[:, 1] = keys.astype(np.int64).view(np.uint64)
    out[:, 2] = np.uint64(L.pack_meta(kind, 0)) | np.uint64(medium << 16)
    return out


BULK_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "delta", "snapshot", "forget", "clear"]),
        st.integers(0, 1),  # medium
        st.integers(1, 24_000),  # how many
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.parametrize("tiny", [False, True], ids=["default", "tiny_index"])
@settings(max_examples=25, deadline=None)
@given(ops=BULK_OPS, seed=st.integers(0, 2**32 - 1))
def test_key_state_acked_is_kvcm_through_reindexes_at_any_call(
    tiny: bool, ops: list[tuple[str, int, int]], seed: int
) -> None:
    """16 k - 64 k keys per medium, where the default table re-indexes (and, `tiny`, a table
    that re-indexes stepwise in nearly every call): re-indexes land inside apply, take_batch,
    confirm, published() and commit_snapshot, with a snapshot or a delta in flight. The model
    is KVCM's copy (what it was sent and answered); `acked` must equal it after every answer,
    and draining the dirty queue must make it equal the engine's truth."""
    from sidecar import key_state
    from sidecar.shm_ring import key_table

    old = key_state._MIN_CAP, key_table.REBUILD_STEP
    if tiny:
        key_state._MIN_CAP, key_table.REBUILD_STEP = 4, 1_000
    try:
        rng = np.random.default_rng(seed)
        ks = KeyState((0,))
        truth: list[set[int]] = [set(), set()]
        kvcm: list[set[int]] = [set(), set()]
        seq = 1
        next_key = 0

        def engine(kind: str, medium: int, n: int) -> None:
            nonlocal seq, next_key
            if kind == "store":  # fresh keys, and some removed ones stored again
                fresh = np.arange(next_key, next_key + n, dtype=np.int64)
                next_key += n
                keys = np.concatenate([fresh, rng.integers(0, max(next_key, 1), n // 8)])
                ks.apply(_bulk(L.KIND_STORED, keys, medium, seq))
                truth[medium].update(keys.tolist())
            elif kind == "remove" and truth[medium]:
                held = np.fromiter(truth[medium], np.int64)
                keys = rng.choice(held, min(n, len(held)), replace=False)
                ks.apply(_bulk(L.KIND_REMOVED, keys, medium, seq))
                truth[medium].difference_update(keys.tolist())
            elif kind == "clear":
                ks.clear_current()
                truth[0].clear()
                truth[1].clear()
            seq += n + 1

        def answered() -> None:
            for m in (0, 1):
                assert ks.acked_keys(m) == kvcm[m]

        for op, medium, n in ops:
            if op in ("store", "remove", "clear"):
                engine(op, medium, n)
            elif op == "delta":  # one request in flight while the engine goes on
                batch = ks.take_batch(n)
                engine("store", medium, n // 2)
                engine("remove", 1 - medium, n // 3)
                failed = list(range(0, len(batch), 7))
                for i, (k, m, pub) in enumerate(batch.triples()):
                    if i not in failed:
                        (kvcm[m].add if pub else kvcm[m].discard)(k)
                ks.confirm(batch, failed)
                answered()
            elif op == "snapshot":  # the whole state in flight, the engine goes on meanwhile
                keys, meds = ks.published()
                engine("remove", medium, n)
                engine("store", 1 - medium, n // 2)
                ks.commit_snapshot(keys, meds)
                for m in (0, 1):
                    kvcm[m] = set(keys[meds == m].tolist())
                answered()
            elif op == "forget":
                ks.forget_acked()
                kvcm = [set(), set()]
                answered()
        while ks.dirty:
            batch = ks.take_batch(4096)
            for k, m, pub in batch.triples():
                (kvcm[m].add if pub else kvcm[m].discard)(k)
            ks.confirm(batch)
        answered()
        for m in (0, 1):
            assert kvcm[m] == truth[m]
            assert set(ks.published_keys(m).tolist()) == truth[m]
        assert ks.in_sync()
    finally:
        key_state._MIN_CAP, key_table.REBUILD_STEP = old


def test_key_state_fold_marks_each_changed_key_dirty_once() -> None:
    """A key stored, removed and stored again in one read is one dirty key; one stored then
    removed again (published before and after: unchanged) is none."""
    ks = KeyState()
    ks.apply(records([(L.KIND_STORED, 0, 9)]))
    ks.confirm(ks.take_batch(10))
    ks.apply(
        records(
            [
                (L.KIND_STORED, 0, 5),
                (L.KIND_REMOVED, 0, 9),
                (L.KIND_STORED, 0, 3),
                (L.KIND_REMOVED, 0, 5),
                (L.KIND_STORED, 0, 9),
                (L.KIND_STORED, 0, 5),
            ],
            start_seq=2,
        )
    )
    batch = ks.take_batch(10)
    assert sorted(batch.pairs()) == [(3, True), (5, True)]  # 9 went and came back: unsent
    assert len(ks.dirty) == 0
    assert ks.published_count == 3


def test_key_state_group_beyond_the_c_fold_is_folded_all_the_same() -> None:
    ks = KeyState(required_groups=(0, 61))
    ks.apply(records([(L.KIND_STORED, 0, 4), (L.KIND_STORED, 61, 4), (L.KIND_STORED, 0, 8)]))
    assert ks.as_dict() == {4: 1 | 1 << 61, 8: 1}
    assert ks.published_count == 1
