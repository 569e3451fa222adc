"""Authentication before the body: a request that would write is refused before a byte of it is read.

The API checks tokens in a dependency, which FastAPI resolves after it has read the body: a gzip body
was inflated and JSON parsed for anyone, token or not (a 32 KB body inflating to 32 MB, from six
unauthenticated threads, slowed a real client 120x). This pure-ASGI middleware, outside the body
limits and the gzip inflation, checks the bearer token of every POST, PUT, PATCH and DELETE under
/api/ first: a missing or unknown token is answered 401 with the body unread (and the connection
closed, so its bytes are never read either). The principal found is handed to the route's
dependency in the scope, so a good token costs no second lookup.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import Principal, Tokens, bearer
from .errors import Unauthenticated
from .http_errors import AsciiJSONResponse

PRINCIPAL_SCOPE_KEY = "gradwatch.principal"  # the principal this middleware authenticated
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class AuthenticateBeforeBody:
    def __init__(self, app: ASGIApp, tokens: Tokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WRITES or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
        )
        try:
            # The token store reads the database: off the event loop, as the dependency would be.
            principal: Principal = await run_in_threadpool(self.tokens.authenticate, bearer(authorization))
        except Unauthenticated as refused:
            response = AsciiJSONResponse(
                {"detail": str(refused)},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
            )
            await response(scope, receive, send)
            return
        await self.app({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)
