"""Who may read the dashboard: whoever shows the token printed at start, on any address (an `Authorization:
Bearer` header; the page keeps it in its own origin's storage, so no cookie carries it to another port). The
page shells and their scripts hold no run data and need none; on a loopback address only loopback names are
answered (no DNS rebinding). Every answer carries headers that keep the page's own scripts the only ones."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp

ASKED = "x-mgpu-dashboard"  # a POST must carry it: a form of another site cannot, a script of another origin is
# stopped by the browser's preflight
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
ASK = ("401: this dashboard answers only to the token that 'mgpu-cluster dashboard' printed at start: open the URL "
       "it printed (it hands the token to the page), or send 'Authorization: Bearer TOKEN'")


def loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _name(host_header: str) -> str:
    """The host of a Host header: without its port, an IPv6 address without its brackets."""
    if host_header.startswith("["):
        return host_header[1:].split("]")[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def shell(path: str) -> bool:
    """A path that serves the page's own files (no run data): the two pages and /static/."""
    return path == "/" or path.startswith("/static/") or (path.startswith("/runs/") and path.count("/") == 2)


def bearer(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


class Guard(BaseHTTPMiddleware):
    def __init__(self, app: ASGIApp, token: str, local: bool):
        super().__init__(app)
        self.token, self.local = token.encode(), local

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if self.local and not loopback(_name(request.headers.get("host", ""))):
            return PlainTextResponse("this dashboard answers only to localhost", 421, headers=HEADERS)
        if not shell(request.url.path):
            given = bearer(request)
            if not given or not hmac.compare_digest(given.encode(), self.token):
                return PlainTextResponse(ASK, 401, headers={**HEADERS, "WWW-Authenticate": "Bearer"})
        if request.method == "POST" and request.headers.get(ASKED) != "1":
            return PlainTextResponse(f"403: a POST needs the header {ASKED}: 1", 403, headers=HEADERS)
        response = await call_next(request)
        response.headers.update(HEADERS)
        return response
