"""engine_hook/include/kvcm_ring.h against the Python producer: compile checks, descriptor and
segment-name fidelity, gating, attach errors as codes, problem counters, snapshots, doorbell.

The C engine is sidecar/testbed/c/kvcm_test_engine.c, compiled once per run with the system compiler
(the tests skip, saying so, only when there is none) and run as a real separate process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_hook.descriptor import Descriptor, DescriptorError, build
from engine_hook.gating import gate_reason
from sidecar.shm_ring import layout as L
from sidecar.shm_ring import snapshot
from sidecar.shm_ring.doorbell import Listener
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.shm_ring.writer import ProducerConflict, RingWriter
from tests import cbuild

KVCM_OK, KVCM_GATED, KVCM_E_CONFIG, KVCM_E_LAYOUT, KVCM_E_CORRUPT = 0, 1, -1, -2, -3
KVCM_E_PERMISSION, KVCM_E_CONFLICT, KVCM_E_CAPACITY = -4, -5, -7


@pytest.fixture(scope="module")
def engine() -> Path:
    return cbuild.build("kvcm_test_engine.c")


class Ops:
    """The C engine in `ops` mode: one stats line per command."""

    def __init__(self, engine: Path, ring: str, capacity: int = 16, **popen: Any) -> None:
        self.p = subprocess.Popen(
            [str(engine), "ops", ring, str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            **popen,
        )
        self.ready = self._line()

    def _line(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"C engine exited rc={self.p.wait()}"
        out: dict[str, Any] = json.loads(line)
        return out

    def __call__(self, cmd: str) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._line()

    def close(self) -> int:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.close()
        rc = self.p.wait(timeout=10)
        self.p.stdout.close()
        return rc


def _env_attach(engine: Path, env: dict[str, str]) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KV_CACHE_EVENT_")}
    res = subprocess.run(
        [str(engine), "env"], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def _python_attach_reason(env: dict[str, str]) -> tuple[Descriptor | None, str]:
    """What engine_hook.attach() makes of the same environment: (descriptor, NullHook reason)."""
    try:
        d = build({}, env)
    except DescriptorError as exc:
        return None, f"invalid config: {exc}"
    return d, gate_reason(d) or ""


@pytest.fixture
def ids() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        unlink(n)


# ---- compile checks ------------------------------------------------------------------------
def test_c_header_compiles_as_pedantic_c99_and_as_cxx17(engine: Path) -> None:
    """gcc -std=c99 -Wall -Wextra -Werror -pedantic (the engine fixture) and g++ -std=c++17."""
    assert engine.exists()
    assert cbuild.build("kvcm_test_engine.c", cxx=True).exists()
    assert cbuild.build("kvcm_test_engine.c", opt="-O0").exists()


def test_c_header_compiles_under_stricter_engine_warnings() -> None:
    assert cbuild.build("kvcm_test_engine.c", extra=cbuild.STRICT).exists()
    assert cbuild.build("kvcm_test_engine.c", cxx=True, extra=cbuild.STRICT_CXX).exists()


def test_c_header_declares_exactly_the_public_names() -> None:
    text = cbuild.HEADER.read_text()
    returns = {"kvcm_ring_attach": "int", "kvcm_ring_poll": "int"}
    for name in (
        "kvcm_ring_attach",
        "kvcm_ring_stored",
        "kvcm_ring_removed",
        "kvcm_ring_cleared",
        "kvcm_ring_poll",
        "kvcm_ring_stats",
        "kvcm_ring_close",
    ):
        assert f"static inline {returns.get(name, 'void')} {name}(" in text
    defined = re.findall(r"^static inline [\w\s\*]+?\b(\w+)\(", text, re.M)
    assert defined and all(n.startswith("kvcm_") for n in defined), defined
    macros = re.findall(r"^#define (\w+)", text, re.M)
    assert all(m.startswith("KVCM") or m.startswith("_") for m in macros), macros


# ---- descriptor, segment name, gating ------------------------------------------------------
_FULL_ENV = {
    "KV_CACHE_EVENT_INSTANCE_ID": 'pod-7/éx "q" ☃',
    "KV_CACHE_EVENT_DP_RANK": " 3 ",
    "KV_CACHE_EVENT_TP_SIZE": "4",
    "KV_CACHE_EVENT_DP_SIZE": "8",
    "KV_CACHE_EVENT_MODEL_NAME": "Qwen/Qwen3-8B\ttab",
    "KV_CACHE_EVENT_DTYPE": "bf16",
    "KV_CACHE_EVENT_USE_MLA": "Yes",
    "KV_CACHE_EVENT_BLOCK_SIZE_TOKENS": "1_024",
    "KV_CACHE_EVENT_GROUP_BLOCK_BYTES": "4096, 1024,,2048",
    "KV_CACHE_EVENT_REQUIRED_GROUPS": "0,2",
    "KV_CACHE_EVENT_MEDIUM": "hbm",
    "KV_CACHE_EVENT_MEDIUMS": " mem, disk ,hbm,mem",
    "KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": "2.5",
    "KV_CACHE_EVENT_EXTRA": "role=prefill,zone=a=b,role=decode",
    "KV_CACHE_EVENT_RING_CAPACITY_SLOTS": "64",
}


def test_c_header_descriptor_json_and_segment_name_match_python(
    engine: Path, ids: list[str]
) -> None:
    d, reason = _python_attach_reason(_FULL_ENV)
    assert d is not None and reason == ""
    name = L.segment_name(d.instance_id, d.dp_rank)
    ids.append(name)
    out = _env_attach(engine, _FULL_ENV)
    assert out["code"] == KVCM_OK, out
    assert out["ring"] == name
    seg = Segment(name)
    try:
        assert seg.read_descriptor() == d.to_json()  # byte for byte
        assert Descriptor.from_json(seg.read_descriptor()).medium_table() == ("hbm", "mem", "disk")
        assert seg.capacity == 64
        assert int(seg.hdr[L.W_PRODUCER_STATE]) == L.PRODUCER_CLOSED  # the engine freed its handle
    finally:
        seg.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    instance_id=st.text(
        st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\x00"),
        min_size=1,
        max_size=90,
    ),
    dp_rank=st.integers(0, 1000),
    delay=st.floats(0.001, 1e6, allow_nan=False),
)
def test_c_header_any_identity_gets_the_python_name_and_json(
    engine: Path, ids: list[str], instance_id: str, dp_rank: int, delay: float
) -> None:
    env = {
        "KV_CACHE_EVENT_INSTANCE_ID": instance_id,
        "KV_CACHE_EVENT_DP_RANK": str(dp_rank),
        "KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": repr(delay),
        "KV_CACHE_EVENT_RING_CAPACITY_SLOTS": "16",
    }
    d = build({}, env)
    name = L.segment_name(instance_id, dp_rank)
    ids.append(name)
    out = _env_attach(engine, env)
    assert out["ring"] == name and out["code"] == KVCM_OK, out
    seg = Segment(name)
    try:
        assert seg.read_descriptor() == d.to_json()
    finally:
        seg.close()


@pytest.mark.parametrize(
    "env",
    [
        {"KV_CACHE_EVENT_PUBLISHER_TYPE": "None"},
        {"KV_CACHE_EVENT_TP_RANK": "1"},
        {"KV_CACHE_EVENT_PP_SIZE": "2"},
        {"KV_CACHE_EVENT_CP_SHARDED_KV": "true"},
        {"KV_CACHE_EVENT_PREFIX_REUSE": "off"},
        {"KV_CACHE_EVENT_INSTANCE_ID": ""},
        {"KV_CACHE_EVENT_PUBLISHER_TYPE": "zmq"},
        {"KV_CACHE_EVENT_DP_RANK": "x1"},
        {"KV_CACHE_EVENT_DP_RANK": "-1"},
        {"KV_CACHE_EVENT_TP_SIZE": "0"},
        {"KV_CACHE_EVENT_USE_MLA": "maybe"},
        {"KV_CACHE_EVENT_GROUP_BLOCK_BYTES": "4096,0"},
        {"KV_CACHE_EVENT_GROUP_BLOCK_BYTES": "4096,x"},
        {"KV_CACHE_EVENT_REQUIRED_GROUPS": "1"},
        {"KV_CACHE_EVENT_MEDIUM": "h#m"},
        {"KV_CACHE_EVENT_MEDIUMS": "mem,d#sk"},
        {"KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": "0"},
        {"KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": "soon"},
    ],
    ids=lambda e: ",".join(f"{k[15:].lower()}={v}" for k, v in e.items()),
)
def test_c_header_gating_and_invalid_config_match_python(
    engine: Path, ids: list[str], env: dict[str, str]
) -> None:
    """The same rule refuses the same rank with the same words, before any shm is touched."""
    full = {"KV_CACHE_EVENT_INSTANCE_ID": f"gate-{uuid.uuid4().hex[:6]}", **env}
    d, reason = _python_attach_reason(full)
    assert reason, "each case is gated or invalid in Python"
    out = _env_attach(engine, full)
    assert out["reason"] == reason
    assert out["code"] == (KVCM_GATED if d is not None else KVCM_E_CONFIG)
    assert out["enabled"] == 0
    if d is not None:
        assert not Path("/dev/shm" + L.segment_name(d.instance_id, d.dp_rank)).exists()


# ---- attach errors: a code and a message, and the engine keeps running -------------------
def _refused(engine: Path, ring: str, code: int, words: str, **popen: Any) -> dict[str, Any]:
    ops = Ops(engine, ring, **popen)
    try:
        assert ops.ready == {"ready": False, "code": code}
        out = ops("stored 0 0 1 2 3")  # a no-op handle: accepted, nothing published
        assert out["enabled"] == 0 and out["code"] == code and words in out["reason"], out
        assert ops("cleared")["last_seq"] == 0
    finally:
        assert ops.close() == 0
    return out


def test_c_header_refuses_a_newer_layout(engine: Path, ring_name: str) -> None:
    seg = Segment(ring_name, 16)
    seg.hdr[L.W_VERSION_SLOT] = (L.LAYOUT_VERSION + 1) | (L.SLOT_SIZE << 32)
    try:
        _refused(engine, ring_name, KVCM_E_LAYOUT, "upgrade the sidecar image first")
        assert int(seg.hdr[L.W_TAIL]) == 0 and int(seg.hdr[L.W_BOOT_ID]) == 0
        seg.hdr[L.W_VERSION_SLOT] = L.LAYOUT_VERSION | (24 << 32)
        _refused(engine, ring_name, KVCM_E_LAYOUT, "ring slot size 24 != 32: layout mismatch")
    finally:
        seg.close()


def test_c_header_refuses_a_corrupt_header(engine: Path, ring_name: str) -> None:
    seg = Segment(ring_name, 16)
    try:
        seg.hdr[L.W_MAGIC] = 0xDEAD
        _refused(engine, ring_name, KVCM_E_CORRUPT, "bad magic 0xdead")
        seg.hdr[L.W_MAGIC] = L.MAGIC
        seg.hdr[L.W_CAPACITY] = 17
        _refused(engine, ring_name, KVCM_E_CORRUPT, "corrupt header (capacity 17)")
        seg.hdr[L.W_CAPACITY] = 1 << 20  # more slots than the file holds
        _refused(engine, ring_name, KVCM_E_CORRUPT, "4608 bytes < capacity 1048576")
    finally:
        seg.close()


def test_c_header_refuses_another_capacity(engine: Path, ring_name: str) -> None:
    seg = Segment(ring_name, 32)  # the engine asks for 16
    try:
        _refused(engine, ring_name, KVCM_E_CAPACITY, "has capacity 32, this side asked for 16: set")
    finally:
        seg.close()


def test_c_header_refuses_a_segment_it_may_not_open(engine: Path, ring_name: str) -> None:
    seg = Segment(ring_name, 16)  # mode 0600, owned by this user
    path = Path("/dev/shm" + ring_name)
    try:
        if os.geteuid() == 0:  # root opens anything: run the engine as another user instead
            _refused(engine, ring_name, KVCM_E_PERMISSION, "Permission denied", user=65534)
        else:
            path.chmod(0)
            _refused(engine, ring_name, KVCM_E_PERMISSION, "Permission denied")
    finally:
        path.chmod(0o600)
        seg.close()


def test_c_header_refuses_a_second_live_producer_and_python_refuses_it(
    engine: Path, ring_name: str
) -> None:
    seg = Segment(ring_name, 16)
    w = RingWriter(seg)  # a live Python producer (this process)
    try:
        _refused(
            engine, ring_name, KVCM_E_CONFLICT, f"already has a live producer pid={os.getpid()}"
        )
        w.close()
        ops = Ops(engine, ring_name)  # the Python one closed: the C one attaches
        assert ops.ready["code"] == KVCM_OK
        with pytest.raises(ProducerConflict):
            RingWriter(seg)  # and now Python is refused the other way round
        ops.close()
    finally:
        seg.close()


# ---- counters, snapshots, liveness, doorbell, close ------------------------------------------
def test_c_header_counts_every_problem_and_publishes_the_rest(engine: Path, ring_name: str) -> None:
    ops = Ops(engine, ring_name)
    try:
        assert ops("stored 2 0 1")["bad_group"] == 1  # groups 0 and 1 only
        assert ops("stored 0 3 1")["bad_medium"] == 1  # table: hbm, mem, disk
        assert ops("stored -1 0 1")["bad_group"] == 2
        out = ops("stored 0 0 " + " ".join(str(k) for k in range(20)))  # 16 slots
        assert (out["last_seq"], out["dropped"], out["attempted"]) == (16, 4, 20)
        out = ops("close")
        assert out["closed"] == 1 and out["enabled"] == 0 and out["reason"] == "closed"
        assert ops("stored 0 0 1")["after_close"] == 1
        assert ops("close")["after_close"] == 1  # idempotent, not a problem
    finally:
        ops.close()
    seg = Segment(ring_name)
    try:
        assert int(seg.hdr[L.W_PRODUCER_STATE]) == L.PRODUCER_CLOSED
        assert int(seg.hdr[L.W_DROPPED]) == 4 and int(seg.hdr[L.W_ATTEMPTED]) == 20
    finally:
        seg.close()


def test_c_header_snapshot_without_callback_fails_and_counts(engine: Path, ring_name: str) -> None:
    ops = Ops(engine, ring_name)
    seg = Segment(ring_name)
    try:
        ops("nocallback")
        req = snapshot.request(seg)
        out = ops("poll")
        assert out["snapshot_failed"] == 1 and out["snapshot_no_callback"] == 1
        with pytest.raises(snapshot.SnapshotFailed):
            snapshot.poll(seg, req)
    finally:
        seg.close()
        ops.close()


def test_c_header_snapshot_answers_with_the_fence_and_mediums(engine: Path, ring_name: str) -> None:
    ops = Ops(engine, ring_name, capacity=1024)
    seg = Segment(ring_name)
    try:
        ops("stored 0 0 5 -6 7")
        ops("stored 1 2 5")
        ops("removed 0 0 7")
        before = ops("poll")
        req = snapshot.request(seg)
        assert snapshot.poll(seg, req) is None  # not answered before the next poll
        out = ops("poll")
        assert out["snapshots"] == 1 and out["polls"] == before["polls"] + 1
        snap = snapshot.poll(seg, req)
        assert snap is not None and snap.seq == 5 and snap.boot_id == out["boot_id"]
        held = {
            (int(k), int(m)): int(b)
            for k, b, m in zip(snap.keys, snap.masks, snap.mediums, strict=True)
            if b
        }
        assert held == {(5, 0): 1, (-6, 0): 1, (5, 2): 2}
    finally:
        seg.close()
        ops.close()


def test_c_header_poll_stamps_liveness(engine: Path, ring_name: str) -> None:
    ops = Ops(engine, ring_name)
    seg = Segment(ring_name)
    try:
        t0 = int(seg.hdr[L.W_LIVENESS_NS])
        ops("stored 0 0 1")
        assert int(seg.hdr[L.W_LIVENESS_NS]) == t0  # the hot path never reads a clock
        ops("poll")
        assert int(seg.hdr[L.W_LIVENESS_NS]) > t0
    finally:
        seg.close()
        ops.close()


def test_c_header_rings_the_doorbell_only_while_the_reader_sleeps(
    engine: Path, ring_name: str
) -> None:
    seg = Segment(ring_name, 16)
    rung = threading.Event()
    bell = Listener(ring_name, seg.hdr, rung.set)
    ops = Ops(engine, ring_name)
    try:
        assert ops("stored 0 0 1")["bells"] == 0  # the reader is awake: no post
        bell.asleep(True)
        assert ops("stored 0 0 2")["bells"] == 1
        assert rung.wait(10)
        bell.asleep(False)
        assert ops("stored 0 0 3")["bells"] == 1
    finally:
        ops.close()
        bell.close()
        seg.close()


def test_c_header_constants_match_layout() -> None:
    """Every header word index, magic and size in kvcm_ring.h is layout.py's."""
    text = cbuild.HEADER.read_text()
    words = dict(re.findall(r"KVCM_(W_\w+) = (\d+)", text))
    assert words == {n: str(getattr(L, n)) for n in dir(L) if n.startswith("W_")}
    snap_words = dict(re.findall(r"KVCM_(SW_\w+) = (\d+)", text))
    assert snap_words == {n: str(getattr(L, n)) for n in dir(L) if n.startswith("SW_")}
    defines = dict(re.findall(r"^#define KVCM_(\w+) (0x[0-9A-F]+ULL|\d+u?)", text, re.M))
    for name in (
        "LAYOUT_VERSION",
        "SLOT_SIZE",
        "HEADER_SIZE",
        "DESCRIPTOR_OFFSET",
        "MIN_CAPACITY",
        "SNAP_HEADER_SIZE",
        "SNAP_ENTRY_BYTES",
        "SNAP_FLAG_MEDIUMS",
        "MAGIC",
        "SNAP_MAGIC",
        "MAX_GROUPS",
    ):
        value = int(defines[name].rstrip("ULu"), 0)
        assert value == getattr(L, name), name
    assert L.DEFAULT_CAPACITY_SLOTS == 1 << 16
    assert "#define KVCM_DEFAULT_CAPACITY_SLOTS (1u << 16)" in text


def _doc_example(tmp_path: Path) -> Path:
    doc = (cbuild.ROOT / "docs" / "ring.md").read_text()
    section = doc[doc.index("## C and C++ producers") :]
    code = section[section.index("```c\n") + 5 :]
    src = tmp_path / "engine.c"
    src.write_text(code[: code.index("```")])
    return src


def test_c_header_doc_example_compiles_and_publishes(tmp_path: Path, ring_name: str) -> None:
    """The complete example in docs/ring.md, compiled as documented and run as an engine."""
    binary = cbuild.build(_doc_example(tmp_path))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KV_CACHE_EVENT_")}
    env = {**clean, "KV_CACHE_EVENT_INSTANCE_ID": "doc", "KV_CACHE_EVENT_RING_NAME": ring_name}
    res = subprocess.run([str(binary)], env=env, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "published=736 dropped=0 problems=0"  # 100x4 stored, 84x4 evicted
    seg = Segment(ring_name)
    reader = RingReader(seg, exclusive=False)
    try:
        held: set[int] = set()
        for _, key, meta, _ in reader.read().records.tolist():
            (held.add if meta & 0xFF == L.KIND_STORED else held.discard)(key)
        assert held == set(range(336, 400))  # the table's last 64 blocks
        assert int(seg.hdr[L.W_PRODUCER_STATE]) == L.PRODUCER_CLOSED
        assert Descriptor.from_json(seg.read_descriptor()).model_name == "toy-model"
    finally:
        reader.close()
        seg.close()


def test_c_header_doc_example_compiles_as_cxx(tmp_path: Path) -> None:
    assert cbuild.build(_doc_example(tmp_path), cxx=True).exists()


def test_c_header_helper_thread_stamps_liveness_and_answers_snapshots(
    engine: Path, ring_name: str
) -> None:
    """With kvcm_ring_start_thread, an engine that does nothing still looks alive and answers."""
    p = subprocess.Popen(
        [str(engine), "cache", ring_name, "thread-test", "1024", "1", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None
    try:
        assert json.loads(p.stdout.readline())["ready"]
        p.stdin.write('{"op":"work","n":5}\n')
        p.stdin.flush()
        published = set(json.loads(p.stdout.readline())["published"])
        seg = Segment(ring_name)
        try:
            t0 = int(seg.hdr[L.W_LIVENESS_NS])
            req = snapshot.request(seg)
            deadline = time.monotonic() + 10
            snap = None
            while snap is None:  # the engine is blocked reading stdin: only its thread runs
                assert time.monotonic() < deadline, "the helper thread never answered"
                snap = snapshot.poll(seg, req)
                time.sleep(0.005)  # polling another process's shared memory, bounded above
            assert int(seg.hdr[L.W_LIVENESS_NS]) > t0
            full = {int(k) for k, m in zip(snap.keys, snap.masks, strict=True) if m & 3 == 3}
            assert full == published
        finally:
            seg.close()
    finally:
        p.stdin.close()
        p.wait(timeout=10)
        p.stdout.close()


def test_c_header_links_into_several_translation_units(tmp_path: Path, ring_name: str) -> None:
    """Header-only: two .c files that both include it link into one program and share a handle."""
    (tmp_path / "a.c").write_text(
        '#include "kvcm_ring.h"\n'
        "void publish(kvcm_ring *r) { int64_t k = 7; kvcm_ring_stored(r, &k, 1, 0, 0); }\n"
    )
    (tmp_path / "main.c").write_text(
        '#include "kvcm_ring.h"\n'
        "void publish(kvcm_ring *r);\n"
        "int main(int argc, char **argv) {\n"
        "    kvcm_descriptor d; kvcm_ring *r; kvcm_stats s; (void)argc;\n"
        '    kvcm_descriptor_init(&d); d.instance_id = "tu"; d.ring_name = argv[1];\n'
        "    if (kvcm_ring_attach(&d, &r) != KVCM_OK) return 1;\n"
        "    publish(r); kvcm_ring_stats(r, &s); kvcm_ring_free(r);\n"
        "    return s.last_seq == 1 ? 0 : 1;\n"
        "}\n"
    )
    exe = tmp_path / "tu"
    argv = [cbuild.compiler(), *cbuild.C_FLAGS, "-O2", f"-I{cbuild.INCLUDE}"]
    srcs = [str(tmp_path / "a.c"), str(tmp_path / "main.c")]
    subprocess.run([*argv, *srcs, "-o", str(exe), "-pthread"], check=True, capture_output=True)
    assert subprocess.run([str(exe), ring_name], check=False).returncode == 0


def test_c_header_repairs_a_half_initialised_segment(engine: Path, ring_name: str) -> None:
    """A creator that died after sizing the file but before the magic: the attacher initialises."""
    fd = os.open("/dev/shm" + ring_name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, L.segment_bytes(16))
    os.close(fd)
    ops = Ops(engine, ring_name)
    try:
        assert ops.ready["code"] == KVCM_OK
        ops("stored 0 0 1")
        seg = Segment(ring_name)
        assert seg.capacity == 16 and int(seg.hdr[L.W_TAIL]) == 1
        seg.close()
    finally:
        ops.close()


def test_c_header_racing_creators_agree_on_one_valid_segment(engine: Path, ring_name: str) -> None:
    """C producers and a Python attacher started together on a fresh name: one valid header."""
    procs = [
        subprocess.Popen(
            [str(engine), "ops", ring_name, "16"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    seg = Segment(ring_name, 16)
    codes = []
    for p in procs:
        assert p.stdout is not None and p.stdin is not None
        codes.append(json.loads(p.stdout.readline())["code"])
        p.stdin.close()
    for p in procs:
        assert p.wait(timeout=10) == 0
        assert p.stdout is not None
        p.stdout.close()
    try:
        assert KVCM_OK in codes and set(codes) <= {KVCM_OK, KVCM_E_CONFLICT, -6}, codes  # -6 busy
        assert seg.capacity == 16 and int(seg.hdr[L.W_MAGIC]) == L.MAGIC
        assert int(seg.hdr[L.W_VERSION_SLOT]) == L.LAYOUT_VERSION | (L.SLOT_SIZE << 32)
    finally:
        seg.close()
