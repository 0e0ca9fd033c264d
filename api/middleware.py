"""ASGI middleware: request body size limit, and request metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracker.metrics import Metrics

from .http_errors import error_response


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, before they are read into memory.

    A declared ``Content-Length`` over the limit is refused at once; a body without one
    (chunked) is counted as it arrives, and the answer is replaced by 413 once it overflows
    (FastAPI would otherwise report the aborted read as a 400).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._refuse(scope, receive, send)
                    return
        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        replaced = False

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if too_large:
                if not replaced:
                    replaced = True
                    await self._refuse(scope, receive, send)
                return
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            if not replaced:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"request body larger than {self.max_bytes} bytes (api_max_body_bytes)"
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


class RequestMetricsMiddleware:
    """Count requests by method, route template (not the raw path) and status; time them."""

    def __init__(self, app: ASGIApp, metrics: Callable[[Scope], Metrics | None]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            metrics = self.metrics(scope)
            if metrics is not None:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                metrics.api_requests.labels(scope.get("method", ""), route, str(status)).inc()
                metrics.api_request_seconds.labels(route).observe(time.perf_counter() - started)
