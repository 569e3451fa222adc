"""The access tokens' table: each method one transaction. Only SHA-256 hashes of tokens are stored;
what a token may do, and whether the server needs one at all, is gradwatch.server.auth's."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Engine, select, update

from ..database import Transactions
from ..errors import NotFound
from ..models import ApiToken

__all__ = ["TokenRecord", "TokenStore"]

_USED_WRITE_INTERVAL_S = 60.0  # last_used_at is written at most this often per token


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


class TokenStore:
    """Create, list, revoke and look up stored tokens (by hash)."""

    def __init__(self, engine: Engine) -> None:
        self._transaction = Transactions(engine)
        self._last_used: dict[int, float] = {}

    def add(self, project: str, scope: str, name: str, prefix: str, token_hash: str) -> TokenRecord:
        """Store a new token (its hash and the prefix shown in listings)."""
        with self._transaction() as session:
            row = ApiToken(
                project=project,
                scope=scope,
                name=name,
                prefix=prefix,
                token_hash=token_hash,
                created_at=time.time(),
            )
            session.add(row)
            session.flush()
            return _record(row)

    def list(self, project: str | None = None, include_revoked: bool = False) -> list[TokenRecord]:
        with self._transaction() as session:
            query = select(ApiToken).order_by(ApiToken.id)
            if project is not None:
                query = query.where(ApiToken.project == project)
            if not include_revoked:
                query = query.where(ApiToken.revoked_at.is_(None))
            return [_record(row) for row in session.scalars(query)]

    def revoke(self, token_id: int) -> TokenRecord:
        """Mark a token revoked (again: harmless); NotFound for an unknown id."""
        with self._transaction() as session:
            row = session.get(ApiToken, token_id)
            if row is None:
                raise NotFound(f"token {token_id} does not exist")
            if row.revoked_at is None:
                row.revoked_at = time.time()
            return _record(row)

    def exists(self, active_only: bool) -> bool:
        """Whether a token was ever created (active_only: one that is not revoked)."""
        query = select(ApiToken.id)
        if active_only:
            query = query.where(ApiToken.revoked_at.is_(None))
        with self._transaction() as session:
            return session.scalar(query.limit(1)) is not None

    def find(self, token_hash: str) -> TokenRecord | None:
        """The token with this hash, revoked or not, or None. A token that is not revoked is marked
        used (last_used_at, written at most every _USED_WRITE_INTERVAL_S per token)."""
        with self._transaction() as session:
            row = session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash))
            if row is None:
                return None
            record = _record(row)
            now = time.time()
            if row.revoked_at is None and now - self._last_used.get(row.id, 0.0) > _USED_WRITE_INTERVAL_S:
                self._last_used[row.id] = now
                session.execute(update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=now))
            return record


def _record(row: ApiToken) -> TokenRecord:
    return TokenRecord(
        row.id, row.project, row.scope, row.name, row.prefix, row.created_at, row.last_used_at, row.revoked_at
    )
