"""The streams process around the faust app: the stages that run beside it and faust's worker.

The validate stage runs in a child process (spawned) or on a thread, the catalogue stage on a
thread; a stage that fails takes the whole process down (``crash_on_error``, and the child's
watch in ``start_validate_process``), so a restart resumes from what Redis and the committed
offsets hold instead of faust running on without its input. faust's worker gets a deadline
on its stop (``faust_worker``): with the broker gone, its consumers' shutdown can wait on
fetches that never come back.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading

from freshcore.childmetrics import MergedRegistry
from freshcore.lifecycle import exit_if_not_stopped
from freshcore.outage import StopRequested
from streams.settings import StreamsSettings
from streams.validate import run_validate_process

log = logging.getLogger("freshrec.streams")


def crash_on_error(loop, stop: threading.Event, name: str) -> None:
    """A stage that fails must take the process down, not leave faust running without
    input: state is in Redis and a restart resumes from committed offsets."""
    try:
        loop(stop)
    except StopRequested:  # asked to stop while Redis was not answering: nothing committed
        log.info("the %s stage stopped while waiting for Redis", name)
    except BaseException:
        log.exception("the %s stage failed; exiting", name)
        logging.shutdown()
        os._exit(1)


def start_validate_process(
    settings: StreamsSettings, by_item_partitions: int, metrics: MergedRegistry
) -> None:
    """The validate stage as a child process (spawned: this process already runs librdkafka
    threads, which a fork would copy half-way). It stops with this process (SIGTERM at exit,
    or the kernel's parent-death signal after a SIGKILL); if it dies first, this process
    exits non-zero, as a failed stage thread would make it."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_validate_process,
        name="freshrec-streams-validate",
        daemon=True,
        args=(settings, by_item_partitions, os.getpid(), writer, logging.getLogger().level),
    )
    proc.start()
    writer.close()
    threading.Thread(
        target=metrics.receive, args=("validate", reader), daemon=True, name="validate-metrics"
    ).start()
    exiting = threading.Event()
    # runs before multiprocessing's own exit hook (registered earlier), which terminates
    # and joins daemonic children
    atexit.register(exiting.set)

    def watch() -> None:
        proc.join()
        if not exiting.is_set():
            log.error("the validate process exited with code %s; exiting", proc.exitcode)
            logging.shutdown()
            os._exit(1)

    threading.Thread(target=watch, daemon=True, name="validate-watch").start()
    log.info("validate stage: process %d", proc.pid)


#: the aiokafka loggers that log per attempt (``aiokafka`` is its client module's)
AIOKAFKA_LOGGERS = (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.cluster",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
)


def faust_worker(app, grace_s: float):
    """faust's worker for ``app``, with a deadline on its stop (``exit_if_not_stopped``):
    asked to stop while the broker is gone, its consumers' shutdown can wait on fetches
    that never come back."""
    from faust.worker import Worker

    class StreamsWorker(Worker):
        def _schedule_shutdown(self, signal) -> None:  # on the event loop, not in a handler
            exit_if_not_stopped(grace_s, "the streams app")
            super()._schedule_shutdown(signal)

    return StreamsWorker(app, loglevel="INFO", quiet=True, redirect_stdouts=False)
