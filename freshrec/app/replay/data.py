"""What every live arm of ``freshrec replay`` replays (``ReplayData``: the log, its plan, and
what the training part left behind), and the log's event times moved onto the present
(``stamp``): the replayed part starts now and runs ``speed`` times faster than it happened."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CATALOGUES = ("listed", "as-it-appears")
"""How a replay lists its items (``--catalogue``)."""
EXCLUDE_MAX = 1000
"""The request schema's bound on ``exclude``."""
MIN_EVENT_MS = 946_684_800_000
"""The events schema's earliest time, 2000-01-01."""


@dataclass
class ReplayData:
    """What every arm replays: the log, its plan, and what the training part left behind."""

    users: np.ndarray
    items: np.ndarray
    types: np.ndarray
    t_ms: np.ndarray
    plan: object
    """``evaluation.protocol.Plan``."""
    window_of: np.ndarray
    catalogue: list[str]
    """Items listed when the replayed part starts: the training part's, and the item file's
    unless the catalogue is listed as it appears."""
    category: dict[str, str]
    price: dict[str, float]
    history: dict[str, list[str]] = field(default_factory=dict)
    """Per replayed user, their training-part items, newest first."""
    speed: float = 1.0
    as_it_appears: bool = False
    """Every item is listed just before its first interaction (training part included),
    created then; else the catalogue is listed before the training part is sent."""


def prepare(
    inter,
    items_table,
    plan,
    windows: int,
    duration_s: float,
    speed: float | None,
    catalogue_mode: str = "listed",
):
    """The ``ReplayData`` of a log and its plan."""
    from evaluation.protocol import windows as window_index
    from inference.models.coldstart import UNKNOWN_CATEGORY

    train_end = plan.train_end
    users, items = inter.users, inter.items
    as_it_appears = catalogue_mode == "as-it-appears"
    listed = [] if as_it_appears else items_table.ids
    catalogue = list(dict.fromkeys([*items[:train_end].tolist(), *listed]))
    replayed = {u for s in plan.steps for u in s.users}
    history: dict[str, list[str]] = {}
    for u, i in zip(
        users[:train_end][::-1].tolist(), items[:train_end][::-1].tolist(), strict=True
    ):
        if u in replayed:
            h = history.setdefault(u, [])
            if len(h) < EXCLUDE_MAX and i not in h:
                h.append(i)
    span = max(int(inter.t_ms[-1]) - int(inter.t_ms[train_end]), 1) if train_end < len(inter) else 1
    return ReplayData(
        users=users,
        items=items,
        types=inter.types,
        t_ms=inter.t_ms,
        plan=plan,
        window_of=window_index(inter.t_ms, train_end, windows),
        catalogue=catalogue,
        category={i: items_table.category.get(i, UNKNOWN_CATEGORY) for i in set(items.tolist())},
        price=dict(items_table.price),
        history=history,
        speed=speed or max(span / (duration_s * 1000.0), 1.0),
        as_it_appears=as_it_appears,
    )


def stamp(data: ReplayData, wall0: int, pos: int) -> int:
    """The event time of log position ``pos`` on the present: the replayed part starts at
    ``wall0``; the training part lies before it (never before 2000-01-01)."""
    t0 = int(data.t_ms[data.plan.train_end]) if data.plan.train_end < len(data.t_ms) else 0
    return max(wall0 + int((int(data.t_ms[pos]) - t0) / data.speed), MIN_EVENT_MS)
