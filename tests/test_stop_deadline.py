"""A service asked to stop exits within ``FRESHREC_STOP_GRACE_S`` whatever it waits on: past
it, it logs where its threads were and exits with status 1 (``lifecycle.exit_if_not_stopped``).
The streams app with its broker gone stayed in faust's shutdown for a minute without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from freshcore.settings import SettingsError, stop_grace_s
from freshrec.app.stack import EmbeddedStack

from .streams_harness import wait_for


def test_the_grace_is_a_setting_and_zero_waits_as_long_as_it_takes():
    assert stop_grace_s({}) == 20.0
    assert stop_grace_s({"FRESHREC_STOP_GRACE_S": "0"}) == 0.0
    with pytest.raises(SettingsError, match="FRESHREC_STOP_GRACE_S=-1 must be >= 0"):
        stop_grace_s({"FRESHREC_STOP_GRACE_S": "-1"})


def test_a_service_that_does_not_stop_within_its_grace_exits_saying_where_it_was(tmp_path):
    child = textwrap.dedent(
        """
        import logging, signal, threading
        from freshcore.lifecycle import set_from_signal

        logging.basicConfig()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop, 0.5, "the test service"))
        print("ready", flush=True)
        stop.wait()

        def close_that_never_returns():
            threading.Event().wait()

        close_that_never_returns()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "the test service did not stop within 0.5 s" in err
    assert "in close_that_never_returns" in err  # every thread's stack, the stuck one's too


@pytest.mark.timeout(180)
def test_the_streams_app_asked_to_stop_with_its_broker_gone_exits_within_its_grace(tmp_path):
    stack = EmbeddedStack(tmp_path / "stack")
    state = stack.up(detach=False)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("FRESHREC_") and k != "REDIS_URL"
    }
    env.update(
        state.env,
        FRESHREC_HOME=str(tmp_path / "home"),
        FRESHREC_TOPIC_PREFIX="stop.",
        FRESHREC_KAFKA_SESSION_TIMEOUT_MS="3000",
        FRESHREC_STOP_GRACE_S="3",
        PYTHONUNBUFFERED="1",
    )
    cli = [sys.executable, "-m", "freshrec.app.cli"]
    log_path = tmp_path / "streams.log"
    try:
        subprocess.run([*cli, "topics", "create"], env=env, check=True, capture_output=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*cli, "streams"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_for(
                lambda: b"Worker ready" in log_path.read_bytes(),
                90,
                "the streams app to start",
            )
            os.kill(state.kafka.pid, signal.SIGKILL)
            proc.send_signal(signal.SIGTERM)
            # without the deadline: 61 s in faust's shutdown (2026-12-03)
            rc = proc.wait(45)
        finally:
            proc.kill()
            proc.wait(10)
    finally:
        stack.down()
    text = log_path.read_text(errors="replace")
    # a clean stop, or the deadline's: either way within the grace, never a hang
    assert rc == 0 or (rc == 1 and "the streams app did not stop within 3 s" in text), text[-3000:]
