"""How the emulated engines hash their blocks from their tokens (issue #22 §4), so tokens,
parents and hashes in their events agree as in vLLM / SGLang.

Imports: stdlib, sidecar.keys. Schemes: `vllm_default` (vLLM's out-of-the-box sha256 over
pickle, NONE_HASH from the seed "vllm-none-hash"), `sha256_cbor_seed0` (what FlexLB expects:
sha256_cbor, PYTHONHASHSEED=0), `random_seed` (sha256_cbor with a seed of its own per engine,
as xxhash without PYTHONHASHSEED). SGLang engines use SGLang's page hash whatever the scheme.
The event form: an int (vLLM: the digest's last 8 bytes; SGLang: its first 8, as unsigned) or
the 32-byte digest (hash_kind bytes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sidecar import keys as K

ENGINE_HASHES = ("random", "vllm_default", "sha256_cbor_seed0", "random_seed")  # as zmq_publisher
_M64 = (1 << 64) - 1


class EngineHasher:
    """Block hashes from tokens, chained through each parent's full digest."""

    def __init__(
        self, scheme: str, *, flavour: str = "vllm", hash_kind: str = "int", seed: str = ""
    ) -> None:
        if scheme not in ENGINE_HASHES[1:]:
            raise ValueError(f"engine hash {scheme!r}: one of {', '.join(ENGINE_HASHES[1:])}")
        self.scheme, self.flavour, self.hash_kind = scheme, flavour, hash_kind
        self.fn: K.HashFn = K.vllm_sha256_cbor
        if scheme == "vllm_default":
            self.fn, seed = K.vllm_sha256_pickle, K.VLLM_DEFAULT_SEED
        elif scheme == "sha256_cbor_seed0":
            seed = "0"
        else:
            seed = seed or os.urandom(8).hex()
        self.seed = seed
        self.none_hash = K.vllm_none_hash(seed, self.fn)
        self.digests: dict[int | bytes, bytes] = {}  # event hash -> full digest (parents)

    def form(self, d: bytes) -> int | bytes:
        if self.hash_kind == "bytes":
            return d
        if self.flavour == "sglang":
            return K.sglang_key(d) & _M64
        return K.vllm_key(d)

    def hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        parent: int | bytes | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[int | bytes]:
        """The hashes of the full blocks of `tokens` after `parent` (None: a chain's root)."""
        prev = None if parent is None else self.digests.get(parent)
        if parent is not None and prev is None:
            if isinstance(parent, bytes) and len(parent) == 32:
                prev = parent
            else:
                raise ValueError(f"parent {parent!r} was not hashed by this engine")
        if self.flavour == "sglang":
            ds = K.sglang_page_digests(tokens, block_size, prev)
        else:
            ds = K.vllm_block_digests(
                tokens,
                block_size,
                parent=prev,
                extra_keys=extra_keys,
                hash_fn=self.fn,
                none_hash=self.none_hash,
            )
        out = []
        for d in ds:
            h = self.form(d)
            self.digests[h] = d
            out.append(h)
        return out
