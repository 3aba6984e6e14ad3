"""``freshrec experiments report|check``: an A/B experiment's report from what the workers and
the streams app counted (``abreport.py``), and an experiments file's split before it runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from freshrec.app.commands import connection


def add_parser(sub) -> None:
    """``freshrec experiments`` and its actions."""
    exps = sub.add_parser("experiments", help="A/B experiments (docs/experiments.md)")
    exps_sub = exps.add_subparsers(dest="action", required=True, metavar="ACTION")
    report = exps_sub.add_parser(
        "report",
        help="per variant: requests, CTR and CVR with user-level 95%% intervals, serving "
        "time, and a verdict against the control",
    )
    report.add_argument("--name", action="append", help="this experiment (default: all)")
    report.add_argument("--json", action="store_true", help="JSON instead of a table")
    report.add_argument(
        "--margin",
        type=float,
        default=0.03,
        help="non-inferiority margin: the relative CTR a variant may lose and still be "
        "'not worse' (0.03)",
    )
    report.set_defaults(func=cmd_experiments_report)
    check = exps_sub.add_parser("check", help="parse an experiments file and show its split")
    check.add_argument("file", type=Path)
    check.set_defaults(func=cmd_experiments_check)


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
