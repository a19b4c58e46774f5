"""The key check: can a router recompute the keys the engine reports? (issue #22 §2)

Imports: stdlib, msgspec, sidecar.keys. On a sample of applied batches the BlockStored events
are decoded in full (the hot path's decoder leaves token ids alone) and each block's hash is
recomputed under every router-side scheme from its tokens and its parent. A parent is usable
when the chain starts there (none), when it is a full 32-byte digest, or when its digest under
that scheme was computed from an earlier checked block (bounded table). Never raises: an event
that cannot be read is skipped (the fold counts it).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from sidecar import keys as K

log = logging.getLogger(__name__)

VLLM, SGLANG = "vllm_sha256_cbor", "sglang_sha256"
CHECK_SCHEMES = (VLLM, SGLANG)
WARM_BATCHES = 8  # flushes whose last batch is checked at start (and after an engine restart)
BATCHES_PER_SAMPLE = 2048  # then one batch in about this many (at most one per flush)
MAX_EVENTS = 4  # BlockStored events checked per sampled batch
DIGESTS_MAX = 1 << 16  # per scheme: engine key -> digest of checked blocks (chains continue)
_GENERIC = msgspec.msgpack.Decoder()


class _Batch(msgspec.Struct, array_like=True):
    ts: Any
    events: list[msgspec.Raw]
    dp_rank: Any = None


_RAW_BATCH = msgspec.msgpack.Decoder(_Batch)
# Positional BlockStored fields after the tag (vLLM; SGLang stops after medium).
_POSITIONAL = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)


def stored_fields(obj: Any) -> dict[str, Any] | None:
    """A generically decoded event -> its BlockStored fields by name (None: another event)."""
    if isinstance(obj, dict):
        return obj if obj.get("type") == "BlockStored" else None
    if isinstance(obj, list) and obj and obj[0] == "BlockStored":
        return dict(zip(_POSITIONAL, obj[1:], strict=False))
    return None


def _is_tokens(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


class KeyCheck:
    """Per scheme: blocks checked and blocks that did not reproduce."""

    def __init__(
        self, block_size: int, router_seed: str = K.ROUTER_SEED, *, warn: bool = True
    ) -> None:
        self.block_size = block_size
        self.warn = warn  # log once when no scheme reproduces (engine key mode)
        self.router_seed = router_seed
        self.none_hash = K.vllm_none_hash(router_seed)
        self.checked = dict.fromkeys(CHECK_SCHEMES, 0)
        self.failed = dict.fromkeys(CHECK_SCHEMES, 0)
        self.batches = 0  # batches sampled
        self.warned = False
        self._warm = WARM_BATCHES
        # Batches until the next sample: the fold's flush subtracts the batches it folds and
        # calls sample() with its last batch at 0, so a batch not sampled costs nothing.
        self.credit = 1
        self._digests: dict[str, dict[int, bytes]] = {s: {} for s in CHECK_SCHEMES}

    # ---- what the metrics and /status read --------------------------------------------------
    def result(self, scheme: str) -> int | None:
        """1: every checked block reproduced; 0: one did not; None: none checked yet."""
        if not self.checked[scheme]:
            return None
        return 0 if self.failed[scheme] else 1

    def reproducing(self) -> list[str]:
        return [s for s in CHECK_SCHEMES if self.result(s) == 1]

    def none_reproduce(self) -> bool:
        """Blocks were checked and no scheme reproduced every one."""
        return any(self.checked.values()) and not self.reproducing()

    def status(self) -> dict[str, Any]:
        return {
            **{s: self.result(s) for s in CHECK_SCHEMES},
            "checked_blocks": dict(self.checked),
            "failed_blocks": dict(self.failed),
            "router_seed": self.router_seed,
        }

    def reset(self) -> None:
        """Another engine life (it may hash otherwise now): start over."""
        for s in CHECK_SCHEMES:
            self.checked[s] = self.failed[s] = 0
            self._digests[s].clear()
        self._warm = WARM_BATCHES
        self.credit = 1
        self.warned = False

    # ---- the sample ---------------------------------------------------------------------------
    def offer(self, payload: bytes) -> bool:
        """An applied batch: sampled (True) when its turn has come (the fold inlines this)."""
        self.credit -= 1
        if self.credit > 0:
            return False
        self.sample(payload)
        return True

    def sample_flush(self, payloads: list[bytes]) -> None:
        """A flush's batches, in order: while warming up the first ones (as many as the warm up
        has left: chains start there), else the last."""
        todo: list[bytes] = []
        for p in payloads:  # a batch's segments (split by clears) are consecutive
            if not todo or todo[-1] is not p:
                todo.append(p)
        for p in todo[: self._warm] if self._warm else todo[-1:]:
            self.sample(p)

    def sample(self, payload: bytes) -> None:
        """Check this batch; the next sample comes BATCHES_PER_SAMPLE batches later (the
        first WARM_BATCHES batches are all checked)."""
        if self._warm > 0:
            self._warm -= 1
        self.credit = 1 if self._warm else BATCHES_PER_SAMPLE
        self.batches += 1
        self.check_payload(payload)

    def check_payload(self, payload: bytes) -> None:
        try:
            raws = _RAW_BATCH.decode(payload).events
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        n = 0
        for raw in raws:
            if n >= MAX_EVENTS:
                break
            try:
                ev = stored_fields(_GENERIC.decode(raw))
            except msgspec.DecodeError:
                continue
            if ev is not None and self.check_event(ev):
                n += 1

    def check_event(self, ev: dict[str, Any]) -> bool:
        """Check one BlockStored (fields by name); False if it could not be read."""
        hashes, tokens = ev.get("block_hashes"), ev.get("token_ids")
        bs = ev.get("block_size") or self.block_size
        if not isinstance(hashes, list) or not hashes or not isinstance(tokens, list):
            return False
        if not _is_tokens(tokens):
            return False
        if not isinstance(bs, int) or bs <= 0 or len(tokens) != len(hashes) * bs:
            return False
        if not all(isinstance(h, int | bytes) for h in hashes):
            return False
        extra = ev.get("extra_keys")
        parent = ev.get("parent_block_hash")
        blocks = [tokens[i * bs : (i + 1) * bs] for i in range(len(hashes))]
        self._check_vllm(hashes, parent, blocks, extra if isinstance(extra, list) else None)
        if not extra and not ev.get("lora_id") and not ev.get("lora_name"):
            self._check_sglang(hashes, parent, blocks)
        self._maybe_warn()
        return True

    def _parent(self, scheme: str, parent: Any, root: bytes | None) -> tuple[bool, bytes | None]:
        """(usable, the parent's digest under `scheme`; `root` when there is none)."""
        if parent is None:
            return True, root
        if isinstance(parent, bytes) and len(parent) == 32 and scheme == VLLM:
            return True, parent
        if isinstance(parent, int | bytes):
            d = self._digests[scheme].get(K.engine_key(parent))
            return d is not None, d
        return False, None

    def _remember(self, scheme: str, h: int | bytes, d: bytes) -> None:
        t = self._digests[scheme]
        if len(t) >= DIGESTS_MAX:
            del t[next(iter(t))]
        t[K.engine_key(h)] = d

    def _check_vllm(
        self,
        hashes: list[Any],
        parent: Any,
        blocks: list[list[int]],
        extra: list[Any] | None,
    ) -> None:
        ok, prev = self._parent(VLLM, parent, self.none_hash)
        if not ok or prev is None:
            return
        for i, (h, toks) in enumerate(zip(hashes, blocks, strict=True)):
            e = extra[i] if extra is not None and i < len(extra) else None
            try:
                # (msgpack gives lists where vLLM hashed tuples: CBOR encodes both alike)
                d = K.vllm_sha256_cbor((prev, tuple(toks), e))
            except TypeError:  # an extra key CBOR cannot carry: not checkable
                return
            if not self._tally(VLLM, h, d, K.vllm_key(d)):
                return
            prev = d

    def _check_sglang(self, hashes: list[Any], parent: Any, blocks: list[list[int]]) -> None:
        ok, prev = self._parent(SGLANG, parent, None)
        if not ok:
            return
        for h, toks in zip(hashes, blocks, strict=True):
            d = K.sglang_page_digests(toks, len(toks), prev)[0]
            if not self._tally(SGLANG, h, d, K.sglang_key(d)):
                return
            prev = d

    def _tally(self, scheme: str, h: int | bytes, d: bytes, key: int) -> bool:
        self.checked[scheme] += 1
        same = d == h if isinstance(h, bytes) else K.engine_key(key) == K.engine_key(h)
        if not same:
            self.failed[scheme] += 1
            return False
        self._remember(scheme, h, d)
        return True

    def _maybe_warn(self) -> None:
        if self.warned or not self.warn or not self.none_reproduce():
            return
        self.warned = True
        log.warning(
            "key check: no router scheme reproduces the engine's block hashes (%s); a router "
            "hashing prompts will find nothing. Fix: key_mode=rolling (KV_CACHE_EVENT_ZMQ_KEY_MODE"
            "=rolling: KVCM's own token keys), or start vLLM with --prefix-caching-hash-algo "
            "sha256_cbor and PYTHONHASHSEED=%s (the router's seed)",
            ", ".join(f"{s}=0" for s in CHECK_SCHEMES if self.checked[s]),
            self.router_seed,
        )
