"""What the Apache Kafka tests share: the marks that skip them where the session's broker is
not the local Apache Kafka (or where it cannot run), and a streams stage run on a thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from .conftest import LOCAL_BROKER, MAIN

on_apache_kafka = pytest.mark.skipif(
    MAIN != "kafka",
    reason=f"the session's broker is {MAIN}, not the local Apache Kafka ({LOCAL_BROKER.line})",
)
can_run_apache_kafka = pytest.mark.skipif(
    LOCAL_BROKER.kind != "kafka", reason=f"Apache Kafka cannot run here: {LOCAL_BROKER.line}"
)


@contextlib.contextmanager
def on_a_thread(stage, name: str) -> Iterator:
    """``stage.run(stop)`` on a thread while the block runs; its failure is raised on exit."""
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            stage.run(stop)
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    try:
        yield stage
    finally:
        stop.set()
        t.join(30)
        if errors:
            raise errors[0]
