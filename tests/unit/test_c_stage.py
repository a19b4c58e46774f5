"""The hook's single-key staging in C (_accel.Publisher.stored / .removed) against the Python
methods it stands in for.

The oracle: two hooks fed the same calls, one whose stored()/removed() are the C ones and one on
the numpy / Python forms (no compiled module), stage the same items after every call (the same
runs, keys staged alone, lists and arrays, in the same order), count the same problems, post the
flusher's bell as often, and leave the same records in their rings and the same resident set.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine_hook
from engine_hook import hook as hook_mod
from engine_hook.hook import Hook
from sidecar.shm_ring import compiled
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.writer import WORDS_MAX
from tests.unit.hook_pair import assert_same_end, close_pair, python_forms, stop_flusher

accel = compiled.accel
pytestmark = pytest.mark.skipif(
    accel is None or not hasattr(accel, "Publisher"), reason="the C staging was not built"
)
U64 = 1 << 64


_python_forms = python_forms


class _Bell:
    """Stands in for the flusher's bell: counts the posts."""

    def __init__(self) -> None:
        self.posts = 0

    def post(self) -> None:
        self.posts += 1

    def close(self) -> None:
        pass


def _quiet_hook(name: str, capacity: int = 1 << 12) -> Hook:
    """A hook with two groups and two mediums whose flusher thread has stopped (only the test's
    calls stage and publish), its bell a counter, armed as the flusher leaves it."""
    h = engine_hook.attach(
        strict=True,
        env={},
        instance_id="inst",
        ring_name=name,
        ring_capacity_slots=capacity,
        group_block_bytes=(4096, 2048),
        medium="hbm",
        mediums=("hbm", "mem"),
    )
    assert isinstance(h, Hook)
    stop_flusher(h)
    assert h._bell is not None
    h._bell.close()
    h._bell = _Bell()  # type: ignore[assignment]
    h._arm()
    return h


def _norm(item: Any) -> Any:
    """A staged item: a key staged alone as it is; a sequence as its keys in KVCM's signed
    spelling (a list is staged as a word array with the C conversion, as a copy without it)."""
    keys, meta = item
    if type(keys) is int:
        return ("alone", keys, meta)
    signed = [k - U64 if type(k) is int and k >= 1 << 63 else k for k in list(keys)]
    return ("seq", signed, meta)


def _staging(h: Hook) -> tuple[Any, ...]:
    """What a hook has staged, its run and where that run is, its posts and problems."""
    run = h._pub.run
    at = next((i for i, it in enumerate(h._staged) if it is run), None)
    bell: Any = h._bell
    assert isinstance(bell, _Bell)
    return (
        [_norm(it) for it in h._staged],
        _norm(run) if run[1] != -1 else None,
        at,
        bell.posts,
        h.stats()["problems"],
    )


_key = st.one_of(
    st.integers(0, 40),
    st.integers(-3, -1),
    st.sampled_from(
        [1 << 63, U64 - 1, U64, 1 << 70, -(1 << 63), -(1 << 63) - 1]  # words, and too wide
    ),
    st.sampled_from([True, False, "7", 7.0, None]),  # never keys: counted, never raised
    st.builds(np.int64, st.integers(0, 40)),
    st.builds(np.uint64, st.integers(0, 40)),
)
_group = st.sampled_from([0, 1, 2, -1, True, np.int64(1), "0"])
_medium = st.sampled_from([None, "hbm", "mem", "ssd", 0])
# How the call spells its arguments: (key), (key, group), (key, group, medium), keywords.
_form = st.sampled_from(["k", "kg", "kgm", "k_g", "k_m", "k_gm", "kg_m", "k_mg", "bad"])
_op = st.one_of(
    st.tuples(st.sampled_from(["stored1", "removed1"]), _key, _form, _group, _medium),
    st.tuples(
        st.sampled_from(["stored", "removed"]),
        st.lists(
            st.one_of(
                st.integers(0, 40), st.integers(-3, -1), st.sampled_from([True, "x", U64, 1 << 70])
            ),
            max_size=6,
        ),
        _form,
        _group,
        _medium,
    ),
    st.tuples(st.just("bad_list"), st.sampled_from([[1, True], [2, "x"], [1 << 64, 3]])),
    st.tuples(
        st.sampled_from(["stored_array", "removed_array"]),
        st.lists(st.one_of(st.integers(0, 40), st.sampled_from([U64 - 1, 1 << 63])), max_size=6),
        st.sampled_from(["int64", "uint64", "int32", ">i8", "bool", "object", "float64"]),
        st.sampled_from(["flat", "column", "strided", "0d"]),
        _form,
        _group,
        _medium,
    ),
    st.tuples(st.sampled_from(["cleared", "flush", "arm"])),
)


def _array(keys: list[int], dtype: str, shape: str) -> np.ndarray:
    if dtype in ("int64", ">i8", "int32", "bool", "float64"):
        keys = [k - U64 if k >= 1 << 63 else k for k in keys]  # (as those dtypes hold them)
    if dtype in ("int32",):
        keys = [k if -(1 << 31) <= k < 1 << 31 else 1 for k in keys]
    a = np.array(keys, dtype=dtype)
    if shape == "column":
        return a.reshape(-1, 1)
    if shape == "strided":
        return np.repeat(a, 2)[::2]
    if shape == "0d":
        return np.array(keys[0] if keys else 0, dtype=dtype)
    return a


def _stage_call(fn: Any, key: Any, form: str, group: Any, medium: Any) -> None:
    if form == "k":
        fn(key)
    elif form == "kg":
        fn(key, group)
    elif form == "kgm":
        fn(key, group, medium)
    elif form == "k_g":
        fn(key, group=group)
    elif form == "k_m":
        fn(key, medium=medium)
    elif form == "k_gm":
        fn(key, group=group, medium=medium)
    elif form == "kg_m":
        fn(key, group, medium=medium)
    elif form == "k_mg":
        fn(key, medium=medium, group=group)
    else:  # wrong arguments: the engine's own TypeError, as from the Python method
        with pytest.raises(TypeError):
            fn(key, group, medium, 4)
        with pytest.raises(TypeError):
            fn(key, 0, group=group)
        with pytest.raises(TypeError):
            fn(keys=key, shelf=1)


def _call(h: Hook, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind in ("stored1", "removed1"):
        _stage_call(getattr(h, kind[:-1]), *op[1:])
    elif kind in ("stored", "removed"):
        keys = list(op[1])
        _stage_call(getattr(h, kind), keys, *op[2:])
        keys[:] = [999] * len(keys)  # an engine reuses its list: the hook staged a copy
    elif kind == "bad_list":
        h.stored(list(op[1]))
    elif kind in ("stored_array", "removed_array"):
        a = _array(*op[1:4])
        _stage_call(getattr(h, kind.split("_")[0]), a, *op[4:])
        if a.dtype != object:
            a[...] = 0  # and its array
    elif kind == "cleared":
        h.cleared()
    elif kind == "flush":
        h.flush()
    elif kind == "arm":
        h._arm()  # as the flusher does before it sleeps: the next staging posts the bell


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=50))
def test_c_staging_stages_what_the_python_methods_stage(ops: list[tuple[Any, ...]]) -> None:
    names = [f"/kvcm-cstage-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    with _python_forms():
        py = _quiet_hook(names[1])
    c = _quiet_hook(names[0])
    assert vars(c)["stored"] == c._pub.stored and vars(c)["removed"] == c._pub.removed
    assert "stored" not in vars(py) and isinstance(py._pub, hook_mod._FlushState)
    readers = [RingReader(h._seg) for h in (c, py)]
    got: list[list[list[int]]] = [[], []]
    try:
        for op in [*ops, ("flush",)]:
            _call(c, op)
            with _python_forms():
                _call(py, op)
                py_staging = _staging(py)
            assert _staging(c) == py_staging, op
            got[0] += readers[0].read().records.tolist()
            with _python_forms():
                got[1] += readers[1].read().records.tolist()
            assert got[0] == got[1]
        assert_same_end(c, py)
    finally:
        close_pair(readers, (c, py), names)


def test_c_staging_is_bound_and_stages_the_common_calls_itself(ring_name: str) -> None:
    h = _quiet_hook(ring_name)
    slow: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def recorder(name: str, method: Any) -> Any:
        def call(*a: Any, **kw: Any) -> None:
            slow.append((name, a, kw))
            method(*a, **kw)

        return call

    try:
        assert type(vars(h)["stored"]).__name__ == "builtin_function_or_method"
        assert vars(h)["stored"].__self__ is h._pub and vars(h)["removed"].__self__ is h._pub
        h.stored([100])  # the Python method's: posts the bell, and the C calls may stage
        assert h._pub.stage == 1 and h._append == h._staged.append
        # The Python methods, behind recorders: the common calls must not reach them.
        h._pub.staging(
            recorder("stored", Hook.stored.__get__(h)),
            recorder("removed", Hook.removed.__get__(h)),
            h._stored_meta,
            h._removed_meta,
            (np.ndarray, np.dtype(np.int64), np.dtype(np.uint64)),
        )
        h.stored(1)
        h.stored(2)  # the same run
        h.stored(U64 - 1, 0, None)
        h.stored(3, 1)  # another group: a new run
        h.stored(4, group=1, medium="mem")
        h.stored(-5)  # KVCM's signed spelling: staged alone
        h.stored(U64)  # too wide: staged alone, rejected by the flush
        h.removed(6)
        h.removed(7, medium="hbm")
        h.stored([8, -9])  # a step's list: its words
        h.removed([10, "x"])  # a key that is no word: a copy, checked at the flush
        h.stored([])  # nothing
        h.stored(np.array([11, U64 - 2], np.uint64))  # an array: its words
        h.removed(np.array([[12], [13]], np.int64), 1)  # any shape that is contiguous
        h.removed(np.array([], np.int64))  # nothing
        assert slow == []
        words = [(type(k).__name__, list(k) if type(k) is not int else k) for k, _m in h._staged]
        assert words == [
            ("array", [100]),
            ("array", [1, 2, U64 - 1]),
            ("array", [3]),
            ("array", [4]),
            ("int", -5),
            ("int", U64),
            ("int", 6),
            ("int", 7),
            ("array", [8, U64 - 9]),
            ("list", [10, "x"]),
            ("ndarray", [11, -2]),  # as Python stages them: an int64 copy of ravel()
            ("ndarray", [12, 13]),
        ]
        assert h._staged[-1][1] == h._removed_meta[1]
        h.stored(True)
        h.removed(np.int64(9))
        h.stored(10, medium="ssd")
        h.removed(11, 5)
        h.stored(np.array([14, 15], np.int32))  # another dtype: Python's int64 copy
        h.stored(np.arange(16, 22)[::2])  # a view (in C too: ravel() copies it)
        assert [(name, a[1:]) for name, a, _kw in slow] == [
            ("stored", ()),
            ("removed", ()),
            ("stored", ()),
            ("removed", (5,)),
            ("stored", ()),
        ]
        assert h._staged[-1][0].tolist() == [16, 18, 20]
        assert h.stats()["problems"] == {"bad_key": 1, "bad_medium": 1, "bad_group": 1}
        assert h.flush() == 22  # U64 and "x" are counted there, not published
        assert h.stats()["problems"] == {"bad_key": 3, "bad_medium": 1, "bad_group": 1}
    finally:
        h.close()


def test_c_staging_posts_the_bell_once_per_quiet_spell(ring_name: str) -> None:
    h = _quiet_hook(ring_name)
    bell: Any = h._bell
    assert isinstance(bell, _Bell)
    try:
        assert h._pub.stage == 0  # armed: the first staging is the Python method's, and posts
        h.stored(1)
        assert bell.posts == 1 and h._pub.stage == 1
        h.stored(2)
        h.removed(3)
        h.stored(4)
        assert bell.posts == 1
        h.flush()
        h._arm()
        h.stored(5)  # (staged empty: a new run)
        assert bell.posts == 2
        h._arm()
        h.stored(6)  # grows the staged run: no new item, so no post, as in Python
        assert bell.posts == 2
        h.removed(6)
        assert bell.posts == 3
    finally:
        h.close()


def test_c_staging_after_close_counts_and_stages_nothing(ring_name: str) -> None:
    h = _quiet_hook(ring_name)
    h.stored(1)
    h.close()
    assert h._pub.stage == 0
    h.stored(2)
    h.removed(3)
    h.stored(4, 1)
    assert h._staged == []
    assert h.stats()["problems"] == {"closed": 3}


def test_c_staging_without_a_publisher_keeps_the_python_methods(ring_name: str) -> None:
    with _python_forms():
        h = _quiet_hook(ring_name)
        try:
            assert "stored" not in vars(h) and "removed" not in vars(h)
            h.stored(1)
            h.stored(2)
            h.removed(2)
            assert [_norm(it)[:2] for it in h._staged] == [("seq", [1, 2]), ("alone", 2)]
            assert type(h._staged[0][0]) is array
            assert h.flush() == 3
        finally:
            h.close()


@pytest.mark.parametrize("form", ["c", "python"])
def test_c_staging_keeps_each_threads_order_beside_the_flusher(ring_name: str, form: str) -> None:
    # Engine threads stage single keys and lists while the flusher and an engine flush()
    # publish, with the GIL switching every microsecond: every transition reaches the ring
    # once, in each thread's order, and the resident set ends in each key's last state. The
    # same is wanted of the Python methods (a build without the C module, or a free-threaded
    # one).
    with _python_forms() if form == "python" else contextlib.nullcontext():
        _threads_keep_their_order(ring_name, form)


@pytest.mark.parametrize("form", ["c", "python"])
def test_resident_set_read_under_the_token_waits_for_the_flushers_fold(
    ring_name: str, form: str
) -> None:
    # The interleaving that failed the threaded test above (4 runs in 30, its Python case): the
    # hook's flusher folds the resident set (FOLD_AT records queued, or its liveness stamp)
    # holding the flush token, while the test read the set (as_dict -> export -> a fold of the
    # same queue) without it: two folds of one queue into one key table at once (a fold is
    # many bytecodes and numpy calls, threads switch inside it) ended keys in another state,
    # or raised IndexError. The set is the token holder's alone (resident.py): here the
    # flusher's stamp fold is held mid-way, deterministically, and a read under the token
    # waits for it and sees every record (a read without it returns at once, beside the fold).
    with _python_forms() if form == "python" else contextlib.nullcontext():
        h = engine_hook.attach(
            strict=True, env={}, instance_id="inst", ring_name=ring_name, group_block_bytes=(4096,)
        )
        assert isinstance(h, Hook) and h._resident is not None and h._bell is not None
        rs = h._resident
        inside, go = threading.Event(), threading.Event()
        try:
            for k in range(1, 40):
                h.stored(k)
            h.removed(list(range(1, 40, 2)))
            assert h.flush() == 39 + 20
            assert rs.queued == 59  # applied, not yet folded (the flusher folds at its stamp)
            real = rs._fold_segment
            flusher = h._thread

            def held(*args: Any) -> None:
                if threading.current_thread() is flusher:
                    inside.set()
                    assert go.wait(5)
                real(*args)

            rs._fold_segment = held  # type: ignore[method-assign, assignment]
            h._next_stamp = 0.0  # the flusher's next turn stamps, so it folds
            h._bell.post()
            assert inside.wait(5)  # the flusher holds the token, its fold under way
            state: list[dict[tuple[int, int], int]] = []

            def read() -> None:
                with h._flush_lock:
                    state.append(rs.as_dict())

            reader = threading.Thread(target=read)
            reader.start()
            reader.join(0.05)
            assert reader.is_alive() and not state  # it waits for the token
            go.set()
            reader.join(5)
            assert state == [{(k, 0): 1 for k in range(2, 40, 2)}]
            assert rs.queued == 0 and not h.stats()["problems"]
        finally:
            go.set()
            h.close()


def test_close_between_the_first_stagings_append_and_its_swap_keeps_the_closed_append(
    ring_name: str,
) -> None:
    # close() swaps `_append` to _closed_append (and stage to 0) between the append of the
    # first staging after a quiet spell and that call's own swap to the plain append: the
    # call must not undo close()'s swap, or every later transition is staged silently into a
    # list no flush publishes (no "closed" problem counted). Forced here: the staged list's
    # append closes the hook.
    class ClosingList(list):  # type: ignore[type-arg]
        def append(self, item: Any) -> None:
            super().append(item)
            h.close()

    with _python_forms():
        h = _quiet_hook(ring_name)
        seg = Segment(ring_name, create=False)  # its own mapping: close() unmaps the hook's
        reader = RingReader(seg)
        try:
            staged = ClosingList(h._staged)
            h._staged = staged
            assert h._append is h._wake
            h.stored(7)
            got = [(k, L.meta_kind(m)) for _s, k, m, _p in reader.read().records.tolist()]
            assert got == [(7, L.KIND_STORED)]  # staged before close()'s swap: published
            assert h._closed and h._append == h._closed_append and h._pub.stage == 0
            h.stored(8)
            h.removed(7)
            assert h.stats()["problems"] == {"closed": 2} and not h._staged
        finally:
            reader.close()
            seg.close()
            h.close()


def _threads_keep_their_order(ring_name: str, form: str) -> None:
    h = engine_hook.attach(
        strict=True,
        env={},
        instance_id="inst",
        ring_name=ring_name,
        ring_capacity_slots=1 << 18,
        group_block_bytes=(4096, 2048),
        max_stage_delay_ms=0.2,
    )
    assert isinstance(h, Hook)
    assert (vars(h).get("stored") == h._pub.stored) if form == "c" else "stored" not in vars(h)
    reader = RingReader(h._seg)
    records: list[list[int]] = []
    threads, keys_per_thread = 3, 6000
    stop = threading.Event()

    def engine(t: int) -> None:
        base = t * 100_000
        for b in range(0, keys_per_thread, 6):
            block = range(base + b, base + b + 6)
            for k in block:
                h.stored(k)  # consecutive keys of one meta: they grow one run
            for k in block:
                h.stored(k, 1)
            for k in block:
                h.removed(k)
            h.stored([k for k in block if k % 7 == 0])  # a list beside the single keys
            if b % 5 == 0:
                h.flush()

    def flusher() -> None:
        while not stop.is_set():
            h.flush()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=engine, args=(t,)) for t in range(threads)]
        extra = threading.Thread(target=flusher)
        extra.start()
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            records += reader.read().records.tolist()
            for w in workers:
                w.join(0.01)
        stop.set()
        extra.join()
    finally:
        sys.setswitchinterval(old)
    h.flush(wait=True)
    records += reader.read().records.tolist()
    try:
        assert h.stats()["dropped"] == 0 and not h.stats()["problems"]
        seqs = [r[0] for r in records]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        per_key: dict[int, list[tuple[int, int]]] = {}
        for _s, k, m, _p in records:
            per_key.setdefault(k, []).append((L.meta_kind(m), L.meta_group(m)))
        S, R = L.KIND_STORED, L.KIND_REMOVED
        for t in range(threads):
            for i in range(keys_per_thread):
                k = t * 100_000 + i
                want = [(S, 0), (S, 1), (R, 0)] + ([(S, 0)] if k % 7 == 0 else [])
                assert per_key.pop(k) == want
        assert not per_key
        assert h._resident is not None
        with h._flush_lock:  # (the flusher may fold meanwhile; only the token's holder may)
            state = h._resident.as_dict()
        for t in range(threads):
            for i in range(keys_per_thread):
                k = t * 100_000 + i
                assert state[(k, 0)] == (0b11 if k % 7 == 0 else 0b10)
    finally:
        reader.close()
        h.close()


@pytest.mark.parametrize("form", ["c", "python"])
def test_single_keys_run_past_words_max_across_the_wrap(
    ring_name: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run of more single keys than one words write takes (WORDS_MAX), meeting the ring's
    # wrap: the general path copies the run's words (it looped over them in Python, ~300 ns a
    # key), every record lands in order and in the resident set.
    n = WORDS_MAX + 904
    with _python_forms() if form == "python" else contextlib.nullcontext():
        h = _quiet_hook(ring_name, capacity=1 << 13)
        reader = RingReader(h._seg)
        try:
            first = list(range(1, n + 1))
            second = [(1 << 63) + k if k % 3 else k for k in range(n + 1, 2 * n + 1)]
            for k in first:
                h.stored(k)
            assert h.flush() == n
            got = reader.read().records.tolist()
            for k in second:
                h.stored(k)
            real = hook_mod.split_keys
            split: list[Any] = []

            def spy(keys: Any) -> Any:
                split.append(type(keys))
                return real(keys)

            monkeypatch.setattr(hook_mod, "split_keys", spy)
            assert len(h._staged) == 1 and len(h._staged[0][0]) == n
            assert h.flush() == n  # (tail n + n wraps a ring of 8192)
            monkeypatch.undo()
            assert array not in split
            got += reader.read().records.tolist()
            assert [k % U64 for _s, k, _m, _p in got] == first + second
            assert {L.meta_kind(m) for _s, _k, m, _p in got} == {L.KIND_STORED}
            assert h._resident is not None
            held = h._resident.as_dict()
            assert {k % U64 for k, _med in held} == set(first + second)
            assert not h.stats()["problems"] and h.stats()["dropped"] == 0
        finally:
            reader.close()
            h.close()
