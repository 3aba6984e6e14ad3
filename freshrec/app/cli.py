"""The ``freshrec`` command: every service and tool behind one entry point.

Options fall back to environment variables, and ``--help`` names them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from freshcore.settings import LOG_FORMAT
from schemas.errors import FreshRecError

Command = Callable[[argparse.Namespace], int]


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def build_parser() -> argparse.ArgumentParser:
    """The ``freshrec`` parser; each command's options are declared beside the code that reads
    them (``add_parser`` in its module), in the order ``--help`` lists the commands."""
    from freshrec.app import commands, experiments, modes, replay, run, training
    from freshrec.app.stack import commands as stack_commands

    parser = argparse.ArgumentParser(
        prog="freshrec",
        description="FreshRec: recommendations over Kafka from embeddings that learn online.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run.add_parser(sub)
    stack_commands.add_parser(sub)
    experiments.add_parser(sub)
    modes.add_parser(sub)
    commands.add_topics_parser(sub)
    commands.add_produce_parser(sub)
    commands.add_service_parsers(sub)
    commands.add_dashboard_parsers(sub)
    training.add_parser(sub)
    replay.add_parser(sub)
    commands.add_recommend_parser(sub)
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
