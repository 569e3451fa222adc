"""The sign-in page (/dashboard/signin) and its form's routes: signing in to a server that requires
tokens.

The token a person pastes is checked against the API (GET /api/v1/auth/whoami) and kept only in a
browser-session cookie: HttpOnly (page scripts cannot read it), SameSite=Strict (other sites cannot
make the browser send it), scoped to the dashboard's path, no expiry (gone when the browser closes).
The dashboard keeps nothing on the server; every API call it makes on someone's behalf carries
their token (ApiClient's token_provider).

Login CSRF (another site signing the browser in with the attacker's token): the server refuses a
cross-site Origin (server.web_security); the form also carries a double-submit token, the value of a
SameSite=Strict cookie that a cross-site page can neither read nor make the browser send, so a browser
that sends no Origin cannot be signed in from elsewhere either. Signing out is a POST with the same
double-submit token: deleting a cookie needs no cookie sent, so a GET would let any page (a link, an
<img>) sign people out.
"""

from __future__ import annotations

import hmac
import secrets
from typing import TYPE_CHECKING
from urllib.parse import quote, urlencode

import dash
import flask
from dash import dcc, html

from ..api_client import ApiClient, ApiError

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

COOKIE = "gradwatch_token"
CSRF_COOKIE = "gradwatch_csrf"
CSRF_FIELD = "csrf"


def token_from_request() -> str | None:
    """The signed-in person's token, when called while serving one of their requests."""
    if not flask.has_request_context():
        return None
    return flask.request.cookies.get(COOKIE) or None


def csrf_token(prefix: str) -> str:
    """The sign-in form's CSRF token, while serving a request: this browser's CSRF cookie, or a new
    random value that the response sets as that cookie (HttpOnly, SameSite=Strict, the dashboard's path)."""
    existing = flask.request.cookies.get(CSRF_COOKIE, "")
    if 32 <= len(existing) <= 64:
        return existing
    if "gradwatch_csrf" not in flask.g:  # one new value per request, however many forms it renders
        token = flask.g.gradwatch_csrf = secrets.token_urlsafe(32)

        @flask.after_this_request
        def _set_cookie(response: flask.Response) -> flask.Response:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                httponly=True,
                samesite="Strict",
                path=prefix,
                secure=flask.request.is_secure,
            )
            return response

    csrf: str = flask.g.gradwatch_csrf
    return csrf


def _csrf_matches() -> bool:
    """The double-submit check: the form's token equals the cookie's (compared in constant time)."""
    cookie = flask.request.cookies.get(CSRF_COOKIE, "")
    field = flask.request.form.get(CSRF_FIELD, "")
    return bool(cookie) and hmac.compare_digest(cookie.encode(), field.encode())


def _safe_next(target: str | None, prefix: str) -> str:
    """Only a path inside the dashboard: never an open redirect to another site."""
    if target and target.startswith(prefix) and not target.startswith("//") and "\\" not in target:
        return target
    return prefix


# What the sign-in page may say after a redirect: ?error= carries one of these codes, never text, so
# a link cannot make the page show words of its author's choosing.
ERRORS = {
    "expired": "The sign-in form had expired or came from another site: sign in again.",
    "signout-expired": "The sign-out form had expired or came from another site: sign out again.",
    "rejected": "That token was not accepted: it is unknown or revoked.",
    "empty": "Paste a token.",
    "unavailable": "The gradwatch API could not check the token just now: try again shortly.",
}


def error_message(code: str | None) -> str | None:
    """The sign-in page's message for an ?error= code (None for no code or an unknown one)."""
    return ERRORS.get(code or "")


def register(app: dash.Dash, api: ApiClient, prefix: str) -> None:
    """POST {prefix}signin (the sign-in form) and POST {prefix}signout on the dashboard's Flask server
    (its routes are relative to the mount point); GET {prefix}signout shows the sign-in page, with its
    sign-out button."""
    server: flask.Flask = app.server

    @server.post("/signin")
    def signin() -> Response:
        token = (flask.request.form.get("token") or "").strip()
        target = _safe_next(flask.request.form.get("next"), prefix)
        if not _csrf_matches():  # before the token is tried: another site's form learns nothing
            return flask.redirect(prefix + "signin?" + urlencode({"error": "expired", "next": target}))
        try:
            identity = api.whoami(token=token) if token else None
        except ApiError as exc:
            identity = None
            if exc.status_code not in (400, 401, 403):
                return flask.redirect(
                    prefix + "signin?" + urlencode({"error": "unavailable", "next": target})
                )
        if not identity:
            code = "rejected" if token else "empty"
            return flask.redirect(prefix + "signin?" + urlencode({"error": code, "next": target}))
        response = flask.redirect(target)
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="Strict", path=prefix, secure=flask.request.is_secure
        )
        return response

    @server.post("/signout")
    def signout() -> Response:
        if not _csrf_matches():  # another site's form or link: nobody is signed out
            return flask.redirect(prefix + "signin?" + urlencode({"error": "signout-expired"}))
        response = flask.redirect(prefix + "signin")
        response.delete_cookie(COOKIE, path=prefix)
        return response

    @server.get("/signout")
    def signout_page() -> Response:
        return flask.redirect(prefix + "signin")


def layout(prefix: str, next_path: str, error: str | None, signed_in: bool) -> html.Div:
    """The sign-in card: a plain HTML form posted to the server (no script handles the token); rendered
    while serving a request, it carries that browser's CSRF token."""
    csrf = csrf_token(prefix) if flask.has_request_context() else None
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
                    dcc.Input(
                        type="password",
                        name="token",
                        id="signin-token",
                        placeholder="gw_…",
                        autoComplete="off",
                        className="token-input",
                    ),
                    dcc.Input(type="hidden", name="next", value=next_path),
                    dcc.Input(type="hidden", name=CSRF_FIELD, value=csrf) if csrf else None,
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
            html.Form(
                [
                    dcc.Input(type="hidden", name=CSRF_FIELD, value=csrf) if csrf else None,
                    html.Button("Sign out", type="submit", id="signout", className="button"),
                ],
                action=prefix + "signout",
                method="POST",
                className="signout-form",
            )
            if signed_in
            else None,
        ],
        className="card signin",
    )


def signin_href(prefix: str, pathname: str | None, search: str | None) -> str:
    """The sign-in page's URL, coming back to where the person was."""
    return prefix + "signin?next=" + quote((pathname or prefix) + (search or ""), safe="")
