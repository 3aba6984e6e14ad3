"""``freshrec replay``'s command line: what is replayed and scored, how fast, the starting
models, and the live arms' settings."""

from __future__ import annotations

import argparse

from freshrec.app.replay.baselines import BASELINES
from freshrec.app.replay.command import cmd_replay
from freshrec.app.replay.data import CATALOGUES


def add_parser(sub) -> None:
    """``freshrec replay PATH`` and its options."""
    from freshrec.app.options import add_log_options

    p = sub.add_parser(
        "replay",
        help="prequential evaluation on an interaction log: live arms and baselines",
    )
    p.add_argument("path", help="the interaction log (CSV, TSV, JSON Lines; gzipped or not)")
    add_log_options(p)
    _add_scoring_options(p)
    _add_pacing_options(p)
    _add_model_options(p)
    p.add_argument("--out", default=None, help="output folder (default .freshrec/replay/NAME)")
    p.add_argument("--seed", type=int, default=1, help="seed of the sample")
    p.add_argument(
        "--train-seed",
        type=int,
        default=None,
        help="seed of the starting models' training (default: LOG_CONFIG's, 11): runs with "
        "different seeds give the live arms' spread over training",
    )
    _add_settings_options(p)
    p.set_defaults(func=cmd_replay)


def _add_scoring_options(p: argparse.ArgumentParser) -> None:
    """Where the log is cut, what is scored in steps of how many, by which arms and
    baselines, over how many windows."""
    p.add_argument(
        "--train-share",
        type=float,
        default=0.8,
        help="the first share of the log, by time, that trains the starting models (0.8)",
    )
    p.add_argument(
        "--sample", type=float, default=1.0, help="share of the replayed interactions scored"
    )
    p.add_argument("-k", type=int, default=10, help="list length (10)")
    p.add_argument(
        "--step",
        type=int,
        default=100,
        help="interactions per step: lists are asked for before a step's interactions are "
        "produced (100)",
    )
    p.add_argument(
        "--arms",
        default="frozen,local,full",
        help="live arms: frozen, local, full, and full-without-CHANNEL (full with that recall "
        "channel off) for any channel (default frozen,local,full)",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="add an ablation arm per recall channel (full-without-vector, …): what each "
        "channel is worth, as the live arm without it",
    )
    p.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help=f"in-process baselines ({','.join(BASELINES)}; empty for none)",
    )
    p.add_argument("--windows", type=int, default=10, help="time windows of the report (10)")
    p.add_argument(
        "--catalogue",
        choices=CATALOGUES,
        default="listed",
        help="listed (default): the training part's items and the --items file's are listed "
        "before the replay starts, the rest at their first interaction; as-it-appears: every "
        "item is produced to `items` just before its first interaction, created then, so no "
        "arm can recommend an item before it exists (a news or shop log whose catalogue grows)",
    )


def _add_pacing_options(p: argparse.ArgumentParser) -> None:
    """How fast the replayed part runs, and how long a request may wait."""
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="how many times faster than it happened the replayed part runs (default: "
        "its span over --duration)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="with no --speed: the replayed part's span is mapped onto this many seconds",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a request may wait")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """How the starting models are trained, as ``freshrec train --log`` would."""
    p.add_argument("--negatives", type=int, default=4, help="as `freshrec train --negatives`")
    p.add_argument("--tower-epochs", type=int, default=None, help="two-tower epochs (10)")
    p.add_argument(
        "--tower-share",
        type=float,
        default=None,
        help="as `freshrec train --tower-share` (default: LOG_CONFIG's)",
    )


def _add_settings_options(p: argparse.ArgumentParser) -> None:
    """The live arms' services' settings: searched (``--tune``) or given (``--set``)."""
    p.add_argument(
        "--tune",
        dest="tuning",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="search a setting of the live arms (repeatable: every combination) on a "
        "validation replay, the training part's last tenth with models trained on the rest; "
        "the scored part is then replayed once, with the best. E.g. --tune "
        "FRESHREC_MMR_LAMBDA=0.7,1.0",
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for every live arm's services (repeatable), e.g. "
        "--set FRESHREC_MMR_LAMBDA=1.0",
    )
