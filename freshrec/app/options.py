"""Command-line options shared by several ``freshrec`` commands: options that fall back to an
environment variable (named in ``--help``), and the synthetic world's options."""

from __future__ import annotations

import argparse
import os


class EnvDefault(argparse.Action):
    """An option whose default comes from an environment variable, named in ``--help``."""

    def __init__(self, envvar: str, default=None, required=False, help=None, **kwargs):
        value = os.environ.get(envvar)
        if value is not None and kwargs.get("type"):
            value = kwargs["type"](value)
        default = value if value is not None else default
        help = f"{help or ''} [env {envvar}; default {default}]".strip()
        super().__init__(
            default=default, required=required and default is None, help=help, **kwargs
        )

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def add_world_options(p: argparse.ArgumentParser, items: int = 100_000) -> None:
    p.add_argument(
        "--users",
        type=int,
        action=EnvDefault,
        envvar="FRESHREC_WORLD_USERS",
        default=1_000_000,
        help="users in the synthetic world",
    )
    p.add_argument(
        "--items",
        type=int,
        action=EnvDefault,
        envvar="FRESHREC_WORLD_ITEMS",
        default=items,
        help="items in the synthetic world",
    )
    p.add_argument(
        "--seed",
        type=int,
        action=EnvDefault,
        envvar="FRESHREC_WORLD_SEED",
        default=7,
        help="seed of the synthetic world",
    )


def world_from_args(args: argparse.Namespace):
    from tools.world import World, WorldConfig

    return World(WorldConfig(seed=args.seed, n_users=args.users, n_items=args.items))
