"""A service started while Redis does not answer waits for it, as it waits out an outage
once running (``freshcore/outage.py``): it says so once, starts when Redis comes up, and a
stop asked for meanwhile ends it at once with status 0. The worker died of a redis-py
traceback there, the streams app's faust worker crashed, and the parameter server waited
but could be stopped only by the stop deadline."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
from pathlib import Path

import pytest

from freshrec.app.stack import free_port, redis_argv, redis_binary

from .streams_harness import service, wait_for

WAITING = "Redis unavailable"


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _nowhere(conn):
    """``conn`` with a Redis URL nothing answers at (yet): the port's number."""
    port = free_port()
    return dataclasses.replace(conn, redis_url=f"redis://127.0.0.1:{port}/0"), port


@pytest.mark.parametrize(
    "command,started",
    [("worker", "objects settled"), ("streams", "assigned events.by_item partitions")],
)
def test_a_service_started_before_redis_waits_and_starts_when_redis_comes_up(
    conn, tmp_path, command, started
):
    down, port = _nowhere(conn)
    log = tmp_path / f"{command}.log"
    with service(down, command, log, FRESHREC_METRICS_PORT="0") as proc:
        wait_for(lambda: WAITING in _text(log) or proc.poll() is not None, 90, "waiting")
        assert proc.poll() is None, _text(log)[-3000:]
        redis = subprocess.Popen(
            redis_argv(redis_binary(), port, tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(
                lambda: "Redis is back" in _text(log) and started in _text(log),
                90,
                f"{command} started once Redis answered",
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(45) == 0, _text(log)[-3000:]
        finally:
            redis.terminate()
            redis.wait(10)
    text = _text(log)
    assert "Traceback" not in text and "experienced a crash" not in text, text[-3000:]
    waits = [
        line.split("freshcore.outage: ", 1)[-1] for line in text.splitlines() if WAITING in line
    ]
    assert waits and len(waits) == len(set(waits)), "one line a wait, not one per attempt"


@pytest.mark.parametrize("command", ["worker", "param-server"])
def test_a_service_asked_to_stop_while_waiting_for_redis_stops_at_once(conn, tmp_path, command):
    down, _ = _nowhere(conn)
    log = tmp_path / f"{command}.log"
    # a grace far longer than the test waits: the stop must not come from the deadline
    with service(down, command, log, FRESHREC_METRICS_PORT="0", FRESHREC_STOP_GRACE_S="300") as p:
        wait_for(lambda: WAITING in _text(log) or p.poll() is not None, 90, "waiting")
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, _text(log)[-3000:]
    text = _text(log)
    assert "asked to stop while waiting for Redis" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
