"""What each ``freshrec`` subcommand does; argument parsing lives in ``cli.py``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from freshcore import clock
from freshcore.settings import (
    STACK_ENV_FILE,
    ConnectionSettings,
    load_environment,
    read_env_file,
    state_dir,
)
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


# -------------------------------------------------------------------------------- topics


def cmd_experiments_report(args: argparse.Namespace) -> int:
    from freshrec.app.abreport import read_from, render

    try:
        if not 0 <= args.margin < 1:
            raise KeyError(f"--margin must be in [0, 1), not {args.margin}")
        reports = read_from(connection(during_run=True), args.name, margin=args.margin)
    except KeyError as exc:
        print(f"freshrec: error: {exc.args[0]}", file=sys.stderr)
        return 2
    print(json.dumps(reports, indent=2) if args.json else render(reports))
    return 0


# ---------------------------------------------------------------------------------- modes


def cmd_mode_set(args: argparse.Namespace) -> int:
    """Write the control record: every worker serves in ``args.name`` within a poll."""
    from inference.serving.modes import ModeError, declared_modes

    try:
        modes = declared_modes(os.environ)
    except ModeError as exc:
        print(f"freshrec: error: {exc}", file=sys.stderr)
        return 2
    if args.name not in modes:
        print(
            f"freshrec: error: no mode {args.name!r}: {', '.join(sorted(modes))}", file=sys.stderr
        )
        return 2
    if not set_mode(connection(during_run=True), args.name):
        print("freshrec: error: the control record was not delivered", file=sys.stderr)
        return 1
    print(f"serving mode set to {args.name}: every worker adopts it within a poll")
    return 0


def set_mode(conn: ConnectionSettings, name: str, by: str | None = None) -> bool:
    """Write the control record naming mode ``name``; whether the broker took it."""
    import getpass
    import socket

    from confluent_kafka import Producer

    from freshcore.kafka import produce, producer_config
    from freshcore.topics import TopicNames
    from schemas.codec import encode_control
    from schemas.records import ControlRecord

    by = by if by is not None else f"{getpass.getuser()}@{socket.gethostname()}"
    record = ControlRecord(name, clock.now_ms(), by)
    producer = Producer(producer_config(conn))
    produce(producer, TopicNames(conn.topic_prefix).control, encode_control(record), b"mode")
    return producer.flush(30) == 0


def cmd_mode_show(args: argparse.Namespace) -> int:
    """The modes and their settings, the newest control record, and the workers' modes (those
    of a ``freshrec run`` going on here)."""
    from freshrec.app.observe import read_targets
    from freshrec.promtext import scrape
    from inference.serving.modes import declared_modes

    modes = declared_modes(os.environ)
    record = latest_control(connection(during_run=True))
    current = record.mode if record else None
    for name, settings in sorted(modes.items()):
        mark = "*" if name == current else " "
        text = ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "as configured"
        print(f"{mark} {name:<12} {text}")
    if record is None:
        print("no control record: workers serve in FRESHREC_MODE (default daily)")
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.at_ms / 1000))
        print(f"control record: {record.mode}, set {when} UTC by {record.by or '?'}")
    for name, url in read_targets(state_dir()).items():
        try:
            series = scrape(url).get("freshrec_mode_info", [])
        except OSError:
            continue
        serving = [labels["mode"] for labels, v in series if v == 1]
        if serving:
            print(f"  {name}: serving in {serving[0]}")
    return 0


def latest_control(conn: ConnectionSettings, quiet_s: float = 1.0):
    """The newest control record on the topic (None: none), read from its start until the
    broker has nothing more for ``quiet_s`` (its end offsets are not to be trusted on every
    broker: docs/operations.md)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from freshcore.kafka import consumer_config
    from freshcore.topics import TopicNames
    from schemas.codec import decode_control

    consumer = Consumer(consumer_config(conn, None, background=True))
    try:
        consumer.assign(
            [TopicPartition(TopicNames(conn.topic_prefix).control, 0, OFFSET_BEGINNING)]
        )
        newest = None
        while True:
            msgs = consumer.consume(1000, quiet_s)
            if not msgs:
                return newest
            for msg in msgs:
                record = decode_control(msg.value()) if msg.error() is None else None
                if record is not None and (newest is None or record.at_ms >= newest.at_ms):
                    newest = record
    finally:
        consumer.close()


def cmd_experiments_check(args: argparse.Namespace) -> int:
    from inference.serving.experiments import ExperimentError, allocate, load

    try:
        exp = load(args.file)
    except ExperimentError as exc:
        print(f"freshrec: error: {exc}", file=sys.stderr)
        return 2
    table = allocate(None, [], exp)
    print(f"experiment {exp.name} (salt {exp.salt!r}, control {exp.control})")
    for i, v in enumerate(exp.variants):
        changes = {
            k: getattr(v, k)
            for k in (
                "ranking",
                "head_share",
                "mid_share",
                "mmr_lambda",
                "exclude_seen",
                "recall_quotas",
            )
            if getattr(v, k) not in (None, {})
        }
        what = ", ".join(f"{k}={val}" for k, val in changes.items()) or "as the worker is set"
        print(f"  {v.name:<14} {v.share:>6.1%}  {table.count(i):>4} of 1000 buckets  {what}")
    return 0


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


def cmd_recommend(args: argparse.Namespace) -> int:
    import json
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
