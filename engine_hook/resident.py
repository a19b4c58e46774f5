"""The hook's own record of resident (key, group) pairs, for engines that cannot enumerate theirs.

Imports: numpy + sidecar.shm_ring.layout. Block metadata lives in arrays (DESIGN §5): dense
(key, mask) arrays indexed by an open-addressing hash table (linear probing), updated in bulk.
Records are queued as they are published and folded in when the queue is long or a snapshot is
asked for, so `export()` is exactly the fold of every record applied so far (the snapshot fence)
and costs two slice copies. Not thread-safe: the hook calls apply/export only under its flush lock.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.key_index import KeyIndex, fit, sized_for
from sidecar.shm_ring.layout import KIND_CLEARED

FOLD_AT = 1 << 16  # queued records before a fold: amortises numpy's fixed per-call cost


class ResidentSet:
    """key -> group mask: a dense (key, mask) array in insertion order plus a hash index.

    A removed key keeps its dense entry with mask 0 until the next compaction, so `export()` is
    two slice copies (the snapshot format treats mask-0 entries as "not held").
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._alloc(capacity)
        self._queue_k: list[np.ndarray] = []
        self._queue_m: list[np.ndarray] = []
        self._queued = 0

    def _alloc(self, capacity: int, keys: np.ndarray | None = None) -> None:
        self._idx = KeyIndex(capacity)
        if keys is not None:
            self._idx.insert_absent(keys)  # at positions 0..len-1, in order
        self._dmasks = np.zeros(len(self._idx.keys), np.uint32)

    @property
    def _cap(self) -> int:
        return self._idx.cap

    # ---- recording ------------------------------------------------------------------------
    def apply(self, keys: np.ndarray, metas: np.ndarray) -> None:
        if not len(keys):
            return
        self._queue_k.append(np.array(keys, np.int64))
        self._queue_m.append(np.array(metas, np.uint64))
        self._queued += len(keys)
        if self._queued >= FOLD_AT:
            self._fold()

    def apply_pairs(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if pairs:
            keys = [k - (1 << 64) if k >= 1 << 63 else k for k, _ in pairs]
            self.apply(np.array(keys, np.int64), np.array([m for _, m in pairs], np.uint64))

    def _fold(self) -> None:
        if not self._queued:
            return
        keys = np.concatenate(self._queue_k)
        metas = np.concatenate(self._queue_m)
        self._queue_k, self._queue_m, self._queued = [], [], 0
        kinds = metas & np.uint64(0xFF)
        start = 0
        for c in np.flatnonzero(kinds == KIND_CLEARED).tolist():
            self._fold_segment(keys[start:c], metas[start:c])
            self._alloc(1 << 16)  # everything gone
            start = c + 1
        self._fold_segment(keys[start:], metas[start:])

    def _fold_segment(self, keys: np.ndarray, metas: np.ndarray) -> None:
        if not len(keys):
            return
        ukeys, set_m, clr_m = fold_ops(keys, metas)
        pos = self._positions(ukeys)
        m = self._dmasks[pos].astype(np.int64)
        self._dmasks[pos] = ((m & ~clr_m) | set_m).astype(np.uint32)

    # ---- the index ------------------------------------------------------------------------
    def _positions(self, ukeys: np.ndarray) -> np.ndarray:
        """Dense position of each distinct key, appending the missing ones."""
        if self._idx.crowded(len(ukeys)):
            self._rebuild(len(ukeys))
        before = self._idx.n
        pos = self._idx.find(ukeys)
        self._dmasks = fit(self._dmasks, self._idx.n)
        self._dmasks[before : self._idx.n] = 0
        return pos

    def _rebuild(self, incoming: int) -> None:
        """Grow, and compact away removed keys: re-index the live entries in a fresh index."""
        n = self._idx.n
        live = self._dmasks[:n] != 0
        keys, masks = self._idx.keys[:n][live], self._dmasks[:n][live]
        self._alloc(sized_for(len(keys) + incoming, 1 << 16), keys)
        self._dmasks[: len(keys)] = masks

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident keys as of the last fold. Never folds: it is read from threads that do not
        hold the hook's flush lock (stats()), and only that lock's holder may fold."""
        return int(np.count_nonzero(self._dmasks[: self._idx.n]))

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, masks) as of every record applied; mask-0 entries are keys not held."""
        self._fold()
        n = self._idx.n
        return self._idx.keys[:n].copy(), self._dmasks[:n].copy()

    def as_dict(self) -> dict[int, int]:
        keys, masks = self.export()
        held = masks != 0
        return dict(zip(keys[held].tolist(), masks[held].tolist(), strict=True))
