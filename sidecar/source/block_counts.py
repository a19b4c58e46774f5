"""Store counts per (key, medium, group): vLLM stores equal hashes once per physical block.

Imports: numpy, key_state. Held while the count is positive; never below 0 (after a forget,
removes of blocks stored before it arrive). The counts are `count<g>` columns of the key state's
per-medium tables (one hash lookup serves both); a batch folds vectorised: per key, the clamped
walk c <- max(0, c + d) ends at P - min(-c0, min_k P_k) (P_k the prefix sums of d).
"""

from __future__ import annotations

import numpy as np

from sidecar.key_state import KeyState


def _col(group: int) -> str:
    return f"count{group}"


class BlockCounts:
    def __init__(self, keys: KeyState) -> None:
        self.keys = keys
        self.places: set[tuple[int, int]] = set()  # (medium, group) that ever had a count

    def _counts(self, medium: int, group: int) -> np.ndarray:
        t = self.keys.table(medium)
        name = _col(group)
        if name not in t.cols:
            t.add_column(name, np.int64)
        self.places.add((medium, group))
        return t.cols[name]

    def _positive(self, medium: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.keys.table(medium)
        c = t.cols[_col(group)][: t.n]
        pos = np.flatnonzero(c > 0)
        return t.keys[pos], c[pos]

    def held(self) -> int:
        """(key, medium, group)s with a positive count."""
        return sum(len(self._positive(m, g)[0]) for m, g in self.places)

    def counts(self) -> dict[tuple[int, int, int], int]:
        """(key, medium, group) -> count of every positive count (tests, checkpoints)."""
        out: dict[tuple[int, int, int], int] = {}
        for m, g in sorted(self.places):
            keys, c = self._positive(m, g)
            for k, n in zip(keys.tolist(), c.tolist(), strict=True):
                out[(k, m, g)] = n
        return out

    def arrays(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """(medium, group, keys, counts) of the positive counts, per (medium, group)."""
        return [(m, g, *self._positive(m, g)) for m, g in sorted(self.places)]

    def clear(self) -> None:
        """Every count to 0 (AllBlocksCleared, a forget); the key state empties too."""
        for m, g in self.places:
            t = self.keys.table(m)
            t.cols[_col(g)][: t.n] = 0
        self.keys.clear_current()

    def load(self, medium: int, group: int, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add distinct keys with positive counts (a checkpoint being restored)."""
        self._counts(medium, group)
        t = self.keys.table(medium)
        pos = t.find(keys, True)
        col = t.cols[_col(group)]
        old = col[pos]
        col[pos] = old + counts
        flip = (old <= 0) & (old + counts > 0)
        bits = np.full(int(flip.sum()), 1 << group, np.int64)
        self.keys.apply_bits_at(medium, pos[flip], bits, np.zeros_like(bits))

    def apply(
        self, keys: np.ndarray, mediums: np.ndarray, groups: np.ndarray, signs: np.ndarray
    ) -> None:
        """Fold block events (one per hash, in arrival order, no clears among them)."""
        if not len(keys):
            return
        if mediums.any() or groups.any():
            place = mediums.astype(np.int64) << 8 | groups.astype(np.int64)
            for p in np.unique(place).tolist():
                sel = place == p
                self._apply_one(p >> 8, p & 0xFF, keys[sel], signs[sel])
            return
        self._apply_one(0, 0, keys, signs)

    def _apply_one(self, medium: int, group: int, keys: np.ndarray, signs: np.ndarray) -> None:
        # By key, arrival order kept within a key. An unstable sort costs ~40 % of a stable
        # one here; only the runs of keys that repeat in this batch (few) are then put back in
        # arrival order among themselves (they already sit where their key belongs).
        order = np.argsort(keys)
        k = keys[order]
        repeat = k[1:] == k[:-1]
        if repeat.any():
            in_run = np.zeros(len(k), np.bool_)
            in_run[1:] = repeat
            in_run[:-1] |= repeat
            at = np.flatnonzero(in_run)
            o = order[at]
            order[at] = o[np.lexsort((o, keys[o]))]
            k = keys[order]
        d = signs[order].astype(np.int64)
        first = np.ones(len(k), np.bool_)
        first[1:] = k[1:] != k[:-1]
        idx = np.flatnonzero(first)
        ukeys = k[idx]
        if len(idx) == len(k):  # no key repeats in this batch: one step each
            total = low = d
        else:
            csum = np.cumsum(d)
            before = np.zeros(len(idx), np.int64)  # the running sum before each key's run
            before[1:] = csum[idx[1:] - 1]
            prefix = csum - np.repeat(before, np.diff(np.append(idx, len(k))))
            total = prefix[np.append(idx[1:], len(k)) - 1]
            low = np.minimum.reduceat(prefix, idx)
        self._counts(medium, group)
        t = self.keys.table(medium)
        pos = t.find(ukeys, True)
        col = t.cols[_col(group)]  # after find: an insert may have grown the columns
        c0 = col[pos]
        c1 = total - np.minimum(-c0, low)
        col[pos] = c1
        was, now = c0 > 0, c1 > 0
        flip = was != now
        if not flip.any():
            return
        bit = np.int64(1 << group)
        fnow = now[flip]
        set_m = np.where(fnow, bit, np.int64(0))
        clr_m = np.where(fnow, np.int64(0), bit)
        self.keys.apply_bits_at(medium, pos[flip], set_m, clr_m)
