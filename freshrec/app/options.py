"""Command-line options shared by several ``freshrec`` commands: options that fall back to an
environment variable (named in ``--help``), and the synthetic world's options."""

from __future__ import annotations

import argparse
import os

from freshcore.declare import Setting
from freshrec.app.settings import WORLD_ITEMS, WORLD_SEED, WORLD_USERS


class EnvDefault(argparse.Action):
    """An option whose default comes from its setting's variable (``freshrec/app/settings.py``),
    named in ``--help``; ``default`` is the command's own where it differs from the setting's."""

    def __init__(self, setting: Setting, default=None, required=False, help=None, **kwargs):
        default = setting.read(os.environ, setting.default if default is None else default)
        help = f"{help or ''} [env {setting.env}; default {default}]".strip()
        super().__init__(
            default=default, required=required and default is None, help=help, **kwargs
        )

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def add_world_options(
    p: argparse.ArgumentParser, items: int | None = None, items_option: bool = True
) -> None:
    p.add_argument(
        "--users",
        type=int,
        action=EnvDefault,
        setting=WORLD_USERS,
        help="users in the synthetic world",
    )
    if items_option:
        p.add_argument(
            "--items",
            type=int,
            action=EnvDefault,
            setting=WORLD_ITEMS,
            default=items,
            help="items in the synthetic world",
        )
    p.add_argument(
        "--seed",
        type=int,
        action=EnvDefault,
        setting=WORLD_SEED,
        help="seed of the synthetic world",
    )


def world_from_args(args: argparse.Namespace):
    from freshrec.sim.world import World, WorldConfig

    return World(WorldConfig(seed=args.seed, n_users=args.users, n_items=args.items))


def add_log_options(p: argparse.ArgumentParser, items_help: str | None = None) -> None:
    """How to read an interaction log (``inference/training/interactions.py``) and its item file."""
    g = p.add_argument_group("interaction log")
    g.add_argument(
        "--format",
        choices=("movielens",),
        default=None,
        help="a preset: movielens reads ratings.csv (userId,movieId,rating,timestamp), "
        "u.data and ratings.dat",
    )
    g.add_argument("--user-col", default=None, help="user column (default user_id)")
    g.add_argument("--item-col", default=None, help="item column (default item_id)")
    g.add_argument("--time-col", default=None, help="time column (default timestamp)")
    g.add_argument(
        "--no-time",
        action="store_true",
        help="the log has no time column, each user's rows in the order they happened "
        "(sequence files such as SASRec's and RecBole's Amazon review logs): they keep that "
        "order at seeded random times over a year, users interleaved (docs/benchmarks.md)",
    )
    g.add_argument("--type-col", default=None, help="event type column (optional)")
    g.add_argument(
        "--types",
        default=None,
        help="with --type-col: value=click|conversion pairs, e.g. view=click,buy=conversion "
        "(other values are skipped; default: click and conversion as themselves)",
    )
    g.add_argument("--rating-col", default=None, help="explicit rating column (optional)")
    g.add_argument(
        "--min-rating",
        type=float,
        default=None,
        help="with --rating-col: only ratings at least this are positives",
    )
    g.add_argument(
        "--time-unit",
        choices=("auto", "s", "ms", "iso"),
        default="auto",
        help="epoch seconds or ms (auto: by size) or ISO 8601",
    )
    g.add_argument("--delimiter", default=None, help="column separator (default: detected)")
    g.add_argument(
        "--no-header",
        action="store_true",
        help="the first line is data: name columns by position (0, 1, ...)",
    )
    g.add_argument("--encoding", default="utf-8", help="text encoding (default utf-8)")
    g.add_argument(
        "--items",
        dest="items_path",
        default=None,
        help=items_help or "item file: id and, when present, category (or genres) and price",
    )
    g.add_argument("--item-id-col", default="item_id", help="the item file's id column")
    g.add_argument("--category-col", default="category", help="the item file's category column")
    g.add_argument("--price-col", default="price", help="the item file's price column")


def log_format_from_args(args: argparse.Namespace, path: str):
    """The ``LogFormat`` the options describe (a preset, then the columns named)."""
    from dataclasses import replace

    from inference.training.interactions import LogError, LogFormat, preset

    fmt = preset(args.format, path) if args.format else LogFormat()
    types = None
    if args.types:
        try:
            types = dict(pair.split("=", 1) for pair in args.types.split(",") if pair)
        except ValueError:
            raise LogError(
                f"--types {args.types!r}: expected value=click,value=conversion"
            ) from None
    changes = {
        "user_col": args.user_col,
        "item_col": args.item_col,
        "time_col": args.time_col,
        "type_col": args.type_col,
        "types": types,
        "rating_col": args.rating_col,
        "min_rating": args.min_rating,
        "delimiter": args.delimiter,
    }
    fmt = replace(fmt, **{k: v for k, v in changes.items() if v is not None})
    if getattr(args, "no_time", False):
        if args.time_col:
            raise LogError("--no-time and --time-col: a log has a time column or none")
        fmt = replace(fmt, time_col="")
    return replace(
        fmt,
        time_unit=args.time_unit,
        encoding=args.encoding,
        header=False if args.no_header else fmt.header,
    )


def read_log_from_args(args: argparse.Namespace, path: str, progress=None):
    """(interactions, item table) as the options say; a summary line on ``progress``."""
    from inference.training.interactions import read_log
    from inference.training.logtrain import ItemFormat, ItemTable, read_items

    inter = read_log(path, log_format_from_args(args, path))
    users, items = len(set(inter.users.tolist())), len(set(inter.items.tolist()))
    line = (
        f"read {len(inter):,} interactions ({users:,} users, {items:,} items) from {path}; "
        f"{inter.bad.summary()}"
        + (f"; {inter.bad.skipped:,} skipped by type or rating" if inter.bad.skipped else "")
    )
    if progress is not None:
        progress.done(line)
    table = ItemTable.empty()
    if args.items_path:
        fmt = ItemFormat(args.item_id_col, args.category_col, args.price_col)
        table = read_items(args.items_path, fmt, movielens=args.format == "movielens")
    return inter, table
