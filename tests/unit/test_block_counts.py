"""BlockCounts: store counts per (key, medium, group) == one-at-a-time clamped counting, through
re-indexes of tiny tables in the middle of folds; held() == positive counts; checkpoint loads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import key_state
from sidecar.key_state import KeyState
from sidecar.shm_ring import key_index, key_table
from sidecar.source.block_counts import BlockCounts

# Over KeyIndex's C probe and its numpy fallback (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

Counts = dict[tuple[int, int, int], int]
POOL = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40, unique=True)
EVENT = st.tuples(
    st.integers(0, 39), st.integers(0, 1), st.integers(0, 1), st.sampled_from([1, -1])
)
STEP = st.one_of(st.just("clear"), st.lists(EVENT, max_size=120))


@pytest.fixture
def tiny_tables() -> Iterator[None]:
    # 16-slot tables re-indexed 3 keys at a time: folds run through starts, steps and switches.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_state, "_MIN_CAP", 16)
        mp.setattr(key_table, "REBUILD_STEP", 3)
        mp.setattr(key_table, "FAULT_STEP_BYTES", 4096)
        yield


def fold(ref: Counts, events: list[tuple[int, int, int, int]]) -> None:
    for key, medium, group, sign in events:
        t = (key, medium, group)
        n = ref.get(t, 0) + sign
        if n > 0:
            ref[t] = n
        else:
            ref.pop(t, None)


def check(bc: BlockCounts, ks: KeyState, ref: Counts) -> None:
    assert bc.counts() == ref
    assert bc.held() == len(ref)
    for m in range(ks.mediums):
        t = ks.table(m)
        used = t.idx._tpos > 0
        assert len(np.unique(t.idx._tkeys[used])) == int(used.sum()) == t.n  # each key once
        want: dict[int, int] = {}
        for k, mm, g in ref:
            if mm == m:
                want[k] = want.get(k, 0) | (1 << g)
        assert ks.as_dict(m) == want  # group bits follow the counts


@pytest.mark.usefixtures("tiny_tables")
@settings(max_examples=150, deadline=None)
@given(pool=POOL, steps=st.lists(STEP, max_size=12), tail=st.sampled_from([0, 2, 512]))
def test_block_counts_fold_equals_one_at_a_time_counting_through_reindexes(
    pool: list[int], steps: list[str | list[tuple[int, int, int, int]]], tail: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_index, "_TAIL", tail)  # probing by slot, by windows, or switching
        ks = KeyState((0,))
        bc = BlockCounts(ks)
        ref: Counts = {}
        for step in steps:
            if isinstance(step, str):  # "clear"
                bc.clear()
                ref.clear()
            elif step:
                ev = [(pool[i % len(pool)], m, g, s) for i, m, g, s in step]
                bc.apply(
                    np.array([e[0] for e in ev], np.int64),
                    np.array([e[1] for e in ev], np.uint8),
                    np.array([e[2] for e in ev], np.uint8),
                    np.array([e[3] for e in ev], np.int8),
                )
                fold(ref, ev)
            check(bc, ks, ref)
        copy_ks = KeyState((0,))
        copy = BlockCounts(copy_ks)  # a checkpoint round trip
        for m, g, k, c in bc.arrays():
            copy.load(m, g, k, c)
        check(copy, copy_ks, ref)


def test_block_counts_load_adds_up_repeated_keys_and_ignores_non_positive_counts() -> None:
    ks = KeyState((0,))
    bc = BlockCounts(ks)
    bc.load(0, 0, np.array([5, 5, 6, 9], np.int64), np.array([1, 2, 0, -3], np.int64))
    assert bc.counts() == {(5, 0, 0): 3}
    assert bc.held() == 1
    zero = np.zeros(1, np.uint8)
    bc.apply(np.array([9], np.int64), zero, zero, np.ones(1, np.int8))
    assert bc.counts() == {(5, 0, 0): 3, (9, 0, 0): 1}  # -3 was not kept: one store holds it
    assert sorted(ks.published_keys().tolist()) == [5, 9]


def test_block_counts_repeats_of_few_keys_do_not_grow_or_reindex_the_table() -> None:
    ks = KeyState((0,))
    bc = BlockCounts(ks)
    keys = np.repeat(np.arange(2_000, dtype=np.int64), 30)  # 60 000 events, 2 000 keys
    ones = np.ones(len(keys), np.int8)
    zeros = np.zeros(len(keys), np.uint8)
    cap = ks.table(0).idx.cap
    bc.apply(keys, zeros, zeros, ones)
    t = ks.table(0)
    assert (t.n, t.idx.cap, t.epoch, t.rebuild) == (2_000, cap, 0, None)
    assert bc.held() == 2_000


def test_block_counts_fresh_key_churn_keeps_the_tables_bounded() -> None:
    # A ZMQ engine's steady state (the chaos run's vLLM/SGLang workload, issue #25's soak):
    # every block hash is new, ~1 000 held per medium, each stored block later removed, KVCM
    # acking every delta. 120 000 distinct keys pass through 65 536-slot tables: removed keys
    # must leave at each re-index, so positions, capacity and columns stay what ~1 000 keys need.
    ks = KeyState((0,))
    bc = BlockCounts(ks)
    rng = np.random.default_rng(25)
    held: list[np.ndarray] = []
    per_step, hold_steps = 100, 10
    sizes: set[tuple[int, int, int, int]] = set()
    for step in range(1_200):
        fresh = rng.integers(-(2**63), 2**63 - 1, per_step, dtype=np.int64)
        held.append(fresh)
        gone = held.pop(0) if len(held) > hold_steps else np.zeros(0, np.int64)
        keys = np.concatenate([fresh, fresh[:20], gone])  # some blocks stored twice
        signs = np.concatenate([np.ones(per_step + 20, np.int8), -np.ones(len(gone), np.int8)])
        meds = (np.arange(len(keys)) % 2).astype(np.uint8)  # GPU and CPU
        meds[per_step : per_step + 20] = meds[:20]
        bc.apply(keys, meds, np.zeros(len(keys), np.uint8), signs)
        if len(gone):  # the extra copies go with their block
            bc.apply(gone[:20], meds[:20], np.zeros(20, np.uint8), -np.ones(20, np.int8))
        while len(batch := ks.take_batch(4096)):
            ks.confirm(batch)
        if step >= 600:  # the second half: sizes must not grow with the keys seen
            for m in range(ks.mediums):
                t = ks.table(m)
                sizes.add((m, t.idx.cap, len(t.cols["masks"]), len(bc._mark)))
    assert bc.held() == hold_steps * per_step  # (key, medium, group)s: copies count once
    assert len(ks.published()[0]) == hold_steps * per_step
    for m, cap, col, mark in sizes:
        assert cap == key_state._MIN_CAP, (m, cap)  # never grew past the first capacity
        assert col <= cap and mark <= cap, (m, col, mark)
    assert all(ks.table(m).n < key_state._MIN_CAP for m in range(ks.mediums))
