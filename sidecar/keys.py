"""Block keys a router can compute: KVCM's rolling hash, vLLM's and SGLang's block hashes, and
the engine key codec (what the sidecar reports in `engine` key mode).

Imports: stdlib, numpy, sidecar.shm_ring (rolling_hash: the pure reference; compiled: its C
loop); never engine_hook (routers import this). Every function is pure; keys are signed int64
(KVCM's bit pattern), digests bytes.
The canonical CBOR here covers what vLLM hashes (ints of any size, bytes, text, None, bools,
tuples and lists); anything else raises TypeError.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np

from sidecar.shm_ring import compiled
from sidecar.shm_ring.rolling_hash import roll as roll_reference
from sidecar.shm_ring.rolling_hash import to_signed

__all__ = [
    "SCHEMES",
    "cbor",
    "engine_key",
    "keys_for",
    "roll",
    "rolling_keys",
    "sglang_key",
    "sglang_page_digests",
    "to_signed",
    "vllm_block_digests",
    "vllm_key",
    "vllm_none_hash",
    "vllm_sha256_cbor",
    "vllm_sha256_pickle",
]

Scheme = Literal["rolling", "vllm_sha256_cbor", "sglang_sha256"]
SCHEMES: tuple[Scheme, ...] = ("rolling", "vllm_sha256_cbor", "sglang_sha256")
M64 = (1 << 64) - 1
VLLM_DEFAULT_SEED = "vllm-none-hash"  # recent vLLM's NONE_HASH seed without PYTHONHASHSEED
ROUTER_SEED = "0"  # FlexLB's default


# ---- KVCM's rolling hash ------------------------------------------------------------------------
def roll(
    tokens: Sequence[int] | np.ndarray, block_size: int, h: int = 0, pending: int = 0
) -> tuple[int, int, list[int]]:
    """(state after `tokens`, tokens since the last boundary, keys of the blocks completed),
    continuing from state `h` with `pending` tokens since the last boundary. C when built."""
    a = compiled.accel
    if a is None:
        return roll_reference(tokens, block_size, h, pending)
    if type(tokens) is list:
        got: tuple[int, int, list[int]] = a.roll_list(tokens, block_size, h, pending)
        return got
    t = np.ascontiguousarray(tokens, np.int64)
    out = np.empty((pending + len(t)) // block_size, np.int64)
    h2, p2, n = a.rolling(t, block_size, h, pending, out)
    return h2, p2, out[:n].tolist()


def rolling_keys(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """KVCM's key of every full block of `tokens` (what KVCM computes for a token_ids query)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    return roll(tokens, block_size)[2]


# ---- the engine key codec -----------------------------------------------------------------------
def engine_key(h: int | bytes) -> int:
    """The key the sidecar reports for an engine hash in `engine` mode: the low 64 bits as a
    signed int64 (ints two's complement; bytes big-endian, i.e. a digest's last 8 bytes)."""
    v = int.from_bytes(h, "big") if isinstance(h, bytes) else h
    return to_signed(v)


# ---- canonical CBOR (RFC 8949 §4.2.1: shortest forms) -------------------------------------------
def _head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 1 << 8:
        return bytes((m | 24, n))
    if n < 1 << 16:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


def _enc(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif obj is True or obj is False:
        out.append(b"\xf5" if obj else b"\xf4")
    elif isinstance(obj, int):
        major, n = (0, obj) if obj >= 0 else (1, -1 - obj)
        if n <= M64:
            out.append(_head(major, n))
        else:  # a bignum: tag 2 (positive) or 3 (negative) over the big-endian magnitude
            out.append(b"\xc2" if major == 0 else b"\xc3")
            raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
            out.append(_head(2, len(raw)) + raw)
    elif isinstance(obj, bytes | bytearray | memoryview):
        raw = bytes(obj)
        out.append(_head(2, len(raw)))
        out.append(raw)
    elif isinstance(obj, str):
        raw = obj.encode()
        out.append(_head(3, len(raw)))
        out.append(raw)
    elif isinstance(obj, tuple | list):
        out.append(_head(4, len(obj)))
        for item in obj:
            _enc(item, out)
    else:
        raise TypeError(f"cbor: cannot encode {type(obj).__name__}")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR of `obj` (what cbor2.dumps(obj, canonical=True) gives for these types)."""
    out: list[bytes] = []
    _enc(obj, out)
    return b"".join(out)


# ---- vLLM ---------------------------------------------------------------------------------------
def vllm_sha256_cbor(obj: Any) -> bytes:
    """vLLM's `sha256_cbor`: sha256 of canonical CBOR."""
    return hashlib.sha256(cbor(obj)).digest()


def vllm_sha256_pickle(obj: Any) -> bytes:
    """vLLM's default `sha256`: sha256 over pickle (no router outside Python reproduces it)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


HashFn = Callable[[Any], bytes]


def vllm_none_hash(seed: str, hash_fn: HashFn = vllm_sha256_cbor) -> bytes:
    """The parent of a chain's first block: hash_fn(seed) (PYTHONHASHSEED, as text)."""
    return hash_fn(seed)


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    seed: str = ROUTER_SEED,
    parent: bytes | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    hash_fn: HashFn = vllm_sha256_cbor,
    none_hash: bytes | None = None,
) -> list[bytes]:
    """vLLM's digest of every full block: hash_fn((parent or NONE_HASH, tuple(tokens), extra
    keys or None)), each block's parent the one before it."""
    prev = parent if parent is not None else (none_hash or vllm_none_hash(seed, hash_fn))
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        block = tuple(int(t) for t in tokens[i * block_size : (i + 1) * block_size])
        prev = hash_fn((prev, block, extra))
        out.append(prev)
    return out


def vllm_key(digest: bytes) -> int:
    """The int form of a vLLM block hash in KV events: the digest's last 8 bytes, big-endian
    (unsigned; KVCM reads it as the signed int64 of the same bits)."""
    return int.from_bytes(digest[-8:], "big")


# ---- SGLang -------------------------------------------------------------------------------------
def sglang_page_digests(
    tokens: Sequence[int], page_size: int, prev: bytes | None = None
) -> list[bytes]:
    """SGLang's page digests: sha256(previous page's digest, if any, + the page's tokens as
    uint32 little-endian), one per full page."""
    out: list[bytes] = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(struct.pack(f"<{len(page)}I", *(int(t) & 0xFFFFFFFF for t in page)))
        prev = h.digest()
        out.append(prev)
    return out


def sglang_key(digest: bytes) -> int:
    """SGLang's key of a page: its digest's first 8 bytes, big-endian, signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


# ---- what `kvcm-sidecar keys` prints ------------------------------------------------------------
def keys_for(
    scheme: Scheme, tokens: Iterable[int], block_size: int, seed: str = ROUTER_SEED
) -> list[tuple[int, str]]:
    """(KVCM key as signed int64, digest hex or "") of every full block under `scheme`."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    toks = [int(t) for t in tokens]
    if scheme == "rolling":
        return [(k, "") for k in rolling_keys(toks, block_size)]
    if scheme == "vllm_sha256_cbor":
        ds = vllm_block_digests(toks, block_size, seed=seed)
        return [(engine_key(vllm_key(d)), d.hex()) for d in ds]
    if scheme == "sglang_sha256":
        return [(sglang_key(d), d.hex()) for d in sglang_page_digests(toks, block_size)]
    raise ValueError(f"unknown scheme {scheme!r}")


def parse_tokens(text: str) -> list[int]:
    """Token ids from text: a JSON array of ints, or ints separated by whitespace (or commas)."""
    s = text.strip()
    if s.startswith("["):
        import json

        got = json.loads(s)
        if not isinstance(got, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in got
        ):
            raise ValueError("the JSON must be an array of ints")
        return got
    return [int(t) for t in s.replace(",", " ").split()]
