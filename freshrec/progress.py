"""A live progress line: rewritten in place on a terminal, one line every few seconds in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    """Call ``update(text)`` as often as you like; it draws at most ``interval_s`` apart."""

    def __init__(self, stream: TextIO | None = None, interval_s: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 5.0)
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self.tty:
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text + " " * max(self._width - len(text), 0) + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._width = 0
