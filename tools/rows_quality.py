"""What the rows alone know, apart from recall and ranking (``tools/bench_freshness.py``
measures it at the start and the end of each arm): the click-through rate of each user's ten
best items by u·v beside that of their truly best ten, by the world's ground truth."""

from __future__ import annotations

import numpy as np

from freshcore.kafka import gradients_partitions
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.rowstore import fetch_rows
from freshrec.sim.world import World
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows, width


def top_k_ctr(world: World, users: np.ndarray, scores: np.ndarray, t_ms: int, k: int = 10) -> float:
    """Mean click probability, by the world's ground truth at ``t_ms``, of each user's ``k``
    items of highest ``scores`` (users × items)."""
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return float(world.click_probability(np.repeat(users, k), top.ravel(), t_ms).mean())


def true_scores(world: World, users: np.ndarray, t_ms: int, chunk: int = 25) -> np.ndarray:
    """Click probabilities of every item for each user (users × items)."""
    items = np.arange(world.config.n_items)
    out = np.empty((len(users), len(items)), np.float32)
    for lo in range(0, len(users), chunk):
        part = users[lo : lo + chunk]
        p = world.click_probability(np.repeat(part, len(items)), np.tile(items, len(part)), t_ms)
        out[lo : lo + len(part)] = p.reshape(len(part), len(items))
    return out


def rows_in_redis(conn, world: World, users: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The cohort's user rows and every item's row (``dim`` + 1 wide) as Redis holds them
    (the parameter server's; the deterministic initial row where it holds none)."""
    r = connect(conn.redis_url)
    keys, w = RedisKeys(conn.topic_prefix), width(dim)
    shards = gradients_partitions(conn)
    try:
        out = []
        for table, names in (
            (TABLE_USER, [World.user_id(int(u)) for u in users]),
            (TABLE_ITEM, [World.item_id(i) for i in range(world.config.n_items)]),
        ):
            ids = row_ids(names)
            rows = initial_rows(ids, table, dim)
            found, held, _, _ = fetch_rows(r, keys, table, ids.tolist(), w, shards)
            rows[found] = held
            out.append(rows)
        return out[0], out[1]
    finally:
        r.close()


def rows_quality(
    conn, world: World, users: np.ndarray, t_ms: int, shown: set[int] | None = None, *, dim: int
) -> dict:
    """What the rows know, apart from recall and ranking: the CTR of each user's ten best
    items by u·v over the whole catalogue, next to the CTR of their ten truly best; with
    ``shown`` (items the loop showed), the same two among those items only — the items
    online learning had feedback on."""
    user_rows, item_rows = rows_in_redis(conn, world, users, dim)
    learned, truth = user_rows @ item_rows.T, true_scores(world, users, t_ms)
    out = {
        "rows_top10_ctr": round(top_k_ctr(world, users, learned, t_ms), 4),
        "ideal_top10_ctr": round(top_k_ctr(world, users, truth, t_ms), 4),
    }
    if shown and len(shown) >= 10:
        unseen = np.ones(world.config.n_items, bool)
        unseen[np.fromiter(shown, np.int64)] = False
        learned[:, unseen], truth[:, unseen] = -np.inf, -np.inf
        out["shown_items"] = len(shown)
        out["rows_top10_shown_ctr"] = round(top_k_ctr(world, users, learned, t_ms), 4)
        out["ideal_top10_shown_ctr"] = round(top_k_ctr(world, users, truth, t_ms), 4)
    return out
