from fastapi import APIRouter
from sqlalchemy import text

from ..deps import StoreDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(store: StoreDep) -> dict[str, str]:
    """Liveness and database reachability."""
    with store.engine.connect() as connection:
        connection.execute(text("SELECT 1"))
    return {"status": "ok", "database": store.engine.dialect.name}
