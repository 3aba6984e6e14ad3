"""The embedded stack's lifecycle: up, status, down leaves no process; clear errors."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import redis
from confluent_kafka.admin import AdminClient

from freshcore.settings import read_env_file
from freshrec.app.stack import EmbeddedStack, StackError, external_services, pid_alive


def test_up_status_down_leaves_no_process(tmp_path):
    stack = EmbeddedStack(tmp_path)
    state = stack.up()
    try:
        env = read_env_file(tmp_path / "stack.env")
        assert env == state.env
        assert redis.Redis.from_url(env["REDIS_URL"]).ping()
        AdminClient({"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"]}).list_topics(timeout=5)
        status = stack.status()
        assert status.count("running") == 2
        assert f"127.0.0.1:{state.kafka.port}" in status
        assert stack.up().kafka.pid == state.kafka.pid  # a second up reuses the running stack
    finally:
        stopped = stack.down()
    assert len(stopped) == 2
    assert not pid_alive(state.kafka.pid) and not pid_alive(state.redis.pid)
    assert not (tmp_path / "stack.env").exists()
    assert "not running" in stack.status()


def test_a_taken_port_is_refused_with_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError, match=f"port {port} for the broker is already in use"):
            EmbeddedStack(tmp_path).up(kafka_port=port)


def test_a_missing_broker_binary_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(StackError, match="Tansu broker binary could not be resolved"):
        EmbeddedStack(tmp_path).up()


def fake_broker(tmp_path, monkeypatch, script: str):
    """A shell script standing in for the Tansu binary."""
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\n" + script + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CALF_TANSU_BIN", str(fake))
    return fake


def test_a_service_that_never_answers_times_out_and_is_cleaned_up(tmp_path, monkeypatch):
    fake = fake_broker(tmp_path, monkeypatch, "exec sleep 60")
    with pytest.raises(StackError, match="did not accept connections"):
        EmbeddedStack(tmp_path / "state").up(timeout_s=0.5)
    assert not (tmp_path / "state" / "stack.json").exists()
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        assert str(fake).encode() not in cmd, "the timed-out broker was left running"


def test_a_broker_that_exits_at_start_reports_its_log(tmp_path, monkeypatch):
    fake_broker(tmp_path, monkeypatch, "echo 'address in use' >&2\nexit 3")
    with pytest.raises(StackError, match="exited with code 3 at start: address in use"):
        EmbeddedStack(tmp_path / "state").up(timeout_s=5)


def test_external_services_need_both_variables():
    assert external_services({}) is False
    assert external_services({"KAFKA_BOOTSTRAP_SERVERS": "k:1", "REDIS_URL": "redis://r"})
    with pytest.raises(StackError, match="REDIS_URL must be set too"):
        external_services({"KAFKA_BOOTSTRAP_SERVERS": "k:1"})
