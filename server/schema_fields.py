"""The field types and limits the API's bodies are built from (gradwatch.server.schemas).

Names, keys, tags and free-form JSON documents are checked here once for what the database and
every later answer need (plain text without NUL characters or lone surrogates, documents nested at
most MAX_DOCUMENT_DEPTH levels), along with run ids, steps, a run's status and resume modes, a
client-given creation time, and the per-batch limits; gradwatch.server.schemas and
gradwatch.server.alert_schemas annotate their fields with them, and gradwatch.server.schemas
re-exports every public name.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

MAX_DOCUMENT_DEPTH = 32


def _plain_text(value: str) -> str:
    """Names and keys are stored as text: no NUL characters (PostgreSQL refuses them) and no lone
    UTF-16 surrogates (not encodable as UTF-8)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return _unicode(value)


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"is not valid Unicode text (a lone surrogate at position {exc.start} of {value[:40]!r})"
        ) from None
    return value


def _shallow(document: dict[str, Any]) -> dict[str, Any]:
    """A free-form JSON document nested at most MAX_DOCUMENT_DEPTH levels, with plain-text keys and
    string values that are valid Unicode (a lone surrogate stored once would fail every answer
    that carries it: a run's config in the project's run list, an event's data in the run's events)."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DOCUMENT_DEPTH:
            raise ValueError(f"is nested deeper than {MAX_DOCUMENT_DEPTH} levels")
        if isinstance(node, str):
            _unicode(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                _plain_text(str(key))
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
    return document


Document = Annotated[dict[str, Any], AfterValidator(_shallow)]

Text = AfterValidator(_plain_text)

RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Client- or server-chosen id")]
Name = Annotated[str, Field(min_length=1, max_length=200), Text]
MetricKey = Annotated[str, Field(min_length=1, max_length=250), Text]
MAX_STEP = 2**62
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
RunStatus = Literal["running", "finished", "crashed"]
ResumeMode = Literal["allow", "must", "never"]
Tag = Annotated[
    str, Field(min_length=1, max_length=100, description='a label such as "baseline" or "lora-r16"'), Text
]
MAX_TAGS = 50

# A run's creation time as a client gives it (`gradwatch sync` of a run recorded offline): at most
# CREATED_AT_SKEW_S ahead of the server's clock (clock skew; stored as the server's now), at most
# CREATED_AT_MAX_AGE_DAYS old (older is a clock that was never set, not a run).
CREATED_AT_SKEW_S = 300
CREATED_AT_MAX_AGE_DAYS = 5 * 365


def _plausible_creation_time(moment: datetime) -> datetime:
    """A creation time in UTC (one without a zone is taken as UTC), not after the server's now."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    now = datetime.now(timezone.utc)
    ahead = (moment - now).total_seconds()
    if ahead > CREATED_AT_SKEW_S:
        raise ValueError(
            f"is {ahead:.0f} s after the server's clock ({now.isoformat()}); at most {CREATED_AT_SKEW_S} s "
            "ahead is taken as clock skew"
        )
    if -ahead > CREATED_AT_MAX_AGE_DAYS * 86400:
        raise ValueError(f"is more than {CREATED_AT_MAX_AGE_DAYS} days before the server's clock")
    return min(moment, now)


CreatedAt = Annotated[datetime, AfterValidator(_plausible_creation_time)]
JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"]

# Per batch: an agent flushes about once a second, so these are generous.
MAX_SERIES_PER_BATCH = 10_000
MAX_POINTS_PER_SERIES = 1_000_000
MAX_EVENTS_PER_BATCH = 100_000
