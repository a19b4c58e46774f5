"""The fast request encoders produce what the Struct encoders produce, up to key spelling.

The fast encoders write every block_key as 20 zero-padded digits of its unsigned value, which
KVCM reads as the same int64 bit pattern (contract §4.2, §12); everything else is byte-equal.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.kvcm_client import wire as W
from sidecar.shm_ring import compiled

# Over the C digit writer (_accel.digits) and its numpy form (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

U64 = 1 << 64


def _canonical(body: bytes | memoryview) -> tuple[Any, list[str]]:
    """The decoded request with block keys as int64 patterns, and the key texts as written."""
    texts: list[str] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            out = {k: walk(v) for k, v in obj.items()}
            if "block_key" in out:
                texts.append(obj["block_key"])
                v = int(obj["block_key"])
                out["block_key"] = v - U64 if v >= 1 << 63 else v
            return out
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(msgspec.json.decode(body)), texts


SPEC = W.Spec("full", "event_report://10.0.0.1:8000/hbm?size=4096")
KEYS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40, unique=True)


@given(adds=KEYS, deletes=KEYS)
def test_encode_deltas_equals_struct_encoding(adds: list[int], deletes: list[int]) -> None:
    fast = W.encode_deltas("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", adds, deletes, "hbm", SPEC)
    events = [W.ev_add(k, "hbm", SPEC) for k in adds] + [
        W.ev_delete(k, "hbm", "full") for k in deletes
    ]
    slow = W.encode(W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", events))
    got, texts = _canonical(fast)
    assert got == _canonical(slow)[0]
    assert all(len(t) == W.KEY_DIGITS and t.isdigit() for t in texts)
    arrays = W.encode_deltas(
        "t",
        "i",
        "h:1",
        "ST_EVENT_REPORT_L1P5",
        np.array(adds, np.int64),
        np.array(deletes, np.int64),
        "hbm",
        SPEC,
    )
    assert arrays == fast


@given(keys=KEYS)
def test_encode_snapshot_equals_struct_encoding(keys: list[int]) -> None:
    fast = W.encode_snapshot("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", keys, "hbm", SPEC)
    blocks = [W.SnapshotBlock(str(k), "hbm", [SPEC]) for k in keys]
    slow = W.encode(
        W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", [W.ev_snapshot(blocks)])
    )
    got, texts = _canonical(fast)
    assert got == _canonical(slow)[0]
    assert all(len(t) == W.KEY_DIGITS and t.isdigit() for t in texts)


MEDIUMS = ("hbm", "mem", "disk")
SPECS = [W.Spec("full", f"event_report://10.0.0.1:8000/{m}?size=4096") for m in MEDIUMS]
TAGGED = st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2)), max_size=30)


@given(adds=TAGGED, deletes=TAGGED)
def test_encode_deltas_per_key_mediums_equals_struct_encoding(
    adds: list[tuple[int, int]], deletes: list[tuple[int, int]]
) -> None:
    fast = W.encode_deltas(
        "t",
        "i",
        "h:1",
        "ST_EVENT_REPORT_L1P5",
        [k for k, _ in adds],
        [k for k, _ in deletes],
        MEDIUMS,
        SPECS,
        np.array([m for _, m in adds], np.uint8),
        np.array([m for _, m in deletes], np.uint8),
    )
    events = [W.ev_add(k, MEDIUMS[m], SPECS[m]) for k, m in adds] + [
        W.ev_delete(k, MEDIUMS[m], "full") for k, m in deletes
    ]
    slow = W.encode(W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", events))
    assert _canonical(fast)[0] == _canonical(slow)[0]


@given(keys=TAGGED)
def test_encode_snapshot_per_key_mediums_equals_struct_encoding(
    keys: list[tuple[int, int]],
) -> None:
    fast = W.encode_snapshot(
        "t",
        "i",
        "h:1",
        "ST_EVENT_REPORT_L1P5",
        [k for k, _ in keys],
        MEDIUMS,
        SPECS,
        np.array([m for _, m in keys], np.uint8),
    )
    blocks = [W.SnapshotBlock(str(k), MEDIUMS[m], [SPECS[m]]) for k, m in keys]
    slow = W.encode(
        W.ReportEventRequest("t", "i", "h:1", "ST_EVENT_REPORT_L1P5", [W.ev_snapshot(blocks)])
    )
    assert _canonical(fast)[0] == _canonical(slow)[0]


def test_encode_deltas_writes_extreme_keys_as_their_unsigned_20_digits() -> None:
    keys = [0, 1, -1, 2**63 - 1, -(2**63), 10**19 - 1, -(10**18)]
    body = W.encode_deltas("t", "i", "h:1", "vineyard", keys, [], "hbm", SPEC)
    _decoded, texts = _canonical(body)
    assert texts == [f"{k % U64:020d}" for k in keys]


_CODE = st.one_of(st.sampled_from(["OK", "INTERNAL_ERROR", "UNSPECIFIED"]), st.integers(0, 9))
_ANSWER = st.fixed_dictionaries(
    {},
    optional={
        "header": st.fixed_dictionaries(
            {},
            optional={
                "status": st.fixed_dictionaries(
                    {}, optional={"code": _CODE, "message": st.text(max_size=8)}
                ),
                "request_id": st.text(max_size=8),
            },
        ),
        "item_results": st.lists(_CODE, max_size=4),
        "committed_snapshot_version": st.text("0123456789abcdef", max_size=32),
        "retry_after_ms": st.one_of(
            st.integers(0, 10**6), st.from_regex(r"\d{1,6}", fullmatch=True)
        ),
        "snapshot_required": st.booleans(),
        "extra_info": st.text(max_size=8),
        "unknown_field": st.dictionaries(st.text("abc", max_size=3), st.integers(), max_size=2),
    },
)


@given(_ANSWER, st.booleans())
def test_decode_response_struct_path_matches_the_dict_path(
    answer: dict[str, Any], camel: bool
) -> None:
    """A body in snake_case names is decoded straight into the Struct; in camelCase through a
    dict: both read the same answer, and the direct path equals the dict path on any body."""
    names = {k: (W._camel(k) if camel else k) for k in answer}
    body = msgspec.json.encode({names[k]: v for k, v in answer.items()})
    got = W.decode_response(body)
    assert got == W._via_dict(body)
    assert got == W._via_dict(msgspec.json.encode(answer))


@given(
    st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.booleans()), max_size=40),
    st.sampled_from(["hbm", "mem"]),
)
def test_encode_batch_is_encode_deltas_of_its_adds_then_deletes(
    items: list[tuple[int, bool]], medium: str
) -> None:
    """The one-call body (_wire.c) is byte for byte encode_deltas(adds, deletes) of the same
    keys, adds first, each in the given order; so is its fallback without the extension."""
    keys = np.array([k for k, _ in items], np.int64)
    pub = np.array([p for _, p in items], np.bool_)
    spec = W.Spec("tp0", f"local://h/{medium}?blocks=4096")
    who = ('trace-\u00e9"1', "inst", "127.0.0.1:1", "vllm")
    want = bytes(W.encode_deltas(*who, keys[pub], keys[~pub], medium, spec))
    got = W.encode_batch(*who, keys, pub, medium, spec)
    assert bytes(got) == want
    assert isinstance(got, bytes) == (getattr(compiled.accel, "delta_body", None) is not None)
    # The batch form take_batch gives: adds first, `nadd` of them (an int for the flags).
    order = np.argsort(~pub, kind="stable")
    nadd = int(pub.sum())
    assert bytes(W.encode_batch(*who, keys[order], nadd, medium, spec)) == want
    saved = compiled.accel
    try:
        compiled.accel = None
        assert bytes(W.encode_batch(*who, keys, pub, medium, spec)) == want
        assert bytes(W.encode_batch(*who, keys[order], nadd, medium, spec)) == want
    finally:
        compiled.accel = saved


@given(st.text(max_size=12), st.text(max_size=12), st.text(max_size=12), st.text(max_size=6))
def test_envelope_head_is_the_struct_encoding(
    trace_id: str, instance_id: str, host_ip_port: str, storage_type: str
) -> None:
    """The cached envelope (everything after the trace id formatted once per reporter) is the
    Struct's own encoding up to its events' `[`, whatever the strings hold."""
    full = W.encode(W.ReportEventRequest(trace_id, instance_id, host_ip_port, storage_type, []))
    assert W._envelope_head(trace_id, instance_id, host_ip_port, storage_type) == full[:-2]
