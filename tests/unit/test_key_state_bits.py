"""apply_bits_at in one C pass (_accel.bits_apply, shm_ring/_bits.c) against its numpy form, and
KeyTable.find's promise that a new position's columns are zero (it no longer writes them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.key_state import KeyState
from sidecar.shm_ring import compiled
from sidecar.shm_ring.key_table import KeyTable

BUILT = compiled.accel  # as imported: other modules' fixtures may switch compiled.accel
needs_bits = pytest.mark.skipif(
    getattr(BUILT, "bits_apply", None) is None, reason="the C loops were not built"
)
T = TypeVar("T")
KEYS = 48  # keys per medium, inserted up front: both states hold them at the same positions
BITS = [1 << b for b in (0, 1, 2, 5, 62)] + [-(1 << 63)]  # group bits; bit 63 is the sign


@contextmanager
def backend(c: bool) -> Iterator[None]:
    was = compiled.accel
    compiled.accel = BUILT if c else None
    try:
        yield
    finally:
        compiled.accel = was


def on(c: bool, call: Callable[..., T], *args: Any) -> T:
    with backend(c):
        return call(*args)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def state(required: tuple[int, ...]) -> KeyState:
    ks = KeyState(required, clock=Clock())
    for m in (0, 1):
        pos = ks.table(m).find(np.arange(100, 100 + KEYS, dtype=np.int64), True)
        assert pos.tolist() == list(range(KEYS))
    return ks


def snapshot(ks: KeyState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "published": ks.published_count,
        "dirty": len(ks.dirty),
        "acked": len(ks.acked),
        "dirty_since": ks.dirty_since,
    }
    for m in range(ks.mediums):
        t = ks._tiers[m]
        n = t.n
        out[f"tier{m}"] = (
            t.masks[:n].tolist(),
            t.queued[:n].tolist(),
            t.acked[:n].tolist(),
            [q.tolist() for q in t.queue],
            t.published_count,
            t.ndirty,
            t.nacked,
        )
    return out


def mask() -> st.SearchStrategy[int]:
    return st.lists(st.sampled_from(BITS), max_size=3).map(lambda b: sum(set(b)))


STEP = st.one_of(
    st.tuples(
        st.just("bits"),
        st.integers(0, 1),  # medium
        st.lists(st.tuples(st.integers(0, KEYS - 1), mask(), mask()), max_size=40),
        # Repeats kept only without a send in the sequence (below): every caller passes
        # distinct positions, and a position queued twice (what a repeat does, on both forms)
        # would be taken twice, where the numpy confirm_all counts it acked twice and the C
        # confirm_run once. The repeat semantics are pinned by the test after this one.
        st.booleans(),
    ),
    st.tuples(st.just("send"), st.integers(1, 30), st.booleans()),  # take, then confirm or fail
    st.tuples(st.just("requeue"), st.integers(0, 1), st.lists(st.integers(0, KEYS - 1))),
)


def run(ks: KeyState, step: tuple[Any, ...]) -> None:
    if step[0] == "bits":
        _, m, items, repeats = step
        if not repeats:
            items = list({p: (p, s, c) for p, s, c in items}.values())
        pos = np.array([p for p, _, _ in items], np.int64)
        set_m = np.array([s for _, s, _ in items], np.int64)
        clr_m = np.array([c for _, _, c in items], np.int64)
        ks.apply_bits_at(m, pos, set_m, clr_m)
    elif step[0] == "send":
        batch = ks.take_batch(step[1])
        ks.confirm(batch, range(0, len(batch), 3) if step[2] else ())
    else:
        _, m, pos = step
        ks.requeue_front(ks.table(m).keys[np.array(pos, np.int64)], m)


@needs_bits
@settings(max_examples=400)
@given(
    required=st.sampled_from([(0,), (1,), (0, 1), (0, 2, 5), (0, 62)]),
    steps=st.lists(STEP, max_size=25),
)
def test_key_state_bits_in_c_leave_what_numpy_leaves(
    required: tuple[int, ...], steps: list[tuple[Any, ...]]
) -> None:
    c, py = on(True, state, required), on(False, state, required)
    if any(step[0] == "send" for step in steps):
        steps = [(*s[:3], False) if s[0] == "bits" else s for s in steps]
    for step in steps:
        on(True, run, c, step)
        on(False, run, py, step)
        assert snapshot(c) == snapshot(py), step


@needs_bits
def test_key_state_bits_repeated_position_sees_the_masks_before_the_call() -> None:
    # The numpy form: every entry's new mask is built from the mask before the call, the last
    # write wins, each entry that flips counts and is queued (twice, if twice).
    outs = []
    for c in (True, False):
        ks = on(c, state, (0,))
        pos, set_m, clr_m = (np.array(v, np.int64) for v in ([3, 3, 4], [1, 2, 1], [0, 0, 0]))
        on(c, ks.apply_bits_at, 0, pos, set_m, clr_m)
        outs.append(snapshot(ks))
    assert outs[0] == outs[1]
    tier0 = outs[0]["tier0"]
    assert tier0[0][3:5] == [2, 1] and tier0[3] == [[3, 4]]
    assert outs[0]["published"] == 2  # 3's second entry (mask 2) flips no published state


@needs_bits
@pytest.mark.parametrize(
    "pos, dtype",
    [([KEYS + 10**6], np.int64), ([-1], np.int64), ([1], np.int32), ([1], np.uint64)],
    ids=["beyond the column", "negative", "int32 bits", "uint64 bits"],
)
def test_key_state_bits_outside_the_common_case_are_numpys(pos: list[int], dtype: type) -> None:
    # bits_apply answers None before writing anything; the numpy form then raises, wraps or
    # casts exactly as it did before the C pass existed.
    assert BUILT is not None
    cols = state((0,)).table(0).cols
    out = np.empty(1, np.int64)
    p = np.array(pos, np.int64)
    bits: np.ndarray = np.ones(1, dtype)
    before = cols["masks"].copy()
    got = BUILT.bits_apply(p, bits, bits, cols["masks"], cols["queued"], 1, out)
    assert got is None and np.array_equal(cols["masks"], before)
    outcome = []
    for c in (True, False):
        ks = on(c, state, (0,))
        try:
            on(c, ks.apply_bits_at, 0, p, bits, np.zeros(1, dtype))
            outcome.append(snapshot(ks))
        except (IndexError, TypeError) as e:
            outcome.append({"raised": type(e)})
    assert outcome[0] == outcome[1]


@settings(max_examples=200)
@given(
    batches=st.lists(
        st.tuples(st.lists(st.integers(0, 400), max_size=60), st.integers(0, 3)), max_size=30
    ),
    add_at=st.integers(0, 30),
)
def test_key_table_new_positions_are_zero_across_growth_and_reindex(
    accel_backend: str, batches: list[tuple[list[int], int]], add_at: int
) -> None:
    # Every live entry is written nonzero and some keys die (all columns back to 0), so the
    # tiny table grows and re-indexes often; a key new to the table must still read zero in
    # every column, and no column may hold anything beyond n.
    table = KeyTable(
        {"masks": np.int64, "acked": np.bool_}, live=("masks", "acked"), min_capacity=16
    )
    model: dict[tuple[int, str], int] = {}  # (key, column) -> its value (0: not held)
    for i, (keys, kill) in enumerate(batches):
        if i == add_at:
            table.add_column("count0", np.int64)
        ukeys = np.array(keys, np.int64)
        before = table.n
        pos = table.find(ukeys, True)
        for name, col in table.cols.items():
            assert len(col) >= table.n
            assert not col[table.n :].any(), name
            new = pos[pos >= before]
            assert not col[new].any(), name
            # Keys found again hold what was written (re-indexes moved them, nothing else).
            want = np.array([model.get((k, name), 0) for k in keys], np.int64)
            if col.dtype == np.bool_:
                want = want != 0
            assert col[pos].tolist() == want.tolist(), name
        for k, p in zip(keys, pos.tolist(), strict=True):
            value = 0 if k % 4 == kill else k + 1  # some keys die: the re-index drops them
            for name, col in table.cols.items():
                col[p] = value
                model[(k, name)] = value
