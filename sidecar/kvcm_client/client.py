"""aiohttp client for KVCM and the classification of every outcome into one action.

Imports: stdlib, aiohttp, msgspec (via wire). One ClientSession per daemon, passed in. Every
transport failure and every KVCM code maps to exactly one Action (table in docs/wire.md);
nothing here retries or sleeps: the caller owns the policy.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from sidecar.kvcm_client.transport import ConnectFailed, Hold, Http1
from sidecar.kvcm_client.transport import supported as lean_supported
from sidecar.kvcm_client.wire import Response, decode_response

MAX_DEPTH = 64


class Action(enum.IntEnum):
    """Ordered by severity: the worst item decides a partially failed request."""

    OK = 0
    RETRY = 1
    RESNAPSHOT = 2
    REREGISTER = 3
    CIRCUIT_OPEN = 4


RETRY_CODES = {
    "INTERNAL_ERROR",
    "SERVICE_NOT_READY",
    "SERVER_NOT_LEADER",
    "SNAPSHOT_IN_PROGRESS",
    "SNAPSHOT_RATE_LIMITED",
    "IO_ERROR",
    "UNKNOWN_ERROR",
}
CIRCUIT_CODES = {"UNSUPPORTED", "INVALID_ARGUMENT", "DUPLICATE_ENTITY", "REACH_MAX_ENTITY_CAPACITY"}
CODE_NAMES = {
    0: "UNSPECIFIED",
    1: "OK",
    2: "UNSUPPORTED",
    3: "INTERNAL_ERROR",
    4: "SERVICE_NOT_READY",
    5: "INVALID_ARGUMENT",
    6: "DUPLICATE_ENTITY",
    7: "REACH_MAX_ENTITY_CAPACITY",
    8: "INSTANCE_NOT_EXIST",
    9: "SERVER_NOT_LEADER",
    10: "NODE_NOT_REGISTERED",
    11: "SNAPSHOT_IN_PROGRESS",
    13: "SNAPSHOT_RATE_LIMITED",
    14: "SNAPSHOT_REQUIRED",
    20: "IO_ERROR",
    100: "UNKNOWN_ERROR",
}


def code_name(code: str | int) -> str:
    if isinstance(code, int) or (isinstance(code, str) and code.isdigit()):
        return CODE_NAMES.get(int(code), f"CODE_{code}")
    return code


def classify_code(code: str, route: str) -> Action:
    """One action per KVCM code; `route` matters only for INSTANCE_NOT_EXIST."""
    if code == "OK":
        return Action.OK
    if code in RETRY_CODES:
        return Action.RETRY
    if code in CIRCUIT_CODES:
        return Action.CIRCUIT_OPEN
    if code == "INSTANCE_NOT_EXIST":
        # From registerInstance the group/storage config is wrong; from reportEvent the
        # instance vanished (or the group lost its storage): register again.
        return Action.CIRCUIT_OPEN if route == "registerInstance" else Action.REREGISTER
    if code == "NODE_NOT_REGISTERED":
        return Action.REREGISTER
    if code == "SNAPSHOT_REQUIRED":
        return Action.REREGISTER
    return Action.RETRY  # UNSPECIFIED and codes this sidecar does not know: transient


def classify_http(status: int) -> tuple[Action, str]:
    if status >= 500 or status in (408, 429):
        return Action.RETRY, f"http_{status}"
    # 400 `{}` (body invalid for the message), 404 (wrong endpoint), 413 (request too big):
    # sending the same thing again cannot succeed; the configuration or version is wrong.
    return Action.CIRCUIT_OPEN, f"http_{status}"


@dataclass
class Result:
    action: Action
    reason: str  # KVCM code name, or a transport reason: timeout, connect, http_NNN, ...
    message: str = ""
    response: Response | None = None
    failed_items: list[int] = field(default_factory=list)  # indexes, in order
    retry_after_s: float = 0.0
    latency_s: float = 0.0
    held_s: float = 0.0  # the answer sat unread this long, at most (transport.Hold)
    endpoint: str = ""  # the base URL it was sent to (leader discovery: the client may move)

    @property
    def ok(self) -> bool:
        return self.action == Action.OK


def _depth(obj: Any, d: int = 1) -> int:
    if d > MAX_DEPTH:
        return d
    if isinstance(obj, dict):
        return max((_depth(v, d + 1) for v in obj.values()), default=d)
    if isinstance(obj, list):
        return max((_depth(v, d + 1) for v in obj), default=d)
    return d


def interpret(body: bytes, route: str, max_bytes: int) -> Result:
    """Classify a 2xx body: the header code, then item_results on partial failure."""
    if len(body) > max_bytes:
        return Result(Action.RETRY, "oversize_response", f"{len(body)} bytes > {max_bytes}")
    try:
        # Nesting needs a bracket per level: a body with few cannot be too deep (one decode
        # fewer per request).
        deep = body.count(b"{") + body.count(b"[") > MAX_DEPTH
        if deep and _depth(msgspec.json.decode(body)) > MAX_DEPTH:
            return Result(Action.RETRY, "malformed_response", f"nested deeper than {MAX_DEPTH}")
        resp = decode_response(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Result(Action.RETRY, "malformed_response", str(exc)[:200])
    code = code_name(resp.header.status.code)
    try:
        retry_after_s = int(resp.retry_after_ms) / 1000.0
    except ValueError:
        return Result(Action.RETRY, "malformed_response", "retry_after_ms is not an integer")
    if resp.committed_snapshot_version and not (
        len(resp.committed_snapshot_version) == 32
        and all(c in "0123456789abcdef" for c in resp.committed_snapshot_version)
    ):
        return Result(Action.RETRY, "malformed_response", "committed_snapshot_version not hex32")
    items = [code_name(c) for c in resp.item_results]
    failed = [i for i, c in enumerate(items) if c != "OK"]
    if code == "OK" and not failed:
        return Result(Action.OK, "OK", response=resp, retry_after_s=retry_after_s)
    if failed:
        action = max(classify_code(items[i], route) for i in failed)
        reason = items[failed[0]]
    else:
        action, reason = classify_code(code, route), code
    return Result(action, reason, resp.header.status.message, resp, failed, retry_after_s)


class KvcmClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        max_response_bytes: int,
        *,
        lean_http: bool = False,
        hold_s: float = 0.0,
    ):
        self.session = session
        self.base = endpoint.rstrip("/")
        self.max_response_bytes = max_response_bytes
        # lean_http: plain http:// POSTs over transport.Http1 (the daemon's; it calls close()),
        # one per base URL: Discovery moves `base` to a new leader, and the connections to the
        # old one must not carry another request
        self.lean_http = lean_http
        self._lean: dict[str, Http1] = {}
        # Held answers (post(hold=True), lean client only): read at the next poke() or hold_s
        self.hold = Hold(hold_s) if lean_http and hold_s > 0 else None

    def _lean_for(self, base: str) -> Http1 | None:
        if not self.lean_http:
            return None
        h = self._lean.get(base)  # first: no URL parse per request
        if h is None:
            if not lean_supported(base):
                return None
            for old in self._lean.values():
                old.close()  # the leader moved; a request still on them fails (ambiguous)
            h = Http1(base)
            self._lean = {base: h}
        return h

    def close(self) -> None:
        for h in self._lean.values():
            h.close()
        self._lean = {}

    def poke(self) -> None:
        """Read a held answer now (the loop is awake anyway)."""
        if self.hold is not None:
            self.hold.poke()

    async def post(
        self, route: str, payload: bytes | memoryview, timeout_s: float, *, hold: bool = False
    ) -> Result:
        """`hold`: the answer may be read late (transport.Hold); its latency_s then leaves the
        hold out and held_s says how long it was (the answer came somewhere in it)."""
        base = self.base  # Discovery may move `base` while this is in flight
        result = await self._post(base, route, payload, timeout_s, hold)
        result.endpoint = base
        return result

    async def _post(
        self, base: str, route: str, payload: bytes | memoryview, timeout_s: float, hold: bool
    ) -> Result:
        """One POST over the lean client (plain http://) or aiohttp; every failure a Result."""
        t0 = time.perf_counter()
        lean = self._lean_for(base)
        held = self.hold if hold and lean is not None else None
        if held is not None:  # at least half the timeout is left for the answer after it
            held.start(time.monotonic() + timeout_s / 2)
        try:
            if lean is not None:  # its own deadline: a timer only for a wait that suspends
                deadline = asyncio.get_running_loop().time() + timeout_s
                path = f"/api/{route}"
                status, body = await lean.post(
                    path, payload, self.max_response_bytes, held, deadline
                )
            else:
                async with asyncio.timeout(timeout_s):
                    async with self.session.post(
                        f"{base}/api/{route}",
                        data=payload,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        body = await resp.content.read(self.max_response_bytes + 1)
                        status = resp.status
        except TimeoutError:
            return _failed("timeout", f"no answer in {timeout_s}s", t0, held)
        except (aiohttp.ClientConnectorError, ConnectFailed) as exc:
            return _failed("connect", str(exc)[:200], t0, held)
        except (aiohttp.ClientError, OSError) as exc:
            return _failed("transport", repr(exc)[:200], t0, held)
        latency_s, held_s = _timing(t0, held)
        if status // 100 != 2:
            action, reason = classify_http(status)
            message = body[:200].decode(errors="replace")
            return Result(action, reason, message, latency_s=latency_s, held_s=held_s)
        result = interpret(body, route, self.max_response_bytes)
        result.latency_s, result.held_s = latency_s, held_s
        return result


def _timing(t0: float, held: Hold | None) -> tuple[float, float]:
    """(latency without the hold, the hold) of a request begun at t0."""
    held_s = held.last_s if held is not None else 0.0
    return time.perf_counter() - t0 - held_s, held_s


def _failed(reason: str, message: str, t0: float, held: Hold | None = None) -> Result:
    """No answer to act on: retried (timeouts and broken connections are ambiguous)."""
    latency_s, held_s = _timing(t0, held)
    return Result(Action.RETRY, reason, message, latency_s=latency_s, held_s=held_s)
