"""Running a service loop until SIGTERM or SIGINT, with its metrics endpoint."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from freshrec.metrics import serve_metrics


def run_until_signalled(
    name: str, loop: Callable[[threading.Event], None], metrics_port: int
) -> int:
    """Serve metrics, run ``loop(stop)``; SIGTERM/SIGINT set ``stop`` for a clean exit."""
    serve_metrics(metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop(stop)
    logging.getLogger(f"freshrec.{name}").info("%s stopped", name)
    return 0
