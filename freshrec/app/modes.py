"""``freshrec mode set|show``: switch every worker's serving mode with a control record, and
show the modes, the newest record and the workers' own."""

from __future__ import annotations

import argparse
import os
import sys
import time

from freshcore import clock
from freshcore.settings import ConnectionSettings, state_dir
from freshrec.app.commands import connection


def add_parser(sub) -> None:
    """``freshrec mode`` and its actions."""
    mode = sub.add_parser("mode", help="serving modes: daily, promo, acquisition (docs/serving.md)")
    mode_sub = mode.add_subparsers(dest="action", required=True, metavar="ACTION")
    mode_set = mode_sub.add_parser("set", help="switch every worker to a mode")
    mode_set.add_argument("name", help="daily, promo, acquisition, or one of FRESHREC_MODES_FILE")
    mode_set.set_defaults(func=cmd_mode_set)
    mode_sub.add_parser("show", help="the modes, the current one, the workers'").set_defaults(
        func=cmd_mode_show
    )


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
