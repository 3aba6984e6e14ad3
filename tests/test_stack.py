"""The embedded stack's lifecycle, on Apache Kafka and on Tansu: up, status, down leaves no
process; a start that fails says why in one line and leaves nothing behind; which broker runs
and why."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from freshcore.settings import read_env_file
from freshrec.app.stack import (
    EmbeddedStack,
    StackError,
    choose_broker,
    external_services,
    pid_alive,
)
from freshrec.app.stack.kafkajars import kafka_release

from .conftest import LOCAL_BROKER, stack_broker

needs_kafka = pytest.mark.skipif(
    LOCAL_BROKER.kind != "kafka", reason=f"Apache Kafka cannot run here: {LOCAL_BROKER.line}"
)


def processes_naming(text: str) -> list[int]:
    """PIDs whose command line names ``text`` (a stack's folder, a fake binary)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if text.encode() in cmd and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def assert_nothing_left(state_dir: Path) -> None:
    """No process of the stack, no stack state, no broker data."""
    assert not processes_naming(str(state_dir)), "a process of the failed start still runs"
    assert not (state_dir / "stack.json").exists() and not (state_dir / "stack.env").exists()
    assert not (state_dir / "kafka").exists()


@pytest.mark.tansu
def test_up_status_down_leaves_no_process(tmp_path, broker):
    stack = EmbeddedStack(tmp_path)
    state = stack.up(broker=stack_broker(broker))
    try:
        env = read_env_file(tmp_path / "stack.env")
        assert env == state.env
        assert env["FRESHREC_KAFKA_PROFILE"] == state.broker  # the profile that suits it
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
    assert_nothing_left(tmp_path)


@needs_kafka
def test_three_brokers_replicate_and_stop_together(tmp_path):
    """``--brokers 3``: three nodes, every partition on all three, a write acknowledged by
    the in-sync replicas, and ``down`` stops the three at once."""
    stack = EmbeddedStack(tmp_path)
    state = stack.up(broker="kafka", brokers=3)
    try:
        assert [b.name for b in state.brokers] == ["kafka", "kafka2", "kafka3"]
        bootstrap = state.env["KAFKA_BOOTSTRAP_SERVERS"]
        assert bootstrap.count(",") == 2
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic("replicated", 2)])["replicated"].result(30)
        parts = admin.list_topics("replicated", timeout=10).topics["replicated"].partitions
        assert {len(p.replicas) for p in parts.values()} == {3}
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
        errors = []
        producer.produce("replicated", b"x", on_delivery=lambda err, msg: errors.append(err))
        assert producer.flush(30) == 0 and errors == [None]
        assert stack.status().count("running") == 4
    finally:
        stopped = stack.down()
    assert [s.split()[0] for s in stopped] == ["kafka", "kafka2", "kafka3", "redis"]
    assert not any(pid_alive(p.pid) for p in state.processes)
    assert_nothing_left(tmp_path)


def test_a_taken_port_is_refused_with_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError, match=f"port {port} for the broker is already in use"):
            EmbeddedStack(tmp_path).up(kafka_port=port)


@needs_kafka
def test_a_port_taken_under_apache_kafka_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    """The port is taken after the stack found it free (as when another process binds it
    while the JVM starts): the broker's own reason, in one line, and nothing left."""
    monkeypatch.setattr("freshrec.app.stack.embedded.port_is_free", lambda port: True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StackError) as failed:
            EmbeddedStack(tmp_path).up(broker="kafka", kafka_port=port, timeout_s=90)
    message = str(failed.value)
    assert "\n" not in message
    assert f"127.0.0.1:{port}: Address already in use" in message, message
    assert_nothing_left(tmp_path)


def fake_program(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / name
    fake.write_text("#!/bin/sh\n" + script + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def only_on_path(monkeypatch, folder: Path) -> None:
    """PATH is ``folder`` alone: no java, no mvn but the fakes there."""
    monkeypatch.setenv("PATH", str(folder))


@pytest.mark.parametrize(
    "java, reason",
    [
        (None, "no java on PATH"),
        ("echo 'openjdk version \"11.0.2\" 2019-01-15' >&2", "java 11.0.2 on PATH is older than"),
        ("echo 'Error: could not open libjvm.so' >&2; exit 1", "does not run: Error: could not"),
    ],
    ids=["absent", "too-old", "unreadable"],
)
def test_without_a_java_that_runs_kafka_auto_is_tansu_and_kafka_says_why(
    tmp_path, monkeypatch, java, reason
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if java is not None:
        fake_program(bin_dir, "java", java)
    only_on_path(monkeypatch, bin_dir)
    chosen = choose_broker("auto")
    assert chosen.kind == "tansu" and reason in chosen.line
    assert chosen.line.startswith("broker: Tansu (embedded): ")
    with pytest.raises(StackError, match=reason):
        EmbeddedStack(tmp_path / "state").up(broker="kafka")
    assert_nothing_left(tmp_path / "state")


@needs_kafka
def test_cached_jars_start_without_maven(monkeypatch, tmp_path):
    """A second start asks nothing of Maven: with the jars cached, no mvn is needed."""
    java_dir = Path(LOCAL_BROKER.java.path).parent
    only_on_path(monkeypatch, java_dir)
    chosen = choose_broker("kafka")
    assert chosen.kind == "kafka" and chosen.line.endswith(", jars cached)"), chosen.line


@needs_kafka
@pytest.mark.parametrize(
    "mvn, reason",
    [
        (None, "no mvn on PATH to fetch Apache Kafka"),
        (
            "echo '[ERROR] Failed to execute goal: Could not transfer artifact: Unknown host'; "
            '/bin/mkdir -p "$(echo "$@" | /bin/sed \'s/.*-DoutputDirectory=//\')"; exit 1',
            "mvn could not fetch Apache Kafka 4.4.0: Failed to execute goal: Could not "
            "transfer artifact: Unknown host",
        ),
    ],
    ids=["no-maven", "maven-unreachable"],
)
def test_jars_that_cannot_be_fetched_say_why_and_leave_no_half_fetch(
    tmp_path, monkeypatch, mvn, reason
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(LOCAL_BROKER.java.path)
    if mvn is not None:
        fake_program(bin_dir, "mvn", mvn)
    only_on_path(monkeypatch, bin_dir)
    with pytest.raises(StackError) as failed:
        choose_broker("kafka", may_fetch=True)
    assert reason in str(failed.value) and "\n" not in str(failed.value)
    release = kafka_release()
    assert not release.lib.exists() and not release.lib.with_name("lib.partial").exists()
    auto = choose_broker("auto", may_fetch=True)
    assert auto.kind == "tansu" and reason in auto.line


@needs_kafka
def test_a_test_never_fetches(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(StackError, match="is not fetched yet"):
        choose_broker("kafka", may_fetch=False)


def test_stack_fetch_says_first_which_broker_runs_and_why(tmp_path):
    env = {**os.environ, "FRESHREC_HOME": str(tmp_path)}
    env.pop("FRESHREC_BROKER", None)
    out = subprocess.run(
        [sys.executable, "-m", "freshrec.app.cli", "stack", "fetch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == LOCAL_BROKER.line
    bare = {**env, "PATH": str(tmp_path / "empty")}
    out = subprocess.run(
        [sys.executable, "-m", "freshrec.app.cli", "stack", "fetch"],
        env=bare,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.splitlines()[0] == "broker: Tansu (embedded): no java on PATH"


def test_three_brokers_need_apache_kafka(tmp_path):
    with pytest.raises(StackError, match="--brokers 3 needs Apache Kafka"):
        EmbeddedStack(tmp_path).up(broker="tansu", brokers=3)


def test_a_missing_broker_binary_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(StackError, match="Tansu broker binary could not be resolved"):
        EmbeddedStack(tmp_path).up(broker="tansu")


def fake_broker(tmp_path, monkeypatch, script: str):
    """A shell script standing in for the Tansu binary."""
    fake = fake_program(tmp_path, "tansu", script)
    monkeypatch.setenv("CALF_TANSU_BIN", str(fake))
    return fake


def test_a_service_that_never_answers_times_out_and_is_cleaned_up(tmp_path, monkeypatch):
    fake = fake_broker(tmp_path, monkeypatch, "exec sleep 60")
    with pytest.raises(StackError, match="did not accept connections"):
        EmbeddedStack(tmp_path / "state").up(broker="tansu", timeout_s=0.5)
    assert not (tmp_path / "state" / "stack.json").exists()
    assert not processes_naming(str(fake)), "the timed-out broker was left running"


def test_a_broker_that_exits_at_start_reports_its_log(tmp_path, monkeypatch):
    fake_broker(tmp_path, monkeypatch, "echo 'address in use' >&2\nexit 3")
    with pytest.raises(StackError, match="exited with code 3 at start: address in use"):
        EmbeddedStack(tmp_path / "state").up(broker="tansu", timeout_s=5)


def test_external_services_need_both_variables():
    assert external_services({}) is False
    assert external_services({"KAFKA_BOOTSTRAP_SERVERS": "k:1", "REDIS_URL": "redis://r"})
    with pytest.raises(StackError, match="REDIS_URL must be set too"):
        external_services({"KAFKA_BOOTSTRAP_SERVERS": "k:1"})
