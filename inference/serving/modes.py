"""Serving modes: named sets of the worker's serving settings, chosen at start and switched
for every worker at run time by a control record. Pure: no I/O.

Seed B runs one recommender in several modes: a promotion trades cost for stability (its
traffic spike must not break the latency target), daily traffic holds P99 ≤ 300 ms, user
acquisition puts diversity first. A mode is a set of ``FRESHREC_*`` settings layered over
the worker's own (the mode wins); only the settings a worker can change while it serves may
appear in one (``MODE_SETTINGS``: those declared ``modes=True``, ``settings.py``). ``daily`` is the worker's settings as configured.

A control record (``schemas/records.py`` ``ControlRecord``) on the ``control`` topic (key
``mode``) names the mode every worker serves
in: ``freshrec mode set NAME`` writes it, each worker reads the topic from its start and
adopts the newest record within a poll. Who may write the topic is the deployment's Kafka
ACLs' to say (``freshrec/acls.py``: no service may).

>>> sorted(MODES)
['acquisition', 'daily', 'promo']
>>> mode_env({"FRESHREC_MMR_LAMBDA": "0.9", "X": "1"}, MODES["acquisition"])["FRESHREC_MMR_LAMBDA"]
'0.4'
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

from freshcore.declare import Setting
from inference.serving.settings import MODE_SETTINGS
from schemas.errors import FreshRecError

DAILY = "daily"

MODE = Setting(
    "FRESHREC_MODE",
    DAILY,
    "The serving mode a worker starts in ([serving modes](modes.md)); a control record "
    "switches every worker while they run.",
)
MODES_FILE = Setting(
    "FRESHREC_MODES_FILE",
    None,
    "A TOML file of serving modes over the shipped ones (`[promo]`, then `FRESHREC_… = value`).",
    kind=Path,
)


MODES: dict[str, dict[str, str]] = {
    DAILY: {},
    "promo": {
        # degrade earlier: a shorter queue before the cached/light tiers take over, a tighter
        # default deadline and recall deadlines, fewer candidates to rank; larger batches
        # amortise more of a spike's requests per model call
        "FRESHREC_QUEUE_DEPTH_LIMIT": "32",
        "FRESHREC_REQUEST_BUDGET_MS": "150",
        "FRESHREC_RECALL_DEADLINE_SCALE": "0.5",
        "FRESHREC_CANDIDATES": "200",
        "FRESHREC_MAX_BATCH": "64",
        "FRESHREC_MAX_WAIT_MS": "2",
    },
    "acquisition": {
        # diversity first: MMR weighs novelty more, categories spaced wider, more new items
        # recalled, and what a user was shown held back for five minutes
        "FRESHREC_MMR_LAMBDA": "0.4",
        "FRESHREC_CATEGORY_GAP": "3",
        "FRESHREC_RECALL_QUOTAS": "new=120,hot=120",
        "FRESHREC_HOLD_SHOWN_S": "300",
    },
}
"""The modes FreshRec ships (``FRESHREC_MODES_FILE`` may change them or add others)."""


class ModeError(FreshRecError, ValueError):
    """A modes file or a mode's settings are not usable; the message says where."""


def mode_env(env: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment with a mode's settings over it."""
    return {**env, **overrides}


def declared_modes(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The modes a deployment has: the shipped ones with ``FRESHREC_MODES_FILE``'s over them."""
    return load_modes(MODES_FILE.read(env))


def load_modes(path: Path | None) -> dict[str, dict[str, str]]:
    """The shipped modes, with a TOML file's tables over them (``[promo]`` then
    ``FRESHREC_… = value`` lines: a table replaces the shipped mode of its name whole)."""
    modes = {name: dict(settings) for name, settings in MODES.items()}
    if path is None:
        return modes
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ModeError(f"modes file {path}: {exc}") from None
    for name, table in doc.items():
        if not isinstance(table, dict):
            raise ModeError(f"modes file {path}: {name!r} is not a table of settings")
        if not name.isidentifier():
            raise ModeError(f"modes file {path}: mode name {name!r} is not an identifier")
        settings = {}
        for key, value in table.items():
            if key not in MODE_SETTINGS:
                raise ModeError(
                    f"modes file {path}: [{name}] {key} is not a setting a mode may change "
                    f"({', '.join(sorted(MODE_SETTINGS))})"
                )
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ModeError(f"modes file {path}: [{name}] {key} must be a number or text")
            settings[key] = str(value)
        modes[name] = settings
    if DAILY not in modes:
        raise ModeError("the daily mode cannot be removed")
    return modes
