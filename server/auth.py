"""Access control: project-scoped bearer tokens, each with a set of scopes.

Scopes (least privilege: give each holder only what it needs):
    ingest  create runs and post batches: what every training job's agent gets
    read    see runs, series, alerts, incidents, rules; webhooks with their URL masked
    admin   change what others rely on: rules, webhooks, deletes, renames, acknowledgements (includes read)
    *       every scope, present and future (operators)
A token's project is "*" for every project (operators), or one project name. Tokens made before scopes
had "write", which migration 0009 turned into "ingest,read": agents and dashboards keep working, and
nothing that could once wipe a project's history or silence its alerts keeps that power unasked.

A server that never had a token runs open (local mode: zero set-up, bound to 127.0.0.1). Once a token
has been created, every API request needs one, also after every token is revoked (a revocation must
never open a team's server; `gradwatch server --open` allows that explicitly): `Authorization: Bearer
<token>` (WebSockets may pass `?token=` instead, since browsers cannot set headers on them). Only
SHA-256 hashes of tokens are stored: they are 256-bit random strings, so a slow password hash would
add nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import Engine

from .errors import Forbidden, InvalidRequest, Unauthenticated
from .storage.tokens import TokenRecord, TokenStore

Scope = Literal["ingest", "read", "admin"]
SCOPES: tuple[Scope, ...] = ("ingest", "read", "admin")
EVERY_SCOPE = "*"
# What each scope lets a token do, for error messages and the CLI's help.
SCOPE_PURPOSE = {
    "ingest": "create runs and send training data",
    "read": "read runs, series and alerts",
    "admin": "change rules, webhooks, runs and acknowledgements",
}
# Names a person may type for a set of scopes; "write" is what tokens had before scopes existed.
SCOPE_ALIASES = {"write": ("ingest", "read"), "all": (EVERY_SCOPE,)}
ALL_PROJECTS = "*"
TOKEN_PREFIX = "gw_"
_OPEN_CACHE_S = 2.0  # how long "this server has no tokens" is believed before asking again
_REQUIRED_CACHE_S = 1.0  # and "this server has tokens"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def parse_scopes(text: str) -> str:
    """A scope list as typed ("ingest", "read,admin", "write", "*") in its stored form: known scopes,
    comma-separated in a fixed order, "*" for all of them; InvalidRequest saying what is wrong."""
    names: list[str] = []
    for word in text.replace(" ", ",").split(","):
        word = word.strip().lower()
        if word:
            names.extend(SCOPE_ALIASES.get(word, (word,)))
    unknown = [n for n in names if n != EVERY_SCOPE and n not in SCOPES]
    if not names or unknown:
        raise InvalidRequest(
            f"scope must be one or more of {', '.join(SCOPES)} (comma-separated) or '*' for all, "
            f"not {text!r}" + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else "")
        )
    chosen = set(names)
    if "admin" in chosen:
        chosen.add("read")  # administering what you cannot see is no use
    if EVERY_SCOPE in chosen or chosen >= set(SCOPES):
        return EVERY_SCOPE
    return ",".join(s for s in SCOPES if s in chosen)


def _scope_set(stored: str) -> frozenset[str]:
    return frozenset(SCOPES) if stored == EVERY_SCOPE else frozenset(stored.split(","))


@dataclass(frozen=True)
class Principal:
    """Who is asking: `open` (the server has no tokens) or a token's project and scopes."""

    open: bool
    project: str | None = None
    scope: str | None = None  # stored form: "ingest,read", "*"…
    token_id: int | None = None

    @property
    def scopes(self) -> frozenset[str]:
        return frozenset(SCOPES) if self.open or self.scope is None else _scope_set(self.scope)

    @property
    def home_project(self) -> str | None:
        """The one project a token is for; None for an open server and a token for every project.
        Run ids are a project's own (Store.find_run): such a token names runs within its project."""
        return None if self.open or self.project in (None, ALL_PROJECTS) else self.project

    def sees(self, project: str) -> bool:
        """Whether the token belongs to the project at all (else its resources are as if absent)."""
        return self.open or self.project in (ALL_PROJECTS, project)

    def allows(self, project: str, scope: Scope) -> bool:
        return self.open or (self.sees(project) and scope in self.scopes)

    def require(self, project: str, scope: Scope, what: str = "this") -> None:
        if self.allows(project, scope):
            return
        if not self.sees(project):
            raise Forbidden(f"this token is for project {self.project!r}; {what} belongs to another project")
        raise Forbidden(
            f"{what} needs a token with {scope} scope ({SCOPE_PURPOSE[scope]}); this one has "
            f"{', '.join(sorted(self.scopes))}. An operator creates one with "
            f"`gradwatch token create --project {project} --scope {scope}`"
        )

    def only_project(self, project: str | None, scope: Scope = "read") -> str | None:
        """The project a listing is limited to: the token's own, or the one asked for if allowed."""
        if self.open:
            return project
        if project is not None and not self.sees(project):
            raise Forbidden(f"this token is for project {self.project!r}, not {project!r}")
        self.require(project or str(self.project), scope, "this listing")
        return project if self.project == ALL_PROJECTS else self.project


class Tokens:
    """Create, list, revoke and check tokens (the CLI and the API share this); stored by TokenStore."""

    def __init__(self, engine: Engine, open_after_revocation: bool = False) -> None:
        """open_after_revocation: serve open again once every token is revoked (default: a server that
        has had tokens keeps requiring them)."""
        self._open_after_revocation = open_after_revocation
        self._stored = TokenStore(engine)
        self._lock = threading.Lock()
        self._open_until = 0.0  # monotonic time until which "no tokens" is cached
        self._required_until = 0.0  # and "tokens required" (a revocation opens a server that late at most)

    def create(self, project: str, scope: str, name: str = "") -> tuple[TokenRecord, str]:
        """A new token: (its record, the token itself: shown once, never stored)."""
        scope = parse_scopes(scope)
        if not project or len(project) > 200:
            raise InvalidRequest("project must be 1 to 200 characters ('*' for every project)")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        record = self._stored.add(project, scope, name or f"{scope} token", token[:10], hash_token(token))
        with self._lock:
            self._open_until = 0.0
        return record, token

    def list(self, project: str | None = None, include_revoked: bool = False) -> list[TokenRecord]:
        return self._stored.list(project, include_revoked)

    def revoke(self, token_id: int) -> TokenRecord:
        record = self._stored.revoke(token_id)
        with self._lock:
            self._required_until = 0.0  # the last one revoked may open the server (open_after_revocation)
        return record

    def required(self) -> bool:
        """Whether requests need a token: a token was ever created (or, with open_after_revocation, one
        is still active)."""
        with self._lock:
            if time.monotonic() < self._open_until:
                return False
        with self._lock:
            if time.monotonic() < self._required_until:
                return True
        required = self._stored.exists(active_only=self._open_after_revocation)
        with self._lock:
            if required:  # asked on every request by the tenant limits, on the event loop: not a query each
                self._required_until = time.monotonic() + _REQUIRED_CACHE_S
            else:
                self._open_until = time.monotonic() + _OPEN_CACHE_S
        return required

    def authenticate(self, token: str | None) -> Principal:
        """The principal for a request's token; Unauthenticated if one is needed and missing or bad."""
        if not token:
            if not self.required():
                return Principal(open=True)
            raise Unauthenticated(
                "this server requires a token: send 'Authorization: Bearer <token>' (an operator creates one "
                "with `gradwatch token create --project NAME --scope ingest|read|admin`)"
            )
        record = self._stored.find(hash_token(token))
        if record is None or record.revoked_at is not None:
            if record is None and not self.required():
                return Principal(open=True)  # an open server ignores stray tokens
            raise Unauthenticated("the token is not recognised or has been revoked")
        return Principal(open=False, project=record.project, scope=record.scope, token_id=record.id)


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization:
        return None
    kind, _, value = authorization.partition(" ")
    if kind.lower() != "bearer" or not value.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
    return value.strip()
