"""Repeated log lines, once per window: what a Kafka client says about a broker that is gone.

librdkafka (2.16) tries the bootstrap address again every ~50 ms while no broker answers, and
logs each refused connection: ~19 lines a second from each consumer, ~2,600 in a minute from
the streams app's processes; aiokafka (faust) adds its own failed fetches and metadata
requests. ``RepeatFilter`` lets the first line of a kind through, holds back the same line
for ``window_s``, and the next one through after the window says how many it held back. The
line's kind is its logger and its text without the parts that change from one attempt to the
next (``after 0ms in state CONNECT``, counts, addresses' ports are kept: they name the peer).

No I/O: the clock is passed in.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

#: the parts of a client's line that differ between two tellings of the same failure
_VARYING = re.compile(
    r"\(after \d+ms in state \w+(?:, \d+ identical error\(s\) suppressed)?\)"
    r"|\d+ms"
    r"|generation \d+"
)


def kind_of(text: str) -> str:
    """A line's kind: its text without what varies from one attempt to the next.

    >>> kind_of("Connect to ipv4#127.0.0.1:9 failed: Connection refused (after 0ms in state CONNECT)")
    'Connect to ipv4#127.0.0.1:9 failed: Connection refused'
    >>> kind_of("timed out after 3002ms") == kind_of("timed out after 3005ms")
    True
    """
    return _VARYING.sub("", text).strip()


class RepeatFilter(logging.Filter):
    """A ``logging.Filter``: each kind of line at most once per ``window_s``; the line that
    opens the next window tells how many were held back in the last. At most ``max_kinds``
    kinds are remembered (the least recently seen are forgotten: a line of a forgotten kind
    is let through as new)."""

    def __init__(
        self,
        window_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = 1024,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self.max_kinds = max_kinds
        self._kinds: OrderedDict[tuple[str, str], list] = OrderedDict()  # [opened, held]
        self._lock = threading.Lock()  # clients log from their own threads

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = (record.name, kind_of(text))
        with self._lock:
            held = self._admit(key, self.clock())
        if held is None:
            return False
        if held:
            record.msg = f"{text} (and {held} more like it in the last {self.window_s:g} s)"
            record.args = ()
        return True

    def held_back(self, logger: str, text: str) -> int:
        """How many lines of ``text``'s kind from ``logger`` are held back in its window."""
        with self._lock:
            seen = self._kinds.get((logger, kind_of(text)))
        return seen[1] if seen is not None else 0

    def _admit(self, key: tuple[str, str], now: float) -> int | None:
        """None: hold the line back; else let it through, having held back that many."""
        seen = self._kinds.get(key)
        if seen is not None and now - seen[0] < self.window_s:
            seen[1] += 1
            self._kinds.move_to_end(key)
            return None
        self._kinds[key] = [now, 0]
        self._kinds.move_to_end(key)
        while len(self._kinds) > self.max_kinds:
            self._kinds.popitem(last=False)
        return seen[1] if seen is not None else 0


def hold_repeats(loggers: Iterable[logging.Logger], window_s: float = 30.0) -> RepeatFilter:
    """One ``RepeatFilter`` on each of ``loggers`` (a filter on a logger sees the records
    logged on that logger, not on its children)."""
    f = RepeatFilter(window_s)
    for logger in loggers:
        logger.addFilter(f)
    return f
