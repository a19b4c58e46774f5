"""sidecar.keys: golden vectors of every scheme (computed with the engines' own code, from
issue #22), the C rolling loop against the Python reference, canonical CBOR, `kvcm-sidecar keys`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import keys as K
from sidecar.shm_ring.rolling_hash import roll as roll_reference

ROLLING = [
    (list(range(1, 9)), [455111481605203084, 6902853672176602142]),
    ([7, 1007, 2007, 3007, 4007, -3, 151643, 7007], [455117408349224064, 6709954523241934289]),
]


@pytest.mark.parametrize(("tokens", "keys"), ROLLING)
def test_keys_rolling_golden_vectors(
    accel_backend: str, tokens: list[int], keys: list[int]
) -> None:
    assert K.rolling_keys(tokens, 4) == keys
    assert K.rolling_keys(tokens[:7], 4) == keys[:1]  # only full blocks have keys


def test_keys_vllm_sha256_cbor_seed0_golden_vectors() -> None:
    d = K.vllm_block_digests(list(range(1, 9)), 4, seed="0")
    assert [K.vllm_key(x) for x in d] == [2164874634404590027, 17270480062156288726]
    assert [K.engine_key(K.vllm_key(x)) for x in d] == [2164874634404590027, -1176264011553262890]
    # the second block chained from the first's full digest, not its int form
    assert K.vllm_block_digests([5, 6, 7, 8], 4, parent=d[0]) == d[1:]


def test_keys_sglang_page_hash_golden_vectors() -> None:
    d = K.sglang_page_digests(list(range(1, 9)), 4)
    assert [K.sglang_key(x) for x in d] == [-3488128144981237669, 5674439469042975057]
    assert K.sglang_page_digests([5, 6, 7, 8], 4, prev=d[0]) == d[1:]


def test_keys_engine_codec_keeps_low_64_bits_signed() -> None:
    assert K.engine_key(2**64 - 1) == -1
    assert K.engine_key(2**63) == -(2**63)
    assert K.engine_key(5) == 5
    assert K.engine_key(bytes(24) + (2**64 - 2).to_bytes(8, "big")) == -2
    assert K.engine_key(-7) == -7


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70),
    st.integers(1, 9),
    st.integers(0, 8),
    st.integers(-(2**63), 2**63 - 1),
)
def test_keys_rolling_c_loop_equals_reference(
    tokens: list[int], bs: int, pending: int, h: int
) -> None:
    accel = pytest.importorskip("sidecar.shm_ring._accel")  # the C loops, if built
    pending %= bs
    out = np.zeros(len(tokens) + 1, np.int64)
    h1, p1, n = accel.rolling(np.array(tokens, np.int64), bs, h, pending, out)
    assert (h1, p1, out[:n].tolist()) == roll_reference(tokens, bs, h, pending)
    assert accel.roll_list(tokens, bs, h, pending) == (h1, p1, out[:n].tolist())
    # one call or token by token: the state carries everything
    h2, p2, ks = h, pending, []
    for t in tokens:
        h2, p2, k = K.roll(np.array([t]), bs, h2, p2)
        ks += k
    assert (h2, p2, ks) == (h1, p1, out[:n].tolist())


cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner),
    max_leaves=12,
)


@settings(max_examples=80, deadline=None)
@given(cbor_values)
def test_keys_cbor_is_cbor2_canonical(obj: object) -> None:
    cbor2 = pytest.importorskip("cbor2")
    assert K.cbor(obj) == cbor2.dumps(obj, canonical=True)


def test_keys_cbor_shortest_heads() -> None:
    assert K.cbor(23) == b"\x17"
    assert K.cbor(24) == b"\x18\x18"
    assert K.cbor(-1) == b"\x20"
    assert K.cbor(2**64) == b"\xc2\x49\x01" + bytes(8)
    assert K.cbor("0") == b"\x610"
    assert K.cbor((b"", [], None)) == b"\x83\x40\x80\xf6"
    with pytest.raises(TypeError):
        K.cbor(1.5)


def test_keys_parse_tokens_json_or_whitespace() -> None:
    assert K.parse_tokens("[1, 2, -3]") == [1, 2, -3]
    assert K.parse_tokens("1 2\n3,4") == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="array of ints"):
        K.parse_tokens('[1, "2"]')


def _keys_cli(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "keys", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_keys_cli_prints_one_key_per_full_block() -> None:
    r = _keys_cli("--scheme", "vllm_sha256_cbor", "--block-size", "4", stdin="1 2 3 4 5 6 7 8 9")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2164874634404590027", "-1176264011553262890"]
    r = _keys_cli("--scheme", "sglang_sha256", "--block-size", "4", "--json", stdin="[1,2,3,4]")
    doc = json.loads(r.stdout)
    assert doc["keys"] == [-3488128144981237669] and len(doc["digests"][0]) == 64
    r = _keys_cli("--scheme", "rolling", "--block-size", "4", stdin="1 2 3 x")
    assert r.returncode == 2 and "not token ids" in r.stderr
