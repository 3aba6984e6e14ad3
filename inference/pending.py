"""Read-your-writes bookkeeping: the worker's local steps that the global row lacks. Pure.

A worker applies u ← u − lr·g to its cached row at once and sends g to the parameter server in
a gradient message. A row always maps to one ``gradients`` partition, and the parameter server
applies that partition's messages in offset order; every broadcast update says "these rows
include everything of partition p up to offset o". So, for each row, the worker keeps its
local steps (the deltas −lr·g) with the gradient message that carries them, and:

- on a broadcast update for the row from (p, o): the steps whose message was delivered at
  an offset ≤ o are included, and dropped; the serving row becomes the update's row plus the
  steps that remain;
- on a delivery report (p, o) for a message: if the row's last installed update already
  covers o, the step was included before the worker learnt its offset: it is dropped too, and
  removed from the serving row.

Exact: a step is in the serving row either through the global row or as a pending delta,
never both, never neither — provided the worker has processed the delivery reports of its
messages before it installs an update that might include them (``has_undelivered``): the
parameter server can only have applied a message the broker had acknowledged, so the worker
waits for its outstanding reports (milliseconds) before installing such a row.

>>> import numpy as np
>>> p = PendingSteps()
>>> p.record(("user", 1), np.array([0.5]), token=7)
>>> p.delivered(7, partition=0, offset=41)
[]
>>> p.on_install(("user", 1), partition=0, offset=40).tolist()    # not yet included
[0.5]
>>> p.on_install(("user", 1), partition=0, offset=41) is None      # now it is
True
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

RowRef = Hashable
"""A row: (table, row id)."""


class PendingSteps:
    def __init__(self) -> None:
        self._steps: dict[RowRef, list[list]] = {}  # row -> [[token, delta], ...]
        self._rows_of: dict[int, set[RowRef]] = {}  # token -> rows it carries
        self._delivered: dict[int, tuple[int, int]] = {}  # token -> (partition, offset)
        self._installed: dict[RowRef, tuple[int, int]] = {}  # row -> (partition, offset)
        self._count = 0  # steps held, kept current by _set (len() is read every poll)
        # token -> steps still held that travel in it: a token is forgotten when it reaches
        # 0 (counting, not scanning the token's rows: that was quadratic in a message's rows)
        self._open: dict[int, int] = {}
        # row -> its steps not sent yet (token None), the same step lists as in ``_steps``:
        # naming their message touches only them, not every step a hot row has pending
        self._unsent: dict[RowRef, list[list]] = {}

    def __len__(self) -> int:
        return self._count

    def rows(self) -> int:
        return len(self._steps)

    def record(self, row: RowRef, delta: np.ndarray, token: int | None) -> None:
        """A local step on ``row``; ``token`` names its gradient message (None: not sent yet)."""
        step = [token, delta]
        self._steps.setdefault(row, []).append(step)
        self._count += 1
        if token is None:
            self._unsent.setdefault(row, []).append(step)
        else:
            self._rows_of.setdefault(token, set()).add(row)
            self._open[token] = self._open.get(token, 0) + 1

    def record_many(
        self, table: int, ids: list[int], deltas: np.ndarray, token: int | None
    ) -> None:
        """``record`` of one step for each row ``(table, id)``, all in message ``token``
        (None: not sent yet, ``assign_many`` names the message later)."""
        rows = [(table, i) for i in ids]
        new = [[token, delta] for delta in list(deltas)]
        for book in (self._steps, self._unsent) if token is None else (self._steps,):
            get = book.get
            for row, step in zip(rows, new, strict=True):
                held = get(row)
                if held is None:
                    book[row] = [step]
                else:
                    held.append(step)
        self._count += len(rows)
        if token is not None:
            self._rows_of.setdefault(token, set()).update(rows)
            self._open[token] = self._open.get(token, 0) + len(rows)

    def assign_many(self, table: int, ids: list[int], token: int) -> None:
        """``assign`` for each row ``(table, id)``: its unsent steps travel in ``token``."""
        carried = self._rows_of.setdefault(token, set())
        pop = self._unsent.pop
        n = 0
        for i in ids:
            row = (table, i)
            unsent = pop(row, None)
            if unsent:
                for step in unsent:
                    step[0] = token
                carried.add(row)
                n += len(unsent)
        if n:
            self._open[token] = self._open.get(token, 0) + n
        else:
            del self._rows_of[token]

    def assign(self, row: RowRef, token: int) -> None:
        """Steps of ``row`` held back (admission) now travel in message ``token``."""
        unsent = self._unsent.pop(row, None)
        if unsent:
            for step in unsent:
                step[0] = token
            self._rows_of.setdefault(token, set()).add(row)
            self._open[token] = self._open.get(token, 0) + len(unsent)

    def delivered(self, token: int, partition: int, offset: int) -> list[tuple[RowRef, np.ndarray]]:
        """Record where message ``token`` landed; returns (row, delta) of steps that an
        installed update already included: subtract them from the serving rows."""
        self._delivered[token] = (partition, offset)
        included: list[tuple[RowRef, np.ndarray]] = []
        for row in self._rows_of.get(token, ()):
            installed = self._installed.get(row)
            if installed and installed[0] == partition and installed[1] >= offset:
                steps = self._steps.get(row, [])
                gone = [(row, s[1]) for s in steps if s[0] == token]
                included += gone
                self._open[token] -= len(gone)
                self._set(row, [s for s in steps if s[0] != token])
        self._forget_if_done(token)
        return included

    def failed(self, token: int) -> None:
        """The message was not delivered: its steps stay local, unsent (the global row will
        never include them)."""
        for row in self._rows_of.pop(token, ()):
            for step in self._steps.get(row, ()):
                if step[0] == token:
                    step[0] = -1
        self._open.pop(token, None)
        self._delivered.pop(token, None)

    def on_install(self, row: RowRef, partition: int, offset: int) -> np.ndarray | None:
        """A global update of ``row`` covering (partition, offset) was installed; returns the
        sum of the steps it does not include (None if none)."""
        self._installed[row] = (partition, offset)
        remaining, dropped = [], set()
        for step in self._steps.get(row, ()):
            where = self._delivered.get(step[0]) if step[0] is not None else None
            if where is not None and where[0] == partition and where[1] <= offset:
                dropped.add(step[0])
                self._open[step[0]] -= 1
                continue
            remaining.append(step)
        self._set(row, remaining)
        for token in dropped:
            self._forget_if_done(token)
        if not remaining:
            return None
        return np.sum([s[1] for s in remaining], axis=0)

    def among(self, table: int, ids: list[int]) -> list[int]:
        """Indices of the rows ``(table, id)`` that have local steps: only they need
        ``on_install``. A row without steps needs no bookkeeping on install: a step recorded
        later travels in a message produced later, at an offset the update cannot cover."""
        steps = self._steps
        return [j for j, i in enumerate(ids) if (table, i) in steps]

    def has_undelivered(self, row: RowRef) -> bool:
        """True if a step of ``row`` travels in a message whose offset is not known yet."""
        return any(
            s[0] is not None and s[0] >= 0 and s[0] not in self._delivered
            for s in self._steps.get(row, ())
        )

    def forget_row(self, row: RowRef) -> None:
        """The cache evicted ``row``: its bookkeeping goes with it."""
        steps = self._steps.pop(row, ())
        self._count -= len(steps)
        self._installed.pop(row, None)
        self._unsent.pop(row, None)
        for token, _ in steps:
            if token is not None and token >= 0:
                self._open[token] -= 1
                self._forget_if_done(token)

    def _set(self, row: RowRef, steps: list) -> None:
        self._count += len(steps) - len(self._steps.get(row, ()))
        if steps:
            self._steps[row] = steps
        else:
            self._steps.pop(row, None)

    def _forget_if_done(self, token: int) -> None:
        if not self._open.get(token):
            self._open.pop(token, None)
            self._rows_of.pop(token, None)
            self._delivered.pop(token, None)
