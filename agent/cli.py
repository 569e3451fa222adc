"""The `gradwatch` command: server, db upgrade, token, prune, demo, sync; runs, alerts, show, export.

The agent package stays light: server-side modules are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._cli_read import _add_read_options, _cmd_alerts, _cmd_export, _cmd_runs, _cmd_show, _rank

if TYPE_CHECKING:
    from gradwatch.server.auth import Tokens
    from gradwatch.server.settings import Settings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEMO_DATABASE = "demo.db"  # the demo's own SQLite file under GRADWATCH_HOME, apart from gradwatch.db


def _server_settings(args: argparse.Namespace) -> Settings:
    from gradwatch.server.serve import local_url
    from gradwatch.server.settings import Settings, default_database_url

    public_url = getattr(args, "public_url", None)
    if public_url is None and hasattr(args, "port"):
        public_url = local_url(args.host, args.port)
    options: dict[str, Any] = {"public_url": public_url} if public_url else {}
    if getattr(args, "open", False):
        options["open_after_revocation"] = True
    if getattr(args, "webhook_allow_private", False):  # else GRADWATCH_WEBHOOK_ALLOW_PRIVATE decides
        options["webhook_allow_private"] = True
    return Settings(database_url=args.database_url or default_database_url(), **options)


def _add_database_option(parser: argparse.ArgumentParser, file_name: str = "gradwatch.db") -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="sqlite:///PATH or postgresql+psycopg://USER@HOST/DB (default: GRADWATCH_DATABASE_URL, else "
        f"the SQLite file GRADWATCH_HOME/{file_name}, GRADWATCH_HOME being ~/.gradwatch unless set)",
    )


def _listen_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now (None: it could), tried as the server binds."""
    from gradwatch.server.listener import listening_sockets

    try:
        sockets = listening_sockets(host, port, backlog=1)
    except OSError as exc:
        return exc
    for sock in sockets:
        sock.close()
    return None


def _port_refusal(command: str, host: str, port: int) -> str | None:
    """None when `gradwatch COMMAND` can listen on host:port; else one line saying why not, naming a free
    port to start on instead when this one is in use. Checked before the database is opened, so a
    refused start leaves nothing behind (the server checks again as it binds)."""
    import errno

    error = _listen_error(host, port)
    if error is None:
        return None
    if error.errno != errno.EADDRINUSE:
        return f"cannot listen on {host}:{port}: {error}"
    spare = next((p for p in range(port + 1, min(port + 100, 65536)) if _listen_error(host, p) is None), None)
    if spare is None:
        advice = f"pass a free one: gradwatch {command} --port PORT"
    else:
        advice = f"gradwatch {command} --port {spare}"
        if command == "demo":
            advice += f' (from the repository: make demo ARGS="--port {spare}")'
    return (
        f"port {port} on {host} is already in use (another gradwatch server or demo still running?); "
        f"start on another port: {advice}"
    )


def _cmd_server(args: argparse.Namespace) -> int:
    from gradwatch.server.database import SchemaError
    from gradwatch.server.serve import ExposureRefused, serve_forever

    refusal = _port_refusal("server", args.host, args.port)
    if refusal is not None:
        print(f"gradwatch server: {refusal}", file=sys.stderr)
        return 2
    try:
        serve_forever(_server_settings(args), args.host, args.port, insecure=args.insecure)
    except (SchemaError, ExposureRefused) as exc:
        print(f"gradwatch: {exc}", file=sys.stderr)
        return 2
    return 0


def _tokens(args: argparse.Namespace) -> Tokens:
    from gradwatch.server.auth import Tokens
    from gradwatch.server.database import make_engine, prepare_schema

    settings = _server_settings(args)
    engine = make_engine(settings.database_url)
    prepare_schema(engine, settings.database_url)
    return Tokens(engine)


def _when(seconds: float | None) -> str:
    from datetime import datetime, timezone

    if seconds is None:
        return "never"
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _cmd_token_create(args: argparse.Namespace) -> int:
    from gradwatch.server.errors import InvalidRequest

    try:
        record, token = _tokens(args).create(args.project, args.scope, args.name or "")
    except InvalidRequest as exc:
        print(f"gradwatch: {exc}", file=sys.stderr)
        return 2
    project = "every project" if record.project == "*" else f"project {record.project!r}"
    scopes = "every scope" if record.scope == "*" else f"scope {record.scope}"
    print(f"created token {record.id} ({record.name!r}) with {scopes} for {project}.")
    print(
        "It is shown only this once; the server keeps only its hash. "
        "Agents (ingest scope): GRADWATCH_TOKEN=<token>."
    )
    print(token)  # the last word of the output, for scripts: TOKEN=$(gradwatch token create ... | tail -1)
    return 0


def _cmd_token_list(args: argparse.Namespace) -> int:
    records = _tokens(args).list(args.project, include_revoked=args.all)
    print(
        f"{'id':>4}  {'scope':<12}  {'project':<20}  {'name':<24}  {'prefix':<10}  {'created':<20}  "
        f"{'last used':<20}  revoked"
    )
    for r in records:
        print(
            f"{r.id:>4}  {r.scope:<12}  {r.project:<20.20}  {r.name:<24.24}  {r.prefix:<10}  "
            f"{_when(r.created_at):<20}  {_when(r.last_used_at):<20}  "
            f"{_when(r.revoked_at) if r.revoked_at else '-'}"
        )
    if not records:
        print("(no tokens: the server runs open, for 127.0.0.1 only)")
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    from gradwatch.server.errors import NotFound

    try:
        record = _tokens(args).revoke(args.id)
    except NotFound as exc:
        print(f"gradwatch: {exc}", file=sys.stderr)
        return 2
    print(
        f"revoked token {record.id} ({record.name!r}, {record.scope}, project {record.project!r}); "
        "requests with it are refused from now on"
    )
    return 0


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from gradwatch.server.database import current_revision, head_revision, make_engine, upgrade

    settings = _server_settings(args)
    engine = make_engine(settings.database_url)
    before = current_revision(engine)
    upgrade(engine)
    print(f"database schema: {before or 'empty'} -> {head_revision()} (head)")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    """Retention: delete finished and crashed runs (all their data) created more than N days ago."""
    import time

    from gradwatch.server.database import make_engine, prepare_schema
    from gradwatch.server.storage import RunFilter, Store

    if args.older_than_days <= 0:
        print("gradwatch: --older-than-days must be positive", file=sys.stderr)
        return 2
    settings = _server_settings(args)
    engine = make_engine(settings.database_url)
    prepare_schema(engine, settings.database_url)
    store = Store(engine)
    cutoff = time.time() - args.older_than_days * 86400
    filters = RunFilter(project=args.project, statuses=("finished", "crashed"), created_before=cutoff)
    doomed, total = store.list_runs(filters, limit=500, offset=0)
    deleted = 0
    while doomed:
        for run in doomed:
            if args.dry_run:
                print(
                    f"would delete {run.id} ({run.project}/{run.name}, {run.status}, "
                    f"last step {run.last_step})"
                )
            else:
                store.delete_run(run.id)
                deleted += 1
        if args.dry_run:
            break
        doomed, _ = store.list_runs(filters, limit=500, offset=0)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} {total if args.dry_run else deleted} run(s) older than {args.older_than_days:g} days "
        "(running runs are never deleted)"
    )
    engine.dispose()
    return 0


def _demo_database_url(database_url: str | None) -> str:
    """The demo's database: the one named (--database-url, else GRADWATCH_DATABASE_URL), else a SQLite
    file of its own, GRADWATCH_HOME/demo.db, so the demo's runs never mix with yours in gradwatch.db."""
    from gradwatch.server.settings import gradwatch_home

    named = database_url or os.environ.get("GRADWATCH_DATABASE_URL")
    return named or f"sqlite:///{gradwatch_home() / DEMO_DATABASE}"


def _shown_url(database_url: str) -> str:
    """A database URL as it may be printed: without its password."""
    from sqlalchemy.engine import make_url

    return make_url(database_url).render_as_string(hide_password=True)


def _shown_database(database_url: str) -> str:
    """A database as the user reads it: a SQLite file's path, any other by its URL without its password."""
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    return url.database if url.get_backend_name() == "sqlite" and url.database else _shown_url(database_url)


def _cmd_demo(args: argparse.Namespace) -> int:
    import gradwatch
    from gradwatch.demo import DemoConfig, train
    from gradwatch.server.database import SchemaError
    from gradwatch.server.serve import BackgroundServer

    refusal = _port_refusal("demo", args.host, args.port)
    if refusal is not None:
        print(f"gradwatch demo: {refusal}", file=sys.stderr)
        return 2
    args.database_url = _demo_database_url(args.database_url)
    try:
        server = BackgroundServer(_server_settings(args), args.host, args.port).start()
    except (SchemaError, RuntimeError) as exc:
        print(f"gradwatch: {exc}", file=sys.stderr)
        return 2
    cfg = DemoConfig(steps=args.steps, step_delay=args.step_delay, diverge_at=250 if args.diverge else None)
    print(f"gradwatch dashboard: {server.url}/dashboard/", flush=True)
    print(f"database:            {_shown_database(args.database_url)}", flush=True)
    try:
        with gradwatch.init(project="demo", name="tiny-lm-fp16", server=server.url, config=vars(cfg)) as run:
            print(f"run page:            {run.url}", flush=True)
            train(run, cfg, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:  # Ctrl-C while training: a stop, not a traceback (the run shows it)
        print("\ngradwatch demo: interrupted; what was logged is stored", file=sys.stderr, flush=True)
        server.stop()
        return 130
    print(f"run {run.id} finished: {run.stats.sent_points} points sent, {run.stats.dropped_points} dropped")
    print(f"to serve it again later: gradwatch server --database-url '{_shown_url(args.database_url)}'")
    if args.exit:
        server.stop()
        return 0
    print("serving the dashboard until Ctrl-C", flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.stop()
    return 0


def _cmd_sync(args: argparse.Namespace) -> int:
    from gradwatch._run import server_and_token
    from gradwatch.sync import sync

    try:
        server, token = server_and_token(args.server, args.token)
        report = sync(args.path, server, token, dead_letters=not args.no_dead_letters, keep=args.keep)
    except ValueError as exc:
        print(f"gradwatch: {exc}", file=sys.stderr)
        return 2
    print(
        f"synced {report.files} spool file(s): {report.points_sent} points in {report.batches_sent} batches "
        f"({report.already_stored} already on the server, {report.skipped} skipped as uploaded before, "
        f"{report.bad_lines} torn or corrupt lines ignored"
        + (
            f"; {report.dead_letters_sent} of the batches were dead letters"
            if report.dead_letters_sent
            else ""
        )
        + ")"
    )
    if report.removed:  # each is named in its own line above
        print(f"removed {len(report.removed)} spool file(s): the server has stored everything in them")
    for message in report.refused:
        print(f"gradwatch: the server refused a batch: {message}", file=sys.stderr)
    for message in report.failed:
        print(f"gradwatch: the server kept failing {message}; left for a later sync", file=sys.stderr)
    if report.error is not None:
        print(
            f"gradwatch: stopped early ({report.error}); run the same command again to continue",
            file=sys.stderr,
        )
    return 0 if report.complete else 1


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, details: str = ""
) -> argparse.ArgumentParser:
    """A subcommand: `summary` in its parent's list, and as the first sentence of its own --help."""
    description = summary[0].upper() + summary[1:] + "." + (f" {details}" if details else "")
    return commands.add_parser(name, help=summary, description=description)


def _add_listen_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="the address to listen on (default: %(default)s, this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="the port to listen on (default: %(default)s)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The `gradwatch` command line: every option has help text naming its default."""
    parser = argparse.ArgumentParser(prog="gradwatch", description="Training-health monitoring for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    server = _command(
        commands,
        "server",
        "run the API and dashboard",
        "The dashboard is at http://HOST:PORT/dashboard/, the JSON API under /api/v1. Runs until Ctrl-C.",
    )
    _add_listen_options(server)
    server.add_argument(
        "--public-url",
        default=os.environ.get("GRADWATCH_PUBLIC_URL"),
        help="the URL people open the dashboard at, used in alert links (default: GRADWATCH_PUBLIC_URL, "
        "else http://HOST:PORT)",
    )
    server.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address while no access tokens exist (a warning is printed)",
    )
    server.add_argument(
        "--open",
        action="store_true",
        help="serve without tokens again once every token is revoked (by default a server that has had "
        "tokens keeps requiring them)",
    )
    server.add_argument(
        "--webhook-allow-private",
        action="store_true",
        help="let webhooks target loopback, private and link-local addresses, e.g. a receiver on your LAN "
        "(default: refused; also GRADWATCH_WEBHOOK_ALLOW_PRIVATE=1)",
    )
    _add_database_option(server)
    server.set_defaults(func=_cmd_server)

    token = _command(commands, "token", "access tokens (project-scoped; scopes ingest, read, admin)")
    token_commands = token.add_subparsers(dest="token_command", required=True)
    create = _command(token_commands, "create", "create a token; prints it once, as the last line")
    create.add_argument("--project", required=True, help="the project it may access ('*' for every project)")
    create.add_argument(
        "--scope",
        required=True,
        help="one or more of ingest (training jobs: create runs, send data), read (dashboards, API reads), "
        "admin (rules, webhooks, deletes, renames, acknowledgements; includes read), comma-separated, "
        "or '*' for all. 'write' (the old scope) means ingest,read",
    )
    create.add_argument(
        "--name", default=None, help="a label, e.g. 'ci agents' or 'alice dashboard' (default: none)"
    )
    _add_database_option(create)
    create.set_defaults(func=_cmd_token_create)
    listing = _command(token_commands, "list", "list tokens (never the tokens themselves)")
    listing.add_argument("--project", default=None, help="only this project's (default: every project's)")
    listing.add_argument("--all", action="store_true", help="include revoked tokens")
    _add_database_option(listing)
    listing.set_defaults(func=_cmd_token_list)
    revoke = _command(token_commands, "revoke", "revoke a token by id (see `gradwatch token list`)")
    revoke.add_argument("id", type=int, help="the token's id, as `gradwatch token list` shows it")
    _add_database_option(revoke)
    revoke.set_defaults(func=_cmd_token_revoke)

    db = _command(commands, "db", "database schema").add_subparsers(dest="db_command", required=True)
    up = _command(db, "upgrade", "apply migrations up to this version's schema")
    _add_database_option(up)
    up.set_defaults(func=_cmd_db_upgrade)

    prune = _command(
        commands,
        "prune",
        "retention: delete old finished/crashed runs and all their data",
        "Running runs are never deleted.",
    )
    prune.add_argument(
        "--older-than-days",
        type=float,
        required=True,
        metavar="DAYS",
        help="delete runs created more than this many days ago",
    )
    prune.add_argument("--project", default=None, help="only this project (default: every project)")
    prune.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    _add_database_option(prune)
    prune.set_defaults(func=_cmd_prune)

    demo = _command(
        commands,
        "demo",
        "server + dashboard + a real fp16 training run streaming into it",
        "Starts a server on HOST:PORT and trains a small transformer language model on CPU in float16 with "
        "a real GradScaler; an overflow burst at step 150 drops the loss scale and skips four steps. The "
        f"run is stored in a database of the demo's own (GRADWATCH_HOME/{DEMO_DATABASE}, not the "
        "gradwatch.db that `gradwatch server` uses), and the dashboard is served until Ctrl-C unless --exit.",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=int(os.environ.get("GRADWATCH_DEMO_STEPS", "400")),
        metavar="N",
        help="optimizer steps to train (default: %(default)s; GRADWATCH_DEMO_STEPS sets it)",
    )
    demo.add_argument("--exit", action="store_true", help="stop serving when training ends")
    demo.add_argument(
        "--diverge",
        action="store_true",
        help="instead of the overflow burst, a warm restart at step 250 to a peak lr 100x too high: "
        "gradwatch warns, and its guard (watch(guard=True)) stops the run on the critical incident",
    )
    demo.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds to pause per step (default: %(default)s)",
    )
    _add_listen_options(demo)
    _add_database_option(demo, DEMO_DATABASE)
    demo.set_defaults(func=_cmd_demo)

    sync = _command(
        commands,
        "sync",
        "upload spool files of offline runs (exactly once, resumable; each removed once stored)",
    )
    sync.add_argument("path", help="a spool file (.jsonl) or a folder of them, e.g. ~/.gradwatch/offline")
    sync.add_argument(
        "--server",
        default=None,
        help="server URL (default: GRADWATCH_SERVER, else http://127.0.0.1:8765)",
    )
    sync.add_argument("--token", default=None, help="write token (default: GRADWATCH_TOKEN)")
    sync.add_argument(
        "--no-dead-letters",
        action="store_true",
        help="leave out dead-letter files (RUN-rankR.dead.jsonl: batches a live run moved aside after "
        "the server refused them), which are synced by default",
    )
    sync.add_argument(
        "--keep",
        action="store_true",
        help="keep each spool file once the server has stored everything in it (default: delete it, and "
        "its .sent list)",
    )
    sync.set_defaults(func=_cmd_sync)

    runs = _command(commands, "runs", "list runs (newest first) from a server")
    runs.add_argument("--project", default=None, help="only this project (default: every project)")
    runs.add_argument(
        "--status",
        action="append",
        help="running, finished or crashed (repeat, or comma-separate, for any; default: every status)",
    )
    runs.add_argument("--tag", action="append", help="runs with this tag (repeat: all of them; default: any)")
    runs.add_argument("--name", default=None, help="part of the run's name, any case (default: any name)")
    runs.add_argument("--limit", type=int, default=50, help="at most this many (default: %(default)s)")
    runs.add_argument("--json", action="store_true", help="print the runs as the API returns them (JSON)")
    _add_read_options(runs)
    runs.set_defaults(func=_cmd_runs)

    alerts = _command(commands, "alerts", "list alerts (newest first) from a server")
    alerts.add_argument("--project", default=None, help="only this project's (default: every project's)")
    alerts.add_argument("--run", default=None, help="only this run's, by id (default: every run's)")
    alerts.add_argument(
        "--state",
        choices=["open", "firing", "resolved", "all"],
        default=None,
        help="open (= firing: the condition holds), resolved, or all (default: all)",
    )
    alerts.add_argument("--limit", type=int, default=100, help="at most this many (default: %(default)s)")
    alerts.add_argument("--json", action="store_true", help="print the alerts as the API returns them (JSON)")
    _add_read_options(alerts)
    alerts.set_defaults(func=_cmd_alerts)

    show = _command(commands, "show", "one run: summary, last values of its main keys, open alerts")
    show.add_argument("run", help="a run id, or a run's exact name (project/name when names repeat)")
    show.add_argument(
        "--keys",
        default=None,
        help="comma-separated keys to show the last values of (default: up to 12, the run's own keys "
        "and then the agent's main ones)",
    )
    show.add_argument("--json", action="store_true", help="print run, last_values and open_alerts as JSON")
    _add_read_options(show)
    show.set_defaults(func=_cmd_show)

    export = _command(commands, "export", "write a run's series, every stored point, to csv or parquet")
    export.add_argument("run", help="a run id, or a run's exact name")
    export.add_argument(
        "--format", choices=["csv", "parquet"], default="csv", help="the file format (default: %(default)s)"
    )
    export.add_argument(
        "--keys", action="append", help="comma-separated keys (repeatable; default: every scalar key)"
    )
    export.add_argument("--rank", type=_rank, default=0, help="a rank, or 'all' (default: %(default)s)")
    export.add_argument("--start", type=int, default=None, help="first step, inclusive (default: the first)")
    export.add_argument("--end", type=int, default=None, help="last step, exclusive (default: past the last)")
    export.add_argument(
        "-o", "--output", default=None, help="the file to write (default: RUN_ID.FORMAT; '-': csv to stdout)"
    )
    _add_read_options(export)
    export.set_defaults(func=_cmd_export)
    return parser


# What `pip install 'gradwatch[server]'` adds (pyproject.toml) and what those packages import themselves.
_SERVER_PACKAGES = frozenset(
    {"fastapi", "starlette", "uvicorn", "h11", "sqlalchemy", "alembic", "psycopg", "dash", "plotly", "a2wsgi"}
    | {"httpx", "websockets", "pydantic"}
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except ModuleNotFoundError as missing:
        # The agent alone (`pip install gradwatch`) has no server: say what to install, not a traceback.
        if (missing.name or "").partition(".")[0] not in _SERVER_PACKAGES:
            raise
        print(
            f"gradwatch {args.command}: this needs the server's packages, and {missing.name} is not "
            "installed: pip install 'gradwatch[server]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
