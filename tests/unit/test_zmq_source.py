"""ZMQ source: decode + count fold == a reference count model; decode never raises; the seq,
replay and forget rules of `Stream`, driven directly (no sockets, an injected clock)."""

from __future__ import annotations

import asyncio
import itertools
import socket
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config import Config, IdentityConfig, SourceConfig, ZmqConfig
from sidecar.key_state import KeyState
from sidecar.source import checkpoint as ckpt
from sidecar.source.block_counts import BlockCounts
from sidecar.source.hash_arrays import fold_hashes
from sidecar.source.zmq import DRAIN_BATCHES, Basis, Stream, ZmqSource
from sidecar.source.zmq_events import EventDecoder

MEDIUM_INDEX = {"GPU": 0, "CPU": 1, "DISK": 2}
M64 = (1 << 64) - 1


def signed(v: int) -> int:
    v &= M64
    return v - (1 << 64) if v >= 1 << 63 else v


def key_of(h: int | bytes) -> int:
    return signed(int.from_bytes(h, "big") if isinstance(h, bytes) else h)


# One op: (kind, hash pool index, medium, group, block_size). Few distinct hashes: many repeats.
HASHES = st.sampled_from(
    [0, 1, 2**63, M64, 2**63 - 1, 12345]
    + [bytes([i]) * 32 for i in range(3)]
    + [b"\x01" * 16]  # not 32 bytes: folded one by one
)
OP = st.tuples(
    st.sampled_from(["s", "s", "s", "r", "r", "c"]),
    st.lists(HASHES, min_size=1, max_size=4),
    st.sampled_from([None, "GPU", "CPU", "DISK", "TAPE"]),
    st.sampled_from([None, 0, 1]),
    st.sampled_from([16, 16, 16, 32]),
)
OPS = st.lists(OP, max_size=60)


def event(op: tuple[str, list[Any], str | None, int | None, int], positional: bool) -> Any:
    kind, hashes, medium, group, bs = op
    if kind == "c":
        return ["AllBlocksCleared"] if positional else {"type": "AllBlocksCleared"}
    if kind == "s":
        fields = {
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": list(range(bs)),
            "block_size": bs,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": None,
            "group_idx": group,
        }
        name = "BlockStored"
    else:
        fields = {"block_hashes": hashes, "medium": medium, "group_idx": group}
        name = "BlockRemoved"
    if positional:
        return [name, *fields.values()]
    return {"type": name, **fields, "a_field_from_the_future": [1, 2]}


def reference(ops: list[Any]) -> dict[tuple[int, int, int], int]:
    """Counts per (key, medium, group): +1 per stored hash, -1 per removed (never below 0)."""
    c: dict[tuple[int, int, int], int] = {}
    for kind, hashes, medium, group, bs in ops:
        if kind == "c":
            c.clear()
            continue
        mi = MEDIUM_INDEX.get(medium or "GPU")
        if mi is None or (kind == "s" and bs != 16):
            continue
        for h in hashes:
            t = (key_of(h), mi, group or 0)
            n = c.get(t, 0) + (1 if kind == "s" else -1)
            if n > 0:
                c[t] = n
            else:
                c.pop(t, None)
    return c


def stream(keys: KeyState | None = None, clock: Any = None) -> Stream:
    ks = keys or KeyState((0,))
    kw = {"clock": clock} if clock is not None else {}
    return Stream(
        EventDecoder(MEDIUM_INDEX, 16, 0),
        BlockCounts(ks),
        dp_rank=0,
        can_replay=True,
        replay_timeout_s=2.0,
        **kw,
    )


def payload(events: list[Any], dp_rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([1.0, events, dp_rank])


@settings(max_examples=300, deadline=None)
@given(ops=OPS, cuts=st.lists(st.integers(0, 60), max_size=8), positional=st.booleans())
def test_zmq_decode_and_fold_equals_reference_count_model(
    ops: list[Any], cuts: list[int], positional: bool
) -> None:
    ks = KeyState((0,))
    s = stream(ks)
    bounds = sorted({0, len(ops), *[min(c, len(ops)) for c in cuts]})
    for seq, (a, b) in enumerate(itertools.pairwise(bounds)):
        s.on_live(seq, payload([event(op, positional) for op in ops[a:b]]))
        if seq % 2:
            s.flush()  # folds of one batch and of several batches at once agree
    s.flush()
    want = reference(ops)
    assert s.counts.counts() == want
    assert s.counts.held() == len(want)  # kept as counts flip, not recounted
    held = {(k, m) for (k, m, g) in want if g == 0}
    published = {(k, m) for m in range(3) for k in ks.published_keys(m).tolist()}
    assert published == held


@settings(max_examples=500)
@given(data=st.binary(max_size=200))
def test_zmq_decode_never_raises_on_random_bytes(data: bytes) -> None:
    d = EventDecoder(MEDIUM_INDEX, 16).decode(data)
    assert d.ok or d.error


MSGPACKABLE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), M64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=500)
@given(obj=MSGPACKABLE)
def test_zmq_decode_never_raises_on_random_msgpack(obj: Any) -> None:
    d = EventDecoder(MEDIUM_INDEX, 16).decode(msgspec.msgpack.encode(obj))
    assert d.ok or d.error


@given(hashes=st.lists(st.integers(-(2**63), M64) | st.binary(max_size=40), max_size=20))
def test_zmq_fold_hashes_keeps_the_low_64_bits(hashes: list[int | bytes]) -> None:
    assert fold_hashes(hashes).tolist() == [key_of(h) for h in hashes]


def stored(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(hashes), "block_size": 16, "medium": medium}


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes)}


def replaying(s: Stream) -> bool:
    """Read through a call: mypy would keep `s.replay` narrowed across the calls between."""
    return s.replay is not None


def pending(s: Stream) -> object:
    """Read through a call, as replaying()."""
    return s.basis


def published(s: Stream) -> set[int]:
    s.flush()
    return set(s.counts.keys.published_keys().tolist())


def test_zmq_stream_duplicate_stores_hold_until_every_copy_is_removed() -> None:
    s = stream()
    s.on_live(0, payload([stored(7, 7)]))
    s.on_live(1, payload([removed(7)]))
    assert published(s) == {7}
    s.on_live(2, payload([removed(7)]))
    assert published(s) == set()


def test_zmq_stream_gap_replays_first_then_held_live_and_skips_duplicates() -> None:
    s = stream()
    p = [payload([stored(10 + k)]) for k in range(6)]
    s.on_live(0, p[0])
    s.on_live(2, p[2])  # seq 1 is missing
    assert s.want_replay == 0 and replaying(s)  # from the last applied: its proof
    for seq in range(5):  # the engine's buffer also holds 3 and 4, not received live yet
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert not replaying(s) and published(s) == {10, 11, 12, 13, 14}
    s.on_live(3, p[3])  # live copies of replayed batches, still in flight: skipped
    s.on_live(4, p[4])
    s.on_live(5, p[5])
    assert s.forgets == {} and s.batches["duplicate"] == 3 and s.expected == 6
    assert published(s) == {10, 11, 12, 13, 14, 15}


def test_zmq_stream_uncovered_gap_forgets_then_follows() -> None:
    s = stream()
    s.on_live(0, payload([stored(10)]))
    s.on_live(5, payload([stored(15)]))
    s.on_replayed(4, payload([removed(10)]))  # the buffer starts after the last applied
    s.on_replayed(5, payload([stored(15)]))
    s.on_replay_end()
    assert s.forgets == {"replay_uncovered": 1} and s.forget_pending
    assert published(s) == {15}


def test_zmq_stream_replay_timeout_forgets_and_applies_the_held_live_batches() -> None:
    now = [0.0]
    s = stream(clock=lambda: now[0])
    s.on_live(0, payload([stored(1)]))
    s.on_live(2, payload([stored(3)]))
    now[0] = 2.5
    assert s.check_deadline()
    assert s.forgets == {"replay_timeout": 1} and published(s) == {3}


def test_zmq_stream_seq_back_to_zero_is_an_engine_restart() -> None:
    s = stream()
    inc = s.incarnation
    s.on_live(0, payload([stored(1)]))
    s.on_live(1, payload([stored(2)]))
    s.on_live(0, payload([stored(9)]))
    assert replaying(s) and s.want_replay == 1 and s.forgets == {}  # prove it first
    s.on_replay_end()  # the new life's buffer holds nothing at seq 1: a restart
    assert s.forgets == {"engine_restart": 1} and published(s) == {9}
    assert s.incarnation != inc and s.forget_pending and not replaying(s)


def test_zmq_stream_seq_back_with_a_new_life_past_zero_forgets_at_once_then_replays() -> None:
    s = stream()
    p = [payload([stored(10 + k)]) for k in range(3)]
    for seq in range(3):
        s.on_live(seq, p[seq])
    s.on_live(1, payload([stored(91)]))  # the new life's seq 1 (its 0 went by unseen)
    s.on_replayed(2, payload([stored(92)]))  # the buffer's seq 2 is another batch
    assert s.forgets == {"engine_restart": 1} and s.forget_pending and published(s) == set()
    assert replaying(s) and s.want_replay == 0
    assert s.replay is not None and s.replay.hollow  # synced: KVCM may forget at once
    s.on_replay_end()  # the rest of the old reply: discarded
    s.on_replayed(0, payload([stored(90)]))
    s.on_replayed(1, payload([stored(91)]))
    s.on_replayed(2, payload([stored(92)]))
    s.on_replay_end()
    assert not replaying(s) and published(s) == {90, 91, 92} and s.expected == 3


def test_zmq_stream_a_stray_decodable_batch_with_a_low_seq_is_no_restart() -> None:
    s = stream()
    p = [payload([stored(10 + k)]) for k in range(3)]
    for seq in range(3):
        s.on_live(seq, p[seq])
    s.on_live(0, payload([stored(66)]))  # a stray: the engine still holds seq 2 unchanged
    assert replaying(s) and s.want_replay == 2
    s.on_replayed(2, p[2])
    s.on_replay_end()
    assert not replaying(s) and s.forgets == {} and s.batches["stale"] == 1
    assert published(s) == {10, 11, 12} and s.expected == 3


def test_zmq_stream_junk_with_a_low_seq_is_dropped_not_a_restart() -> None:
    """Review of #13: 8 zero bytes and a garbage payload made the sidecar forget everything."""
    s = stream()
    for seq in range(5):
        s.on_live(seq, payload([stored(100 + seq)]))
    s.on_live(0, b"\xc1junk")
    assert s.forgets == {} and not s.forget_pending and not replaying(s)
    assert s.batches["malformed"] == 1 and s.decode_errors["not_msgpack"] == 1
    s.on_live(5, payload([stored(105)]))
    assert published(s) == set(range(100, 106)) and s.restarts == 0


def test_zmq_stream_junk_with_a_far_seq_is_dropped_and_forgets_nothing() -> None:
    """Review of #13: a junk seq far ahead asked a replay that could not cover it: a forget."""
    s = stream()
    for seq in range(5):
        s.on_live(seq, payload([stored(100 + seq)]))
    s.on_live(1 << 40, b"\x00garbage")
    assert s.batches["malformed"] == 1 and s.want_replay == 4  # its seq may be real: look
    s.on_replayed(4, payload([stored(104)]))  # the engine has nothing after 4
    s.on_replay_end()
    assert not replaying(s) and s.forgets == {} and s.expected == 5
    for seq in range(5, 8):
        s.on_live(seq, payload([stored(100 + seq)]))
    assert s.forgets == {} and published(s) == set(range(100, 108)) and s.expected == 8


def test_zmq_stream_restart_while_a_replay_is_served_is_caught() -> None:
    """Review of #13: the new life's seq 0 and 1, held during a gap replay the old life
    served, were skipped as duplicates (seq < expected) without a look at their payload."""
    s = stream()
    old = [payload([stored(100 + k)]) for k in range(8)]
    for seq in range(5):
        s.on_live(seq, old[seq])
    s.on_live(6, old[6])  # gap: replay from 4 (the proof)
    s.on_live(7, old[7])  # held
    s.on_live(0, payload([stored(999)]))  # the new life's, held
    s.on_live(1, payload([removed(999)]))
    for seq in range(4, 8):
        s.on_replayed(seq, old[seq])
    s.on_replay_end()
    assert replaying(s) and s.want_replay == 7  # seq 0 after 7: prove the restart
    s.on_replay_end()  # the new life has nothing at 7
    assert s.forgets == {"engine_restart": 1} and s.restarts == 1
    assert published(s) == set() and s.expected == 2 and not replaying(s)


def test_zmq_stream_unanswered_start_replay_is_retried_within_its_budget_then_follows_live() -> (
    None
):
    """Review of #13: an endpoint that never answers kept a fresh sidecar from applying. The
    engine publishes (live batches arrive while each replay waits): the timed attempts run out
    and the live stream is followed, nothing forgotten (nothing was held)."""
    now = [0.0]
    s = stream(clock=lambda: now[0])
    s.start(None, loaded=False)
    seq = 100
    for _ in range(12):
        for _ in range(5):
            s.on_live(seq, payload([stored(seq)]))
            seq += 1
        now[0] += 2.5
        s.check_deadline()
        now[0] += 60.0  # past any backoff
        s.tick()
    assert s.replays["timeout"] == 1 + s.replay_retries and not replaying(s)
    assert s.replays["recovery_given_up"] == 1 and s.basis is None and s.forgets == {}
    assert published(s) == set(range(100, seq)) and s.expected == seq


def test_zmq_stream_a_long_replay_still_arriving_does_not_time_out() -> None:
    now = [0.0]
    s = stream(clock=lambda: now[0])
    s.start(None, loaded=False)
    for seq in range(10):
        now[0] += 1.5  # each reply within the timeout of the one before, all beyond the first
        assert not s.check_deadline()
        s.on_replayed(seq, payload([stored(seq)]))
    s.on_replay_end()
    assert s.replays == {"covered": 1} and published(s) == set(range(10))


def test_zmq_stream_checkpoint_replay_beyond_its_seq_is_checkpoint_unproven() -> None:
    s = stream()
    s.start(ckpt.Checkpoint(3, ckpt.digest(b"old life"), []), loaded=True)
    s.on_replayed(7, payload([stored(7)]))  # the buffer no longer holds seq 3
    s.on_replay_end()
    assert s.forgets == {"checkpoint_unproven": 1} and published(s) == {7}


def test_zmq_stream_checkpoint_proof_differs_forgets_and_reasks_from_zero() -> None:
    s = stream()
    s.start(ckpt.Checkpoint(3, ckpt.digest(b"old life"), []), loaded=True)
    assert s.want_replay == 3
    s.on_replayed(3, payload([stored(30)]))  # another batch under seq 3: another life
    assert s.forgets == {"checkpoint_unproven": 1} and replaying(s)
    assert s.replay is not None and s.replay.start == 0
    s.on_replayed(4, payload([]))  # the rest of the old reply: discarded
    s.on_replay_end()
    for seq, k in enumerate((40, 41, 42)):
        s.on_replayed(seq, payload([stored(k)]))
    s.on_replay_end()
    assert not replaying(s) and published(s) == {40, 41, 42}


def test_zmq_stream_all_blocks_cleared_forgets() -> None:
    s = stream()
    s.on_live(0, payload([stored(1, 2), {"type": "AllBlocksCleared"}, stored(3)]))
    assert published(s) == {3} and s.forgets == {"all_blocks_cleared": 1}


def test_zmq_stream_foreign_dp_rank_is_dropped_but_consumes_its_seq() -> None:
    s = stream()
    s.on_live(0, payload([stored(1)], dp_rank=4))
    s.on_live(1, payload([stored(2)], dp_rank=None))  # vLLM without DP omits the rank
    assert published(s) == {2} and s.batches["dp_rank"] == 1 and s.gaps == 0


def test_zmq_checkpoint_round_trip_and_corruption(tmp_path: Path) -> None:
    path = ckpt.path_for(str(tmp_path), "i", 0, "tcp://e:1")
    tables = [("hbm", 0, np.array([-1, 5], np.int64), np.array([2, 1], np.int64))]
    ckpt.save(path, "i", 0, "tcp://e:1", ckpt.Checkpoint(9, b"d" * 16, tables))
    got = ckpt.load(path, "i", 0, "tcp://e:1")
    assert got is not None and got.last_seq == 9 and got.digest == b"d" * 16
    assert got.tables[0][2].tolist() == [-1, 5] and got.tables[0][3].tolist() == [2, 1]
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(path, "other", 0, "tcp://e:1")
    Path(path).write_bytes(b"\x93garbage")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(path, "i", 0, "tcp://e:1")
    assert ckpt.load(str(tmp_path / "none.ckpt"), "i", 0, "tcp://e:1") is None


def test_zmq_stream_a_hole_the_replay_did_not_fill_forgets_once_not_forever() -> None:
    s = stream()
    s.on_live(0, payload([stored(1)]))
    s.on_live(1 << 40, payload([stored(2)]))  # a bogus (or unbuffered) seq reveals a "gap"
    s.on_replayed(0, payload([stored(1)]))
    s.on_replay_end()  # the engine had nothing after 0: the hole is not in its buffer
    assert not replaying(s) and s.forgets == {"replay_uncovered": 1}
    assert published(s) == {2}


def test_zmq_stream_a_replay_outrun_by_the_live_stream_is_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sidecar.source import zmq as Z

    monkeypatch.setattr(Z, "MAX_HELD_LIVE", 3)
    s = stream()
    s.on_live(0, payload([stored(1)]))
    for seq in range(2, 6):  # a gap, then more live batches than may be held
        s.on_live(seq, payload([stored(seq)]))
    assert not replaying(s) and s.forgets == {"live_backlog": 1}
    assert published(s) == {5} and s.expected == 6
    s.on_replayed(0, payload([stored(1)]))  # the old reply, still coming: ignored
    s.on_replay_end()
    s.on_live(6, payload([stored(6)]))
    assert published(s) == {5, 6} and s.forgets == {"live_backlog": 1}


def test_zmq_stream_unanswered_start_replay_is_no_forget() -> None:
    """A sidecar started before its engine: nothing was held, so nothing is forgotten."""
    now = [0.0]
    s = stream(clock=lambda: now[0])
    s.start(None, loaded=False)
    assert s.want_replay == 0
    now[0] = 3.0
    assert s.check_deadline() and s.forgets == {} and s.replays["timeout"] == 1
    s.on_live(3, payload([stored(4)]))  # the engine came up meanwhile: ask for its start
    assert replaying(s) and s.want_replay == 0
    for seq in range(4):
        s.on_replayed(seq, payload([stored(seq + 1)]))
    s.on_replay_end()
    assert published(s) == {1, 2, 3, 4} and s.forgets == {}


def zmq_source(tmp_path: Path, endpoint: str, replay_endpoint: str = "") -> ZmqSource:
    """A source whose libzmq sockets these tests drive themselves (transport libzmq)."""
    z = ZmqConfig(
        endpoint=endpoint, replay_endpoint=replay_endpoint, bind=False, transport="libzmq"
    )
    cfg = Config(
        publisher_type="none",
        identity=IdentityConfig(instance_id="i"),
        source=SourceConfig(kind="zmq", state_dir=str(tmp_path), zmq=z),
    )
    src = ZmqSource(cfg, KeyState((0,)))
    src._ctx = zmq.asyncio.Context()
    return src


def test_zmq_source_replay_of_a_full_engine_buffer_loses_no_frame(tmp_path: Path) -> None:
    """Review of #13: vLLM's ROUTER sends its whole buffer (10 000 batches by default) in a
    tight loop and drops what its peer's queue cannot take; the DEALER kept RCVHWM 1000."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    # vLLM's ROUTER keeps the default SNDHWM and drops whatever its queue to the peer cannot
    # take; how much that is depends on how fast the I/O threads run on a busy machine, so
    # the drop is checked as the option that prevents it, and this router queues everything
    # (a frame lost on our side still fails the count below).
    router.setsockopt(zmq.SNDHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    src = zmq_source(tmp_path, "tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}")
    try:
        dealer = src._dealer()
        assert dealer is not None
        assert dealer.getsockopt(zmq.RCVHWM) == 0  # unbounded: the engine's ROUTER never drops
        sync_dealer: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        s = src.stream
        s.start(None, loaded=False)
        assert s.want_replay == 0
        sync_dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert router.poll(10_000)
        ident, _, start = router.recv_multipart()
        assert start == bytes(8)
        pad = b"p" * 2000  # ~2 KB batches: 20 MB, as a busy engine's buffer
        for seq in range(10_000):  # the sidecar reads nothing meanwhile
            body = msgspec.msgpack.encode([1.0, [stored(seq)], 0, pad])
            router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), body])
        router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
        turns = 0
        while replaying(s) and sync_dealer.poll(5_000):
            before = src.replayed_frames
            src._read_replies(sync_dealer)
            assert src.replayed_frames - before <= DRAIN_BATCHES  # the loop gets its turn
            turns += 1
        assert not replaying(s) and turns >= 10_000 // DRAIN_BATCHES
        assert s.batches["replayed"] == 10_000 and s.forgets == {} and s.replays == {"covered": 1}
        assert len(published(s)) == 10_000
    finally:
        src.close()
        router.close(0)
        ctx.term()


def test_zmq_source_lag_is_not_moved_by_a_junk_seq(tmp_path: Path) -> None:
    """Review of #13: a frame with a junk seq (2^40) set the seq-lag gauge to ~2^40."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # XPUB: the subscription arrives as a message (no slow joiner)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    src = zmq_source(tmp_path, f"tcp://127.0.0.1:{port}")
    try:
        sub, _ = src._sockets()
        sync_sub: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        assert pub.poll(10_000)
        assert pub.recv()[:1] == b"\x01"  # subscribed
        for seq in range(5):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload([stored(seq)])])
        pub.send_multipart([b"kv", (1 << 40).to_bytes(8, "big"), b"\x00garbage"])
        pub.send_multipart([b"kv", (5).to_bytes(8, "big"), payload([stored(5)])])
        while src.live_frames < 7 and sync_sub.poll(5_000):
            src._read_live(sync_sub)
        assert src.live_frames == 7 and src.lag() == 0 and src.stream.forgets == {}
        assert published(src.stream) == set(range(6)) and src.stream.batches["malformed"] == 1
        sub.close(0)
    finally:
        src.close()
        pub.close(0)
        ctx.term()


def test_zmq_stream_start_replay_beyond_seq_zero_is_counted_uncovered() -> None:
    """Nothing held yet, so nothing to forget; but batches the engine no longer buffers went
    by unseen (KVCM misses their keys): counted as an uncovered replay."""
    s = stream()
    s.start(None, loaded=False)
    s.on_replayed(5, payload([stored(5)]))
    s.on_replay_end()
    assert s.replays == {"uncovered": 1} and s.forgets == {} and published(s) == {5}


def synced(src: ZmqSource) -> bool:
    return src.synced  # read through a call (see replaying)


def test_zmq_source_restart_forget_reaches_the_publisher_before_the_replay_from_zero(
    tmp_path: Path,
) -> None:
    """The publisher sends KVCM's forgetting snapshot only while the source is synced: right
    after a restart's forget the empty state is true, so it must not wait for the replay."""
    src = zmq_source(tmp_path, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    try:
        s = src.stream
        for seq in range(3):
            s.on_live(seq, payload([stored(10 + seq)]))
        assert synced(src)
        s.on_live(1, payload([stored(91)]))  # backwards: prove it first (not synced meanwhile)
        assert not synced(src) and not src.take_forget()
        s.on_replay_end()  # seq 2 gone from the buffer: a restart; replay the new life from 0
        assert replaying(s) and synced(src) and src.take_forget() and published(s) == set()
        s.on_replayed(0, payload([stored(90)]))  # the new life's state is partial from here
        assert not synced(src) and src.sync_state == "replaying_restart"
        s.on_replayed(1, payload([stored(91)]))
        s.on_replay_end()
        assert synced(src) and published(s) == {90, 91} and s.forgets == {"engine_restart": 1}
    finally:
        src.close()


def test_zmq_stream_a_reply_still_being_discarded_keeps_the_next_replay_alive() -> None:
    now = [0.0]
    s = stream(clock=lambda: now[0])
    s.start(ckpt.Checkpoint(3, ckpt.digest(b"old life"), []), loaded=True)
    s.on_replayed(3, payload([stored(30)]))  # another life: re-ask from 0 behind this reply
    for seq in range(4, 8):  # the rest of the reply to the first request, arriving slowly
        now[0] += 1.5
        assert not s.check_deadline()
        s.on_replayed(seq, payload([stored(seq)]))
    s.on_replay_end()
    now[0] += 1.5
    assert not s.check_deadline()
    s.on_replayed(0, payload([stored(40)]))
    s.on_replay_end()
    assert s.replays == {"restart": 1, "covered": 1} and published(s) == {40}


S7 = (7).to_bytes(8, "big")
SHAPES: dict[str, tuple[list[list[bytes]], list[tuple[int, bytes]], dict[str, int]]] = {
    # messages sent -> batches handed to the stream, frames skipped by reason
    "good": ([[b"kv", S7, b"P"]], [(7, b"P")], {}),
    "empty payload and topic": ([[b"", S7, b""]], [(7, b"")], {}),
    "one frame": ([[b"x"]], [], {"frame_shape": 1}),
    "two frames": ([[b"kv", S7]], [], {"frame_shape": 1}),
    "four frames, then a good one": (
        [[b"kv", S7, b"P", b"Q"], [b"kv", S7, b"R"]],
        [(7, b"R")],
        {"frame_shape": 1},
    ),
    "five empty frames": ([[b""] * 5], [], {"frame_shape": 1}),
    "seq not 8 bytes": ([[b"kv", b"7", b"P"]], [], {"frame_shape": 1}),
    "the end marker's seq": ([[b"kv", b"\xff" * 8, b""]], [], {"frame_shape": 1}),
    # A short message shifts the next one: that batch is lost as well (a seq gap: replayed).
    "one frame, then a good one": ([[b"x"], [b"kv", S7, b"P"]], [], {"frame_shape": 1}),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_zmq_source_live_frames_of_another_shape_are_skipped_and_counted(
    tmp_path: Path, case: str
) -> None:
    sent, want, bad = SHAPES[case]
    src = zmq_source(tmp_path, "tcp://127.0.0.1:1")
    got: list[tuple[int, bytes]] = []
    src.stream.on_live = lambda seq, payload, pre=None: got.append((seq, payload))  # type: ignore[method-assign]
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)  # multipart kept, like PUB/SUB
    try:
        pull.bind("inproc://shapes")
        push.connect("inproc://shapes")
        for m in sent:
            push.send_multipart(m)
        assert pull.poll(5_000)
        src._read_live(pull)
        assert got == want
        assert dict(src.frames_bad) == bad
        assert not pull.poll(0)  # everything sent was read
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        src.close()


BAD_HASHES = {"type": "BlockRemoved", "block_hashes": "not-a-list"}


def test_zmq_stream_unreadable_block_hashes_in_a_live_batch_are_fetched_again() -> None:
    # The typed decode keeps hashes as msgpack, so an unreadable array shows at the flush,
    # after its batch and a later one were taken. The feed loop's flush (repair) handles it as
    # a batch unreadable at decode: fold what came before, replay from the batch before it.
    s = stream()
    first = payload([stored(1), stored(2)])
    s.on_live(0, first)
    s.flush(repair=True)
    s.on_live(1, payload([removed(1), BAD_HASHES, stored(3)]))  # damaged on the way
    later = payload([stored(4)])
    s.on_live(2, later)
    s.flush(repair=True)
    assert replaying(s) and s.want_replay == 0 and s.expected == 1 and s.forgets == {}
    assert s.batches["malformed"] == 1 and s.decode_errors["malformed_event"] == 1
    assert s.batches["applied"] == 1  # 1 and 2 are not (the replay brings them: replayed)
    assert set(s.counts.keys.published_keys().tolist()) == {1, 2}  # 1 and 2: not folded
    s.on_replayed(0, first)  # the proof: same engine life
    s.on_replayed(1, payload([removed(1), removed(2), stored(3)]))  # the engine's own copy
    s.on_replayed(2, later)
    s.on_replay_end()
    s.on_live(3, payload([stored(5)]))
    assert not replaying(s) and published(s) == {3, 4, 5} and s.forgets == {}
    assert s.events[:2].tolist() == [2, 5]  # removed, stored (GPU): the discarded not counted
    # each batch counted once by what finally happened to it (0 applied, 1 and 2 replayed
    # after the malformed copy of 1, 3 applied; the replay's proof batch 0 a duplicate)
    assert (s.batches["applied"], s.batches["replayed"], s.batches["malformed"]) == (2, 2, 1)


def test_zmq_stream_unreadable_block_hashes_in_the_replayed_copy_too_forget() -> None:
    s = stream()
    first = payload([stored(1), stored(2)])
    s.on_live(0, first)
    s.flush(repair=True)
    bad = payload([removed(1), BAD_HASHES, stored(3)])
    s.on_live(1, bad)
    s.flush(repair=True)
    s.on_replayed(0, first)
    s.on_replayed(1, bad)  # damaged in the engine's buffer too: lost for good
    s.on_replay_end()
    s.flush(repair=True)
    assert s.forgets == {"malformed_replay": 1} and s.forget_pending
    assert published(s) == {3}  # what followed the unreadable event
    assert s.decode_errors["malformed_event"] == 2


def test_zmq_stream_unreadable_block_hashes_forget_and_what_follows_is_kept() -> None:
    # A flush inside another step (here: a test's; also before a replay, at a clear, for a
    # checkpoint) cannot rewind the seq: the state is lost there (a forget), the events after
    # it (same batch, later batches of the same flush) are the new truth.
    s = stream()
    s.on_live(0, payload([stored(1), stored(2)]))
    assert published(s) == {1, 2}
    s.on_live(1, payload([removed(1), BAD_HASHES, stored(3)]))
    s.on_live(2, payload([stored(4), removed(3), BAD_HASHES, stored(6)]))
    assert published(s) == {6}
    assert s.forgets == {"malformed_replay": 1}
    assert s.decode_errors["malformed_event"] == 2
    assert s.last_seq == 2 and s.forget_pending


def _paused_after_a_gap(now: list[float]) -> tuple[Stream, list[bytes]]:
    """Batches 0..4 applied; 7 arrives (a gap); the engine then stops: the replay times out."""
    s = stream(clock=lambda: now[0])
    p = [payload([stored(10 + k)]) for k in range(30)]
    for seq in range(5):
        s.on_live(seq, p[seq])
    s.on_live(7, p[7])
    assert s.want_replay == 4
    now[0] += 2.5
    assert s.check_deadline()
    return s, p


def test_zmq_stream_replay_unanswered_in_a_pause_is_undone_when_the_stream_comes_back() -> None:
    """Issue #24 §2: a forget after a replay timeout is not final while the engine's buffer may
    still hold what it needs: the first live batch after the silence asks again, and a proof
    rebuilds the state exactly."""
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    assert s.forgets == {"replay_timeout": 1} and s.forget_pending
    assert published(s) == {17}  # the live stream is followed meanwhile
    assert s.basis is not None and s.basis.seq == 4 and s.basis.armed
    s.on_live(8, p[8])  # the engine is back
    assert replaying(s) and s.want_replay == 4
    for seq in range(4, 9):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert not replaying(s) and pending(s) is None
    assert published(s) == {10 + k for k in range(9)} and s.expected == 9
    assert s.replays["recovered"] == 1 and s.replays["recovery_stream_back"] == 1


def test_zmq_stream_a_due_timed_attempt_recovers_an_engine_that_stays_quiet() -> None:
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    assert s.basis is not None
    due = s.next_timer()
    assert due is not None and now[0] < due <= now[0] + 2.0
    s.tick()
    assert not replaying(s)  # not due yet
    now[0] = due
    s.tick()
    assert replaying(s) and s.want_replay == 4
    for seq in range(4, 8):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert published(s) == {10 + k for k in range(8)} and s.replays["recovered"] == 1


def test_zmq_stream_engine_stopped_past_every_timed_attempt_still_recovers_when_back() -> None:
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    for _ in range(s.replay_retries + 3):  # the engine stays stopped: every attempt unanswered
        now[0] += 100.0
        s.tick()
        if replaying(s):
            now[0] += 2.5
            assert s.check_deadline()
    assert s.forgets == {"replay_timeout": 1}  # KVCM was told once
    b = pending(s)
    assert isinstance(b, Basis) and b.attempts > s.replay_retries  # silent: on at the cap
    due = s.next_timer()
    assert due is not None and due <= now[0] + s.replay_retry_cap_s
    s.on_live(8, p[8])  # back at last
    for seq in range(4, 9):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert published(s) == {10 + k for k in range(9)} and s.basis is None


def test_zmq_stream_a_recovery_that_meets_another_life_rebuilds_that_life() -> None:
    now = [0.0]
    s, _p = _paused_after_a_gap(now)
    inc = s.incarnation
    s.on_live(0, payload([stored(99)]))  # a new engine life came up meanwhile
    assert s.want_replay == 4
    s.on_replayed(4, payload([stored(98)]))  # its seq 4 is another batch: not our basis
    assert s.basis is None and s.incarnation != inc and s.forgets["engine_restart"] == 1
    s.on_replay_end()  # the end of that reply: discarded
    s.on_live(1, payload([stored(97)]))  # the new life was held from its seq 0: followed
    assert not replaying(s) and published(s) == {99, 97}


def test_zmq_stream_checkpoint_while_a_recovery_waits_is_its_basis() -> None:
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    s.on_live(9, payload([stored(50)]))  # followed live (after the stream-back ask times out)
    now[0] += 2.5
    s.check_deadline()
    got = s.checkpoint()
    assert got is not None
    c, tables = got
    assert c.last_seq == 4 and c.digest == ckpt.digest(p[4]) and tables is not None
    held = {k for _m, _g, keys, _n in tables for k in keys.tolist()}
    assert held == {10, 11, 12, 13, 14}


def test_zmq_stream_a_gap_replay_timing_out_while_a_recovery_waits_keeps_its_basis() -> None:
    """Review: a plain gap replay of the followed stream that timed out made a new basis from
    the followed (partial) state, and the next recovery "proved" that partial state."""
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    s.on_live(8, p[8])  # stream back: a recovery is asked for, unanswered (the port is cut)
    s.on_live(9, p[9])
    now[0] += 2.5
    s.check_deadline()
    s.on_live(12, p[12])  # a gap in the followed stream: a plain replay, unanswered too
    now[0] += 2.5
    assert s.check_deadline()
    b = pending(s)
    assert isinstance(b, Basis) and b.seq == 4  # still the exact one
    now[0] += 100.0
    s.tick()
    assert s.want_replay == 4
    for seq in range(4, 13):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert published(s) == {10 + k for k in range(13)}


def test_zmq_stream_a_refuted_recovery_keeps_what_the_live_stream_brought() -> None:
    """Review: a recovery replay whose buffer had moved past its basis forgot the followed
    state and rebuilt from the buffer's start, losing what was followed before it."""
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    for seq in range(8, 20):  # the engine is back and publishing; the recovery ask goes unanswered
        s.on_live(seq, p[seq])
    now[0] += 2.5
    s.check_deadline()
    for seq in range(20, 24):
        s.on_live(seq, p[seq])
    followed = published(s)
    assert {18, 25, 30, 33} <= followed
    now[0] += 100.0
    s.tick()
    assert s.want_replay == 4
    s.on_replayed(21, p[21])  # the buffer starts at 21 now: the basis is gone from it
    s.on_replayed(22, p[22])  # the rest of that reply: discarded
    s.on_replay_end()
    assert not replaying(s) and pending(s) is None and s.replays["recovery_refuted"] == 1
    assert published(s) == followed and s.forgets == {"replay_timeout": 1}
    s.on_live(24, payload([stored(77)]))  # and the stream goes on
    assert 77 in published(s)


def test_zmq_stream_an_unanswered_recovery_keeps_the_followed_streams_expected_seq() -> None:
    """Review: a recovery timeout cleared `expected`, so a batch lost on the followed stream
    while the recovery waited was never asked for."""
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    s.on_live(8, p[8])  # stream back: recovery asked, 8 held
    now[0] += 2.5
    s.check_deadline()  # unanswered: 8 followed
    assert s.expected == 9
    now[0] += 100.0
    s.tick()
    assert replaying(s)
    s.on_live(10, payload([removed(17)]))  # batch 9 was lost on the link; 10 arrives, held
    now[0] += 2.5
    s.check_deadline()
    assert s.gaps >= 2 and replaying(s) and s.want_replay == 8  # 9 is asked for


def _tail_stream(now: list[float]) -> tuple[Stream, list[bytes]]:
    s = Stream(
        EventDecoder(MEDIUM_INDEX, 16, 0),
        BlockCounts(KeyState((0,))),
        dp_rank=0,
        can_replay=True,
        replay_timeout_s=2.0,
        tail_check_s=1.0,
        clock=lambda: now[0],
    )
    p = [payload([stored(10 + k)]) for k in range(8)]
    for seq in range(5):
        s.on_live(seq, p[seq])
    return s, p


def test_zmq_stream_batches_lost_at_the_end_of_a_burst_are_fetched_by_the_tail_check() -> None:
    """Found by the chaos run (seed 2007): a cut PUB link lost the last batches of a burst; no
    later seq revealed the gap while the engine idled, so KVCM missed them for good."""
    now = [0.0]
    s, p = _tail_stream(now)  # 5 and 6 were published, and lost on the way
    now[0] = 0.9
    s.tick()
    assert not replaying(s)  # not quiet long enough yet
    assert s.next_timer() == 1.0
    now[0] = 1.0
    s.tick()
    assert replaying(s) and s.want_replay == 4 and s.replays["tail_check"] == 1
    for seq in range(4, 7):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert published(s) == {10 + k for k in range(7)} and s.forgets == {} and s.expected == 7
    now[0] = 5.0
    s.tick()
    assert not replaying(s)  # once per quiet spell: nothing new arrived since


def test_zmq_stream_an_unanswered_tail_check_changes_nothing() -> None:
    now = [0.0]
    s, _p = _tail_stream(now)
    now[0] = 1.0
    s.tick()
    assert replaying(s)
    now[0] = 3.5
    assert s.check_deadline()
    assert s.forgets == {} and pending(s) is None and published(s) == {10, 11, 12, 13, 14}
    assert s.expected == 5


def test_zmq_stream_an_engine_back_but_idle_is_recovered_by_a_timed_attempt() -> None:
    """Review of the chaos soak: an engine resumed after the whole retry budget and published
    nothing; with no batch to ask for it and no timed attempt left, KVCM kept nothing."""
    now = [0.0]
    s, p = _paused_after_a_gap(now)
    while (b := pending(s)) is not None and isinstance(b, Basis) and b.attempts < 10:
        now[0] += 100.0
        s.tick()
        if replaying(s):
            now[0] += 2.5
            s.check_deadline()
    now[0] += 100.0  # the engine is back, and idle
    s.tick()
    assert replaying(s) and s.want_replay == 4
    for seq in range(4, 8):
        s.on_replayed(seq, p[seq])
    s.on_replay_end()
    assert published(s) == {10 + k for k in range(8)} and pending(s) is None


def _tail_check_finds_a_new_life() -> tuple[Stream, list[float]]:
    """A stream whose tail check found its last applied batch gone: forgotten, asking for the
    new life from 0."""
    now = [0.0]
    s, _p = _tail_stream(now)
    now[0] = 1.0
    s.tick()
    assert s.want_replay == 4
    s.on_replay_end()  # the new life's buffer holds nothing from seq 4 on
    assert s.forgets == {"engine_restart": 1} and s.want_replay == 0  # its life from 0
    return s, now


def test_zmq_stream_a_tail_check_that_finds_the_last_batch_gone_is_an_engine_restart() -> None:
    """Found by the chaos run (seed 3101): the engine restarted, and its few first batches were
    lost while the SUB reconnected; the tail check found the last applied batch gone from the
    buffer and forgot, but nothing asked for the new life, whose keys KVCM never got."""
    s, _now = _tail_check_finds_a_new_life()
    for seq, k in enumerate((90, 91)):
        s.on_replayed(seq, payload([stored(k)]))
    s.on_replay_end()
    assert published(s) == {90, 91} and not replaying(s)


def test_zmq_stream_batches_published_after_the_restart_replay_and_never_seen_live() -> None:
    """Chaos seed 8048 (vllm, engine_kill just before the end): the tail check found the last
    batch gone (a new life), the replay from 0 rebuilt the new life's first batches, and the
    batches the engine published after serving it went by before the SUB had reconnected; the
    engine then idled. Nothing live ever arrived, so no gap and no tail check showed them:
    KVCM kept the state as of the replay for good (2 keys missing, 4 extra)."""
    s, now = _tail_check_finds_a_new_life()
    q = [payload([stored(90)]), payload([stored(91)]), payload([removed(90), stored(92)])]
    for seq in range(2):  # the engine served the replay after its first two batches
        s.on_replayed(seq, q[seq])
    s.on_replay_end()
    assert published(s) == {90, 91} and not replaying(s)
    # seq 2 was published, lost on the way (no subscription yet); the engine idles.
    now[0] = 3.0
    s.tick()
    assert replaying(s) and s.want_replay == 1, "a tail check must follow the replay"
    s.on_replayed(1, q[1])
    s.on_replayed(2, q[2])
    s.on_replay_end()
    assert published(s) == {91, 92}


def test_zmq_stream_a_tail_check_unanswered_while_the_engine_is_down_hides_its_restart() -> None:
    """Chaos (vllm only, engine_kill,zmq_restart,zmq_cut,checkpoint_unwritable, seed 3): the
    tail check went out while the killed engine was still down and timed out ("changes
    nothing"); the new life published its few batches before the SUB reconnected and then
    idled: no live batch ever showed the seq going back, and nothing asked again. KVCM kept
    the old life's keys (280 extra, 23 missing) for the whole convergence window."""
    now = [0.0]
    s, _p = _tail_stream(now)
    now[0] = 1.0
    s.tick()
    assert s.want_replay == 4
    now[0] = 3.5
    assert s.check_deadline()  # no reply: the engine is down
    assert s.forgets == {} and not replaying(s)
    # The new engine is up, published what the SUB never got, idles. Someone must ask again.
    assert s.next_timer() == 3.5 + 2.0  # backoff: tail_check_s doubled per miss
    now[0] = 5.5
    s.tick()
    assert replaying(s) and s.want_replay == 4 and s.replays["tail_check"] == 2
    s.on_replay_end()  # the new life's buffer holds nothing from seq 4 on
    assert s.forgets == {"engine_restart": 1} and s.want_replay == 0
    s.on_replayed(0, payload([stored(90)]))
    s.on_replay_end()
    assert published(s) == {90}


@pytest.mark.parametrize(
    ("endpoint", "bind", "transport", "want"),
    [
        ("tcp://127.0.0.1:5557", False, "auto", "zmtp"),  # the engine binds, we connect
        ("ipc:///tmp/kv.sock", None, "auto", "zmtp"),
        ("tcp://127.0.0.1:5557", True, "auto", "libzmq"),  # we bind: libzmq's SUB
        ("inproc://kv", False, "auto", "libzmq"),
        ("tcp://127.0.0.1:5557", False, "libzmq", "libzmq"),
    ],
)
def test_zmq_source_auto_transport_is_zmtp_where_the_sidecar_connects(
    tmp_path: Path, endpoint: str, bind: bool | None, transport: str, want: str
) -> None:
    z = ZmqConfig(endpoint=endpoint, bind=bind, transport=transport)  # type: ignore[arg-type]
    cfg = Config(
        publisher_type="none",
        identity=IdentityConfig(instance_id="i"),
        source=SourceConfig(kind="zmq", state_dir=str(tmp_path), zmq=z),
    )
    src = ZmqSource(cfg, KeyState((0,)))
    assert src.transport == want and src.status()["zmq_transport"] == want


def _zmtp_source(tmp_path: Path, port: int) -> tuple[ZmqSource, Any]:
    """A zmtp source on 127.0.0.1:port at clock 100.0, with its (unconnected) connection."""
    from sidecar.source.zmtp import ZmtpSub

    z = ZmqConfig(endpoint=f"tcp://127.0.0.1:{port}", bind=False, transport="zmtp")
    cfg = Config(
        publisher_type="none",
        identity=IdentityConfig(instance_id="i"),
        source=SourceConfig(kind="zmq", state_dir=str(tmp_path), zmq=z),
    )
    src = ZmqSource(cfg, KeyState((0,)), clock=lambda: 100.0)
    conn = src.zmtp = ZmtpSub(z.endpoint, b"")
    return src, conn


async def test_zmtp_a_peer_that_ends_every_connection_at_once_is_retried_backing_off(
    tmp_path: Path,
) -> None:
    """Review of 45d5006: a peer that completes the handshake and then ends it (a ROUTER given
    as the live endpoint) was connected to again at once, thousands of times a second."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    src, conn = _zmtp_source(tmp_path, port)
    poller = zmq.asyncio.Poller()
    waits = []
    try:
        for _ in range(5):
            assert await src._zmtp_connect(conn)
            sock = conn.sock
            assert sock is not None
            poller.register(sock, zmq.POLLIN)
            async with asyncio.timeout(10):
                while conn.fileno() >= 0:  # its READY says ROUTER: the connection ends
                    src._read_zmtp(conn, poller)
                    await asyncio.sleep(0.005)
            waits.append(round(src._zmtp_retry_at - 100.0, 3))
        assert waits == [0.1, 0.2, 0.4, 0.8, 1.0]
        assert src.zmtp_events == {"connected": 5, "lost": 5}
    finally:
        conn.close()
        router.close(0)
        ctx.term()


async def test_zmtp_a_refused_connect_is_tried_again_every_100_ms_as_libzmq_does(
    tmp_path: Path,
) -> None:
    """An engine restarting: its port refuses until it binds. The retry stays at libzmq's
    reconnect_ivl (no backoff to 1 s), so the new engine is followed within 0.1 s of its bind;
    a peer that ended a connection before any batch keeps the backoff it earned."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src, conn = _zmtp_source(tmp_path, port)
    src._zmtp_backoff = 0.8  # earned from a peer that closed at once
    waits = []
    for _ in range(4):
        assert not await src._zmtp_connect(conn)
        waits.append(round(src._zmtp_retry_at - 100.0, 3))
    assert waits == [0.1] * 4
    assert src.zmtp_events == {"connect_failed": 4}
    assert src._zmtp_backoff == 0.8
