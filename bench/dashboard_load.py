"""How long a big run's dashboard page takes to open in a real browser.

    .venv/bin/python bench/dashboard_load.py [--layers 200] [--steps 100000] [--repeats 3]

Creates, through the HTTP API of a real server (API + dashboard, fresh SQLite file), a run with
`--layers` layers and `--steps` steps: scalars every step (loss, amp/scale, grad/global_norm,
grad/global_norm_post_clip, lr), per-layer grad/norm every 10 steps (steps/10 rows of `layers` values),
update/ratio and grad/underflow_frac every 100 steps, log2 histograms of every layer and the fp16
safe-scale band every 1000 steps, and a skipped step (NaN norms, a skip event) every 2000 steps.
Then opens /dashboard/runs/{id} in headless Chromium (/usr/bin/chromium or GRADWATCH_TEST_CHROMIUM)
and measures the time from navigation until every graph of the page holds data (not a placeholder),
`--repeats` times (the first with the server's caches cold), with the CPU time the server process
(API and dashboard, one process) spent meanwhile; then how long the API alone takes to answer the
page's data requests one after the other. Prints one line per load and a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time

import httpx

CHROMIUM = os.environ.get("GRADWATCH_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
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


def make_run(url: str, layer_count: int, steps: int) -> str:
    rng = random.Random(0)
    layers = layer_names(layer_count)
    with httpx.Client(base_url=url, timeout=600) as client:
        run = client.post(
            "/api/v1/runs",
            json={
                "project": "bench",
                "name": f"{layer_count}-layers-{steps}-steps",
                "config": {"layers": layer_count, "steps": steps},
            },
        )
        run.raise_for_status()
        run_id = run.json()["id"]
        for seq, first in enumerate(range(0, steps, STEPS_PER_BATCH)):
            body = batch(seq, first, min(steps, first + STEPS_PER_BATCH), layers, rng)
            # json.dumps writes NaN literals, which the API reads (httpx's json= refuses them).
            client.post(
                f"/api/v1/runs/{run_id}/batches",
                content=json.dumps(body),
                headers={"Content-Type": "application/json"},
            ).raise_for_status()
        client.post(
            f"/api/v1/runs/{run_id}/batches", json={"seq": seq + 1, "status": "finished"}
        ).raise_for_status()
    return run_id


def api_floor(url: str, run_id: str) -> float:
    """Seconds the API takes, one request after the other, to answer what one page load asks for."""
    requests = [
        ("series", {"key": key})
        for key in ("loss", "amp/scale", "grad/global_norm", "grad/global_norm_post_clip", "lr")
    ]
    requests += [
        ("vectors", {"key": key, "max_steps": 500})
        for key in ("grad/norm", "update/ratio", "grad/underflow_frac")
    ]
    requests.append(("histograms", {"layer": layer_names(1)[0]}))
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120) as client:
        for path, params in requests:
            client.get(f"/api/v1/runs/{run_id}/{path}", params=params).raise_for_status()
    return time.perf_counter() - started


def load_times(url: str, run_id: str, repeats: int) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process: the server's API and dashboard) per page load."""
    from playwright.sync_api import sync_playwright

    condition = " && ".join(
        f"(() => {{ const g = document.querySelector('#{graph} .js-plotly-plot');"
        " return !!(g && g.data && g.data.length > 0); })()"
        for graph in GRAPHS
    )
    seconds = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for _ in range(repeats):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
            started, cpu_started = time.perf_counter(), time.process_time()
            page.goto(f"{url}/dashboard/runs/{run_id}")
            page.wait_for_function(f"() => {condition}", timeout=120_000, polling=50)
            seconds.append((time.perf_counter() - started, time.process_time() - cpu_started))
            if errors:
                raise RuntimeError(f"page errors: {errors}")
            page.close()
        browser.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from gradwatch.server.serve import BackgroundServer
    from gradwatch.server.settings import Settings

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(database_url=f"sqlite:///{home}/gradwatch.db")
        server = BackgroundServer(settings, "127.0.0.1", free_port()).start()
        try:
            started = time.perf_counter()
            run_id = make_run(server.url, args.layers, args.steps)
            print(
                f"ingested {args.layers} layers x {args.steps:,} steps "
                f"({args.steps // 10:,} grad/norm rows) in {time.perf_counter() - started:.1f} s"
            )
            times = load_times(server.url, run_id, args.repeats)
            floor = api_floor(server.url, run_id)
        finally:
            server.stop()
    for index, (seconds, cpu) in enumerate(times):
        print(
            f"load {index + 1}: all {len(GRAPHS)} graphs with data after {seconds:.2f} s "
            f"(server process CPU {cpu:.2f} s)"
        )
    walls = [seconds for seconds, _ in times]
    print(
        f"median {statistics.median(walls):.2f} s, worst {max(walls):.2f} s; the API alone, request after "
        f"request, takes {floor:.2f} s for the same data; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
