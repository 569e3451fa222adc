"""Errors the store raises; the API turns each into one HTTP status with its message.

    GradwatchServerError
    ├── NotFound        → 404
    ├── Conflict        → 409
    └── InvalidRequest  → 422
"""


class GradwatchServerError(Exception):
    """Root of the server's own errors."""


class NotFound(GradwatchServerError):
    pass


class Conflict(GradwatchServerError):
    pass


class InvalidRequest(GradwatchServerError):
    pass
