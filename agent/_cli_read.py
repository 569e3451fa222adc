"""The read commands of `gradwatch`: runs, alerts, show, export. Each reads a server through
gradwatch.api and prints a table (or JSON, CSV, Parquet), its failures as one line with exit status 1
(the server could not be read) or 2 (a bad argument, a missing optional dependency). Kept apart from
cli, which builds the parser and holds the commands that act on a server or a spool (server, token,
db upgrade, prune, demo, sync): these four only read, and share their own formatting helpers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

SHOW_KEYS = (  # the agent's keys `gradwatch show` lists when the run has them, after the run's own keys
    "amp/scale",
    "amp/skipped",
    "grad/global_norm",
    "grad/global_norm_post_clip",
    "perf/step_time",
    "perf/samples_per_sec",
    "perf/tokens_per_sec",
)
SHOW_MAX_KEYS = 12


def _add_read_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", default=None, help="server URL (default: GRADWATCH_SERVER, else http://127.0.0.1:8765)"
    )
    parser.add_argument("--token", default=None, help="a token with read scope (default: GRADWATCH_TOKEN)")


def _reading(command: Callable[[Any, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A read command: given an Api; its failures printed as one line. Exit status 1 when the server
    could not be read (unreachable, no or bad token, no such run), 2 for a bad argument or a missing
    optional dependency."""

    def run(args: argparse.Namespace) -> int:
        from gradwatch.api import Api, ApiError

        try:
            return command(Api(args.server, args.token), args)
        except ApiError as exc:
            print(f"gradwatch: {exc}", file=sys.stderr)
            return 1
        except (AttributeError, KeyError, TypeError, RecursionError) as exc:
            # JSON of another shape than a gradwatch server's ({"data": [1]}): one line, not a traceback
            print(
                f"gradwatch: {args.server or 'the server'}'s answer is not shaped as a gradwatch server's "
                f"({type(exc).__name__}: {str(exc)[:200]}); is it a gradwatch server of this version?",
                file=sys.stderr,
            )
            return 1
        except (ValueError, ImportError) as exc:
            print(f"gradwatch: {exc}", file=sys.stderr)
            return 2

    return run


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> None:
    """Aligned plain-text columns; the columns numbered in `right` (numbers) right-aligned."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(line(headers))
    for row in rows:
        print(line(row))


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _moment(moment: Any) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M UTC")


def _number(value: float) -> str:
    return f"{value:.6g}"


def _print_json(document: Any) -> None:
    import json

    print(json.dumps(document, indent=2, allow_nan=False))


def _statuses(values: list[str] | None) -> list[str] | None:
    """--status running --status crashed, or --status running,crashed."""
    return [part for value in values for part in value.split(",") if part] if values else None


@_reading
def _cmd_runs(api: Any, args: argparse.Namespace) -> int:
    runs = api.runs(
        args.project, status=_statuses(args.status), tags=args.tag, name=args.name, limit=args.limit
    )
    if args.json:
        _print_json([run.raw for run in runs])
        return 0
    _table(
        ["id", "project", "name", "status", "last step", "created", "tags"],
        [
            [
                run.id,
                _cut(run.project, 20),
                _cut(run.name, 30),
                run.status,
                "-" if run.last_step is None else str(run.last_step),
                _moment(run.created_at),
                _cut(",".join(run.tags), 30) or "-",
            ]
            for run in runs
        ],
        right=[4],
    )
    if not runs:
        print("(no runs match)")
    elif args.limit is not None and len(runs) == args.limit:
        print(f"(the newest {len(runs)}; --limit N for more)")
    return 0


def _alert_rows(alerts: Sequence[Any], with_run: bool = True) -> tuple[list[str], list[list[str]]]:
    headers = ["id", "status", "severity", *(["project", "run"] if with_run else []), "type", "step", "title"]
    rows = [
        [
            str(alert.id),
            "open" if alert.status == "firing" else alert.status,
            alert.severity,
            *([_cut(alert.project, 20), _cut(alert.run_name, 24)] if with_run else []),
            alert.type,
            "-" if alert.step is None else str(alert.step),
            _cut(alert.title, 70),
        ]
        for alert in alerts
    ]
    return headers, rows


@_reading
def _cmd_alerts(api: Any, args: argparse.Namespace) -> int:
    alerts = api.alerts(args.project, run=args.run, state=args.state, limit=args.limit)
    if args.json:
        _print_json([alert.raw for alert in alerts])
        return 0
    headers, rows = _alert_rows(alerts)
    _table(headers, rows, right=[0, headers.index("step")])
    if not alerts:
        print("(no alerts)")
    return 0


def _show_keys(run: Any, asked: str | None) -> list[str]:
    if asked:
        return [key for key in asked.split(",") if key]
    present = run.keys()
    own = [key for key in present if "/" not in key]  # what the training loop logged: loss, lr…
    return (own + [key for key in SHOW_KEYS if key in present])[:SHOW_MAX_KEYS]


@_reading
def _cmd_show(api: Any, args: argparse.Namespace) -> int:
    from gradwatch._wire import wire_float

    run = api.run(args.run)
    last = run.last_values(_show_keys(run, args.keys))
    alerts = run.alerts(state="open")
    if args.json:
        _print_json(
            {
                "run": run.raw,
                "last_values": {key: {"step": s, "value": wire_float(v)} for key, (s, v) in last.items()},
                "open_alerts": [alert.raw for alert in alerts],
            }
        )
        return 0
    scale = run.summary.get("scale")
    fields = [
        ("run", run.id),
        ("name", run.name),
        ("project", run.project),
        ("status", run.status + (f" ({run.raw['status_reason']})" if run.raw.get("status_reason") else "")),
        ("last step", "-" if run.last_step is None else str(run.last_step)),
        ("created", _moment(run.created_at)),
        ("updated", _moment(run.updated_at)),
        ("tags", ", ".join(run.tags) or "-"),
        ("skipped", f"{run.summary.get('skips', 0)} optimizer step(s)"),
        ("loss scale", "-" if scale is None else _number(scale)),
        ("config", _cut(", ".join(f"{k}={v}" for k, v in run.config.items()), 100) or "-"),
        ("dashboard", run.url),
    ]
    for name, value in fields:
        print(f"{name:<11} {value}")
    print()
    if last:
        _table(
            ["key", "step", "last value"],
            [[key, str(step), _number(value)] for key, (step, value) in last.items()],
            right=[1, 2],
        )
    else:
        print("(no scalar values stored yet)")
    print()
    if alerts:
        print(f"open alerts ({len(alerts)}):")
        headers, rows = _alert_rows(alerts, with_run=False)
        _table(headers, rows, right=[0, headers.index("step")])
    else:
        print("no open alerts")
    return 0


def _rank(text: str) -> int | str:
    if text == "all":
        return text
    try:
        rank = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rank is a whole number or 'all', not {text!r}") from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"a rank is a whole number >= 0, not {text!r}")
    return rank


@_reading
def _cmd_export(api: Any, args: argparse.Namespace) -> int:
    run = api.run(args.run)
    keys = [key for value in args.keys or () for key in value.split(",") if key] or None
    target = args.output or f"{run.id}.{args.format}"
    if target == "-":
        if args.format != "csv":
            raise ValueError("only csv can be written to standard output (-o -); give -o FILE for parquet")
        rows = run.export(sys.stdout, "csv", keys, rank=args.rank, start=args.start, end=args.end)
    else:
        rows = run.export(target, args.format, keys, rank=args.rank, start=args.start, end=args.end)
    print(
        f"wrote {rows} rows (one per step) of run {run.id} ({run.name}) to {target}",
        file=sys.stderr if target == "-" else sys.stdout,
    )
    return 0
