"""Store counts per (key, medium, group): vLLM stores equal hashes once per physical block.

Imports: numpy, key_state. Held while the count is positive; never below 0 (after a forget,
removes of blocks stored before it arrive). The counts are `count<g>` columns of the key state's
per-medium tables (one hash lookup serves both); a batch folds in one C pass (_accel.zmq_count:
the clamped walk c <- max(0, c + d) in arrival order) or, without it, vectorised: per key, that
walk ends at P - min(-c0, min_k P_k) (P_k the prefix sums of d).
"""

from __future__ import annotations

import numpy as np

from sidecar.key_state import KeyState
from sidecar.shm_ring import compiled
from sidecar.shm_ring.key_table import KeyTable


def _col(group: int) -> str:
    return f"count{group}"


class BlockCounts:
    def __init__(self, keys: KeyState) -> None:
        self.keys = keys
        self.places: set[tuple[int, int]] = set()  # (medium, group) that ever had a count
        self._held = 0  # positive counts (kept as they flip: /status and metrics read it often)
        self._mark = np.zeros(0, np.int64)  # scratch, one entry per dense position
        self._flags = np.zeros(0, np.uint8)  # the C walk's scratch (zeroed between calls)

    def _counts(self, medium: int, group: int) -> KeyTable:
        """The table holding (medium, group)'s counts (the column added if it is new)."""
        t = self.keys.table(medium)
        if (medium, group) not in self.places:
            name = _col(group)
            if name not in t.cols:
                t.add_column(name, np.int64)
            self.places.add((medium, group))
        return t

    def _positive(self, medium: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.keys.table(medium)
        c = t.cols[_col(group)][: t.n]
        pos = np.flatnonzero(c > 0)
        return t.keys[pos], c[pos]

    def held(self) -> int:
        """(key, medium, group)s with a positive count."""
        return self._held

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
        self._held = 0
        self.keys.clear_current()

    def load(self, medium: int, group: int, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add keys' counts (a checkpoint being restored): a key listed twice adds up, counts
        <= 0 are ignored (a damaged file must not hold a key below 0 or count it held)."""
        self._counts(medium, group)
        counts = np.asarray(counts, np.int64)
        keep = counts > 0
        ukeys, inv = np.unique(np.asarray(keys, np.int64)[keep], return_inverse=True)
        add = np.zeros(len(ukeys), np.int64)
        np.add.at(add, inv, counts[keep])
        t = self.keys.table(medium)
        pos = t.find(ukeys, True)
        col = t.cols[_col(group)]
        old = col[pos]
        col[pos] = old + add
        flip = (old <= 0) & (old + add > 0)
        self._held += int(flip.sum())
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
            for p in np.flatnonzero(np.bincount(place)).tolist():
                sel = np.flatnonzero(place == p)
                self._apply_one(p >> 8, p & 0xFF, keys[sel], signs[sel])
            return
        self._apply_one(0, 0, keys, signs)

    def apply_at(self, medium: int, group: int, keys: np.ndarray, signs: np.ndarray) -> None:
        """apply(), for block events all of one (medium, group)."""
        if len(keys):
            self._apply_one(medium, group, keys, signs)

    def _scratch(self, col: np.ndarray) -> np.ndarray:
        """The C walks' zeroed flags, one per position of `col` at least."""
        if len(self._flags) < len(col):
            self._flags = np.zeros(max(len(col), 2 * len(self._flags)), np.uint8)
        return self._flags

    def _apply_one(self, medium: int, group: int, keys: np.ndarray, signs: np.ndarray) -> None:
        t = self._counts(medium, group)
        accel = compiled.accel
        if (
            accel is not None
            and keys.dtype == np.int64
            and signs.dtype == np.int64
            and keys.flags.c_contiguous
            and signs.flags.c_contiguous
        ):  # the common case (the flush's C read): find, walk and bits in one call
            col = t.cols[_col(group)]
            held = self.keys.fold_counts(medium, keys, signs, col, self._scratch(col), 1 << group)
            if held is not None:
                self._held += held
                return
        # Every event's key, repeats included: one lookup per event.
        pos = t.find(keys, True)
        col = t.cols[_col(group)]  # after find: an insert may have grown the columns
        if accel is not None:  # the walk below in one C pass, in arrival order
            out = np.empty((3, len(pos)), np.int64)  # fresh: the key state may keep them
            d = np.ascontiguousarray(signs, np.int64)  # zmq_count takes C order only
            nf, held = accel.zmq_count(pos, d, col, self._scratch(col), out, 1 << group)
            self._held += held
            if nf:
                self.keys.apply_bits_at(medium, out[0, :nf], out[1, :nf], out[2, :nf])
            return
        d = signs.astype(np.int64)
        # Keys that repeat in this batch, found without sorting them all: each event writes
        # its index at its key's position, and an event that does not read its own back
        # shares the key with a later one. Those few keys alone are sorted (stable: arrival
        # order kept within a key); the rest take one step each.
        if len(self._mark) < t.n:
            self._mark = np.zeros(max(t.n, 2 * len(self._mark)), np.int64)
        mark = self._mark
        ev = np.arange(len(pos))
        mark[pos] = ev
        shared = mark[pos] != ev
        if not shared.any():
            upos, total, low = pos, d, d
        else:
            mark[pos[shared]] = -1
            rep = mark[pos] == -1  # every event of a key that repeats
            sub = np.flatnonzero(rep)
            sub = sub[np.argsort(pos[sub], kind="stable")]
            k, dd = pos[sub], d[sub]
            first = np.ones(len(k), np.bool_)
            first[1:] = k[1:] != k[:-1]
            idx = np.flatnonzero(first)
            csum = np.cumsum(dd)
            before = np.zeros(len(idx), np.int64)  # the running sum before each key's run
            before[1:] = csum[idx[1:] - 1]
            prefix = csum - np.repeat(before, np.diff(np.append(idx, len(k))))
            one = ~rep
            upos = np.concatenate([pos[one], k[idx]])
            total = np.concatenate([d[one], prefix[np.append(idx[1:], len(k)) - 1]])
            low = np.concatenate([d[one], np.minimum.reduceat(prefix, idx)])
        c0 = col[upos]
        c1 = total - np.minimum(-c0, low)
        col[upos] = c1
        was, now = c0 > 0, c1 > 0
        flip = was != now
        if not flip.any():
            return
        fnow = now[flip]
        self._held += 2 * int(fnow.sum()) - len(fnow)
        bit = np.int64(1 << group)
        set_m = np.where(fnow, bit, np.int64(0))
        clr_m = np.where(fnow, np.int64(0), bit)
        self.keys.apply_bits_at(medium, upos[flip], set_m, clr_m)
