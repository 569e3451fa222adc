"""Access control: project-scoped bearer tokens with read or write scope.

A server that never had a token runs open (local mode: zero set-up, bound to 127.0.0.1). Once a token
has been created, every API request needs one — also after every token is revoked (a revocation must
never open a team's server; `gradwatch server --open` allows that explicitly): `Authorization: Bearer <token>` (WebSockets may pass
`?token=` instead, since browsers cannot set headers on them). Write scope includes read. A token's
project is "*" for every project (operators), or one project name. Only SHA-256 hashes of tokens are
stored: they are 256-bit random strings, so a slow password hash would add nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import Engine, select, update

from .database import Transactions
from .errors import Forbidden, InvalidRequest, NotFound, Unauthenticated
from .models import ApiToken

Scope = Literal["read", "write"]
ALL_PROJECTS = "*"
TOKEN_PREFIX = "gw_"
_USED_WRITE_INTERVAL_S = 60.0  # last_used_at is written at most this often per token
_OPEN_CACHE_S = 2.0  # how long "this server has no tokens" is believed before asking again


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is asking: `open` (the server has no tokens) or a token's project and scope."""

    open: bool
    project: str | None = None
    scope: Scope | None = None
    token_id: int | None = None

    def allows(self, project: str, scope: Scope) -> bool:
        if self.open:
            return True
        if scope == "write" and self.scope != "write":
            return False
        return self.project in (ALL_PROJECTS, project)

    def require(self, project: str, scope: Scope, what: str = "this") -> None:
        if self.allows(project, scope):
            return
        if scope == "write" and self.scope != "write":
            raise Forbidden(f"a read token cannot change data; {what} needs a write token for project {project!r}")
        raise Forbidden(f"this token is for project {self.project!r}; {what} belongs to another project")

    def only_project(self, project: str | None) -> str | None:
        """The project a listing is limited to: the token's own, or the one asked for if allowed."""
        if self.open or self.project == ALL_PROJECTS:
            return project
        if project is not None and project != self.project:
            raise Forbidden(f"this token is for project {self.project!r}, not {project!r}")
        return self.project


@dataclass(frozen=True)
class TokenRecord:
    id: int
    project: str
    scope: str
    name: str
    prefix: str
    created_at: float
    last_used_at: float | None
    revoked_at: float | None


class Tokens:
    """Create, list, revoke and check tokens (the CLI and the API share this)."""

    def __init__(self, engine: Engine, open_after_revocation: bool = False) -> None:
        """open_after_revocation: serve open again once every token is revoked (default: a server that
        has had tokens keeps requiring them)."""
        self._open_after_revocation = open_after_revocation
        self._transaction = Transactions(engine)
        self._lock = threading.Lock()
        self._open_until = 0.0  # monotonic time until which "no tokens" is cached
        self._last_used: dict[int, float] = {}

    def create(self, project: str, scope: str, name: str = "") -> tuple[TokenRecord, str]:
        """A new token: (its record, the token itself: shown once, never stored)."""
        if scope not in ("read", "write"):
            raise InvalidRequest(f"scope must be 'read' or 'write', not {scope!r}")
        if not project or len(project) > 200:
            raise InvalidRequest("project must be 1 to 200 characters ('*' for every project)")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._transaction() as session:
            row = ApiToken(
                project=project, scope=scope, name=name or f"{scope} token", prefix=token[:10],
                token_hash=hash_token(token), created_at=time.time(),
            )
            session.add(row)
            session.flush()
            record = self._record(row)
        with self._lock:
            self._open_until = 0.0
        return record, token

    def list(self, project: str | None = None, include_revoked: bool = False) -> list[TokenRecord]:
        with self._transaction() as session:
            query = select(ApiToken).order_by(ApiToken.id)
            if project is not None:
                query = query.where(ApiToken.project == project)
            if not include_revoked:
                query = query.where(ApiToken.revoked_at.is_(None))
            return [self._record(row) for row in session.scalars(query)]

    def revoke(self, token_id: int) -> TokenRecord:
        with self._transaction() as session:
            row = session.get(ApiToken, token_id)
            if row is None:
                raise NotFound(f"token {token_id} does not exist")
            if row.revoked_at is None:
                row.revoked_at = time.time()
            return self._record(row)

    def required(self) -> bool:
        """Whether requests need a token: a token was ever created (or, with open_after_revocation, one
        is still active)."""
        with self._lock:
            if time.monotonic() < self._open_until:
                return False
        query = select(ApiToken.id)
        if self._open_after_revocation:
            query = query.where(ApiToken.revoked_at.is_(None))
        with self._transaction() as session:
            required = session.scalar(query.limit(1)) is not None
        if not required:
            with self._lock:
                self._open_until = time.monotonic() + _OPEN_CACHE_S
        return required

    def authenticate(self, token: str | None) -> Principal:
        """The principal for a request's token; Unauthenticated if one is needed and missing or bad."""
        if not token:
            if not self.required():
                return Principal(open=True)
            raise Unauthenticated(
                "this server requires a token: send 'Authorization: Bearer <token>' "
                "(an operator creates one with `gradwatch token create --project NAME --scope read|write`)"
            )
        with self._transaction() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
            if row is None or row.revoked_at is not None:
                if row is None and not self.required():
                    return Principal(open=True)  # an open server ignores stray tokens
                raise Unauthenticated("the token is not recognised or has been revoked")
            principal = Principal(open=False, project=row.project, scope=row.scope, token_id=row.id)  # type: ignore[arg-type]
            now = time.time()
            if now - self._last_used.get(row.id, 0.0) > _USED_WRITE_INTERVAL_S:
                self._last_used[row.id] = now
                session.execute(update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=now))
        return principal

    @staticmethod
    def _record(row: ApiToken) -> TokenRecord:
        return TokenRecord(
            row.id, row.project, row.scope, row.name, row.prefix, row.created_at, row.last_used_at, row.revoked_at
        )


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization:
        return None
    kind, _, value = authorization.partition(" ")
    if kind.lower() != "bearer" or not value.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return value.strip()
