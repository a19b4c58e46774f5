"""Events' `block_hashes` as they came (msgpack arrays, msgspec.Raw) -> int64 keys, vectorised.

Imports: numpy, msgspec. The hashes of a whole feed-loop turn are read in a few numpy passes
over the joined bytes instead of as Python ints: an array whose every element is a 64-bit int
(msgpack uint64 / int64, 9 bytes: what random 64-bit hashes encode as) or a 32-byte bin digest
(34 bytes) is read in place; any other array (small ints, other byte lengths, mixed) is decoded
one by one; anything else (a string, a float, not an array) is malformed. Keys keep the low 64
bits: ints as two's complement, bytes big-endian (a digest's last 8 bytes).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import msgspec
import numpy as np

M64 = (1 << 64) - 1
_FIXARRAY, _ARRAY16 = 0x90, 0xDC
_UINT64, _INT64, _BIN8 = 0xCF, 0xD3, 0xC4
_INT_SIZE, _DIGEST_SIZE = 9, 34  # bytes per element, tag included
_PAD = bytes(16)  # header reads of a short last array stay inside the buffer
_ONE_BY_ONE = msgspec.msgpack.Decoder(list[int | bytes])


def fold_hashes(hashes: list[Any]) -> np.ndarray:
    """Decoded hashes -> int64 bit patterns: ints keep their low 64 bits; bytes are read
    big-endian, low 64 bits."""
    vals = [(int.from_bytes(h, "big") if isinstance(h, bytes) else int(h)) & M64 for h in hashes]
    return np.array(vals, np.uint64).view(np.int64)


def read_keys(raws: list[Any]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(keys of every event in order, hashes per event, indexes of malformed events: no keys)."""
    e = len(raws)
    if not e:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    lens = np.fromiter(map(len, raws), np.int64, e)
    joined = b"".join(chain(raws, (_PAD,)))
    buf = np.frombuffer(joined, np.uint8)
    start = np.cumsum(lens) - lens
    b0 = buf[start].astype(np.int64)
    fix = (b0 & 0xF0) == _FIXARRAY
    array = fix | (b0 == _ARRAY16)
    n = np.where(fix, b0 & 0x0F, buf[start + 1].astype(np.int64) << 8 | buf[start + 2])
    body = start + np.where(fix, 1, 3)
    first = buf[body]
    ints = array & (lens == body - start + _INT_SIZE * n)
    ints &= (first == _UINT64) | (first == _INT64) | (n == 0)
    digests = array & (lens == body - start + _DIGEST_SIZE * n) & (first == _BIN8) & ~ints
    digests &= buf[body + 1] == 32
    fast = ints | digests
    nf = np.where(fast, n, 0)
    ev = np.repeat(np.arange(e), nf)
    first_elem = np.cumsum(nf) - nf  # of each array, in the output
    if not digests.any():  # one element size (the usual case: int hashes): fewer passes
        elem = np.repeat(body - first_elem * _INT_SIZE, nf) + np.arange(len(ev)) * _INT_SIZE
        is_int = np.ones(len(ev), np.bool_)
    else:
        is_int = ints[ev]
        at = np.arange(len(ev)) - np.repeat(first_elem, nf)  # element index in its array
        elem = body[ev] + at * np.where(is_int, _INT_SIZE, _DIGEST_SIZE)
    tag = buf[elem]
    # Every element must have its array's layout; an array that does not is read one by one.
    odd = np.where(
        is_int, (tag != _UINT64) & (tag != _INT64), (tag != _BIN8) | (buf[elem + 1] != 32)
    )
    if odd.any():
        fast[ev[odd]] = False
        keep = fast[ev]
        ev, elem, is_int = ev[keep], elem[keep], is_int[keep]
    # The 8 bytes after an int's tag, or a digest's last 8: unaligned big-endian words.
    words = np.ndarray((len(buf) - 7,), ">u8", joined, 0, (1,))
    keys = words[elem + np.where(is_int, 1, _DIGEST_SIZE - 8)].astype(np.uint64).view(np.int64)
    counts = np.where(fast, n, 0)
    slow = np.flatnonzero(~fast).tolist()
    if not slow:
        return keys, counts, []
    return _merge_slow(raws, keys, counts, slow)


def _merge_slow(
    raws: list[Any], keys: np.ndarray, counts: np.ndarray, slow: list[int]
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Decode the arrays not in a fast layout one by one and put their keys in event order."""
    bad: list[int] = []
    parts: dict[int, np.ndarray] = {}
    for i in slow:
        try:
            parts[i] = fold_hashes(_ONE_BY_ONE.decode(raws[i]))
        except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
            bad.append(i)
            continue
        counts[i] = len(parts[i])
    if not parts:
        return keys, counts, bad
    out = np.empty(int(counts.sum()), np.int64)
    offs = np.cumsum(counts) - counts
    filled = np.zeros(len(out), np.bool_)
    for i, k in parts.items():
        out[offs[i] : offs[i] + len(k)] = k
        filled[offs[i] : offs[i] + len(k)] = True
    out[~filled] = keys  # the fast arrays' keys, in event order
    return out, counts, bad
