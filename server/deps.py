"""Dependency aliases shared by the routers: the store, the alert service, who is asking (access
control), and the path and query parameters several endpoints take."""

from typing import Annotated

from fastapi import Depends, Header, Path, Query, Request

from .alerts import AlertService
from .auth import Principal, Scope, Tokens, bearer
from .auth_first import PRINCIPAL_SCOPE_KEY
from .errors import NotFound
from .storage import Store


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _alerts(request: Request) -> AlertService:
    alerts: AlertService = request.app.state.alerts
    return alerts


def _principal(
    request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> Principal:
    known = request.scope.get(PRINCIPAL_SCOPE_KEY)  # authenticated before the body was read
    if known is not None:
        return known  # type: ignore[no-any-return]
    tokens: Tokens = request.app.state.tokens
    return tokens.authenticate(bearer(authorization))


StoreDep = Annotated[Store, Depends(_store)]
AlertsDep = Annotated[AlertService, Depends(_alerts)]
PrincipalDep = Annotated[Principal, Depends(_principal)]

# Row ids are 32-bit integers in the database; larger values cannot name anything.
RowId = Annotated[int, Path(ge=1, le=2**31 - 1)]
QueryRowId = Annotated[int | None, Query(ge=1, le=2**31 - 1)]
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0)]


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


def _readable_run(run_id: str, store: StoreDep, principal: PrincipalDep) -> str:
    """The path's run id, once the caller may read the run (404 unknown run, 401/403 token): checked
    before the endpoint's query parameters are."""
    authorize_run(store, principal, run_id, "read")
    return run_id


ReadableRunId = Annotated[str, Depends(_readable_run)]
