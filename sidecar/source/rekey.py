"""Re-keying for key modes `rolling` and `both`: engine block hashes -> KVCM's rolling keys.

Imports: stdlib, numpy, msgspec, sidecar.keys, shm_ring.compiled, source.zmq_events. A key is
the full rolling state, so the table maps (group, engine key) to (state, tokens since the last
KVCM boundary) and stores no tokens. Rules (issue #22 §1): a chain continues from its parent's
state (no parent: h = 0) and never restarts from 0 for a parent it does not know; what cannot be
proven is not reported, and counted; taints (extra keys, LoRA) pass to descendants; an entry
outlives its block (content, not residency) and is evicted by epochs (approximate LRU, Table),
never while its block is held. Bad input is counted, never raised. This Python form is the
reference; _rekey.c (the table and the common events) must match it entry for entry.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol, cast

import msgspec
import numpy as np

from sidecar import keys as K
from sidecar.shm_ring import compiled
from sidecar.source.zmq_events import Blocks, Folded

# Reasons a stored block gets no KVCM key (labels of kvcm_sidecar_blocks_unkeyed_total).
UNKNOWN_PARENT, EXTRA_KEYS, LORA, TAINTED, GROUP = (
    "unknown_parent",
    "extra_keys",
    "lora",
    "tainted",
    "group",
)
TOKENLESS, MALFORMED = "tokenless", "malformed"
# A sidecar that serves one LoRA adapter (source.zmq.lora_adapter): the base model's blocks and
# other adapters' belong to other KVCM instances (their own sidecars report them there).
OTHER_INSTANCE = "other_instance"
REASONS = (UNKNOWN_PARENT, EXTRA_KEYS, LORA, TAINTED, GROUP, TOKENLESS, MALFORMED, OTHER_INSTANCE)

_TOKENS = msgspec.msgpack.Decoder(list[int])
_PARENT = msgspec.msgpack.Decoder(int | bytes | None)
_LORA = msgspec.msgpack.Decoder(int | str | None)
_ANY = msgspec.msgpack.Decoder()
_M64 = (1 << 64) - 1
# An entry, packed in one int (the C table, _rekey.c, hands out the same int): state (64 bits,
# unsigned view) | meta << 64, meta = held (24 bits: copies of the block the engine holds,
# saturating) | tainted << 24 | pending << 32 (24 bits: tokens since the last KVCM boundary, n:1)
# | epoch << 56 (8 bits: when the entry was last used, for eviction).
_H_SHIFT, _P_SHIFT, _E_SHIFT = 64, 96, 120
_HELD_MAX = (1 << 24) - 1
_P_MASK = (1 << 24) - 1
PENDING_MAX = _P_MASK  # KVCM block sizes above this do not fit an entry (Rekey refuses them)
C_DOWN_MAX = 64  # the C table's KVCM keys per engine block at most (1:n); beyond, this form
_TAINT = 1 << 88
_HELD = _HELD_MAX << _H_SHIFT
_EPOCH = 0xFF << _E_SHIFT
_ONE = 1 << _H_SHIFT  # one held copy
# The reasons in the order of the counters array the C fast path adds to, then "keyed".
_KEYED = len(REASONS)


def _pack(state: int, pending: int, flags: int, held: int) -> int:
    return (
        (state & _M64)
        | min(held, _HELD_MAX) << _H_SHIFT
        | (_TAINT if flags & 1 else 0)
        | pending << _P_SHIFT
    )


def _unpack(v: int) -> tuple[int, int, int, int]:
    """(state signed, pending, flags (1: tainted), held)."""
    s = v & _M64
    return (
        s - (1 << 64) if s >> 63 else s,
        (v >> _P_SHIFT) & _P_MASK,
        1 if v & _TAINT else 0,
        (v >> _H_SHIFT) & _HELD_MAX,
    )


def _held(v: int) -> int:
    return (v >> _H_SHIFT) & _HELD_MAX


_NIL, _NONE = msgspec.Raw(b"\xc0"), msgspec.Raw()


def _raw(v: Any) -> Any:
    """A field as msgpack (decoders read a Raw as it is, no copy); absent: empty."""
    return v if isinstance(v, msgspec.Raw) else b""


def _is_nil(raw: Any) -> bool:
    """Absent, nil or None (positional events of older releases leave trailing fields out)."""
    return raw is None or raw in (_NIL, _NONE)


def _full_attention(kind: Any) -> bool:
    """vLLM's kv_cache_spec_kind: absent, or a full-attention (or MLA) spec."""
    if kind is None:
        return True
    k = str(kind).lower()
    return "full" in k or "mla" in k


class Table(Protocol):
    """The key table's interface: KeyTable here (the reference, and the fallback without the C
    extension) and _rekey.c's KeyTable implement it alike, entry for entry.

    Eviction is by epochs, an approximation of LRU that both forms compute alike: an entry
    carries the epoch of its last use (an 8-bit counter that advances every capacity / 16 new
    entries); when an apply leaves more than `capacity` entries, the entries whose block is not
    held are dropped oldest epoch first, whole epochs at a time, down to capacity - capacity / 16.
    An entry whose block is held is never evicted."""

    capacity: int

    @property
    def n(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def down(self) -> int: ...
    def get(self, g: int, key: int) -> int | None: ...
    def extras(self, g: int, key: int) -> tuple[int, ...]: ...
    def put(self, g: int, key: int, v: int, extras: tuple[int, ...] | None = None) -> None: ...
    def keep(self, g: int, key: int, v: int) -> None: ...
    def touch(self, g: int, key: int) -> None: ...
    def evict(self) -> None: ...
    def unhold(self) -> None: ...
    def clear(self) -> None: ...
    def export(self) -> tuple[bytes, bytes, bytes, bytes, bytes, int]: ...
    def load(
        self, groups: bytes, keys: bytes, states: bytes, metas: bytes, extras: bytes, epoch: int
    ) -> None: ...


def _epoch_len(capacity: int) -> int:
    return max(1, capacity >> 4)


class KeyTable:
    """The reference table (Table): (group, engine key) -> packed entry, a dict per group; 1:n
    keeps each entry's earlier keys beside it (`extra`)."""

    def __init__(self, capacity: int, down: int = 1) -> None:
        self.capacity = capacity
        self.down = down  # KVCM keys per entry (1:n), else 1
        self.groups: dict[int, dict[int, int]] = {}
        self.extra: dict[tuple[int, int], tuple[int, ...]] = {}  # 1:n: the earlier keys
        self.evictions = 0
        self.n = 0
        self.epoch = 0  # stamped on every use
        self.since = 0  # new entries since the epoch advanced

    def get(self, g: int, key: int) -> int | None:
        t = self.groups.get(g)
        return None if t is None else t.get(key)

    def extras(self, g: int, key: int) -> tuple[int, ...]:
        return self.extra.get((g, key), ())

    def put(self, g: int, key: int, v: int, extras: tuple[int, ...] | None = None) -> None:
        """Set the entry, stamped with the current epoch (a use)."""
        t = self.groups.get(g)
        if t is None:
            t = self.groups[g] = {}
        new = key not in t
        t[key] = (v & ~_EPOCH) | self.epoch << _E_SHIFT
        if extras is not None:
            self.extra[(g, key)] = extras
        if new:
            self.n += 1
            self.since += 1
            if self.since >= _epoch_len(self.capacity):
                self.epoch = (self.epoch + 1) & 0xFF
                self.since = 0

    def keep(self, g: int, key: int, v: int) -> None:
        """Set an existing entry as it is (its epoch too: not a use)."""
        self.groups[g][key] = v

    def touch(self, g: int, key: int) -> None:
        t = self.groups[g]
        t[key] = (t[key] & ~_EPOCH) | self.epoch << _E_SHIFT

    def evict(self) -> None:
        """Beyond capacity: drop the entries whose block is not held, oldest epoch first,
        whole epochs, down to capacity - capacity / 16 (Table)."""
        if self.n <= self.capacity:
            return
        need = self.n - (self.capacity - _epoch_len(self.capacity))
        hist = [0] * 256
        ep = self.epoch
        for t in self.groups.values():
            for v in t.values():
                if not v & _HELD:
                    hist[(ep - (v >> _E_SHIFT)) & 0xFF] += 1
        cutoff, got = 0, 0
        for age in range(255, -1, -1):
            got += hist[age]
            if got >= need:
                cutoff = age
                break
        for g, t in self.groups.items():
            drop = [
                k for k, v in t.items() if not v & _HELD and (ep - (v >> _E_SHIFT)) & 0xFF >= cutoff
            ]
            for k in drop:
                del t[k]
                self.extra.pop((g, k), None)
            self.n -= len(drop)
            self.evictions += len(drop)

    def unhold(self) -> None:
        """Every entry to held 0 (a forget: which blocks the engine holds is unknown)."""
        for t in self.groups.values():
            for k, v in t.items():
                if v & _HELD:
                    t[k] = v & ~_HELD

    def clear(self) -> None:
        self.groups.clear()
        self.extra.clear()
        self.n = self.epoch = self.since = 0

    def export(self) -> tuple[bytes, bytes, bytes, bytes, bytes, int]:
        """(groups u1, keys <i8, states <i8, metas <u8, earlier keys <i8 (down - 1 per entry),
        the epoch << 32 | new entries since it advanced), as bytes."""
        gs: list[int] = []
        ks: list[int] = []
        vs: list[int] = []
        xs: list[int] = []
        for g, t in sorted(self.groups.items()):
            gs += [g] * len(t)
            ks += t.keys()
            vs += t.values()
            if self.down > 1:
                for k in t:
                    xs += self.extra.get((g, k), (0,) * (self.down - 1))
        return (
            np.array(gs, "u1").tobytes(),
            np.array(ks, "<i8").tobytes(),
            np.array([v & _M64 for v in vs], "<u8").tobytes(),
            np.array([v >> 64 for v in vs], "<u8").tobytes(),
            np.array(xs, "<i8").tobytes(),
            self.epoch << 32 | self.since,
        )

    def load(
        self, groups: bytes, keys: bytes, states: bytes, metas: bytes, extras: bytes, epoch: int
    ) -> None:
        """Replace the table with export()'s columns."""
        self.clear()
        d = self.down - 1
        xs = np.frombuffer(extras, "<i8").tolist()
        cols = (
            np.frombuffer(groups, "u1").tolist(),
            np.frombuffer(keys, "<i8").tolist(),
            np.frombuffer(states, "<u8").tolist(),
            np.frombuffer(metas, "<u8").tolist(),
        )
        for i, (g, k, s, m) in enumerate(zip(*cols, strict=True)):
            t = self.groups.get(g)
            if t is None:
                t = self.groups[g] = {}
            if k not in t:
                self.n += 1
            t[k] = s | m << 64
            if d:
                self.extra[(g, k)] = tuple(xs[i * d : (i + 1) * d])
        self.epoch, self.since = (epoch >> 32) & 0xFF, epoch & 0xFFFFFFFF


class Rekey:
    """Block events with engine keys -> the same events under KVCM's rolling keys.

    With the C extension built the table is _rekey.c's and the common events (a BlockRemoved; a
    BlockStored of full attention whose tokens are a list of ints, without LoRA or extra keys)
    are re-keyed there, a run of events per call; every other event comes back here, one at a
    time (_stored), in order. Both forms keep the same table and counts (a test holds them
    equal)."""

    def __init__(
        self,
        engine_block: int,
        kvcm_block: int,
        *,
        both: bool = False,
        capacity: int = 1 << 22,
        sglang: bool = False,
        lora_adapter: str = "",
    ) -> None:
        if max(engine_block, kvcm_block) % min(engine_block, kvcm_block):
            raise ValueError(f"block sizes {engine_block} and {kvcm_block}: not a whole ratio")
        if kvcm_block > PENDING_MAX:
            raise ValueError(f"KVCM block size {kvcm_block}: at most {PENDING_MAX} tokens")
        self.e, self.k = engine_block, kvcm_block
        self.step = min(engine_block, kvcm_block)  # the rolling pass reports every step tokens
        self.up = kvcm_block // self.step  # engine blocks per KVCM key (n:1), else 1
        self.down = engine_block // self.step  # KVCM keys per engine block (1:n), else 1
        self.both = both
        # SGLang (source.zmq.engine=sglang): its events carry no salt, but a salted chain's
        # first page is seeded with the salt, so a root page whose hash is not SGLang's
        # unsalted page hash is salted: its chain is not token-addressable.
        self.sglang = sglang
        # One LoRA adapter's KVCM instance: only that adapter's blocks, keyed by their tokens
        # (the instance separates them from the base model's). Empty: the base model's.
        self.lora_adapter = lora_adapter
        a = compiled.accel
        self.table: Table = (
            cast(Table, a.KeyTable(capacity, self.down))
            if a is not None and self.down <= C_DOWN_MAX
            else KeyTable(capacity, self.down)
        )
        # Blocks unkeyed per reason (REASONS' order), then blocks keyed: one array, so the C
        # fast path adds to the same counts as this code.
        self.counts = np.zeros(len(REASONS) + 1, np.int64)
        self.proven = ""  # a router scheme proven for the engine life the table was built in

    @property
    def unkeyed(self) -> Counter[str]:
        c = self.counts.tolist()
        return Counter({r: c[i] for i, r in enumerate(REASONS) if c[i]})

    @property
    def keyed(self) -> int:
        """Engine blocks reported under rolling keys."""
        return int(self.counts[_KEYED])

    def _count(self, reason: str, n: int) -> None:
        self.counts[REASONS.index(reason)] += n

    def status(self) -> dict[str, Any]:
        return {
            "engine_block_size": self.e,
            "kvcm_block_size": self.k,
            "key_table_entries": self.table.n,
            "key_table_evictions": self.table.evictions,
            "blocks_keyed": self.keyed,
            "blocks_unkeyed": dict(self.unkeyed),
            **({"lora_adapter": self.lora_adapter} if self.lora_adapter else {}),
        }

    # ---- the fold ---------------------------------------------------------------------------
    def apply(self, f: Folded, first: int, end: int, events: list[Any]) -> Blocks:
        """Events [first, end) of `f` (their event structs in `events`, by the same index)
        as KVCM-keyed block events, in order."""
        lo, hi = f.block(first), f.block(end)
        ek = f.blocks.keys[lo:hi]
        room = (hi - lo) * (self.down + self.both)  # keys per block at most
        keys = np.empty(room, np.int64)
        meds = np.empty(room, np.uint8)
        grps = np.empty(room, np.uint8)
        sgns = np.empty(room, np.int8)
        codes, counts = f.codes, f.counts
        # The C fast path keys every plain store: in an adapter's instance those are another
        # instance's blocks, so there every event goes through _stored (the one LoRA rule).
        fast = None if self.lora_adapter else getattr(self.table, "rekey", None)
        i, blk, m = first, 0, 0
        while i < end:
            if fast is not None:  # C: every event it can, up to the first it hands back
                i, blk, m = fast(
                    codes, counts, ek, events, i, end, blk, m, keys, meds, grps, sgns,
                    self.counts, self.e, self.k, self.both, self.sglang,
                )  # fmt: skip
                if i >= end:
                    break
            n = int(counts[i])
            if n:
                c = int(codes[i])
                group = (c >> 1) & 0x7F
                engine = ek[blk : blk + n].tolist()
                if c & 1:
                    got = self._stored(events[i], group, engine)
                    sign = 1
                else:
                    got = self._removed(group, engine)
                    sign = -1
                if self.both:
                    got = engine + got
                j = m + len(got)
                keys[m:j] = got
                meds[m:j] = c >> 8
                grps[m:j] = group
                sgns[m:j] = sign
                m = j
            blk += n
            i += 1
        if self.table.n > self.table.capacity:
            self.table.evict()
        return Blocks(keys[:m], meds[:m], grps[:m], sgns[:m])

    def _keys_of(self, g: int, key: int, v: int) -> list[int]:
        if v & _TAINT or (v >> _P_SHIFT) & _P_MASK:
            return []
        state = _unpack(v)[0]
        if self.down > 1:
            return [*self.table.extras(g, key), state]
        return [state]

    def _removed(self, g: int, engine: list[int]) -> list[int]:
        """The keys of the removed blocks' reported copies (a copy stored without a key, or
        before a forget, has none to remove)."""
        out: list[int] = []
        table = self.table
        for key in engine:
            v = table.get(g, key)
            if v is None or not v & _HELD:
                continue
            table.keep(g, key, v - _ONE)
            out += self._keys_of(g, key, v)
        return out

    def _known(self, g: int, key: int, v: int) -> list[int]:
        """A store of a block the table knows: one more reported copy, its keys (none if
        tainted); a use of the entry either way."""
        if v & _TAINT:
            self.table.put(g, key, v)
            self.counts[REASONS.index(TAINTED)] += 1
            return []
        if _held(v) < _HELD_MAX:
            v += _ONE
        self.table.put(g, key, v)
        self.counts[_KEYED] += 1
        return self._keys_of(g, key, v)

    def _taint(self, g: int, keys: list[int], reason: str) -> None:
        table = self.table
        for key in keys:
            old = table.get(g, key)
            if old is None or not old & _TAINT:
                table.put(g, key, _TAINT)
        self._count(reason, len(keys))

    def _stored(self, ev: Any, g: int, engine: list[int]) -> list[int]:
        table = self.table
        nb = len(engine)
        # A re-store of blocks already in the table: their keys, without reading the tokens.
        known = [table.get(g, k) for k in engine]
        if all(v is not None for v in known):
            out: list[int] = []
            for key in engine:
                v = table.get(g, key)
                assert v is not None
                out += self._known(g, key, v)
            return out
        name, lid = self._lora_of(ev)
        # By name whenever the event names its adapter (ids may be reassigned as adapters
        # load), by id only where no name is sent (older releases).
        if self.lora_adapter and self.lora_adapter != (name or lid or None):
            self._count(OTHER_INSTANCE, nb)  # no entries: nothing here may chain from them
            return []
        if not _full_attention(getattr(ev, "kv_cache_spec_kind", None)):
            self._count(GROUP, nb)
            return []
        try:
            traw = ev.token_ids
            tokens = [] if _is_nil(traw) else _TOKENS.decode(traw)
            praw = ev.parent_block_hash
            parent = None if _is_nil(praw) else _PARENT.decode(praw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._count(MALFORMED, nb)
            return []
        if not tokens:
            self._count(TOKENLESS, sum(1 for v in known if v is None))
            out = []
            for key in engine:
                v = table.get(g, key)
                if v is not None:
                    out += self._known(g, key, v)
            return out
        if (ev.block_size or self.e) != self.e or len(tokens) != nb * self.e:
            self._count(MALFORMED, nb)
            return []
        # Where the chain is known from: the parent (h = 0 without one), else the first block
        # the table knows; the blocks before it have no provable prefix. Never h = 0 there.
        out = []
        start, h = 0, 0
        if parent is None and self.sglang and not self._sglang_plain(engine[0], tokens):
            self._taint(g, engine, EXTRA_KEYS)  # a salted root (cache_salt): all of its chain
            return []
        if parent is not None:
            pkey = K.engine_key(parent)
            pv = table.get(g, pkey)
            if pv is not None:
                table.touch(g, pkey)
                if pv & _TAINT:
                    self._taint(g, engine, TAINTED)
                    return []
                h = _unpack(pv)[0]
            else:
                start = next((j for j, v in enumerate(known) if v is not None), nb)
                self._count(UNKNOWN_PARENT, start)
                if start == nb:
                    return []  # no entries: the descendants are not reported either
                v = table.get(g, engine[start])
                assert v is not None
                if v & _TAINT:
                    self._taint(g, engine[start:], TAINTED)
                    return []
                h = _unpack(v)[0]
                out += self._known(g, engine[start], v)
                start += 1
        if (name or lid) and not self.lora_adapter:
            self._taint(g, engine[start:], LORA)
            return out
        first_extra = self._first_extra(getattr(ev, "extra_keys", None), nb, name, lid)
        stop = max(first_extra, start)
        if start < stop:
            # the state after every step tokens, from the chain's known state
            states = K.roll(tokens[start * self.e : stop * self.e], self.step, h, 0)[2]
            base = self._pending_of(g, parent, engine, start)
            for j in range(start, stop):
                key = engine[j]
                old = table.get(g, key)
                if old is not None:
                    out += self._known(g, key, old)
                    continue
                i = j - start
                if self.down > 1:
                    mine = states[i * self.down : (i + 1) * self.down]
                    out += mine
                    table.put(g, key, (mine[-1] & _M64) | _ONE, tuple(mine[:-1]))
                else:
                    state = states[i]
                    pend = (base + (i + 1) * self.e) % self.k
                    if not pend:
                        out.append(state)
                    table.put(g, key, (state & _M64) | pend << _P_SHIFT | _ONE)
                self.counts[_KEYED] += 1
        if stop < nb:  # an extra key here (a salt, an image): tainted from here on
            self._taint(g, engine[stop:], EXTRA_KEYS)
        return out

    def _pending_of(self, g: int, parent: Any, engine: list[int], start: int) -> int:
        """Tokens since the last KVCM boundary where block `start` begins (n:1 only)."""
        if self.up == 1:
            return 0
        if start > 0:
            prev = self.table.get(g, engine[start - 1])
        elif parent is not None:
            prev = self.table.get(g, K.engine_key(parent))
        else:
            return 0
        return 0 if prev is None else _unpack(prev)[1]

    def _sglang_plain(self, h: int, tokens: list[int]) -> bool:
        """The root page's hash is SGLang's page hash of its tokens, unsalted."""
        d = K.sglang_page_digests(tokens[: self.e], self.e)[0]
        return K.engine_key(h) == K.sglang_key(d)

    @staticmethod
    def _lora_of(ev: Any) -> tuple[str, str]:
        """The event's adapter as (lora_name, lora_id) text, "" where absent ("?" unreadable:
        some adapter's, never the base model's). Releases before lora_name send only the id."""
        out = []
        for raw in (getattr(ev, "lora_name", None), ev.lora_id):
            v: Any = None
            if not _is_nil(raw):
                try:
                    v = _LORA.decode(_raw(raw))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    v = "?"
            out.append("" if v is None else str(v) or "?")  # an empty name is still a LoRA's
        return out[0], out[1]

    @staticmethod
    def _first_extra(raw: Any, nb: int, lora: str = "", lora_id: str = "") -> int:
        """Index of the first block with extra keys (nb: none); unreadable counts as extra.
        vLLM puts an adapter's name first in every block's extra keys: in the adapter's own
        instance that one is not an extra key."""
        if _is_nil(raw):
            return nb
        try:
            extra = _ANY.decode(_raw(raw))
        except msgspec.DecodeError:
            return 0
        if not isinstance(extra, list):
            return 0
        for j, e in enumerate(extra[:nb]):
            if (lora or lora_id) and isinstance(e, list) and e and e[0] in (lora, lora_id):
                e = e[1:]  # the adapter itself (its name; an id-only release's id)
            elif lora_id and isinstance(e, list) and e and str(e[0]) == lora_id:
                e = e[1:]
            if e is not None and e != [] and e != ():
                return j
        return nb

    # ---- lifecycle ----------------------------------------------------------------------------
    def forget(self) -> None:
        """The counts were emptied: no block is known held any more; the table stays."""
        self.table.unhold()

    def clear(self) -> None:
        """Another engine life whose hashing is not proven the same: nothing in the table holds."""
        self.table.clear()
        self.proven = ""


def fingerprint(engine: str, e: int, k: int, groups: Iterable[int], lora_adapter: str = "") -> str:
    """What a saved table must match to be loaded: engine, block sizes, groups, the adapter
    served (the scheme it proved is saved beside it)."""
    fp = f"{engine}|{e}|{k}|{','.join(map(str, sorted(groups)))}"
    return f"{fp}|lora={lora_adapter}" if lora_adapter else fp


# ---- the table in the checkpoint ----------------------------------------------------------------
class _TableFile(msgspec.Struct):
    version: int
    fingerprint: str  # engine | engine block size | KVCM block size | groups
    scheme: str  # the router scheme the key check proved ("" none): survives an engine restart
    down: int  # KVCM keys per entry (1:n), else 1
    epoch: int  # the table's epoch << 32 | new entries since it advanced
    groups: bytes  # u8 per entry
    keys: bytes  # <i8 per entry: the engine key
    states: bytes  # <i8 per entry: the rolling state
    metas: bytes  # <u8 per entry: held | tainted << 24 | pending << 32 | epoch << 56
    extras: bytes  # <i8, (down - 1) per entry: 1:n's earlier keys


# 2: columns of the C table's entries (with epochs); 1 (a dict per group, LRU order) is not read:
# its table is rebuilt from the live stream (unknown parents until then, never a wrong key).
_TABLE_VERSION = 2
_table_enc = msgspec.msgpack.Encoder()
_table_dec = msgspec.msgpack.Decoder(_TableFile)


def save_table(path: str, fp: str, scheme: str, rekey: Rekey) -> int:
    """Write the table beside the checkpoint, atomically; returns the bytes written."""
    import os
    import tempfile

    g, k, st, m, x, epoch = rekey.table.export()
    body = _table_enc.encode(
        _TableFile(_TABLE_VERSION, fp, scheme, rekey.table.down, epoch, g, k, st, m, x)
    )
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(body)


def load_table(path: str, fp: str, rekey: Rekey) -> str | None:
    """Load the table if the file is there and its fingerprint is `fp`: the scheme it proved
    ("" none); None if nothing was loaded (no file, another fingerprint, unreadable)."""
    try:
        with open(path, "rb") as f:
            data = _table_dec.decode(f.read())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if data.version != _TABLE_VERSION or data.fingerprint != fp:
        return None
    n = len(data.groups)
    d = rekey.table.down - 1
    if data.down != rekey.table.down or not (
        len(data.keys) == len(data.states) == len(data.metas) == 8 * n
        and len(data.extras) == 8 * n * d
    ):
        return None
    if any(g > 62 for g in data.groups):
        return None
    rekey.table.load(data.groups, data.keys, data.states, data.metas, data.extras, data.epoch)
    rekey.table.evict()  # a smaller capacity than the saved table's
    return data.scheme
