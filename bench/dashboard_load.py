"""How long a big run's dashboard page takes to open in a real browser, what an open page asks of the
server on every tick, and how much CPU an open idle page costs.

    .venv/bin/python bench/dashboard_load.py [--layers 200] [--steps 100000] [--repeats 3]
        [--seconds 30] [--idle-seconds 60] [--dashboard PATH]

--seconds 0 --idle-seconds 0 measures the page loads only.

Creates, through the HTTP API of a real server (API + dashboard in one process, fresh SQLite file), a
run with `--layers` layers and `--steps` steps: scalars every step (loss, amp/scale, grad/global_norm,
grad/global_norm_post_clip, lr), per-layer grad/norm every 10 steps (steps/10 rows of `layers`
values), update/ratio and grad/underflow_frac every 100 steps, log2 histograms of every layer and the
fp16 safe-scale band every 1000 steps, and a skipped step (NaN norms, a skip event) every 2000 steps.
Headless Chromium (/usr/bin/chromium or GRADWATCH_TEST_CHROMIUM, Playwright) then:

1. ticks: keeps the run page of the still running run open for `--seconds`, (a) with no new data,
   (b) while a feeder posts 20 new steps a second; then the runs list, (a) and (b) again. Counted:
   the dashboard's requests to the API (GETs through httpx in this process, by endpoint) and their
   bytes, the browser's requests to the dashboard and their bytes, the CPU of the server (this
   process less the bench's own threads) and of Chromium. The feeder alone, with no page open, is
   measured too: the server's CPU for ingest, to subtract.
2. loads: finishes the run and opens /dashboard/runs/{id} `--repeats` times, timing from navigation
   until every graph of the page holds data (not a placeholder), with the time the last callback
   answer arrived, the bytes of the callback answers and the CPU the server process and Chromium
   spent meanwhile (on a shared machine steadier than the wall time);
   then how long the API alone takes to answer the requests the last load made, one after the other.
3. idle: keeps the finished run's page open for `--idle-seconds` and measures the CPU.

--dashboard PATH imports gradwatch.dashboard from PATH instead (a copy of an earlier dashboard/
folder): the before and after of a change, measured back to back by the same script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import psutil
from _common import CHROMIUM, CHROMIUM_ARGS

GRAPHS = (
    "loss-graph",
    "scale-graph",
    "grad-norm-graph",
    "lr-graph",
    "grad-norm-heatmap",
    "update-ratio-heatmap",
    "underflow-heatmap",
    "hist-graph",
    "hist-time-graph",
)
STEPS_PER_BATCH = 2000
EXPONENT_MIN, EXPONENT_MAX = -80, 40
TICK_S = 2.0  # the run page's refresh interval (pages/run.py RUN_REFRESH_MS)
RUNS_TICK_S = 5.0  # the runs list's (pages/runs.py RUNS_LIST_REFRESH_MS)
FEED_STEPS_PER_S = 20
ALL_GRAPHS_HAVE_DATA = " && ".join(
    f"(() => {{ const g = document.querySelector('#{graph} .js-plotly-plot');"
    " return !!(g && g.data && g.data.length > 0); })()"
    for graph in GRAPHS
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer_names(count: int) -> list[str]:
    names = []
    for index in range(count):
        block, part = divmod(index, 8)
        kind = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "norm1", "norm2")[part]
        names.append(f"model.layers.{block}.{kind}.weight")
    return names


def histogram_row(rng: random.Random, center: int) -> list[int]:
    """One layer's counts per exponent, then zeros, then non-finite: a bell around 2^center."""
    counts = [0] * (EXPONENT_MAX - EXPONENT_MIN + 1)
    for offset in range(-8, 9):
        counts[center + offset - EXPONENT_MIN] = int(4000 * math.exp(-(offset**2) / 8)) + rng.randrange(5)
    return [*counts, rng.randrange(50), 0]


def batch(seq: int, first: int, last: int, layers: list[str], rng: random.Random) -> dict:
    steps = list(range(first, last))
    skipped = {step for step in steps if step % 2000 == 1999}
    scale = [2.0 ** (16 - (step // 2000) % 4) for step in steps]
    scalars = [
        {
            "key": "loss",
            "steps": steps,
            "values": [2.0 / math.log(step + 3) + rng.random() * 0.05 for step in steps],
        },
        {"key": "amp/scale", "steps": steps, "values": scale},
        {
            "key": "grad/global_norm",
            "steps": steps,
            "values": [math.nan if step in skipped else 1.0 + rng.random() for step in steps],
        },
        {
            "key": "grad/global_norm_post_clip",
            "steps": steps,
            "values": [math.nan if step in skipped else 1.0 for step in steps],
        },
        {"key": "lr", "steps": steps, "values": [3e-4 * min(1.0, (step + 1) / 2000) for step in steps]},
    ]
    band_steps = [step for step in steps if step % 1000 == 0]
    scalars += [
        {"key": "amp/safe_scale_min", "steps": band_steps, "values": [2.0**-6] * len(band_steps)},
        {"key": "amp/safe_scale_max", "steps": band_steps, "values": [2.0**19] * len(band_steps)},
    ]
    width = len(layers)

    def rows(every: int, value: float) -> tuple[list[int], list[list[float]]]:
        at = sorted({step for step in steps if step % every == 0} | (skipped if every == 10 else set()))
        return at, [
            [math.nan] * width if step in skipped else [value * (1 + rng.random()) for _ in range(width)]
            for step in at
        ]

    vectors = []
    for key, every, value in (
        ("grad/norm", 10, 0.05),
        ("update/ratio", 100, 1e-3),
        ("grad/underflow_frac", 100, 0.01),
    ):
        at, values = rows(every, value)
        vectors.append({"key": key, "steps": at, "values": values})
    histograms = [
        {
            "key": "grad/hist",
            "step": step,
            "exponent_min": EXPONENT_MIN,
            "exponent_max": EXPONENT_MAX,
            "counts": [histogram_row(rng, -14 + index % 6) for index in range(width)],
        }
        for step in band_steps
    ]
    events = [
        {
            "step": step,
            "kind": "skip",
            "data": {
                "scale_before": scale[step - first],
                "scale_after": scale[step - first] / 2,
                "non_finite_layers": layers[:3],
                "non_finite_layer_count": 3,
            },
        }
        for step in sorted(skipped)
    ]
    body = {"seq": seq, "scalars": scalars, "vectors": vectors, "histograms": histograms, "events": events}
    if seq == 0:
        body["layers"] = layers
    return body


def make_run(url: str, layer_count: int, steps: int, name: str = "") -> str:
    """A run of `layer_count` layers and `steps` steps, still running (see finish_run)."""
    rng = random.Random(0)
    layers = layer_names(layer_count)
    with httpx.Client(base_url=url, timeout=600) as client:
        run = client.post(
            "/api/v1/runs",
            json={
                "project": "bench",
                "name": name or f"{layer_count}-layers-{steps}-steps",
                "config": {"layers": layer_count, "steps": steps},
            },
        )
        run.raise_for_status()
        run_id = run.json()["id"]
        for seq, first in enumerate(range(0, steps, STEPS_PER_BATCH)):
            post_batch(client, run_id, batch(seq, first, min(steps, first + STEPS_PER_BATCH), layers, rng))
    return run_id


def post_batch(client: httpx.Client, run_id: str, body: dict) -> None:
    # json.dumps writes NaN literals, which the API reads (httpx's json= refuses them).
    client.post(
        f"/api/v1/runs/{run_id}/batches",
        content=json.dumps(body),
        headers={"Content-Type": "application/json"},
    ).raise_for_status()


def finish_run(url: str, run_id: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        client.post(
            f"/api/v1/runs/{run_id}/batches", json={"seq": 10**9, "status": "finished"}
        ).raise_for_status()


# -- what is measured ------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Requests and response bytes by name, with the time the requests took (summed)."""

    requests: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    urls: list[str] = field(default_factory=list)

    def add(self, name: str, size: int, seconds: float = 0.0, url: str = "") -> None:
        self.requests[name] += 1
        self.bytes[name] += size
        self.seconds += seconds
        if url:
            self.urls.append(url)

    def summary(self, ticks: float) -> str:
        total, size = sum(self.requests.values()), sum(self.bytes.values())
        parts = ", ".join(
            f"{name} {count / ticks:.1f} ({self.bytes[name] / ticks / 1000:.1f} kB)"
            for name, count in self.requests.most_common()
        )
        return f"{total / ticks:.1f} requests, {size / ticks / 1000:.1f} kB per tick [{parts or 'none'}]"


class ApiCounter:
    """Counts the GET requests this process sends to the API through httpx (the dashboard's API
    client; clients in `ignored`, the bench's own, are not counted)."""

    def __init__(self) -> None:
        self.traffic = Traffic()
        self.ignored: set[int] = set()
        self._lock = threading.Lock()
        original = httpx.Client.send
        counter = self

        def send(client: httpx.Client, request: httpx.Request, **kwargs: object) -> httpx.Response:
            started = time.perf_counter()
            response = original(client, request, **kwargs)  # type: ignore[arg-type]
            if id(client) not in counter.ignored and request.method == "GET":
                path = request.url.path
                if path.startswith("/api/v1/"):
                    name = endpoint_name(path, request.url.params.get("key"))
                    with counter._lock:
                        counter.traffic.add(
                            name, len(response.content), time.perf_counter() - started, str(request.url)
                        )
            return response

        httpx.Client.send = send  # type: ignore[method-assign]

    def reset(self) -> Traffic:
        with self._lock:
            traffic, self.traffic = self.traffic, Traffic()
        return traffic


def endpoint_name(path: str, key: str | None) -> str:
    parts = path.removeprefix("/api/v1/").split("/")
    if parts[0] == "runs" and len(parts) >= 3:
        name = "/".join(parts[2:])
    elif parts[0] == "runs":
        name = "run" if len(parts) == 2 else "runs"
    else:
        name = parts[0]
    return f"{name}:{key}" if key and name in ("series", "vectors") else name


class Cpu:
    """CPU seconds of the server (this process less the bench's own threads) and of Chromium."""

    def __init__(self, own_threads: set[int]) -> None:
        self.own_threads = own_threads
        self.process = psutil.Process()

    def read(self) -> tuple[float, dict[int, float]]:
        """(server CPU seconds so far, CPU seconds so far per Chromium process id)."""
        times = self.process.cpu_times()  # includes threads that have ended
        own = sum(
            thread.user_time + thread.system_time
            for thread in self.process.threads()
            if thread.id in self.own_threads
        )
        browser = {}
        for child in self.process.children(recursive=True):
            try:
                if "chrom" in child.name():
                    child_times = child.cpu_times()
                    browser[child.pid] = child_times.user + child_times.system
            except psutil.Error:
                continue
        return times.user + times.system - own, browser

    @staticmethod
    def browser_seconds(before: dict[int, float], after: dict[int, float]) -> float:
        """Chromium's CPU seconds between two reads: processes that ended in between are left out."""
        return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


class Feeder:
    """Posts FEED_STEPS_PER_S new steps of the run a second from a thread, like a training run."""

    def __init__(self, url: str, run_id: str, first_step: int, layer_count: int, api: ApiCounter) -> None:
        self.client = httpx.Client(base_url=url, timeout=60)
        api.ignored.add(id(self.client))
        self.run_id, self.step, self.layers = run_id, first_step, layer_names(layer_count)
        self.seq = 10**6
        self.rng = random.Random(1)
        self.native_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, own_threads: set[int]) -> None:
        started = threading.Event()

        def loop() -> None:
            self.native_id = threading.get_native_id()
            own_threads.add(self.native_id)
            started.set()
            while not self._stop.wait(1.0):
                body = batch(self.seq, self.step, self.step + FEED_STEPS_PER_S, self.layers, self.rng)
                body.pop("layers", None)
                post_batch(self.client, self.run_id, body)
                self.seq += 1
                self.step += FEED_STEPS_PER_S

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="bench-feeder", daemon=True)
        self._thread.start()
        started.wait()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def request_sizes(request: object) -> dict[str, int] | None:
    """A finished request's sizes, or None when its page closed meanwhile (a callback that answered
    as the page was being closed)."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        return request.sizes()  # type: ignore[attr-defined,no-any-return]
    except PlaywrightError:
        return None


def observe(
    browser: object,
    url: str,
    ready: str,
    seconds: float,
    api: ApiCounter,
    cpu: Cpu,
    feeder: Feeder | None = None,
) -> tuple[Traffic, Traffic, float, float]:
    """Open `url`, wait for the JS condition `ready` and a few more seconds, then count for `seconds`:
    (API traffic, browser traffic, server CPU %, Chromium CPU %). Without a browser: no page."""
    page = None
    browser_traffic = Traffic()
    if browser is not None:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
        counting = [False]

        def finished(request: object) -> None:
            if counting[0] and "/_dash-" in request.url:  # type: ignore[attr-defined]
                sizes = request_sizes(request)
                if sizes is None:
                    return
                browser_traffic.add(
                    urlsplit(request.url).path.rsplit("/", 1)[-1],  # type: ignore[attr-defined]
                    sizes["responseBodySize"] + sizes["requestBodySize"],
                )

        page.on("requestfinished", finished)
        page.goto(url)
        page.wait_for_function(f"() => {ready}", timeout=120_000, polling=100)
        page.wait_for_timeout(5000)  # the first live ticks and the layers refresh settle
        counting[0] = True
    if feeder is not None:
        feeder.start(cpu.own_threads)
    api.reset()
    server_before, browser_before = cpu.read()
    if page is not None:
        page.wait_for_timeout(seconds * 1000)
    else:
        time.sleep(seconds)
    server_after, browser_after = cpu.read()
    traffic = api.reset()
    if feeder is not None:
        feeder.stop()
    if page is not None:
        page.close()
    return (
        traffic,
        browser_traffic,
        100 * (server_after - server_before) / seconds,
        100 * Cpu.browser_seconds(browser_before, browser_after) / seconds,
    )


MISSING_GRAPHS = (
    "() => " + json.dumps(GRAPHS) + ".map(id => [id, document.querySelector('#' + id + ' .js-plotly-plot')])"
    ".filter(([id, g]) => !(g && g.data && g.data.length))"
    ".map(([id, g]) => id + ': ' + ((g && g.layout && (g.layout.annotations || [])"
    ".map(a => a.text).join(' ')) || '?'))"
)


@dataclass
class Load:
    """One page load, timed from navigation until every graph holds data."""

    seconds: float
    last_answer_s: float  # when the last callback answer arrived
    server_cpu_s: float
    # Chromium's CPU seconds meanwhile (all its processes): steadier than wall time on a busy machine.
    browser_cpu_s: float
    answer_bytes: int  # of the callback answers
    traffic: Traffic  # the load's API requests
    load_average: float  # the 1-minute load average when it ended: the machine is shared


def load_times(browser: object, url: str, run_id: str, repeats: int, api: ApiCounter, cpu: Cpu) -> list[Load]:
    """Each of `repeats` loads of the run page, in a new page (no cache, as a first visit)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    loads = []
    for _ in range(repeats):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
        errors: list[str] = []
        answers: list[tuple[float, int]] = []
        page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))

        def finished(request: object, answers: list[tuple[float, int]] = answers) -> None:
            if "/_dash-update-component" in request.url:  # type: ignore[attr-defined]
                at, sizes = time.perf_counter(), request_sizes(request)
                if sizes is not None:
                    answers.append((at, sizes["responseBodySize"]))

        page.on("requestfinished", finished)
        api.reset()
        server_before, browser_before = cpu.read()
        started = time.perf_counter()
        page.goto(f"{url}/dashboard/runs/{run_id}")
        try:
            page.wait_for_function(f"() => {ALL_GRAPHS_HAVE_DATA}", timeout=120_000, polling=50)
        except PlaywrightTimeout:
            # A graph that shows a message instead of data (an API call past the dashboard's timeout).
            shown = page.evaluate(MISSING_GRAPHS)
            raise RuntimeError(f"graphs without data after 120 s: {shown}") from None
        drawn = time.perf_counter() - started
        server_after, browser_after = cpu.read()
        traffic = api.reset()
        last_answer = max((at for at, _ in answers), default=started) - started
        answer_bytes = sum(s for _, s in answers)
        loads.append(
            Load(
                drawn,
                last_answer,
                server_after - server_before,
                Cpu.browser_seconds(browser_before, browser_after),
                answer_bytes,
                traffic,
                os.getloadavg()[0],
            )
        )
        if errors:
            raise RuntimeError(f"page errors: {errors}")
        page.close()
    return loads


def api_alone(urls: list[str], api: ApiCounter) -> float:
    """Seconds the API takes to answer `urls`, one after the other."""
    with httpx.Client(timeout=120) as client:
        api.ignored.add(id(client))
        started = time.perf_counter()
        for url in urls:
            client.get(url).raise_for_status()
        return time.perf_counter() - started


def use_dashboard_from(path: str) -> None:
    """Import gradwatch.dashboard from the folder `path` (an earlier copy of dashboard/)."""
    import gradwatch

    spec = importlib.util.spec_from_file_location(
        "gradwatch.dashboard", os.path.join(path, "__init__.py"), submodule_search_locations=[path]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no dashboard package at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gradwatch.dashboard"] = module
    spec.loader.exec_module(module)
    gradwatch.dashboard = module  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="each tick measurement (0: none)")
    parser.add_argument(
        "--idle-seconds", type=float, default=60.0, help="the finished run's idle page (0: not measured)"
    )
    parser.add_argument("--dashboard", help="import gradwatch.dashboard from this folder")
    args = parser.parse_args()
    if args.dashboard:
        use_dashboard_from(args.dashboard)

    from playwright.sync_api import sync_playwright

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    api = ApiCounter()
    own_threads = {threading.get_native_id()}
    cpu = Cpu(own_threads)
    report: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(database_url=f"sqlite:///{home}/gradwatch.db")
        server = BackgroundServer(settings, "127.0.0.1", free_port()).start()
        try:
            started = time.perf_counter()
            run_id = make_run(server.url, args.layers, args.steps)
            say(
                f"ingested {args.layers} layers x {args.steps:,} steps "
                f"({args.steps // 10:,} grad/norm rows) in {time.perf_counter() - started:.1f} s"
            )
            run_page = f"{server.url}/dashboard/runs/{run_id}"
            runs_page = f"{server.url}/dashboard/"
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                feeder = Feeder(server.url, run_id, args.steps, args.layers, api)
                runs_list_ready = "!!document.querySelector('#runs-table table')"
                scenarios: list[tuple[str, object, str, str, Feeder | None, float]] = [
                    ("live run page, no new data", browser, run_page, ALL_GRAPHS_HAVE_DATA, None, TICK_S),
                    ("feeder alone, no page open", None, "", "", feeder, TICK_S),
                    (
                        "live run page, 20 new steps/s",
                        browser,
                        run_page,
                        ALL_GRAPHS_HAVE_DATA,
                        feeder,
                        TICK_S,
                    ),
                    ("runs list, no new data", browser, runs_page, runs_list_ready, None, RUNS_TICK_S),
                    ("runs list, 20 new steps/s", browser, runs_page, runs_list_ready, feeder, RUNS_TICK_S),
                ]
                for label, in_browser, url, ready, feeding, tick_s in scenarios if args.seconds > 0 else []:
                    ticks = args.seconds / tick_s
                    api_traffic, page_traffic, server_cpu, browser_cpu = observe(
                        in_browser, url, ready, args.seconds, api, cpu, feeding
                    )
                    say(
                        f"{label} ({args.seconds:.0f} s, per {tick_s:.0f}-s tick): API "
                        f"{api_traffic.summary(ticks)}; browser<->dashboard {page_traffic.summary(ticks)}; "
                        f"CPU server {server_cpu:.1f}%, Chromium {browser_cpu:.1f}%; "
                        f"load average {os.getloadavg()[0]:.1f}"
                    )
                finish_run(server.url, run_id)
                loads = load_times(browser, server.url, run_id, args.repeats, api, cpu)
                for index, load in enumerate(loads):
                    say(
                        f"load {index + 1}: all {len(GRAPHS)} graphs with data after {load.seconds:.2f} s "
                        f"(last callback answer at {load.last_answer_s:.2f} s, "
                        f"{load.answer_bytes / 1e6:.2f} MB of answers; "
                        f"{sum(load.traffic.requests.values())} API requests, "
                        f"{sum(load.traffic.bytes.values()) / 1e6:.2f} MB; CPU server process "
                        f"{load.server_cpu_s:.2f} s, Chromium {load.browser_cpu_s:.2f} s; "
                        f"load average {load.load_average:.1f})"
                    )
                floor = api_alone(loads[-1].traffic.urls, api)
                walls = [load.seconds for load in loads]
                say(
                    f"median {statistics.median(walls):.2f} s, worst {max(walls):.2f} s (CPU per load, "
                    f"median: server {statistics.median(load.server_cpu_s for load in loads):.2f} s, "
                    f"Chromium {statistics.median(load.browser_cpu_s for load in loads):.2f} s); "
                    f"the API alone, request after request, takes {floor:.2f} s for the same data; "
                    f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
                )
                api_traffic, page_traffic, server_cpu, browser_cpu = (
                    observe(browser, run_page, ALL_GRAPHS_HAVE_DATA, args.idle_seconds, api, cpu)
                    if args.idle_seconds > 0
                    else (Traffic(), Traffic(), math.nan, math.nan)
                )
                say(
                    f"finished run page, idle ({args.idle_seconds:.0f} s): API requests "
                    f"{sum(api_traffic.requests.values())}, browser<->dashboard requests "
                    f"{sum(page_traffic.requests.values())}; CPU server {server_cpu:.1f}%, "
                    f"Chromium {browser_cpu:.1f}%; load average {os.getloadavg()[0]:.1f}"
                )
                browser.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
