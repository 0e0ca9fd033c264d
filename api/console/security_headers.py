"""Security headers of every console response (pages, fragments, static files, errors).

The Content-Security-Policy allows scripts, styles, images and requests from the console's
own origin only: no inline script or style, no ``eval`` (htmx is configured without it), no
framing, forms posting only back to the console. Even a value that escaped escaping could not
run as script.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/console"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'"
)

HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
]
#: Pages show live data and are only for the logged-in operator: never cached.
NO_STORE = (b"cache-control", b"no-store")


class ConsoleHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        static = path.startswith(PREFIX + "/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.lower() not in {name for name, _ in HEADERS}
                ]
                headers.extend(HEADERS)
                if not static:
                    headers = [(k, v) for k, v in headers if k.lower() != b"cache-control"]
                    headers.append(NO_STORE)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
