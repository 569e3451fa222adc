"""Webhook SSRF protection (server/alerts/egress.py): private targets are refused when a webhook is
created (address literals, in any spelling), when a test is sent, and when a delivery is sent (after
resolving the host), and every request goes to the address that was checked.

Real uvicorn servers on 127.0.0.1 with a SQLite file, a real delivery worker, real receivers on
127.0.0.1. No test here sends a packet beyond loopback: `connections` replaces socket.create_connection
for the whole module, so a connection to any other address is recorded and refused before it is made
(the only other address a test expects to reach the connect step is TEST-NET-3's 203.0.113.5).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import free_port, unavailable
from webhook_receiver import WebhookReceiver, settled_deliveries

from gradwatch.server.alerts import egress
from gradwatch.server.alerts.egress import (
    ALLOW_PRIVATE_HINT,
    HostNotPublic,
    PinnedTransport,
    refusal,
)
from gradwatch.server.serve import BackgroundServer
from gradwatch.server.settings import Settings

LOOPBACK, LINK_LOCAL, PRIVATE = "a loopback address", "a link-local address", "a private address"
# Webhook hosts (as written in a URL, port optional) and the kind of address each is or resolves to.
TARGETS = {
    "127.0.0.1": LOOPBACK,
    "2130706433": LOOPBACK,
    "0x7f000001": LOOPBACK,
    "0177.0.0.1": LOOPBACK,
    "[::1]": LOOPBACK,
    "[::ffff:127.0.0.1]": LOOPBACK,
    "localhost:5432": LOOPBACK,
    "169.254.169.254": LINK_LOCAL,
    "10.0.0.1": PRIVATE,
    "192.168.1.1": PRIVATE,
    "0.0.0.0": "an unspecified address",
    "[fe80::1]": LINK_LOCAL,
    "224.0.0.1": "a multicast address",
}
NAMES = {"localhost:5432"}  # judged when sent (after resolving), not when created
WORKER = "gradwatch-outbox"  # the delivery worker's threads: its own and each POST's (-post)


class Connections:
    """socket.create_connection, recorded with the calling thread's name: loopback connections are made,
    any other is refused without a packet sent."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.attempts: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def __call__(self, address: tuple, *args: Any, **kwargs: Any) -> socket.socket:
        host, port = address[0], address[1]
        with self._lock:
            self.attempts.append((threading.current_thread().name, host, port))
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConnectionRefusedError(f"test guard: no connection to {host}:{port} beyond loopback")
        return self.real(address, *args, **kwargs)

    def by_worker(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(host, port) for thread, host, port in self.attempts if thread.startswith(WORKER)]

    def clear(self) -> None:
        with self._lock:
            self.attempts.clear()


class FakeDns:
    """socket.getaddrinfo with made-up names: each answers its list of addresses in turn (the last one
    repeats); numeric-only lookups and every other host go to the real resolver."""

    def __init__(self, real: Any, names: dict[str, list[str]]) -> None:
        self.real = real
        self.names = names
        self.lookups: list[str] = []

    def __call__(
        self, host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> list:
        if host not in self.names:
            return self.real(host, port, family, type, proto, flags)
        if flags & socket.AI_NUMERICHOST:  # a name is not a numeric host, as with the real resolver
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        answers = self.names[host]
        address = answers[min(len(self.lookups), len(answers) - 1)]
        self.lookups.append(host)
        if ":" in address:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0))]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]


@pytest.fixture(scope="module", autouse=True)
def connections() -> Iterator[Connections]:
    with pytest.MonkeyPatch.context() as patch:
        guard = Connections(socket.create_connection)
        patch.setattr(socket, "create_connection", guard)
        yield guard


def _server(database_url: str, **overrides: Any) -> BackgroundServer:
    settings = Settings(
        database_url=database_url,
        outbox_poll_interval_s=0.05,
        outbox_backoff_base_s=0.2,
        outbox_backoff_max_s=0.5,
        webhook_timeout_s=10.0,  # a loaded machine: a timed-out delivery is retried (a second copy)
        **overrides,
    )
    return BackgroundServer(settings, "127.0.0.1", free_port(), with_dashboard=False).start()


@pytest.fixture(scope="module")
def quiet_receiver() -> Iterator[WebhookReceiver]:
    """The receiver every refused target points at (where it has no port of its own): it must get nothing."""
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def apis(tmp_path_factory) -> Iterator[dict[str, httpx.Client]]:
    """Two servers on one SQLite file: "strict" refuses private targets and delivers; "lenient" allows
    them and delivers nothing (it stands for the settings a webhook was created under before)."""
    database_url = f"sqlite:///{tmp_path_factory.mktemp('ssrf') / 'gradwatch.db'}"
    strict = _server(database_url, webhook_allow_private=False)
    lenient = _server(database_url, webhook_allow_private=True, alert_worker=False)
    try:
        with (
            httpx.Client(base_url=strict.url, timeout=30) as s,
            httpx.Client(base_url=lenient.url, timeout=30) as le,
        ):
            yield {"strict": s, "lenient": le}
    finally:
        lenient.stop()
        strict.stop()


@pytest.fixture
def strict_api(tmp_path) -> Iterator[httpx.Client]:
    server = _server(f"sqlite:///{tmp_path / 'gradwatch.db'}", webhook_allow_private=False)
    with httpx.Client(base_url=server.url, timeout=30) as api:
        yield api
    server.stop()


@pytest.fixture
def lenient_api(tmp_path) -> Iterator[httpx.Client]:
    server = _server(f"sqlite:///{tmp_path / 'gradwatch.db'}", webhook_allow_private=True)
    with httpx.Client(base_url=server.url, timeout=30) as api:
        yield api
    server.stop()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


def _url(target: str, port: int) -> str:
    """The webhook URL for a target: its own port if it names one, else the receiver's."""
    has_port = target.rsplit("]", 1)[-1].count(":") == 1
    return f"http://{target}/hook" if has_port else f"http://{target}:{port}/hook"


def _refused(target: str) -> str:
    host = urlsplit(f"http://{target}/").hostname
    if target in NAMES:  # the same words as for a name that does not resolve (no oracle of names)
        return _not_public(host)
    return f"webhook host {host} is {TARGETS[target]}; {ALLOW_PRIVATE_HINT}"


def _not_public(host: str | None) -> str:
    return (
        f"webhook host {host} does not resolve to a public address (no such name, or only a private,"
        f" loopback or reserved one); {ALLOW_PRIVATE_HINT}"
    )


# -- the rule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", LOOPBACK),
        ("127.255.0.9", LOOPBACK),
        ("::1", LOOPBACK),
        ("10.1.2.3", PRIVATE),
        ("172.16.0.1", PRIVATE),
        ("192.168.1.1", PRIVATE),
        ("fc00::1", PRIVATE),
        ("fd12:3456::1", PRIVATE),
        ("169.254.169.254", LINK_LOCAL),
        ("fe80::1", LINK_LOCAL),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("0.1.2.3", "an unspecified address"),
        ("100.64.0.1", "a shared (CGNAT) address"),
        ("240.0.0.1", "a reserved address"),
        ("255.255.255.255", "a reserved address"),
        ("::ffff:127.0.0.1", LOOPBACK),
        ("::ffff:10.0.0.1", PRIVATE),
        ("::127.0.0.1", LOOPBACK),
        ("64:ff9b::a9fe:a9fe", LINK_LOCAL),
        ("2002:7f00:1::", LOOPBACK),  # NAT64 169.254.169.254, 6to4 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", LOOPBACK),  # Teredo, client 127.0.0.1
        ("203.0.113.5", None),
        ("8.8.8.8", None),
        ("172.32.0.1", None),
        ("::ffff:8.8.8.8", None),
        ("64:ff9b::808:808", None),
        ("2606:4700::1111", None),
    ],
)
def test_which_addresses_are_refused(address, kind):
    assert refusal(ipaddress.ip_address(address)) == kind


def test_egress_exports_what_it_defines():
    defined = {
        name
        for name, value in vars(egress).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == egress.__name__
    }
    assert set(egress.__all__) == defined | {"ALLOW_PRIVATE_HINT"}


# -- through the API and the delivery worker ----------------------------------------------------------


@pytest.mark.parametrize("target", [t for t in TARGETS if t not in NAMES])
def test_a_private_address_literal_is_refused_when_the_webhook_is_created(apis, quiet_receiver, target):
    response = apis["strict"].post(
        "/api/v1/webhooks", json={"url": _url(target, quiet_receiver.port), "project": "p"}
    )
    assert response.status_code == 422 and response.json()["detail"] == _refused(target), response.text


def test_a_host_name_is_judged_when_sent_not_when_created(apis):
    response = apis["strict"].post(
        "/api/v1/webhooks", json={"url": "http://localhost:5432/x", "project": "p"}
    )
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_private_target_is_refused_when_sent_and_nothing_reaches_it(
    apis, quiet_receiver, connections, target
):
    """A webhook made while private targets were allowed, sent by a server that refuses them: the test
    request is refused (at once for a literal, in the delivery log for a name), the delivery fails
    without a response (a literal on its first attempt; a name is retried, as one that does not resolve
    is), and the worker opens no connection at all."""
    connections.clear()
    url = _url(target, quiet_receiver.port)
    hook = apis["lenient"].post("/api/v1/webhooks", json={"url": url, "project": "ssrf"}).json()
    assert (
        apis["lenient"].post(f"/api/v1/webhooks/{hook['id']}/test").status_code == 202
    )  # the worker: strict's

    test = apis["strict"].post(f"/api/v1/webhooks/{hook['id']}/test")
    if target in NAMES:
        assert test.status_code == 202, test.text  # its addresses are known only once it is resolved
    else:
        assert test.status_code == 422 and test.json()["detail"] == _refused(target), test.text

    deliveries = settled_deliveries(apis["strict"], hook["id"], count=2 if target in NAMES else 1)
    for delivery in deliveries:
        attempts = Settings().outbox_max_attempts if target in NAMES else 1
        assert delivery["status"] == "failed" and delivery["attempts"] == attempts, delivery
        assert delivery["last_error"] == _refused(target) and delivery["response_status"] is None
    time.sleep(0.3)  # nothing arrives late either
    assert quiet_receiver.received == []
    assert connections.by_worker() == []


def test_with_allow_private_loopback_receivers_get_the_post(lenient_api, receiver, connections):
    connections.clear()
    port = receiver.port
    urls = [
        receiver.url,
        f"http://localhost:{port}/a",
        f"http://2130706433:{port}/b",
        f"http://127.1:{port}/c",
    ]
    for url in urls:
        hook = lenient_api.post("/api/v1/webhooks", json={"url": url, "project": "lan"})
        assert hook.status_code == 201, hook.text
        assert lenient_api.post(f"/api/v1/webhooks/{hook.json()['id']}/test").status_code == 202
        [delivery] = settled_deliveries(lenient_api, hook.json()["id"])
        assert delivery["status"] == "delivered" and delivery["response_status"] == 200, delivery
    assert [r.path for r in receiver.received] == ["/hook", "/a", "/b", "/c"]
    assert set(connections.by_worker()) <= {("127.0.0.1", port), ("::1", port)}  # resolved, then pinned

    # The resolver reads 0177.0.0.1 as 127.0.0.1, but httpx refuses that spelling: failed, not retried.
    hook = lenient_api.post(
        "/api/v1/webhooks", json={"url": f"http://0177.0.0.1:{port}/d", "project": "lan"}
    ).json()
    lenient_api.post(f"/api/v1/webhooks/{hook['id']}/test")
    [delivery] = settled_deliveries(lenient_api, hook["id"])
    assert delivery["status"] == "failed" and delivery["attempts"] == 1
    assert delivery["last_error"].startswith("webhook url cannot be sent: ")
    assert len(receiver.received) == 4


def test_a_pinned_request_keeps_the_original_host_header(lenient_api, receiver, connections, monkeypatch):
    """receiver.test resolves (here) to 127.0.0.1: the request goes there, saying Host: receiver.test."""
    dns = FakeDns(socket.getaddrinfo, {"receiver.test": ["127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    connections.clear()
    url = f"http://receiver.test:{receiver.port}/hook"
    hook = lenient_api.post("/api/v1/webhooks", json={"url": url, "project": "lan"}).json()
    lenient_api.post(f"/api/v1/webhooks/{hook['id']}/test")
    [received] = receiver.wait_for(1)
    assert received.headers["Host"] == f"receiver.test:{receiver.port}" and received.path == "/hook"
    assert connections.by_worker() == [("127.0.0.1", receiver.port)]
    assert dns.lookups == ["receiver.test"]  # one lookup, and the connection went to its answer
    assert settled_deliveries(lenient_api, hook["id"])[0]["status"] == "delivered"


def test_dns_rebinding_cannot_redirect_a_checked_request(strict_api, receiver, connections, monkeypatch):
    """rebind.test answers a public address first and 127.0.0.1 after. The first attempt connects to the
    public address it checked (unroutable TEST-NET-3: refused here before any packet), never to
    127.0.0.1; the retry resolves again, gets 127.0.0.1 and is refused for good."""
    dns = FakeDns(socket.getaddrinfo, {"rebind.test": ["203.0.113.5", "127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    connections.clear()
    url = f"http://rebind.test:{receiver.port}/hook"
    hook = strict_api.post("/api/v1/webhooks", json={"url": url, "project": "rebind"}).json()
    assert strict_api.post(f"/api/v1/webhooks/{hook['id']}/test").status_code == 202
    [delivery] = settled_deliveries(strict_api, hook["id"])
    attempts = Settings().outbox_max_attempts
    assert delivery["status"] == "failed" and delivery["attempts"] == attempts, delivery
    assert delivery["last_error"] == _not_public("rebind.test")
    assert connections.by_worker() == [("203.0.113.5", receiver.port)]  # never 127.0.0.1
    assert dns.lookups == ["rebind.test"] * attempts  # one per attempt: none between check and connect
    assert receiver.received == []


# -- https: SNI and the certificate check use the host name -------------------------------------------


class _TlsReceiver:
    """HTTPS on 127.0.0.1 with a self-signed certificate for hooks.test; records each handshake's SNI
    name and each POST's Host header."""

    def __init__(self, folder: Path) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            unavailable("openssl not found (apt-get install -y openssl)")
        self.cert, key = folder / "cert.pem", folder / "key.pem"
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(self.cert),
                "-days",
                "1",
                "-subj",
                "/CN=hooks.test",
                "-addext",
                "subjectAltName=DNS:hooks.test",
            ],
            check=True,
            capture_output=True,
        )
        self.sni: list[str | None] = []
        self.hosts: list[str | None] = []
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        context.sni_callback = lambda _socket, name, _context: self.sni.append(name)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.hosts.append(self.headers.get("Host"))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="tls-receiver", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def tls_receiver(tmp_path) -> Iterator[_TlsReceiver]:
    receiver = _TlsReceiver(tmp_path)
    yield receiver
    receiver.stop()


def test_https_is_pinned_with_sni_and_certificate_checked_against_the_host_name(tls_receiver, connections):
    dns = FakeDns(socket.getaddrinfo, {"hooks.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    trust = ssl.create_default_context(cafile=str(tls_receiver.cert))
    port = tls_receiver.port
    connections.clear()
    with httpx.Client(transport=PinnedTransport(True, getaddrinfo=dns, verify=trust), timeout=5) as client:
        response = client.post(f"https://hooks.test:{port}/hook", content=b"{}")
        assert response.status_code == 200 and response.url == f"https://hooks.test:{port}/hook"
        assert tls_receiver.sni == ["hooks.test"] and tls_receiver.hosts == [f"hooks.test:{port}"]
        # Same address, another name: the certificate (for hooks.test) does not match, so nothing is sent.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            client.post(f"https://other.test:{port}/hook", content=b"{}")
    assert tls_receiver.sni == ["hooks.test", "other.test"] and len(tls_receiver.hosts) == 1
    assert [(host, p) for _, host, p in connections.attempts] == [("127.0.0.1", port)] * 2
    assert dns.lookups == ["hooks.test", "other.test"]

    strict = httpx.Client(transport=PinnedTransport(False, getaddrinfo=dns, verify=trust), timeout=5)
    with strict, pytest.raises(HostNotPublic, match=r"webhook host hooks\.test does not resolve to a public"):
        strict.post(f"https://hooks.test:{port}/hook", content=b"{}")
    assert len(connections.attempts) == 2


def test_a_name_that_resolves_privately_and_one_that_does_not_resolve_read_alike(strict_api, monkeypatch):
    """The delivery log must not tell a project's admins which of the server's internal names exist."""
    dns = FakeDns(socket.getaddrinfo, {"intranet-db.test": ["10.1.2.3"]})

    def resolver(host: Any, *args: Any, **kwargs: Any) -> list:
        if host == "nowhere.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return dns(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    seen = []
    for host in ("intranet-db.test", "nowhere.test"):
        hook = strict_api.post(
            "/api/v1/webhooks", json={"url": f"http://{host}/x", "project": "oracle"}
        ).json()
        assert strict_api.post(f"/api/v1/webhooks/{hook['id']}/test").status_code == 202
        [delivery] = settled_deliveries(strict_api, hook["id"])
        seen.append({**delivery, "last_error": delivery["last_error"].replace(host, "HOST")})
    keys = ("status", "attempts", "last_error", "response_status")
    private, unknown = ({k: d[k] for k in keys} for d in seen)
    assert private == unknown, seen
