"""The settings of the command line itself: the synthetic world's size and the traffic
``freshrec run`` sends, each an option that falls back to its variable (``EnvDefault``)."""

from __future__ import annotations

from collections.abc import Mapping

from freshcore.declare import Setting

GROUP = "command line"

WORLD_USERS = Setting(
    "FRESHREC_WORLD_USERS",
    1_000_000,
    "Users in the synthetic world (`--users`).",
    kind=int,
    minimum=1,
    group=GROUP,
)
WORLD_ITEMS = Setting(
    "FRESHREC_WORLD_ITEMS",
    100_000,
    "Items in the synthetic world (`--items`).",
    kind=int,
    minimum=1,
    group=GROUP,
    shown="100,000 (`freshrec run`: 20,000)",
)
WORLD_SEED = Setting(
    "FRESHREC_WORLD_SEED", 7, "Seed of the synthetic world (`--seed`).", kind=int, group=GROUP
)
EVENT_RATE = Setting(
    "FRESHREC_EVENT_RATE",
    100.0,
    "`freshrec run`'s background synthetic events per second (`--rate`).",
    kind=float,
    minimum=0,
    group=GROUP,
)
REQUEST_RATE = Setting(
    "FRESHREC_REQUEST_RATE",
    20.0,
    "`freshrec run`'s closed-loop recommendation requests per second (`--requests`).",
    kind=float,
    minimum=0,
    group=GROUP,
)

BROKER = Setting(
    "FRESHREC_BROKER",
    "auto",
    "The embedded stack's broker (`--broker`): `kafka` (Apache Kafka, needs Java 17+ and its "
    "jars, fetched with Maven), `tansu`, or `auto`: Apache Kafka where it can run, else Tansu "
    "([brokers](brokers.md)).",
    choices=("auto", "kafka", "tansu"),
    group=GROUP,
)

COMMAND_SETTINGS = (WORLD_USERS, WORLD_ITEMS, WORLD_SEED, EVENT_RATE, REQUEST_RATE, BROKER)


def read_command_settings(env: Mapping[str, str]) -> dict[str, object]:
    """Each of the command line's settings as ``env`` gives it (its default when unset)."""
    return {s.env: s.read(env) for s in COMMAND_SETTINGS}
