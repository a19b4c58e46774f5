"""The hook never loses a transition: ring drops, snapshots and the resident set (hypothesis).

A rule-based state machine drives the real hook (no provider, so snapshots answer from its own
resident set) against a tiny real ring, read by the sidecar's real EngineSync into its real
per-medium KeyState: on a drop or gap it requests a snapshot, buffers what it reads meanwhile,
replaces its view with the snapshot and applies only records after the fence. The oracle is the
fold of every call made.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

import engine_hook
from engine_hook.hook import Hook
from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.source.engine_sync import EngineSync, Sync
from tests.oracle import fold_mediums

MEDIUMS = ("hbm", "mem", "disk")
GROUPS = 3
KEYS = st.integers(0, 24) | st.sampled_from([2**64 - 1, 2**63, -(2**63), 2**63 - 1])
MEDIUM = st.sampled_from([None, None, "hbm", "mem", "disk"])


def _signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


class HookDropsMachine(RuleBasedStateMachine):
    hook: Hook
    sync: EngineSync

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, int, int]] = []
        self.ring = ""

    @initialize(capacity=st.sampled_from([8, 16, 32, 64]))
    def attach(self, capacity: int) -> None:
        self.ring = f"/kvcm-hyp-{uuid.uuid4().hex[:10]}"
        hook = engine_hook.attach(
            strict=True,
            env={},
            instance_id="hyp",
            ring_name=self.ring,
            ring_capacity_slots=capacity,
            group_block_bytes=(64,) * GROUPS,
            mediums=MEDIUMS,
            start_flusher=False,  # the test decides when flushes (and snapshot answers) happen
        )
        assert isinstance(hook, Hook)
        self.hook = hook
        self.sync = EngineSync(RingReader(Segment(self.ring)), KeyState(range(GROUPS)))
        self.sync.n_mediums = len(MEDIUMS)

    def view(self) -> dict[tuple[int, int], int]:
        keys = self.sync.keys
        return {(k, m): mask for m in range(len(MEDIUMS)) for k, mask in keys.as_dict(m).items()}

    def _record(self, kind: int, keys: list[int], group: int, medium: str | None) -> None:
        m = 0 if medium is None else MEDIUMS.index(medium)
        self.calls.extend((kind, group, m, _signed(k)) for k in keys)

    @rule(key=KEYS, group=st.integers(0, GROUPS - 1), medium=MEDIUM, stored=st.booleans())
    def scalar(self, key: int, group: int, medium: str | None, stored: bool) -> None:
        (self.hook.stored if stored else self.hook.removed)(key, group, medium=medium)
        self._record(L.KIND_STORED if stored else L.KIND_REMOVED, [key], group, medium)

    @rule(
        keys=st.lists(KEYS, min_size=1, max_size=40),
        group=st.integers(0, GROUPS - 1),
        medium=MEDIUM,
        stored=st.booleans(),
        as_array=st.booleans(),
        bad=st.sampled_from([None, None, None, 1.5, 2**64, "x"]),
    )
    def many(
        self,
        keys: list[int],
        group: int,
        medium: str | None,
        stored: bool,
        as_array: bool,
        bad: Any,
    ) -> None:
        arg: Any = np.array([k & (2**64 - 1) for k in keys], np.uint64) if as_array else list(keys)
        if bad is not None and not as_array:
            arg.insert(len(arg) // 2, bad)  # a bad key costs only itself
        (self.hook.stored if stored else self.hook.removed)(arg, group, medium=medium)
        self._record(L.KIND_STORED if stored else L.KIND_REMOVED, keys, group, medium)

    @rule()
    def cleared(self) -> None:
        self.hook.cleared()
        self.calls.append((L.KIND_CLEARED, 0, 0, 0))

    @rule()
    def flush(self) -> None:
        self.hook.flush()  # no flusher thread: this also answers a pending snapshot request

    @rule(n=st.integers(1, 80))
    def drain(self, n: int) -> None:
        self.sync.step(n)

    @precondition(lambda self: self.sync.status is Sync.SYNCED)
    @rule()
    def sidecar_requests_snapshot(self) -> None:
        self.sync.request("test")

    @rule()
    def converge_and_compare(self) -> None:
        """Flush and drain until synced and caught up: the view is the fold of every call."""
        for _ in range(20):
            self.hook.flush()
            while self.sync.step(1 << 16).records:
                pass
            if self.sync.status is Sync.SYNCED and self.sync.reader.idle():
                break
        assert self.sync.status is Sync.SYNCED, "the sidecar never got a snapshot it could trust"
        truth = fold_mediums(self.calls)
        assert self.view() == truth  # so nothing removed reappears, nothing stored is missing
        assert self.hook.stats()["problems"].get("internal", 0) == 0

    def teardown(self) -> None:
        if not self.ring:
            return
        try:
            self.converge_and_compare()
        finally:  # a failing example must not leak its segments
            self.hook.close()
            self.sync.reader.close()
            self.sync.reader.seg.close()
            unlink(self.ring)


@pytest.mark.usefixtures("accel_backend")  # the C hot loops and their Python forms
def test_hook_never_loses_a_transition_through_drops_and_snapshots() -> None:
    run_state_machine_as_test(
        HookDropsMachine,
        settings=settings(max_examples=300, stateful_step_count=40, deadline=None),
    )
