"""What each ``freshrec`` subcommand does; argument parsing lives in ``cli.py``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from freshrec.progress import ProgressLine
from freshrec.settings import ConnectionSettings, load_environment, state_dir
from freshrec.stack import EmbeddedStack, StackError, external_services
from freshrec.supervisor import ServiceDied, ServiceGroup

log = logging.getLogger("freshrec")


def connection() -> ConnectionSettings:
    """Connection settings for commands that need a running stack."""
    env = load_environment()
    if not external_services() and "KAFKA_BOOTSTRAP_SERVERS" not in env:
        raise StackError(
            "no stack is running: start one with `freshrec stack up`, or set "
            "KAFKA_BOOTSTRAP_SERVERS and REDIS_URL"
        )
    return ConnectionSettings.from_env(env)


def provision_topics(conn: ConnectionSettings) -> None:
    from confluent_kafka.admin import AdminClient

    from freshrec.kafka import admin_config
    from freshrec.topics import catalogue_with, ensure_topics, partitions_from_env

    specs = catalogue_with(partitions_from_env(os.environ))
    report = ensure_topics(AdminClient(admin_config(conn)), conn.topic_prefix, specs)
    if report.created:
        log.info("topics created: %s", ", ".join(report.created))
    if report.existing:
        log.info("topics already present: %d", len(report.existing))


# --------------------------------------------------------------------------------- stack


def cmd_stack_up(args: argparse.Namespace) -> int:
    if external_services():
        print("KAFKA_BOOTSTRAP_SERVERS and REDIS_URL are set: using them, starting nothing")
        return 0
    stack = EmbeddedStack(state_dir())
    stack.up(kafka_port=args.kafka_port, redis_port=args.redis_port, timeout_s=args.timeout)
    print(stack.status())
    print(f"settings written to {stack.env_path}")
    return 0


def cmd_stack_down(args: argparse.Namespace) -> int:
    stopped = EmbeddedStack(state_dir()).down()
    print("stopped: " + ", ".join(stopped) if stopped else "nothing was running")
    return 0


def cmd_stack_status(args: argparse.Namespace) -> int:
    if external_services():
        conn = ConnectionSettings.from_env(os.environ)
        print(f"external: KAFKA_BOOTSTRAP_SERVERS={conn.kafka_bootstrap_servers}")
        print(f"external: REDIS_URL={conn.redis_url}")
        return 0
    print(EmbeddedStack(state_dir()).status())
    return 0


# -------------------------------------------------------------------------------- topics


def cmd_topics_create(args: argparse.Namespace) -> int:
    provision_topics(connection())
    return 0


def cmd_topics_list(args: argparse.Namespace) -> int:
    from freshrec.topics import CATALOGUE, partitions_from_env

    prefix = load_environment().get("FRESHREC_TOPIC_PREFIX", "")
    overrides = partitions_from_env(os.environ)
    for spec in CATALOGUE:
        n = overrides.get(spec.name, spec.partitions)
        print(f"{prefix + spec.name:28} partitions={n:<3} key={spec.key}")
    return 0


# ------------------------------------------------------------------------------ services


def cmd_streams(args: argparse.Namespace) -> int:
    from streams.app import run_streams
    from streams.settings import StreamsSettings

    env = load_environment()
    connection()  # fail early, with the one-line reason, when no stack is configured
    return run_streams(StreamsSettings.from_env(env))


def cmd_worker(args: argparse.Namespace) -> int:
    from inference.settings import WorkerSettings
    from inference.worker import run_worker

    env = load_environment()
    connection()
    return run_worker(WorkerSettings.from_env(env))


def cmd_param_server(args: argparse.Namespace) -> int:
    from param_server.server import run_param_server
    from param_server.settings import ParamServerSettings

    env = load_environment()
    connection()
    return run_param_server(ParamServerSettings.from_env(env))


# ------------------------------------------------------------------------------- produce


def cmd_produce_items(args: argparse.Namespace) -> int:
    from freshrec.cli import world_from_args
    from tools.produce import produce_items

    produce_items(connection(), world_from_args(args), ProgressLine())
    return 0


def cmd_produce_events(args: argparse.Namespace) -> int:
    from freshrec.cli import world_from_args
    from tools.produce import produce_events

    stats = produce_events(
        connection(),
        world_from_args(args),
        rate_per_s=args.rate,
        duration_s=args.duration,
        progress=ProgressLine(),
    )
    return 0 if stats.failed == 0 else 1


# ---------------------------------------------------------------------- dashboard, top


def _observer_targets(spec: str | None) -> dict[str, str]:
    from freshrec.observe import parse_targets, read_targets

    targets = parse_targets(spec) if spec else read_targets(state_dir())
    if not targets:
        raise StackError(
            "no services to watch: start `freshrec run`, or pass --targets "
            "worker=localhost:9101,streams=localhost:9100,param-server=localhost:9102"
        )
    return targets


def start_dashboard(targets: dict[str, str], host: str, port: int):
    """The dashboard on ``port``, or on a free port when that one is taken."""
    from freshrec.dashboard import DashboardServer
    from freshrec.observe import Observer

    try:
        return DashboardServer(Observer(targets), host, port).start()
    except OSError:
        log.info("port %d is taken: the dashboard takes a free one", port)
        return DashboardServer(Observer(targets), host, 0).start()


def cmd_dashboard(args: argparse.Namespace) -> int:
    server = start_dashboard(_observer_targets(args.targets), args.host, args.port)
    print(f"dashboard: {server.url} (Ctrl-C stops)", flush=True)
    try:
        if args.duration is not None:
            time.sleep(args.duration)
        else:
            threading.Event().wait()
    finally:
        server.stop()
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from freshrec.observe import Observer
    from freshrec.top import run_top

    observer = Observer(_observer_targets(args.targets))
    if args.once:
        observer.sample()
        time.sleep(args.interval)
        run_top(observer, args.interval, iterations=1)
    else:
        run_top(observer, args.interval)
    return 0


# ------------------------------------------------------------------------- train, recommend


def model_dir(args_out: str | None = None) -> Path:
    from inference.settings import default_model_dir

    env = load_environment()
    return Path(args_out or env.get("FRESHREC_MODEL_DIR") or default_model_dir(env))


def ensure_models(world, directory: Path, config, progress: ProgressLine) -> dict:
    """The manifest of models trained on this world with this ``TrainConfig``; trains them
    when there are none (models of another world, or trained by another configuration — an
    older release's included — are replaced)."""
    from dataclasses import asdict

    from inference.modelfile import ModelFileError, read_manifest
    from inference.train import train, world_fingerprint

    try:
        manifest = read_manifest(directory)
        same_world = manifest.get("world") == world_fingerprint(world)
        same_config = manifest.get("training", {}).get("config") == asdict(config)
        if same_world and same_config:
            log.info(
                "models %s found in %s (this world, this configuration)",
                manifest["version"],
                directory,
            )
            return manifest
        why = "on another world" if not same_world else "with another training configuration"
        log.info("models in %s were trained %s: training again", directory, why)
    except ModelFileError:
        log.info("no models in %s yet: training (a minute or two, cached afterwards)", directory)
    started = time.monotonic()
    manifest = train(world, config, directory, progress.update)
    t = manifest["training"]
    progress.done(
        f"trained {manifest['version']} in {time.monotonic() - started:.0f}s: AUC two-tower "
        f"{t['auc_two_tower']:.3f}, wide&deep {t['auc_wide_deep']:.3f}, light {t['auc_light']:.3f}"
    )
    return manifest


def load_starting_embeddings(conn: ConnectionSettings, directory: Path, manifest: dict) -> int:
    """Write the trained two-tower rows to Redis where no row exists yet."""
    import redis

    from freshrec.rediskeys import RedisKeys
    from inference.modelfile import load_tensors
    from param_server.rows import TABLE_ITEM, TABLE_USER
    from param_server.store import seed_rows

    tensors = load_tensors(directory, manifest["files"]["two_tower"])
    r = redis.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    written = 0
    try:
        for table, ids, rows in (
            (TABLE_ITEM, "item_ids", "item_rows"),
            (TABLE_USER, "user_ids", "user_rows"),
        ):
            written += seed_rows(
                r,
                keys,
                table,
                tensors[ids].numpy(),
                tensors[rows].numpy(),
                version=1,
                event_ms=int(manifest["created_ms"]),
            )
    finally:
        r.close()
    return written


def cmd_train(args: argparse.Namespace) -> int:
    from freshrec.cli import world_from_args
    from inference.modelfile import read_manifest
    from inference.train import TrainConfig, train

    world = world_from_args(args)
    directory = model_dir(args.out)
    progress = ProgressLine()
    try:
        config = TrainConfig(
            impressions=args.impressions,
            l2=args.l2,
            tower_share=args.tower_share,
            tower_epochs=args.tower_epochs,
        )
    except ValueError as exc:
        raise SystemExit(f"freshrec train: {exc}") from None
    if args.if_missing:
        manifest = ensure_models(world, directory, config, progress)
    else:
        manifest = train(world, config, directory, progress.update)
        t = manifest["training"]
        progress.done(
            f"trained {manifest['version']}: AUC two-tower {t['auc_two_tower']:.3f}, "
            f"wide&deep {t['auc_wide_deep']:.3f}, light {t['auc_light']:.3f} "
            f"({t['impressions']:,} impressions, {t['seconds']}s)"
        )
    print(f"models: {directory / 'manifest.json'} (version {read_manifest(directory)['version']})")
    load = args.load == "yes" or (
        args.load == "auto"
        and (external_services() or "KAFKA_BOOTSTRAP_SERVERS" in load_environment())
    )
    if load:
        n = load_starting_embeddings(connection(), directory, manifest)
        print(f"starting embeddings: {n:,} rows written to Redis (existing rows kept)")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from inference.client import SyncRecommendClient

    conn = connection()
    context = {k: v for k, v in (("device", args.device), ("region", args.region)) if v}
    exclude = [x for x in args.exclude.split(",") if x]
    with SyncRecommendClient(
        conn.kafka_bootstrap_servers,
        topic_prefix=conn.topic_prefix,
        timeout_s=args.timeout,
        profile=conn.kafka_profile,
    ) as client:
        started = time.monotonic()
        reply = client.recommend(args.user, args.k, context=context or None, exclude=exclude)
        elapsed = (time.monotonic() - started) * 1000
    if args.json:
        print(json.dumps(asdict(reply), indent=2))
        return 0
    print(format_reply(reply, elapsed))
    return 0


def format_reply(reply, elapsed_ms: float) -> str:
    lines = [
        f"user {reply.user_id}: {len(reply.items)} items, tier {reply.tier} ({reply.tier_reason}),"
        f" model {reply.model_version or '-'}, worker {reply.worker or '-'}",
        f"user embedding v{reply.user_embedding_version} "
        f"age {_age(reply.user_embedding_age_ms)}; round trip {elapsed_ms:.1f} ms; "
        + ", ".join(f"{k} {v:.1f}" for k, v in (reply.timings_ms or {}).items()),
        f"{'#':>3}  {'item':<12} {'score':>8}  channels",
    ]
    for n, item in enumerate(reply.items, 1):
        lines.append(f"{n:>3}  {item.item_id:<12} {item.score:>8.4f}  {','.join(item.channels)}")
    return "\n".join(lines)


def _age(ms: int | None) -> str:
    if ms is None:
        return "- (initial row)"
    return f"{ms / 1000:.1f}s" if ms < 120_000 else f"{ms / 60_000:.0f}min"


# ----------------------------------------------------------------------------------- run


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
def running_stack() -> Iterator[RunContext]:
    """Use external services if set, else start an embedded stack owned by this run."""
    if external_services():
        yield RunContext(ConnectionSettings.from_env(load_environment()), None)
        return
    stack = EmbeddedStack(state_dir() / "run")
    if stack.running():
        raise StackError(
            f"another `freshrec run` owns {stack.state_dir}; stop it first "
            f"(or `FRESHREC_HOME={stack.state_dir} freshrec stack down`)"
        )
    started = time.monotonic()
    state = stack.up(detach=False)
    log.info(
        "embedded stack up in %.1fs: Kafka %s, Redis %s",
        time.monotonic() - started,
        state.env["KAFKA_BOOTSTRAP_SERVERS"],
        state.env["REDIS_URL"],
    )
    try:
        env = dict(os.environ)
        env.update(state.env)
        yield RunContext(ConnectionSettings.from_env(env), stack)
    finally:
        stopped = stack.down()
        log.info("embedded stack stopped (%s)", ", ".join(stopped) or "already gone")


def cmd_run(args: argparse.Namespace) -> int:
    from freshrec.cli import world_from_args
    from freshrec.runstatus import StatusPoller, summary, wait_until_assigned
    from freshrec.stack import free_port
    from inference.train import TrainConfig
    from tools.closedloop import ClosedLoop
    from tools.produce import produce_events, produce_items

    world = world_from_args(args)
    progress = ProgressLine()
    models = model_dir()
    impressions = args.train_impressions or min(1_000_000, max(50_000, 10 * world.config.n_items))
    manifest = ensure_models(world, models, TrainConfig(impressions=impressions), progress)
    with running_stack() as ctx:
        provision_topics(ctx.conn)
        rows = load_starting_embeddings(ctx.conn, models, manifest)
        log.info(
            "starting embeddings: %s rows written to Redis (trained %s)",
            f"{rows:,}",
            manifest["version"],
        )
        services = ServiceGroup(
            {
                **os.environ,
                **ctx.conn_env,
                "FRESHREC_MODEL_DIR": str(models),
                "FRESHREC_EMBEDDING_DIM": str(manifest["dim"]),
            },
            state_dir() / "run" / "logs",
        )
        try:
            ports = {"streams": free_port(), "param-server": free_port()}
            for n in range(args.workers):
                ports[f"worker-{n}" if args.workers > 1 else "worker"] = free_port()
            for name, port in ports.items():
                command = "worker" if name.startswith("worker") else name
                services.start(
                    name, command, FRESHREC_METRICS_PORT=str(port), FRESHREC_WORKER_ID=name
                )
            produce_items(ctx.conn, world, progress)

            def waiting(names: list[str]) -> None:
                services.check()  # a service that died will never join
                progress.update(f"waiting for {', '.join(names)} to join")

            wait_until_assigned(ports, 120, waiting)
            from freshrec.observe import targets_file, write_targets

            targets = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
            write_targets(state_dir(), targets)
            dashboard = start_dashboard(targets, "127.0.0.1", args.dashboard_port)
            progress.done(f"dashboard: {dashboard.url}  (terminal: freshrec top)")
            stop = threading.Event()
            watcher = threading.Thread(
                target=_watch_services, args=(services, stop), daemon=True, name="watch"
            )
            watcher.start()
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
                    final = summary(ports)
            finally:
                stop.set()
                dashboard.stop()
                targets_file(state_dir()).unlink(missing_ok=True)
            if services.failure:
                raise services.failure
        finally:
            services.stop_all()
    print(
        f"run finished: {stats.delivered:,} background events delivered in {stats.elapsed_s:.1f}s "
        f"({stats.rate_per_s:,.0f}/s), {stats.failed} failed\n"
        f"closed loop: {loop.stats.final()}\n{final}"
    )
    return 0 if stats.failed == 0 and (args.requests == 0 or loop.stats.replied > 0) else 1


def _watch_services(services: ServiceGroup, stop: threading.Event) -> None:
    """Stop the run when a service dies, keeping the reason for the exit message."""
    while not stop.wait(0.5):
        try:
            services.check()
        except ServiceDied as exc:
            services.failure = exc
            stop.set()
