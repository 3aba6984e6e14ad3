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

import asyncio
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


async def _drain_messages(self, fetcher) -> None:  # pragma: no cover - exercised end to end
    """faust's ``Consumer._drain_messages`` (faust-streaming 0.15.3, BSD-3-Clause), with one
    change: while flow is running, a message is handed to the conductor with a plain ``await``
    instead of ``wait_first(callback, suspend_flow.wait())``, which builds two tasks and an
    ``asyncio.wait`` per message and caps faust at about 4k messages/s on two cores. When flow
    is suspended (a rebalance) the original abortable wait is used, as before."""
    from typing import cast

    from faust.transport.consumer import CONSUMER_FETCHING
    from mode import Service

    callback = self.callback
    getmany = self.getmany
    consumer_should_stop = cast(Service, self)._stopped.is_set
    fetcher_should_stop = cast(Service, fetcher)._stopped.is_set
    get_read_offset = self._read_offset.__getitem__
    set_read_offset = self._read_offset.__setitem__
    set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
    commit_every = self._commit_every
    acks_enabled_for = self.app.topics.acks_enabled_for
    suspended = self.suspend_flow.is_set
    yield_every, num_since_yield = 100, 0
    try:
        while not (consumer_should_stop() or fetcher_should_stop()):
            set_flag(CONSUMER_FETCHING)
            ait = getmany(timeout=1.0)
            await self.sleep(0)
            if not self.should_stop:
                async for tp, message in ait:
                    num_since_yield += 1
                    if num_since_yield > yield_every:
                        await asyncio.sleep(0)
                        num_since_yield = 0
                    offset = message.offset
                    r_offset = get_read_offset(tp)
                    if r_offset is None or offset >= r_offset:
                        gap = offset - (r_offset or 0)
                        if gap > 1 and r_offset and acks_enabled_for(message.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        if suspended():
                            await self.wait_first(callback(message), self.suspend_flow.wait())
                        else:
                            await callback(message)
                        set_read_offset(tp, offset)
                unset_flag(CONSUMER_FETCHING)
    except self.consumer_stopped_errors:
        if self.transport.app.should_stop:
            return
        raise
    except asyncio.CancelledError:
        if self.transport.app.should_stop:
            return
        raise
    finally:
        unset_flag(CONSUMER_FETCHING)


FetchTunedConsumer._drain_messages = _drain_messages
