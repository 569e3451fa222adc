"""Dependency aliases shared by the routers: the store, and who is asking (access control)."""

from typing import Annotated

from fastapi import Depends, Header, Request

from .auth import Principal, Scope, Tokens, bearer
from .store import Store


def _store(request: Request) -> Store:
    return request.app.state.store


def _principal(
    request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> Principal:
    tokens: Tokens = request.app.state.tokens
    return tokens.authenticate(bearer(authorization))


StoreDep = Annotated[Store, Depends(_store)]
PrincipalDep = Annotated[Principal, Depends(_principal)]


def authorize_run(store: Store, principal: Principal, run_id: str, scope: Scope) -> None:
    """404 for an unknown run; 403 unless the principal may read (or write) the run's project."""
    if not principal.open:
        principal.require(store.run_project(run_id), scope, f"run {run_id!r}")
