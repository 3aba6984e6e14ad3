"""The extension point that makes faust's consumer fetch wait a setting.

faust-streaming 0.15 builds its aiokafka consumer with ``fetch_max_wait_ms=1500`` hard-coded.
On a broker that answers a waiting fetch only when that time runs out (the embedded Tansu
broker, see docs/operations.md) every batch then waits 1.5 s. ``FetchTunedApp`` swaps in a
transport whose consumer thread builds the same consumer and then sets the fetch wait before
the consumer starts (aiokafka reads it when it creates its fetcher in ``start()``).
``tests/test_streams_unit.py`` checks that the value reaches the fetcher, so a faust upgrade
that changes this path fails loudly instead of silently slowing down.
"""

from __future__ import annotations

from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka


class FetchTunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any):
        consumer = super()._create_worker_consumer(transport)
        wait_ms = getattr(self.app, "fetch_wait_max_ms", None)
        if wait_ms is not None:
            consumer._fetch_max_wait_ms = int(wait_ms)
        return consumer


class FetchTunedConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> FetchTunedConsumerThread:
        return FetchTunedConsumerThread(self, loop=self.loop, beacon=self.beacon)


class FetchTunedTransport(faust_aiokafka.Transport):
    Consumer = FetchTunedConsumer


class FetchTunedApp(faust.App):
    """A faust App whose consumer uses ``fetch_wait_max_ms`` instead of faust's 1500 ms."""

    fetch_wait_max_ms: int | None = None

    def _new_transport(self) -> FetchTunedTransport:
        return FetchTunedTransport(self.conf.broker_consumer, self)
