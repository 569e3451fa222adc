"""Dependency aliases shared by the routers: the store, the alert service, who is asking (access
control), and the path and query parameters several endpoints take."""

from typing import Annotated, Any

from fastapi import Depends, Header, Path, Query, Request

from .alerts import AlertService
from .auth import Principal, Scope, Tokens, bearer
from .auth_first import PRINCIPAL_SCOPE_KEY
from .errors import NotFound
from .storage import RunRecord, Store


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


def authorize_run(
    store: Store, principal: Principal, run_id: str, scope: Scope, project: str | None = None
) -> str:
    """The stored id of the run the caller calls run_id, once it may use the run with `scope`: 404 for
    a run that does not exist or belongs to a project the token is not for (the same answer: a token
    cannot learn which ids other projects use), 403 when the token lacks the scope.

    Run ids are a project's own (Store.find_run): a token for one project names runs within it, so
    "exp-1" is its project's run even when another project has an "exp-1" too; the endpoints work on
    the stored id this returns and name runs in their answers as the caller does (RunNames). With
    `project`, run_id is that project's name for the run, whoever asks (the dashboard links alerts
    carry: a token for every project would otherwise take "exp-1" for the run stored under it)."""
    if project is not None and principal.home_project not in (None, project):
        raise NotFound(f"run {run_id!r} does not exist")
    stored, project = store.find_run(run_id, principal.home_project if project is None else project)
    if not principal.sees(project):
        raise NotFound(f"run {run_id!r} does not exist")
    principal.require(project, scope, f"run {run_id!r}")
    return stored


class RunNames:
    """Runs named in an answer as the caller names them. A token for one project calls its runs by the
    ids the project asked for; a run stored under another id (its name was another project's first:
    Store.find_run) is shown under the asked-for id. Open servers and tokens for every project see the
    stored ids, unique on the server. (Links an alert or incident carries name the project's own id
    already, AlertEngine.link; those stored before links named it carry the stored id, rewritten here.)"""

    def __init__(self, store: Store, principal: Principal) -> None:
        self._store = store
        self._renames = principal.home_project is not None

    def of_record(self, record: RunRecord) -> str:
        return record.requested_id if self._renames and record.requested_id else record.id

    def in_documents(self, documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Alerts, incidents or rules (dicts with a run_id) with their runs named for the caller."""
        if not self._renames:
            return documents
        names = self._store.requested_ids(d["run_id"] for d in documents if d.get("run_id"))
        if not names:
            return documents
        return [_renamed(d, names[d["run_id"]]) if d.get("run_id") in names else d for d in documents]


def _renamed(document: dict[str, Any], name: str) -> dict[str, Any]:
    page = f"/dashboard/runs/{document['run_id']}"  # a stored id of another name is a uuid4 hex

    def rename(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(page, f"/dashboard/runs/{name}") if page in value else value
        if isinstance(value, dict):
            return {k: rename(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rename(v) for v in value]
        return value

    return {**rename(document), "run_id": name}


def authorize_project(principal: Principal, project: str, scope: Scope, what: str) -> None:
    """authorize_run for a rule, alert, incident or webhook: 404 ("{what} does not exist") when it
    belongs to a project the token is not for, 403 when the token lacks the scope."""
    if not principal.sees(project):
        raise NotFound(f"{what} does not exist")
    principal.require(project, scope, what)


def _readable_run(run_id: str, store: StoreDep, principal: PrincipalDep) -> str:
    """The stored id of the path's run, once the caller may read it (404 unknown run, 401/403 token):
    checked before the endpoint's query parameters are."""
    return authorize_run(store, principal, run_id, "read")


def _ingestible_run(run_id: str, store: StoreDep, principal: PrincipalDep) -> str:
    """The same for a caller that sends the run data (scope ingest)."""
    return authorize_run(store, principal, run_id, "ingest")


def _administered_run(run_id: str, store: StoreDep, principal: PrincipalDep) -> str:
    """The same for a caller that changes or deletes the run (scope admin)."""
    return authorize_run(store, principal, run_id, "admin")


# The path's run id, authorized for one scope: an endpoint takes one of these instead of calling
# authorize_run itself (404 unknown or another project's run, 401/403 token).
ReadableRunId = Annotated[str, Depends(_readable_run)]
IngestibleRunId = Annotated[str, Depends(_ingestible_run)]
AdministeredRunId = Annotated[str, Depends(_administered_run)]


def _run_names(store: StoreDep, principal: PrincipalDep) -> RunNames:
    return RunNames(store, principal)


RunNamesDep = Annotated[RunNames, Depends(_run_names)]
