"""Rule-based state machine: the ring against a deque model (order, dense seq, drops, capacity)."""

from __future__ import annotations

import os
import uuid
from collections import deque

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.shm_ring.writer import RingWriter

CAP = 16


class RingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.name = f"/kvcm-sm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.wseg = Segment(self.name, CAP)
        self.writer = RingWriter(self.wseg)
        self.rseg = Segment(self.name, CAP)
        self.reader = RingReader(self.rseg)
        self.model: deque[tuple[int, int]] = deque()  # (seq, key)
        self.dropped = 0
        self.next_key = 0
        self.seq = 0
        self.expect_new_incarnation = False
        self.stale = 0  # unread records of a dead incarnation: they hold space until the next read

    @rule(n=st.integers(1, 3 * CAP))
    def put(self, n: int) -> None:
        keys = np.arange(self.next_key, self.next_key + n, dtype=np.int64)
        self.next_key += n
        accepted = self.writer.write(keys, L.pack_meta(L.KIND_STORED))
        room = CAP - len(self.model) - self.stale
        assert accepted == min(n, room)
        for k in keys[:accepted].tolist():
            self.seq += 1
            self.model.append((self.seq, k))
        self.dropped += n - accepted

    @rule(limit=st.integers(1, 2 * CAP))
    def drain(self, limit: int) -> None:
        res = self.reader.read(limit)
        self.stale = 0
        assert not res.gap and not res.anomalies
        assert res.new_incarnation == self.expect_new_incarnation or not len(res.records)
        if len(res.records) or res.new_incarnation:
            self.expect_new_incarnation = False
        want = [self.model.popleft() for _ in range(min(limit, len(self.model)))]
        got = [(int(s), int(np.int64(k))) for s, k in res.records[:, :2].view(np.int64).tolist()]
        assert got == want

    @rule()
    def reader_reattach(self) -> None:
        self.reader.close()
        self.rseg.close()
        self.rseg = Segment(self.name, CAP)
        self.reader = RingReader(self.rseg)
        self.expect_new_incarnation = False  # a fresh reader resyncs anyway; nothing is "new" to it

    @precondition(lambda self: self.seq > 0)
    @rule()
    def producer_restart(self) -> None:
        self.writer.close()
        self.wseg.close()
        self.wseg = Segment(self.name, CAP)
        self.writer = RingWriter(self.wseg)
        self.stale += len(self.model)
        self.model.clear()  # the old incarnation's unread records describe a dead cache
        self.seq = 0
        self.expect_new_incarnation = self.reader.incarnation is not None

    @invariant()
    def counters_match(self) -> None:
        assert self.writer.dropped == self.dropped
        assert 0 <= self.reader.lag() <= CAP
        assert self.writer.last_seq == self.seq

    def teardown(self) -> None:
        self.reader.close()
        self.writer.close()
        self.rseg.close()
        self.wseg.close()
        unlink(self.name)


RingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_ring_matches_deque_model = RingMachine.TestCase
