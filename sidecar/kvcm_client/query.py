"""Typed query client for routers: which host holds how much of a prompt's prefix, and where.

Imports: stdlib, aiohttp, msgspec. The piece an operator's own router imports: one ClientSession
passed in, one request per call, no retries (a failed query is a miss: route without it). Keys are
the engine's int64 block keys in prompt order (or token ids: KVCM hashes full blocks itself).
Request and response fields are in docs/wire.md "Queries"; 64-bit numbers may be strings.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TypeVar

import aiohttp
import msgspec


class QueryError(Exception):
    """The query failed (transport, HTTP status, or a KVCM code other than OK)."""


class HostCacheState(msgspec.Struct, frozen=True):
    """One host's contiguous prefix from the first key: `local` blocks on the host itself,
    `p2p_1_fetch` more from other hosts' L2 copies, `p2p_1_total_match` both together."""

    host_ip_port: str
    local: int = 0
    p2p_1_fetch: int = 0
    p2p_1_total_match: int = 0


class LocationSpec(msgspec.Struct, frozen=True):
    name: str
    uri: str


class CacheLocation(msgspec.Struct, frozen=True):
    """One block's row: the storage type it is in (`ST_EVENT_REPORT_L1P5` ...) and spec URIs."""

    type: str = ""
    spec_size: int = 0
    location_specs: tuple[LocationSpec, ...] = ()


class _Status(msgspec.Struct):
    code: str | int = "UNSPECIFIED"
    message: str = ""


class _Header(msgspec.Struct):
    status: _Status = msgspec.field(default_factory=_Status)


class _HostCacheStateResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    hosts: list[HostCacheState] = msgspec.field(default_factory=list)


class _CacheLocationResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    locations: list[CacheLocation] = msgspec.field(default_factory=list)


class _HostCacheStateRequest(msgspec.Struct, omit_defaults=True):
    trace_id: str
    instance_id: str
    query_type: str
    block_cache_keys: list[str] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    medium: list[str] = msgspec.field(default_factory=list)


class _CacheLocationRequest(msgspec.Struct, omit_defaults=True):
    trace_id: str
    instance_id: str
    query_type: str
    block_keys: list[str] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    location_spec_names: list[str] = msgspec.field(default_factory=list)


_R = TypeVar("_R", _HostCacheStateResponse, _CacheLocationResponse)
_encoder = msgspec.json.Encoder()
_OK = ("OK", 1)


def _keys(keys: Sequence[int]) -> list[str]:
    return [str(k & ((1 << 64) - 1)) for k in keys]  # unsigned decimal text, contract §4.2


class QueryClient:
    """`await QueryClient(session, "http://kvcm:6382").get_host_cache_state(iid, keys)`."""

    def __init__(
        self, session: aiohttp.ClientSession, endpoint: str, *, timeout_s: float = 1.0
    ) -> None:
        self.session = session
        self.base = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._n = itertools.count()

    async def _post(self, route: str, body: msgspec.Struct, into: type[_R]) -> _R:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(
                    f"{self.base}/api/{route}",
                    data=_encoder.encode(body),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise QueryError(f"{route}: HTTP {resp.status}")
        except TimeoutError:
            raise QueryError(f"{route}: no answer in {self.timeout_s}s") from None
        except aiohttp.ClientError as exc:
            raise QueryError(f"{route}: {exc!r}") from None
        try:
            out = msgspec.json.decode(raw, type=into, strict=False)
        except msgspec.DecodeError as exc:
            raise QueryError(f"{route}: malformed answer: {exc}") from None
        status = out.header.status
        if status.code not in _OK:
            raise QueryError(f"{route}: {status.code} {status.message}")
        return out

    async def get_host_cache_state(
        self,
        instance_id: str,
        block_keys: Sequence[int] = (),
        *,
        token_ids: Sequence[int] = (),
        mediums: Sequence[str] = (),
        query_type: str = "QT_PREFIX_MATCH",
    ) -> dict[str, HostCacheState]:
        """Per host, how long a prefix of the prompt it holds; hosts holding none are absent."""
        body = _HostCacheStateRequest(
            f"router-{next(self._n)}",
            instance_id,
            query_type,
            _keys(block_keys),
            list(token_ids),
            list(mediums),
        )
        out = await self._post("getHostCacheState", body, _HostCacheStateResponse)
        return {h.host_ip_port: h for h in out.hosts}

    async def get_cache_location(
        self,
        instance_id: str,
        block_keys: Sequence[int] = (),
        *,
        token_ids: Sequence[int] = (),
        query_type: str = "QT_PREFIX_MATCH",
        location_spec_names: Sequence[str] = (),
    ) -> list[CacheLocation]:
        """One row per block: for QT_PREFIX_MATCH up to the first miss, for QT_BATCH_GET every
        key (a miss is a row with no specs)."""
        body = _CacheLocationRequest(
            f"router-{next(self._n)}",
            instance_id,
            query_type,
            _keys(block_keys),
            list(token_ids),
            list(location_spec_names),
        )
        out = await self._post("getCacheLocation", body, _CacheLocationResponse)
        return out.locations
