"""The vLLM/SGLang-style ZMQ publisher (sidecar.testbed.zmq_publisher) against plain SUB/DEALER
sockets.

The publisher runs as a real process (PublisherProcess); the property test drives it in-process.
Waits are on the publisher's replies (`wait_subscribers`, step replies after the send) and on
socket polls with timeouts, never on sleeps.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.testbed.zmq_publisher import (
    END_SEQ,
    Publisher,
    PublisherConfig,
    PublisherError,
    PublisherProcess,
    key_of,
    offset_endpoint_port,
)

Frames = list[bytes]


class Sub:
    """A plain SUB socket (unbounded receive queue) plus a DEALER for replay requests."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], pub: str, replay: str | None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.dealer = None
        if replay is not None:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.connect(replay)

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)

    def recv(self, timeout_ms: int = 5000) -> Frames:
        if not self.sub.poll(timeout_ms):
            raise TimeoutError("no frame on the SUB socket")
        return self.sub.recv_multipart()

    def nothing_pending(self) -> bool:
        return not self.sub.poll(0)

    def replay(self, start: int, timeout_ms: int = 5000) -> list[Frames]:
        assert self.dealer is not None
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[Frames] = []
        while True:
            if not self.dealer.poll(timeout_ms):
                raise TimeoutError("replay did not finish")
            f = self.dealer.recv_multipart()
            out.append(f)
            if f[-2] == END_SEQ:
                return out


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


Spawn = Callable[..., tuple[PublisherProcess, Sub]]


@pytest.fixture
def spawn(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[Spawn]:
    procs: list[PublisherProcess] = []
    subs: list[Sub] = []

    def start(**cfg: Any) -> tuple[PublisherProcess, Sub]:
        pp = PublisherProcess(**cfg)
        procs.append(pp)
        sub = Sub(ctx, pp.ready["pub"], pp.ready["replay"])
        subs.append(sub)
        pp.call("wait_subscribers", n=1)
        return pp, sub

    yield start
    for sub in subs:
        sub.close()
    for pp in procs:
        pp.close()


def seq_of(f: Frames) -> int:
    return int.from_bytes(f[1], "big")


def decode(f: Frames) -> Any:
    return msgspec.msgpack.decode(f[-1])


# A reference fold written from the wire facts (independent of the publisher's own model).
POSITIONAL_MEDIUM = {"BlockStored": 6, "BlockRemoved": 2}
POSITIONAL_GROUP = {"BlockStored": 9, "BlockRemoved": 3}


def fold(counts: dict[tuple[int, str, int], int], payload: Any, *, vllm: bool) -> None:
    for ev in payload[1]:
        if isinstance(ev, dict):
            kind, hashes = ev["type"], ev.get("block_hashes", [])
            medium, group = ev.get("medium") or "GPU", ev.get("group_idx") or 0
        else:
            kind, hashes = ev[0], ev[1] if len(ev) > 1 else []
            mi, gi = POSITIONAL_MEDIUM.get(kind, 99), POSITIONAL_GROUP.get(kind, 99)
            medium = (ev[mi] if len(ev) > mi else None) or "GPU"
            group = (ev[gi] if vllm and len(ev) > gi else None) or 0
        if kind == "AllBlocksCleared":
            counts.clear()
        for h in hashes:
            t = (key_of(h), medium, group)
            if kind == "BlockStored":
                counts[t] = counts.get(t, 0) + 1
            elif counts.get(t, 0) > 1:
                counts[t] -= 1
            else:
                counts.pop(t, None)


def truth_counts(pp: PublisherProcess) -> dict[tuple[int, str, int], int]:
    return {(k, m, g): n for k, m, g, n in pp.call("truth")["counts"]}


# --- boundaries, config ---------------------------------------------------------------------


def test_zmq_publisher_import_engine_hook_loads_no_zmq() -> None:
    code = "import sys, engine_hook\nprint('zmq' in sys.modules, 'msgspec' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        (["--flavour", "tgi"], "flavour"),
        (["--hash-kind", "str"], "hash_kind"),
        (["--buffer-steps", "0"], "buffer_steps"),
        (["--dp-rank", "x"], "dp_rank"),
        (["--endpoint", "localhost"], "endpoint"),
    ],
)
def test_zmq_publisher_invalid_config_exits_2_naming_the_field(flag: list[str], field: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "sidecar.testbed.zmq_publisher", *flag],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2
    assert field in p.stderr
    assert p.stdout == ""


def test_zmq_publisher_offset_endpoint_port_follows_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5558", 1) == "tcp://10.0.0.1:5559"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"


def test_zmq_publisher_key_codec_keeps_low_64_bits_as_int64() -> None:
    assert key_of(5) == 5
    assert key_of((1 << 64) - 1) == -1
    assert key_of(1 << 63) == -(1 << 63)
    digest = bytes(range(24)) + (0x8000000000000001).to_bytes(8, "big")
    assert key_of(digest) == -(1 << 63) + 1
    assert key_of(b"\x01\x02") == 0x0102


def test_zmq_publisher_bad_command_replies_error_and_continues(spawn: Spawn) -> None:
    pp, sub = spawn()
    for bad in ({"cmd": "nope"}, {"cmd": "store", "hashes": [-1]}, {"cmd": "store", "what": 1}):
        with pytest.raises(PublisherError):
            pp.call(**bad)
    assert pp.call("store", n=1, step=True)["seq"] == 0
    assert seq_of(sub.recv()) == 0


# --- frames, encodings, hash kinds ----------------------------------------------------------


def test_zmq_publisher_frames_are_topic_seq_payload_with_seq_from_0(spawn: Spawn) -> None:
    pp, sub = spawn(topic="kv@pod@m", dp_rank=0)
    assert pp.ready["flavour"] == "vllm"
    assert pp.ready["topic"] == "kv@pod@m"
    assert pp.ready["pub"].startswith("tcp://127.0.0.1:")
    assert not pp.ready["pub"].endswith("*")
    for i in range(3):
        assert pp.call("store", n=2, step=True)["seq"] == i
    frames = [sub.recv() for _ in range(3)]
    assert all(len(f) == 3 and f[0] == b"kv@pod@m" and len(f[1]) == 8 for f in frames)
    assert [seq_of(f) for f in frames] == [0, 1, 2]
    ts, events, dp = decode(frames[0])
    assert isinstance(ts, float)
    assert dp == 0
    assert events[0]["type"] == "BlockStored"
    assert events[0]["block_size"] == 16
    assert events[0]["medium"] == "GPU"
    assert events[0]["group_idx"] == 0
    assert len(events[0]["token_ids"]) == 2 * 16


def test_zmq_publisher_step_without_events_sends_nothing(spawn: Spawn) -> None:
    pp, sub = spawn()
    assert pp.call("step")["seq"] is None
    assert pp.call("step", force=True)["seq"] == 0
    assert decode(sub.recv())[1] == []


def test_zmq_publisher_vllm_map_events_carry_fields_by_name_and_extra_fields(spawn: Spawn) -> None:
    pp, sub = spawn(flavour="vllm", encoding="map")
    h = pp.call("store", n=1, medium="CPU", group=1, extra={"future_field": [1, 2]})["hashes"]
    pp.call("remove", hashes=h, medium="CPU", group=1)
    pp.call("clear", step=True)
    stored, removed, cleared = decode(sub.recv())[1]
    assert stored["medium"] == "CPU"
    assert stored["group_idx"] == 1
    assert stored["future_field"] == [1, 2]
    assert {"lora_id", "lora_name", "parent_block_hash"} <= stored.keys()
    assert removed == {"type": "BlockRemoved", "block_hashes": h, "medium": "CPU", "group_idx": 1}
    assert cleared == {"type": "AllBlocksCleared"}


def test_zmq_publisher_vllm_positional_uses_declaration_order(spawn: Spawn) -> None:
    pp, sub = spawn(flavour="vllm", encoding="positional")
    h = pp.call("store", n=1, medium="STORAGE", group=2, parent=7)["hashes"]
    pp.call("remove", hashes=h, medium="STORAGE", group=2, step=True)
    stored, removed = decode(sub.recv())[1]
    # tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
    # group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window (msgspec's array_like writes
    # every field, defaults included)
    assert stored[:2] == ["BlockStored", h]
    assert stored[2] == 7
    assert stored[4:] == [16, None, "STORAGE", None, None, 2, None, None]
    assert removed == ["BlockRemoved", h, "STORAGE", 2]


def test_zmq_publisher_positional_v0_has_no_medium_and_no_dp_rank(spawn: Spawn) -> None:
    pp, sub = spawn(encoding="positional_v0", dp_rank=None)
    h = pp.call("store", n=1, step=True)["hashes"]
    payload = decode(sub.recv())
    assert len(payload) == 2
    assert payload[1][0][:2] == ["BlockStored", h]
    assert len(payload[1][0]) == 6
    with pytest.raises(PublisherError, match="carries no medium"):
        pp.call("store", n=1, medium="CPU")


def test_zmq_publisher_sglang_mediums_rank_nil_and_no_group(spawn: Spawn) -> None:
    pp, sub = spawn(flavour="sglang", encoding="map", dp_rank=None)
    pp.call("store", n=1, medium="CPU_PINNED")
    pp.call("store", n=1, medium=None, step=True)
    _ts, events, rank = decode(sub.recv())
    assert rank is None
    assert events[0]["medium"] == "CPU_PINNED"
    assert "group_idx" not in events[0]
    assert "medium" not in events[1]  # absent means GPU
    assert {m for _, m in pp.truth()} == {"CPU_PINNED", "GPU"}
    with pytest.raises(PublisherError, match="carry no group"):
        pp.call("store", n=1, group=1)


def test_zmq_publisher_sglang_positional_ends_at_medium(spawn: Spawn) -> None:
    pp, sub = spawn(flavour="sglang", encoding="positional", dp_rank=1)
    h = pp.call("store", n=1, medium="DISK")["hashes"]
    pp.call("remove", hashes=h, medium="DISK", step=True)
    _ts, (stored, removed), rank = decode(sub.recv())
    assert rank == 1
    assert stored[0] == "BlockStored"
    assert stored[4:] == [16, None, "DISK"]
    assert removed == ["BlockRemoved", h, "DISK"]


def test_zmq_publisher_int_hashes_reach_uint64_and_fold_to_int64(spawn: Spawn) -> None:
    pp, sub = spawn(hash_kind="int")
    big = (1 << 64) - 2
    r = pp.call("store", hashes=[big, 3], step=True)
    assert decode(sub.recv())[1][0]["block_hashes"] == [big, 3]
    assert r["keys"] == [-2, 3]
    assert pp.truth() == {(-2, "GPU"), (3, "GPU")}


def test_zmq_publisher_bytes_hashes_are_32_byte_digests(spawn: Spawn) -> None:
    pp, sub = spawn(hash_kind="bytes")
    r = pp.call("store", n=3, step=True)
    sent = decode(sub.recv())[1][0]["block_hashes"]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in sent)
    assert [h.hex() for h in sent] == r["hashes"]
    assert pp.truth() == {(key_of(h), "GPU") for h in sent}


def test_zmq_publisher_connect_mode_reaches_a_bound_sub(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with PublisherProcess(endpoint=f"tcp://127.0.0.1:{port}") as pp:
        assert pp.ready["bind"] is False
        # libzmq sends a bound SUB's subscription to a connecting PUB only once the SUB socket
        # handles its commands (zeromq/pyzmq#1650): poll it (bounded) until the engine sees it.
        for _ in range(200):
            sub.poll(50)
            if pp.call("stats")["subscribers"]:
                break
        pp.call("wait_subscribers", timeout_s=0.1)
        pp.call("store", n=1, step=True)
        assert sub.poll(5000)
        assert seq_of(sub.recv_multipart()) == 0
    sub.close(linger=0)


# --- truth ----------------------------------------------------------------------------------


def test_zmq_publisher_truth_counts_duplicate_stores(spawn: Spawn) -> None:
    pp, _ = spawn()
    h = pp.call("store", n=1, step=True)["hashes"]
    pp.call("store", hashes=h, step=True)
    k = key_of(h[0])
    assert truth_counts(pp) == {(k, "GPU", 0): 2}
    pp.call("remove", hashes=h, step=True)
    assert pp.truth() == {(k, "GPU")}
    pp.call("remove", hashes=h, step=True)
    assert pp.truth() == set()
    pp.call("remove", hashes=h, step=True)  # never negative
    pp.call("store", hashes=h, step=True)
    assert truth_counts(pp) == {(k, "GPU", 0): 1}


def test_zmq_publisher_truth_is_per_medium_and_group(spawn: Spawn) -> None:
    pp, _ = spawn()
    h = pp.call("store", n=1, medium="GPU")["hashes"]
    pp.call("store", hashes=h, medium="CPU")
    pp.call("store", hashes=h, medium="CPU", group=1)
    pp.call("remove", hashes=h, medium="GPU", step=True)
    k = key_of(h[0])
    assert truth_counts(pp) == {(k, "CPU", 0): 1, (k, "CPU", 1): 1}
    assert pp.truth(group=1) == {(k, "CPU")}


def test_zmq_publisher_clear_sends_all_blocks_cleared_and_empties_truth(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=3, medium="CPU", step=True)
    pp.call("clear", step=True)
    sub.recv()
    assert decode(sub.recv())[1] == [{"type": "AllBlocksCleared"}]
    assert pp.truth() == set()


def test_zmq_publisher_workload_stream_folds_to_truth(spawn: Spawn) -> None:
    pp, sub = spawn(hash_kind="bytes")
    r = pp.call(
        "workload",
        wait=True,
        events=3000,
        mediums=["GPU", "CPU", "STORAGE"],
        groups=[0, 1],
        dup_prob=0.3,
        remove_prob=0.4,
        max_held=300,
        seed=7,
    )["workload"]
    assert r["block_events"] >= 3000
    counts: dict[tuple[int, str, int], int] = {}
    for i in range(r["steps"]):
        f = sub.recv()
        assert seq_of(f) == i
        fold(counts, decode(f), vllm=True)
    assert sub.nothing_pending()
    truth = truth_counts(pp)
    assert counts == truth
    assert max(truth.values()) >= 2, "the workload stores duplicates"
    assert {m for _, m, _ in truth} == {"GPU", "CPU", "STORAGE"}


def test_zmq_publisher_burst_workload_sends_everything_and_folds_to_truth(spawn: Spawn) -> None:
    pp, sub = spawn()
    r = pp.call("workload", wait=True, events=2000, burst=True, batch_events=16, seed=3)
    w = r["workload"]
    assert w["send_s"] > 0
    assert w["bytes"] > 0
    counts: dict[tuple[int, str, int], int] = {}
    for i in range(w["steps"]):
        f = sub.recv()
        assert seq_of(f) == i
        fold(counts, decode(f), vllm=True)
    assert counts == truth_counts(pp)
    assert pp.call("store", n=1, step=True)["seq"] == w["steps"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"events": 0, "burst": True}, "burst needs"),
        ({"dup_prob": 2.0}, "dup_prob"),
        ({"speed": 1}, "speed"),
        ({"groups": [1]}, None),
    ],
)
def test_zmq_publisher_bad_workload_is_refused_before_it_starts(
    spawn: Spawn, args: dict[str, Any], match: str | None
) -> None:
    pp, _ = spawn(flavour="sglang")
    with pytest.raises(PublisherError, match=match or "carry no group"):
        pp.call("workload", **args)
    assert pp.call("stats")["workload_running"] is False


def test_zmq_publisher_workload_runs_until_stop_and_counts_cpu(spawn: Spawn) -> None:
    pp, _ = spawn()
    assert pp.call("workload", events=0, rate=50_000, seed=1)["started"] is True
    sub_stats = pp.call("stats")
    assert sub_stats["workload_running"] is True
    r = pp.call("stop")["workload"]
    s = pp.call("stats")
    assert r["block_events"] > 0
    assert s["block_events_queued"] == r["block_events"]
    assert s["sent"] == r["steps"]
    assert s["cpu_s"] > 0
    assert s["publisher_thread_cpu_s"] > 0


# --- replay ---------------------------------------------------------------------------------


def test_zmq_publisher_vllm_replay_sends_topic_seq_payload_then_end_marker(spawn: Spawn) -> None:
    pp, sub = spawn(topic="t", flavour="vllm")
    for _ in range(4):
        pp.call("store", n=1, step=True)
    live = [sub.recv() for _ in range(4)]
    got = sub.replay(2)
    assert got[:-1] == [[b"", b"t", f[1], f[2]] for f in live[2:]]
    assert got[-1] == [b"", b"", END_SEQ, b""]


def test_zmq_publisher_sglang_replay_has_no_topic_frame(spawn: Spawn) -> None:
    pp, sub = spawn(topic="t", flavour="sglang")
    pp.call("store", n=1, step=True)
    live = sub.recv()
    assert sub.replay(0) == [[b"", live[1], live[2]], [b"", END_SEQ, b""]]


def test_zmq_publisher_replay_topic_can_be_forced(spawn: Spawn) -> None:
    pp, sub = spawn(topic="t", flavour="sglang", replay_topic=True)
    pp.call("store", n=1, step=True)
    assert [len(f) for f in sub.replay(0)] == [4, 4]


def test_zmq_publisher_replay_buffer_keeps_last_buffer_steps(spawn: Spawn) -> None:
    pp, sub = spawn(buffer_steps=3)
    for _ in range(5):
        pp.call("store", n=1, step=True)
    got = sub.replay(0)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [2, 3, 4]
    assert pp.call("stats")["buffered"] == 3


def test_zmq_publisher_gap_is_covered_by_replay(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=1, step=True)
    pp.call("gap", batches=2)
    for _ in range(3):
        pp.call("store", n=1, step=True)
    assert [seq_of(sub.recv()) for _ in range(2)] == [0, 3]
    got = sub.replay(1)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [1, 2, 3]
    counts: dict[tuple[int, str, int], int] = {}
    for f in sub.replay(0)[:-1]:
        fold(counts, msgspec.msgpack.decode(f[3]), vllm=True)
    assert counts == truth_counts(pp)
    assert len(counts) == 4


def test_zmq_publisher_evicted_gap_is_not_in_replay(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=1, step=True)
    pp.call("gap", batches=2, evict=True)
    for _ in range(3):
        pp.call("store", n=1, step=True)
    assert [seq_of(sub.recv()) for _ in range(2)] == [0, 3]
    got = sub.replay(1)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [3]
    assert len(pp.truth()) == 4  # the engine holds the lost batches' blocks all the same


def test_zmq_publisher_without_replay_endpoint_has_none(spawn: Spawn) -> None:
    pp, sub = spawn(replay_endpoint=None)
    assert pp.ready["replay"] is None
    assert sub.dealer is None


def test_zmq_publisher_replay_never_answers(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=1, step=True)
    pp.call("replay", mode="never")
    assert sub.dealer is not None
    sub.dealer.send_multipart([b"", bytes(8)])
    assert not sub.dealer.poll(300)
    pp.call("flush")  # the thread polls the replay socket before it takes the barrier
    assert pp.call("stats")["replay_ignored"] == 1
    pp.call("replay", mode="normal")
    assert [len(f) for f in sub.replay(0)] == [4, 4]


def test_zmq_publisher_replay_slow_still_answers(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=1, step=True)
    pp.call("replay", mode="slow", delay_s=0.3)
    assert [len(f) for f in sub.replay(0)] == [4, 4]


# --- faults ---------------------------------------------------------------------------------


def test_zmq_publisher_restart_resets_seq_buffer_and_truth(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("store", n=2, step=True)
    pp.call("store", n=2, step=True)
    assert pp.call("restart")["life"] == 1
    assert pp.truth() == set()
    h = pp.call("store", n=1, step=True)["hashes"]
    assert [seq_of(sub.recv()) for _ in range(3)] == [0, 1, 0]
    assert [len(f) for f in sub.replay(0)] == [4, 4]
    assert pp.truth() == {(key_of(h[0]), "GPU")}


def test_zmq_publisher_foreign_dp_rank_batch_is_not_truth(spawn: Spawn) -> None:
    pp, sub = spawn(dp_rank=0)
    pp.call("store", n=1)
    assert pp.call("step", dp_rank=5)["seq"] == 0
    assert decode(sub.recv())[2] == 5
    assert pp.truth() == set()


def test_zmq_publisher_block_size_mismatch_is_not_truth(spawn: Spawn) -> None:
    pp, sub = spawn(block_size=16)
    pp.call("store", n=1, block_size=32)
    keep = pp.call("store", n=1, step=True)["keys"]
    assert [e["block_size"] for e in decode(sub.recv())[1]] == [32, 16]
    assert pp.truth() == {(keep[0], "GPU")}
    assert pp.call("stats")["excluded_events"] == 1


def test_zmq_publisher_unknown_medium_is_not_truth(spawn: Spawn) -> None:
    pp, _ = spawn()
    pp.call("store", n=1, medium="TAPE", step=True)
    assert pp.truth() == set()


@pytest.mark.parametrize("kind", ["frame_count", "seq_bytes"])
def test_zmq_publisher_malformed_frames_take_no_seq(spawn: Spawn, kind: str) -> None:
    pp, sub = spawn()
    assert pp.call("malformed", kind=kind)["seq"] is None
    bad = sub.recv()
    if kind == "frame_count":
        assert len(bad) == 2
    else:
        assert len(bad) == 3 and len(bad[1]) == 3
    assert pp.call("store", n=1, step=True)["seq"] == 0
    assert seq_of(sub.recv()) == 0


@pytest.mark.parametrize(
    ("kind", "encoding"),
    [
        ("not_msgpack", "map"),
        ("shape", "map"),
        ("unknown_event", "map"),
        ("field_types", "map"),
        ("unknown_event", "positional"),
        ("field_types", "positional"),
    ],
)
def test_zmq_publisher_malformed_payload_takes_a_seq_replay_repairs(
    spawn: Spawn, kind: str, encoding: str
) -> None:
    pp, sub = spawn(encoding=encoding)
    assert pp.call("malformed", kind=kind)["seq"] == 0
    bad = sub.recv()
    assert seq_of(bad) == 0
    if kind == "not_msgpack":
        with pytest.raises(msgspec.DecodeError):
            decode(bad)
    elif kind == "shape":
        assert isinstance(decode(bad), dict)
    else:
        ev = decode(bad)[1][0]
        tag = ev["type"] if isinstance(ev, dict) else ev[0]
        hashes = ev["block_hashes"] if isinstance(ev, dict) else ev[1]
        assert tag == ("BlockMoved" if kind == "unknown_event" else "BlockStored")
        assert kind == "unknown_event" or isinstance(hashes, str)
    (good, end) = sub.replay(0)
    assert msgspec.msgpack.decode(good[3])[1] == []
    assert end[-2] == END_SEQ
    assert pp.truth() == set()


def test_zmq_publisher_malformed_replay_as_same_replays_the_bad_bytes(spawn: Spawn) -> None:
    pp, sub = spawn()
    pp.call("malformed", kind="not_msgpack", replay_as="same")
    bad = sub.recv()
    assert sub.replay(0)[0][3] == bad[2]


def test_zmq_publisher_health_endpoint_switches(spawn: Spawn) -> None:
    pp, _ = spawn(health=True)
    url = pp.ready["health"]
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
    pp.call("health", ok=False)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=5)
    assert e.value.code == 503
    e.value.close()
    pp.call("health", ok=True)
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200


def test_zmq_publisher_health_off_by_default(spawn: Spawn) -> None:
    pp, _ = spawn()
    assert pp.ready["health"] is None
    with pytest.raises(PublisherError, match="health endpoint not enabled"):
        pp.call("health", ok=False)


# --- property: the stream folds to the truth -----------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear", "step"]),
        st.lists(st.integers(0, 7), min_size=1, max_size=4),
        st.sampled_from(["GPU", "CPU"]),
        st.integers(0, 1),
    ),
    max_size=30,
)


@pytest.fixture(scope="module")
def inproc() -> Iterator[tuple[Publisher, zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = Publisher(PublisherConfig(replay_endpoint=None, encoding="positional"))
    sub = c.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoints["pub"])
    pub.wait_subscribers(1)
    yield pub, sub
    sub.close(linger=0)
    pub.close()
    c.destroy(linger=0)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_ops)
def test_zmq_publisher_stream_fold_equals_truth(
    inproc: tuple[Publisher, zmq.Socket[bytes]], ops: list[tuple[str, list[int], str, int]]
) -> None:
    pub, sub = inproc
    pub.restart()
    universe = [(1 << 63) + i for i in range(8)]  # few hashes: many duplicates and re-stores
    for op, idx, medium, group in ops:
        hs = [universe[i] for i in idx]
        if op == "store":
            pub.store(hs, medium=medium, group=group)
        elif op == "remove":
            pub.remove(hs, medium=medium, group=group)
        elif op == "clear":
            pub.clear()
        else:
            pub.step()
    last = pub.step(force=True)
    counts: dict[tuple[int, str, int], int] = {}
    while True:
        assert sub.poll(5000)
        f = sub.recv_multipart()
        fold(counts, msgspec.msgpack.decode(f[2]), vllm=True)
        if int.from_bytes(f[1], "big") == last:
            break
    assert counts == pub.truth()
