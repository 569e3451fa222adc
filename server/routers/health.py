"""Health and identity: whether the server is up, and which principal a token is."""

from fastapi import APIRouter

from ..deps import PrincipalDep, StoreDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(store: StoreDep) -> dict[str, str]:
    """Liveness and database reachability."""
    return {"status": "ok", "database": store.ping()}


@router.get("/api/v1/auth/whoami", tags=["auth"])
def whoami(principal: PrincipalDep) -> dict[str, object]:
    """What the request's token may do: {"open": true} on a server without tokens, else the token's
    project ("*": every project), `scope` as stored ("ingest,read", "*"…) and `scopes` (the list:
    ingest, read, admin). 401 without a valid token."""
    return {
        "open": principal.open,
        "project": principal.project,
        "scope": principal.scope,
        "scopes": sorted(principal.scopes),
    }
