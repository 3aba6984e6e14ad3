"""How long work queued on the device takes, as the device spends it, without making the host
wait for it.

A CUDA call returns once its kernels are queued: the host's clock around a forward pass
measures the launch, not the pass, and a ladder fed that would think the full model cheaper
than it is. ``DeviceClock`` puts a pair of CUDA events around the work and reads their time
once the device has passed the second (``collect``, at the next batch: by then the batch's
reply has been copied back, which waited for it), so no synchronise is added to the serving
path. On a CPU the work is done when the call returns, and the host's clock says at once.

>>> clock = DeviceClock(torch.device("cpu"))
>>> spent = []
>>> host_ms = clock.stop(clock.start(), spent.append)
>>> len(spent), spent[0] == host_ms
(1, True)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch

Done = Callable[[float], None]


class DeviceClock:
    """Spans of work on ``device``, timed as it spends them. ``events``: what makes a timing
    event (``torch.cuda.Event`` on CUDA, none on a CPU; a test's fake device gives its own)."""

    def __init__(self, device: torch.device, events: Callable | None = None) -> None:
        cuda = device.type == "cuda"
        self.events = events if events is not None else torch.cuda.Event if cuda else None
        self._queued: collections.deque = collections.deque()

    def start(self):
        """A span's start: the host's time, and on CUDA an event queued behind the work
        already on the stream."""
        if self.events is None:
            return time.monotonic(), None
        event = self.events(enable_timing=True)
        event.record()
        return time.monotonic(), event

    def stop(self, started, done: Done) -> float:
        """The span from ``started`` to now: ``done(ms)`` is given its time, now on a CPU,
        once the device has passed it on CUDA (``collect``: the most of the host's and the
        device's times). Returns the host's time, ms, which a caller needing one now uses."""
        t0, first = started
        host_ms = (time.monotonic() - t0) * 1000
        if first is None:
            done(host_ms)
            return host_ms
        last = self.events(enable_timing=True)
        last.record()
        self._queued.append((host_ms, first, last, done))
        return host_ms

    def collect(self) -> int:
        """``done`` for every span the device has passed (queried, never waited for);
        returns how many."""
        n = 0
        while self._queued and self._queued[0][2].query():
            host_ms, first, last, done = self._queued.popleft()
            done(max(host_ms, first.elapsed_time(last)))
            n += 1
        return n


class BatchTotal:
    """The sum of several spans' times, handed on once every one is in (``close`` says there
    are no more): the full tier's models of one batch, which the ladder budgets together.

    >>> got = []
    >>> total = BatchTotal(got.append)
    >>> a, b = total.part(), total.part()
    >>> a(2.0); total.close(); b(3.0)
    >>> got
    [5.0]
    """

    def __init__(self, done: Done) -> None:
        self.done = done
        self.ms = 0.0
        self.waiting = 0
        self.closed = False

    def part(self) -> Done:
        self.waiting += 1
        return self._add

    def _add(self, ms: float) -> None:
        self.ms += ms
        self.waiting -= 1
        self._hand_on()

    def close(self) -> None:
        self.closed = True
        self._hand_on()

    def _hand_on(self) -> None:
        if self.closed and self.waiting == 0 and self.ms > 0:
            self.done(self.ms)
            self.ms = 0.0
