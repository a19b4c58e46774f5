"""A vLLM / SGLang ZMQ KV-event stream as a source: SUB + DEALER replay, counts, checkpoint.

Imports: stdlib, numpy, pyzmq (zmq.asyncio on the daemon's loop), msgspec, key_state, source.*.
`Stream` is the synchronous core (tests drive it): seq order; a seq out of order counts only
once its payload decodes; a gap or a backwards seq replays from the last applied seq, whose
digest must match (else another engine life); when the truth is lost the counts are emptied and
KVCM gets an authoritative snapshot (a forget). Bad input is counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from sidecar.config import Config, group_list, medium_map
from sidecar.key_state import KeyState
from sidecar.source import checkpoint as ckpt
from sidecar.source.base import FlushPolicy, Identity, Watch, WatchResult, next_tick
from sidecar.source.block_counts import BlockCounts
from sidecar.source.health import probe
from sidecar.source.key_check import KeyCheck
from sidecar.source.rekey import Rekey, fingerprint, load_table, save_table
from sidecar.source.zmq_events import (
    ERR_EVENT,
    BlockReader,
    Blocks,
    Decoded,
    EventDecoder,
    Folded,
    Segment,
    to_blocks,
)
from sidecar.source.zmtp import ZmtpClosed, ZmtpSub
from sidecar.wakeups import Work

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # the replay end marker's seq (-1)
MAX_HELD_LIVE = 200_000  # live batches held while a replay runs; beyond: give up, forget
IDLE_TURN_S = 1.0  # the feed loop's longest poll (a replay the watch asks for cuts it short)
WATCH_FALLBACK_S = 60.0  # the engine watch's longest sleep (health probes wake it)
# Transport zmtp: a failed connect is tried again after ZMTP_RETRY_S, as libzmq's reconnect_ivl
# (100 ms, never longer): an engine that restarts is followed within it, and what it publishes
# before the subscription lands is the slow joiner's loss (replay repairs it; without replay it
# stays lost, so the wait stays short). A peer that takes the connection and ends it before any
# batch backs off instead, doubling to ZMTP_RETRY_MAX_S (it would otherwise be connected to
# thousands of times a second).
ZMTP_RETRY_S = 0.1
ZMTP_RETRY_MAX_S = 1.0
ZMTP_CONNECT_S = 0.5  # connect + greeting, awaited in the feed loop
DRAIN_BATCHES = 1024  # frames read per loop turn before folding: ~25 ms of work at 1 M blocks/s
COALESCE_MIN_S = 0.002  # shorter coalesced waits poll instead (a timer's own granularity: 1 ms)

# Forget reasons (labels of kvcm_sidecar_zmq_forgets_total).
F_UNCOVERED = "replay_uncovered"  # the engine's buffer no longer holds the gap
F_TIMEOUT = "replay_timeout"  # no reply (or no end marker) in time
F_NO_REPLAY = "no_replay_endpoint"
F_RESTART = "engine_restart"  # seq went backwards, or the replayed batch differs
F_CLEARED = "all_blocks_cleared"
F_CHECKPOINT = "checkpoint_unproven"
F_MALFORMED = "malformed_replay"  # the replayed batch is unreadable too
F_HELD = "live_backlog"  # too many live batches arrived during one replay


class EndpointError(Exception):
    """The SUB or DEALER socket cannot bind / connect (the sidecar exits 1 and is restarted)."""


def digest(payload: bytes) -> bytes:
    return ckpt.digest(payload)


Held = tuple[int, bytes, Decoded | None]  # a live batch held during a replay (decoded or not)
Tables = list[tuple[int, int, np.ndarray, np.ndarray]]  # BlockCounts.arrays(): (medium, group, ..)


@dataclass
class Basis:
    """What a replay can still rebuild exactly after a replay went unanswered: the counts as of
    `seq`, whose batch's digest is `proof`; or (seq -1) the empty state before the life's seq 0.
    Kept (and checkpointed) until a replay proves or refutes it."""

    seq: int
    proof: bytes | None
    tables: Tables
    attempts: int = 0  # recovery replays asked for so far
    retry_at: float = 0.0  # clock() of the next timed attempt
    # The stream was silent while the last attempt waited (a paused or dead engine): its next
    # live batch asks again at once, whatever the timed attempts left (an engine back from a
    # long stop still holds its life in its buffer).
    armed: bool = False
    followed: bool = False  # batches were applied to the followed state since it was made


@dataclass
class _Replay:
    start: int  # the seq asked for
    proof: bytes | None  # digest the batch at `start` must have (None: apply from `start`)
    deadline: float
    why: str
    next: int = -1  # the next seq to apply from the replay (-1: the first reply decides)
    live: deque[Held] = field(default_factory=deque)  # held meanwhile
    proven: bool = False
    replies: int = 0
    # Held batches received before this request went out: a proof refutes their seq (the
    # engine that answered after them is still the life we follow).
    before: int = 0
    hollow: bool = False  # follows a forget, nothing applied yet: the empty state is true
    basis: Basis | None = None  # a recovery: the state to rebuild on, once the replay proves it


class Stream:
    """Seq bookkeeping, replay, forget and the fold into counts (no sockets, no clock reads)."""

    def __init__(
        self,
        decoder: EventDecoder,
        counts: BlockCounts,
        *,
        dp_rank: int,
        can_replay: bool,
        replay_timeout_s: float,
        replay_retries: int = 8,
        replay_retry_cap_s: float = 30.0,
        tail_check_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.decoder = decoder
        self.counts = counts
        self.dp_rank = dp_rank
        self.can_replay = can_replay
        self.replay_timeout_s = replay_timeout_s
        self.replay_retries = replay_retries  # timed recovery attempts per basis
        self.replay_retry_cap_s = replay_retry_cap_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.basis: Basis | None = None  # a recovery is pending (see Basis)
        # The tail check: a seq gap shows only when a later batch arrives, so batches lost at
        # the end of a burst (a cut connection, the publisher's HWM) would stay unseen while
        # the engine idles. Once the stream has been quiet this long after live batches, one
        # replay from the last applied seq (its proof, and whatever followed) tells.
        self.tail_check_s = tail_check_s
        self.live_at: float | None = None  # last live batch, while no tail check covers it
        self.tail_misses = 0  # tail checks unanswered since the last live batch
        self.expected: int | None = None  # next seq to apply (None: take the next one seen)
        self.last_seq = -1
        self.last_payload: bytes | None = None
        self.last_digest: bytes | None = None  # when last_payload is gone (a checkpoint)
        self.replay: _Replay | None = None
        self.want_replay: int | None = None  # a request the socket side must send
        self.forget_pending = False
        self.discard_ends = 0  # end markers of replies given up on, still to come
        self.incarnation = secrets.randbits(63) | 1
        self._pend: list[Segment] = []
        self._reader = BlockReader()  # the flush's common case, in C
        self._replayed: dict[int, bytes] = {}  # seq -> digest of batches applied from a replay
        self._replayed_top = -1
        # counters (exported by sidecar/metrics)
        # batches by outcome: applied, replayed, duplicate, stale, dp_rank, malformed
        self.batches: Counter[str] = Counter()
        self.events = np.zeros(512, np.int64)  # [2 * medium + stored?]: events applied
        self.blocks = 0  # block hashes applied
        self.decode_errors: Counter[str] = Counter()
        self.gaps = 0
        self.replays: Counter[str] = Counter()  # by outcome
        self.forgets: Counter[str] = Counter()
        self.restarts = 0
        self.changed = False  # the key state may have changed since the owner last looked
        self.pristine = True  # nothing applied or loaded yet (a forget would lose nothing)
        self.key_check: KeyCheck | None = None  # samples stores: can a router recompute keys?
        self.rekey: Rekey | None = None  # key modes rolling / both (None: engine keys)

    # ---- entry points ------------------------------------------------------------------------
    def start(self, checkpoint: ckpt.Checkpoint | None, loaded: bool) -> None:
        """At sidecar start: prove a loaded checkpoint, or replay from 0 without one."""
        if checkpoint is not None and loaded:
            self.pristine = False
            self.last_seq = checkpoint.last_seq
            self.last_digest = checkpoint.digest
            self.expected = checkpoint.last_seq + 1
            if not self.can_replay:
                self.forget(F_CHECKPOINT, "no replay endpoint to prove the checkpoint with")
                self.expected = None
                return
            self._ask(checkpoint.last_seq, checkpoint.digest, "checkpoint")
        elif self.can_replay:
            self._ask(0, None, "start")

    def reprove(self) -> None:
        """The engine is healthy again after ENGINE_DOWN: a new incarnation, unless the replay
        shows the same batch at the last applied seq."""
        self.incarnation = secrets.randbits(63) | 1
        if self.last_seq < 0:
            return
        if not self.can_replay:
            self.forget(F_NO_REPLAY, "engine recovered, no replay endpoint to prove continuity")
            self.expected = None
            return
        if self.replay is None and self.basis is not None:
            self._recover("engine_recovered")
        elif self.replay is None:
            self._ask(self.last_seq, self._last_digest(), "engine_recovered")

    def on_live(self, seq: int, payload: bytes, pre: Decoded | None = None) -> None:
        if self.tail_check_s:
            self.live_at = self.clock()
            self.tail_misses = 0
        r = self.replay
        if r is not None:
            if len(r.live) >= MAX_HELD_LIVE:
                # The replay is not keeping up with the live stream: give up on both, follow
                # the live stream from here (from this batch on).
                self.replay = None
                self.replays["abandoned"] += 1
                self.forget(F_HELD, f"more than {MAX_HELD_LIVE} live batches during a replay")
                self.expected = None
                self.discard_ends += 1
            else:
                r.live.append((seq, payload, pre))
                return
        exp = self.expected
        if self._replayed:
            # Live copies of batches a replay already applied may still be in flight (the PUB
            # socket lags the ROUTER): the same seq with the same payload is one of those.
            if seq in self._replayed and self._replayed[seq] == digest(payload):
                self.batches["duplicate"] += 1
                return
            if seq >= self._replayed_top:
                self._replayed.clear()
        b = self.basis
        if b is not None and b.armed:
            # The stream is back after a replay went unanswered in silence (the engine was
            # paused or down): its buffer may still hold all we need. Ask now.
            b.armed = False
            if b.seq < 0 and seq == 0 and exp is None:
                self.basis = None  # its first batch: the whole life arrives live
            else:
                self._recover("stream_back", (seq, payload, pre))
                return
        if exp is None or seq == exp:
            self._apply(seq, payload, replayed=False, pre=pre)
            return
        # An unexpected seq proves nothing until its payload reads: junk is dropped, not held
        # (held, a junk seq beyond the engine's buffer would read as an uncovered gap). Its
        # seq ahead may still be real: a replay fetches whatever the engine has.
        d = pre if pre is not None else self.decoder.decode(payload)
        if not d.ok:
            self._malformed(seq, d)
            if seq > exp and self.can_replay and self.last_seq >= 0:
                self.gaps += 1
                self._ask(self.last_seq, self._last_digest(), "malformed")
            return
        if seq > exp:
            self.gaps += 1
            log.warning("zmq seq gap expected=%d got=%d", exp, seq)
            if self.can_replay and self.last_seq >= 0:
                self._ask(self.last_seq, self._last_digest(), "gap", (seq, payload, d))
            elif self.can_replay:
                self._ask(exp, None, "gap", (seq, payload, d))
            else:
                self.forget(F_NO_REPLAY, f"seq gap {exp}..{seq - 1} and no replay endpoint")
                self._apply(seq, payload, replayed=False, pre=d)
        elif self.can_replay and self.last_seq >= 0:
            # Backwards: an engine restart, or a stray batch. The engine's buffer tells: the
            # batch applied last still there (same life: drop this one) or not (restart).
            self._ask(self.last_seq, self._last_digest(), "back", (seq, payload, d))
        else:
            self._restart(F_RESTART, f"seq went back from {exp - 1} to {seq}", [(seq, payload, d)])

    def on_replayed(self, seq: int, payload: bytes) -> None:
        r = self.replay
        if r is None:
            return  # a late reply to a request given up on
        # The engine is answering: a long replay (or one queued behind it) still arriving lives.
        r.deadline = self.clock() + self.replay_timeout_s
        if self.discard_ends:
            return  # the rest of a reply given up on (its end marker is still to come)
        r.replies += 1
        if r.proof is not None and not r.proven:
            if seq == r.start and (d := digest(payload)) == r.proof:
                if r.basis is not None:
                    self._restore(r.basis)
                r.proven = True
                r.next = seq + 1
                self._replayed[seq] = d  # a live copy of it is a duplicate too
                self._replayed_top = max(self._replayed_top, seq)
                return
            if seq == r.start:
                # Another batch under that seq: another engine life. All of it may still be
                # in the engine's buffer: forget, then ask for it from 0.
                why = F_CHECKPOINT if r.why == "checkpoint" else F_RESTART
                self.replays["restart"] += 1
                self.discard_ends += 1
                self.replay = None
                self._restart(why, f"the batch at seq {seq} differs from the one applied", r.live)
                return
            if self._refuted(r, f"replay from {r.start} began at {seq}", more=True):
                return
            reason = F_CHECKPOINT if r.why == "checkpoint" else F_UNCOVERED
            self._uncovered(reason, f"replay from {r.start} began at {seq}")
            r.proof = None
            r.next = seq
        if r.next < 0:
            if seq != r.start:
                if self._refuted(r, f"replay from {r.start} began at {seq}", more=True):
                    return
                self._uncovered(F_UNCOVERED, f"replay from {r.start} began at {seq}")
            elif r.basis is not None:
                self._restore(r.basis)  # the life from its seq 0: rebuilt from empty
            r.next = seq
        if seq < r.next:
            self.batches["duplicate"] += 1
            return
        if seq > r.next:
            self._uncovered(F_UNCOVERED, f"replay skipped {r.next}..{seq - 1}")
        r.next = seq + 1
        self._replayed[seq] = digest(payload)
        self._replayed_top = max(self._replayed_top, seq)
        self._apply(seq, payload, replayed=True)

    def on_replay_end(self) -> None:
        if self.discard_ends:
            self.discard_ends -= 1
            return
        r = self.replay
        if r is None:
            return
        if r.proof is not None and not r.proven and r.why in ("back", "tail"):
            # The batch applied last is gone from the buffer: the seq went back for good (a
            # tail check sees it when a new engine life came up quietly: chaos seed 3101).
            self.replays["restart"] += 1
            self.replay = None
            self._restart(F_RESTART, f"batch {r.start} gone from the replay buffer", r.live)
            return
        if r.proof is not None and not r.proven:
            if self._refuted(r, f"replay from {r.start} returned nothing", more=False):
                return
            reason = F_CHECKPOINT if r.why == "checkpoint" else F_UNCOVERED
            self._uncovered(reason, f"replay from {r.start} returned nothing")
        elif r.replies == 0 and r.why != "start" and not (r.basis and r.basis.seq < 0):
            # (An empty buffer answering a replay from 0 is a life that published nothing.)
            self._uncovered(F_UNCOVERED, f"replay from {r.start} returned nothing")
        self.replays["covered" if not self._forgot_during(r) else "uncovered"] += 1
        self._end_replay()

    def check_deadline(self) -> bool:
        """Give up on a replay not answered in time (True if it did).

        A forget need not be final: what the replay would have rebuilt on is kept as a Basis,
        and recovery replays are asked for again, timed (with backoff, `replay_retries` of
        them) and at once when a silent stream comes back, until one proves or refutes it."""
        r = self.replay
        if r is None or self.clock() < r.deadline:
            return False
        self.replays["timeout"] += 1
        self.discard_ends = 0  # the socket side opens a fresh DEALER: nothing stale arrives
        silent = len(r.live) <= r.before  # nothing live arrived while it waited
        why = f"no replay from {r.start} within {self.replay_timeout_s}s"
        if r.why == "tail" and not r.replies:
            # A tail check unanswered (the engine stopped or went away after its burst): it
            # proved nothing and changed nothing; the stream goes on where it was. It is asked
            # again, with backoff: a killed engine back as a new life that published only
            # while the SUB reconnected, then idled, shows no live batch (chaos seed 3).
            self.tail_misses += 1
            wait = self.tail_check_s * 2 ** min(self.tail_misses, 20)
            self.live_at = self.clock() + min(wait, self.replay_retry_cap_s) - self.tail_check_s
            self.replay = None
            self._drain_held(r, applied=False)
            return True
        if r.basis is not None and not r.replies:
            # A recovery attempt unanswered: it changed nothing (KVCM already forgot, the
            # followed stream goes on where it was: its expected seq stays), try again later.
            self.replay = None
            self._drain_held(r, applied=False)  # a hole before what was held: a gap, asked for
            self._pend_basis(r.basis, silent)
            return True
        if self.basis is not None:
            # Another replay timed out while a recovery waits: the followed state is partial
            # and may now miss a gap's removes: forget it too, but keep the basis (one made
            # now, from that partial state, would rebuild the partial state "exactly").
            basis: Basis | None = self.basis
            self.forget(F_TIMEOUT, why)
        elif self._forgot_during(r):
            basis = None  # the replay had shown the gap uncovered: nothing exact to rebuild
            self.forget(F_TIMEOUT, why)
        elif self.last_seq < 0:
            basis = Basis(-1, None, [])
            if self.pristine:  # a sidecar started before its engine: nothing to forget
                log.info("zmq replay unanswered within %ss: following live", self.replay_timeout_s)
            self.forget(F_TIMEOUT, why)
        else:
            basis = Basis(self.last_seq, self._last_digest(), self.counts.arrays())
            self.forget(F_TIMEOUT, why)
        self.expected = None
        self.replay = None
        self._drain_held(r)  # follow the live stream meanwhile (a recovery replaces it)
        if basis is not None:
            self._pend_basis(basis, silent)
        return True

    def tick(self) -> None:
        """The feed loop's turn: a timed recovery attempt or a tail check, when one is due."""
        b = self.basis
        if b is not None and self.replay is None and self._timed(b) and self.clock() >= b.retry_at:
            self._recover("retry")
        tail = self._tail_due()
        if tail is not None and self.clock() >= tail:
            self.live_at = None
            self.replays["tail_check"] += 1
            self._ask(self.last_seq, self._last_digest(), "tail")

    def _tail_due(self) -> float | None:
        if (
            self.live_at is None
            or self.replay is not None
            or self.basis is not None
            or not self.can_replay
            or self.last_seq < 0
        ):
            return None
        return self.live_at + self.tail_check_s

    def next_timer(self) -> float | None:
        """clock() of the next timed recovery attempt or tail check (None: none is due)."""
        b = self.basis
        due = [t for t in (self._tail_due(),) if t is not None]
        if b is not None and self.replay is None and self._timed(b):
            due.append(b.retry_at)
        return min(due) if due else None

    def _timed(self, b: Basis) -> bool:
        """Timed attempts go on: `replay_retries` of them, then, while the stream stays silent
        (an engine that is back may stay idle: no batch would ask for it), one every
        replay_retry_cap_s."""
        return b.attempts < self.replay_retries or b.armed

    def _pend_basis(self, basis: Basis, silent: bool) -> None:
        base = self.replay_timeout_s * 2 ** min(basis.attempts, 20)
        base = min(self.replay_retry_cap_s, max(base, self.replay_timeout_s))
        basis.retry_at = self.clock() + base * (0.5 + 0.5 * self.rng.random())
        basis.armed = silent
        if basis.attempts >= self.replay_retries and not silent:
            # The engine publishes but never answers a replay: what was forgotten stays so.
            self.replays["recovery_given_up"] += 1
            log.warning("zmq recovery given up attempts=%d (replays unanswered)", basis.attempts)
            return
        self.basis = basis

    def _recover(self, why: str, held: Held | None = None) -> None:
        """Ask for a replay that rebuilds the pending basis exactly, once it proves it."""
        b = self.basis
        assert b is not None
        b.attempts += 1
        self.replays[f"recovery_{why}"] += 1
        r = self._ask(max(b.seq, 0), b.proof, f"recover_{why}", held)
        r.basis = b
        self.basis = None  # held by the replay; given back if it goes unanswered

    def _refuted(self, r: _Replay, detail: str, *, more: bool) -> bool:
        """A recovery replay whose buffer no longer holds its basis: the forget stands. What
        the live stream brought since is kept (rebuilding from where the buffer starts would
        lose what came before that); True if so. With nothing followed yet, the caller
        rebuilds from the buffer as after any uncovered gap (False)."""
        b = r.basis
        if b is None or not b.followed:
            return False
        self.replays["recovery_refuted"] += 1
        log.warning("zmq recovery impossible (%s): the forget stands, following live", detail)
        if more:
            self.discard_ends += 1  # the rest of this reply, up to its end marker
        self.replay = None
        self._drain_held(r, applied=False)  # the followed stream goes on where it was
        return True

    def _restore(self, b: Basis) -> None:
        """The replay proved the basis: back to its counts; the replay goes on from there."""
        self.flush()
        self.counts.clear()
        for medium, group, keys, counts in b.tables:
            self.counts.load(medium, group, keys, counts)
        self.last_seq, self.last_payload, self.last_digest = b.seq, None, b.proof
        self._replayed.clear()
        self._replayed_top = -1
        self.replays["recovered"] += 1
        self.changed = True
        log.info("zmq recovery proven from=%d attempts=%d: rebuilding exactly", b.seq, b.attempts)

    def flush(self, repair: bool = False) -> None:
        """Fold what was decoded since the last flush into the counts (and the key state).

        The typed decode leaves each event's hashes as msgpack, so an event whose hashes are
        unreadable (a string, a float, not an array) shows only here, after its batch's seq
        was taken. With `repair` (the feed loop's flush, where nothing else is under way) a
        live batch is handled as one unreadable at decode: what came before it is folded, the
        seq goes back to the batch before it and the replay fetches it (and the rest) again.
        Otherwise (a replayed copy; a flush inside another step) its changes are lost for
        good: forget, then fold what came after it."""
        if not self._pend:
            return
        pend, self._pend = self._pend, []
        kc = self.key_check
        if kc is not None:  # one step per flush; now and then the last batch is checked
            kc.credit -= len(pend)
            if kc.credit <= 0:
                kc.sample_flush([p.origin[1] for p in pend if p.origin is not None])
        if self.rekey is None and (got := self._reader.read(pend, self.events)) is not None:
            # The common case: every event readable (counted by the read), engine keys.
            keys, places, signs, place = got
            self.blocks += len(keys)
            if place >= 0:
                self.counts.apply_at(place >> 8, place & 0xFF, keys, signs)
            else:
                self.counts.apply(keys, places >> 8, places & 0xFF, signs)
            self.changed = True
            return
        f = to_blocks(pend)
        evs = [e for p in pend for e in p.events] if self.rekey is not None else None
        if f.bad:
            self.decode_errors[ERR_EVENT] += len(f.bad)
            i, start = self._batch_of(pend, f.bad[0])
            o = pend[i].origin
            if repair and o is not None and self._repairable(o):
                self._fold(f, 0, start, evs)
                seq, _payload, _replayed, *prev = o
                # This batch and the live ones after it were counted applied, and the replay
                # brings them again (counted replayed): they were not applied, after all.
                redo = {p.origin[0] for p in pend[i:] if p.origin is not None and not p.origin[2]}
                self.batches["applied"] -= len(redo)
                self.batches["malformed"] += 1
                self.gaps += 1
                log.warning("zmq batch unreadable seq=%d reason=%s (block_hashes)", seq, ERR_EVENT)
                self.last_seq, self.last_payload, self.last_digest = prev
                self.expected = seq
                self._ask(self.last_seq, self._last_digest(), "malformed")
                return
            self.forget(F_MALFORMED, "an event's block_hashes are unreadable")
            self._fold(f, f.bad[-1] + 1, len(f.codes), evs)
            return
        self._fold(f, 0, len(f.codes), evs)

    def _fold(self, f: Folded, first: int, end: int, evs: list[Any] | None = None) -> None:
        """Events [first, end) of `f` into the counts (re-keyed first in rolling / both)."""
        self.events += f.events(first, end)
        b = f.blocks
        lo, hi = f.block(first), f.block(end)
        self.blocks += hi - lo
        if self.rekey is not None and evs is not None:
            b = self.rekey.apply(f, first, end, evs)
        elif lo or hi < len(b.keys):
            b = Blocks(b.keys[lo:hi], b.mediums[lo:hi], b.groups[lo:hi], b.signs[lo:hi])
        self.counts.apply(b.keys, b.mediums, b.groups, b.signs)
        self.changed = True

    @staticmethod
    def _batch_of(pend: list[Segment], event: int) -> tuple[int, int]:
        """(index of the first segment of the batch holding `event`, its first event)."""
        i = start = 0
        while start + len(pend[i].codes) <= event:
            start += len(pend[i].codes)
            i += 1
        seq = pend[i].origin[0] if pend[i].origin is not None else None
        while (
            i
            and seq is not None
            and pend[i - 1].origin is not None
            and pend[i - 1].origin[0] == seq
        ):
            i -= 1
            start -= len(pend[i].codes)
        return i, start

    def _repairable(self, origin: tuple[Any, ...]) -> bool:
        _seq, _payload, replayed, prev_seq, *_ = origin
        return not replayed and self.replay is None and self.can_replay and prev_seq >= 0

    def forget(self, reason: str, detail: str) -> None:
        """The counts can no longer be trusted: empty them; KVCM gets an authoritative snapshot."""
        if self.pristine:  # nothing was ever held: nothing to lose (the registration snapshot
            log.info("zmq source starts mid-stream reason=%s detail=%s", reason, detail)
            return  # already tells KVCM exactly what we hold: nothing)
        self._pend = []
        self.counts.clear()
        if self.rekey is not None:
            self.rekey.forget()
        self.forgets[reason] += 1
        self.forget_pending = True
        self.changed = True
        log.warning("zmq source forgets the replica's keys reason=%s detail=%s", reason, detail)

    def pending_basis(self) -> Basis | None:
        """The basis a recovery waits to rebuild on (pending, or held by a recovery replay)."""
        if self.basis is not None:
            return self.basis
        r = self.replay
        return r.basis if r is not None and r.basis is not None and not r.replies else None

    def checkpoint(self) -> tuple[ckpt.Checkpoint, Tables | None] | None:
        """The state to persist: as of the last applied batch, with None for the tables (the
        counts now); while a recovery is pending, its basis instead (what a restarted sidecar
        must still rebuild on; an empty basis needs no checkpoint: it replays from 0). None:
        nothing to write."""
        self.flush()
        b = self.pending_basis()
        if b is not None:
            if b.seq < 0 or b.proof is None:
                return None
            return ckpt.Checkpoint(b.seq, b.proof, []), b.tables
        d = self._last_digest()
        if self.last_seq < 0 or d is None:
            return None
        return ckpt.Checkpoint(self.last_seq, d, []), None

    # ---- internals ---------------------------------------------------------------------------
    def _last_digest(self) -> bytes | None:
        if self.last_payload is not None:
            self.last_digest = digest(self.last_payload)
            self.last_payload = None  # hash once; keep the digest
        return self.last_digest

    def _ask(self, start: int, proof: bytes | None, why: str, held: Held | None = None) -> _Replay:
        self.flush()
        r = self.replay = _Replay(start, proof, self.clock() + self.replay_timeout_s, why)
        if held is not None:
            r.live.append(held)
            r.before = 1
        self.want_replay = start
        log.info("zmq replay requested from=%d why=%s", start, why)
        return r

    def _restart(self, reason: str, detail: str, live: deque[Held] | list[Held]) -> None:
        """Another engine life: forget, then follow it from its seq 0 (the replay brings what
        went by; KVCM hears of the forget at once, as the empty state is true meanwhile)."""
        self.restarts += 1
        self._replayed.clear()
        if self.key_check is not None:
            # A seeded, deterministic scheme proven (now, or by the life the table was saved in)
            proven = bool(self.key_check.reproducing()) or bool(self.rekey and self.rekey.proven)
            self.key_check.reset()
            if self.rekey is not None and not proven:
                self.rekey.clear()  # the new life's hashes may mean other tokens
        self.basis = None  # another life: nothing of the old one to rebuild
        self.forget(reason, detail)
        self.incarnation = secrets.randbits(63) | 1
        self.last_seq, self.last_payload, self.last_digest = -1, None, None
        self.expected = None
        held = deque(live)
        if self.can_replay and not (held and held[0][0] == 0):  # its first batches went by
            r = self._ask(0, None, "restart")
            r.live, r.before, r.hollow = held, len(held), True
        else:
            self._drain_held(_Replay(0, None, 0.0, "restart", live=held))

    def _malformed(self, seq: int, d: Decoded) -> None:
        reason = d.error.split(":", 1)[0]
        self.decode_errors[reason] += 1
        self.batches["malformed"] += 1
        log.warning("zmq batch unreadable seq=%d reason=%s", seq, d.error[:200])

    def _uncovered(self, reason: str, detail: str) -> None:
        assert self.replay is not None
        self.replay.why = f"{self.replay.why}:forgot"
        self.forget(reason, detail)

    @staticmethod
    def _forgot_during(r: _Replay) -> bool:
        return r.why.endswith(":forgot")

    def _end_replay(self) -> None:
        r = self.replay
        self.replay = None
        if r is None:
            return
        if r.next >= 0:
            self.expected = r.next
        if self.tail_check_s and r.replies and not r.why.startswith("tail"):
            # What the engine published after serving it comes live only, and may go by
            # unseen (a SUB still reconnecting after an engine restart: chaos seed 8048); with
            # no later batch, only a tail check shows it. A tail check's own end does not
            # arm one (once per quiet spell); a held batch applied next re-arms it anyway.
            self.live_at = self.clock()
        self._drain_held(r)

    def _drain_held(self, r: _Replay, applied: bool = True) -> None:
        """The live batches held during the replay, in order; copies of replayed ones skipped,
        and those a proof refuted (seen before the request the same engine life answered)."""
        first = True
        n = 0
        while r.live:
            seq, payload, pre = r.live.popleft()
            n += 1
            if self.expected is not None and seq < self.expected and self.replay is None:
                if self._replayed.get(seq) == digest(payload):
                    self.batches["duplicate"] += 1
                    continue
                if r.proven and n <= r.before:
                    self.batches["stale"] += 1
                    log.warning("zmq batch dropped seq=%d reason=stale (not this life's)", seq)
                    continue
                # Not what the replay showed under that seq: maybe a new engine life that
                # began while the replay was served; on_live finds out.
            elif first and applied and self.expected is not None and seq > self.expected:
                # The engine replays all it has buffered when it serves the request, which is
                # after it published the batch that revealed the gap: a hole here is not in
                # its buffer (or that seq was bogus). Asking again would loop.
                self.forget(F_UNCOVERED, f"replay ended at {self.expected - 1}, live is at {seq}")
                self.expected = None
            first = False
            self.on_live(seq, payload, pre)
            if self.replay is not None:  # another gap: the rest waits for that replay
                self.replay.live.extend(r.live)
                return

    def _apply(
        self, seq: int, payload: bytes, *, replayed: bool, pre: Decoded | None = None
    ) -> None:
        self.pristine = False
        if self.replay is not None:
            self.replay.hollow = False
        if self.basis is not None:
            self.basis.followed = True
        d = pre if pre is not None else self.decoder.decode(payload)
        if not d.ok:
            self._malformed(seq, d)
            if replayed or not self.can_replay or self.last_seq < 0:
                # Its changes are lost for good: what we hold may be wrong from here on.
                self.forget(F_MALFORMED, f"batch {seq} unreadable")
            else:  # maybe only this copy was damaged: ask for it again
                self.gaps += 1
                self._ask(self.last_seq, self._last_digest(), "malformed")
                return
        origin = (seq, payload, replayed, self.last_seq, self.last_payload, self.last_digest)
        self.expected = seq + 1
        self.last_seq = seq
        self.last_payload = payload
        if not d.ok:
            return
        if d.dp_rank is not None and d.dp_rank != self.dp_rank:
            self.batches["dp_rank"] += 1
            log.warning("zmq batch of another dp rank dropped seq=%d dp_rank=%d", seq, d.dp_rank)
            return
        self.batches["replayed" if replayed else "applied"] += 1
        if self.decoder.dropped_recently:
            self.decoder.dropped_recently = False
            log.warning("zmq events dropped totals=%s", self.decoder.drops)
        for part in d.parts:
            if isinstance(part, Segment):
                part.origin = origin  # what a late-found unreadable event goes back to
                self._pend.append(part)
            else:  # CLEARED
                self.flush()
                self.forget(F_CLEARED, f"AllBlocksCleared in batch {seq}")


def _unwatch(sock: zmq.asyncio.Socket) -> Callable[[], None] | None:
    """Stop the event loop watching an asyncio socket's descriptor; returns what watches it
    again (None, and nothing changed, if this pyzmq lacks the two methods)."""
    clear = getattr(sock, "_clear_io_state", None)
    init = getattr(sock, "_init_io_state", None)
    if clear is None or init is None:
        return None
    clear()
    out: Callable[[], None] = init
    return out


def kvcm_mediums(cfg: Config) -> tuple[tuple[str, ...], dict[str, int]]:
    """(medium table, engine medium -> index): index 0 is what GPU (the default) maps to."""
    mm = medium_map(cfg.source.zmq.medium_map)
    table: list[str] = []
    for kvcm in [mm.get("GPU", "hbm"), *mm.values()]:
        if kvcm not in table:
            table.append(kvcm)
    return tuple(table), {engine: table.index(kvcm) for engine, kvcm in mm.items()}


def infer_bind(endpoint: str) -> bool:
    """The engine binds wildcard and ipc endpoints (so the sidecar connects), else connects."""
    return not ("*" in endpoint or endpoint.startswith(("ipc://", "inproc://")))


def connectable(endpoint: str) -> str:
    return endpoint.replace("://*:", "://127.0.0.1:")


class ZmqSource:
    kind = "zmq"

    def __init__(
        self,
        cfg: Config,
        keys: KeyState,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.cfg = cfg
        z = cfg.source.zmq
        self.z = z
        self.keys = keys
        self.clock = clock
        self.sleep = sleep
        self.mediums, index = kvcm_mediums(cfg)
        self.required = group_list(z.required_groups)
        keys.set_required(self.required)
        self.counts = BlockCounts(keys)
        self.stream = Stream(
            EventDecoder(index, z.block_size, cfg.identity.dp_rank, full=z.key_mode != "engine"),
            self.counts,
            dp_rank=cfg.identity.dp_rank,
            can_replay=bool(z.replay_endpoint),
            replay_timeout_s=z.replay_timeout_s,
            replay_retries=z.replay_retries,
            replay_retry_cap_s=z.replay_retry_cap_s,
            tail_check_s=z.tail_check_s,
            clock=clock,
        )
        self.bind = infer_bind(z.endpoint) if z.bind is None else z.bind
        can_zmtp = not self.bind and z.endpoint.startswith(("tcp://", "ipc://"))
        self.transport = (
            "zmtp" if z.transport == "zmtp" or (z.transport == "auto" and can_zmtp) else "libzmq"
        )
        self.ckpt_path = ckpt.path_for(
            cfg.source.state_dir, cfg.identity.instance_id, cfg.identity.dp_rank, z.endpoint
        )
        self.key_check = self.stream.key_check = KeyCheck(
            z.block_size, z.router_hash_seed, warn=z.key_mode == "engine"
        )
        self.rekey: Rekey | None = None
        if z.key_mode != "engine":
            self.rekey = self.stream.rekey = Rekey(
                z.block_size,
                z.kvcm_block_tokens,
                both=z.key_mode == "both",
                capacity=z.key_table_entries,
                sglang=z.engine == "sglang",
                lora_adapter=z.lora_adapter,
            )
        self.table_path = self.ckpt_path + ".keys"
        self.table_fp = fingerprint(
            z.engine, z.block_size, z.kvcm_block_tokens, self.required, z.lora_adapter
        )
        self.ckpt_at = 0.0  # clock() of the last checkpoint written (0: none yet)
        self.ckpt_seq = -2
        self.ckpt_errors: Counter[str] = Counter()
        self.health_failures = 0
        self.health_ok_once = False
        self.watch_wake = asyncio.Event()  # set after each health probe: a verdict may change
        self._turn: asyncio.Future[Any] | None = None  # the feed loop's idle poll, to cut short
        self.frames_bad: Counter[str] = Counter()
        self.live_frames = 0
        # transport zmtp (sidecar/source/zmtp.py): the live connection and its history
        self.zmtp: ZmtpSub | None = None
        self.zmtp_events: Counter[str] = Counter()  # connected, lost, connect_failed
        self._zmtp_retry_at = 0.0  # when to connect again (monotonic)
        self._zmtp_backoff = ZMTP_RETRY_S
        self._zmtp_delivered = False  # the connection in use carried a batch
        self.replayed_frames = 0
        self._ctx: zmq.asyncio.Context | None = None

    # ---- what the publisher reads ----------------------------------------------------------
    @property
    def incarnation(self) -> int:
        return self.stream.incarnation

    @property
    def last_seq(self) -> int:
        return max(self.stream.last_seq, 0)

    @property
    def dropped_total(self) -> int:
        return sum(self.stream.forgets.values())

    @property
    def resyncs(self) -> Counter[str]:
        return self.stream.forgets

    @property
    def synced(self) -> bool:
        # Right after a forget, before the replay applied anything, the empty state is true:
        # the publisher may tell KVCM to forget at once instead of after the whole replay.
        r = self.stream.replay
        # A recovery replay not answered yet changes nothing until it proves its basis: the
        # live stream followed meanwhile is what the publisher reports.
        return (
            r is None
            or r.hollow
            or (r.basis is not None and not r.replies)
            or r.why == "tail"  # applies what was missed, in order, as the live stream would
        )

    @property
    def sync_state(self) -> str:
        r = self.stream.replay
        return "synced" if r is None else f"replaying_{r.why.split(':')[0]}"

    def lag(self) -> int:
        """Live batches seen beyond the last applied one (those held while a replay runs;
        counted, not read off their seqs: a junk seq must not move a gauge)."""
        r = self.stream.replay
        return len(r.live) if r is not None else 0

    def take_forget(self) -> bool:
        out = self.stream.forget_pending
        self.stream.forget_pending = False
        return out

    def identity(self) -> Identity:
        i, z = self.cfg.identity, self.z
        return Identity(
            instance_id=i.instance_id,
            dp_rank=i.dp_rank,
            model_name=z.model_name,
            dtype=z.dtype,
            use_mla=False,
            tp_size=z.tp_size,
            dp_size=z.dp_size,
            pp_size=1,
            block_size_tokens=z.kvcm_block_tokens,
            block_bytes=z.block_bytes,
            required_groups=self.required,
            mediums=self.mediums,
        )

    def watch(self, engine_down: bool) -> WatchResult:
        if not self.z.health_url:
            return WatchResult()  # silence is not death: without a probe the engine lives
        if not engine_down and self.health_failures >= self.z.health_fail_after:
            log.warning("engine down reason=health failures=%d", self.health_failures)
            return WatchResult(Watch.DOWN, f"health check failed {self.health_failures} times")
        if engine_down and self.health_failures == 0 and self.health_ok_once:
            # A new incarnation unless the replay proves continuity; not synced until then, so
            # the publisher's snapshot after re-registering waits for the proof.
            self.stream.reprove()
            self._kick()  # a replay it asks for goes out now, not at the feed loop's next turn
            log.info("engine back reason=health")
            return WatchResult(Watch.BACK, "healthy again", self.stream.incarnation)
        return WatchResult()

    def watch_wait_s(self, engine_down: bool, now: float | None = None) -> float:
        """The verdict changes only with a health probe, which sets `watch_wake`: without a
        health URL never (silence is not death). The fallback is a safety net."""
        return next_tick(self.clock() if now is None else now, WATCH_FALLBACK_S)

    def _kick(self) -> None:
        """End the feed loop's idle poll now (it re-reads what it must send)."""
        turn = self._turn
        if turn is not None and not turn.done():
            turn.set_result([])

    def recovery_status(self) -> dict[str, Any]:
        """A forget that a replay may still undo: from which seq, tries, when the next is due."""
        s = self.stream
        b = s.pending_basis()
        if b is None:
            return {"pending": False}
        nxt = s.next_timer()
        return {
            "pending": True,
            "from_seq": max(b.seq, 0),
            "attempts": b.attempts,
            "in_flight": s.basis is None,
            "next_attempt_in_s": None if nxt is None else round(max(nxt - self.clock(), 0), 3),
            "on_stream_back": b.armed,
        }

    def checkpoint_age_s(self) -> float:
        return self.clock() - self.ckpt_at if self.ckpt_at else -1.0

    def status(self) -> dict[str, Any]:
        s = self.stream
        return {
            "source": self.kind,
            "zmq_endpoint": self.z.endpoint,
            "zmq_bind": self.bind,
            "zmq_transport": self.transport,
            **({"zmtp": dict(self.zmtp_events)} if self.zmtp is not None else {}),
            "zmq_gaps": s.gaps,
            "zmq_forgets": dict(s.forgets),
            "zmq_replays": dict(s.replays),
            "zmq_drops": dict(s.decoder.drops),
            "zmq_decode_errors": dict(s.decode_errors),
            "zmq_held_blocks": self.counts.held(),
            "zmq_recovery": self.recovery_status(),
            "checkpoint_age_s": round(self.checkpoint_age_s(), 3),
            "health_failures": self.health_failures,
            "key_mode": self.z.key_mode,
            "key_check": self.key_check.status(),
            **({"rekey": self.rekey.status()} if self.rekey is not None else {}),
        }

    # ---- loops -------------------------------------------------------------------------------
    def loops(self, work: Work) -> dict[str, Awaitable[None]]:
        out: dict[str, Awaitable[None]] = {"zmq-feed": self.run(work)}
        if self.z.health_url:
            out["zmq-health"] = self.health_loop()
        return out

    async def health_loop(self) -> None:
        z = self.z
        while True:
            ok = await probe(z.health_url, z.health_timeout_s)
            if ok:
                self.health_failures = 0
                self.health_ok_once = True
            else:
                self.health_failures += 1
                log.warning(
                    "engine health probe failed url=%s n=%d", z.health_url, self.health_failures
                )
            self.watch_wake.set()
            # On the shared tick (next_tick): the probe shares the heartbeat's wake-up.
            await self.sleep(next_tick(self.clock(), z.health_interval_s))

    def _load_checkpoint(self) -> ckpt.Checkpoint | None:
        i = self.cfg.identity
        try:
            c = ckpt.load(self.ckpt_path, i.instance_id, i.dp_rank, self.z.endpoint)
        except ckpt.CheckpointError as exc:
            self.ckpt_errors["unreadable"] += 1
            log.warning("zmq checkpoint ignored detail=%s", exc)
            return None
        if c is None:
            return None
        index = {m: n for n, m in enumerate(self.mediums)}
        for medium, group, keys, counts in c.tables:
            if medium in index:
                self.counts.load(index[medium], group, keys, counts)
            else:
                self.ckpt_errors["unknown_medium"] += 1
        log.info("zmq checkpoint loaded last_seq=%d held=%d", c.last_seq, self.counts.held())
        if self.rekey is not None:
            got = load_table(self.table_path, self.table_fp, self.rekey)
            if got is None:
                # Counts under rolling keys without the table that made them: a removal
                # could not find its keys. Start from nothing (the replay rebuilds).
                self.ckpt_errors["key_table"] += 1
                log.warning("zmq checkpoint ignored: no key table for it path=%s", self.table_path)
                self.counts.clear()
                return None
            self.rekey.proven = got
            log.info("zmq key table loaded entries=%d", self.rekey.table.n)
        return c

    def write_checkpoint(self) -> None:
        got = self.stream.checkpoint()
        if got is None or (got[0].last_seq == self.ckpt_seq and self.ckpt_at):
            if got is not None:
                self.ckpt_at = self.clock()
            return
        c, tables = got
        names = self.mediums
        arrays = self.counts.arrays() if tables is None else tables
        c.tables = [(names[m], g, k, n) for m, g, k, n in arrays if m < len(names)]
        i = self.cfg.identity
        try:
            if self.rekey is not None:  # first: a checkpoint is loaded only with its table
                proven = self.key_check.reproducing()
                scheme = proven[0] if proven else self.rekey.proven
                save_table(self.table_path, self.table_fp, scheme, self.rekey)
            ckpt.save(self.ckpt_path, i.instance_id, i.dp_rank, self.z.endpoint, c)
        except OSError as exc:
            self.ckpt_errors["write"] += 1
            log.warning("zmq checkpoint not written path=%s detail=%s", self.ckpt_path, exc)
            return
        self.ckpt_at = self.clock()
        self.ckpt_seq = c.last_seq

    def _sockets(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None]:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop silently in the sidecar: the engine's HWM
        sub.setsockopt(zmq.SUBSCRIBE, self.z.topic.encode())
        if self.transport == "zmtp":
            return sub, self._dealer()  # the live stream is the zmtp connection's
        try:
            if self.bind:
                sub.bind(self.z.endpoint)
            else:
                sub.connect(connectable(self.z.endpoint))
            return sub, self._dealer()
        except zmq.ZMQError as exc:
            sub.close(0)
            how = "bind" if self.bind else "connect to"
            raise EndpointError(
                f"cannot {how} {self.z.endpoint} ({exc}); source.zmq.bind must be the opposite "
                "of the engine's: vLLM binds tcp://*:P and ipc:// endpoints, connects otherwise"
            ) from None

    def _dealer(self) -> zmq.asyncio.Socket | None:
        if not self.z.replay_endpoint:
            return None
        assert self._ctx is not None
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        # The engine's ROUTER sends its whole buffer in a tight loop and drops what does not
        # fit (no ROUTER_MANDATORY): a bounded queue here would lose frames of a long replay.
        d.setsockopt(zmq.RCVHWM, 0)
        d.connect(connectable(self.z.replay_endpoint))
        return d

    async def run(self, work: Work) -> None:
        self._ctx = zmq.asyncio.Context()
        c = self._load_checkpoint()
        self.stream.start(c, loaded=c is not None)
        if c is None:
            self.stream.changed = True
        sub, dealer = self._sockets()
        sync_sub: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        if self.transport == "zmtp":
            # the libzmq SUB stays, never connected: the poller's and the loop's shape are
            # the same, and only the zmtp connection carries the live stream
            self.zmtp = ZmtpSub(self.z.endpoint, self.z.topic.encode())
        try:
            await self._feed(sub, sync_sub, dealer, work)
        finally:
            sub.close(0)
            if self.zmtp is not None:
                self.zmtp.close()
            if dealer is not None:
                dealer.close(0)
            self._ctx.destroy(0)
            self._ctx = None

    async def _feed(
        self,
        sub: zmq.asyncio.Socket,
        sync_sub: zmq.Socket[bytes],
        dealer: zmq.asyncio.Socket | None,
        work: Work,
    ) -> None:
        s = self.stream
        poller = zmq.asyncio.Poller()
        if self.zmtp is None:  # (zmtp: its connection's socket, registered once connected)
            poller.register(sub, zmq.POLLIN)
        sync_dealer: zmq.Socket[bytes] | None = None
        if dealer is not None:
            poller.register(dealer, zmq.POLLIN)
            sync_dealer = zmq.Socket.shadow(dealer.underlying)
        every = self.z.checkpoint_interval_s
        next_ckpt = self.clock() + next_tick(self.clock(), every)  # on the shared tick
        policy = FlushPolicy.of(self.cfg.report)
        send_at = policy.at_keys
        since = 0.0  # > 0: the loop slept on purpose since then (batches queued in the SUB)
        rewatch: Callable[[], None] | None = None  # watches the SUB's descriptor again
        blocks_before = 0
        while True:
            work.awake()  # the heartbeat, when due, rides this wake-up
            s.tick()
            if s.want_replay is not None and dealer is not None:
                start, s.want_replay = s.want_replay, None
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            read = 0
            zt = self.zmtp
            if (
                zt is not None
                and zt.sock is None
                and self.clock() >= self._zmtp_retry_at
                and await self._zmtp_connect(zt)
            ):
                poller.register(zt.sock, zmq.POLLIN)
            if zt is not None and zt.sock is not None and (since or zt.backlog):
                # after a coalesced wait (or a read that stopped at DRAIN_BATCHES with whole
                # batches in its buffer, which no poll would report): read, no poll
                read = self._read_zmtp(zt, poller)
            elif since and zt is None:  # after a coalesced wait: read what queued, no poll
                read = self._read_live(sync_sub)
            else:
                # At most IDLE_TURN_S asleep, on the shared tick; a replay the watch loop asks
                # for ends the poll at once (_kick).
                timeout = min(next_ckpt - self.clock(), next_tick(self.clock(), IDLE_TURN_S))
                if s.replay is not None:
                    timeout = min(timeout, s.replay.deadline - self.clock())
                if (retry_at := s.next_timer()) is not None:
                    timeout = min(timeout, retry_at - self.clock())
                if zt is not None and zt.sock is None:
                    timeout = min(timeout, self._zmtp_retry_at - self.clock())
                if rewatch is not None:  # the SUB's descriptor, unwatched since a wait
                    rewatch()
                    rewatch = None
                turn = poller.poll(max(int(timeout * 1000), 0))
                assert isinstance(turn, asyncio.Future)  # pyzmq's asyncio poller: a Future
                self._turn = turn
                try:
                    events = dict(await turn)
                finally:
                    self._turn = None
                if zt is not None:
                    # pyzmq removes a raw socket's reader in a callback of the turn's end: a
                    # poll begun before it runs would lose its new reader (a kicked turn)
                    await asyncio.sleep(0)
                if sync_dealer is not None and dealer in events:
                    self._read_replies(sync_dealer)
                if zt is not None:
                    # pyzmq's poller gives a raw socket back as its descriptor
                    if zt.sock is not None and zt.sock.fileno() in events:
                        read = self._read_zmtp(zt, poller)
                elif sub in events:
                    read = self._read_live(sync_sub)
            if s.check_deadline() and dealer is not None:
                # Replies to the request given up on may still come: a fresh socket drops them.
                poller.unregister(dealer)
                dealer.close(0)
                dealer = self._dealer()
                assert dealer is not None
                poller.register(dealer, zmq.POLLIN)
                sync_dealer = zmq.Socket.shadow(dealer.underlying)
            was_dirty = bool(self.keys.dirty)
            s.flush(repair=True)
            if s.changed:
                s.changed = False
                if not was_dirty and self.keys.dirty:
                    # Batches read after a coalesced wait arrived after it began.
                    self.keys.dirty_since = since or self.clock()
                work.set()
            if self.clock() >= next_ckpt:
                self.write_checkpoint()
                next_ckpt = self.clock() + next_tick(self.clock(), every)
            now, prev, since = self.clock(), since, 0.0
            until = policy.read_at(self.keys, now) if read else 0.0
            if until and read < DRAIN_BATCHES and s.replay is None and s.want_replay is None:
                # Changes wait for the flush window: read again just before it ends (or when
                # flush_at_keys would fill at the rate just seen), not at every engine step.
                blocks = s.blocks - blocks_before if prev else 0
                if blocks:
                    fill = max(send_at - len(self.keys.dirty), 0) / (blocks / (now - prev))
                    until = min(until, now + fill)
                if (retry_at := s.next_timer()) is not None:
                    until = min(until, retry_at)
                until = min(until, next_ckpt)
                if until - now >= COALESCE_MIN_S:
                    since, blocks_before = now, s.blocks
                    # pyzmq watches the SUB's descriptor for the socket's whole life: its first
                    # batch during the wait would wake the loop for nothing. Unwatched meanwhile,
                    # and until the loop polls again (only the poll needs it: at a steady pace
                    # waits follow waits, and each unwatch / watch costs the event loop a
                    # handle and syscalls).
                    if rewatch is None and zt is None:  # (zmtp's is watched only in a poll)
                        rewatch = _unwatch(sub)
                    await asyncio.sleep(until - now)

    def _read_live(self, sock: zmq.Socket[bytes]) -> int:
        # pyzmq's recv_multipart asks RCVMORE after every frame (~1 us each: getsockopt goes
        # through a Python enum): a batch is three frames, so take three and ask once that the
        # message ended there, through the payload's Frame (its `more` is read in C). A message
        # of another shape then shows as "more after the third frame" (or no third frame): it
        # and the rest of what was read with it are skipped and counted; a good batch lost
        # that way is a seq gap, which the replay repairs.
        recv, more = sock.recv, sock.getsockopt
        nb, rcvmore = int(zmq.NOBLOCK), int(zmq.RCVMORE)
        for n_read in range(DRAIN_BATCHES):
            try:
                topic = recv(nb)
            except zmq.Again:
                return n_read
            self.live_frames += 1
            try:
                seq_b = recv(nb)
                frame = recv(nb, copy=False)
            except zmq.Again:  # a message of one or two frames, and nothing after it
                self._bad_frame("frame_shape", 2)
                return n_read + 1
            payload = frame.bytes
            if frame.more:
                n = 3
                while more(rcvmore):
                    recv(nb)
                    n += 1
                self._bad_frame("frame_shape", n)
                continue
            del topic  # the SUB's prefix filter already matched it
            self._live(seq_b, payload)
        return DRAIN_BATCHES

    def _live(self, seq_b: bytes, payload: bytes) -> None:
        """One live batch of three frames (topic, seq, payload), either transport's."""
        if len(seq_b) != 8 or seq_b == END_SEQ:
            self._bad_frame("frame_shape", 3)
            return
        self.stream.on_live(int.from_bytes(seq_b, "big"), payload)

    def _read_zmtp(self, conn: ZmtpSub, poller: zmq.asyncio.Poller) -> int:
        """_read_live's work on the zmtp connection: every complete message it holds (at
        most ~8 MiB a call); a lost connection is counted, logged and retried."""
        n_read = 0

        def on_message(frames: list[bytes]) -> None:
            nonlocal n_read
            n_read += 1
            self.live_frames += 1
            if len(frames) != 3:
                self._bad_frame("frame_shape", len(frames))
                return
            self._live(frames[1], frames[2])

        sock = conn.sock
        try:
            conn.read(on_message, DRAIN_BATCHES)
        except ZmtpClosed as exc:
            if sock is not None:
                poller.unregister(sock)
            self.zmtp_events["lost"] += 1
            if n_read or self._zmtp_delivered:
                # a connection that carried batches: connect again at once (every ZMTP_RETRY_S
                # while refused); one that ended before any (a peer that closes at once) backs off
                self._zmtp_backoff = ZMTP_RETRY_S
                self._zmtp_retry_at = self.clock()
            else:
                self._zmtp_back_off()
            # (at most once per log.repeat_interval_s: sidecar/logs.py)
            log.warning("zmtp connection lost endpoint=%s: %s", self.z.endpoint, exc)
        self._zmtp_delivered = self._zmtp_delivered or n_read > 0
        return n_read

    async def _zmtp_connect(self, conn: ZmtpSub) -> bool:
        self._zmtp_delivered = False
        try:
            await conn.connect(ZMTP_CONNECT_S)
        except (OSError, TimeoutError) as exc:
            self.zmtp_events["connect_failed"] += 1
            self._zmtp_retry_at = self.clock() + ZMTP_RETRY_S  # (the backoff is left as it is)
            log.warning("zmtp connect failed endpoint=%s: %r", self.z.endpoint, exc)
            return False
        self.zmtp_events["connected"] += 1  # (the backoff stays until batches come)
        log.info("zmtp connected endpoint=%s", self.z.endpoint)
        return True

    def _zmtp_back_off(self) -> None:
        self._zmtp_retry_at = self.clock() + self._zmtp_backoff
        self._zmtp_backoff = min(self._zmtp_backoff * 2, ZMTP_RETRY_MAX_S)

    def _read_replies(self, sock: zmq.Socket[bytes]) -> None:
        # At most DRAIN_BATCHES per loop turn, as for live frames: a 10 000-batch replay must
        # not keep the event loop (HTTP, health, metrics) waiting.
        s = self.stream
        for _ in range(DRAIN_BATCHES):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            # vLLM: ["", topic, seq, payload]; SGLang: ["", seq, payload]; end: seq -1, b"".
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                self._bad_frame("replay_frame_shape", len(frames))
                continue
            self.replayed_frames += 1
            if frames[-2] == END_SEQ:
                s.on_replay_end()
            else:
                s.on_replayed(int.from_bytes(frames[-2], "big"), frames[-1])

    def _bad_frame(self, reason: str, n: int) -> None:
        self.frames_bad[reason] += 1
        self.stream.decode_errors[reason] += 1
        log.warning("zmq frame skipped reason=%s frames=%d", reason, n)

    async def final_drain(self) -> None:
        self.stream.flush()
        self.write_checkpoint()

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.destroy(0)
            self._ctx = None
