"""HTTP endpoints: /metrics (Prometheus), /healthz (alive), /readyz (registered, not draining),
/status (JSON).

Imports: aiohttp + metrics.registry. Served by an AppRunner the daemon's TaskGroup owns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from sidecar.metrics.registry import Metrics

StatusFn = Callable[[], dict[str, Any]]
ReadyFn = Callable[[], bool]


def build_app(metrics: Metrics, status: StatusFn, ready: ReadyFn) -> web.Application:
    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        ok = ready()
        return web.Response(status=200 if ok else 503, text="ready\n" if ok else "not ready\n")

    async def status_view(_: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(status(), indent=2, sort_keys=True) + "\n",
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_view)
    return app
