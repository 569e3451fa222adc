"""One HTTP core for gradwatch's two API clients: `gradwatch.Api` (gradwatch.api) and the dashboard's
ApiClient (gradwatch.dashboard.api_client). Standard library only: the agent has no dependencies.

    http = HttpCore("http://127.0.0.1:8765", token="gw_...", timeout=30.0)
    run = http.request("GET", "/api/v1/runs/3f2a9c")                  # a JSON object, or an ApiError
    runs = http.offset_pages("/api/v1/runs", {"project": "llm"}, page_size=500, limit=None)

One request: the URL (query parameters without None or [], booleans as true/false, a list as the
parameter repeated), the headers (Accept, and `Authorization: Bearer` with the token), the send, then
the answer read as a JSON object ({} for 204 No Content) or turned into an error (gradwatch._errors):

    no answer (refused, timed out, reset)        ApiUnreachable   status None
    5xx                                          ApiUnavailable   status, detail: the server's message
    404 for a run asked for by id (run_id=)      RunNotFound
    any other status >= 400                      ApiError
    an answer that is not a JSON object          ApiError

The send is a parameter (`send=`): by default the standard library's (urllib: gzip, the proxies the
environment names, `timeout` seconds); the dashboard sends through its httpx.Client. A send returns
an Answer for every status and raises OSError when no answer came. The messages' wording is a
parameter too (`wording=`), so each client says things as it always has.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._errors import ApiError, ApiUnavailable, ApiUnreachable, RunNotFound

__all__ = [
    "MAX_ANSWER_BYTES",
    "READ_API",
    "Answer",
    "HttpCore",
    "Request",
    "Send",
    "Wording",
    "path_segment",
    "read_bounded",
    "send_with_urllib",
]

Json = dict[str, Any]


@dataclass(frozen=True)
class Request:
    """What a send sends. json: a body to send as JSON, or None; timeout: seconds, or None for the
    send's own (send_with_urllib: none)."""

    method: str
    url: str
    headers: dict[str, str]
    json: Any = None
    timeout: float | None = None


@dataclass(frozen=True)
class Answer:
    """What the server answered: any status, the body as sent (decompressed), the reason phrase."""

    status: int
    body: bytes
    reason: str = ""


Send = Callable[[Request], Answer]


@dataclass(frozen=True)
class Wording:
    """The messages of the errors, as str.format templates over base, method, path, status, detail,
    reason and type: unreachable (no answer) and its detail, refused (4xx), failed (5xx), not_json,
    not_object; no_token_hint is added to a 401 when no token was sent."""

    unreachable: str
    refused: str
    failed: str
    not_json: str
    not_object: str
    unreachable_detail: str = "{reason}"
    no_token_hint: str = ""


# gradwatch.Api's (and so the `gradwatch runs | alerts | show | export` commands').
READ_API = Wording(
    unreachable=(
        "cannot reach the gradwatch server at {base} ({reason}); is it running there? "
        "(set GRADWATCH_SERVER, pass server=, or --server)"
    ),
    refused="{method} {path}: HTTP {status}: {detail}",
    failed="{method} {path}: HTTP {status}: {detail}",
    not_json="{method} {path}: the answer is not JSON; is {base} a gradwatch server?",
    not_object="{method} {path}: expected a JSON object, got {type}",
    no_token_hint=" -- pass token= (or --token), or set GRADWATCH_TOKEN, to a token with read scope",
)


# An answer larger than this (as sent, and again once inflated) is no answer: a page of the read API
# is a few MB at most; a hostile or broken server's 1 GiB (or a 1 MiB gzip inflating to 1 GiB) must not
# take the client's memory.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_READ_CHUNK = 256 * 1024


class _NoCredentialsElsewhere(urllib.request.HTTPRedirectHandler):
    """Follows a redirect, but never takes the token (or cookies) to another origin: urllib's own handler
    copies every header, Authorization included, to wherever the server points."""

    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        follow = super().redirect_request(req, fp, code, msg, headers, newurl)
        if follow is not None and _origin(newurl) != _origin(req.full_url):
            for name in ("Authorization", "Cookie"):
                follow.headers.pop(name, None)
                follow.unredirected_hdrs.pop(name, None)
        return follow


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


_OPENER = urllib.request.build_opener(_NoCredentialsElsewhere)


def read_bounded(response: Any, deadline: float | None) -> bytes:
    """The answer's body, read a piece at a time: at most MAX_ANSWER_BYTES, and by `deadline` (the
    socket's timeout bounds each read only: a server dripping a byte a second would hold us for ever)."""
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = response.read1(_READ_CHUNK) if hasattr(response, "read1") else response.read(_READ_CHUNK)
        if not piece:
            response.read()  # b"": marks the answer read in full, so a kept connection can be reused
            return b"".join(pieces)
        size += len(piece)
        if size > MAX_ANSWER_BYTES:
            raise ConnectionError(f"the answer is larger than {MAX_ANSWER_BYTES // 2**20} MiB: not read")
        if deadline is not None and time.monotonic() > deadline:
            raise ConnectionError("the answer did not arrive in time (the request's timeout, in all)")
        pieces.append(piece)


def _inflate(body: bytes) -> bytes:
    """gzip undone, a MiB at a time, to at most MAX_ANSWER_BYTES: a small bomb must not inflate into all
    memory (nor into one buffer that doubles its way to the cap)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    pieces: list[bytes] = []
    size, pending = 0, body
    try:
        while pending or not inflater.eof:
            piece = inflater.decompress(pending, 2**20)
            pending = inflater.unconsumed_tail
            if not piece:
                break
            size += len(piece)
            if size > MAX_ANSWER_BYTES:
                raise ConnectionError(
                    f"the answer inflates to more than {MAX_ANSWER_BYTES // 2**20} MiB: not read"
                )
            pieces.append(piece)
    except zlib.error as exc:
        raise ConnectionError(f"the answer's gzip is broken: {exc}") from exc
    return b"".join(pieces)


def send_with_urllib(request: Request) -> Answer:
    """The standard library's send: gzip asked for and undone, the environment's proxies used, the token
    never sent to another origin on a redirect, the answer bounded in size and, with a timeout, in time
    as a whole (not per read)."""
    headers = {"Accept-Encoding": "gzip", "User-Agent": "gradwatch-api/0.1", **request.headers}
    data = None
    if request.json is not None:
        data = json.dumps(request.json, separators=(",", ":"), allow_nan=False).encode()
        headers["Content-Type"] = "application/json"
    prepared = urllib.request.Request(request.url, data=data, headers=headers, method=request.method)
    deadline = time.monotonic() + request.timeout if request.timeout is not None else None
    try:
        with _OPENER.open(prepared, timeout=request.timeout) as response:
            status, reason = response.status, response.reason
            body = read_bounded(response, deadline)
            encoding = response.headers.get("Content-Encoding")
    except urllib.error.HTTPError as exc:  # an answer: 4xx, 5xx
        with exc:
            status, reason, body = exc.code, str(exc.reason), read_bounded(exc, deadline)
            encoding = exc.headers.get("Content-Encoding")
    except http.client.HTTPException as exc:  # a broken answer is no answer
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
    if encoding == "gzip":
        body = _inflate(body)
    return Answer(status, body, reason)


class HttpCore:
    """Requests to one gradwatch server's API (base_url: its root, without /api/v1).

    token: sent as `Authorization: Bearer <token>`; token_provider: called on every request, and the
    token it returns (if any) replaces `token`. timeout: seconds per request (None: the send's own).
    send, wording: see the module docstring."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_provider: Callable[[], str | None] | None = None,
        timeout: float | None = None,
        send: Send = send_with_urllib,
        wording: Wording = READ_API,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.token_provider = token_provider
        self.timeout = timeout
        self.send = send
        self.wording = wording

    def url(self, path: str, params: Json | None = None) -> str:
        query = {
            name: ("true" if value else "false") if isinstance(value, bool) else value
            for name, value in (params or {}).items()
            if value is not None and value != []
        }
        return self.base_url + path + (f"?{urllib.parse.urlencode(query, doseq=True)}" if query else "")

    def request(
        self,
        method: str,
        path: str,
        params: Json | None = None,
        *,
        body: Json | None = None,
        token: str | None = None,
        run_id: str | None = None,
    ) -> Json:
        """One API call: the JSON object it answers ({} for 204), or an error (see the module docstring).
        body: a JSON object to send; token: send this one instead of the current one; run_id: the run
        the path is about, so that a 404 is RunNotFound."""
        url = self.url(path, params)
        if token is None and self.token_provider is not None:
            token = self.token_provider()
        token = token or self.token
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        words: dict[str, Any] = {"base": self.base_url, "method": method, "path": path}
        try:
            answer = self.send(Request(method, url, headers, body, self.timeout))
        except OSError as exc:
            words["reason"] = str(getattr(exc, "reason", None) or exc)
            message, detail = self.wording.unreachable, self.wording.unreachable_detail
            raise ApiUnreachable(message.format(**words), None, detail.format(**words), url) from None
        status = answer.status
        if status >= 400:
            detail = error_detail(answer)
            if status == 404 and run_id is not None:
                raise RunNotFound(run_id, detail or f"run {run_id!r} does not exist", url)
            template, error = (
                (self.wording.failed, ApiUnavailable) if status >= 500 else (self.wording.refused, ApiError)
            )
            message = template.format(status=status, detail=detail, **words)
            if status == 401 and not token:
                message += self.wording.no_token_hint
            raise error(message, status, detail, url)
        if status == 204:
            return {}
        try:
            parsed = json.loads(answer.body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            raise ApiError(self.wording.not_json.format(**words), status, url=url) from None
        if not isinstance(parsed, dict):
            raise ApiError(
                self.wording.not_object.format(type=type(parsed).__name__, **words), status, url=url
            )
        return parsed

    def offset_pages(self, path: str, params: Json, page_size: int, limit: int | None) -> list[Json]:
        """A listing's items (its "data"), page by page over limit/offset, up to `limit` (None: all of
        them); the listing's "count" says how many there are."""
        found: list[Json] = []
        while limit is None or len(found) < limit:
            page = page_size if limit is None else min(page_size, limit - len(found))
            body = self.request("GET", path, params | {"limit": page, "offset": len(found)})
            data = body.get("data", [])
            found.extend(data)
            if len(data) < page or len(found) >= int(body.get("count", 0)):
                break
        return found

    def step_pages(
        self, path: str, params: Json, page_size: int, *, owner: str, items: str
    ) -> Iterator[list[Json]]:
        """A listing in step order (its "data", each item with a "step") that has no offset, page by
        page over `start`: each page ends before the last step it reached, which the next page reads
        again, whole. An ApiError when one step has more than page_size items (owner and items name
        them: "run 'x'", "events")."""
        low = params.get("start")
        while True:
            body = self.request("GET", path, params | {"start": low, "limit": page_size})
            data = body.get("data", [])
            if len(data) >= int(body.get("count", 0)):
                yield data
                return
            last = int(data[-1]["step"])
            page = [item for item in data if int(item["step"]) < last]
            if not page:
                raise ApiError(
                    f"{owner} has more than {page_size} {items} at step {last}: they cannot be read in "
                    "pages; pass start= and end= around other steps",
                    url=self.url(path),
                )
            yield page
            low = last


def path_segment(text: str) -> str:
    """A string (a run id…) as one segment of a URL's path: quoted, "." and ".." too (URL normalisation
    would resolve them away)."""
    segment = urllib.parse.quote(text, safe="")
    return segment.replace(".", "%2E") if segment in (".", "..") else segment


def error_detail(answer: Answer) -> str:
    """The server's {"detail": ...} message, or the start of the body, or the reason phrase. FastAPI's
    validation errors (a list of {"loc", "msg"}) read as "query.limit: Input should be …; …"."""
    try:
        detail = json.loads(answer.body).get("detail")
    except (ValueError, AttributeError, RecursionError):
        detail = None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and all(isinstance(item, dict) for item in detail):
        return "; ".join(
            f"{'.'.join(str(part) for part in item.get('loc') or [])}: {item.get('msg', '')}".lstrip(": ")
            for item in detail
        )
    if detail is not None:
        return str(detail)
    return answer.body[:200].decode("utf-8", "replace") or answer.reason
