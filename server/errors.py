"""Errors the store raises; the API turns each into one HTTP status with its message.

GradwatchServerError
├── Unauthenticated → 401 (no token, or one that is unknown or revoked)
├── Forbidden       → 403 (a valid token without the right scope or project)
├── NotFound        → 404
├── Conflict        → 409
├── TooLarge        → 413 (more work than one request may make; `limit` names the limit)
└── InvalidRequest  → 422

GradwatchServerError is a gradwatch.GradwatchError, the root of everything gradwatch raises.
"""

from .._errors import GradwatchError


class GradwatchServerError(GradwatchError):
    """Root of the server's own errors."""


class NotFound(GradwatchServerError):
    pass


class Conflict(GradwatchServerError):
    pass


class InvalidRequest(GradwatchServerError):
    pass


class Unauthenticated(GradwatchServerError):
    pass


class Forbidden(GradwatchServerError):
    pass


class TooLarge(GradwatchServerError):
    """A request that would make the server do more than one request may: split it and send again."""

    def __init__(self, detail: str, limit: str) -> None:
        super().__init__(detail)
        self.limit = limit
