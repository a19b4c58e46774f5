"""Re-keying for key modes `rolling` and `both`: engine block hashes -> KVCM's rolling keys.

Imports: stdlib, numpy, msgspec, sidecar.keys, source.zmq_events. A key is the full rolling
state, so the table maps (group, engine key) to (state, tokens since the last KVCM boundary)
and stores no tokens. Rules (issue #22 §1): a chain continues from its parent's state (no
parent: h = 0) and never restarts from 0 for a parent it does not know; what cannot be proven
is not reported, and counted; taints (extra keys, LoRA) pass to descendants; an entry outlives
its block (content, not residency) and is evicted LRU, never while its block is held. Bad input
is counted, never raised.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from sidecar import keys as K
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
# An entry, packed in one int: state (64 bits, unsigned view) | pending << 64 | flags << 96 |
# held << 104. flags: bit 0 tainted. held: copies of the block the engine holds (saturates).
_P_SHIFT, _F_SHIFT, _H_SHIFT = 64, 96, 104
_P_MASK = (1 << 32) - 1
_TAINT = 1
_HELD_MAX = (1 << 24) - 1


def _pack(state: int, pending: int, flags: int, held: int) -> int:
    return (
        (state & _M64) | pending << _P_SHIFT | flags << _F_SHIFT | min(held, _HELD_MAX) << _H_SHIFT
    )


def _unpack(v: int) -> tuple[int, int, int, int]:
    s = v & _M64
    return (
        s - (1 << 64) if s >> 63 else s,
        (v >> _P_SHIFT) & _P_MASK,
        (v >> _F_SHIFT) & 0xFF,
        v >> _H_SHIFT,
    )


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


class KeyTable:
    """(group, engine key) -> packed entry, LRU (dict order: the oldest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.groups: dict[int, dict[int, int]] = {}
        self.extra: dict[tuple[int, int], tuple[int, ...]] = {}  # 1:n: the earlier keys
        self.evictions = 0
        self.n = 0

    def group(self, g: int) -> dict[int, int]:
        t = self.groups.get(g)
        if t is None:
            t = self.groups[g] = {}
        return t

    def get(self, g: int, key: int) -> int | None:
        t = self.groups.get(g)
        return None if t is None else t.get(key)

    def put(self, g: int, key: int, v: int) -> None:
        t = self.group(g)
        if t.pop(key, None) is None:
            self.n += 1
        t[key] = v  # to the end: the most recent

    def touch(self, g: int, key: int) -> None:
        t = self.groups[g]
        t[key] = t.pop(key)

    def evict(self) -> None:
        """Drop the least recently used entries beyond capacity; held ones go to the end
        (a held block's removal must find its keys)."""
        tries = 0
        while self.n > self.capacity and tries < 4 * (self.n - self.capacity) + 64:
            tries += 1
            g = min(self.groups, key=lambda x: -len(self.groups[x]))
            t = self.groups[g]
            key = next(iter(t))
            v = t.pop(key)
            if v >> _H_SHIFT:
                t[key] = v
                continue
            self.n -= 1
            self.evictions += 1
            self.extra.pop((g, key), None)

    def unhold(self) -> None:
        """Every entry to held 0 (a forget: which blocks the engine holds is unknown)."""
        mask = (1 << _H_SHIFT) - 1
        for t in self.groups.values():
            for k, v in t.items():
                if v >> _H_SHIFT:
                    t[k] = v & mask

    def clear(self) -> None:
        self.groups.clear()
        self.extra.clear()
        self.n = 0

    def arrays(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(group, keys, packed entries as 2 uint64 words) per group, in LRU order."""
        out = []
        for g, t in sorted(self.groups.items()):
            ks = np.fromiter(t.keys(), np.int64, len(t))
            vals = list(t.values())
            lo = np.fromiter((v & _M64 for v in vals), np.uint64, len(vals))
            hi = np.fromiter((v >> 64 for v in vals), np.uint64, len(vals))
            out.append((g, ks, np.stack([lo, hi], 1) if len(vals) else np.zeros((0, 2), np.uint64)))
        return out

    def load(self, g: int, keys: np.ndarray, words: np.ndarray) -> None:
        t = self.group(g)
        for k, lo, hi in zip(
            keys.tolist(), words[:, 0].tolist(), words[:, 1].tolist(), strict=True
        ):
            if k not in t:
                self.n += 1
            t[k] = lo | hi << 64


class Rekey:
    """Block events with engine keys -> the same events under KVCM's rolling keys."""

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
        self.table = KeyTable(capacity)
        self.unkeyed: Counter[str] = Counter()
        self.keyed = 0  # engine blocks reported under rolling keys
        self.proven = ""  # a router scheme proven for the engine life the table was built in

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
        keys: list[int] = []
        meds: list[int] = []
        grps: list[int] = []
        sgns: list[int] = []
        counts = f.counts.tolist()
        codes = f.codes.tolist()
        lo = f.block(first)
        ek = f.blocks.keys[lo : f.block(end)].tolist()
        bad = set(f.bad)
        at = 0
        both = self.both
        for i in range(first, end):
            n = counts[i]
            if not n or i in bad:
                at += n
                continue
            c = codes[i]
            group = (c >> 1) & 0x7F
            engine = ek[at : at + n]
            at += n
            if c & 1:
                got = self._stored(events[i], group, engine)
                sign = 1
            else:
                got = self._removed(group, engine)
                sign = -1
            if both:
                got = engine + got
            m = len(got)
            if m:
                keys += got
                meds += [c >> 8] * m
                grps += [group] * m
                sgns += [sign] * m
        if self.table.n > self.table.capacity:
            self.table.evict()
        return Blocks(
            np.array(keys, np.int64),
            np.array(meds, np.uint8),
            np.array(grps, np.uint8),
            np.array(sgns, np.int8),
        )

    def _keys_of(self, g: int, key: int, v: int) -> list[int]:
        state, pending, flags, _held = _unpack(v)
        if flags & _TAINT or pending:
            return []
        if self.down > 1:
            return [*self.table.extra.get((g, key), ()), state]
        return [state]

    def _removed(self, g: int, engine: list[int]) -> list[int]:
        """The keys of the removed blocks' reported copies (a copy stored without a key, or
        before a forget, has none to remove)."""
        out: list[int] = []
        t = self.table.groups.get(g)
        if t is None:
            return out
        for key in engine:
            v = t.get(key)
            if v is None or not v >> _H_SHIFT:
                continue
            t[key] = v - (1 << _H_SHIFT)
            out += self._keys_of(g, key, v)
        return out

    def _hold(self, g: int, key: int, v: int) -> int:
        """One more reported copy of the block (entry `v`), now the most recent entry."""
        if (v >> _H_SHIFT) < _HELD_MAX:
            v += 1 << _H_SHIFT
        self.table.put(g, key, v)
        return v

    def _known(self, g: int, key: int, v: int) -> list[int]:
        """A store of a block the table knows: its keys (none if tainted)."""
        if v & (_TAINT << _F_SHIFT):
            self.table.put(g, key, v)
            self.unkeyed[TAINTED] += 1
            return []
        v = self._hold(g, key, v)
        self.keyed += 1
        return self._keys_of(g, key, v)

    def _taint(self, g: int, keys: list[int], reason: str) -> None:
        t = self.table.groups[g]
        for key in keys:
            old = t.get(key)
            if old is None or not old & (_TAINT << _F_SHIFT):
                self.table.put(g, key, _pack(0, 0, _TAINT, 0))
        self.unkeyed[reason] += len(keys)

    def _stored(self, ev: Any, g: int, engine: list[int]) -> list[int]:
        table = self.table
        t = table.group(g)
        nb = len(engine)
        # A re-store of blocks already in the table: their keys, without reading the tokens.
        if engine[0] in t and all(k in t for k in engine):
            out: list[int] = []
            for key in engine:
                out += self._known(g, key, t[key])
            return out
        name, lid = self._lora_of(ev)
        if self.lora_adapter and self.lora_adapter not in (name or None, lid or None):
            self.unkeyed[OTHER_INSTANCE] += nb  # no entries: nothing here may chain from them
            return []
        if not _full_attention(getattr(ev, "kv_cache_spec_kind", None)):
            self.unkeyed[GROUP] += nb
            return []
        try:
            traw = ev.token_ids
            tokens = [] if _is_nil(traw) else _TOKENS.decode(traw)
            praw = ev.parent_block_hash
            parent = None if _is_nil(praw) else _PARENT.decode(praw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.unkeyed[MALFORMED] += nb
            return []
        if not tokens:
            self.unkeyed[TOKENLESS] += sum(1 for k in engine if k not in t)
            return [x for k in engine if k in t for x in self._known(g, k, t[k])]
        if (ev.block_size or self.e) != self.e or len(tokens) != nb * self.e:
            self.unkeyed[MALFORMED] += nb
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
            pv = t.get(pkey)
            if pv is not None:
                table.touch(g, pkey)
                if pv & (_TAINT << _F_SHIFT):
                    self._taint(g, engine, TAINTED)
                    return []
                h = _unpack(pv)[0]
            else:
                start = next((j for j, k in enumerate(engine) if k in t), nb)
                self.unkeyed[UNKNOWN_PARENT] += start
                if start == nb:
                    return []  # no entries: the descendants are not reported either
                v = t[engine[start]]
                if v & (_TAINT << _F_SHIFT):
                    self._taint(g, engine[start:], TAINTED)
                    return []
                h = _unpack(v)[0]
                out += self._known(g, engine[start], v)
                start += 1
        if (name or lid) and not self.lora_adapter:
            self._taint(g, engine[start:], LORA)
            return out
        first_extra = self._first_extra(getattr(ev, "extra_keys", None), nb, name)
        stop = max(first_extra, start)
        if start < stop:
            # the state after every step tokens, from the chain's known state
            states = K.roll(tokens[start * self.e : stop * self.e], self.step, h, 0)[2]
            base = self._pending_of(g, parent, engine, start)
            one = 1 << _H_SHIFT  # a new entry: one reported copy
            for j in range(start, stop):
                key = engine[j]
                old = t.get(key)
                if old is not None:
                    out += self._known(g, key, old)
                    continue
                i = j - start
                if self.down > 1:
                    mine = states[i * self.down : (i + 1) * self.down]
                    table.extra[(g, key)] = tuple(mine[:-1])
                    out += mine
                    t[key] = (mine[-1] & _M64) | one
                else:
                    state = states[i]
                    pend = (base + (i + 1) * self.e) % self.k
                    if not pend:
                        out.append(state)
                    t[key] = (state & _M64) | pend << _P_SHIFT | one
                table.n += 1
                self.keyed += 1
        if stop < nb:  # an extra key here (a salt, an image): tainted from here on
            self._taint(g, engine[stop:], EXTRA_KEYS)
        return out

    def _pending_of(self, g: int, parent: Any, engine: list[int], start: int) -> int:
        """Tokens since the last KVCM boundary where block `start` begins (n:1 only)."""
        if self.up == 1:
            return 0
        if start > 0:
            prev = self.table.groups[g].get(engine[start - 1])
        elif parent is not None:
            prev = self.table.groups[g].get(K.engine_key(parent))
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
            out.append("" if v is None else str(v))
        return out[0], out[1]

    @staticmethod
    def _first_extra(raw: Any, nb: int, lora: str = "") -> int:
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
            if lora and isinstance(e, list) and e and e[0] == lora:
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
    groups: list[tuple[int, bytes, bytes]]  # (group, keys <i8, entries 2 x <u8 per key)
    extra: list[tuple[int, int, list[int]]]  # 1:n: (group, key, the earlier keys)


_TABLE_VERSION = 1
_table_enc = msgspec.msgpack.Encoder()
_table_dec = msgspec.msgpack.Decoder(_TableFile)


def save_table(path: str, fp: str, scheme: str, rekey: Rekey) -> int:
    """Write the table beside the checkpoint, atomically; returns the bytes written."""
    import os
    import tempfile

    t = rekey.table
    body = _table_enc.encode(
        _TableFile(
            _TABLE_VERSION,
            fp,
            scheme,
            [(g, k.astype("<i8").tobytes(), w.astype("<u8").tobytes()) for g, k, w in t.arrays()],
            [(g, k, list(v)) for (g, k), v in t.extra.items()],
        )
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
    for _g, kb, wb in data.groups:
        if len(kb) * 2 != len(wb) or len(kb) % 8:
            return None
    rekey.table.clear()
    for g, kb, wb in data.groups:
        keys = np.frombuffer(kb, "<i8").astype(np.int64)
        words = np.frombuffer(wb, "<u8").astype(np.uint64).reshape(-1, 2)
        rekey.table.load(g, keys, words)
    for g, k, v in data.extra:
        rekey.table.extra[(g, k)] = tuple(v)
    return data.scheme
