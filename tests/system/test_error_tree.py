"""One error tree: every exception class gradwatch defines (found in its source, not listed by hand
alone) is a gradwatch.GradwatchError, or is named below with the reason it is not; classes that were
RuntimeErrors stay RuntimeErrors; both API clients raise the same ApiError."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import httpx
import pytest

import gradwatch
from gradwatch import GradwatchError

ROOT = Path(__file__).resolve().parents[2]
# The source folders and the packages they are ([tool.setuptools] package-dir in pyproject.toml).
PACKAGES = {"agent": "gradwatch", "server": "gradwatch.server", "dashboard": "gradwatch.dashboard"}

# module → class → the bases besides GradwatchError it must keep (users and code catch them).
IN_THE_TREE = {
    "gradwatch._errors": {
        "GradwatchError": (Exception,),
        "ApiError": (),
        "ApiUnavailable": (),
        "ApiUnreachable": (),
        "RunNotFound": (),
        "ResumeError": (RuntimeError,),
    },
    "gradwatch._transport": {"TransportError": ()},
    "gradwatch._guard": {"TrainingHalted": ()},
    "gradwatch.server.errors": {
        "GradwatchServerError": (),
        "NotFound": (),
        "Conflict": (),
        "InvalidRequest": (),
        "Unauthenticated": (),
        "Forbidden": (),
        "TooLarge": (),
    },
    "gradwatch.server.database": {"SchemaError": (RuntimeError,)},
    "gradwatch.server.serve": {"ExposureRefused": (RuntimeError,)},
    "gradwatch.server.ingest_limits": {"IngestLimited": ()},
    # A ValueError of the webhook checks; an httpx.ConnectError, so that its delivery is retried.
    "gradwatch.server.alerts.egress": {
        "EgressRefused": (ValueError,),
        "HostNotPublic": (httpx.ConnectError,),
    },
}

# Defined by the package but not GradwatchErrors, each with why.
OUTSIDE = {
    ("gradwatch._errors", "GradwatchWarning"): "a warning category (a UserWarning), never raised",
    ("gradwatch.server.compression", "_Refused"): "private: caught where raised, answered as a status",
    ("gradwatch.server.routers.live", "_BadQuery"): "private: caught where raised, answered as a status",
    ("gradwatch.server.app", "_BodyTooLarge"): "private: caught where raised, answered as a 413",
}

EXCEPTION_NAMES = {name for name, value in vars(builtins).items() if isinstance(value, type)}
EXCEPTION_NAMES = {name for name in EXCEPTION_NAMES if issubclass(getattr(builtins, name), BaseException)}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[relative.parts[0]], *relative.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def defined_exception_classes() -> set[tuple[str, str]]:
    """(module, class) for every class in agent/, server/ and dashboard/ whose bases are exceptions:
    a built-in one, a name ending in Error, Exception or Warning (httpx.ConnectError…), or another
    class found so."""
    classes: list[tuple[str, str, list[str]]] = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
                    classes.append((module_name(path), node.name, bases))
    found: set[tuple[str, str]] = set()
    names = set(EXCEPTION_NAMES)
    while True:
        more = {
            (module, name)
            for module, name, bases in classes
            if any(base in names or base.endswith(("Error", "Exception", "Warning")) for base in bases)
        }
        if more == found:
            return found
        found = more
        names |= {name for _, name in found}


def test_every_exception_class_the_package_defines_is_listed_here():
    listed = {(module, name) for module, classes in IN_THE_TREE.items() for name in classes} | set(OUTSIDE)
    assert defined_exception_classes() == listed


@pytest.mark.parametrize(
    ("module", "name", "kept"),
    [(module, name, kept) for module, classes in IN_THE_TREE.items() for name, kept in classes.items()],
)
def test_each_is_a_gradwatch_error_and_keeps_its_old_bases(module, name, kept):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, GradwatchError)
    for base in kept:
        assert issubclass(cls, base)


@pytest.mark.parametrize(("module", "name"), sorted(OUTSIDE))
def test_those_outside_the_tree_are_exceptions_or_warnings(module, name):
    assert issubclass(getattr(importlib.import_module(module), name), BaseException)


def test_the_public_names_are_the_tree():
    from gradwatch import _errors, api
    from gradwatch.dashboard import api_client

    assert gradwatch.GradwatchError is _errors.GradwatchError
    assert gradwatch.ApiError is api.ApiError is api_client.ApiError is _errors.ApiError
    assert api.ApiUnavailable is api_client.ApiUnavailable
    assert api.ApiUnreachable is api_client.ApiUnreachable
    assert api_client.RunNotFound is _errors.RunNotFound
    assert issubclass(api.ApiUnreachable, api_client.ApiUnavailable)
    assert gradwatch.ResumeError is _errors.ResumeError


def test_api_error_takes_both_clients_arguments():
    read = gradwatch.ApiError("GET /x: HTTP 404: gone", 404, "gone", "http://h/x")
    assert (read.status, read.status_code, read.detail, read.url) == (404, 404, "gone", "http://h/x")
    dashboard = gradwatch.ApiError("GET /x → 500: boom", status_code=500)
    assert (dashboard.status, dashboard.status_code, dashboard.detail) == (500, 500, "GET /x → 500: boom")
