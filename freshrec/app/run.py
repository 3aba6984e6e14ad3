"""``freshrec run``: the whole pipeline on the embedded stack (or on existing services), with
the synthetic world's traffic in a closed loop."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from freshcore.declare import declaration
from freshcore.lifecycle import set_from_signal
from freshcore.settings import (
    BOOTSTRAP_SERVERS,
    REDIS_URL,
    ConnectionSettings,
    SettingsError,
    load_environment,
    state_dir,
)
from freshrec.app.commands import provision_topics, start_dashboard
from freshrec.app.options import EnvDefault, add_world_options
from freshrec.app.settings import EVENT_RATE, REQUEST_RATE
from freshrec.app.stack import (
    BrokerChoice,
    EmbeddedStack,
    StackError,
    external_services,
    free_port,
)
from freshrec.app.stack.commands import add_broker_options, chosen_broker
from freshrec.app.supervisor import ServiceDied, ServiceGroup
from freshrec.app.training import (
    ensure_models,
    load_starting_embeddings,
    model_dir,
    served_rankers,
)
from freshrec.cost import CORE_HOUR_PRICE, GPU_HOUR_PRICE
from freshrec.progress import ProgressLine

if TYPE_CHECKING:
    from freshrec.sim.closedloop import LoopStats
    from freshrec.sim.produce import ProduceStats

log = logging.getLogger("freshrec")


def add_parser(sub) -> None:
    """``freshrec run`` and its options."""
    run = sub.add_parser("run", help="the whole pipeline on the embedded stack, with traffic")
    _add_traffic_options(run)
    _add_service_options(run)
    add_broker_options(run)
    _add_cost_options(run)
    run.add_argument(
        "--train-impressions",
        type=int,
        default=None,
        help="impressions for offline training when no models are cached "
        "(default: 10 per item, 50k to 1M)",
    )
    # 20k items: with 100k everything still runs on two cores, but most replies come from
    # the hot tier (see docs/benchmarks.md); `--items 100000` runs the larger world
    add_world_options(run, items=20_000)
    run.set_defaults(func=cmd_run)


def _add_traffic_options(run: argparse.ArgumentParser) -> None:
    """How long the run lasts and how much traffic the synthetic world sends."""
    run.add_argument(
        "--duration", type=float, default=None, help="seconds to run (default: until Ctrl-C)"
    )
    run.add_argument(
        "--rate",
        type=float,
        action=EnvDefault,
        setting=EVENT_RATE,
        help="background synthetic events per second",
    )
    run.add_argument(
        "--requests",
        type=float,
        action=EnvDefault,
        setting=REQUEST_RATE,
        help="closed-loop recommendation requests per second",
    )


def _add_service_options(run: argparse.ArgumentParser) -> None:
    """How many workers, serving what, on which Redis, with the dashboard where."""
    run.add_argument("--workers", type=int, default=1, help="inference workers to start")
    run.add_argument(
        "--experiment",
        type=Path,
        default=None,
        metavar="FILE",
        help="run the workers with this A/B experiment (examples/experiments.toml) and print "
        "its report at the end",
    )
    run.add_argument(
        "--mode",
        default=None,
        help="the serving mode the workers start in (daily, promo, acquisition; default "
        "FRESHREC_MODE or daily); `freshrec mode set NAME` switches it while running",
    )
    run.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="run on an embedded Redis Cluster of N masters instead of one Redis server",
    )
    run.add_argument(
        "--dashboard-port",
        type=int,
        default=8050,
        help="port of the built-in dashboard (0: any free port)",
    )


def _add_cost_options(run: argparse.ArgumentParser) -> None:
    """The prices the summary's cost per 1,000 requests is reckoned at."""
    run.add_argument(
        "--core-hour-price",
        type=float,
        default=CORE_HOUR_PRICE,
        help="USD per core-hour, for the summary's cost per 1,000 requests "
        f"(default {CORE_HOUR_PRICE}: an assumption, replace it with yours)",
    )
    run.add_argument(
        "--gpu-hour-price",
        type=float,
        default=GPU_HOUR_PRICE,
        help="USD per GPU-hour, for the workers that hold a GPU "
        f"(default {GPU_HOUR_PRICE}: an assumption, replace it with yours)",
    )


@dataclass
class RunContext:
    conn: ConnectionSettings
    owned_stack: EmbeddedStack | None

    @property
    def conn_env(self) -> dict[str, str]:
        """The variables that point child services at this run's Kafka and Redis."""
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.conn.kafka_bootstrap_servers,
            "REDIS_URL": self.conn.redis_url,
            "FRESHREC_TOPIC_PREFIX": self.conn.topic_prefix,
            "FRESHREC_KAFKA_PROFILE": self.conn.kafka_profile,
        }


@contextlib.contextmanager
def running_stack(
    redis_cluster: int = 0, broker: BrokerChoice | None = None, brokers: int = 1
) -> Iterator[RunContext]:
    """Use external services if set, else start an embedded stack owned by this run (on
    ``broker``, with ``brokers`` nodes of it; with a ``redis_cluster``-master Redis Cluster
    where it is not 0)."""
    if external_services():
        if redis_cluster or brokers > 1:
            raise StackError(
                "--redis-cluster and --brokers start an embedded cluster, but "
                "KAFKA_BOOTSTRAP_SERVERS and REDIS_URL name existing services: unset them, or "
                "name a cluster in REDIS_URL"
            )
        yield RunContext(ConnectionSettings.from_env(load_environment()), None)
        return
    stack = EmbeddedStack(state_dir() / "run")
    if stack.running():
        raise StackError(
            f"another `freshrec run` owns {stack.state_dir}; stop it first "
            f"(or `FRESHREC_HOME={stack.state_dir} freshrec stack down`)"
        )
    started = time.monotonic()
    state = stack.up(detach=False, redis_cluster=redis_cluster, broker=broker, brokers=brokers)
    log.info(
        "embedded stack up in %.1fs: Kafka %s, Redis %s",
        time.monotonic() - started,
        BOOTSTRAP_SERVERS.read(state.env),
        REDIS_URL.read(state.env),
    )
    try:
        env = dict(os.environ)
        env.update(state.env)
        yield RunContext(ConnectionSettings.from_env(env), stack)
    finally:
        stopped = stack.down()
        log.info("embedded stack stopped (%s)", ", ".join(stopped) or "already gone")


@dataclass(frozen=True)
class LoadStart:
    """Where the load began: the services' CPU and counts, the services that hold a GPU, and
    when. The cost per 1,000 requests is of what the services used from here on."""

    used: tuple[dict[str, float], tuple[float, float]]
    held_gpu: list[str]
    at: float


@dataclass(frozen=True)
class RunOutcome:
    """What the run's traffic came to: the background events' and the closed loop's figures,
    the services' summary, and the signals that stopped it (none: ``--duration`` did)."""

    events: ProduceStats
    loop: LoopStats
    summary: str
    interrupted: list[int]


def cmd_run(args: argparse.Namespace) -> int:
    from freshrec.app.options import world_from_args
    from freshrec.app.runstatus import wait_until_assigned
    from freshrec.sim.produce import produce_items
    from inference.training.train import TrainConfig

    # the first line: which broker runs, and why (the jars fetched first if need be)
    broker = None if external_services() else chosen_broker(args.broker)
    world = world_from_args(args)
    progress = ProgressLine()
    run_env, rankings = _experiment_and_mode(args)
    models = model_dir()
    impressions = args.train_impressions or min(1_000_000, max(50_000, 10 * world.config.n_items))
    config = TrainConfig(impressions=impressions, rankers=served_rankers(rankings))
    manifest = ensure_models(world, models, config, progress)
    with running_stack(args.redis_cluster, broker, args.brokers) as ctx:
        provision_topics(ctx.conn)
        rows = load_starting_embeddings(ctx.conn, models, manifest)
        log.info(
            "starting embeddings: %s rows written to Redis (trained %s)",
            f"{rows:,}",
            manifest["version"],
        )
        services = ServiceGroup(
            _service_env(ctx, models, manifest, run_env), state_dir() / "run" / "logs"
        )
        try:
            ports = _start_services(services, args.workers)
            produce_items(ctx.conn, world, progress)

            def waiting(names: list[str]) -> None:
                services.check()  # a service that died will never join
                progress.update(f"waiting for {', '.join(names)} to join")

            wait_until_assigned(ports, 120, waiting)
            outcome = _run_traffic(ctx, world, services, ports, args, progress)
            if services.failure:
                raise services.failure
        finally:
            services.stop_all()
    stats = outcome.events
    print(
        f"run finished: {stats.delivered:,} background events delivered in {stats.elapsed_s:.1f}s "
        f"({stats.rate_per_s:,.0f}/s), {stats.failed} failed\n"
        f"closed loop: {outcome.loop.final()}\n{outcome.summary}"
    )
    if outcome.interrupted:
        return 130
    return 0 if stats.failed == 0 and (args.requests == 0 or outcome.loop.replied > 0) else 1


def _experiment_and_mode(args: argparse.Namespace) -> tuple[dict[str, str], list]:
    """The settings ``--experiment`` and ``--mode`` give the services, and the rankings the
    experiment's variants serve (the models to train); checked before anything starts."""
    run_env = {}
    rankings = []
    if args.experiment:
        from inference.serving.experiments import load

        # a bad file stops the run here, naming the line
        rankings = [v.ranking for v in load(args.experiment).variants]
        run_env["FRESHREC_EXPERIMENTS_FILE"] = str(args.experiment.resolve())
    if args.mode:
        from inference.serving.modes import declared_modes

        modes = declared_modes(os.environ)
        if args.mode not in modes:  # an unknown mode stops the run here, naming them
            raise SettingsError(f"--mode {args.mode!r}: one of {', '.join(sorted(modes))}")
        run_env["FRESHREC_MODE"] = args.mode
    return run_env, rankings


def _service_env(ctx: RunContext, models: Path, manifest: dict, run_env: dict[str, str]) -> dict:
    """The environment of the run's services: this one, the run's stack, its models."""
    from inference.settings import WorkerSettings

    return {
        **os.environ,
        **ctx.conn_env,
        "FRESHREC_MODEL_DIR": str(models),
        "FRESHREC_EMBEDDING_DIM": str(manifest["dim"]),
        # the synthetic world's users click the same items again (its click model
        # ignores what they clicked before): a repeat-consumption domain, unless the
        # environment says otherwise
        "FRESHREC_EXCLUDE_SEEN": str(
            declaration(WorkerSettings, "exclude_seen").read(os.environ, False)
        ).lower(),
        **run_env,
    }


def _start_services(services: ServiceGroup, workers: int) -> dict[str, int]:
    """The streams app, the parameter server and ``workers`` workers started, each with a
    metrics port of its own; returns the ports by service name."""
    ports = {"streams": free_port(), "param-server": free_port()}
    for n in range(workers):
        ports[f"worker-{n}" if workers > 1 else "worker"] = free_port()
    for name, port in ports.items():
        command = "worker" if name.startswith("worker") else name
        services.start(name, command, FRESHREC_METRICS_PORT=str(port), FRESHREC_WORKER_ID=name)
    return ports


def _run_traffic(ctx, world, services, ports, args, progress: ProgressLine) -> RunOutcome:
    """The run proper: the dashboard, the closed loop and the background events until
    ``--duration`` ends or Ctrl-C, then the services' summary."""
    from freshrec.app.observe import targets_file, write_targets
    from freshrec.app.runstatus import StatusPoller, counts, gpu_services, service_cpu
    from freshrec.sim.closedloop import ClosedLoop
    from freshrec.sim.produce import produce_events

    targets = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    write_targets(state_dir(), targets)
    dashboard = start_dashboard(targets, "127.0.0.1", args.dashboard_port)
    progress.done(f"dashboard: {dashboard.url}  (terminal: freshrec top)")
    stop = threading.Event()
    interrupted = _stop_on_signals(stop)
    watcher = threading.Thread(
        target=_watch_services, args=(services, stop), daemon=True, name="watch"
    )
    watcher.start()
    # the services' CPU from here on is the load's: the cost per 1,000 requests
    start = LoadStart(
        (service_cpu(services.children), counts(ports)), gpu_services(ports), time.monotonic()
    )
    loop = ClosedLoop(ctx.conn, world, args.requests, seed=args.seed)
    loop_thread = loop.run_in_thread(stop) if args.requests > 0 else None
    try:
        with StatusPoller(ports) as status:
            stats = produce_events(
                ctx.conn,
                world,
                rate_per_s=args.rate,
                duration_s=args.duration,
                stop=stop,
                progress=progress,
                seed=args.seed,
                suffix=lambda: f"{loop.stats.line()} | {status.text}",
                label="background events",
            )
            stop.set()
            if loop_thread:
                loop_thread.join(15)
            time.sleep(2.5)  # let the services drain the last events
            final = _summary(ctx.conn, services, ports, start, args)
    finally:
        stop.set()
        dashboard.stop()
        targets_file(state_dir()).unlink(missing_ok=True)
    return RunOutcome(stats, loop.stats, final, interrupted)


def _summary(conn, services: ServiceGroup, ports, start: LoadStart, args) -> str:
    """The services' figures at the end of the run, the cost of the load since ``start``
    and, with ``--experiment``, the experiment's report."""
    from freshrec.app.runstatus import cost_line, counts, ranking_line, service_cpu, summary

    final = summary(ports)
    span = time.monotonic() - start.at
    cost = cost_line(
        start.used,
        (service_cpu(services.children), counts(ports)),
        args.core_hour_price,
        dict.fromkeys(start.held_gpu, span),
        args.gpu_hour_price,
    )
    if cost:
        final += "\n" + cost
    ranking = ranking_line(ports)
    if ranking:
        final += "\n" + ranking
    if args.experiment:
        from freshrec.app.abreport import read_from, render

        final += "\n" + render(read_from(conn))
    return final


def _stop_on_signals(stop: threading.Event) -> list[int]:
    """From here on Ctrl-C (or SIGTERM) sets ``stop``: the run winds down the way it does at
    the end of ``--duration`` and prints its summary. A KeyboardInterrupt raised wherever the
    main thread happened to be could leave a lock held that the clean-up then waits for
    (``stop``'s own, inside ``Event.wait``: the run hung on Ctrl-C). Returns the list of
    signals received."""
    received: list[int] = []

    def handler(signum, frame) -> None:
        if not received:
            os.write(2, b"\ninterrupted: stopping (the summary follows)\n")
        received.append(signum)
        set_from_signal(stop)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return received


def _watch_services(services: ServiceGroup, stop: threading.Event) -> None:
    """Stop the run when a service dies, keeping the reason for the exit message."""
    while not stop.wait(0.5):
        try:
            services.check()
        except ServiceDied as exc:
            services.failure = exc
            stop.set()
