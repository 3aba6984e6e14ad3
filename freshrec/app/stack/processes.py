"""The stack's child processes: spawned with their output in a log, waited on until their
port accepts connections, checked by PID, and stopped (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from freshrec.app.stack.errors import StackError
from freshrec.app.stack.ports import accepts
from freshrec.app.stack.state import ServiceProcess


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """In ``run`` mode children get SIGTERM if the parent dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], log_path: Path, *, detach: bool) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if detach else die_with_parent,
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


def pid_runs(proc: ServiceProcess) -> bool:
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
    stop_pids([pid], grace_s)


def stop_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM to every one at once, then SIGKILL to those still running after ``grace_s``.
    At once, because the last node of an Apache Kafka cluster, once the others have gone and
    its quorum with them, does not exit on SIGTERM."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = [p for p in pids if pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if pid_alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_ready(name: str, proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise StackError(
                f"{name} exited with code {proc.returncode} at start"
                + (f": {tail[0]}" if tail else "")
                + f" (log: {log})"
            )
        if accepts(port):
            return
        time.sleep(0.02)
    raise StackError(f"{name} did not accept connections on port {port} within {timeout_s}s")
