"""Dependency aliases shared by the routers."""

from typing import Annotated

from fastapi import Depends, Request

from .store import Store


def _store(request: Request) -> Store:
    return request.app.state.store


StoreDep = Annotated[Store, Depends(_store)]
