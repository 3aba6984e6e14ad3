"""The ``freshrec`` commands that need little more than a connection: topics, producing the
synthetic world, the services, the dashboard and ``top``, ``recommend``; each with its
parser. The connection settings every command uses (``connection``) live here too."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time

from freshcore.settings import (
    STACK_ENV_FILE,
    ConnectionSettings,
    load_environment,
    read_env_file,
    state_dir,
)
from freshrec.app.options import add_world_options
from freshrec.app.stack import StackError, external_services
from freshrec.progress import ProgressLine

log = logging.getLogger("freshrec")


def connection(during_run: bool = False) -> ConnectionSettings:
    """Connection settings for commands that need a running stack (``during_run``: or the
    stack of a ``freshrec run`` going on in this directory)."""
    env = load_environment()
    if during_run and not external_services() and "KAFKA_BOOTSTRAP_SERVERS" not in env:
        env = {**read_env_file(state_dir() / "run" / STACK_ENV_FILE), **env}
    if not external_services() and "KAFKA_BOOTSTRAP_SERVERS" not in env:
        raise StackError(
            "no stack is running: start one with `freshrec stack up`, or set "
            "KAFKA_BOOTSTRAP_SERVERS and REDIS_URL"
        )
    return ConnectionSettings.from_env(env)


def provision_topics(conn: ConnectionSettings) -> None:
    from confluent_kafka.admin import AdminClient

    from freshcore.kafka import admin_config
    from freshcore.topics import catalogue_with, ensure_topics, partitions_from_env

    specs = catalogue_with(partitions_from_env(os.environ))
    report = ensure_topics(AdminClient(admin_config(conn)), conn.topic_prefix, specs)
    if report.created:
        log.info("topics created: %s", ", ".join(report.created))
    if report.existing:
        log.info("topics already present: %d", len(report.existing))


def add_topics_parser(sub) -> None:
    """``freshrec topics`` and its actions."""
    topics = sub.add_parser("topics", help="the topic catalogue")
    topics_sub = topics.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = topics_sub.add_parser("create", help="create missing topics (idempotent)")
    create.add_argument(
        "--acls",
        action="store_true",
        help="also grant each service's Kafka user what it needs (freshrec/acls.py; run as a "
        "user that may alter ACLs)",
    )
    create.set_defaults(func=cmd_topics_create)
    topics_sub.add_parser("list", help="print the catalogue").set_defaults(func=cmd_topics_list)


def cmd_topics_create(args: argparse.Namespace) -> int:
    conn = connection()
    provision_topics(conn)
    if args.acls:
        from confluent_kafka.admin import AdminClient

        from freshcore.kafka import admin_config
        from freshrec.acls import apply_acls

        n = apply_acls(AdminClient(admin_config(conn)), conn.topic_prefix)
        log.info("ACLs: %d grants for the streams, worker, param-server and client users", n)
    return 0


def cmd_topics_list(args: argparse.Namespace) -> int:
    from freshcore.topics import CATALOGUE, partitions_from_env

    prefix = ConnectionSettings.from_env(load_environment()).topic_prefix
    overrides = partitions_from_env(os.environ)
    for spec in CATALOGUE:
        n = overrides.get(spec.name, spec.partitions)
        print(f"{prefix + spec.name:28} partitions={n:<3} key={spec.key}")
    return 0


# ------------------------------------------------------------------------------ services


def add_service_parsers(sub) -> None:
    """``freshrec streams``, ``worker`` and ``param-server``: the services, set by the environment."""
    streams = sub.add_parser("streams", help="the faust app: validation, hot scores, features")
    streams.set_defaults(func=cmd_streams)
    worker = sub.add_parser("worker", help="the inference worker: embedding cache, online learning")
    worker.set_defaults(func=cmd_worker)
    ps = sub.add_parser("param-server", help="aggregate gradients, Adagrad, persist, broadcast")
    ps.set_defaults(func=cmd_param_server)


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


def add_produce_parser(sub) -> None:
    """``freshrec produce items|events``: the synthetic world to the topics."""
    produce = sub.add_parser("produce", help="produce the synthetic world")
    produce_sub = produce.add_subparsers(dest="what", required=True, metavar="WHAT")
    p_items = produce_sub.add_parser("items", help="load the item catalogue")
    add_world_options(p_items)
    p_items.set_defaults(func=cmd_produce_items)
    p_events = produce_sub.add_parser("events", help="produce events at a steady rate")
    p_events.add_argument("--rate", type=float, default=1000.0, help="events per second")
    p_events.add_argument("--duration", type=float, default=None, help="seconds (default: forever)")
    add_world_options(p_events)
    p_events.set_defaults(func=cmd_produce_events)


def cmd_produce_items(args: argparse.Namespace) -> int:
    from freshrec.app.options import world_from_args
    from freshrec.sim.produce import produce_items

    produce_items(connection(), world_from_args(args), ProgressLine())
    return 0


def cmd_produce_events(args: argparse.Namespace) -> int:
    from freshrec.app.options import world_from_args
    from freshrec.sim.produce import produce_events

    stats = produce_events(
        connection(),
        world_from_args(args),
        rate_per_s=args.rate,
        duration_s=args.duration,
        progress=ProgressLine(),
    )
    return 0 if stats.failed == 0 else 1


# ---------------------------------------------------------------------- dashboard, top


def add_dashboard_parsers(sub) -> None:
    """``freshrec dashboard`` and ``freshrec top``: the headline figures, on a web page or in the
    terminal."""
    for name, helptext in (
        ("dashboard", "a live web page of freshness, lag, throughput, latency and tiers"),
        ("top", "the same headline figures as a live table in the terminal"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--targets",
            default=None,
            help="name=host:port,... of /metrics endpoints "
            "(default: the services of the running `freshrec run`)",
        )
        if name == "dashboard":
            p.add_argument("--host", default="127.0.0.1")
            p.add_argument("--port", type=int, default=8050)
            p.add_argument("--duration", type=float, default=None, help="seconds to serve")
            p.set_defaults(func=cmd_dashboard)
        else:
            p.add_argument("--interval", type=float, default=1.0)
            p.add_argument("--once", action="store_true", help="print one table (after 2 samples)")
            p.set_defaults(func=cmd_top)


def _observer_targets(spec: str | None) -> dict[str, str]:
    from freshrec.app.observe import parse_targets, read_targets

    targets = parse_targets(spec) if spec else read_targets(state_dir())
    if not targets:
        raise StackError(
            "no services to watch: start `freshrec run`, or pass --targets "
            "worker=localhost:9101,streams=localhost:9100,param-server=localhost:9102"
        )
    return targets


def start_dashboard(targets: dict[str, str], host: str, port: int):
    """The dashboard on ``port``, or on a free port when that one is taken."""
    from freshrec.app.dashboard import DashboardServer
    from freshrec.app.observe import Observer

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
    from freshrec.app.observe import Observer
    from freshrec.app.top import run_top

    observer = Observer(_observer_targets(args.targets))
    if args.once:
        observer.sample()
        time.sleep(args.interval)
        run_top(observer, args.interval, iterations=1)
    else:
        run_top(observer, args.interval)
    return 0


# ------------------------------------------------------------------------- train, recommend


def add_recommend_parser(sub) -> None:
    """``freshrec recommend`` and its options."""
    rec = sub.add_parser("recommend", help="ask the workers for recommendations over Kafka")
    rec.add_argument("--user", required=True, help="user id, e.g. u42")
    rec.add_argument("-k", type=int, default=20, help="how many items")
    rec.add_argument("--device", choices=("high_end", "pc", "low_end"), default=None)
    rec.add_argument("--region", default=None)
    rec.add_argument("--exclude", default="", help="comma-separated item ids never to return")
    rec.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")
    rec.add_argument("--json", action="store_true", help="print the reply as JSON")
    rec.set_defaults(func=cmd_recommend)


def cmd_recommend(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from freshrec.client import SyncRecommendClient

    conn = connection()
    context = {k: v for k, v in (("device", args.device), ("region", args.region)) if v}
    exclude = [x for x in args.exclude.split(",") if x]
    with SyncRecommendClient(
        conn.kafka_bootstrap_servers,
        topic_prefix=conn.topic_prefix,
        timeout_s=args.timeout,
        profile=conn.kafka_profile,
        security=conn.kafka_security,
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
        f" model {reply.ranker + ' ' if reply.ranker else ''}{reply.model_version or '-'},"
        f" worker {reply.worker or '-'}"
        + (f", variant {reply.experiment}/{reply.variant}" if reply.variant else ""),
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
