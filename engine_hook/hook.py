"""Hook: the engine-facing API that stages cache transitions and publishes them into the ring.

Imports: stdlib, numpy, sidecar.shm_ring. Invariants: no public method raises into the engine or
blocks on the sidecar; every failure is counted in `stats()` and logged at most once per reason per
interval. Records are staged in a list (one atomic `append` per call under the GIL; with the
compiled module a single key's stored()/removed() stage in C, the same items) and published
by `flush()`. A background flusher sleeps while nothing is staged (a liveness stamp once a second)
and publishes what the engine leaves staged within `max_stage_delay_ms` (docs/ring.md, "Producer
protocol"); it never wakes per engine step of an engine that flushes itself.
"""

from __future__ import annotations

import _thread
import contextlib
import itertools
import logging
import operator
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from engine_hook import resident
from engine_hook.descriptor import Descriptor
from engine_hook.resident import ResidentSet
from sidecar.shm_ring import compiled
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import EngineBell
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.snapshot import SnapshotWriter
from sidecar.shm_ring.writer import WORDS_MAX, RingWriter

log = logging.getLogger(__name__)

SnapshotProvider = Callable[
    [], tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]
]
_I64_MIN = -(1 << 63)
_U64_END = 1 << 64
_U64_MASK = _U64_END - 1
LOG_INTERVAL_S = 60.0
SCALAR_FLUSH_MAX = 16
# The flusher's liveness stamp period while idle; the sidecar declares an engine dead only after
# engine.stale_after_s (default 5 s) without a stamp.
STAMP_S = 1.0
# While the engine flushes itself the flusher is only a safety net: it looks at its stamp, once
# a second, not every max_stage_delay_ms: each wake-up of a sleeping thread costs 65-100 us of
# CPU on this VM (bench/README.md), so a look every 100 ms cost an engine at 5 k events/s
# ~400 ns per event, more than its own flushes.
FOLD_BEHIND = 1 << 16  # queued resident records at which the engine's own flush folds
_NEVER = 1 << 62


class _Mode:
    QUIET = "quiet"  # nothing staged: asleep until the stamp; the first staging posts the bell
    WATCH = "watch"  # records staged that the engine does not flush: publish every delay
    SELF = "self"  # the engine flushes itself: look at the stamp (and when a fold is due)


class _FlushToken:
    """Who may publish: the engine's flush() or the flusher thread, one at a time.

    A list holding one item: pop() takes it (IndexError: taken), append() gives it back; each
    is one C call, atomic under the GIL (and per list in free-threaded builds). threading.Lock
    did the same for 5-15 us more per flush on the caches an engine's step leaves cold (its
    argument parsing and semaphore calls; bench/README.md, "hotpath"), 200+ ns per event at
    5 k events/s. `with token:` waits for it (the flusher, close(), flush(wait=True)): it says
    it waits (`waiting`) and sleeps on `_gate`, a lock used as a binary semaphore that
    whoever gives the token back releases (a release never blocks: the engine's flush must
    not; threading.Event.set takes a lock the sleeper may hold). A wake-up it misses (two
    waiters at once) costs at most WAIT_S. (Polling instead, every 0.2 ms, made a flusher
    that met an engine flushing back to back spin: 3x the CPU per unpaced flush.)
    """

    __slots__ = ("_gate", "give", "slot", "take", "waiting")
    WAIT_S = 0.005

    def __init__(self) -> None:
        self.slot = slot = [True]  # (the C flush looks at it: one item = free)
        self.take = slot.pop
        self.give = slot.append
        self.waiting = False
        self._gate = _thread.allocate_lock()
        self._gate.acquire()  # held: no wake-up pending

    def woken(self) -> None:
        """After give(), when `waiting`: wake the waiter (never blocks)."""
        with contextlib.suppress(RuntimeError):  # already released: a wake-up is pending
            self._gate.release()

    def __enter__(self) -> None:
        while True:
            self.waiting = True
            self._gate.acquire(False)  # a stale wake-up: consumed before the look
            try:
                self.take()
            except IndexError:
                self._gate.acquire(True, self.WAIT_S)
                continue
            self.waiting = False
            return

    def __exit__(self, *exc: object) -> None:
        self.give(True)
        if self.waiting:
            self.woken()


# What the C flush (_accel.Publisher) leaves to Python, as flag bits (_accel.AFTER_*).
_AFTER_RING, _AFTER_POST, _AFTER_FOLD = 1, 2, 4


class _FlushState:
    """What the C flush (_accel.Publisher) shares with the Python code, for a hook without it:
    the same attributes, and every flush is the Python one."""

    __slots__ = ("busy", "fast", "flushes", "fold_at", "fold_post_at", "queue", "run", "stage")

    def __init__(self) -> None:
        self.queue: Any = None
        self.fast = 0
        self.run: tuple[Any, int] = ((), -1)
        self.stage = 0
        self.flushes = self.busy = 0
        self.fold_post_at = self.fold_at = _NEVER

    def release(self) -> None:
        pass


class _RateLimitedLog:
    """Counts every event by reason; logs a reason at most once per interval."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.counts: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._interval = interval_s

    def __call__(self, reason: str, detail: object = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last.get(reason, -1e18) >= self._interval:
            self._last[reason] = now
            log.warning(
                "kvcm hook problem reason=%s count=%d detail=%s",
                reason,
                self.counts[reason],
                detail,
            )


def normalize_keys(keys: Any) -> np.ndarray:
    """Any int, sequence or integer ndarray -> int64 array of KVCM's signed bit pattern.

    Raises on the first bad key; `split_keys` is the forgiving form the hook uses."""
    good, bad = split_keys(keys)
    if bad is not None:
        raise bad
    return good


def split_keys(keys: Any) -> tuple[np.ndarray, Exception | None]:
    """(the valid keys as int64, the first problem or None): a bad key inside a sequence costs
    only itself, so the good transitions beside it are never lost."""
    if isinstance(keys, np.ndarray):
        arr = keys.ravel()
        if arr.dtype == np.int64:
            return arr, None
        if arr.dtype == np.uint64:
            return arr.view(np.int64), None
        if arr.dtype.kind in "iu":
            return arr.astype(np.int64), None
        if arr.dtype.kind != "O":
            return _NO_KEYS, TypeError(f"keys array dtype {arr.dtype} is not an integer type")
        keys = arr.tolist()
    if isinstance(keys, (int, np.integer)) and not isinstance(keys, bool):
        keys = [int(keys)]
    out = []
    problem: Exception | None = None
    for k in keys:
        # Any int-like (__index__: numpy integers, 0-d arrays), as array('Q') on the fast path
        # takes them; never a bool. The type's name, not the key's repr, in the message: a
        # repr may be huge, or raise (a poison pill: the flush would put its chunk back
        # forever).
        try:
            if type(k) is bool:
                raise TypeError
            k = operator.index(k)
        except TypeError:
            problem = problem or TypeError(f"a key of type {type(k).__name__} is not an integer")
            continue
        if not _I64_MIN <= k < _U64_END:
            problem = problem or OverflowError(f"a key of {k.bit_length()} bits does not fit in 64")
            continue
        out.append(k - _U64_END if k >= 1 << 63 else k)
    return np.array(out, dtype=np.int64), problem


_NO_KEYS = np.empty(0, np.int64)


def _py_words(keys: list[Any]) -> array[int]:
    """The staging conversion without the compiled module (`_accel.words` in C): a list of
    ints as a 'Q' word array; OverflowError for a negative key (the flush converts those),
    TypeError for a bool or a non-int (a bool is never a key: split_keys refuses it)."""
    for k in keys:
        if type(k) is bool:
            raise TypeError("a bool is not a block key")
    return array("Q", keys)


def _key_words(flat: list[Any]) -> array[int] | None:
    """`flat` as u64 words of KVCM's signed bit pattern if every key is an int (not a bool)
    in [-2^63, 2^64), else None. One C-level conversion checks and converts: what a flush of
    a step's lists costs per key."""
    accel = compiled.accel
    if accel is not None:
        try:
            words: array[int] = accel.words(flat)
            return words
        except OverflowError:
            return None
        except TypeError:
            pass  # an int-like object (__index__: a 0-d array, say): the conversions below
    try:
        return _py_words(flat)
    except OverflowError:
        pass  # a negative key: KVCM's signed spelling
    except TypeError:  # a bool, or not an int
        return None
    try:
        return array("Q", array("q", flat).tobytes())
    except OverflowError:  # signed and unsigned spellings mixed, or a key beyond 64 bits
        if all(type(k) is int and _I64_MIN <= k < _U64_END for k in flat):
            return array("Q", [k & _U64_MASK for k in flat])
    except TypeError:
        pass
    return None


class Hook:
    """Publishes one replica's cache transitions. Create it with `engine_hook.attach()`."""

    enabled = True

    def __init__(
        self,
        descriptor: Descriptor,
        segment: Segment,
        *,
        start_flusher: bool = True,
    ) -> None:
        self.descriptor = descriptor
        self._seg = segment
        self._writer = RingWriter(segment, descriptor=descriptor.to_json())
        self._snap = SnapshotWriter(segment)
        self._resident: ResidentSet | None = None
        self._provider: SnapshotProvider | None = None
        self._staged: list[tuple[Any, int]] = []
        self._append = self._staged.append
        self._wake = self._append_and_wake  # bound once: _append_and_wake looks at it by `is`
        # The staging conversion of a list (C: one call; a bool refused, a negative key taken).
        accel = compiled.accel
        self._words: Callable[[list[Any]], array[int]] = (
            accel.words if accel is not None else _py_words
        )
        self._flush_lock = _FlushToken()
        self._take, self._give = self._flush_lock.take, self._flush_lock.give
        self._problem = _RateLimitedLog()
        self._closed = False
        self._flushes = 0
        self._flush_busy = 0
        self._snapshots = 0
        self._snapshot_last_stall_s = 0.0
        self._groups = len(descriptor.group_block_bytes)
        # Dicts, not lists: a negative or unknown group must miss (KeyError), not wrap around.
        # The default medium's metas are keyed by group alone (the common, fastest call); other
        # mediums by (group, name).
        self._mediums = descriptor.medium_table()
        self._stored_meta: dict[Any, int] = {}
        self._removed_meta: dict[Any, int] = {}
        for g in range(self._groups):
            self._stored_meta[g] = L.pack_meta(L.KIND_STORED, g)
            self._removed_meta[g] = L.pack_meta(L.KIND_REMOVED, g)
            for i, name in enumerate(self._mediums):
                self._stored_meta[(g, name)] = L.pack_meta(L.KIND_STORED, g, i)
                self._removed_meta[(g, name)] = L.pack_meta(L.KIND_REMOVED, g, i)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._delay_s = descriptor.max_stage_delay_ms / 1000.0
        self._mode = _Mode.QUIET
        self._own_flushes = 0  # publishes made by the flusher thread (the rest are the engine's)
        self._engine_flushes_seen = 0
        self._next_stamp = 0.0
        self._turns = 0
        self._bell = EngineBell(segment.name) if start_flusher else None
        # The engine's flush() is the C one (one call, no Python frame) when the compiled
        # module has it: it does the usual flush and leaves the rest to this class's flush().
        # So are stored() and removed(): a call with an int key, a list or an int64/uint64
        # array is staged in C exactly as the methods below stage it; every other call is
        # theirs. `_pub.run` is the word array single stored() keys grow, shared by both;
        # `_pub.stage` is 1 only while `_append` is the staged list's own (the C calls stage
        # new items only then).
        self._pub: Any = _FlushState()
        accel = compiled.accel
        if start_flusher and accel is not None and hasattr(accel, "Publisher"):
            try:
                self._pub = accel.Publisher(
                    self._staged,
                    self._flush_lock.slot,
                    segment.slot_words,
                    segment.hdr,
                    self.flush,
                    self._after_flush,
                )
                object.__setattr__(self, "flush", self._pub.flush)
            except Exception as exc:  # an acceleration: without it the Python flush publishes
                self._problem("c_flush_unavailable", repr(exc))
            else:
                try:
                    pub = self._pub
                    pub.run = ((), -1)
                    numpy = (np.ndarray, np.dtype(np.int64), np.dtype(np.uint64))
                    pub.staging(
                        self.stored, self.removed, self._stored_meta, self._removed_meta, numpy
                    )
                    object.__setattr__(self, "stored", pub.stored)
                    object.__setattr__(self, "removed", pub.removed)
                except Exception as exc:  # the same: the Python methods stage every call
                    self._problem("c_stage_unavailable", repr(exc))
        self._set_resident(self._new_resident(start_flusher))
        # Queued resident records at which a flush posts the flusher to fold (once, until it
        # has): the fold runs in the flusher, never in the engine's flush.
        self._pub.fold_post_at = resident.FOLD_AT if start_flusher else _NEVER
        if start_flusher:
            self._arm()
            self._thread = threading.Thread(
                target=self._flush_loop, name="kvcm-hook-flusher", daemon=True
            )
            self._thread.start()

    # ---- hot path ----------------------------------------------------------------------------
    # A call only stages (keys, meta): an int; a list of ints as a 'Q' word array (one C call,
    # _accel.words, checks and converts it, and reads each int once: the engine's ints are
    # cold after its step); a list that does not convert (a bad key: a bool, a str, ...) as a
    # copy, checked at the flush, where a bad key costs only itself; an int64 array copy.
    # Copies, because an engine may reuse its list after the call.
    def stored(self, keys: Any, group: int = 0, medium: str | None = None) -> None:
        """Blocks with these keys now hold `group`'s KV in `medium` (default: the descriptor's).
        Never raises, never blocks."""
        try:
            meta = self._stored_meta[group if medium is None else (group, medium)]
            t = type(keys)
            if t is int:
                # Block by block (Python engines that report each block): consecutive keys
                # with one meta grow one word array, so the flush writes one run, not one per
                # key. Only the newest staged item grows (the flush detaches what it takes).
                # (_accel.Publisher.stored does this branch in C when compiled.)
                pub = self._pub
                run = pub.run
                try:
                    if self._staged[-1] is run and run[1] == meta:
                        run[0].append(keys)
                        return
                except (IndexError, OverflowError):  # nothing staged; a key the array refuses
                    pass
                try:
                    run = (array("Q", (keys,)), meta)
                except OverflowError:  # negative or too large: staged alone, as before
                    self._append((keys, meta))
                    return
                pub.run = run
                self._append(run)
            elif t is list:
                if keys:
                    try:
                        self._append((self._words(keys), meta))
                    except (OverflowError, TypeError):
                        self._append((keys[:], meta))
            else:
                self._stage_many(keys, meta)
        except Exception as exc:  # the engine must never see our failures
            self._reject(exc, group, medium)

    def removed(self, keys: Any, group: int = 0, medium: str | None = None) -> None:
        """Blocks with these keys no longer hold `group`'s KV in `medium` (evicted or freed)."""
        # stored()'s body with the other meta table, not a shared helper: one Python call
        # frame less per call on the engine's hot path.
        try:
            meta = self._removed_meta[group if medium is None else (group, medium)]
            t = type(keys)
            if t is int:
                self._append((keys, meta))
            elif t is list:
                if keys:
                    try:
                        self._append((self._words(keys), meta))
                    except (OverflowError, TypeError):
                        self._append((keys[:], meta))
            else:
                self._stage_many(keys, meta)
        except Exception as exc:
            self._reject(exc, group, medium)

    def cleared(self) -> None:
        """Every block of every group is gone (cache reset)."""
        try:
            self._append((0, L.KIND_CLEARED))
        except Exception as exc:
            self._reject(exc)

    def _stage_many(self, keys: Any, meta: int) -> None:
        if type(keys) is bool:
            raise TypeError("a bool is not a block key")
        if isinstance(keys, np.ndarray):
            arr = keys.ravel()
            if arr.dtype.kind == "O":
                keys = arr.tolist()  # checked per key at the flush
            elif arr.dtype.kind in "iu":
                if len(arr):
                    # KVCM's signed bit pattern: uint64 keys >= 2^63 wrap (a copy either way)
                    u64 = arr.dtype == np.uint64
                    self._append((arr.view(np.int64).copy() if u64 else arr.astype(np.int64), meta))
                return
            else:
                raise TypeError(f"keys array dtype {arr.dtype} is not an integer type")
        if isinstance(keys, (int, np.integer)):
            keys = [keys]
        items = list(keys)
        if items:
            self._append((items, meta))

    def _reject(self, exc: Exception, group: object = 0, medium: object = None) -> None:
        try:
            self._count_rejected(exc, group, medium)
        except Exception:  # a repr that raises: stored()/removed() must not raise anyway
            self._problem("bad_argument", type(exc).__name__)

    def _count_rejected(self, exc: Exception, group: object, medium: object) -> None:
        if isinstance(exc, KeyError):
            if medium is not None and medium not in self._mediums:
                self._problem("bad_medium", f"medium {medium!r} not in {self._mediums}")
            else:
                self._problem("bad_group", f"group {group!r}")
        elif isinstance(exc, (TypeError, OverflowError, ValueError)):
            self._problem("bad_key", exc)
        else:
            self._problem("internal", repr(exc))

    # ---- publishing ------------------------------------------------------------------------
    def flush(self, wait: bool = False) -> int:
        """Publish staged records; answer a pending snapshot request. Returns records accepted.

        By default it never waits: if another thread is flushing, it returns 0 at once and that
        flush (or the next tick) publishes the records. `wait=True` is for shutdown and tests.
        With the compiled module a hook's `flush` is _accel.Publisher's, which does the usual
        flush in one C call and calls this one for everything else.
        """
        try:
            self._take()
        except IndexError:
            if not wait:
                self._flush_busy += 1
                return 0  # another thread is flushing; it (or the next tick) publishes ours
            self._flush_lock.__enter__()
        try:
            if self._closed:
                return 0
            accepted = self._publish_staged()
            if self._thread is None:  # no flusher thread: the engine's flush does its chores
                self._chores()
            return accepted
        except Exception as exc:
            self._problem("flush_failed", repr(exc))
            return 0
        finally:  # the token's __exit__, inline (one call frame less per flush)
            self._give(True)
            if self._flush_lock.waiting:
                self._flush_lock.woken()

    def _publish_staged(self) -> int:
        staged = self._staged
        n = len(staged)
        if not n:
            return 0
        chunk = staged[:n]  # slicing and deleting are single atomic list operations
        del staged[:n]
        self._flushes += 1
        try:
            # The usual step: lists staged as word arrays go straight into the slots in one C
            # call (no numpy, no Python loop: on a VM whose caches went cold during the step,
            # each distinct call and object costs microseconds).
            rs = self._resident
            step = self._writer.write_step(chunk)
            if step is None:
                accepted = self._publish_chunk(chunk)
            else:
                accepted, total = step
                if rs is not None:
                    rs.apply_runs(chunk, total)  # accepted or dropped: see _publish_chunk
            if rs is not None and rs.queued >= self._pub.fold_post_at:
                self._pub.fold_post_at = _NEVER  # until the flusher has folded
                if self._bell is not None:
                    self._bell.post()
            return accepted
        except Exception:
            # The ring or the resident set may lack this chunk: put it back first in line so
            # the next flush publishes it again, in order. Nothing is lost, and a transition
            # written twice in the same order ends in the same state (flush() counts the error).
            staged[0:0] = chunk
            raise

    def _publish_chunk(self, chunk: list[tuple[Any, int]]) -> int:
        n = len(chunk)
        if (
            n <= SCALAR_FLUSH_MAX
            and type(chunk[0][0]) is int
            and all(type(k) is int and _I64_MIN <= k < _U64_END for k, _ in chunk)
        ):
            # A few records: word stores beat numpy's fixed per-call cost by ~20x.
            accepted = self._writer.write_pairs(chunk)
            if self._resident is not None:
                self._resident.apply_pairs(chunk)  # accepted or dropped: see below
            return accepted
        # Every transition goes to the resident set, the dropped ones too: the resync after a
        # drop answers from this set, so a record the ring refused must be here or it is lost
        # for good. The fence stays the last accepted seq (docs/ring.md, "Drops and the
        # resident set").
        flat: np.ndarray | None = None
        # Single keys staged one by one: one C-level pass. Lists, or keys beyond int64, in the
        # chunk make it fail: the paths below.
        if type(chunk[0][0]) is int:
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                flat = np.fromiter(itertools.chain.from_iterable(chunk), np.int64, 2 * n)
        if flat is not None:
            pairs = flat.reshape(-1, 2)
            keys, metas = pairs[:, 0], pairs[:, 1].view(np.uint64)
            accepted = self._writer.write(keys, metas)
            if self._resident is not None:
                self._resident.apply(keys, metas, copy=False)  # views of our own array
            return accepted
        words = self._list_words(chunk)
        if words is not None:  # a step's lists of int keys: no numpy call at all
            kw, mw = words
            accepted = self._writer.write_words(kw, mw)
            if self._resident is not None:
                self._resident.apply_words(kw, mw)
            return accepted
        keys, metas = self._materialize(chunk)
        accepted = self._writer.write(keys, metas)
        if self._resident is not None:
            self._resident.apply(keys, metas, copy=False)  # fresh arrays, ours alone
        return accepted

    @staticmethod
    def _list_words(chunk: list[tuple[Any, int]]) -> tuple[array[int], array[int]] | None:
        """(key words, meta words) of a chunk of ints and int lists, or None (arrays, bad keys,
        more than WORDS_MAX records: the general path)."""
        flat: list[Any] = []
        flat_m: list[int] = []
        for item, meta in chunk:
            t = type(item)
            if t is list or t is array:
                if len(flat) + len(item) > WORDS_MAX:
                    return None  # (before a list of ints is made of, say, a 200 k-key run)
                flat += item
                flat_m += [meta] * len(item)
            elif t is int:
                flat.append(item)
                flat_m.append(meta)
            else:
                return None
        if len(flat) > WORDS_MAX:
            return None
        kw = _key_words(flat)
        return None if kw is None else (kw, array("Q", flat_m))

    def _materialize(self, chunk: list[tuple[Any, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(keys int64, metas uint64): fresh arrays in call order; bad keys counted, left out."""
        keys_l: list[np.ndarray] = []
        metas_l: list[np.ndarray] = []
        for item, meta in chunk:
            if type(item) is array and item.typecode == "Q":
                # Single keys' run (or a list's words): words already, one copy, not a Python
                # loop per key (a run past WORDS_MAX that met a wrap cost ~300 ns per key).
                item = np.array(item, np.uint64).view(np.int64)
            elif type(item) is not np.ndarray:
                item, bad = split_keys(item)
                if bad is not None:  # dropped from the ring and the resident set alike
                    self._problem("bad_key", bad)
            keys_l.append(item)
            metas_l.append(np.full(len(item), meta, dtype=np.uint64))
        if not keys_l:
            return np.empty(0, np.int64), np.empty(0, np.uint64)
        return np.concatenate(keys_l), np.concatenate(metas_l)

    # ---- snapshots -------------------------------------------------------------------------
    def set_snapshot_provider(self, provider: SnapshotProvider | None) -> None:
        """Let an engine that can enumerate its cache answer snapshots itself.

        `provider()` returns (keys int64, group masks uint32) for the default medium, or
        (keys, masks, medium indexes uint8) where index i is `descriptor.medium_table()[i]`; a
        (key, medium) may repeat with different bits. The engine must update its own state
        before reporting the transition to the hook, so that every transition already flushed is
        visible to the provider.
        """
        self._provider = provider
        if provider is not None:
            self._set_resident(None)
        elif self._resident is None:
            # The provider knew the cache; the hook saw its transitions but kept no record, so a
            # new resident set starts empty and a resync would miss keys stored before now.
            self._problem("provider_removed", "the hook's own record starts empty now")
            self._set_resident(self._new_resident(self._thread is not None))

    def _set_resident(self, rs: ResidentSet | None) -> None:
        # The C flush's queue first: a C flush between the two stores feeds the new set.
        self._pub.fold_at = (rs.fold_at or resident.FOLD_AT) if rs is not None else _NEVER
        self._pub.queue = rs.queue if rs is not None else None
        self._resident = rs

    @staticmethod
    def _new_resident(threaded: bool) -> ResidentSet:
        rs = ResidentSet()
        if threaded:
            # The flusher folds queued records between engine steps (at FOLD_AT, or at its
            # stamp); the engine's flush folds only if the flusher falls far behind, so a fold
            # (~2 ms per 8 k records) stays off the engine's flush latency.
            rs.fold_at = FOLD_BEHIND
        return rs

    def _answer_snapshot(self, req: int) -> None:
        t0 = time.perf_counter()
        try:
            self._publish_staged()  # the fence covers everything staged before the request
            fence = self._writer.last_seq
            dropped = self._writer.dropped
            mediums: np.ndarray | None = None
            if self._provider is not None:
                keys, masks, *rest = self._provider()
                mediums = rest[0] if rest else None
            elif self._resident is not None:
                keys, masks, mediums = self._resident.export()
            else:
                raise RuntimeError("no snapshot source")
            self._snap.publish(req, fence, self._writer.boot_id, dropped, keys, masks, mediums)
            self._snapshots += 1
        except Exception as exc:
            self._problem("snapshot_failed", repr(exc))
            self._snap.fail(req)
        self._snapshot_last_stall_s = time.perf_counter() - t0

    def _chores(self) -> None:
        """Liveness stamp and snapshot answers: off the engine's per-step path when threaded."""
        self._writer.stamp()
        req = self._snap.pending_request()
        if req:
            self._answer_snapshot(req)

    def _after_flush(self, flags: int) -> None:
        """What a C flush leaves to Python (_AFTER_* bits; rare): ring the reader's doorbell,
        post the flusher to fold, or fold now (the flusher fell far behind). Never raises."""
        try:
            if flags & _AFTER_RING:
                self._writer.ring_if_idle()
            if flags & _AFTER_POST and self._bell is not None:
                self._bell.post()
            if flags & _AFTER_FOLD and self._resident is not None:
                try:
                    self._take()
                except IndexError:
                    return  # the flusher holds the token: it folds (never wait for it)
                try:
                    self._resident.fold()
                finally:
                    self._flush_lock.__exit__()
        except Exception as exc:
            self._problem("flush_failed", repr(exc))

    # ---- the flusher thread ----------------------------------------------------------------
    def _arm(self) -> None:
        """Make the next staging post the bell (the flusher is about to sleep until the stamp)."""
        self._pub.stage = 0  # first: the C stored()/removed() must not stage past the post
        self._append = self._wake

    def _append_and_wake(self, item: tuple[Any, int]) -> None:
        self._staged.append(item)
        # One post per quiet spell, then plain appends; but never over close()'s swap to
        # _closed_append that fell between the append and here (the item is staged before
        # that swap, so close() publishes it). The look and the store allocate nothing and
        # pass no eval-breaker check between them: no thread switch under the GIL.
        if self._append is not self._wake:
            return  # closed meanwhile (stage 0 too), or another thread's call swapped and posts
        self._append = self._staged.append
        # Last: the C calls may append to staged themselves again. (An _arm() racing this may
        # leave stage 1 beside an armed _append: the post below still follows, and the
        # flusher, which looks at staged after arming, publishes what the C calls stage.)
        self._pub.stage = 1
        if self._bell is not None:
            self._bell.post()

    def _flush_loop(self) -> None:
        sleep = 0.0
        while True:
            posted = self._bell.wait(sleep) if self._bell is not None else False
            if self._stopping:
                return
            busy = self._flush_busy + self._pub.busy
            sleep = self._flusher_turn(posted, time.monotonic())
            if self._flush_busy + self._pub.busy != busy:
                sleep = 0.0  # an engine flush found us holding the lock: publish its records now

    def _flusher_turn(self, posted: bool, now: float) -> float:
        """One wake-up of the flusher: publish, stamp, answer; returns how long to sleep.

        QUIET + posted + staged: the first record after a quiet spell; wait one delay for the
        engine's own flush. Otherwise publish what is staged, then: the engine flushed since the
        last turn -> SELF; we published -> WATCH; neither -> QUIET (arm the bell)."""
        with self._flush_lock:
            try:
                if self._closed:
                    return STAMP_S
                self._turns += 1
                engine = self._flushes + self._pub.flushes - self._own_flushes
                engine_flushed = engine != self._engine_flushes_seen
                self._engine_flushes_seen = engine
                wait_for_engine = self._mode == _Mode.QUIET and posted and bool(self._staged)
                before = self._flushes
                req = self._snap.pending_request()
                if req:
                    self._answer_snapshot(req)  # publishes what is staged first
                elif not wait_for_engine:
                    self._publish_staged()
                published = self._flushes != before
                self._own_flushes += self._flushes - before
                stamp = now >= self._next_stamp
                if stamp:
                    self._writer.stamp()
                    self._next_stamp = now + STAMP_S
                rs = self._resident
                if rs is not None and rs.queued and (stamp or rs.queued >= resident.FOLD_AT):
                    rs.fold()
                self._pub.fold_post_at = resident.FOLD_AT
                if wait_for_engine and not published:
                    self._mode = _Mode.WATCH
                    return self._delay_s
                if engine_flushed:
                    self._mode = _Mode.SELF
                    return self._next_stamp - now
                if published:
                    self._mode = _Mode.WATCH
                    return self._delay_s
                self._mode = _Mode.QUIET
                self._arm()
                if self._staged:  # staged before the bell was armed: no post is coming
                    self._mode = _Mode.WATCH
                    return self._delay_s
                return self._next_stamp - now
            except Exception as exc:
                self._problem("flush_failed", repr(exc))
                self._mode = _Mode.WATCH
                return self._delay_s

    # ---- introspection and shutdown --------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        w = self._writer
        return {
            "enabled": True,
            "ring": self._seg.name,
            "boot_id": w.boot_id,
            "staged": len(self._staged),
            "last_seq": w.last_seq,
            "dropped": w.dropped,
            "flushes": self._flushes + self._pub.flushes,
            "flush_busy": self._flush_busy + self._pub.busy,
            "flusher_alive": self._thread is not None and self._thread.is_alive(),
            "flusher_mode": self._mode if self._bell is not None else None,
            "flusher_wakeups": self._turns,
            "snapshots": self._snapshots,
            "snapshot_last_stall_s": self._snapshot_last_stall_s,
            "resident_keys": len(self._resident) if self._resident is not None else None,
            "problems": dict(self._problem.counts),
            "closed": self._closed,
        }

    def close(self) -> None:
        """Publish what is staged, mark the producer closed, stop the flusher. Idempotent."""
        if self._closed:
            return
        try:
            self._stopping = True
            self._pub.fast = 0  # from here on every flush is the Python one (it sees _closed)
            if self._bell is not None:
                self._bell.post()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=1.0)
            self.flush(wait=True)
            with self._flush_lock:
                self._pub.stage = 0  # the C stored()/removed() leave every call to Python
                self._append = self._closed_append
                # What the engine staged between that flush and the swap is published too.
                self._publish_staged()
                self._closed = True
                self._writer.close()
                self._snap.close()
                self._pub.release()  # its views of the ring, before the segment unmaps
                self._seg.close()
                if self._bell is not None:
                    self._bell.close()
        except Exception as exc:
            self._problem("close_failed", repr(exc))

    def _closed_append(self, item: tuple[Any, int]) -> None:
        self._problem("closed", "transition reported after close()")


class NullHook:
    """The hook of a gated or misconfigured rank: accepts every call and does nothing."""

    enabled = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def stored(self, keys: Any, group: int = 0, medium: str | None = None) -> None:
        pass

    def removed(self, keys: Any, group: int = 0, medium: str | None = None) -> None:
        pass

    def cleared(self) -> None:
        pass

    def flush(self, wait: bool = False) -> int:
        return 0

    def set_snapshot_provider(self, provider: SnapshotProvider | None) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"enabled": False, "disabled_reason": self.reason}

    def close(self) -> None:
        pass
