"""`freshrec run` end to end: produces through the embedded stack and leaves no process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from freshcore import clock
from freshcore.abstats import VERDICTS
from freshrec.app.stack import pid_alive

from .conftest import stack_broker, wait_for

PIDS = re.compile(r"pid (\d+)")
DASHBOARD = re.compile(r"dashboard: (http://\S+)")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def freshrec(tmp_path, *args: str, models: Path | None = None, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
    env["FRESHREC_HOME"] = str(tmp_path)
    if models is not None:  # the runs of this module share their trained models
        env["FRESHREC_MODEL_DIR"] = str(models)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "freshrec.app.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


EXAMPLE_EXPERIMENT = Path(__file__).resolve().parents[1] / "examples" / "experiments.toml"
WORLD_ARGS = ("--items", "2000", "--users", "10000")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Where this module's runs keep their models: the first trains them, the next reuse."""
    return tmp_path_factory.mktemp("run-models")


def test_run_is_a_closed_loop_that_serves_learns_and_cleans_up(tmp_path, models):
    """`freshrec run --experiment examples/experiments.toml`: trains (small world), serves
    simulated users who click; while it runs every service's /metrics has the named series
    with plausible values, the dashboard renders with data — per-variant CTR too — in
    headless Chromium (screenshot saved), `freshrec top` prints. Ctrl-C (SIGINT) then winds it
    down: it prints served requests, a nonzero CTR, freshness figures and the experiment's
    report (every variant served and clicked), exits 130, and leaves nothing behind. The run
    lasts as long as the checks need (its --duration is far beyond them): nothing races it.

    Midway it meets three inputs that each once stopped the whole run (``send_hostile``):
    a burst of valid events naming one item id of 64 emoji, an edit that makes the
    experiments file valid TOML but no experiment, and a batch of rows of another width on
    every ``embeddings.updates`` partition. The run goes on with every service it started
    (no restart: three "started" lines), serving the experiment it had. It starts in the
    daily mode (``--mode daily``); ``freshrec mode set promo`` moves its worker to promo,
    which ``freshrec mode show`` reports, and ``freshrec mode set daily`` back."""
    experiment = tmp_path / "experiments.toml"
    experiment.write_text(EXAMPLE_EXPERIMENT.read_text())
    proc = freshrec(
        tmp_path,
        "run",
        "--duration",
        "900",
        *WORLD_ARGS,
        "--rate",
        "100",
        "--requests",
        "20",
        "--dashboard-port",
        "0",
        "--experiment",
        str(experiment),
        "--mode",
        "daily",
        models=models,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        url = next((m.group(1) for x in list(lines) if (m := DASHBOARD.search(x))), None)
        time.sleep(0.5)
    assert url, "".join(lines)
    targets = json.loads((tmp_path / "run" / "services.json").read_text())
    wait_for(lambda: replies(targets) >= 100, 120, what="100 closed-loop replies")
    send_hostile(tmp_path / "run", experiment)
    switch_modes(tmp_path)
    check_dashboard_in_chromium(url)
    check_service_metrics(targets)
    top = freshrec(tmp_path, "top", "--once")
    top_out, _ = top.communicate(timeout=60)
    assert top.returncode == 0 and "freshness" in top_out and "requests/s" in top_out, top_out
    assert "variants   CTR ranking-2026-12/control" in top_out, top_out
    behind = re.search(r"behind\s+global_applied ([\d.]+) s\s+served ([\d.]+) s", top_out)
    assert behind and all(0 <= float(v) < 60 for v in behind.groups()), top_out
    # three CTR windows of 10 s: at 20 requests/s the closed loop needs 30 s for 600 replies
    wait_for(lambda: replies(targets) >= 600, 240, what="600 closed-loop replies")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=240)
    reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 130 and "interrupted: stopping" in out, out
    m = re.search(r"run finished: ([\d,]+) background events delivered", out)
    assert m and int(m.group(1).replace(",", "")) > 2000, out
    assert "items: 2,000 loaded" in out and "trained " in out
    served = re.search(r"closed loop: served ([\d,]+) of ([\d,]+) requests", out)
    assert served and int(served.group(1).replace(",", "")) > 300, out
    ctr = re.search(r"CTR of served recommendations ([\d.]+)%", out)
    assert ctr and float(ctr.group(1)) > 0, out
    curve = re.search(r"CTR per 10 s: ((?:[\d.]+% ?)+)", out)  # 600 replies: 30 s or more
    assert curve and len(curve.group(1).split()) >= 3, out
    fresh = re.search(r"p99 local ([\d,]+)ms global ([\d,]+)ms served ([\d,]+)ms", out)
    assert fresh, out
    cost = re.search(
        r"cost: streams ([\d.]+) CPU-s .*worker ([\d.]+) CPU-s \(([\d.]+) per 1,000 requests", out
    )
    assert cost and float(cost.group(2)) > 0 and float(cost.group(3)) > 0, out
    ranking = re.search(r"ranking per batch, p50/p99: (.*)", out)  # control and light variant
    assert ranking and re.search(r"wide_deep [\d.]+/[\d.]+ ms \([\d,]+ candidates\)", ranking[1])
    assert "light " in ranking[1], out
    report = out.split("experiment ranking-2026-12 (control: control)")[1]
    for variant in ("control", "light", "diverse"):
        row = re.search(rf"\n  {variant} +[\d.]+% +([\d,]+) +([\d,]+) +([\d,]+) ", report)
        assert row and all(int(x.replace(",", "")) > 0 for x in row.groups()), report
    assert "vs control (CTR, relative; users in 64 buckets" in report, report
    for variant in ("light", "diverse"):  # the guard's verdict on each variant
        verdict = re.search(rf"\n  {variant} +\S+ \[[^]]+\] +(.+)", report)
        assert verdict and verdict[1].strip() in VERDICTS, report
    assert (models / "manifest.json").exists()  # cached for the next run
    assert not (tmp_path / "run" / "services.json").exists()
    pids = [int(p) for p in PIDS.findall(out.split("embedded stack stopped")[1])]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    children = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", out)]
    assert len(children) == 3 and not any(pid_alive(p) for p in children)


def send_hostile(stack_dir: Path, experiment: Path) -> None:
    """The three inputs of the docstring above, to the run's own broker and file."""
    import numpy as np
    from confluent_kafka import Producer

    from freshcore.kafka import producer_config
    from freshcore.settings import STACK_ENV_FILE, ConnectionSettings, read_env_file
    from freshcore.topics import TopicNames
    from schemas.codec import encode_event
    from schemas.records import Event
    from schemas.rowbatch import KIND_UPDATES, TABLE_ITEM, RowBatch

    conn = ConnectionSettings.from_env(read_env_file(stack_dir / STACK_ENV_FILE))
    names = TopicNames(conn.topic_prefix)
    producer = Producer(producer_config(conn))
    now_ms = clock.now_ms()
    item = "\N{GRINNING FACE}" * 64
    for n in range(5000):
        event = Event(f"emoji-{n}", "click", f"emoji-user-{n % 7}", item, now_ms)
        producer.produce(names.events, encode_event(event), key=event.user_id.encode())
    n = 3
    wide = RowBatch(
        KIND_UPDATES,
        TABLE_ITEM,
        np.arange(1, n + 1, dtype=np.uint64),
        np.ones((n, 7), np.float32),
        np.full(n, 1, np.uint64),
        np.full(n, now_ms, np.int64),
    ).encode()
    partitions = producer.list_topics(names.embeddings_updates, timeout=10).topics
    for q in partitions[names.embeddings_updates].partitions:
        producer.produce(names.embeddings_updates, wide, partition=q)
    assert producer.flush(30) == 0
    experiment.write_text("variant = [1, 2]\n" + experiment.read_text())


def switch_modes(tmp_path: Path) -> None:
    """``freshrec mode set``/``show`` against the run going on in ``tmp_path``."""

    def mode_command(*args: str) -> str:
        proc = freshrec(tmp_path, "mode", *args)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        return out

    shown = mode_command("show")
    assert "worker: serving in daily" in shown and "no control record" in shown, shown
    assert "serving mode set to promo" in mode_command("set", "promo")
    wait_for(lambda: "worker: serving in promo" in mode_command("show"), 30, what="promo")
    shown = mode_command("show")
    assert "* promo" in shown and "control record: promo" in shown, shown
    mode_command("set", "daily")
    wait_for(lambda: "worker: serving in daily" in mode_command("show"), 30, what="daily")
    bad = freshrec(tmp_path, "mode", "set", "rush")
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "no mode 'rush'" in out, out


def replies(targets: dict[str, str]) -> float:
    """The worker's replies so far (0 while its endpoint does not answer)."""
    from freshrec.promtext import scrape, total

    try:
        return total(scrape(targets["worker"]), "freshrec_replies_total")
    except OSError:
        return 0.0


def check_service_metrics(targets: dict[str, str]) -> None:
    from freshrec.promtext import histogram_quantile, scrape, total

    first = {name: scrape(url) for name, url in targets.items()}
    rising = [
        ("worker", "freshrec_worker_events_total"),
        ("worker", "freshrec_requests_total"),
        ("worker", "freshrec_replies_total"),
        ("worker", "freshrec_recall_calls_total"),
        ("worker", "freshrec_cache_lookups_total"),
        ("worker", "freshrec_updates_installed_total"),
        ("param-server", "freshrec_ps_rows_applied_total"),
        ("streams", "freshrec_streams_counted_events_total"),
    ]

    def risen() -> dict | None:
        now = {name: scrape(url) for name, url in targets.items()}
        ok = all(total(now[n], metric) > total(first[n], metric) for n, metric in rising)
        return now if ok else None

    second = wait_for(risen, 60, interval_s=0.5, what="every service's counters to rise")
    w0, w1 = first["worker"], second["worker"]
    for stage in ("local", "served"):
        p99 = histogram_quantile(w1, "freshrec_freshness_lag_seconds", 0.99, stage=stage)
        assert 0 < p99 < 60, (stage, p99)
    p99 = histogram_quantile(
        second["param-server"], "freshrec_freshness_lag_seconds", 0.99, stage="global_applied"
    )
    assert 0 < p99 < 60
    assert histogram_quantile(second["streams"], "freshrec_hot_list_lag_seconds", 0.99) > 0
    newest = "freshrec_freshness_event_timestamp_seconds"
    learnt, served = (total(w1, newest, stage=s) for s in ("local", "served"))
    applied = total(second["param-server"], newest, stage="global_applied")
    # the server is scraped after the worker: it may have persisted a little past ``learnt``
    assert 0 <= learnt - served < 60 and -5 < learnt - applied < 60, (learnt, served, applied)
    for name, group in (
        ("worker", "workers"),
        ("param-server", "param-server"),
        ("streams", "streams-validate"),
    ):
        lags = [
            v
            for labels, v in second[name].get("freshrec_consumer_lag_messages", [])
            if labels["group"] == group
        ]
        assert lags and all(0 <= v < 1e6 for v in lags), (name, lags)
    assert histogram_quantile(w1, "freshrec_request_seconds", 0.99, stage="total") > 0
    assert total(w1, "freshrec_model_info") == 1
    assert {labels["channel"] for labels, _ in w1["freshrec_breaker_state"]} >= {"vector", "hot"}
    assert total(w1, "freshrec_requests_total") > total(w0, "freshrec_requests_total")


def check_dashboard_in_chromium(url: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, (
        "Debian's chromium is needed: `make test` installs it (apt-get install chromium)"
    )
    flags = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--virtual-time-budget=5000",
    ]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    points = dict(re.findall(r'id="(\w+)" data-points="(\d+)"', dom.stdout))
    assert set(points) >= {"fresh99", "fresh50", "behind", "lag", "rates", "latency", "tiers"}, (
        dom.stdout[-2000:]
    )
    for chart in ("fresh99", "behind", "rates", "latency", "lag", "variants"):
        assert int(points[chart]) > 0, points
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    subprocess.run(
        [*flags, "--window-size=1400,1150", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=90,
    )
    assert shot.exists() and shot.stat().st_size > 10_000


def _sigint_as_from_a_terminal() -> None:
    """A test runner started in the background of a shell without job control has SIGINT
    ignored (POSIX), and a child inherits that: Python then keeps it ignored. Ctrl-C must
    reach the run as it does from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.tansu
def test_ctrl_c_stops_the_run_and_its_stack(tmp_path, models, broker):
    """On a Redis Cluster of three masters (``--redis-cluster 3``): the run says first which
    broker it runs, starts on it, its closed loop gets going, and Ctrl-C stops the broker and
    every node. (The world of the test above: its models.)"""
    chosen = stack_broker(broker)
    proc = freshrec(
        tmp_path,
        "run",
        "--redis-cluster",
        "3",
        *(("--broker", chosen) if chosen else ()),
        *WORLD_ARGS,
        "--rate",
        "200",
        models=models,
        preexec_fn=_sigint_as_from_a_terminal,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("background events:") or time.monotonic() > deadline:
            break
    assert lines[0].startswith("broker: "), "".join(lines)
    if chosen:
        assert lines[0].startswith("broker: Tansu" if chosen == "tansu" else "broker: Apache")
    up = next(x for x in lines if "embedded stack up" in x)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, "".join(lines) + out
    assert "Redis redis+cluster://127.0.0.1:" in up
    stopped = re.search(r"embedded stack stopped \((.*)\)", out).group(1)
    ports = [int(p) for p in re.findall(r"port (\d+)", stopped)]
    assert [name.split()[0] for name in stopped.split("), ")] == [
        "kafka",
        "redis",
        "redis1",
        "redis2",
    ]
    state = tmp_path / "run" / "stack.json"
    assert not state.exists()
    import socket

    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listening"
