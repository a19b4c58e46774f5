"""What is published, what KVCM has confirmed, and the difference between them.

Imports: stdlib + numpy + sidecar.shm_ring.layout. `current` maps each key to the cache groups
that hold it (from the ring and engine snapshots); a key is published when every required group
holds it. `acked` is what KVCM confirmed. `dirty` holds keys whose published state may differ from
`acked`, in first-seen order; sending is always "make KVCM's copy equal to current", so retries
are idempotent and per-key coalescing (last state wins) comes for free.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.layout import KIND_CLEARED


class KeyState:
    def __init__(self, required_groups: Iterable[int] = (0,)) -> None:
        self.required = sum(1 << g for g in set(required_groups)) or 1
        self.current: dict[int, int] = {}
        self.acked: set[int] = set()
        self.dirty: dict[int, None] = {}
        self.published_count = 0

    def set_required(self, required_groups: Iterable[int]) -> None:
        req = sum(1 << g for g in set(required_groups)) or 1
        if req != self.required:
            self.required = req
            self._recount()

    def is_published(self, key: int) -> bool:
        return self.current.get(key, 0) & self.required == self.required

    # ---- engine side --------------------------------------------------------------------
    def apply(self, records: np.ndarray) -> None:
        """Fold ring records ((n, 4) uint64 rows: seq, key, meta, parent) into `current`."""
        if not len(records):
            return
        kinds = (records[:, 2] & 0xFF).astype(np.uint8)
        clears = np.flatnonzero(kinds == KIND_CLEARED)
        start = 0
        for c in clears.tolist():  # a clear splits the batch: before it, then nothing survives
            self._apply_segment(records[start:c])
            self._clear()
            start = c + 1
        self._apply_segment(records[start:])

    def _apply_segment(self, records: np.ndarray) -> None:
        """Vectorised fold: last op per (key, group) wins, then one dict pass per distinct key."""
        if not len(records):
            return
        ukeys, set_m, clr_m = fold_ops(records[:, 1].view(np.int64), records[:, 2])
        cur = self.current
        ukeys_l = ukeys.tolist()
        old = np.fromiter(map(cur.get, ukeys_l, itertools.repeat(0)), np.int64, len(ukeys_l))
        new = (old & ~clr_m) | set_m
        changed = np.flatnonzero(new != old)
        if not len(changed):
            return
        req = self.required
        was = (old[changed] & req) == req
        now = (new[changed] & req) == req
        ck = ukeys[changed]
        cn = new[changed]
        keep = cn != 0
        cur.update(zip(ck[keep].tolist(), cn[keep].tolist(), strict=True))
        for k in ck[~keep].tolist():
            del cur[k]
        flips = was != now
        self.dirty.update(dict.fromkeys(ck[flips].tolist()))
        self.published_count += int(now.sum()) - int(was.sum())

    def _clear(self) -> None:
        req = self.required
        for k, m in self.current.items():
            if m & req == req:
                self.dirty[k] = None
        self.current.clear()
        self.published_count = 0

    def clear_current(self) -> None:
        """The engine's cache is empty (a new engine incarnation)."""
        self._clear()

    def replace(self, keys: np.ndarray, masks: np.ndarray) -> None:
        """Replace `current` with an engine snapshot; a key may repeat with different bits."""
        new: dict[int, int] = {}
        get = new.get
        held = masks != 0  # mask-0 entries are keys the engine no longer holds
        for k, m in zip(keys[held].tolist(), masks[held].tolist(), strict=True):
            new[k] = get(k, 0) | m
        req = self.required
        old = self.current
        for k, m in old.items():
            if (m & req == req) != (new.get(k, 0) & req == req):
                self.dirty[k] = None
        for k, m in new.items():
            if m & req == req and old.get(k, 0) & req != req:
                self.dirty[k] = None
        self.current = new
        self._recount()

    def _recount(self) -> None:
        req = self.required
        self.published_count = sum(1 for m in self.current.values() if m & req == req)

    def published_keys(self) -> list[int]:
        req = self.required
        return [k for k, m in self.current.items() if m & req == req]

    # ---- KVCM side ----------------------------------------------------------------------
    def take_batch(self, limit: int) -> list[tuple[int, bool]]:
        """Up to `limit` (key, publish?) pairs whose state differs from `acked`, in order."""
        out: list[tuple[int, bool]] = []
        dirty = self.dirty
        acked = self.acked
        get = self.current.get
        req = self.required
        while dirty and len(out) < limit:
            # One slice per batch: popping keys one by one from the front of a dict rescans
            # the deleted slots every time (quadratic on a large backlog).
            chunk = list(itertools.islice(dirty, limit - len(out)))
            for key in chunk:
                del dirty[key]
            pubs = [get(k, 0) & req == req for k in chunk]
            # never re-send an unchanged key
            out += [(k, p) for k, p in zip(chunk, pubs, strict=True) if p != (k in acked)]
        if not dirty:
            self.dirty = {}  # a fresh dict drops the deleted slots the loop left behind
        return out

    def confirm(self, sent: list[tuple[int, bool]], failed: Iterable[int] = ()) -> None:
        """KVCM applied `sent` except the items at `failed` indexes, which go back in front."""
        bad = set(failed)
        ok = [kp for i, kp in enumerate(sent) if i not in bad] if bad else sent
        adds = [k for k, pub in ok if pub]
        dels = [k for k, pub in ok if not pub]
        self.acked.update(adds)
        self.acked.difference_update(dels)
        get = self.current.get
        req = self.required
        # Keys that changed again while in flight stay dirty.
        moved = [k for k in adds if get(k, 0) & req != req]
        moved += [k for k in dels if get(k, 0) & req == req]
        if moved:
            self.dirty.update(dict.fromkeys(moved))
        if bad:
            self.requeue_front([sent[i][0] for i in sorted(bad)])

    def requeue_front(self, keys: list[int]) -> None:
        rest = self.dirty
        self.dirty = dict.fromkeys(keys)
        self.dirty.update(rest)

    def commit_snapshot(self, sent: set[int]) -> None:
        """KVCM now holds exactly `sent`; whatever changed since is dirty."""
        self.acked = sent
        req = self.required
        self.dirty = {
            k: None
            for k in (
                *(k for k, m in self.current.items() if (m & req == req) != (k in sent)),
                *(k for k in sent if self.current.get(k, 0) & req != req),
            )
        }

    def forget_acked(self) -> None:
        """KVCM dropped everything of this reporter (HOST_DOWN, tombstone)."""
        self.acked = set()
        self.dirty = dict.fromkeys(self.published_keys())

    def in_sync(self) -> bool:
        return not self.dirty and self.published_count == len(self.acked)
