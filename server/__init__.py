"""gradwatch server: the JSON API over SQLite or PostgreSQL.

Importing this package pulls in neither torch nor the dashboard; `gradwatch.server.serve` is the
composition root that mounts the dashboard beside the API.
"""

from .app import create_app
from .settings import Settings

__all__ = ["Settings", "create_app"]
