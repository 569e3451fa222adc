"""Dependency aliases shared by the routers: the store, and who is asking (access control)."""

from typing import Annotated

from fastapi import Depends, Header, Request

from .auth import Principal, Scope, Tokens, bearer
from .errors import NotFound
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
    """404 for a run that does not exist or belongs to a project the token is not for (the same answer:
    a token cannot learn which ids other projects use); 403 when the token lacks the scope."""
    if principal.open:
        return
    project = store.run_project(run_id)
    if not principal.sees(project):
        raise NotFound(f"run {run_id!r} does not exist")
    principal.require(project, scope, f"run {run_id!r}")


def authorize_project(principal: Principal, project: str, scope: Scope, what: str) -> None:
    """authorize_run for a rule, alert, incident or webhook: 404 ("{what} does not exist") when it
    belongs to a project the token is not for, 403 when the token lacks the scope."""
    if not principal.sees(project):
        raise NotFound(f"{what} does not exist")
    principal.require(project, scope, what)
