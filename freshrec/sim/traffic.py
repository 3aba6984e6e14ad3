"""Synthetic behaviour as events: the world's ground truth turned into a stream. Pure.

Pure: no Kafka. ``EventSynthesizer.batch`` draws active users, shows each a slate of items
(half from the user's interests, half popular), and lets the world's click and conversion
model decide what happens.

>>> from freshrec.sim.world import World, WorldConfig
>>> s = EventSynthesizer(World(WorldConfig(seed=3, n_users=100, n_items=50)), seed=3)
>>> events = s.batch(4, now_ms=1_767_225_600_000)
>>> sum(e.event_type == "impression" for e in events)
40
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from freshrec.sim.world import World
from schemas.records import DEVICE_CLASSES, Event, Item


class EventSynthesizer:
    """Impressions, clicks and conversions drawn from the world's behaviour model."""

    def __init__(
        self, world: World, seed: int = 0, slate_size: int = 10, relevant_share: float = 0.5
    ) -> None:
        self.world = world
        self.rng = np.random.default_rng(seed)
        self.slate_size = slate_size
        self.relevant_share = relevant_share
        self._seq = 0
        self._prefix = f"s{seed}-"

    def batch(self, n_slates: int, now_ms: int) -> list[Event]:
        """``n_slates`` users each see a slate; returns events in time order."""
        w, rng, k = self.world, self.rng, self.slate_size
        users = w.sample_users(rng, n_slates)
        slate_users = np.repeat(users, k)
        main = np.repeat(w.user_main_category(users, now_ms), k)
        relevant = rng.random(n_slates * k) < self.relevant_share
        items = w.sample_popular_items(rng, n_slates * k)
        if relevant.any():
            items[relevant] = w.sample_category_items(rng, main[relevant])
        clicked = rng.random(len(items)) < w.click_probability(slate_users, items, now_ms)
        converted = np.zeros_like(clicked)
        if clicked.any():
            p_conv = w.conversion_probability(slate_users[clicked], items[clicked], now_ms)
            converted[clicked] = rng.random(int(clicked.sum())) < p_conv
        regions = w.user_region(users)
        devices = w.user_device(users)
        return self._events(users, items, clicked, converted, regions, devices, now_ms)

    def _events(self, users, items, clicked, converted, regions, devices, now_ms) -> list[Event]:
        k = self.slate_size
        region_names = self.world.config.regions
        out: list[Event] = []
        follow_ups: list[Event] = []
        for s, user in enumerate(users.tolist()):
            uid = World.user_id(user)
            region, device = region_names[regions[s]], DEVICE_CLASSES[devices[s]]
            self._seq += 1
            request_id = f"{self._prefix}{self._seq}"
            for pos in range(k):
                j = s * k + pos
                iid = World.item_id(int(items[j]))
                base = f"{request_id}-{pos}"
                out.append(
                    Event(
                        base + "i", "impression", uid, iid, now_ms, region, device, request_id, pos
                    )
                )
                if clicked[j]:
                    follow_ups.append(
                        Event(
                            base + "c", "click", uid, iid, now_ms, region, device, request_id, pos
                        )
                    )
                if converted[j]:
                    price = float(self.world.item_price[int(items[j])])
                    follow_ups.append(
                        Event(
                            base + "v",
                            "conversion",
                            uid,
                            iid,
                            now_ms,
                            region,
                            device,
                            request_id,
                            pos,
                            price,
                        )
                    )
        return out + follow_ups


def catalogue(world: World) -> Iterator[Item]:
    """Every item of the world as a catalogue record."""
    regions = world.config.regions
    for i in range(world.config.n_items):
        r = int(world.item_region[i])
        yield Item(
            item_id=World.item_id(i),
            category=f"c{int(world.item_category[i])}",
            price=float(world.item_price[i]),
            created_at_ms=int(world.item_created_ms[i]),
            region=regions[r] if r >= 0 else None,
        )
