"""Protections against the pages a user's browser visits: one pure-ASGI middleware, outermost, for the
API and the dashboard alike (HTTP, streaming and WebSockets).

An open local server (no tokens) answers everyone who reaches 127.0.0.1, and any page a browser shows
can make it send requests there; a signed-in dashboard's cookie goes with every request to it.

- Host allow-list on a server listening on loopback (DNS rebinding: a page on evil.example whose name
  is re-pointed at 127.0.0.1 can read the answers, since to the browser they are same-origin; its
  requests say `Host: evil.example`). Answered: loopback names, IP addresses (never a rebinding: no
  name is resolved), the host of Settings.public_url, the host the server listens on,
  Settings.allowed_hosts ("*": any). Else 400, WebSocket handshakes too.
- Origin check (cross-site forms and fetches, login CSRF, reading a live stream from another site):
  POST, PUT, PATCH and DELETE requests and WebSocket handshakes that carry an Origin must come from
  the request's own origin (the scope's scheme, which uvicorn takes from X-Forwarded-Proto of a
  trusted proxy, and the Host header; any port of it when a proxy forwarded Host without one), the
  origin of Settings.public_url or a host of Settings.allowed_hosts; `Origin: null` is refused, and
  so is `Sec-Fetch-Site: cross-site` without an Origin. Else 403. Requests with neither header
  (agents, curl) pass: current browsers send one (the sign-in form has its own token besides).
- On every HTTP response: `Content-Security-Policy: frame-ancestors 'none'` (added to a policy the
  response already has), `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff`,
  `Referrer-Policy: same-origin`.
- Open and exposed while serving: a server started beyond loopback with `--open` passed
  serve.check_exposure because tokens existed; once the last one is revoked it is open, and other
  machines get 503 until a token exists again (unless it was started with `--insecure`).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import Tokens
from .http_errors import AsciiJSONResponse
from .settings import Settings

__all__ = ["STATE_CHANGING", "WebSecurity", "WebSecurityPolicy", "is_loopback", "split_authority"]

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HTTP_SCHEME = {"http": "http", "https": "https", "ws": "http", "wss": "https"}
# host[:port]: a name, an IPv4 address or a bracketed IPv6 address (matched lower-cased).
_AUTHORITY = re.compile(r"(?:\[(?P<ipv6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?")
_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<authority>[^/?#@\\\s]+)")
_MAX_ECHO = 100  # characters of a refused Host or Origin shown back
_SECURITY_HEADERS = (
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
)
_FRAME_ANCESTORS = "frame-ancestors 'none'"

Origin = tuple[str, str, int]  # (http or https, host, port)


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_authority(value: str) -> tuple[str, int | None] | None:
    """(host, port) of "host[:port]" (a Host header, an allow-list entry), the host lower-cased without
    IPv6 brackets or a trailing dot, the port None when absent; None when value is not one."""
    match = _AUTHORITY.fullmatch(value.strip().lower())
    if match is None:
        return None
    host = match["ipv6"] or match["name"].rstrip(".")
    port = int(match["port"]) if match["port"] else None
    if not host or (port is not None and not 0 < port < 65536):
        return None
    return host, port


def _origin(scheme: str, authority: str) -> Origin | None:
    """The normalised origin of a scheme and "host[:port]" (the default port filled in)."""
    scheme = _HTTP_SCHEME.get(scheme.lower(), "")
    split = split_authority(authority)
    if not scheme or split is None:
        return None
    host, port = split
    return scheme, host, _DEFAULT_PORTS[scheme] if port is None else port


def _parse_origin(value: str) -> Origin | None:
    match = _ORIGIN.fullmatch(value.strip().lower())
    return _origin(match["scheme"], match["authority"]) if match else None


def _shown(value: str) -> str:
    return repr(value if len(value) <= _MAX_ECHO else value[:_MAX_ECHO] + "…")


class WebSecurityPolicy:
    """Which hosts and origins the server answers, and where it listens. Built with the app (a bad
    allowed_hosts entry is a ValueError then); the composition root calls listening_on() before serving."""

    def __init__(self, settings: Settings) -> None:
        # A str: a caller without a type checker gave one host name; iterating it would allow its letters.
        entries: tuple[str, ...] | str = settings.allowed_hosts or ()
        if isinstance(entries, str):
            raise TypeError(f"allowed_hosts must be a tuple of host names, not the string {entries!r}")
        self.any_host = "*" in entries
        self._allowed: list[tuple[str, int | None]] = []
        for entry in entries:
            if entry == "*":
                continue
            split = split_authority(entry)
            if split is None:
                raise ValueError(f"allowed_hosts: {entry!r} is not a host name, address or host:port")
            self._allowed.append(split)
        public = urlsplit(settings.public_url)
        self.public_origin = _origin(public.scheme, public.netloc) if public.netloc else None
        self.open_after_revocation = settings.open_after_revocation
        self.listening_host: str | None = None  # None: not told (an app served some other way)
        self.insecure = False

    def listening_on(self, host: str, insecure: bool) -> None:
        """The address the server binds (a name counts as an allowed host) and whether --insecure was
        given."""
        self.listening_host = host.strip().strip("[]").lower()
        self.insecure = insecure

    def _configured(self, host: str, port: int) -> bool:
        return any(host == name and allowed_port in (None, port) for name, allowed_port in self._allowed)

    def allows_host(self, host: str, port: int) -> bool:
        """Whether requests naming host:port in their Host header are answered. Only a server on
        loopback checks: that is what DNS rebinding reaches. One listening beyond it either requires
        tokens (a rebound page has none, and the dashboard's cookie is the real host's) or was opened to
        the network on purpose (--insecure); checking there would only make a team's agents, which
        reach it by whatever name their network gives it, lose their batches to a 400."""
        if self.listening_host is not None and not is_loopback(self.listening_host):
            return True
        if self.any_host or host in LOOPBACK_NAMES or _is_address(host) or host == self.listening_host:
            return True
        if self.public_origin is not None and host == self.public_origin[1]:
            return True
        return self._configured(host, port)

    def allows_origin(self, origin: Origin) -> bool:
        """Whether pages of another origin than the request's own may change things here."""
        return origin == self.public_origin or self._configured(origin[1], origin[2])

    def exposure_matters(self) -> bool:
        """Whether the server could become open while reachable from elsewhere: started with --open,
        beyond loopback, without --insecure. (Without --open, a server that passed check_exposure
        keeps requiring tokens: Tokens.required() stays true once a token was created.)"""
        return (
            self.open_after_revocation
            and not self.insecure
            and self.listening_host is not None
            and not is_loopback(self.listening_host)
        )


class WebSecurity:
    """The ASGI middleware applying a WebSecurityPolicy (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: WebSecurityPolicy, tokens: Tokens) -> None:
        self.app = app
        self.policy = policy
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._host_refusal(scope, headers) or self._origin_refusal(scope, headers)
        if refusal is None and self.policy.exposure_matters():
            refusal = await self._exposure_refusal(scope)
        if scope["type"] == "http":
            send = self._with_security_headers(send)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, detail = refusal
        response = AsciiJSONResponse({"detail": detail}, status_code=status)
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            await send(
                {"type": "websocket.close", "code": 1008}
            )  # before the handshake: the server sends 403
            return
        await response(scope, receive, send)  # on a WebSocket: a denial response (the ASGI extension)

    @staticmethod
    def _is_own_origin(origin: Origin, scope: Scope, headers: Headers) -> bool:
        """Whether origin is the request's own: the scope's scheme (uvicorn applies X-Forwarded-Proto
        from trusted proxies) with the Host header's host and port. A proxy that forwards Host without
        the port (nginx's $host, as server/deploy/nginx.conf does) makes every port of that host the
        request's own; a proxied request carries X-Forwarded-For, which a cross-site form cannot add
        (and a cross-site fetch only after a CORS preflight this server never approves)."""
        own = _origin(scope.get("scheme", "http"), headers.get("host", ""))
        if own is None:
            return False
        if "x-forwarded-for" in headers and split_authority(headers["host"]) == (own[1], None):  # no port
            return origin[:2] == own[:2]
        return origin == own

    def _host_refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host")
        if host is None or self.policy.any_host:
            return None  # HTTP/1.0 without Host: not a browser
        own = _origin(scope.get("scheme", "http"), host)
        if own is not None and self.policy.allows_host(own[1], own[2]):
            return None
        return 400, (
            f"refused Host {_shown(host)}: this server answers only to loopback names, IP addresses, the "
            "host of its public URL (--public-url, GRADWATCH_PUBLIC_URL) and GRADWATCH_ALLOWED_HOSTS "
            "(protection against DNS rebinding); to reach it by this name, add it to "
            "GRADWATCH_ALLOWED_HOSTS (comma separated, '*' for any)"
        )

    def _origin_refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        if scope["type"] == "http" and scope["method"] not in STATE_CHANGING:
            return None
        what = "WebSocket" if scope["type"] == "websocket" else scope["method"]
        origin = headers.get("origin")
        if origin is None:
            if headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
                return 403, (
                    f"refused a cross-site {what} (Sec-Fetch-Site: cross-site): only this server's own "
                    "pages may change data or open live streams from a browser"
                )
            return None  # not sent by a browser (agents, curl, httpx)
        parsed = _parse_origin(origin)
        if parsed is not None and (
            self._is_own_origin(parsed, scope, headers) or self.policy.allows_origin(parsed)
        ):
            return None
        return 403, (
            f"refused a cross-site {what} from origin {_shown(origin)}: only this server's own pages may "
            "change data or open live streams from a browser; to allow that site, add its host to "
            "GRADWATCH_ALLOWED_HOSTS"
        )

    async def _exposure_refusal(self, scope: Scope) -> tuple[int, str] | None:
        client = scope.get("client")
        if client is not None and is_loopback(client[0]):
            return None
        if await run_in_threadpool(self.tokens.required):  # a database query: off the event loop
            return None
        return 503, (
            f"this server is open and exposed: it listens on {self.policy.listening_host}, beyond this "
            "machine, and every access token has been revoked (it was started with --open), so it "
            "refuses requests from other machines until a token exists (`gradwatch token create "
            "--project NAME --scope SCOPE`); restart it with --insecure to serve them open"
        )

    @staticmethod
    def _with_security_headers(send: Send) -> Send:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                policy = headers.get("content-security-policy")
                if policy is None:
                    headers["Content-Security-Policy"] = _FRAME_ANCESTORS
                elif "frame-ancestors" not in policy.lower():
                    headers["Content-Security-Policy"] = f"{policy.rstrip('; ')}; {_FRAME_ANCESTORS}"
                for name, value in _SECURITY_HEADERS:
                    headers.setdefault(name, value)
            await send(message)

        return send_with_headers
