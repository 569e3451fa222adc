"""gradwatch._http, the HTTP core of gradwatch.Api and the dashboard's ApiClient, against a real HTTP
server on 127.0.0.1 (http.server in a thread): pages, statuses, tokens, bodies that are not JSON, a
closed port, a timeout. Each test runs with both sends: the standard library's (gradwatch.Api) and the
dashboard's over httpx."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gradwatch._errors import ApiError, ApiUnavailable, ApiUnreachable, GradwatchError, RunNotFound
from gradwatch._http import READ_API, Answer, HttpCore, Request

ITEMS = [{"id": i} for i in range(7)]
# Steps of /events-like items, in step order: three at step 4, so a page of 2 cannot end inside it.
STEPPED = [{"step": s} for s in (0, 1, 1, 2, 3, 5)]


class Handler(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str | None, Any]]  # method, path with query, Authorization, JSON body

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        sent = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), sent))
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        path = url.path
        if path == "/items":
            offset, limit = int(query["offset"]), int(query["limit"])
            self._json(200, {"data": ITEMS[offset : offset + limit], "count": len(ITEMS)})
        elif path == "/stepped":
            low, limit = int(query.get("start", 0)), int(query["limit"])
            rest = [item for item in STEPPED if item["step"] >= low]
            self._json(200, {"data": rest[:limit], "count": len(rest)})
        elif path == "/crowded":  # more items at step 0 than a page holds
            self._json(200, {"data": [{"step": 0}] * int(query["limit"]), "count": 100})
        elif path == "/private":
            if self.headers.get("Authorization") != "Bearer s3cret":
                self._json(401, {"detail": "this server requires a token"})
            else:
                self._json(200, {"who": "reader"})
        elif path.startswith("/api/v1/runs/"):
            self._json(404, {"detail": f"run {path.rsplit('/', 1)[-1]!r} does not exist"})
        elif path == "/invalid":
            self._json(422, {"detail": [{"loc": ["query", "limit"], "msg": "Input should be <= 500"}]})
        elif path == "/locked":
            self._json(503, {"detail": "database is locked"})
        elif path == "/bare":
            self._send(502, b"", "text/plain")
        elif path == "/html":
            self._send(200, b"<html>hello</html>", "text/html")
        elif path == "/list":
            self._json(200, [1, 2])
        elif path == "/gzipped":
            self._send(
                200, gzip.compress(b'{"packed": true}'), "application/json", {"Content-Encoding": "gzip"}
            )
        elif path == "/gone":
            self._send(204, b"", "text/plain")
        elif path == "/echo":
            self._json(200, {"got": sent, "query": query})
        elif path == "/slow":  # answers nothing, later than the client waits
            time.sleep(1.0)
        else:
            self._json(404, {"detail": "Not Found"})

    def _json(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if status != 204:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if status != 204:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[Any]]]:
    seen: list[Any] = []
    handler = type("RecordingHandler", (Handler,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture(params=["urllib", "httpx"])
def connect(request: pytest.FixtureRequest) -> Iterator[Any]:
    """connect(base_url, token=None, timeout=5.0) -> an HttpCore: gradwatch.Api's (the standard
    library's send) or the dashboard client's (its httpx.Client)."""
    opened: list[Any] = []

    def urllib_core(base_url: str, token: str | None = None, timeout: float = 5.0) -> HttpCore:
        return HttpCore(base_url, token=token, timeout=timeout)

    def httpx_core(base_url: str, token: str | None = None, timeout: float = 5.0) -> HttpCore:
        api_client = pytest.importorskip("gradwatch.dashboard.api_client")
        client = api_client.ApiClient(base_url, token=token, timeout_s=timeout)
        opened.append(client)
        http: HttpCore = client._http
        return http

    yield urllib_core if request.param == "urllib" else httpx_core
    for client in opened:
        client.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_offset_pages_read_every_item_page_by_page_or_up_to_a_limit(server, connect):
    base, seen = server
    seen.clear()
    assert connect(base).offset_pages("/items", {"q": None}, page_size=3, limit=None) == ITEMS
    assert [path for _, path, _, _ in seen] == [
        "/items?limit=3&offset=0",
        "/items?limit=3&offset=3",
        "/items?limit=3&offset=6",
    ]
    seen.clear()
    assert connect(base).offset_pages("/items", {}, page_size=3, limit=4) == ITEMS[:4]
    assert [path for _, path, _, _ in seen] == ["/items?limit=3&offset=0", "/items?limit=1&offset=3"]


def test_step_pages_end_each_page_before_the_last_step_it_reached(server, connect):
    base, _ = server
    pages = list(connect(base).step_pages("/stepped", {"start": None}, 3, owner="run 'r'", items="events"))
    assert pages == [[{"step": 0}], [{"step": 1}, {"step": 1}], [{"step": 2}, {"step": 3}, {"step": 5}]]
    with pytest.raises(ApiError, match="run 'r' has more than 2 events at step 0") as caught:
        list(connect(base).step_pages("/crowded", {}, 2, owner="run 'r'", items="events"))
    assert caught.value.url == f"{base}/crowded"


def test_query_parameters_drop_none_and_empty_lists_and_repeat_lists(server, connect):
    base, _ = server
    core = connect(base)
    assert core.url("/echo", {"a": None, "b": [], "c": ["x", "y"], "d": True, "e": False, "f": "a b/c"}) == (
        f"{base}/echo?c=x&c=y&d=true&e=false&f=a+b%2Fc"
    )
    body = core.request("POST", "/echo", {"n": 3}, body={"rule": "skip_storm"})
    assert body == {"got": {"rule": "skip_storm"}, "query": {"n": "3"}}


def test_the_token_is_sent_as_a_bearer_header_and_a_401_names_how_to_pass_one(server, connect):
    base, seen = server
    assert connect(base, token="s3cret").request("GET", "/private") == {"who": "reader"}
    assert seen[-1][2] == "Bearer s3cret"
    with pytest.raises(ApiError) as caught:
        connect(base).request("GET", "/private")
    assert seen[-1][2] is None
    error = caught.value
    assert (type(error), error.status, error.status_code) == (ApiError, 401, 401)
    assert error.detail == "this server requires a token" and error.url == f"{base}/private"
    if "GRADWATCH_TOKEN" in str(error):  # the read API's wording says how to pass a token
        assert str(error) == "GET /private: HTTP 401: this server requires a token" + READ_API.no_token_hint


def test_statuses_map_to_the_error_tree_with_the_servers_detail(server, connect):
    core = connect(server[0])
    with pytest.raises(ApiError) as invalid:
        core.request("GET", "/invalid")
    assert type(invalid.value) is ApiError and invalid.value.status == 422
    assert invalid.value.detail == "query.limit: Input should be <= 500"
    with pytest.raises(ApiUnavailable) as locked:
        core.request("GET", "/locked")
    assert not isinstance(locked.value, ApiUnreachable)
    assert (locked.value.status, locked.value.detail) == (503, "database is locked")
    assert "database is locked" in str(locked.value)
    with pytest.raises(ApiUnavailable) as bare:
        core.request("GET", "/bare")
    assert (bare.value.status, bare.value.detail) == (502, "Bad Gateway")  # no body: the reason phrase


def test_a_404_is_run_not_found_only_for_a_run_asked_for_by_id(server, connect):
    core = connect(server[0])
    with pytest.raises(RunNotFound) as caught:
        core.request("GET", "/api/v1/runs/r9", run_id="r9")
    assert (caught.value.run_id, caught.value.status) == ("r9", 404)
    assert caught.value.detail == "run 'r9' does not exist"
    with pytest.raises(ApiError) as plain:
        core.request("GET", "/api/v1/runs/r9")
    assert type(plain.value) is ApiError and plain.value.status == 404


def test_answers_that_are_not_a_json_object_are_api_errors(server, connect):
    core = connect(server[0])
    with pytest.raises(ApiError, match="not JSON") as html:
        core.request("GET", "/html")
    assert html.value.status == 200
    with pytest.raises(ApiError, match="list") as listed:
        core.request("GET", "/list")
    assert type(listed.value) is ApiError
    assert core.request("GET", "/gone") == {}
    assert core.request("GET", "/gzipped") == {"packed": True}


def test_a_closed_port_and_a_timeout_are_api_unreachable_without_a_status(server, connect):
    base = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ApiUnreachable) as refused:
        connect(base).request("GET", "/items")
    assert refused.value.status is None and refused.value.url == f"{base}/items"
    assert base in str(refused.value) and refused.value.detail in str(refused.value)
    assert isinstance(refused.value, ApiUnavailable) and isinstance(refused.value, GradwatchError)
    assert refused.value.__cause__ is None  # one line in a notebook, not two tracebacks
    with pytest.raises(ApiUnreachable) as slow:
        connect(server[0], timeout=0.2).request("GET", "/slow")
    assert slow.value.status is None


def test_a_send_is_a_parameter_and_a_token_provider_is_asked_on_every_request():
    sent: list[Request] = []

    def send(request: Request) -> Answer:
        sent.append(request)
        return Answer(200, b'{"ok": true}')

    tokens = iter(["first", None])
    core = HttpCore("http://gradwatch.test/", token="fixed", token_provider=lambda: next(tokens), send=send)
    assert core.request("GET", "/a") == {"ok": True}
    core.request("GET", "/a")
    core.request("GET", "/a", token="given")
    assert [r.headers.get("Authorization") for r in sent] == ["Bearer first", "Bearer fixed", "Bearer given"]
    assert sent[0].url == "http://gradwatch.test/a" and sent[0].json is None

    def refuse(request: Request) -> Answer:
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(ApiUnreachable, match="Connection refused"):  # a send that raises OSError: no answer
        HttpCore("http://gradwatch.test", send=refuse).request("GET", "/a")
