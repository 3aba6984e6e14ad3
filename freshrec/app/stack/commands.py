"""``freshrec stack up|down|status``: the embedded stack from the command line."""

from __future__ import annotations

import argparse
import os

from freshcore.redisconn import redacted
from freshcore.settings import ConnectionSettings, state_dir
from freshrec.app.stack.embedded import EmbeddedStack, external_services


def add_parser(sub) -> None:
    """``freshrec stack`` and its actions."""
    stack = sub.add_parser("stack", help="the embedded Kafka broker and Redis server")
    stack_sub = stack.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = stack_sub.add_parser("up", help="start both on free loopback ports")
    up.add_argument("--kafka-port", type=int, default=None)
    up.add_argument("--redis-port", type=int, default=None, help="the (first) Redis port")
    up.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="a Redis Cluster of N masters (2 to 64) instead of one Redis server",
    )
    up.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for readiness")
    up.set_defaults(func=cmd_stack_up)
    stack_sub.add_parser("down", help="stop what `up` started").set_defaults(func=cmd_stack_down)
    stack_sub.add_parser("status", help="what runs where").set_defaults(func=cmd_stack_status)


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
