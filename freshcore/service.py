"""The one shape of every long-running part of FreshRec (faust's ``mode.Service``, cut to
what a poll loop needs): ``start`` once, ``poll_once`` until asked to stop, ``close`` once
whatever happened — told whether the loop ended cleanly (a clean end commits what is done; a
failure commits nothing, so the work is read again after a restart). The worker, the
parameter server and the streams app's validate and catalogue stages are ``Service``s; the
faust count stage is faust's (``mode``) own. A Redis outage is waited out the same way in all
of them (``wait_for_redis``, ``freshcore/outage.py``)."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import ClassVar, TypeVar

from freshcore.health import HEALTH
from freshcore.outage import until_redis_answers

T = TypeVar("T")


class Service(abc.ABC):
    name: ClassVar[str] = "service"
    beats: ClassVar[bool] = True
    """Each round beats the process's liveness (``freshcore/health.py``); a stage on a side
    thread of a process whose main loop beats says False."""

    _stop: threading.Event | None = None

    @property
    def stopping(self) -> bool:
        """Asked to stop (a long wait inside a round checks it)."""
        return self._stop is not None and self._stop.is_set()

    def start(self) -> None:  # noqa: B027  a hook: most services need nothing before
        """Connect, load, subscribe: what comes before the first round."""

    @abc.abstractmethod
    def poll_once(self) -> None:
        """One round of the loop: take what arrived, work on it."""

    def close(self, clean: bool) -> None:  # noqa: B027  a hook
        """Release everything, once. ``clean``: the loop ended because it was asked to (commit
        what is done); else it failed (commit nothing)."""

    def run(self, stop: threading.Event) -> None:
        """``start``, rounds until ``stop`` is set, ``close``."""
        self._stop = stop
        self.start()
        clean = False
        try:
            while not stop.is_set():
                self.poll_once()
                if self.beats:
                    HEALTH.beat()
            clean = True
        finally:
            self.close(clean)

    def wait_for_redis(
        self, op: Callable[[], T], what: str, while_waiting: Callable[[bool], None] | None = None
    ) -> T:
        """``op()``, waiting out a Redis outage (``freshcore.outage.until_redis_answers``);
        asked to stop meanwhile, it raises ``StopRequested``."""
        return until_redis_answers(
            op, f"{self.name}: {what}", while_waiting=while_waiting, stop=self._stop
        )
