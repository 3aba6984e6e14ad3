"""The worker's serving mode while it runs: the one it started in (``FRESHREC_MODE``), then
the newest control record on the ``control`` topic (``modes.py``).

Every worker reads the topic's one partition from its start (outside any group: each worker
sees every record), so a worker that starts later adopts the mode the others serve in once
its first fetch arrives, and a switch reaches every worker within a poll of the broadcast
consumer. A record naming a mode this worker does not know is logged and counted, and the
mode it serves in stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from freshcore import metrics as m
from freshcore.topics import metadata
from schemas.codec import decode_control

log = logging.getLogger("freshrec.worker")


class LiveMode:
    def __init__(
        self, modes: Mapping[str, Any], start: str, apply: Callable[[str, Any], None]
    ) -> None:
        """``modes``: each mode's settings; ``apply(name, settings)`` puts one in use."""
        if start not in modes:
            raise ValueError(f"no such mode: {start!r}")
        self.modes = modes
        self.apply = apply
        self.current = ""
        self.newest_ms = -1
        """The write time of the record adopted last: an older one read later (a topic
        replayed from its start, two writers racing) does not switch back."""
        self._switch(start)

    def partitions(self, client, topic: str) -> list[TopicPartition]:
        """What to read of the control topic: its partition from the start, or nothing where
        the topic is missing (a deployment from before modes: the mode then stays)."""
        if topic not in metadata(client, 15).topics:
            log.warning("no %s topic: the serving mode stays %s", topic, self.current)
            return []
        return [TopicPartition(topic, 0, OFFSET_BEGINNING)]

    def on_record(self, raw: bytes | None) -> None:
        record = decode_control(raw)
        if record is None:
            m.MODE_RECORDS.labels("invalid").inc()
            log.warning("control topic: a record that is not a control record, skipped")
            return
        if record.at_ms < self.newest_ms:
            m.MODE_RECORDS.labels("older").inc()
            return
        if record.mode not in self.modes:
            m.MODE_RECORDS.labels("unknown_mode").inc()
            log.error(
                "control topic: mode %r (set by %s) is not one of %s; serving on in %s",
                record.mode,
                record.by or "?",
                ", ".join(sorted(self.modes)),
                self.current,
            )
            return
        self.newest_ms = record.at_ms
        if record.mode == self.current:
            m.MODE_RECORDS.labels("same").inc()
            return
        m.MODE_RECORDS.labels("adopted").inc()
        log.info("serving mode %s -> %s (set by %s)", self.current, record.mode, record.by or "?")
        self._switch(record.mode)

    def _switch(self, mode: str) -> None:
        self.apply(mode, self.modes[mode])
        if self.current:
            m.MODE_INFO.labels(self.current).set(0)
        m.MODE_INFO.labels(mode).set(1)
        self.current = mode
