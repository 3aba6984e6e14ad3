"""The gradient outbox: what a worker has learnt and not yet sent to the parameter server. Pure.

aiokafka's accumulator is the model. Each learnt slice adds, per table, its rows' gradient
sums, example counts, newest event times and the local steps (``pending.py`` indices) it took
on them; ``drain`` hands back message-sized ``GradientBatch``es — rows of one table bound for
one ``gradients`` partition (the murmur2 partition of the row key, as every producer of a row
chooses it), at most ``rows_per_message`` rows, summed per row across slices — each with the
local steps it carries. The caller decides nothing but when to ask: ``due`` says when the
linger has run out or too many rows wait.

In front sits admission (Monolith's occurrence filter, ``admission.py``): a row's gradients
are held back, summed in a ``HeldRow``, until its Nth touch; then everything held joins the
outbox. A row the filter forgets (unseen for a whole window) is dropped with its gradients;
``forget_unadmitted`` returns their steps, which will never be sent.

Time is passed in (milliseconds); nothing here reads a clock or does I/O.

>>> import numpy as np
>>> box = GradientOutbox(partitions=2, admission=AdmissionFilter(1, 1000), linger_ms=100)
>>> box.add(0, np.array([7, 9]), np.ones((2, 3), np.float32), np.array([1, 1]),
...         np.array([50, 60]), steps=np.array([0, 1]), now_ms=1_000)
0
>>> box.rows, box.due(1_050), box.due(1_100)
(2, False, True)
>>> box.add(0, np.array([7]), np.ones((1, 3), np.float32), np.array([2]), np.array([70]),
...         steps=np.array([2]), now_ms=1_060)
0
>>> sorted((int(b.partition), b.ids.tolist(), b.counts.tolist(), b.steps.tolist())
...        for b in box.drain())
[(0, [9], [1], [1]), (1, [7], [3], [0, 2])]
>>> box.rows, box.due(5_000)
(0, False)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from freshcore.partitioner import row_partitions
from inference.learning.admission import AdmissionFilter
from inference.learning.steps import aggregate, oldest_per_group

__all__ = ["AdmissionFilter", "GradientBatch", "GradientOutbox", "HeldRow"]


@dataclass
class HeldRow:
    """A row's gradients held back by admission: summed until the row is admitted."""

    sum: np.ndarray
    """The sum of its gradients so far."""
    count: int
    """Examples behind them."""
    newest_ms: int
    """The newest event time among them."""
    oldest_ms: int
    """The oldest event time among them."""
    steps: list[int] = field(default_factory=list)
    """The local steps (``pending.py`` indices) they carry."""


@dataclass(frozen=True)
class GradientBatch:
    """One gradient message's rows: one table, one ``gradients`` partition."""

    table: int
    partition: int
    ids: np.ndarray
    sums: np.ndarray
    counts: np.ndarray
    newest_ms: np.ndarray
    steps: np.ndarray
    """The local steps this message carries (``PendingSteps.assign`` names its message)."""
    oldest_ms: np.ndarray
    """Per row, the oldest event time its sum includes."""


@dataclass
class _Chunk:
    """Rows added at once; ``step_rows[j]`` is the row (in ``ids``) of step ``steps[j]``."""

    ids: np.ndarray
    sums: np.ndarray
    counts: np.ndarray
    newest_ms: np.ndarray
    step_rows: np.ndarray
    steps: np.ndarray
    oldest_ms: np.ndarray


class GradientOutbox:
    def __init__(
        self,
        partitions: int,
        admission: AdmissionFilter,
        linger_ms: int,
        max_rows: int = 20_000,
        rows_per_message: int = 1000,
    ) -> None:
        if partitions < 1 or rows_per_message < 1:
            raise ValueError("partitions and rows_per_message must be at least 1")
        self.partitions = partitions
        self.admission = admission
        self.linger_ms = linger_ms
        self.max_rows = max_rows
        """Rows waiting past which ``due`` does not wait for the linger."""
        self.rows_per_message = rows_per_message
        self.held: dict[tuple[int, int], HeldRow] = {}
        """(table, row id) → gradients held back for admission."""
        self._chunks: dict[int, list[_Chunk]] = defaultdict(list)
        self.rows = 0
        """Rows waiting (a row added twice counts twice until ``drain`` sums it)."""
        self._since_ms: int | None = None

    def add(
        self,
        table: int,
        ids: np.ndarray,
        sums: np.ndarray,
        counts: np.ndarray,
        newest_ms: np.ndarray,
        steps: np.ndarray,
        now_ms: int,
        oldest_ms: np.ndarray | None = None,
    ) -> int:
        """One slice's gradients of ``table``: distinct ``ids`` with their sums, example
        counts, newest event times, the local step each took and (by default the newest)
        oldest event times. Returns how many rows were held back for admission."""
        oldest_ms = newest_ms if oldest_ms is None else oldest_ms
        if self.admission.threshold == 1:  # every row admitted: no per-row bookkeeping
            chunk = _Chunk(ids, sums, counts, newest_ms, np.arange(len(ids)), steps, oldest_ms)
            held_back = 0
        else:
            chunk, held_back = self._admit(
                table, ids, sums, counts, newest_ms, steps, now_ms, oldest_ms
            )
        if len(chunk.ids):
            self._chunks[table].append(chunk)
            self.rows += len(chunk.ids)
            if self._since_ms is None:
                self._since_ms = now_ms
        return held_back

    def _admit(
        self, table, ids, sums, counts, newest_ms, steps, now_ms, oldest_ms
    ) -> tuple[_Chunk, int]:
        admitted: list[tuple[int, HeldRow]] = []
        for rid, g, c, t, step, t0 in zip(
            ids.tolist(),
            sums,
            counts.tolist(),
            newest_ms.tolist(),
            steps.tolist(),
            oldest_ms.tolist(),
            strict=True,
        ):
            ref = (table, rid)
            held = self.held.get(ref)
            if held is None:
                held = self.held[ref] = HeldRow(g.copy(), c, t, t0, [step])
            else:
                held.sum += g
                held.count += c
                held.newest_ms = max(held.newest_ms, t)
                held.oldest_ms = min(held.oldest_ms, t0)
                held.steps.append(step)
            if self.admission.touch(ref, now_ms):
                admitted.append((rid, self.held.pop(ref)))
        w = sums.shape[1]
        chunk = _Chunk(
            np.array([rid for rid, _ in admitted], np.int64),
            np.stack([h.sum for _, h in admitted]) if admitted else np.empty((0, w), sums.dtype),
            np.array([h.count for _, h in admitted], np.int64),
            np.array([h.newest_ms for _, h in admitted], np.int64),
            np.array([j for j, (_, h) in enumerate(admitted) for _ in h.steps], np.int64),
            np.array([s for _, h in admitted for s in h.steps], np.int64),
            np.array([h.oldest_ms for _, h in admitted], np.int64),
        )
        return chunk, len(ids) - len(admitted)

    def due(self, now_ms: int) -> bool:
        """Whether to drain now: rows wait and the linger has run out (or is 0), or more than
        ``max_rows`` wait."""
        if not self.rows:
            return False
        return self.rows >= self.max_rows or now_ms - self._since_ms >= self.linger_ms

    def drain(self) -> list[GradientBatch]:
        """Everything waiting, as message-sized batches; the outbox is empty afterwards."""
        out: list[GradientBatch] = []
        for table, chunks in self._chunks.items():
            if chunks:
                out += self._batches(table, chunks)
        self._chunks.clear()
        self.rows, self._since_ms = 0, None
        return out

    def _batches(self, table: int, chunks: list[_Chunk]) -> list[GradientBatch]:
        if len(chunks) == 1:
            c = chunks[0]
            ids, sums, counts, newest, steps = c.ids, c.sums, c.counts, c.newest_ms, c.steps
            oldest, row_of_step = c.oldest_ms, c.step_rows
        else:  # a row may be in several chunks (each chunk's ids differ): summed
            starts = np.cumsum([0] + [len(c.ids) for c in chunks[:-1]])
            g = aggregate(
                np.concatenate([c.ids for c in chunks]),
                np.concatenate([c.sums for c in chunks]),  # summed in the sums' float32
                np.concatenate([c.newest_ms for c in chunks]),
                np.concatenate([c.counts for c in chunks]),
            )
            ids, sums, counts, newest = g.keys, g.sums, g.counts, g.newest
            oldest = oldest_per_group(
                g.index, len(ids), np.concatenate([c.oldest_ms for c in chunks])
            )
            steps = np.concatenate([c.steps for c in chunks])
            row_of_step = g.index[
                np.concatenate([c.step_rows + s for c, s in zip(chunks, starts, strict=True)])
            ]
        parts = row_partitions(ids, self.partitions)
        order = np.argsort(parts, kind="stable")
        # each step's row's position in ``order``: steps grouped as their rows are, in order
        place = np.empty(len(ids), np.int64)
        place[order] = np.arange(len(ids))
        step_place = place[row_of_step]
        by_place = np.argsort(step_place, kind="stable")
        step_place = step_place[by_place]
        steps = steps[by_place]
        out = []
        most = self.rows_per_message
        bounds = [*(np.flatnonzero(np.diff(parts[order])) + 1).tolist(), len(ids)]
        lo = 0
        for hi in bounds:
            for start in range(lo, hi, most):
                stop = min(start + most, hi)
                rows = order[start:stop]
                s0, s1 = np.searchsorted(step_place, [start, stop])
                out.append(
                    GradientBatch(
                        table,
                        int(parts[rows[0]]),
                        ids[rows],
                        sums[rows],
                        counts[rows],
                        newest[rows],
                        steps[s0:s1],
                        oldest[rows],
                    )
                )
            lo = hi
        return out

    def forget_unadmitted(self, now_ms: int) -> dict[int, np.ndarray]:
        """Rows unseen for a whole admission window are forgotten with the gradients they
        held back; returns, per table, those gradients' local steps (never to be sent)."""
        gone: dict[int, list[int]] = defaultdict(list)
        for ref in self.admission.rotate(now_ms):
            held = self.held.pop(ref, None)
            if held is not None:
                gone[ref[0]] += held.steps
        return {table: np.asarray(steps, np.int64) for table, steps in gone.items()}

    def forget_steps(self, table: int, ids: list[int]) -> None:
        """Rows left the cache with their local steps: gradients they hold back stay, to be
        sent on admission, but no longer name those steps."""
        for rid in ids:
            held = self.held.get((table, rid))
            if held is not None:
                held.steps = []
