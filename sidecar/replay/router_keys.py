"""The keys a router asks KVCM for, per key mode of the ZMQ replay (issue #22 §4).

Imports: stdlib, sidecar.keys, sidecar.replay.trace. A router knows a prompt's token ids (here:
trace.block_tokens of each block's chain key), never the engine's hashes. `rolling`: KVCM's
rolling keys (what key mode rolling reports); `flexlb`: vLLM's sha256_cbor with seed "0", as
FlexLB recomputes engine keys (what key mode engine reports when the engine hashes so). Both
memoised per chain key: equal prefixes, equal keys.
"""

from __future__ import annotations

from sidecar import keys as K
from sidecar.replay.trace import Request, block_tokens


class RouterKeys:
    def __init__(self, how: str, block_tokens_n: int, seed: str = K.ROUTER_SEED) -> None:
        if how not in ("rolling", "flexlb"):
            raise ValueError(f"router keys {how!r}: rolling or flexlb")
        self.how = how
        self.bs = block_tokens_n
        self.none_hash = K.vllm_none_hash(seed)
        self._state: dict[int, int] = {}  # chain key -> rolling key (its full state)
        self._digest: dict[int, tuple[bytes, int]] = {}  # chain key -> (digest, key)

    def __call__(self, req: Request) -> list[int]:
        return self.rolling(req.keys) if self.how == "rolling" else self.flexlb(req.keys)

    def rolling(self, chain: tuple[int, ...]) -> list[int]:
        out: list[int] = []
        h = 0
        for k in chain:
            got = self._state.get(k)
            if got is None:
                got = self._state[k] = K.roll(block_tokens(k, self.bs), self.bs, h, 0)[2][-1]
            out.append(got)
            h = got
        return out

    def flexlb(self, chain: tuple[int, ...]) -> list[int]:
        out: list[int] = []
        prev = self.none_hash
        for k in chain:
            got = self._digest.get(k)
            if got is None:
                d = K.vllm_sha256_cbor((prev, tuple(block_tokens(k, self.bs)), None))
                got = self._digest[k] = (d, K.engine_key(K.vllm_key(d)))
            out.append(got[1])
            prev = got[0]
        return out
