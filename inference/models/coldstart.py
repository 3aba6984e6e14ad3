"""Starting rows for items nothing has been learnt about yet. Pure.

A row made from the item's id alone (``schemas.rows.initial_rows``) is a random point: vector
recall does not find the item and the rankers' u·v feature says nothing, until clicks move
it. What is known of a new item at once is its category, so its row starts at the mean row of
the learnt items of that category (plus a small offset from its id, so that a category's new
items are not one point): a new thriller is recalled for users whose rows point at
thrillers from its first request. Items of no known category, or of a category without any
learnt item, keep their id row.

The worker applies it to catalogue items it holds no learnt row for and writes the start to
Redis (where no row exists), so the parameter server learns on from it and every worker
starts from the same row; offline training applies it to the catalogue's items that had no
positive interaction to learn from (``train.train``).

>>> rows = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 0.0], [9.0, 9.0]])
>>> start, changed = category_starts(
...     rows, torch.tensor([0, 0, 0, 1]), learnt=torch.tensor([True, True, False, False]),
...     jitter=torch.zeros(4, 2), buckets=2)
>>> start[2].tolist(), changed.tolist()
([2.0, 1.0], [False, False, True, False])
"""

from __future__ import annotations

import torch

UNKNOWN_CATEGORY = "unknown"
"""The category of items whose category nobody said (the log reader's, when the item file does
not name an item): not a category to start from."""


def known_category(name: str | None) -> bool:
    """Whether a category name is one to start from (not absent, empty or ``unknown``)."""
    return bool(name) and name != UNKNOWN_CATEGORY


JITTER = 0.1
"""The id row's share in a start: ``initial_rows`` have a spread of 0.1 a dimension, so a
start lies about 0.01 a dimension from its category's mean."""


def category_starts(
    rows: torch.Tensor,
    category: torch.Tensor,
    learnt: torch.Tensor,
    jitter: torch.Tensor,
    buckets: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` with each row that is not ``learnt`` and whose category (``0..buckets-1``;
    negative: unknown) has learnt rows replaced by that category's mean learnt row plus
    ``JITTER * jitter`` (its id row); and the mask of the rows replaced. Works on the device
    the tensors are on, without a host round trip."""
    category = category.to(rows.device, torch.long)
    learnt = learnt.to(rows.device)
    known = category >= 0
    use = learnt & known
    sums = torch.zeros(buckets, rows.shape[1], dtype=rows.dtype, device=rows.device)
    sums.index_add_(0, category[use], rows[use])
    counts = torch.zeros(buckets, dtype=rows.dtype, device=rows.device)
    counts.index_add_(0, category[use], torch.ones_like(category[use], dtype=rows.dtype))
    where = category.clamp(min=0)
    changed = ~learnt & known & (counts[where] > 0)
    means = sums[where] / counts[where].clamp(min=1).unsqueeze(1)
    start = means + JITTER * jitter.to(rows.device, rows.dtype)
    return torch.where(changed.unsqueeze(1), start, rows), changed
