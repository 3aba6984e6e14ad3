"""``freshrec stack up|down|status|fetch``: the embedded stack from the command line."""

from __future__ import annotations

import argparse
import os
import sys

from freshcore.redisconn import redacted
from freshcore.settings import ConnectionSettings, state_dir
from freshrec.app.options import EnvDefault
from freshrec.app.settings import BROKER
from freshrec.app.stack.choice import BROKERS, KAFKA, BrokerChoice, choose_broker
from freshrec.app.stack.embedded import EmbeddedStack, external_services
from freshrec.app.stack.errors import StackError
from freshrec.app.stack.kafkajars import kafka_release


def add_parser(sub) -> None:
    """``freshrec stack`` and its actions."""
    stack = sub.add_parser("stack", help="the embedded Kafka broker and Redis server")
    stack_sub = stack.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = stack_sub.add_parser("up", help="start both on free loopback ports")
    add_broker_options(up)
    up.add_argument("--kafka-port", type=int, default=None, help="the (first) broker's port")
    up.add_argument("--redis-port", type=int, default=None, help="the (first) Redis port")
    up.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="a Redis Cluster of N masters (2 to 64) instead of one Redis server",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for readiness (default: 120 for Apache Kafka, 20 for Tansu)",
    )
    up.set_defaults(func=cmd_stack_up)
    stack_sub.add_parser("down", help="stop what `up` started").set_defaults(func=cmd_stack_down)
    stack_sub.add_parser("status", help="what runs where").set_defaults(func=cmd_stack_status)
    fetch = stack_sub.add_parser(
        "fetch",
        help="fetch the pinned Apache Kafka's jars with Maven where Java 17+ and mvn are "
        "found (once; make test and make run do)",
    )
    fetch.set_defaults(func=cmd_stack_fetch)


def add_broker_options(p: argparse.ArgumentParser) -> None:
    """``--broker`` and ``--brokers``, for ``stack up`` and ``run``."""
    p.add_argument(
        "--broker",
        choices=BROKERS,
        action=EnvDefault,
        setting=BROKER,
        help="the embedded broker: Apache Kafka (kafka), Tansu (tansu), or auto: Apache "
        "Kafka where Java 17+ and its jars or Maven are found, else Tansu",
    )
    p.add_argument(
        "--brokers",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: a cluster of three Apache Kafka nodes (replication factor 3, "
        "min.insync.replicas 2)",
    )


def chosen_broker(requested: str) -> BrokerChoice:
    """The broker for ``--broker``, its jars fetched if need be (saying so on stderr), and
    its line printed: the first a command prints."""
    release = kafka_release()
    if requested != "tansu" and not release.fetched():
        print(f"fetching {release.name} with Maven into {release.lib} (once)", file=sys.stderr)
    choice = choose_broker(requested, may_fetch=True)
    print(choice.line, flush=True)
    return choice


def cmd_stack_up(args: argparse.Namespace) -> int:
    if external_services():
        print("KAFKA_BOOTSTRAP_SERVERS and REDIS_URL are set: using them, starting nothing")
        return 0
    stack = EmbeddedStack(state_dir())
    stack.up(
        kafka_port=args.kafka_port,
        redis_port=args.redis_port,
        timeout_s=args.timeout,
        redis_cluster=args.redis_cluster,
        broker=chosen_broker(args.broker),
        brokers=args.brokers,
    )
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
        print(f"external: REDIS_URL={redacted(conn.redis_url)}")
        return 0
    print(EmbeddedStack(state_dir()).status())
    return 0


def cmd_stack_fetch(args: argparse.Namespace) -> int:
    """The broker ``auto`` picks, its jars fetched where it is Apache Kafka: where Java or
    Maven is missing, or Maven cannot fetch, the line says why Tansu runs instead (exit 0:
    Tansu is a broker too)."""
    try:
        choice = chosen_broker(BROKER.read(os.environ))
    except StackError as exc:  # FRESHREC_BROKER=kafka and it cannot run
        print(f"broker: Apache Kafka cannot run: {exc}", file=sys.stderr)
        return 1
    if choice.kind == KAFKA and choice.release is not None:
        print(f"{choice.release.name}: {choice.release.lib}")
    return 0
