"""Who may read the dashboard: on a loopback address, pages asked for by a loopback name (no DNS rebinding);
on any other address, whoever shows the token printed at start (?token= once, then a cookie, or an
`Authorization: Bearer` header). Every answer carries headers that keep the page's own scripts the only ones."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

COOKIE = "mgpu_token"
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


def _same(given: str | None, token: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


class Guard(BaseHTTPMiddleware):
    def __init__(self, app, token: str | None):
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next) -> Response:
        if self.token is None and not loopback(_name(request.headers.get("host", ""))):
            return PlainTextResponse("this dashboard answers only to localhost", 421, headers=HEADERS)
        in_query = request.query_params.get("token")
        if self.token is not None:
            bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not any(_same(g, self.token) for g in (in_query, request.cookies.get(COOKIE), bearer)):
                return PlainTextResponse("401: this dashboard asks for the token that 'mgpu-cluster dashboard' "
                                         "printed: open the URL it printed, or send 'Authorization: Bearer TOKEN'",
                                         401, headers={**HEADERS, "WWW-Authenticate": "Bearer"})
        if request.method == "POST" and request.headers.get(ASKED) != "1":
            return PlainTextResponse(f"403: a POST needs the header {ASKED}: 1", 403, headers=HEADERS)
        response = await call_next(request)
        response.headers.update(HEADERS)
        if self.token is not None and _same(in_query, self.token):
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        return response
