"""Key modes rolling / both (sidecar/source/rekey.py) and the key check (key_check.py), driven
through the real Stream and decoder: the manager's counts must hold exactly the rolling keys of
the token prefixes the engine holds that the sidecar can prove, computed here from the tokens."""

from __future__ import annotations

import hashlib
import itertools
import logging
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import keys as K
from sidecar.key_state import KeyState
from sidecar.source.block_counts import BlockCounts
from sidecar.source.key_check import KeyCheck
from sidecar.source.rekey import Rekey, load_table, save_table
from sidecar.source.zmq import Stream
from sidecar.source.zmq_events import EventDecoder

MI = {"GPU": 0, "CPU": 1}


class Rig:
    """A Stream in a rolling key mode, fed batches in seq order."""

    def __init__(
        self, e: int, k: int, *, both: bool = False, positional: bool = False, lora: str = ""
    ) -> None:
        self.e, self.k, self.positional, self.lora = e, k, positional, lora
        self.counts = BlockCounts(KeyState((0,)))
        self.s = Stream(
            EventDecoder(MI, e, 0, full=True),
            self.counts,
            dp_rank=0,
            can_replay=False,
            replay_timeout_s=2.0,
        )
        self.rekey = self.s.rekey = Rekey(e, k, both=both, lora_adapter=lora)
        self.s.key_check = KeyCheck(e, warn=False)
        self.seq = 0

    def send(self, events: list[Any]) -> None:
        self.s.on_live(self.seq, msgspec.msgpack.encode([1.0, events, 0]))
        self.seq += 1
        self.s.flush()

    def held(self) -> set[int]:
        return {k for (k, _m, _g) in self.counts.counts()}

    def stored(self, hashes: list[Any], tokens: Any, parent: Any = None, **kw: Any) -> Any:
        f = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.e,
            "lora_id": kw.get("lora_id"),
            "medium": kw.get("medium"),
            "lora_name": kw.get("lora_name"),
            "extra_keys": kw.get("extra_keys"),
            "group_idx": kw.get("group_idx"),
            "kv_cache_spec_kind": kw.get("kind"),
        }
        if self.positional:
            return ["BlockStored", *f.values()]
        return {"type": "BlockStored", **f}

    def removed(self, hashes: list[Any]) -> Any:
        if self.positional:
            return ["BlockRemoved", hashes, None, None]
        return {"type": "BlockRemoved", "block_hashes": hashes}


def h(*parts: Any) -> int:
    """An engine hash (a random-seeded engine's: nothing a router could recompute)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def test_rekey_reports_rolling_keys_and_removes_them() -> None:
    r = Rig(4, 4)
    toks = list(range(1, 13))
    a, b, c = h(1), h(2), h(3)
    r.send([r.stored([a, b], toks[:8])])
    r.send([r.stored([c], toks[8:], parent=b)])  # chains through the parent's state
    assert r.held() == set(K.rolling_keys(toks, 4))
    r.send([r.removed([c])])
    assert r.held() == set(K.rolling_keys(toks[:8], 4))
    r.send([r.stored([c], [])])  # a tokenless re-store of a hash the table knows
    assert r.held() == set(K.rolling_keys(toks, 4))
    assert r.rekey.unkeyed["tokenless"] == 0


def test_rekey_unknown_parent_is_not_reported_nor_its_descendants() -> None:
    r = Rig(4, 4)
    r.send([r.stored([h(2)], [5, 6, 7, 8], parent=h(1))])  # the parent was never seen
    r.send([r.stored([h(3)], [9, 9, 9, 9], parent=h(2))])
    assert r.held() == set()
    assert r.rekey.unkeyed["unknown_parent"] == 2
    assert r.rekey.table.n == 0


@pytest.mark.parametrize(("e", "k"), [(1, 4), (4, 1), (4, 16), (16, 4)])
def test_rekey_block_size_ratios(e: int, k: int) -> None:
    r = Rig(e, k)
    toks = list(range(100, 132))
    hs = [h("r", i) for i in range(32 // e)]
    half = len(hs) // 2
    r.send([r.stored(hs[:half], toks[: half * e])])
    r.send([r.stored(hs[half:], toks[half * e :], parent=hs[half - 1])])
    assert r.held() == set(K.rolling_keys(toks, k))
    r.send([r.removed([hs[-1]])])  # the last engine block: its keys (n:1: the last key) go
    assert r.held() == set(K.rolling_keys(toks[: 32 - e], k))


def test_rekey_taints_lora_extra_keys_salt_and_descendants() -> None:
    r = Rig(4, 4)
    r.send([r.stored([h("l")], [1, 2, 3, 4], lora_id=3)])
    r.send([r.stored([h("s1"), h("s2")], list(range(8)), extra_keys=[["salt"], None])])
    r.send([r.stored([h("s3")], [9, 9, 9, 9], parent=h("s2"))])  # salted chain: tainted
    r.send([r.stored([h("m1"), h("m2")], list(range(8)), extra_keys=[None, [["mm", 0, 4]]])])
    r.send([r.stored([h("w")], [1, 2, 3, 4], kind="sliding_window")])
    assert r.held() == set(K.rolling_keys(list(range(4)), 4))  # m1 only
    u = r.rekey.unkeyed
    assert (u["lora"], u["extra_keys"], u["tainted"], u["group"]) == (1, 3, 1, 1)


def test_rekey_lora_adapter_instance_reports_only_its_adapter_under_token_keys() -> None:
    toks = list(range(1, 13))

    def sql(r: Rig, hashes: list[int], tokens: list[int], parent: Any = None, **kw: Any) -> Any:
        # as vLLM 0.33 sends it: the name first in every block's extra keys
        extra = kw.pop("extra_keys", [["sql"]] * len(hashes))
        return r.stored(hashes, tokens, parent, lora_name="sql", lora_id=7, extra_keys=extra)

    r = Rig(4, 4, lora="sql")
    r.send([r.stored([h("b1"), h("b2")], toks[:8])])  # the base model's: another instance's
    r.send([sql(r, [h("a1"), h("a2")], toks[:8])])
    r.send([sql(r, [h("a3")], toks[8:], parent=h("a2"))])  # chains through the adapter's parent
    chat = r.stored([h("c1")], toks[:4], lora_name="chat", lora_id=8, extra_keys=[["chat"]])
    r.send([chat])
    salted = sql(r, [h("s1")], toks[:4], extra_keys=[["sql", "salt"]])
    r.send([salted, r.stored([h("s2")], toks[4:8], h("s1"), lora_name="sql")])
    assert r.held() == set(K.rolling_keys(toks, 4))  # the base model's keys, in their instance
    u = r.rekey.unkeyed
    assert (u["other_instance"], u["extra_keys"], u["tainted"], u["lora"]) == (3, 1, 1, 0)
    r.send([r.removed([h("a3"), h("b2")])])
    assert r.held() == set(K.rolling_keys(toks[:8], 4))
    assert r.rekey.status()["lora_adapter"] == "sql"

    by_id = Rig(4, 4, lora="7")  # a release that sends only lora_id
    by_id.send([by_id.stored([h("i1")], toks[:4], lora_id=7)])
    by_id.send([by_id.stored([h("i2")], toks[:4], lora_id=9)])
    assert by_id.held() == set(K.rolling_keys(toks[:4], 4))

    # an id-only release that puts the id first in the extra keys
    by_id.send([by_id.stored([h("i3")], toks[4:8], h("i1"), lora_id=7, extra_keys=[[7]])])
    assert by_id.held() == set(K.rolling_keys(toks[:8], 4))
    # an event that names its adapter is matched by name only: id 7 of another adapter, or
    # an adapter named "7" with another id, belong to the one the name says
    by_id.send([by_id.stored([h("o1")], toks[:4], lora_name="other", lora_id=7)])
    by_id.send([by_id.stored([h("n1")], toks[4:8], lora_name="7", lora_id=3)])
    assert by_id.rekey.unkeyed["other_instance"] == 2
    assert by_id.held() == set(K.rolling_keys(toks[:8], 4)) | {K.rolling_keys(toks[4:8], 4)[0]}

    base = Rig(4, 4)  # the base model's sidecar: the adapter's blocks are not reported there
    base.send([sql(base, [h("a1"), h("a2")], toks[:8])])
    base.send([base.stored([h("e1")], toks[:4], lora_name="")])  # named, if emptily: a LoRA's
    assert base.held() == set() and base.rekey.unkeyed["lora"] == 3


def test_lora_adapter_config_needs_rolling_and_vllm() -> None:
    from sidecar.config import ConfigError, load

    env = {
        "KV_CACHE_EVENT_SOURCE": "zmq",
        "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://*:5557",
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:6382",
        "KV_CACHE_EVENT_INSTANCE_ID": "m-sql",
        "KV_CACHE_EVENT_HOST_IP_PORT": "127.0.0.1:8000",
        "KV_CACHE_EVENT_ZMQ_LORA_ADAPTER": "sql",
    }
    with pytest.raises(ConfigError, match=r"source.zmq.lora_adapter 'sql' needs .*rolling"):
        load(env=env)
    env["KV_CACHE_EVENT_ZMQ_KEY_MODE"] = "rolling"
    for engine in ("sglang", "auto"):  # auto may find SGLang, whose events carry no LoRA
        with pytest.raises(ConfigError, match=r"lora_adapter 'sql' needs source.zmq.engine=vllm"):
            load(env={**env, "KV_CACHE_EVENT_ZMQ_ENGINE": engine})
    env["KV_CACHE_EVENT_ZMQ_ENGINE"] = "vllm"
    assert load(env=env).source.zmq.lora_adapter == "sql"


def test_rekey_malformed_is_counted_and_nothing_else_lost() -> None:
    r = Rig(4, 4, positional=True)
    good = r.stored([h("g")], [1, 2, 3, 4])
    r.send(
        [
            r.stored([h("x")], [1, 2, 3]),  # not blocks x block size tokens
            r.stored([h("y")], ["a", "b", "c", "d"]),  # not ints
            good,
            r.stored([h("z")], [1, 2, 3, 4], parent=h("other-group"), group_idx=1),
        ]
    )
    assert r.held() == set(K.rolling_keys([1, 2, 3, 4], 4))
    assert r.rekey.unkeyed["malformed"] == 2 and r.rekey.unkeyed["unknown_parent"] == 1


def test_rekey_both_reports_engine_and_rolling_keys() -> None:
    r = Rig(4, 4, both=True)
    r.send([r.stored([h("b")], [1, 2, 3, 4])])
    assert r.held() == {K.engine_key(h("b")), *K.rolling_keys([1, 2, 3, 4], 4)}


def test_rekey_two_engines_with_different_seeds_hold_the_same_keys() -> None:
    toks = list(range(40, 56))
    held = []
    for seed in ("a", "b"):
        r = Rig(4, 4)
        hs = [h(seed, i) for i in range(4)]
        r.send([r.stored(hs[:2], toks[:8]), r.stored(hs[2:], toks[8:], parent=hs[1])])
        held.append(r.held())
    assert held[0] == held[1] == set(K.rolling_keys(toks, 4))


def test_rekey_table_is_bounded_lru_and_spares_held_blocks() -> None:
    r = Rig(1, 1)
    r.rekey.table.capacity = 8
    ks = [h("c", i) for i in range(20)]
    r.send([r.stored([ks[0]], [7])])
    for i in range(1, 20):
        r.send([r.stored([ks[i]], [i])])
        r.send([r.removed([ks[i]])])  # not held: may go
    assert r.rekey.table.n <= 8 and r.rekey.table.evictions >= 12
    assert (
        r.rekey.table.get(0, K.engine_key(ks[0])) is not None
    )  # held: kept, so its removal finds its key
    r.send([r.removed([ks[0]])])
    assert r.held() == set()


def test_key_check_vllm_sha256_cbor_seed0_and_sglang_reproduce() -> None:
    toks = list(range(1, 17))
    vd = K.vllm_block_digests(toks, 4, seed="0")
    sd = K.sglang_page_digests(toks, 4)
    for hashes, scheme in (
        ([K.vllm_key(d) for d in vd], "vllm_sha256_cbor"),
        (vd, "vllm_sha256_cbor"),  # 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        ([K.sglang_key(d) for d in sd], "sglang_sha256"),
    ):
        kc = KeyCheck(4)
        r = Rig(4, 4)
        ev1 = r.stored(hashes[:2], toks[:8])
        ev2 = r.stored(hashes[2:], toks[8:], parent=hashes[1])
        kc.check_payload(msgspec.msgpack.encode([1.0, [ev1], 0]))
        kc.check_payload(msgspec.msgpack.encode([1.0, [ev2], 0]))  # parent from the table
        assert kc.result(scheme) == 1 and kc.checked[scheme] == 4, scheme
        other = "sglang_sha256" if scheme != "sglang_sha256" else "vllm_sha256_cbor"
        assert kc.result(other) == 0


def test_key_check_warns_once_naming_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    r = Rig(4, 4)
    kc = KeyCheck(4, warn=True)
    caplog.set_level(logging.WARNING)
    pickled = K.vllm_block_digests(
        [1, 2, 3, 4], 4, hash_fn=K.vllm_sha256_pickle, seed=K.VLLM_DEFAULT_SEED
    )
    for _ in range(3):
        kc.check_payload(msgspec.msgpack.encode([1.0, [r.stored(pickled, [1, 2, 3, 4])], 0]))
    assert kc.status()["vllm_sha256_cbor"] == 0 and kc.none_reproduce()
    warned = [x for x in caplog.records if "key check" in x.getMessage()]
    assert len(warned) == 1
    assert "rolling" in warned[0].getMessage() and "sha256_cbor" in warned[0].getMessage()


def test_key_check_samples_cheaply_after_the_warm_up() -> None:
    kc = KeyCheck(4)
    ev = Rig(4, 4).stored([h(1)], [1, 2, 3, 4])
    p = msgspec.msgpack.encode([1.0, [ev], 0])
    sampled = sum(kc.offer(p) for _ in range(50_000))
    assert sampled == 8 + (50_000 - 8) // 2048


# ---- the model -----------------------------------------------------------------------------------
# A store: (document, first block, last block + 1, events it is split into, flag); documents
# share prefixes (a two-token alphabet); flags taint: lora on every block, salt on the first
# block of a chain only (its descendants inherit the taint), extra keys on one block.
STORE = st.tuples(
    st.integers(0, 3),
    st.sampled_from([0, 0, 0, 1, 2, 3, 4]),
    st.integers(1, 5),
    st.integers(1, 3),
    st.sampled_from([None] * 6 + ["lora", "salt", "extra"]),
)
OP = st.one_of(
    st.tuples(st.just("store"), STORE),
    st.tuples(st.just("store"), STORE),
    st.tuples(st.just("dup"), STORE),
    st.tuples(st.just("remove"), st.tuples(st.integers(0, 3), st.integers(0, 6))),
    st.tuples(st.just("restart"), st.booleans()),
)


class Model:
    """The engine (copies per block) and what a sidecar can prove, from the tokens."""

    def __init__(self, docs: list[list[int]], e: int, k: int) -> None:
        self.docs, self.e, self.k = docs, e, k
        self.copies: dict[Any, int] = {}  # block id -> copies the engine holds
        self.reported: dict[Any, int] = {}  # block id -> copies stored under a key
        self.known: set[Any] = set()  # blocks whose key the sidecar can prove
        self.serves = ""  # the namespace whose instance this sidecar reports ("lora": adapter)

    def bid(self, doc: int, i: int, ns: str) -> tuple[str, tuple[int, ...]]:
        return (ns, tuple(self.docs[doc][: (i + 1) * self.e]))

    def keys(self, b: Any) -> list[int]:
        prefix = list(b[1])
        ks = K.rolling_keys(prefix, self.k)
        if self.k <= self.e:
            return ks[-(self.e // self.k) :]
        return ks[-1:] if len(prefix) % self.k == 0 else []

    def expected(self) -> set[int]:
        return {k for b, n in self.reported.items() if n > 0 for k in self.keys(b)}

    def truth(self) -> set[int]:
        """The rolling keys of every untainted prefix the engine holds (nothing wrong may show)."""
        return {
            k for b, n in self.copies.items() if n > 0 and b[0] == self.serves for k in self.keys(b)
        }


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    ratio=st.sampled_from([(4, 4), (1, 4), (4, 1), (2, 8), (8, 2)]),
    ops=st.lists(OP, min_size=6, max_size=30),
    positional=st.booleans(),
    adapter=st.sampled_from(["", "", "adapter"]),
)
def test_rekey_manager_holds_exactly_the_provable_rolling_keys(
    data: st.DataObject, ratio: tuple[int, int], ops: list[Any], positional: bool, adapter: str
) -> None:
    """The base model's sidecar, or (adapter) the sidecar of the LoRA adapter's own instance."""
    e, k = ratio
    docs = [
        data.draw(st.lists(st.integers(1, 2), min_size=7 * e, max_size=7 * e)) for _ in range(4)
    ]
    m = Model(docs, e, k)
    m.serves = "lora" if adapter else ""
    r = Rig(e, k, positional=positional, lora=adapter)
    for op, arg in ops:
        if op == "restart":
            r, m = _restart(r, m, with_checkpoint=arg)
            continue
        if op == "remove":
            doc, i = arg
            b = m.bid(doc, i, "")
            if m.copies.get(b, 0) <= 0:
                continue
            m.copies[b] -= 1
            if m.reported.get(b, 0) > 0:
                m.reported[b] -= 1
            r.send([r.removed([h(b)])])
            continue
        doc, first, n, splits, flag = arg
        last = min(first + n, 7)
        ns = flag or ""
        blocks = [m.bid(doc, i, ns) for i in range(first, last)]
        parent = h(m.bid(doc, first - 1, ns)) if first else None
        events = []
        bounds = sorted({0, len(blocks), *[(len(blocks) * j) // splits for j in range(splits)]})
        # the sidecar's view, as the rules say: a chain is known from a root or a known parent
        chain = first == 0 or m.bid(doc, first - 1, ns) in m.known
        for lo, hi in itertools.pairwise(bounds):
            part = blocks[lo:hi]
            toks = docs[doc][(first + lo) * e : (first + hi) * e]
            kw: dict[str, Any] = {}
            if flag == "lora":  # vLLM 0.33: the name, and first in every block's extra keys
                kw["lora_name"] = "adapter"
                kw["extra_keys"] = [["adapter"]] * len(part)
            elif flag == "salt" and first + lo == 0:
                kw["extra_keys"] = [["salt"]] + [None] * (len(part) - 1)
            elif flag == "extra":
                kw["extra_keys"] = [[["mm", 1]]] * len(part)
            events.append(r.stored([h(b) for b in part], toks, parent=parent, **kw))
            parent = h(part[-1])
            for b in part:
                m.copies[b] = m.copies.get(b, 0) + 1
                if ns == m.serves and (chain or b in m.known):
                    m.known.add(b)
                    m.reported[b] = m.reported.get(b, 0) + 1
                    chain = True
                elif b not in m.known:
                    chain = False
        r.send(events)
        if op == "dup":  # the same blocks stored again (another physical copy)
            for ev in events:
                r.send([ev])
            for b in blocks:
                m.copies[b] += 1
                if b in m.known:
                    m.reported[b] = m.reported.get(b, 0) + 1
        got = r.held()
        assert got == m.expected(), (op, arg)
        assert got <= m.truth()  # never a wrong key


def _restart(r: Rig, m: Model, *, with_checkpoint: bool) -> tuple[Rig, Model]:
    """A sidecar restart: a new Stream, with the counts and the key table loaded (as the
    checkpoint does) or from nothing (a late join: every held block is unprovable)."""
    r2 = Rig(r.e, r.k, positional=r.positional, lora=r.lora)
    if with_checkpoint:
        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "t.keys")
            save_table(path, "fp", "", r.rekey)
            assert load_table(path, "fp", r2.rekey) == ""
        for medium, group, keys, counts in r.counts.arrays():
            r2.counts.load(medium, group, keys, counts)
        return r2, m
    m2 = Model(m.docs, m.e, m.k)
    m2.copies, m2.serves = dict(m.copies), m.serves
    return r2, m2


def test_rekey_block_sizes_without_a_whole_ratio_are_a_config_error_naming_both() -> None:
    from sidecar.config import ConfigError, load

    env = {
        "KV_CACHE_EVENT_SOURCE": "zmq",
        "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://*:5557",
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:6382",
        "KV_CACHE_EVENT_INSTANCE_ID": "m",
        "KV_CACHE_EVENT_HOST_IP_PORT": "127.0.0.1:8000",
        "KV_CACHE_EVENT_ZMQ_KEY_MODE": "Rolling",
        "KV_CACHE_EVENT_ZMQ_BLOCK_SIZE": "16",
        "KV_CACHE_EVENT_KVCM_BLOCK_SIZE": "24",
    }
    with pytest.raises(ConfigError, match=r"kvcm_block_size 24 .* block size 16"):
        load(env=env)  # the CLI prints it and exits 2 before any socket
    cfg = load(env={**env, "KV_CACHE_EVENT_KVCM_BLOCK_SIZE": "64"})
    assert cfg.source.zmq.key_mode == "rolling" and cfg.source.zmq.kvcm_block_tokens == 64
    cfg = load(env={**env, "KV_CACHE_EVENT_KVCM_BLOCK_SIZE": "0"})
    assert cfg.source.zmq.kvcm_block_tokens == 16  # defaults to the engine's
    with pytest.raises(ConfigError, match=r"kvcm_block_size 16777216 must be at most"):
        load(env={**env, "KV_CACHE_EVENT_KVCM_BLOCK_SIZE": str(1 << 24)})  # an entry's pending


def test_rekey_one_to_many_beyond_the_c_table_uses_the_python_form() -> None:
    from sidecar.source.rekey import C_DOWN_MAX, KeyTable

    r = Rig(2 * C_DOWN_MAX, 1)  # 128 KVCM keys per engine block
    assert isinstance(r.rekey.table, KeyTable)
    toks = list(range(2 * C_DOWN_MAX))
    r.send([r.stored([h("big")], toks)])
    assert r.held() == set(K.rolling_keys(toks, 1))


def test_engine_hash_emulator_hashes_as_vllm_and_sglang_do() -> None:
    from sidecar.testbed import zmq_publisher
    from sidecar.testbed.engine_hash import ENGINE_HASHES, EngineHasher

    assert ENGINE_HASHES == zmq_publisher.ENGINE_HASHES
    v = EngineHasher("sha256_cbor_seed0")
    first = v.hashes(list(range(1, 5)), 4)
    assert first == [2164874634404590027]
    assert v.hashes([5, 6, 7, 8], 4, parent=first[0]) == [17270480062156288726]
    s = EngineHasher("sha256_cbor_seed0", flavour="sglang")
    assert [K.engine_key(x) for x in s.hashes(list(range(1, 9)), 4)] == [
        -3488128144981237669,
        5674439469042975057,
    ]
    a, b = EngineHasher("random_seed"), EngineHasher("random_seed")
    assert a.hashes([1, 2, 3, 4], 4) != b.hashes([1, 2, 3, 4], 4)
    d = EngineHasher("vllm_default")
    assert d.hashes([1, 2, 3, 4], 4) != first  # sha256 over pickle: no router reproduces it


def test_status_command_shows_key_mode_check_and_table() -> None:
    from sidecar.status import render

    text = render(
        {
            "state": "READY",
            "key_mode": "rolling",
            "key_check": {"vllm_sha256_cbor": 0, "sglang_sha256": None},
            "rekey": {
                "key_table_entries": 12,
                "key_table_evictions": 3,
                "blocks_unkeyed": {"unknown_parent": 2},
            },
        }
    )
    assert "key_mode" in text and "rolling" in text
    assert "vllm_sha256_cbor=0, sglang_sha256=-" in text
    assert "key_table_entries" in text and "12" in text and "unknown_parent" in text


def test_rekey_sglang_salted_root_taints_its_chain() -> None:
    import hashlib as hl

    r = Rig(4, 4)
    r.rekey.sglang = True
    plain = K.sglang_page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)
    # SGLang 0.5.23 seeds a salted chain's first page with sha256("sglang-cache-salt-v1\0" + salt)
    seed = hl.sha256(b"sglang-cache-salt-v1\0tenant-a").digest()
    salted = K.sglang_page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, prev=seed)
    u64 = (1 << 64) - 1
    r.send([r.stored([K.sglang_key(d) & u64 for d in plain], [1, 2, 3, 4, 5, 6, 7, 8])])
    r.send([r.stored([K.sglang_key(d) & u64 for d in salted], [1, 2, 3, 4, 5, 6, 7, 8])])
    r.send([r.stored([h("after-salt")], [9, 9, 9, 9], parent=K.sglang_key(salted[1]) & u64)])
    assert r.held() == set(K.rolling_keys([1, 2, 3, 4, 5, 6, 7, 8], 4))  # the unsalted chain
    assert r.rekey.unkeyed["extra_keys"] == 2 and r.rekey.unkeyed["tainted"] == 1


@pytest.mark.parametrize("seeded", [True, False])
def test_rekey_engine_restart_drops_the_table_unless_a_seeded_scheme_was_proven(
    seeded: bool,
) -> None:
    r = Rig(4, 4)
    toks = list(range(1, 9))
    if seeded:  # vLLM sha256_cbor with PYTHONHASHSEED=0: the key check proves it
        hs: list[Any] = [K.vllm_key(d) for d in K.vllm_block_digests(toks, 4, seed="0")]
    else:
        hs = [h("x", 1), h("x", 2)]
    r.send([r.stored(hs, toks)])
    assert r.s.key_check is not None
    assert r.s.key_check.result("vllm_sha256_cbor") == int(seeded)
    r.seq = 0  # the engine restarted: its seq starts again
    r.send([r.stored([h("z")], [6, 6, 6, 6])])
    assert r.s.restarts == 1
    assert (r.rekey.table.get(0, K.engine_key(hs[0])) is not None) is seeded
