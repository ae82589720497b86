"""Who may talk to the server, and how much: API key, body size limit, loopback check.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streamed
responses and hide client disconnects). The key is compared in constant time
(hmac.compare_digest), so response timing reveals nothing about it.
"""

from __future__ import annotations

import hmac
import ipaddress

from moespec.serve.errors import ApiError


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (a name other than localhost counts as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Gate:
    """ASGI middleware: 401 without the right Bearer key, 413 for a body over ``max_body_bytes``.

    Args:
        app: the wrapped ASGI app.
        api_key: the key clients must send (None: no key, loopback only).
        max_body_bytes: the largest request body accepted.
        open_paths: paths answered without a key (health checks).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] not in self.open_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                        code="request_too_large")

    def _limited(self, receive):
        seen = 0

        async def wrapped():
            # A chunked body has no Content-Length: count what arrives.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large()
            return message

        return wrapped
