"""How the API reports requests it cannot take: always JSON with a `detail` that says what is wrong.

FastAPI's defaults fall short on hostile input: a body that is not UTF-8, or JSON nested deeper than
Python's parser recurses, becomes "There was an error parsing the body"; a validation error echoes
the offending input back (a million-value array, or a lone surrogate that cannot be encoded, which
turned the 422 into a 500). These handlers keep FastAPI's shape ({"detail": [...]}) for validation
errors, with short inputs only, and name the cause of parse errors.

install(app) is the one place every exception handler of the API is installed: these, the server's
own errors (gradwatch.server.errors: each class one status) and SQLite's busy write lock (503 with
Retry-After).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from pydantic_core import PydanticSerializationError
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from starlette.exceptions import HTTPException

from .database import is_lock_timeout
from .errors import (
    Conflict,
    Forbidden,
    GradwatchServerError,
    InvalidRequest,
    NotFound,
    TooLarge,
    Unauthenticated,
)

_MAX_ECHO = 100  # characters of an offending input shown back
_STATUS = {
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    InvalidRequest: 422,
}


class ErrorItem(BaseModel):
    type: str | None = None
    loc: list[str | int] = Field(description="where in the request: body, query… and the path to the value")
    msg: str
    input: Any = Field(default=None, description="the offending value, shortened")


class ErrorOut(BaseModel):
    detail: str | list[ErrorItem] = Field(description="what is wrong with the request")


# Every operation may answer these; documented once for the whole API (OpenAPI).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": description}
    for status, description in (
        (400, "the body could not be parsed (not JSON, not UTF-8, nested too deeply)"),
        (401, "a token is needed, or the one given is unknown or revoked"),
        (403, "the token may not read or change this project's data"),
        (404, "no such run, rule, alert or webhook"),
        (409, "conflicts with what is stored"),
        (413, "the body is larger than the server accepts"),
        (422, "the request is well-formed but a value is wrong: detail says which"),
    )
}


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: any Python string (lone surrogates included) can be sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def model_json(model: BaseModel) -> Response:
    """A response model as JSON straight from pydantic's serializer, for the large numeric reads (a
    100,000-point series: 8 ms, where FastAPI's path -- validate the model again, turn it into
    Python objects, json.dumps -- took ~85 ms of the server's one interpreter while every other
    request waited). A string the serializer refuses (a lone surrogate) falls back to escaped ASCII."""
    try:
        body = model.model_dump_json()
    except (ValueError, PydanticSerializationError):
        return AsciiJSONResponse(model.model_dump(mode="json"))
    return Response(body, media_type="application/json")


def _short(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Infinity
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "…"


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = []
    for error in exc.errors():
        entry = {"type": error.get("type"), "loc": list(error.get("loc", ())), "msg": str(error.get("msg"))}
        if "input" in error and not isinstance(error["input"], (dict, list)):
            entry["input"] = _short(error["input"])
        errors.append(entry)
    return AsciiJSONResponse({"detail": errors}, status_code=422)


def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    detail: Any = exc.detail
    cause = exc.__cause__
    if exc.status_code == 400 and cause is not None:  # FastAPI could not parse the body
        if isinstance(cause, RecursionError):
            detail = "request body is JSON nested too deeply to parse"
        elif isinstance(cause, UnicodeDecodeError):
            detail = f"request body is not valid UTF-8 (byte {cause.start}: {cause.reason})"
        else:
            detail = f"request body could not be parsed: {type(cause).__name__}: {_short(str(cause))}"
    return AsciiJSONResponse(
        {"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


def _out_of_range(_request: Request, exc: OverflowError) -> JSONResponse:
    # A safety net: schemas bound the numbers they store; this catches an id or parameter that slipped
    # through unbounded and is larger than the database's 64-bit integers.
    return AsciiJSONResponse({"detail": f"a number in the request is out of range: {exc}"}, status_code=422)


def _database_refused(_request: Request, exc: DataError) -> JSONResponse:
    # The database refused a value the schemas let through (e.g. a number beyond a column's range).
    return AsciiJSONResponse(
        {"detail": f"a value in the request is out of range for the database: {_short(str(exc.orig))}"},
        status_code=422,
    )


async def _server_error(_request: Request, exc: GradwatchServerError) -> JSONResponse:
    status = _STATUS.get(type(exc), 400)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"detail": str(exc)}
    if isinstance(exc, TooLarge):
        body["limit"] = exc.limit  # as the ingest limits' 413s name theirs
    return JSONResponse(body, status_code=status, headers=headers)


def _read_only(exc: DBAPIError) -> bool:
    """The database refused a write because it is read-only: a PostgreSQL standby or a
    default_transaction_read_only session (SQLSTATE 25006), a read-only SQLite file."""
    orig = exc.orig
    return getattr(orig, "sqlstate", None) == "25006" or "readonly database" in str(orig)


def _read_only_answer() -> JSONResponse:
    return JSONResponse(  # a failover or a maintenance window: retryable, nothing was stored
        {
            "detail": "the database is read-only at the moment (a standby or maintenance); retry later",
            "retry_after_s": 10,
        },
        status_code=503,
        headers={"Retry-After": "10"},
    )


async def _database_failed(_request: Request, exc: DBAPIError) -> JSONResponse:
    if _read_only(exc):
        return _read_only_answer()
    raise exc  # any other database failure stays a 500, logged with its traceback


async def _database_busy(_request: Request, exc: OperationalError) -> JSONResponse:
    if _read_only(exc):
        return _read_only_answer()
    if not is_lock_timeout(exc):
        raise exc  # any other database failure stays a 500, logged with its traceback
    return JSONResponse(  # SQLite's write lock stayed taken (database.SQLITE_BUSY_TIMEOUT_S): retryable
        {"detail": "the database is busy with other writes; retry shortly", "retry_after_s": 2},
        status_code=503,
        headers={"Retry-After": "2"},
    )


def install(app: FastAPI) -> None:
    """Install every exception handler of the API on `app`."""
    app.add_exception_handler(GradwatchServerError, _server_error)  # type: ignore[arg-type]
    app.add_exception_handler(OperationalError, _database_busy)  # type: ignore[arg-type]
    app.add_exception_handler(DataError, _database_refused)  # type: ignore[arg-type]
    app.add_exception_handler(DBAPIError, _database_failed)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(OverflowError, _out_of_range)  # type: ignore[arg-type]
