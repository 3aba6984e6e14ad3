"""Benchmark of online learning: the worker's event path vs raw consume, parameter-server
rows/s with Redis persistence, and freshness lag per stage at a steady event rate.

    .venv/bin/python -m tools.bench_learning [--events 100000] [--rate 5000] [--duration 20]
                                             [--ramp 5] [--only throughput|lag] [--passes 3]
                                             [--producer-linger-ms N] [--alongside]

The throughput phase alternates raw reads of the events with passes of a new worker over the
same events (its own topics: a worker's group follows from its prefix), ``--passes`` of each,
and sets the fastest against the fastest: noise only slows a run, on either side. Both run in
this process with its heap frozen first (``settle_heap``, as every FreshRec service does at
start): until 2026-11-30 (eb7ddd2) the raw reads ran before the worker had frozen it, and the cyclic
collector, set off by the Message objects a read creates, walked torch's ~184,000 objects
during each read: the reads came out at about half a plain consumer's rate (0.58-0.77M
against 1.19-1.30M events/s once frozen, scratch runs) and the ratio at 1.3-2x what it is.

Writes artifacts/bench_learning.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import threading
import time

import numpy as np

from freshcore.kafka import close_producer
from freshcore.lifecycle import settle_heap
from freshcore.metrics import PS_ROWS_APPLIED, WORKER_EVENTS
from freshcore.topics import TopicNames
from freshrec.app.stack import free_port
from freshrec.progress import ProgressLine
from freshrec.promtext import merge, scrape_port, scrape_port_now, total
from freshrec.sim.produce import events_producer, prepare_events, produce_events, produce_prepared
from inference.settings import LearningSettings, WorkerSettings
from inference.worker import LOOP_PHASES, Worker
from param_server.server import ParameterServer
from param_server.settings import ParamServerSettings
from tools.benchlib import (
    bench_connection,
    events_on_own_topics,
    lag_alongside,
    lag_summary,
    learning_world,
    p50_p99,
    produce_values,
    raw_consume_rate,
    raw_lag,
    save,
    service_process,
    synthetic_records,
)


def counter(name: str, **labels: str) -> float:
    """A counter of this process, read from the in-process registry."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def gradient_counts() -> tuple[float, float]:
    """Gradient messages and rows this process's workers have sent so far."""
    rows = sum(
        counter("freshrec_gradient_rows_total", table=t, outcome="sent") for t in ("user", "item")
    )
    return counter("freshrec_gradient_messages_total", side="sent"), rows


def worker_pass(conn, events: int) -> float:
    """Events/s of a new worker's event path (decode, examples, gradients, local step, gradient
    emit) over the ``events`` events waiting on ``conn``'s topic, from its first batch on.
    The worker closes after: its last gradients (the outbox's linger) leave, and are
    delivered."""
    w = Worker(WorkerSettings(conn, LearningSettings(dim=64)))
    w.start()
    # read the counter's own value: scraping /metrics, or even the registry's
    # get_sample_value (it collects every metric: 7% of this loop in a profile), per poll
    # would be measured as the worker's time
    valid = WORKER_EVENTS.labels("valid")
    base, first = valid._value.get(), None
    while True:
        w.poll_once()
        n = valid._value.get() - base
        if n and first is None:
            first = (time.perf_counter(), n)
        if n >= events:
            break
    elapsed = time.perf_counter() - first[0]
    w.close()
    return (events - first[1]) / elapsed


def main() -> None:
    args = parser().parse_args()
    progress = ProgressLine()
    world = learning_world()
    results: dict = {}
    if args.only in (None, "throughput"):
        results["throughput"] = throughput(world, args, progress)
    if args.only in (None, "lag"):
        results["freshness_lag"] = freshness_lag(world, args, progress)
    save("bench_learning", results)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument(
        "--ramp",
        type=float,
        default=5.0,
        help="seconds at the full rate before the lag is measured",
    )
    ap.add_argument("--only", choices=["throughput", "lag"], help="run one of the two phases")
    ap.add_argument(
        "--passes",
        type=int,
        default=3,
        choices=range(1, 9),
        metavar="1..8",
        help="raw reads and worker passes of the throughput phase (alternating)",
    )
    ap.add_argument(
        "--alongside",
        action="store_true",
        help="also read the events with a plain consumer beside the pipeline "
        "(a diagnostic: it adds load of its own)",
    )
    ap.add_argument(
        "--producer-linger-ms",
        type=int,
        default=None,
        help="linger.ms of the lag phase's event producer (default: the profile's)",
    )
    return ap


# ------------------------------------------------------------------------------ throughput
def throughput(world, args, progress: ProgressLine) -> dict:
    """The worker's event path against raw consume (the fastest of ``--passes`` each), and
    the parameter server's rows/s over the first pass's gradients."""
    stamp = int(time.time())
    with bench_connection(f"bw{stamp}.") as conn:
        # each worker pass needs a topic its group has not read: the same events on one
        # topic set per pass (a worker's group follows from its topic prefix)
        records = synthetic_records(world, 5, args.events)
        produce_values(conn, TopicNames(conn.topic_prefix).events, records)
        passes = [conn] + [
            events_on_own_topics(conn, f"bw{stamp}{p}.", records)
            for p in "bcdefgh"[: args.passes - 1]
        ]
        settle_heap()  # what the worker's start does; the raw reads must not pay for it
        raw_reads, worker_rates, (grad_msgs, grad_rows) = alternate(
            conn, passes, args.events, progress
        )
        raw, worker_rate = max(raw_reads), max(worker_rates)
        progress.done(
            f"fastest of {len(passes)}: raw {raw:,.0f}, worker {worker_rate:,.0f} events/s "
            f"({worker_rate / raw:.1%} of raw; the first worker pass {worker_rates[0] / raw:.1%})"
        )
        ps_rate = param_server_rate(conn, grad_rows)
        progress.done(f"parameter server: {ps_rate:,.0f} rows/s applied and persisted")
        return {
            "events": args.events,
            "raw_consume_events_per_s": round(raw),
            "raw_consume_reads": [round(r) for r in raw_reads],
            "worker_events_per_s": round(worker_rate),
            "worker_passes": [round(r) for r in worker_rates],
            "ratio": round(worker_rate / raw, 3),
            "ratio_first_pass": round(worker_rates[0] / raw, 3),
            "ratio_note": "fastest worker pass / fastest raw read, alternating, in one "
            "process with its heap frozen; ratio_first_pass: the first worker pass / the "
            "fastest raw read",
            "gradient_messages": int(grad_msgs),
            "gradient_rows": int(grad_rows),
            "param_server_rows_per_s": round(ps_rate),
            "dim": 64,
        }


def alternate(conn, passes: list, events: int, progress: ProgressLine):
    """Raw reads of ``conn``'s events and worker passes over each of ``passes``, alternating
    so that both sides sample the same minutes: the raw rates, the worker rates, and the
    gradient messages and rows the first pass sent."""
    topic = TopicNames(conn.topic_prefix).events
    raw_reads, worker_rates = [], []
    for i, c in enumerate(passes):
        raw_reads.append(raw_consume_rate(conn, topic, events))
        if i == 0:
            msgs0, rows0 = gradient_counts()
        worker_rates.append(worker_pass(c, events))
        if i == 0:
            # param_server_rate applies the first pass's gradients
            msgs1, rows1 = gradient_counts()
            first = (msgs1 - msgs0, rows1 - rows0)
        progress.done(
            f"pass {i + 1}: raw consume {raw_reads[-1]:,.0f} events/s, "
            f"worker event path {worker_rates[-1]:,.0f} events/s"
        )
    return raw_reads, worker_rates, first


def param_server_rate(conn, grad_rows: float) -> float:
    """Rows/s a parameter server in this process applies and persists over the gradient
    messages just produced (``grad_rows`` rows), from the first rows it applied."""
    ps = ParameterServer(ParamServerSettings(conn, dim=64))
    stop = threading.Event()
    t = threading.Thread(target=ps.run, args=(stop,), daemon=True)
    # the counters' own values, as in worker_pass: a registry collect every 20 ms took the
    # GIL from the server thread being measured
    users, items = PS_ROWS_APPLIED.labels("user"), PS_ROWS_APPLIED.labels("item")
    before = users._value.get() + items._value.get()
    t.start()
    start = None
    while True:
        applied = users._value.get() + items._value.get() - before
        if applied and start is None:
            start = (time.perf_counter(), applied)
        if applied >= grad_rows:
            break
        time.sleep(0.02)
    while ps.unpersisted_rows:
        time.sleep(0.01)
    ps_rate = (grad_rows - start[1]) / (time.perf_counter() - start[0])
    stop.set()
    t.join(30)
    return ps_rate


# ------------------------------------------------------------------------------------- lag
def freshness_lag(world, args, progress: ProgressLine) -> dict:
    """Freshness lag per stage at ``--rate`` after a ramp, with the worker and the parameter
    server as their own processes, beside the floor a plain consumer sees."""
    # the lag phase sends events encoded ahead of time, stamped as they are sent: generating
    # them on the fly would take a quarter of the machine away from what is measured
    steady = prepare_events(world, int(args.rate * (args.duration + args.ramp)), seed=2)
    ramp, steady = steady[: int(args.rate * args.ramp)], steady[int(args.rate * args.ramp) :]
    with bench_connection(f"br{int(time.time())}.") as conn:
        floor = raw_lag(conn, steady, args.rate, ramp=ramp, linger_ms=args.producer_linger_ms)
        progress.done(
            f"raw Kafka lag (plain consumer): p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms"
        )
    with bench_connection(f"bf{int(time.time())}.") as conn:
        base, after, stats, alongside = pipeline_lag(conn, world, ramp, steady, args, progress)
    lag = {
        stage: p50_p99(base, after, "freshrec_freshness_lag_seconds", stage=stage)
        for stage in ("local", "global_applied", "served")
    }
    # where the local lag goes: the broker and the fetch (Kafka timestamp -> the
    # worker's consume returns it) vs the worker's own loop, phase by phase
    lag["worker_fetch"] = p50_p99(base, after, "freshrec_worker_fetch_lag_seconds")
    loop = {
        phase: p50_p99(base, after, "freshrec_worker_loop_seconds", 2, phase=phase)
        for phase in LOOP_PHASES
    }
    return {
        "rate_events_per_s": args.rate,
        "duration_s": args.duration,
        "events": stats.delivered,
        "ramp_s": args.ramp,
        "note": "worker and parameter server as separate processes; measured after a ramp "
        "at the full rate; histogram buckets; "
        "raw_kafka: the same events read by a plain consumer on a fresh broker; "
        "raw_kafka_alongside: read by a plain consumer in its own process beside the "
        "pipeline, on its broker; worker_fetch: Kafka timestamp -> the worker's consume "
        "returns the event; worker_loop_phases: time of each phase of a loop round",
        "raw_kafka": floor,
        "raw_kafka_alongside": alongside,
        **lag,
        "worker_loop_phases": loop,
    }


def pipeline_lag(conn, world, ramp: list, steady: list, args, progress: ProgressLine):
    """The ramp, then the measured events, through a worker and a parameter server as their
    own processes: both services' metrics before and after the measured phase, the phase's
    delivery figures, and (``--alongside``) what a plain consumer beside them waited."""
    # worker and parameter server as their own processes, as in production
    wport, pport = free_port(), free_port()
    env = {"FRESHREC_EMBEDDING_DIM": "64"}
    probe = AlongsideProbe(conn) if args.alongside else None
    with (
        service_process(conn, "worker", wport, env),
        service_process(conn, "param-server", pport, env),
    ):
        if probe:
            probe.process.start()
        produce_events(conn, world, rate_per_s=200, duration_s=2.0, seed=1)  # warm-up (joins)
        deadline = time.monotonic() + 60
        while total(scrape_port(pport), "freshrec_ps_rows_applied_total") == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the parameter server applied nothing within 60 s")
            time.sleep(0.2)
        # the lag is measured at a steady rate: the jump from nothing to the full rate
        # (new users' rows loaded or created at once, tables growing) comes first
        # one producer for the ramp and the measured phase (see events_producer)
        producer = events_producer(conn, args.producer_linger_ms)
        produce_prepared(
            conn, ramp, rate_per_s=args.rate, label="ramp", progress=progress, producer=producer
        )
        time.sleep(1)
        base = merge(scrape_port_now(wport), scrape_port_now(pport))
        measured_from = time.time() * 1000
        stats = produce_prepared(
            conn, steady, rate_per_s=args.rate, progress=progress, producer=producer
        )
        close_producer(producer, 10)  # before its broker stops
        time.sleep(3)
        after = merge(scrape_port_now(wport), scrape_port_now(pport))
        if probe:
            probe.stop.set()
            probe.process.join(30)
    alongside = None
    if probe:
        alongside = probe.summary(measured_from)
        progress.done(
            f"plain consumer beside the pipeline: p50 {alongside['p50_ms']} "
            f"ms, p99 {alongside['p99_ms']} ms"
        )
    return base, after, stats, alongside


class AlongsideProbe:
    """``--alongside``: a plain consumer in its own process reads the same events beside the
    pipeline: the broker's share of the lag under the pipeline's load (raw_kafka is on a
    fresh, idle broker). It loads the machine itself (a consumer polling every 5 ms costs
    the embedded broker ~18% of a core), so it is off by default."""

    def __init__(self, conn) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.stop, self.out = spawn.Event(), f"{tempfile.mkdtemp()}/alongside.npy"
        self.process = spawn.Process(target=lag_alongside, args=(conn, self.stop, self.out))

    def summary(self, measured_from: float) -> dict:
        """The lag of the events stamped from ``measured_from`` (ms) on."""
        sent, lags = np.load(self.out)
        return lag_summary(lags[sent >= measured_from], sent[sent >= measured_from])


if __name__ == "__main__":
    main()
