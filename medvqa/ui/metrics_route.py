"""GET /metrics: the app's live serving metrics (medvqa/metrics.py) for a Prometheus scraper.

Served only when the app is started with metrics on (`app.py --metrics`); otherwise the route does
not exist. It sits behind `AccessGuard` (access.py), so with a login set a scraper needs the login
cookie like any other client. The body holds counts and latencies only: no question, answer or scan.
"""

from __future__ import annotations

from typing import Any

METRICS_PATH = "/metrics"


class MetricsRoute:
    """ASGI middleware answering GET/HEAD `METRICS_PATH` from a ServingMetrics; everything else
    passes through."""

    def __init__(self, app: Any, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") != METRICS_PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("GET", "HEAD"):
            await _send(send, 405, b"Only GET and HEAD.\n", "text/plain; charset=utf-8")
            return
        body, content_type = self.metrics.exposition()
        await _send(send, 200, body if scope["method"] == "GET" else b"", content_type)


async def _send(send: Any, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})
