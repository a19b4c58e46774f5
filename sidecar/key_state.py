"""What is published, what KVCM has confirmed, and the difference between them.

Imports: numpy + sidecar.shm_ring. Per key: the cache groups that hold it (from the ring and
engine snapshots; published when every required group does), whether KVCM has confirmed it
(`acked`), and whether it waits in the dirty queue. Sending is always "make KVCM's copy equal to
the engine's", so retries are idempotent and per-key coalescing (last state wins) is free.
Everything lives in dense numpy columns behind a hash index (shm_ring/key_table.py, ~52 bytes per
key, re-indexed in bounded steps), and every operation works on whole batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.key_table import KeyTable, Mover
from sidecar.shm_ring.layout import KIND_CLEARED

_MIN_CAP = 1 << 16  # ~2 MB to start with; smaller made the first 100 k keys re-index 5 times


class _Size:
    """len() and truthiness of a count (what callers ask of `dirty` and `acked`)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0


class Batch:
    """Keys taken for one delta request: adds first, then deletes (the item_results order)."""

    __slots__ = ("epoch", "keys", "pos", "publish")

    def __init__(
        self, keys: np.ndarray, publish: np.ndarray, pos: np.ndarray | None = None, epoch: int = -1
    ) -> None:
        self.keys = keys  # int64 bit patterns
        self.publish = publish  # bool: ADD (True) or DELETE (False)
        self.pos = pos  # dense positions in the key state of `epoch` (saves a lookup)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def adds(self) -> np.ndarray:
        out: np.ndarray = self.keys[self.publish]
        return out

    @property
    def deletes(self) -> np.ndarray:
        out: np.ndarray = self.keys[~self.publish]
        return out

    def pairs(self) -> list[tuple[int, bool]]:
        """(key, publish?) per item, for tests and diagnostics."""
        return list(zip(self.keys.tolist(), self.publish.tolist(), strict=True))


_EMPTY = Batch(np.zeros(0, np.int64), np.zeros(0, np.bool_))


class KeyState:
    def __init__(
        self, required_groups: Iterable[int] = (0,), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.dirty_since = 0.0  # when the dirty queue last went from empty to non-empty
        self.required = sum(1 << g for g in set(required_groups)) or 1
        self.published_count = 0
        self._t = KeyTable(
            {"masks": np.int64, "acked": np.bool_, "queued": np.bool_},
            live=("masks", "acked", "queued"),  # held, confirmed, or waiting to be sent
            min_capacity=_MIN_CAP,
        )
        self._t.on_move = self._move_queue
        self._queue: list[np.ndarray] = []  # dense positions, in the order they became dirty
        self._ndirty = 0
        self._nacked = 0

    # ---- storage: columns in a KeyTable (re-indexed in bounded steps) -----------------------
    @property
    def _masks(self) -> np.ndarray:
        return self._t.cols["masks"]

    @property
    def _acked(self) -> np.ndarray:
        return self._t.cols["acked"]

    @property
    def _queued(self) -> np.ndarray:
        return self._t.cols["queued"]

    @property
    def _n(self) -> int:
        return self._t.n

    @property
    def _keys(self) -> np.ndarray:
        return self._t.keys

    def _find(self, ukeys: np.ndarray, insert: bool) -> np.ndarray:
        """Dense position of each distinct key (-1 if absent and not inserting)."""
        return self._t.find(ukeys, insert)

    def _move_queue(self, moved: Mover) -> None:
        self._queue = [moved(q) for q in self._queue if len(q)]  # queued keys are live

    def _published(self, masks: np.ndarray) -> np.ndarray:
        out: np.ndarray = (masks & self.required) == self.required
        return out

    def _mark_dirty(self, pos: np.ndarray, front: bool = False) -> None:
        """Queue the positions not queued yet: last in line, or first (`front`, for retries)."""
        pos = pos[~self._queued[pos]]
        if len(pos):
            if not self._ndirty:
                self.dirty_since = self.clock()
            self._queued[pos] = True
            if front:
                self._queue.insert(0, pos)
            else:
                self._queue.append(pos)
            self._ndirty += len(pos)

    # ---- views --------------------------------------------------------------------------------
    @property
    def dirty(self) -> _Size:
        return _Size(self._ndirty)

    @property
    def acked(self) -> _Size:
        return _Size(self._nacked)

    def set_required(self, required_groups: Iterable[int]) -> None:
        req = sum(1 << g for g in set(required_groups)) or 1
        if req != self.required:
            self.required = req
            self.published_count = int(self._published(self._masks[: self._n]).sum())

    def is_published(self, key: int) -> bool:
        pos = self._find(np.array([key], np.int64), insert=False)[0]
        return bool(pos >= 0 and self._published(self._masks[pos : pos + 1])[0])

    def as_dict(self) -> dict[int, int]:
        """key -> group mask of every held key (for tests and diagnostics)."""
        n = self._n
        held = self._masks[:n] != 0
        return dict(zip(self._keys[:n][held].tolist(), self._masks[:n][held].tolist(), strict=True))

    def acked_keys(self) -> set[int]:
        n = self._n
        return set(self._keys[:n][self._acked[:n]].tolist())

    def published_keys(self) -> np.ndarray:
        n = self._n
        keys: np.ndarray = self._keys[:n][self._published(self._masks[:n])]
        return keys

    # ---- engine side --------------------------------------------------------------------
    def apply(self, records: np.ndarray) -> None:
        """Fold ring records ((n, 4) uint64 rows: seq, key, meta, parent)."""
        if not len(records):
            return
        kinds = (records[:, 2] & 0xFF).astype(np.uint8)
        start = 0
        for c in np.flatnonzero(kinds == KIND_CLEARED).tolist():  # a clear splits the batch
            self._apply_segment(records[start:c])
            self._clear()
            start = c + 1
        self._apply_segment(records[start:])

    def _apply_segment(self, records: np.ndarray) -> None:
        if not len(records):
            return
        ukeys, set_m, clr_m = fold_ops(records[:, 1].view(np.int64), records[:, 2])
        pos = self._find(ukeys, insert=True)
        old = self._masks[pos]
        new = (old & ~clr_m) | set_m
        self._masks[pos] = new
        was, now = self._published(old), self._published(new)
        self.published_count += int(now.sum()) - int(was.sum())
        self._mark_dirty(pos[was != now])

    def _clear(self) -> None:
        n = self._n
        self._mark_dirty(np.flatnonzero(self._published(self._masks[:n])))
        self._masks[:n] = 0
        self.published_count = 0

    def clear_current(self) -> None:
        """The engine's cache is empty (a new engine incarnation)."""
        self._clear()

    def replace(self, keys: np.ndarray, masks: np.ndarray) -> None:
        """Replace the engine state with a snapshot; a key may repeat; mask 0 = not held."""
        held = masks != 0
        keys, masks = keys[held], masks[held].astype(np.int64)
        order = np.argsort(keys, kind="stable")
        keys, masks = keys[order], masks[order]
        first = np.ones(len(keys), np.bool_)
        first[1:] = keys[1:] != keys[:-1]
        idx = np.flatnonzero(first)
        ukeys = keys[idx]
        umasks = np.bitwise_or.reduceat(masks, idx) if len(idx) else masks[:0]
        pos = self._find(ukeys, insert=True)
        n = self._n
        new = np.zeros(n, np.int64)
        new[pos] = umasks
        was, now = self._published(self._masks[:n]), self._published(new)
        self._masks[:n] = new
        self.published_count = int(now.sum())
        self._mark_dirty(np.flatnonzero(was != now))

    # ---- KVCM side ----------------------------------------------------------------------
    def take_batch(self, limit: int) -> Batch:
        """Up to `limit` keys whose state differs from `acked`, oldest first; adds, then deletes."""
        out_p: list[np.ndarray] = []
        out_pos: list[np.ndarray] = []
        got = 0
        while self._queue and got < limit:
            head = self._queue[0]
            take = head[: limit - got]
            rest = head[len(take) :]
            if len(rest):
                self._queue[0] = rest
            else:
                self._queue.pop(0)
            self._queued[take] = False
            self._ndirty -= len(take)
            pub = self._published(self._masks[take])
            differ = pub != self._acked[take]  # never re-send an unchanged key
            out_pos.append(take[differ])
            out_p.append(pub[differ])
            got += int(differ.sum())
        if not out_pos:
            return _EMPTY
        pos, pubs = np.concatenate(out_pos), np.concatenate(out_p)
        order = np.argsort(~pubs, kind="stable")  # each key once, so ADD/DELETE order is free
        pos = pos[order]
        return Batch(self._keys[pos], pubs[order], pos, self._t.epoch)

    def confirm(self, sent: Batch, failed: Iterable[int] = ()) -> None:
        """KVCM applied `sent` except the items at `failed` indexes, which go back in front."""
        if not len(sent):
            return
        bad = np.zeros(len(sent), np.bool_)
        failed_idx = sorted(set(failed))
        bad[failed_idx] = True
        keys, pubs = sent.keys, sent.publish
        pos = sent.pos if sent.epoch == self._t.epoch else None
        if pos is None:  # compacted while in flight: look the keys up again
            pos = self._find(keys, insert=True)
        ok = ~bad
        p_ok = pos[ok]
        self._nacked += int(pubs[ok].sum()) - int(self._acked[p_ok].sum())
        self._acked[p_ok] = pubs[ok]
        # Keys that changed again while in flight stay dirty.
        moved = p_ok[self._published(self._masks[p_ok]) != pubs[ok]]
        self._mark_dirty(moved)
        if failed_idx:
            self.requeue_front(keys[failed_idx])

    def requeue_front(self, keys: np.ndarray) -> None:
        self._mark_dirty(self._find(keys, insert=True), front=True)

    def commit_snapshot(self, sent: np.ndarray) -> None:
        """KVCM now holds exactly `sent` (distinct keys); whatever changed since is dirty."""
        n = self._n
        self._acked[:n] = False
        if len(sent):
            pos = self._find(sent, insert=True)
            self._acked[pos] = True
        n = self._n
        self._nacked = len(sent)
        self._queued[:n] = False
        self._queue, self._ndirty = [], 0
        self._mark_dirty(np.flatnonzero(self._published(self._masks[:n]) != self._acked[:n]))

    def forget_acked(self) -> None:
        """KVCM dropped everything of this reporter (HOST_DOWN, tombstone)."""
        n = self._n
        self._acked[:n] = False
        self._nacked = 0
        self._mark_dirty(np.flatnonzero(self._published(self._masks[:n])))

    def in_sync(self) -> bool:
        return self._ndirty == 0 and self.published_count == self._nacked
