"""The hook's flush in C (_accel.Publisher) against the Python flush it stands in for.

The oracle: two hooks fed the same calls, one whose flush() is the C one and one on the numpy /
Python forms (no compiled module), leave the same records in their rings, the same header
counters and the same resident set, whatever the calls: lists, single keys, bad keys, arrays,
clears, a full ring, a wrap, a garbage reader cursor.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
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
from sidecar.shm_ring.doorbell import Listener
from sidecar.shm_ring.reader import RingReader
from tests.unit.hook_pair import assert_same_end, close_pair, python_forms, stop_flusher

accel = compiled.accel
pytestmark = pytest.mark.skipif(
    accel is None or not hasattr(accel, "Publisher"), reason="the C flush was not built"
)


_python_forms = python_forms


def _quiet_hook(name: str, capacity: int, fold_at: int) -> Hook:
    """A hook whose flusher thread has stopped (so only the test's calls publish: the two hooks
    must see the same flushes), folding its resident queue at `fold_at` records."""
    h = engine_hook.attach(
        strict=True, env={}, instance_id="inst", ring_name=name, ring_capacity_slots=capacity
    )
    assert isinstance(h, Hook)
    stop_flusher(h)
    assert h._resident is not None
    h._resident.fold_at = fold_at
    h._set_resident(h._resident)
    return h


_key = st.one_of(st.integers(0, 40), st.integers(-3, -1), st.just((1 << 64) - 1))
_op = st.one_of(
    st.tuples(st.sampled_from(["stored", "removed"]), st.lists(_key, min_size=1, max_size=12)),
    st.tuples(st.sampled_from(["stored1", "removed1"]), _key),
    st.tuples(st.just("bad"), st.sampled_from([[1, True], [2, "x"], [1 << 64, 3]])),
    st.tuples(st.just("array"), st.lists(st.integers(0, 40), min_size=1, max_size=8)),
    st.tuples(st.just("cleared"), st.none()),
    st.tuples(st.just("flush"), st.none()),
    st.tuples(st.just("read"), st.none()),
    st.tuples(st.just("garbage_head"), st.none()),
)


def _call(h: Hook, op: str, arg: Any) -> None:
    if op in ("stored", "removed"):
        getattr(h, op)(list(arg))
    elif op in ("stored1", "removed1"):
        getattr(h, op[:-1])(arg)
    elif op == "bad":
        h.stored(list(arg))
    elif op == "array":
        h.removed(np.array(arg, np.int64))
    elif op == "cleared":
        h.cleared()
    elif op == "flush":
        h.flush()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40), capacity=st.sampled_from([16, 32]))
def test_c_flush_leaves_what_the_python_flush_leaves(
    ops: list[tuple[str, Any]], capacity: int
) -> None:
    names = [f"/kvcm-cflush-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    with _python_forms():
        py = _quiet_hook(names[1], capacity, fold_at=8)
    c = _quiet_hook(names[0], capacity, fold_at=8)
    assert not isinstance(c._pub, hook_mod._FlushState)  # its flush() is the C one
    assert isinstance(py._pub, hook_mod._FlushState)
    readers = [RingReader(h._seg) for h in (c, py)]
    got: list[list[list[int]]] = [[], []]
    try:
        for op, arg in [*ops, ("flush", None), ("read", None)]:
            for i, h in enumerate((c, py)):
                ctx = _python_forms() if h is py else contextlib.nullcontext()
                with ctx:
                    if op == "read":
                        got[i] += readers[i].read().records.tolist()
                    elif op == "garbage_head":  # a reader cursor beyond the tail
                        h._seg.hdr[L.W_HEAD] = int(h._seg.hdr[L.W_TAIL]) + 5
                        readers[i].head = int(h._seg.hdr[L.W_TAIL])
                    else:
                        _call(h, op, arg)
            assert got[0] == got[1]
        hc, hp = c._seg.hdr, py._seg.hdr
        for w in (L.W_TAIL, L.W_LAST_SEQ, L.W_ATTEMPTED, L.W_DROPPED):
            assert hc[w] == hp[w]
        assert_same_end(c, py)
    finally:
        close_pair(readers, (c, py), names)


def test_c_flush_is_one_call_that_publishes_and_queues(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    reader = RingReader(h._seg)
    try:
        assert "flush" in vars(h)  # the instance's flush is the C one, no Python frame
        h.stored([1, 2, 3])
        h.removed(4)
        assert h.flush() == 4
        assert not h._staged
        assert h._pub.flushes == 1 and h.stats()["flushes"] == 1
        assert [(k, m & 0xFF) for _s, k, m, _p in reader.read().records.tolist()] == [
            (1, L.KIND_STORED),
            (2, L.KIND_STORED),
            (3, L.KIND_STORED),
            (4, L.KIND_REMOVED),
        ]
        assert h._resident is not None and h._resident.queued == 4
        assert h._writer.last_seq == 4  # the Python writer reads the cursors back
        assert h.flush() == 0  # nothing staged
    finally:
        reader.close()
        h.close()


def test_c_flush_finds_the_token_taken_and_leaves_everything_staged(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    try:
        h.stored([1, 2])
        h._take()  # as the flusher does, mid-publish
        assert h.flush() == 0
        assert len(h._staged) == 1
        assert h.stats()["flush_busy"] == 1
        assert h._writer.last_seq == 0
        h._give(True)
        assert h.flush() == 2
        assert h.stats()["flush_busy"] == 1
    finally:
        h.close()


def test_c_flush_arguments_and_closed_hook_take_the_python_flush(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    h.stored([1, 2])
    assert h.flush(wait=True) == 2
    h.stored(3)
    assert h.flush(False) == 1
    assert h._pub.flushes == 0 and h.stats()["flushes"] == 2  # both were the Python flush's
    h.close()
    assert h.stats()["problems"] == {}  # its views of the ring let go before the unmap
    h.stored(4)
    assert h.flush() == 0
    assert h.stats()["problems"] == {"closed": 1}


def test_c_flush_rings_a_sleeping_reader(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    rung = threading.Event()
    listener = Listener(ring_name, h._seg.hdr, rung.set)
    try:
        listener.asleep(True)
        h.stored([1])
        assert h.flush() == 1
        assert rung.wait(5)
    finally:
        listener.asleep(False)
        listener.close()
        h.close()


def test_c_flush_posts_the_flusher_to_fold_once_then_folds_itself_when_far_behind(
    ring_name: str,
) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=6)
    assert h._bell is not None and h._resident is not None
    rs, bell = h._resident, h._bell

    def posts() -> int:
        n = 0
        while bell.wait(0):
            n += 1
        return n

    try:
        h.stored([1])  # the first staging after a quiet spell posts the bell (_arm)
        assert h.flush() == 1
        posts()
        h._pub.fold_post_at = 3
        h.stored([2, 3])
        assert h.flush() == 2
        assert h._pub.fold_post_at == hook_mod._NEVER  # posted once, until the flusher folds
        assert posts() == 1
        assert rs.queued == 3
        h.stored([4, 5, 6])
        assert h.flush() == 3
        assert posts() == 0
        assert rs.queued == 0  # fold_at reached: folded in the engine's flush
        assert rs.as_dict() == {(k, 0): 1 for k in range(1, 7)}
        # ... but never waiting for the token: a flusher holding it folds instead
        h.stored([7, 8, 9, 10, 11, 12])
        h._take()
        h._after_flush(hook_mod._AFTER_FOLD)
        assert h.stats()["problems"] == {}
        h._give(True)
        assert h.flush() == 6
        assert rs.queued == 0
    finally:
        h.close()


def test_flusher_sees_the_engines_c_flushes_and_looks_only_at_its_stamp(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    try:
        assert h._flusher_turn(False, 0.0) > 0.5  # nothing staged: QUIET until the stamp
        assert h._mode == hook_mod._Mode.QUIET
        h.stored([1, 2])
        assert h.flush() == 2  # the C flush
        sleep = h._flusher_turn(True, 0.01)
        assert h._mode == hook_mod._Mode.SELF  # the engine flushes itself
        assert sleep > 0.5
        h.stored([3])  # staged after the engine's last flush: the flusher's turn publishes it
        h._flusher_turn(True, 1.5)
        assert h._writer.last_seq == 3
    finally:
        h.close()


def test_c_flush_after_flags_are_the_hooks() -> None:
    assert accel is not None
    assert (accel.AFTER_RING, accel.AFTER_POST, accel.AFTER_FOLD) == (
        hook_mod._AFTER_RING,
        hook_mod._AFTER_POST,
        hook_mod._AFTER_FOLD,
    )
    assert (accel.W_CAPACITY, accel.W_HEAD, accel.W_READER_IDLE, accel.W_HEAD_SEEN) == (
        L.W_CAPACITY,
        L.W_HEAD,
        L.W_READER_IDLE,
        L.W_HEAD_SEEN,
    )


def test_c_flush_refuses_buffers_that_are_not_one_rings() -> None:
    assert accel is not None
    from array import array

    def nop(*_a: object) -> None:
        pass

    hdr = array("Q", bytes(L.HEADER_SIZE))
    with pytest.raises(ValueError, match="not one ring"):  # capacity word says 0
        accel.Publisher([], [True], array("Q", bytes(32 * 8)), hdr, nop, nop)
    hdr[L.W_CAPACITY] = 8
    with pytest.raises(ValueError, match="not one ring"):  # not a power of two of slots
        accel.Publisher([], [True], array("Q", bytes(32 * 6)), hdr, nop, nop)
    with pytest.raises(TypeError):
        accel.Publisher([], [True], array("Q", bytes(32 * 8)), hdr, 1, nop)
    p = accel.Publisher([], [True], array("Q", bytes(32 * 8)), hdr, nop, nop)
    p.release()
    p.release()  # idempotent
    with pytest.raises(RuntimeError, match="not initialised"):
        accel.Publisher.__new__(accel.Publisher).flush()  # (it crashed: a NULL callable)


def test_reading_last_seq_from_another_thread_never_moves_the_writers_cursors(
    ring_name: str,
) -> None:
    # stats() reads last_seq without the token. It used to sync the cursors from the header:
    # in the middle of a Python write (cursors ahead of the header until its last store) that
    # rolled them back, and the write then published the old tail: records lost, no drop.
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    try:
        h.stored([1, 2])
        h.flush()
        w = h._writer
        w._sync()  # as a write starts (the C flush published without this object)
        w._tail += 3  # as a write in progress leaves them
        w._seq += 3
        assert h.stats()["last_seq"] == 2  # the published one
        assert (w._tail, w._seq) == (5, 5)
        w._sync()
    finally:
        h.close()


def test_c_flush_keeps_going_after_the_python_paths_ran_a_ring_ahead(ring_name: str) -> None:
    # The reader's cursor the producer caches fell more than a ring behind the tail while the
    # Python paths published (the flusher, arrays): the C flush must reload it, not give up
    # on itself for good (every later flush would have been the Python one).
    h = _quiet_hook(ring_name, 64, fold_at=1 << 20)
    reader = RingReader(h._seg)
    try:
        for i in range(10):  # 160 records through the Python flush, read as they go
            h.removed(np.arange(16 * i, 16 * i + 16, dtype=np.int64))
            assert h.flush() == 16
            assert len(reader.read().records) == 16
        assert h._pub.flushes == 0
        for i in range(10):
            h.stored([1000 + i, 2000 + i])
            assert h.flush() == 2
            reader.read()
        assert h._pub.flushes >= 9  # (one may meet the wrap: the Python flush's)
        assert h.stats()["dropped"] == 0
    finally:
        reader.close()
        h.close()


def test_c_flush_and_the_python_writer_share_one_cached_reader_cursor(ring_name: str) -> None:
    # A garbage reader cursor: each keeps the last good one it saw, and they must be the same
    # (the Python writer's own copy, never refreshed while the C flush ran, dropped records).
    h = _quiet_hook(ring_name, 16, fold_at=1 << 20)
    reader = RingReader(h._seg)
    try:
        for i in range(9):  # C flushes: the 9th finds 0 free as last seen and reloads (16)
            h.stored([i, 100 + i])
            assert h.flush() == 2
            reader.read()
        assert h._pub.flushes == 9
        hdr = h._seg.hdr
        hdr[L.W_HEAD] = int(hdr[L.W_TAIL]) + 99  # garbage
        h.removed(np.arange(12, dtype=np.int64))  # the Python path: 14 free as last seen
        assert h.flush() == 12
        assert h.stats()["dropped"] == 0
    finally:
        reader.close()
        h.close()


def test_c_flush_lets_a_keyboard_interrupt_through(ring_name: str) -> None:
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    try:

        def interrupted(flags: int) -> None:
            raise KeyboardInterrupt

        h._pub = accel.Publisher(  # type: ignore[union-attr]
            h._staged, h._flush_lock.slot, h._seg.slot_words, h._seg.hdr, h.flush, interrupted
        )
        h._pub.fold_post_at = 1
        h._pub.queue = h._resident.queue if h._resident is not None else None
        h.stored([1])
        with pytest.raises(KeyboardInterrupt):
            h._pub.flush()  # the records are published; the interrupt is the engine's
        assert h._writer.last_seq == 1
        h._pub.release()
    finally:
        h.close()


def test_c_flush_runs_no_python_code_inside_an_except_block(ring_name: str) -> None:
    # A negative single key made the conversion raise (and clear) an OverflowError; inside an
    # `except` block CPython 3.11 makes that exception an object at once, a GC-tracked
    # allocation that ran a collection, and its finalizers (Python code: the GIL could pass to
    # the flusher, which published and emptied `staged` under the C flush: a crash).
    import gc

    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    seen: list[int] = []

    class Finalized:
        me: Any

        def __del__(self) -> None:
            seen.append(len(h._staged))

    def garbage() -> None:
        a = Finalized()
        a.me = a

    h.stored(-5)
    h.stored([1, 2, 3])
    h.removed(-7)
    old = gc.get_threshold()
    gc.collect()
    gc.disable()
    gc.set_threshold(1)
    try:
        try:
            raise ValueError("the engine's error path")
        except ValueError:
            garbage()
            gc.enable()
            assert h.flush() == 5
    finally:
        gc.set_threshold(*old)
        gc.enable()
    gc.collect()
    assert seen and all(n == 0 for n in seen)  # it ran, and never inside the flush
    h.close()


def test_c_flush_on_a_mapping_longer_than_its_ring(ring_name: str) -> None:
    # A segment longer than header + slots is valid (Segment refuses only a short one); the C
    # flush refused it and took the whole hook down (attach gave a NullHook).
    import os

    import posix_ipc

    from sidecar.shm_ring.segment import Segment

    Segment(ring_name, 16).close()
    shm = posix_ipc.SharedMemory(ring_name)
    os.ftruncate(shm.fd, L.segment_bytes(16) + 4096)
    os.close(shm.fd)
    h = _quiet_hook(ring_name, 16, fold_at=1 << 20)
    try:
        assert "flush" in vars(h)
        h.stored(list(range(16)))
        assert h.flush() == 16
        h.stored([99])
        assert h.flush() == 0  # the ring's 16 slots, not the mapping's: full
        assert h.stats()["dropped"] == 1
    finally:
        h.close()


def test_hook_without_a_c_flush_it_could_not_make_keeps_the_python_one(
    ring_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    def refuse(*_a: object) -> None:
        raise ValueError("no")

    assert accel is not None
    fake = types.SimpleNamespace(**{**vars(accel), "Publisher": refuse})
    monkeypatch.setattr(compiled, "accel", fake)
    h = _quiet_hook(ring_name, 1024, fold_at=1 << 20)
    try:
        assert "flush" not in vars(h)
        assert h.stats()["problems"] == {"c_flush_unavailable": 1}
        h.stored([1, 2])
        assert h.flush() == 2
    finally:
        h.close()


def test_c_conversions_hold_near_the_recursion_limit() -> None:
    # A key in [2^63, 2^64) was range-checked with PyObject_RichCompareBool, whose recursion
    # guard raised RecursionError near the limit: half of all 64-bit hashes then fell to the
    # Python flush (which raised it into the engine), and put_runs returned -1 with it set.
    from array import array

    assert accel is not None
    words = array("Q", bytes(32 * 16))
    hdr = array("Q", bytes(L.HEADER_SIZE))
    got: list[int] = []

    def deep(d: int) -> None:
        try:
            deep(d + 1)
        except RecursionError:
            got.append(accel.put_runs([((1 << 63) + 5, 1)], words, hdr, 0, 16, 0, 0, 0))
            raise

    with contextlib.suppress(RecursionError):
        deep(0)
    assert got and all(n == 1 for n in got)
    assert words[1] == (1 << 63) + 5
