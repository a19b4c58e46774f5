"""What is published, what KVCM has confirmed, and the difference between them, per medium.

Imports: numpy + sidecar.shm_ring. Per (key, medium): the groups that hold it (published when
every required group does), `acked` (KVCM confirmed it), `queued` (in the dirty queue). Sending
makes KVCM's copy equal to the engine's, so retries are idempotent and coalescing is free. Each
medium has dense numpy columns behind a hash index (shm_ring/key_table.py); batches throughout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from sidecar.shm_ring import compiled
from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.key_table import REBUILD_AT, KeyTable, Mover
from sidecar.shm_ring.layout import KIND_CLEARED

_MIN_CAP = 1 << 16  # ~2 MB to start with; smaller made the first 100 k keys re-index 5 times
_MEDIUM_SHIFT = np.uint64(16)  # ring meta: the medium index is the u8 at bits 16..23


class _Dirty:
    """len() and truthiness of the dirty count, read when asked (what callers ask of `dirty`:
    an attribute, not a property making an object, since the drain loop asks at every read)."""

    __slots__ = ("ks",)

    def __init__(self, ks: KeyState) -> None:
        self.ks = ks

    def __len__(self) -> int:
        return self.ks._ndirty

    def __bool__(self) -> bool:
        return self.ks._ndirty > 0


class _Acked(_Dirty):
    """The same for the acked count."""

    __slots__ = ()

    def __len__(self) -> int:
        return self.ks._nacked

    def __bool__(self) -> bool:
        return self.ks._nacked > 0


class Batch:
    """Keys taken for one delta request: adds first, then deletes (the item_results order);
    within each, keys of one medium are contiguous (one run of fixed-width rows per medium)."""

    __slots__ = ("_mediums", "_publish", "epochs", "keys", "medium", "nadd", "pos")

    def __init__(
        self,
        keys: np.ndarray,
        publish: np.ndarray | None,
        mediums: np.ndarray | None = None,
        pos: np.ndarray | None = None,
        epochs: dict[int, int] | None = None,
        *,
        nadd: int = -1,
        medium: int = -1,
    ) -> None:
        self.keys = keys  # int64 bit patterns
        self._publish = publish  # bool: ADD (True) or DELETE (False); None: from nadd
        self._mediums = mediums  # None: all `medium` (0 if -1)
        self.pos = pos  # dense positions in each medium's key table (saves a lookup)
        self.epochs = epochs or {}  # medium -> table epoch the positions belong to
        self.medium = medium  # >= 0: every key is of this medium (take_batch's one-medium batch)
        self.nadd = nadd  # >= 0: the first nadd keys are the adds, the rest the deletes

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def publish(self) -> np.ndarray:
        if self._publish is None:
            self._publish = np.arange(len(self.keys)) < self.nadd
        return self._publish

    @property
    def mediums(self) -> np.ndarray:
        if self._mediums is None:
            self._mediums = np.full(len(self.keys), max(self.medium, 0), np.uint8)
        return self._mediums

    @property
    def adds(self) -> np.ndarray:
        out: np.ndarray = self.keys[: self.nadd] if self.nadd >= 0 else self.keys[self.publish]
        return out

    @property
    def deletes(self) -> np.ndarray:
        out: np.ndarray = self.keys[self.nadd :] if self.nadd >= 0 else self.keys[~self.publish]
        return out

    @property
    def add_mediums(self) -> np.ndarray:
        if self.nadd >= 0 and self._mediums is None:
            return np.full(self.nadd, max(self.medium, 0), np.uint8)
        out: np.ndarray = self.mediums[self.publish]
        return out

    @property
    def delete_mediums(self) -> np.ndarray:
        if self.nadd >= 0 and self._mediums is None:
            return np.full(len(self.keys) - self.nadd, max(self.medium, 0), np.uint8)
        out: np.ndarray = self.mediums[~self.publish]
        return out

    def pairs(self) -> list[tuple[int, bool]]:
        """(key, publish?) per item, for tests and diagnostics."""
        return list(zip(self.keys.tolist(), self.publish.tolist(), strict=True))

    def triples(self) -> list[tuple[int, int, bool]]:
        """(key, medium, publish?) per item, for tests and diagnostics."""
        return list(
            zip(self.keys.tolist(), self.mediums.tolist(), self.publish.tolist(), strict=True)
        )


_EMPTY = Batch(np.zeros(0, np.int64), np.zeros(0, np.bool_))


class _Tier:
    """The key state of one medium: group masks, acked, queued, and its dirty queue."""

    def __init__(self, owner: KeyState, medium: int) -> None:
        self.owner = owner
        self.medium = medium
        self.published_count = 0
        self.t = KeyTable(
            {"masks": np.int64, "acked": np.bool_, "queued": np.bool_},
            live=("masks", "acked", "queued"),  # held, confirmed, or waiting to be sent
            min_capacity=_MIN_CAP,
        )
        self.t.on_move = self._move_queue
        self.queue: list[np.ndarray] = []  # dense positions, in the order they became dirty
        self._ring_out: np.ndarray | None = None  # fold_ring's output, kept between calls
        self._res = np.zeros(4, np.int64)  # the C folds' answers, written in place (_accel.c)
        self.ndirty = 0
        self.nacked = 0

    @property
    def masks(self) -> np.ndarray:
        return self.t.cols["masks"]

    @property
    def acked(self) -> np.ndarray:
        return self.t.cols["acked"]

    @property
    def queued(self) -> np.ndarray:
        return self.t.cols["queued"]

    @property
    def n(self) -> int:
        return self.t.n

    @property
    def keys(self) -> np.ndarray:
        return self.t.keys

    def find(self, ukeys: np.ndarray, insert: bool) -> np.ndarray:
        return self.t.find(ukeys, insert)

    def _move_queue(self, moved: Mover) -> None:
        self.queue = [moved(q) for q in self.queue if len(q)]  # queued keys are live

    def published(self, masks: np.ndarray) -> np.ndarray:
        req = self.owner.required
        out: np.ndarray = (masks & req) == req
        return out

    def mark_dirty(self, pos: np.ndarray, front: bool = False) -> None:
        """Queue the positions not queued yet: last in line, or first (`front`, for retries).
        The positions are distinct (a repeat would be queued twice: every caller's are)."""
        pos = pos[~self.queued[pos]]
        if len(pos):
            self.queued[pos] = True
            self._enqueue(pos, front)

    def _enqueue(self, pos: np.ndarray, front: bool = False) -> None:
        """Queue positions already marked queued (by mark_dirty, or by the C loops)."""
        o = self.owner
        if not o._ndirty:
            o.dirty_since = o.clock()
        if front:
            self.queue.insert(0, pos)
        else:
            self.queue.append(pos)
        self.ndirty += len(pos)
        o._ndirty += len(pos)

    def _folded(self, delta: int, out: np.ndarray, k: int, keep: bool = True) -> None:
        """A C fold's result: the published count moves by `delta`, and out[:k] (positions
        the C has marked queued) join the dirty queue; `keep` False: `out` is used again, so
        the queue gets a copy."""
        self.published_count += delta
        self.owner.published_count += delta
        if k:
            self._enqueue(out[:k] if keep else out[:k].copy())

    def fold_records(self, records: np.ndarray) -> bool:
        """apply_records of (n, 4) ring records, all stored/removed of medium 0, in one C call
        (_accel.fold_records: find, fold, mark_dirty). False, with nothing folded: a clear,
        another medium, a re-index due, extra columns, or no such build; the caller's path."""
        c = compiled.accel
        fold = getattr(c, "fold_records", None) if c is not None else None  # None: stale build
        t = self.t
        idx = t.idx
        if (
            fold is None
            or t.rebuild is not None
            or len(t.cols) != 3  # another owner's columns (the ZMQ source's) need zeroing too
            or idx.n + len(records) > idx.cap * REBUILD_AT  # find() would pace a re-index
        ):
            return False
        out = np.empty(len(records), np.int64)
        cols = t.cols
        got = fold(
            records,
            idx._tkeys,
            idx._tpos,
            idx.keys,
            idx.n,
            cols["masks"],
            cols["acked"],
            cols["queued"],
            self.owner.required,
            out,
        )
        if got is None:
            return False
        idx.n, k, delta = got  # the keys are in even when it declined the fold (k < 0)
        if k < 0:
            return False
        self._folded(delta, out, k)
        return True

    def fold_ring(
        self, hdr: memoryview, slots: np.ndarray, head: int, base: int, gen: int, dropped: int
    ) -> int:
        """A steady-state ring read folded in, in one C call (_accel.ring_fold: the reader's
        checks, ring_copy and fold_records): records folded (the caller advances W_HEAD), or
        -1 with nothing read (a check failed, a clear, another medium, no such build: the
        caller's path reads them; keys already inserted stay, as fold_records leaves them)."""
        c = compiled.accel
        fold = getattr(c, "ring_fold", None) if c is not None else None  # None: stale build
        t = self.t
        idx = t.idx
        if fold is None or t.rebuild is not None or len(t.cols) != 3:
            return -1  # as fold_records: a paced re-index, or another owner's columns
        out = self._ring_out
        if out is None or len(out) < len(slots):
            out = self._ring_out = np.empty(len(slots), np.int64)  # once: the ring's capacity
        cols = t.cols
        got = fold(
            hdr,
            slots,
            head,
            base,
            gen,
            dropped,
            int(idx.cap * REBUILD_AT) - idx.n,  # find() would pace a re-index past it
            idx._tkeys,
            idx._tpos,
            idx.keys,
            idx.n,
            cols["masks"],
            cols["acked"],
            cols["queued"],
            self.owner.required,
            out,
            self._res,
        )
        if got is None:
            return -1
        m, idx.n, k, delta = self._res.tolist()  # the keys are in even if it declined (k < 0)
        if k < 0:
            return -1
        self._folded(delta, out, k, keep=False)  # `out` serves every read
        return int(m)

    def fold_counts(
        self, keys: np.ndarray, signs: np.ndarray, col: np.ndarray, flags: np.ndarray, bit: int
    ) -> int | None:
        """The ZMQ source's fold of one (medium, group)'s block events in one C call
        (_accel.count_fold: find, the store counts' clamped walk in `col`, then bits_apply of
        the counts that went from 0 to positive or back, setting or clearing `bit`): the held
        delta, or None with nothing changed (a re-index due, columns to grow, no such build:
        block_counts.py's path)."""
        c = compiled.accel
        fold = getattr(c, "count_fold", None) if c is not None else None  # None: stale build
        t = self.t
        idx = t.idx
        if fold is None or t.rebuild is not None or idx.n + len(keys) > t.room:
            return None
        out = np.empty(len(keys), np.int64)  # fresh: the queue keeps it
        cols = t.cols
        got = fold(
            keys,
            signs,
            idx._tkeys,
            idx._tpos,
            idx.keys,
            idx.n,
            int(idx.cap * REBUILD_AT) - idx.n,  # find() would pace a re-index past it
            col,
            flags,
            cols["masks"],
            cols["acked"],
            cols["queued"],
            self.owner.required,
            bit,
            out,
            self._res,
        )
        if got is None:
            return None
        idx.n, k, held, delta = self._res.tolist()
        self._folded(delta, out, k, keep=2 * k >= len(out))  # a view would keep all of out
        return int(held)

    def recount(self) -> None:
        new = int(self.published(self.masks[: self.n]).sum())
        self.owner.published_count += new - self.published_count
        self.published_count = new

    def apply_records(self, keys: np.ndarray, metas: np.ndarray) -> None:
        """Stored/removed records of this medium, in order (the last op per (key, group) wins):
        one pass in C (_accel.fold_apply), else the numpy fold."""
        c = compiled.accel
        fold = getattr(c, "fold_apply", None) if c is not None else None  # None: a stale build
        keys = np.ascontiguousarray(keys.view(np.int64))
        if fold is not None:
            pos = self.find(keys, insert=True)  # first: it may swap the columns for new ones
            metas = np.ascontiguousarray(metas, np.uint64)
            out = np.empty(len(pos), np.int64)
            got = fold(pos, metas, self.masks, self.owner.required, out)
            if got is not None:
                n, delta = got
                self.published_count += delta
                self.owner.published_count += delta
                self.mark_dirty(out[:n])
                return
        self.apply_bits(*fold_ops(keys, metas))

    def apply_bits(self, ukeys: np.ndarray, set_m: np.ndarray, clr_m: np.ndarray) -> None:
        """Distinct keys: clear then set these group bits."""
        self.apply_bits_at(self.find(ukeys, insert=True), set_m, clr_m)

    def apply_bits_at(self, pos: np.ndarray, set_m: np.ndarray, clr_m: np.ndarray) -> None:
        """Clear then set group bits at positions (repeats: each entry sees the masks before the
        call, the last write wins): in one C pass (_accel.bits_apply), else numpy."""
        c = compiled.accel
        bits = getattr(c, "bits_apply", None) if c is not None else None  # None: a stale build
        if bits is not None:
            cols, o = self.t.cols, self.owner
            out = np.empty(len(pos), np.int64)  # fresh: the queue keeps it
            got = bits(pos, set_m, clr_m, cols["masks"], cols["queued"], o.required, out)
            if got is not None:  # None: not int64 / contiguous / in the table: numpy's turn
                k, delta = got
                self._folded(delta, out, k)  # C has set queued at out[:k]
                return
        old = self.masks[pos]
        new = (old & ~clr_m) | set_m
        self.masks[pos] = new
        was, now = self.published(old), self.published(new)
        delta = int(now.sum()) - int(was.sum())
        self.published_count += delta
        self.owner.published_count += delta
        self.mark_dirty(pos[was != now])

    def clear(self) -> None:
        n = self.n
        self.mark_dirty(np.flatnonzero(self.published(self.masks[:n])))
        self.masks[:n] = 0
        self.owner.published_count -= self.published_count
        self.published_count = 0

    def replace(self, ukeys: np.ndarray, umasks: np.ndarray) -> None:
        pos = self.find(ukeys, insert=True)
        n = self.n
        new = np.zeros(n, np.int64)
        new[pos] = umasks
        was, now = self.published(self.masks[:n]), self.published(new)
        self.masks[:n] = new
        count = int(now.sum())
        self.owner.published_count += count - self.published_count
        self.published_count = count
        self.mark_dirty(np.flatnonzero(was != now))

    def _c_take(
        self, limit: int, pos: np.ndarray, keys: np.ndarray, pub: np.ndarray | None
    ) -> tuple[int, int]:
        """take() in one C call (_accel.take_queue) into the given outputs: (taken, adds);
        `pub` None: adds first, then deletes."""
        c = compiled.accel
        assert c is not None
        cols, q = self.t.cols, self.queue
        got, adds, done, offset, consumed = c.take_queue(
            q,
            cols["masks"],
            cols["acked"],
            cols["queued"],
            self.t.idx.keys,
            self.owner.required,
            limit,
            pos,
            keys,
            pub,
            pub is None,
        )
        del q[:done]
        if offset:
            q[0] = q[0][offset:]
        self.ndirty -= consumed
        self.owner._ndirty -= consumed
        return got, adds

    def take_batch(self, limit: int) -> Batch | None:
        """take() as a Batch of this medium alone (adds first), in one C call; None: no build."""
        c = compiled.accel
        if c is None or getattr(c, "take_queue", None) is None:
            return None
        n = min(limit, self.ndirty)  # each taken key was queued: ndirty bounds them
        buf = np.empty(2 * n, np.int64)
        pos, keys = buf[:n], buf[n:]
        got, adds = self._c_take(n, pos, keys, None)
        if not got:
            return _EMPTY
        if got < n:
            pos, keys = pos[:got], keys[:got]
        m = self.medium
        return Batch(keys, None, None, pos, {m: self.t.epoch}, nadd=adds, medium=m)

    def take(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to `limit` (positions, publish?) whose state differs from `acked`, oldest first."""
        c = compiled.accel
        if c is not None and getattr(c, "take_queue", None) is not None:
            n = min(limit, self.ndirty)
            pos, keys, pub = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.bool_)
            got, _ = self._c_take(n, pos, keys, pub)
            return pos[:got], pub[:got]
        out_p: list[np.ndarray] = []
        out_pos: list[np.ndarray] = []
        got = 0
        while self.queue and got < limit:
            head = self.queue[0]
            take = head[: limit - got]
            rest = head[len(take) :]
            if len(rest):
                self.queue[0] = rest
            else:
                self.queue.pop(0)
            self.queued[take] = False
            self.ndirty -= len(take)
            self.owner._ndirty -= len(take)
            pub = self.published(self.masks[take])
            differ = pub != self.acked[take]  # never re-send an unchanged key
            out_pos.append(take[differ])
            out_p.append(pub[differ])
            got += int(differ.sum())
        if not out_pos:
            return np.zeros(0, np.int64), np.zeros(0, np.bool_)
        return np.concatenate(out_pos), np.concatenate(out_p)

    def confirm(
        self, keys: np.ndarray, pubs: np.ndarray, pos: np.ndarray | None, bad: np.ndarray
    ) -> None:
        if pos is None:  # compacted while in flight: look the keys up again
            pos = self.t.locate(keys)
        ok = ~bad
        p_ok = pos[ok]
        delta = int(pubs[ok].sum()) - int(self.acked[p_ok].sum())
        self.nacked += delta
        self.owner._nacked += delta
        self.acked[p_ok] = pubs[ok]
        # Keys that changed again while in flight stay dirty.
        self.mark_dirty(p_ok[self.published(self.masks[p_ok]) != pubs[ok]])
        if bad.any():
            self.mark_dirty(self.find(keys[bad], insert=True), front=True)

    def confirm_run(self, pos: np.ndarray, nadd: int) -> bool:
        """confirm_all() of a batch whose first `nadd` were adds, in one C call
        (_accel.confirm_run); False: no such build."""
        c = compiled.accel
        run = getattr(c, "confirm_run", None) if c is not None else None
        if run is None:
            return False
        out = np.empty(len(pos), np.int64)
        cols = self.t.cols
        k, delta = run(
            pos, nadd, cols["masks"], cols["acked"], cols["queued"], self.owner.required, out
        )
        self.nacked += delta
        self.owner._nacked += delta
        if k:
            self._enqueue(out[:k])
        return True

    def confirm_all(self, pubs: np.ndarray, pos: np.ndarray) -> None:
        """confirm() of a batch that KVCM applied whole, at positions still valid."""
        delta = int(np.count_nonzero(pubs)) - int(np.count_nonzero(self.acked[pos]))
        self.nacked += delta
        self.owner._nacked += delta
        self.acked[pos] = pubs
        self.mark_dirty(pos[self.published(self.masks[pos]) != pubs])

    def commit_snapshot(self, sent: np.ndarray) -> None:
        # Positions first, columns after: an insert may grow or re-index the table and swap
        # every column for a new array, so a column read before find() would take the writes
        # into the discarded copy (issue #24: nothing acked, removed keys never deleted).
        pos = self.t.locate(sent)
        n = self.n
        self.acked[:n] = False
        self.acked[pos] = True
        self.owner._nacked += len(sent) - self.nacked
        self.nacked = len(sent)
        self.queued[:n] = False
        self.owner._ndirty -= self.ndirty
        self.queue, self.ndirty = [], 0

    def forget_acked(self) -> None:
        n = self.n
        self.acked[:n] = False
        self.owner._nacked -= self.nacked
        self.nacked = 0
        self.mark_dirty(np.flatnonzero(self.published(self.masks[:n])))

    def mark_differing(self) -> None:
        n = self.n
        self.mark_dirty(np.flatnonzero(self.published(self.masks[:n]) != self.acked[:n]))


class KeyState:
    def __init__(
        self, required_groups: Iterable[int] = (0,), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.dirty_since = 0.0  # when the dirty queue last went from empty to non-empty
        self.window_s = 0.0  # the stretched flush window (source/base.py FlushPolicy), 0: none
        self.required = sum(1 << g for g in set(required_groups)) or 1
        self.published_count = 0
        self._ndirty = 0
        self._nacked = 0
        self._tiers: list[_Tier] = [_Tier(self, 0)]  # index = medium index
        self._next = 0  # the medium take_batch starts with (round robin between mediums)
        self.dirty = _Dirty(self)  # len(): (key, medium)s queued to send; truthy while any
        self.acked = _Acked(self)  # len(): (key, medium)s KVCM has confirmed

    def _tier(self, medium: int) -> _Tier:
        while len(self._tiers) <= medium:
            self._tiers.append(_Tier(self, len(self._tiers)))
        return self._tiers[medium]

    # ---- views --------------------------------------------------------------------------------

    @property
    def mediums(self) -> int:
        """Medium indexes in use so far (1 + the highest seen)."""
        return len(self._tiers)

    def set_required(self, required_groups: Iterable[int]) -> None:
        req = sum(1 << g for g in set(required_groups)) or 1
        if req != self.required:
            self.required = req
            for t in self._tiers:
                t.recount()
                # held keys whose verdict flipped: KVCM has them by the old one (or lacks them)
                t.mark_differing()

    def is_published(self, key: int, medium: int = 0) -> bool:
        if medium >= len(self._tiers):
            return False
        t = self._tiers[medium]
        pos = t.find(np.array([key], np.int64), insert=False)[0]
        return bool(pos >= 0 and t.published(t.masks[pos : pos + 1])[0])

    def as_dict(self, medium: int = 0) -> dict[int, int]:
        """key -> group mask of every key held in `medium` (for tests and diagnostics)."""
        if medium >= len(self._tiers):
            return {}
        t = self._tiers[medium]
        n = t.n
        held = t.masks[:n] != 0
        return dict(zip(t.keys[:n][held].tolist(), t.masks[:n][held].tolist(), strict=True))

    def acked_keys(self, medium: int = 0) -> set[int]:
        if medium >= len(self._tiers):
            return set()
        t = self._tiers[medium]
        n = t.n
        return set(t.keys[:n][t.acked[:n]].tolist())

    def published_keys(self, medium: int = 0) -> np.ndarray:
        if medium >= len(self._tiers):
            return np.zeros(0, np.int64)
        t = self._tiers[medium]
        n = t.n
        keys: np.ndarray = t.keys[:n][t.published(t.masks[:n])]
        return keys

    def published(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, medium indexes) of every published (key, medium)."""
        keys = [self.published_keys(m) for m in range(len(self._tiers))]
        meds = [np.full(len(k), m, np.uint8) for m, k in enumerate(keys)]
        return np.concatenate(keys), np.concatenate(meds)

    # ---- engine side --------------------------------------------------------------------
    def apply(self, records: np.ndarray) -> None:
        """Fold ring records ((n, 4) uint64 rows: seq, key, meta, parent); the medium index is
        meta bits 16..23 (the source has dropped indexes outside its medium table)."""
        if not len(records):
            return
        if self._tiers[0].fold_records(records):  # the common case, in one C call
            return
        kinds = (records[:, 2] & 0xFF).astype(np.uint8)
        start = 0
        for c in np.flatnonzero(kinds == KIND_CLEARED).tolist():  # a clear splits the batch
            self._apply_segment(records[start:c])
            self.clear_current()
            start = c + 1
        self._apply_segment(records[start:])

    def fold_ring(
        self, hdr: memoryview, slots: np.ndarray, head: int, base: int, gen: int, dropped: int
    ) -> int:
        """_Tier.fold_ring of medium 0: records read from the ring and folded, or -1."""
        return self._tiers[0].fold_ring(hdr, slots, head, base, gen, dropped)

    def _apply_segment(self, records: np.ndarray) -> None:
        if not len(records):
            return
        metas = records[:, 2]
        meds = ((metas >> _MEDIUM_SHIFT) & np.uint64(0xFF)).astype(np.uint8)
        if meds.any():
            for m in np.unique(meds).tolist():
                sel = records[meds == m]
                self._tier(m).apply_records(sel[:, 1], sel[:, 2])
            return
        self._tiers[0].apply_records(records[:, 1], metas)

    def apply_bits(
        self, medium: int, ukeys: np.ndarray, set_m: np.ndarray, clr_m: np.ndarray
    ) -> None:
        """Distinct int64 keys of one medium: clear `clr_m`, then set `set_m` group bits."""
        if len(ukeys):
            self._tier(medium).apply_bits(ukeys, set_m, clr_m)

    def table(self, medium: int) -> KeyTable:
        """The key table of one medium (the ZMQ source keeps its store counts in it as extra
        columns, so one lookup serves both)."""
        return self._tier(medium).t

    def apply_bits_at(
        self, medium: int, pos: np.ndarray, set_m: np.ndarray, clr_m: np.ndarray
    ) -> None:
        """As apply_bits, for distinct positions already found in `table(medium)`."""
        if len(pos):
            tiers = self._tiers
            t = tiers[medium] if medium < len(tiers) else self._tier(medium)
            t.apply_bits_at(pos, set_m, clr_m)

    def fold_counts(
        self,
        medium: int,
        keys: np.ndarray,
        signs: np.ndarray,
        col: np.ndarray,
        flags: np.ndarray,
        bit: int,
    ) -> int | None:
        """_Tier.fold_counts of `medium` (int64 keys and signs, C order): the held delta, or
        None with nothing changed."""
        tiers = self._tiers
        t = tiers[medium] if medium < len(tiers) else self._tier(medium)
        return t.fold_counts(keys, signs, col, flags, bit)

    def clear_current(self) -> None:
        """The engine's cache is empty (a clear, a new engine incarnation, a forget)."""
        for t in self._tiers:
            t.clear()

    def replace(
        self, keys: np.ndarray, masks: np.ndarray, mediums: np.ndarray | None = None
    ) -> None:
        """Replace the engine state with a snapshot; a (key, medium) may repeat (bits OR);
        mask 0 = not held; `mediums` None = all medium 0."""
        held = masks != 0
        keys, masks = keys[held], masks[held].astype(np.int64)
        meds = np.zeros(len(keys), np.uint8) if mediums is None else mediums[held]
        present = set(np.unique(meds).tolist())
        for m in sorted(present | set(range(len(self._tiers)))):
            sel = meds == m
            k, mk = keys[sel], masks[sel]
            order = np.argsort(k, kind="stable")
            k, mk = k[order], mk[order]
            first = np.ones(len(k), np.bool_)
            first[1:] = k[1:] != k[:-1]
            idx = np.flatnonzero(first)
            umasks = np.bitwise_or.reduceat(mk, idx) if len(idx) else mk[:0]
            self._tier(m).replace(k[idx], umasks)

    # ---- KVCM side ----------------------------------------------------------------------
    def take_batch(self, limit: int) -> Batch:
        """Up to `limit` (key, medium)s whose state differs from `acked`, oldest first per
        medium (mediums take turns leading); adds, then deletes, each grouped by medium."""
        tiers = self._tiers
        dirty: _Tier | None = None
        for t in tiers:
            if t.ndirty:
                if dirty is not None:  # several mediums to take from: the loop below
                    dirty = None
                    break
                dirty = t
        else:
            if dirty is None:  # nothing to send
                self._next = (self._next + 1) % len(tiers)
                return _EMPTY
            one = dirty.take_batch(limit) if limit > 0 else None
            if one is not None:
                self._next = (self._next + 1) % len(tiers)
                return one
        parts: list[tuple[int, np.ndarray, np.ndarray]] = []
        got = 0
        for i in range(len(tiers)):
            t = tiers[(self._next + i) % len(tiers)]
            if got >= limit:
                break
            if t.ndirty:
                pos, pub = t.take(limit - got)
                if len(pos):
                    parts.append((t.medium, pos, pub))
                    got += len(pos)
        self._next = (self._next + 1) % len(tiers)
        if not parts:
            return _EMPTY
        if len(parts) == 1:
            m, pos, pubs = parts[0]
            order = np.argsort(~pubs, kind="stable")  # each key once: ADD/DELETE order is free
            pos = pos[order]
            t = tiers[m]
            nadd = int(np.count_nonzero(pubs))
            return Batch(t.keys[pos], pubs[order], None, pos, {m: t.t.epoch}, nadd=nadd, medium=m)
        keys = np.concatenate([tiers[m].keys[p] for m, p, _ in parts])
        pos = np.concatenate([p for _m, p, _ in parts])
        pubs = np.concatenate([b for _m, _p, b in parts])
        meds = np.concatenate([np.full(len(p), m, np.uint8) for m, p, _ in parts])
        order = np.lexsort((meds, ~pubs))
        epochs = {m: tiers[m].t.epoch for m, _p, _b in parts}
        nadd = int(np.count_nonzero(pubs))
        return Batch(keys[order], pubs[order], meds[order], pos[order], epochs, nadd=nadd)

    def confirm(self, sent: Batch, failed: Iterable[int] = ()) -> None:
        """KVCM applied `sent` except the items at `failed` indexes, which go back in front."""
        if not len(sent):
            return
        if sent.medium >= 0 and not failed and sent.pos is not None:
            t = self._tier(sent.medium)
            if sent.epochs.get(sent.medium) == t.t.epoch:  # the common case, in fewer calls
                if sent.nadd < 0 or not t.confirm_run(sent.pos, sent.nadd):
                    t.confirm_all(sent.publish, sent.pos)
                return
        bad = np.zeros(len(sent), np.bool_)
        bad[sorted(set(failed))] = True
        meds = sent.mediums
        for m in np.unique(meds).tolist():
            t = self._tier(m)
            sel = meds == m
            fresh = sent.pos is not None and sent.epochs.get(m) == t.t.epoch
            pos = sent.pos[sel] if fresh and sent.pos is not None else None
            t.confirm(sent.keys[sel], sent.publish[sel], pos, bad[sel])

    def requeue_front(self, keys: np.ndarray, medium: int = 0) -> None:
        t = self._tier(medium)
        keys = np.asarray(keys, np.int64)
        if len(keys) > 1:  # each key once, first seen first: mark_dirty takes distinct positions
            _, first = np.unique(keys, return_index=True)
            keys = keys[np.sort(first)]
        t.mark_dirty(t.find(keys, insert=True), front=True)

    def commit_snapshot(self, sent: np.ndarray, mediums: np.ndarray | None = None) -> None:
        """KVCM now holds exactly `sent` (distinct (key, medium)s); whatever changed since is
        dirty."""
        meds = np.zeros(len(sent), np.uint8) if mediums is None else mediums
        for t in list(self._tiers):
            t.commit_snapshot(sent[meds == t.medium])
        for m in set(np.unique(meds).tolist()) - set(range(len(self._tiers))):
            self._tier(m).commit_snapshot(sent[meds == m])
        for t in self._tiers:
            t.mark_differing()

    def forget_acked(self) -> None:
        """KVCM dropped everything of this reporter (HOST_DOWN, tombstone)."""
        for t in self._tiers:
            t.forget_acked()

    def in_sync(self) -> bool:
        return self._ndirty == 0 and self.published_count == self._nacked
