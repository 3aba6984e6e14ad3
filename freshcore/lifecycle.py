"""Running a service loop until SIGTERM or SIGINT, with its metrics endpoint."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from freshcore.endpoints import serve_metrics
from freshcore.outage import STOP_SIGNALLED, StopRequested
from freshcore.settings import stop_grace_s

log = logging.getLogger("freshcore.lifecycle")

_stop_deadline_armed = threading.Lock()


def settle_heap() -> int:
    """Collect once, then take every surviving object out of the cyclic collector's reach;
    returns how many. A service holds ~10^5 long-lived objects once started (torch, faust,
    loaded tables), and a full collection walks them all: 250 ms measured in the worker, its
    worst event-lag stall. Frozen objects are still freed by reference counting; only a
    cycle among them would outlive its use, and start-up state lives as long as the process.
    Call it once, when the service has started."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def set_from_signal(
    event: threading.Event, grace_s: float = 0.0, name: str = "", whole_process: bool = False
) -> None:
    """Set ``event`` from a signal handler. The handler runs on the main thread between two
    bytecodes, possibly while that thread holds the event's lock (inside ``wait`` or
    ``set``): setting it right there would wait for itself forever, so another thread sets
    it. With ``grace_s`` the process also has that long to stop (``exit_if_not_stopped``);
    with ``whole_process`` the signal stops the process, and waits that look at
    ``STOP_SIGNALLED`` (a broker's metadata at start) end too."""

    def signalled() -> None:
        if whole_process:
            STOP_SIGNALLED.set()
        event.set()
        exit_if_not_stopped(grace_s, name)

    threading.Thread(target=signalled, daemon=True, name="signalled").start()


def stop_on_signals(stop: threading.Event, grace_s: float, name: str) -> None:
    """SIGTERM and SIGINT set ``stop`` and stop the whole process (``set_from_signal``), with
    ``grace_s`` to finish."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: set_from_signal(stop, grace_s, name, whole_process=True))


def exit_if_not_stopped(grace_s: float, name: str) -> None:
    """Give a stopping process ``grace_s`` seconds (``FRESHREC_STOP_GRACE_S``; 0: forever):
    if it is still running then — a close waiting on a broker that is gone, a thread that
    does not end, an exit hook joining a child that hangs — log so, dump every thread's
    stack to stderr (where it was stuck) and exit with status 1 at once. Nothing is lost by
    that: a service commits an offset only once its work is written, so what was not
    committed is read again by the next owner. Armed once per process; later calls do
    nothing."""
    if grace_s <= 0 or not _stop_deadline_armed.acquire(blocking=False):
        return

    def expire() -> None:
        log.error(
            "%s did not stop within %g s of being asked to (FRESHREC_STOP_GRACE_S): exiting "
            "without finishing; its threads were at:",
            name or "the service",
            grace_s,
        )  # a stream handler flushes each record: the line is out before the stacks
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)

    timer = threading.Timer(grace_s, expire)
    timer.daemon = True
    timer.name = "stop-deadline"
    timer.start()


def run_until_signalled(
    name: str,
    loop: Callable[[threading.Event], None],
    metrics_port: int,
    redis_url: str | None = None,
) -> int:
    """Serve metrics and health (readiness pings ``redis_url``), run ``loop(stop)``;
    SIGTERM/SIGINT set ``stop`` for a clean exit, which has ``FRESHREC_STOP_GRACE_S`` to
    finish (``exit_if_not_stopped``)."""
    grace_s = stop_grace_s(os.environ)
    serve_metrics(metrics_port, redis_url=redis_url)
    stop = threading.Event()
    stop_on_signals(stop, grace_s, name)
    try:
        loop(stop)
    except StopRequested as exc:  # asked to stop while starting: no Redis or broker answering
        logging.getLogger(f"freshrec.{name}").info("%s stopped (%s)", name, exc)
        return 0
    logging.getLogger(f"freshrec.{name}").info("%s stopped", name)
    return 0


def die_with_parent(parent_pid: int, stop: threading.Event) -> None:
    """In a child process: set ``stop`` when the parent is gone, however it died. On Linux
    the kernel sends SIGTERM at the parent's death (``PR_SET_PDEATHSIG``; the caller's SIGTERM
    handler sets ``stop``); everywhere a thread also checks the parent pid every second.
    Without it a SIGKILLed service would leave its child in the consumer group."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # died before the prctl
        stop.set()

    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                stop.set()

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def lower_thread_priority(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority where the OS schedules threads on their own
    (Linux); elsewhere, or without permission, nothing changes."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
