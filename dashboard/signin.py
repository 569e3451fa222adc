"""Signing in to a server that requires tokens.

The token a person pastes is checked against the API (GET /api/v1/auth/whoami) and kept only in a
browser-session cookie: HttpOnly (page scripts cannot read it), SameSite=Strict (other sites cannot
make the browser send it), scoped to the dashboard's path, no expiry (gone when the browser closes).
The dashboard keeps nothing on the server; every API call it makes on someone's behalf carries
their token (ApiClient's token_provider).
"""

from __future__ import annotations

from urllib.parse import quote, urlencode

import flask
from dash import dcc, html

from .api_client import ApiClient, ApiError

COOKIE = "gradwatch_token"


def token_from_request() -> str | None:
    """The signed-in person's token, when called while serving one of their requests."""
    if not flask.has_request_context():
        return None
    return flask.request.cookies.get(COOKIE) or None


def _safe_next(target: str | None, prefix: str) -> str:
    """Only a path inside the dashboard: never an open redirect to another site."""
    if target and target.startswith(prefix) and not target.startswith("//") and "\\" not in target:
        return target
    return prefix


def register_routes(server: flask.Flask, api: ApiClient, prefix: str) -> None:
    """POST {prefix}signin (the sign-in form) and GET {prefix}signout on the dashboard's Flask server
    (its routes are relative to the mount point)."""

    @server.post("/signin")
    def signin() -> flask.Response:
        token = (flask.request.form.get("token") or "").strip()
        target = _safe_next(flask.request.form.get("next"), prefix)
        try:
            identity = api.whoami(token=token) if token else None
        except ApiError as exc:
            identity = None
            if exc.status_code not in (400, 401, 403):
                return flask.redirect(prefix + "signin?" + urlencode({"error": exc.detail, "next": target}))
        if not identity:
            message = "That token was not accepted: it is unknown or revoked." if token else "Paste a token."
            return flask.redirect(prefix + "signin?" + urlencode({"error": message, "next": target}))
        response = flask.redirect(target)
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="Strict", path=prefix, secure=flask.request.is_secure
        )
        return response

    @server.get("/signout")
    def signout() -> flask.Response:
        response = flask.redirect(prefix + "signin")
        response.delete_cookie(COOKIE, path=prefix)
        return response


def signin_page(prefix: str, next_path: str, error: str | None, signed_in: bool) -> html.Div:
    """The sign-in card: a plain HTML form posted to the server (no script handles the token)."""
    return html.Div(
        [
            html.H1("Sign in"),
            html.P(
                "This gradwatch server requires an access token. Paste a read token to look at your "
                "project's runs (an admin token also lets you change alert rules and webhooks). It is "
                "kept only for this browser session."
            ),
            html.P(error, className="error-text", id="signin-error") if error else None,
            html.Form(
                [
                    dcc.Input(type="password", name="token", id="signin-token", placeholder="gw_…",
                              autoComplete="off", className="token-input"),
                    dcc.Input(type="hidden", name="next", value=next_path),
                    html.Button("Sign in", type="submit", id="signin-submit", className="button primary"),
                ],
                action=prefix + "signin",
                method="POST",
                className="signin-form",
            ),
            html.P(
                [
                    "An operator creates tokens with ",
                    html.Code("gradwatch token create --project NAME --scope read"),
                    ".",
                ],
                className="muted",
            ),
            html.A("Sign out", href=prefix + "signout", id="signout") if signed_in else None,
        ],
        className="card signin",
    )


def signin_href(prefix: str, pathname: str | None, search: str | None) -> str:
    """The sign-in page's URL, coming back to where the person was."""
    return prefix + "signin?next=" + quote((pathname or prefix) + (search or ""), safe="")
