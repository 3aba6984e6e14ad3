"""The ``freshrec`` command: every service and tool behind one entry point.

Options fall back to environment variables, and ``--help`` names them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from freshcore.settings import LOG_FORMAT
from freshrec.app.options import EnvDefault, add_log_options, add_world_options
from freshrec.cost import CORE_HOUR_PRICE, GPU_HOUR_PRICE
from schemas.errors import FreshRecError

Command = Callable[[argparse.Namespace], int]


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def build_parser() -> argparse.ArgumentParser:
    from freshrec.app import commands, experiments, modes, replay, training
    from freshrec.app import run as run_command
    from freshrec.app.stack import commands as stack_commands

    parser = argparse.ArgumentParser(
        prog="freshrec",
        description="FreshRec: recommendations over Kafka from embeddings that learn online.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="the whole pipeline on the embedded stack, with traffic")
    run.add_argument(
        "--duration", type=float, default=None, help="seconds to run (default: until Ctrl-C)"
    )
    run.add_argument(
        "--rate",
        type=float,
        action=EnvDefault,
        envvar="FRESHREC_EVENT_RATE",
        default=100.0,
        help="background synthetic events per second",
    )
    run.add_argument(
        "--requests",
        type=float,
        action=EnvDefault,
        envvar="FRESHREC_REQUEST_RATE",
        default=20.0,
        help="closed-loop recommendation requests per second",
    )
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
    run.set_defaults(func=run_command.cmd_run)

    stack_commands.add_parser(sub)

    experiments.add_parser(sub)
    modes.add_parser(sub)

    topics = sub.add_parser("topics", help="the topic catalogue")
    topics_sub = topics.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = topics_sub.add_parser("create", help="create missing topics (idempotent)")
    create.add_argument(
        "--acls",
        action="store_true",
        help="also grant each service's Kafka user what it needs (freshrec/acls.py; run as a "
        "user that may alter ACLs)",
    )
    create.set_defaults(func=commands.cmd_topics_create)
    topics_sub.add_parser("list", help="print the catalogue").set_defaults(
        func=commands.cmd_topics_list
    )

    produce = sub.add_parser("produce", help="produce the synthetic world")
    produce_sub = produce.add_subparsers(dest="what", required=True, metavar="WHAT")
    p_items = produce_sub.add_parser("items", help="load the item catalogue")
    add_world_options(p_items)
    p_items.set_defaults(func=commands.cmd_produce_items)
    p_events = produce_sub.add_parser("events", help="produce events at a steady rate")
    p_events.add_argument("--rate", type=float, default=1000.0, help="events per second")
    p_events.add_argument("--duration", type=float, default=None, help="seconds (default: forever)")
    add_world_options(p_events)
    p_events.set_defaults(func=commands.cmd_produce_events)
    streams = sub.add_parser("streams", help="the faust app: validation, hot scores, features")
    streams.set_defaults(func=commands.cmd_streams)
    worker = sub.add_parser("worker", help="the inference worker: embedding cache, online learning")
    worker.set_defaults(func=commands.cmd_worker)
    ps = sub.add_parser("param-server", help="aggregate gradients, Adagrad, persist, broadcast")
    ps.set_defaults(func=commands.cmd_param_server)
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
            p.set_defaults(func=commands.cmd_dashboard)
        else:
            p.add_argument("--interval", type=float, default=1.0)
            p.add_argument("--once", action="store_true", help="print one table (after 2 samples)")
            p.set_defaults(func=commands.cmd_top)

    train = sub.add_parser(
        "train",
        help="offline training: starting embeddings and both ranking models, on the "
        "synthetic world or an interaction log (--log)",
    )
    add_world_options(train, items_option=False)
    train.add_argument(
        "--log",
        default=None,
        help="train on this interaction log (CSV, TSV or JSON Lines, gzipped or not) "
        "instead of the synthetic world; see docs/replay.md",
    )
    add_log_options(
        train,
        items_help="with --log: the item file (id, category or genres, price); without: "
        "the synthetic world's item count [env FRESHREC_WORLD_ITEMS; default 100000]",
    )
    train.add_argument(
        "--negatives",
        type=int,
        default=4,
        help="with --log: negatives drawn uniformly from the catalogue per interaction, "
        "for the ranking models (default 4)",
    )
    train.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        help="with --log: the last share of the log, by time, held out and reported on "
        "(default 0.1)",
    )
    train.add_argument(
        "--impressions", type=int, default=1_000_000, help="logged impressions to train on"
    )
    train.add_argument(
        "--l2",
        type=float,
        default=2.0,
        help="two-tower L2 penalty (default 2.0; see docs/serving.md)",
    )
    train.add_argument(
        "--tower-share",
        type=float,
        default=1.0,
        help="share of the training logs for the two-tower model; the ranking "
        "models learn from the rest (1.0: both from all)",
    )
    train.add_argument(
        "--tower-epochs",
        type=int,
        default=None,
        help="two-tower epochs (default 3; with --log 10)",
    )
    train.add_argument(
        "--rankers",
        default=None,
        help="the further ranking models, comma-separated, '' for none (default: "
        "pruned,attention,attention_window,attention_lowrank; docs/serving.md)",
    )
    train.add_argument(
        "--out",
        default=None,
        help="model directory [env FRESHREC_MODEL_DIR; default .freshrec/models]",
    )
    train.add_argument(
        "--load",
        choices=("auto", "yes", "no"),
        default="auto",
        help="write the starting embeddings to Redis (auto: if a stack is set)",
    )
    train.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when the directory already holds models of this world "
        "trained with this configuration",
    )
    train.set_defaults(func=training.cmd_train)

    replay.add_parser(sub)

    rec = sub.add_parser("recommend", help="ask the workers for recommendations over Kafka")
    rec.add_argument("--user", required=True, help="user id, e.g. u42")
    rec.add_argument("-k", type=int, default=20, help="how many items")
    rec.add_argument("--device", choices=("high_end", "pc", "low_end"), default=None)
    rec.add_argument("--region", default=None)
    rec.add_argument("--exclude", default="", help="comma-separated item ids never to return")
    rec.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the reply")
    rec.add_argument("--json", action="store_true", help="print the reply as JSON")
    rec.set_defaults(func=commands.cmd_recommend)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=LOG_FORMAT,
    )
    _sigterm_as_interrupt()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (FreshRecError, TimeoutError) as exc:  # every error FreshRec raises on purpose
        print(f"freshrec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
