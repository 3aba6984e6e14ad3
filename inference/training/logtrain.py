"""``freshrec train --log``: the starting models from an interaction log.

Interaction logs are positive-only (a play, a rating, a purchase); nothing says what a user
saw and passed over. The trainer therefore:

1. keeps the last ``holdout`` share of the interactions (by time) out of training: the
   ranking models stop on it and the metrics printed are measured on it (a chronological
   split: a random one would let the models see the future of the users they are scored on);
2. trains the two-tower rows with a sampled softmax (``TrainConfig.tower_loss``): each
   interaction against the other interactions of its batch and ``softmax_negatives`` items
   drawn uniformly from the catalogue;
3. trains the ranking models on the interactions as positives and ``negatives`` items drawn
   uniformly from the catalogue per interaction as negatives. Uniform, not by popularity:
   popular items are what users do consume, and negatives drawn by popularity taught the
   models to rank them down (``docs/benchmarks.md``, the learner's table).

The catalogue is every item of the log and of the item file (``ItemTable``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from inference.models.coldstart import UNKNOWN_CATEGORY
from inference.training.interactions import Interactions, LogError, _open_text, _split
from inference.training.train import TrainConfig, TrainingLog, train

MOVIELENS_GENRES = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
]
"""The genre flags of MovieLens 100K's u.item, in order."""


@dataclass
class ItemTable:
    ids: list[str]
    category: dict[str, str]
    price: dict[str, float]
    title: dict[str, str]

    @classmethod
    def empty(cls) -> ItemTable:
        return cls([], {}, {}, {})


@dataclass(frozen=True)
class ItemFormat:
    id_col: str = "item_id"
    category_col: str | None = "category"
    price_col: str | None = "price"
    title_col: str | None = "title"
    encoding: str = "utf-8"


def _first_genre(value: str) -> str:
    return value.split("|")[0].strip() or UNKNOWN_CATEGORY


def read_items(path: str | Path, fmt: ItemFormat, movielens: bool = False) -> ItemTable:
    """The item file at ``path``: CSV/TSV with a header (or JSON Lines) naming the id and,
    when present, the category and price columns. ``movielens``: also MovieLens's movies.csv
    (genres), ml-1m's movies.dat (``::``) and ml-100k's u.item (``|``, genre flags); an item
    of several genres takes the first."""
    path = Path(path)
    if movielens:
        fmt = replace(fmt, id_col="movieId", category_col="genres", price_col=None)
    text = _open_text(path, "latin-1" if movielens else fmt.encoding)
    table = ItemTable.empty()
    try:
        first = text.readline()
        if not first:
            raise LogError(f"{path}: the item file is empty")
        if movielens and "|" in first and "::" not in first and "," not in first.split("|")[0]:
            _read_u_item([first, *text], table)
        elif movielens and "::" in first:
            _read_movies_dat([first, *text], table)
        else:
            for row in _item_rows(path, first, text, fmt):
                _add_item(table, row, fmt)
    except (UnicodeDecodeError, ValueError) as exc:
        raise LogError(f"{path}: cannot read the item file ({exc})") from None
    finally:
        text.close()
    return table


def _read_u_item(lines, table: ItemTable) -> None:
    """ml-100k's u.item: id|title|date|video date|url|19 genre flags (the first set names
    the item's category)."""
    for cells in (line.rstrip("\r\n").split("|") for line in lines):
        if len(cells) < 5 + len(MOVIELENS_GENRES):
            continue
        flags = [g for g, f in zip(MOVIELENS_GENRES, cells[5:], strict=False) if f == "1"]
        table.ids.append(cells[0])
        table.category[cells[0]] = flags[0] if flags else UNKNOWN_CATEGORY
        table.title[cells[0]] = cells[1]


def _read_movies_dat(lines, table: ItemTable) -> None:
    """ml-1m's movies.dat: id::title::genres."""
    for line in lines:
        cells = line.rstrip("\r\n").split("::")
        if len(cells) >= 3:
            table.ids.append(cells[0])
            table.category[cells[0]] = _first_genre(cells[2])
            table.title[cells[0]] = cells[1]


def _item_rows(path: Path, first: str, text, fmt: ItemFormat):
    """The rows of a JSON Lines item file (by its name), else of a CSV/TSV one whose header
    is ``first`` and names ``fmt.id_col``: each a dict by column."""
    if path.name.lower().removesuffix(".gz").endswith((".jsonl", ".ndjson", ".json")):
        import json

        return (json.loads(line) for line in [first, *text] if line.strip())
    delimiter = "\t" if "\t" in first else ","
    names = [c.strip() for c in _split(first, delimiter)]
    if fmt.id_col not in names:
        raise LogError(f"{path}: no column {fmt.id_col!r} in the item file's header")
    return (
        dict(zip(names, _split(line, delimiter), strict=False)) for line in text if line.strip()
    )


def _add_item(table: ItemTable, row: dict, fmt: ItemFormat) -> None:
    """One row of an item file: its id, and its category, price and title where it has them
    (a price that is not a number, or negative, is left out)."""
    item = str(row.get(fmt.id_col, "")).strip()
    if not item:
        return
    table.ids.append(item)
    cat = row.get(fmt.category_col) if fmt.category_col else None
    if cat not in (None, ""):
        table.category[item] = _first_genre(str(cat))
    price = row.get(fmt.price_col) if fmt.price_col else None
    try:
        if price not in (None, "") and float(price) >= 0:
            table.price[item] = float(price)
    except (TypeError, ValueError):
        pass
    title = row.get(fmt.title_col) if fmt.title_col else None
    if title:
        table.title[item] = str(title)[:200]


def fingerprint(inter: Interactions) -> str:
    """Identifies a log's content (its interactions, in order)."""
    h = hashlib.sha256()
    for part in (inter.users, inter.items):
        h.update("\0".join(part.tolist()).encode())
    h.update(inter.t_ms.tobytes())
    return h.hexdigest()[:16]


def training_log(
    inter: Interactions,
    items: ItemTable,
    negatives: int,
    rng: np.random.Generator,
    source: str = "",
) -> TrainingLog:
    """The interactions as labelled rows (clicked, converted for conversions) and
    ``negatives`` uniform catalogue items per interaction (``sampled``), in time order."""
    catalogue = list(dict.fromkeys([*inter.items.tolist(), *items.ids]))
    index = {item: j for j, item in enumerate(catalogue)}
    user_ids, users = np.unique(inter.users.astype(str), return_inverse=True)
    pos_items = np.fromiter((index[i] for i in inter.items.tolist()), np.int64, len(inter))
    n, k = len(inter), negatives
    neg_items = rng.integers(0, len(catalogue), (n, k))
    clash = neg_items == pos_items[:, None]  # never the positive itself
    neg_items[clash] = (neg_items[clash] + 1) % len(catalogue)
    order = np.repeat(np.arange(n), k + 1)  # each positive, then its negatives
    all_items = np.column_stack([pos_items, neg_items]).ravel()
    sampled = np.tile(np.r_[False, np.ones(k, bool)], n)
    clicked = ~sampled
    converted = clicked & np.repeat(inter.types == "conversion", k + 1)
    return TrainingLog(
        user_ids=user_ids.astype(object),
        item_ids=np.asarray(catalogue, object),
        item_category=np.asarray(
            [items.category.get(i, UNKNOWN_CATEGORY) for i in catalogue], object
        ),
        item_price=np.asarray([items.price.get(i, 0.0) for i in catalogue], np.float64),
        users=users[order].astype(np.int64),
        items=all_items.astype(np.int64),
        t_ms=inter.t_ms[order],
        clicked=clicked,
        converted=converted,
        device=np.full(len(order), -1, np.int64),
        region=np.full(len(order), None, object),
        source=source,
        sampled=sampled,
    )


def chronological_split(logs: TrainingLog, holdout: float) -> tuple[np.ndarray, ...]:
    """(train, valid, test) rows: the last ``holdout`` share by time is both valid and test
    (rows of one interaction stay together: they share its time)."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    n = len(logs.users)
    cut = logs.t_ms[min(int(n * (1 - holdout)), n - 1)]
    held = logs.t_ms >= cut
    if held.all():  # every interaction at one instant: hold out the last rows instead
        held = np.arange(n) >= int(n * (1 - holdout))
    train_idx, test_idx = np.flatnonzero(~held), np.flatnonzero(held)
    if len(train_idx) == 0:
        raise LogError("the log is too short to hold out its last part: add interactions")
    return train_idx, test_idx, test_idx


LOG_CONFIG = TrainConfig(
    dim=64,
    tower_epochs=40,
    tower_patience=3,
    tower_loss="softmax",
    rank_epochs=20,
    impressions=1,
)
"""Training on interaction logs: the softmax two-tower, as many passes over the log (at most
40) as do best on its validation rows (the training part's chronological tenth before the
held-out one)."""


def train_from_log(
    inter: Interactions,
    items: ItemTable,
    out_dir: Path,
    progress: Callable[[str], None],
    cfg: TrainConfig = LOG_CONFIG,
    negatives: int = 4,
    holdout: float = 0.1,
) -> dict:
    """Train the starting rows and both ranking models on ``inter``; returns the manifest
    (its ``source`` is ``log:<fingerprint>``)."""
    if negatives < 1:
        raise ValueError(f"negatives must be at least 1, got {negatives}")
    rng = np.random.default_rng(cfg.seed)
    progress(f"labelling {len(inter):,} interactions, {negatives} sampled negatives each")
    logs = training_log(inter, items, negatives, rng, source=f"log:{fingerprint(inter)}")
    split = chronological_split(logs, holdout)
    return train(logs, replace(cfg, impressions=len(logs.users)), out_dir, progress, rng, split)
