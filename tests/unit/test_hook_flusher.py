"""The hook's flusher: asleep while nothing is staged, woken by the first staging after a quiet
spell or by the sidecar's snapshot request, never per step of an engine that flushes itself.

Turns are driven directly (`_flusher_turn(posted, now)`) with an injected clock; one test runs
the real thread and waits on the ring, bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import engine_hook
from engine_hook import hook as hook_mod
from engine_hook.hook import Hook
from sidecar.shm_ring import layout as L
from sidecar.shm_ring import snapshot
from sidecar.shm_ring.doorbell import EngineBell, ring_engine
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment

# Over the C hot loops and their Python forms (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

DELAY_S = 0.005


def _driven(ring_name: str, **kw: Any) -> tuple[Hook, RingReader]:
    """A hook whose flusher turns the test makes itself (no thread), with the bell armed."""
    h = engine_hook.attach(
        strict=True,
        env={},
        instance_id="inst",
        ring_name=ring_name,
        ring_capacity_slots=1024,
        max_stage_delay_ms=DELAY_S * 1e3,
        start_flusher=False,
        **kw,
    )
    assert isinstance(h, Hook)
    h._bell = EngineBell(ring_name)
    h._arm()
    return h, RingReader(Segment(ring_name))


def _keys(reader: RingReader) -> list[int]:
    return [int(k) for k in reader.read().records[:, L.C_KEY]]


def test_hook_flusher_idle_sleeps_until_the_stamp(ring_name: str) -> None:
    h, reader = _driven(ring_name)
    assert h._flusher_turn(False, 100.0) == pytest.approx(hook_mod.STAMP_S)
    assert h._flusher_turn(False, 100.4) == pytest.approx(hook_mod.STAMP_S - 0.4)
    assert h.stats()["flusher_mode"] == "quiet"
    stamp = reader.producer_liveness_ns()
    h._flusher_turn(False, 101.0)  # the stamp was due
    assert reader.producer_liveness_ns() > stamp
    assert h._bell is not None and not h._bell.wait(0)  # nothing staged: nobody posted
    h.close()
    reader.close()


def test_hook_flusher_first_staging_posts_and_is_published_one_delay_later(
    ring_name: str,
) -> None:
    h, reader = _driven(ring_name)
    h._flusher_turn(False, 10.0)
    h.stored(5)  # the engine never calls flush()
    h.stored(6)
    assert h._bell is not None and h._bell.wait(0)
    assert not h._bell.wait(0)  # one post per quiet spell
    assert h._flusher_turn(True, 10.1) == pytest.approx(DELAY_S)  # the engine may flush itself
    assert _keys(reader) == []
    assert h._flusher_turn(False, 10.1 + DELAY_S) == pytest.approx(DELAY_S)
    assert _keys(reader) == [5, 6]
    assert h.stats()["flusher_mode"] == "watch"
    h._flusher_turn(False, 10.2)  # nothing more: quiet again, the bell armed
    assert h.stats()["flusher_mode"] == "quiet"
    h.removed(5)
    assert h._bell.wait(0)
    h.close()
    reader.close()


def test_hook_flusher_is_not_woken_per_step_of_an_engine_that_flushes(ring_name: str) -> None:
    h, reader = _driven(ring_name)
    assert h._bell is not None
    h._flusher_turn(False, 0.0)
    h.stored([1, 2])
    assert h._bell.wait(0)
    h._flusher_turn(True, 0.01)
    h.removed([1])
    h.flush()  # the engine flushes its own step
    # Only a safety net now: it sleeps until its liveness stamp (one wake-up a second).
    assert h._flusher_turn(False, 0.02) == pytest.approx(hook_mod.STAMP_S - 0.02)
    assert h.stats()["flusher_mode"] == "self"
    for step in range(50):
        h.stored([100 + step] * 3)
        h.removed([100 + step])
        h.flush()
        assert not h._bell.wait(0), f"step {step} woke the flusher"
    assert h._flusher_turn(False, 1.0) == pytest.approx(hook_mod.STAMP_S)
    assert h.stats()["flusher_mode"] == "self"
    h.stored([7])  # staged, and the engine stops flushing: the next look publishes it
    h._flusher_turn(False, 2.0)
    assert _keys(reader)[-1] == 7
    assert h.stats()["flusher_mode"] == "watch"
    h._flusher_turn(False, 2.01)
    assert h.stats()["flusher_mode"] == "quiet"
    h.close()
    reader.close()


def test_hook_flusher_answers_a_snapshot_request_at_the_posted_turn(ring_name: str) -> None:
    h, reader = _driven(ring_name)
    h.stored(np.arange(1, 4))
    h.flush()
    h._flusher_turn(False, 0.0)
    seg = Segment(ring_name)
    req = snapshot.request(seg)  # posts the engine's bell
    assert h._bell is not None and h._bell.wait(0)
    h._flusher_turn(True, 0.1)
    snap = snapshot.poll(seg, req)
    assert snap is not None and sorted(snap.keys[snap.masks != 0].tolist()) == [1, 2, 3]
    seg.close()
    h.close()
    reader.close()


def test_engine_bell_holds_at_most_one_post_from_the_reader(ring_name: str) -> None:
    bell = EngineBell(ring_name)
    ring_engine(ring_name)
    ring_engine(ring_name)
    assert bell.wait(0)
    assert not bell.wait(0)
    bell.close()
    ring_engine(ring_name + "-none")  # no producer bell: nothing to post, nothing raised


def test_hook_flusher_thread_answers_an_idle_engines_snapshot(ring_name: str) -> None:
    h = engine_hook.attach(strict=True, env={}, instance_id="inst", ring_name=ring_name)
    assert isinstance(h, Hook)
    h.stored([11, 12])
    seg = Segment(ring_name)
    deadline = time.monotonic() + 10
    while h.stats()["flusher_mode"] != "quiet" and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, bounded: the flusher publishes, then sleeps
    req = snapshot.request(seg)
    snap = None
    while snap is None and time.monotonic() < deadline:
        snap = snapshot.poll(seg, req)
    assert snap is not None and sorted(snap.keys.tolist()) == [11, 12]
    seg.close()
    h.close()


def test_hook_flush_rings_a_sleeping_readers_doorbell_after_publishing(ring_name: str) -> None:
    import posix_ipc

    h, reader = _driven(ring_name)
    sem = posix_ipc.Semaphore(L.doorbell_name(ring_name), posix_ipc.O_CREAT, initial_value=0)
    reader.seg.hdr[L.W_READER_IDLE] = 1  # the reader sleeps on its doorbell
    h.stored([1, 2, 3])
    h.flush()
    assert sem.value == 1 and _keys(reader) == [1, 2, 3]
    h.flush()  # nothing new: no post
    assert sem.value == 1
    sem.close()
    h.close()
    reader.close()


def test_hook_flush_posts_the_flusher_once_to_fold_and_never_folds_itself(
    ring_name: str,
) -> None:
    """The resident set's fold runs in the flusher: a flush that leaves FOLD_AT records queued
    posts it once (not per flush), the flusher's turn folds them all and re-arms the post."""
    from engine_hook import resident

    h, reader = _driven(ring_name)
    assert h._bell is not None and h._resident is not None
    h._resident.fold_at = hook_mod.FOLD_BEHIND  # as with a flusher thread
    h._pub.fold_post_at = resident.FOLD_AT
    h._flusher_turn(False, 0.0)
    h.stored([1])
    h.flush()
    assert h._bell.wait(0)  # the first staging's post
    h._flusher_turn(True, 0.001)  # the engine flushed itself: SELF
    per_step = 64
    steps = resident.FOLD_AT // (2 * per_step)
    for step in range(steps - 1):
        keys = list(range(10 + step * per_step, 10 + (step + 1) * per_step))
        h.stored(keys)
        h.removed(keys)
        h.flush()
        assert not h._bell.wait(0), f"step {step} woke the flusher"
    assert 0 < h._resident.queued < resident.FOLD_AT
    h.stored([5] * per_step)
    h.removed([6] * per_step)
    h.flush()  # FOLD_AT reached: one post, and the engine's flush did not fold
    assert h._resident.queued >= resident.FOLD_AT
    h.stored([5])
    h.flush()
    assert h._bell.wait(0) and not h._bell.wait(0)
    h._flusher_turn(True, 0.01)
    assert h._resident.queued == 0
    assert h._resident.as_dict() == {(1, 0): 1, (5, 0): 1}
    h.stored(list(range(100, 100 + resident.FOLD_AT)))
    h.flush()
    assert h._bell.wait(0)  # re-armed by the fold
    h.close()
    reader.close()


def test_flush_token_excludes_every_taker_and_wakes_its_waiter() -> None:
    # The engine's flush takes it without waiting (IndexError: busy) and gives it back; the
    # flusher, close() and flush(wait=True) wait for it (`with token:`), woken by the giver.
    from engine_hook.hook import _FlushToken

    tok = _FlushToken()
    tok.take()  # held: by an engine flush, say
    inside = threading.Event()

    def waiter() -> None:
        with tok:
            inside.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not tok.waiting and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert tok.waiting and not inside.is_set()  # it waits while the token is taken
    tok.give(True)
    tok.woken()
    assert inside.wait(5)
    t.join(5)
    with pytest.raises(IndexError):  # given back once: one item, not two
        tok.take()
        tok.take()

    tok = _FlushToken()
    holders: list[int] = []
    overlaps: list[int] = []

    def hold(who: int) -> None:
        if holders:
            overlaps.append(who)
        holders.append(who)
        holders.remove(who)

    def blocking(who: int) -> None:
        for _ in range(2000):
            with tok:
                hold(who)

    def engine() -> None:
        for _ in range(4000):
            try:
                tok.take()
            except IndexError:
                continue
            try:
                hold(99)
            finally:
                tok.give(True)
                if tok.waiting:
                    tok.woken()

    threads = [threading.Thread(target=blocking, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=engine))
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert overlaps == []
    tok.take()  # exactly one token left
    with pytest.raises(IndexError):
        tok.take()
