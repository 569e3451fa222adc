"""One router per resource of the /api/v1 JSON API."""
