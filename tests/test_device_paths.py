"""The worker's device paths where a GPU differs from a CPU, tested on the CPU: ranking time
as the device spends it (CUDA events, here a fake device's), so the ladder sees the real
cost and not the launch's.
"""

from __future__ import annotations

import time

import torch

from inference.serving.devicetime import BatchTotal, DeviceClock
from tools.devicerig import DeviceRig, RigConfig

CPU = torch.device("cpu")
SMALL = RigConfig(dim=8, users=200, items=500, requests=4, candidates=60)


class FakeDevice:
    """Timing events of a device that spends ``step_ms`` between one event recorded and the
    next, and has passed them only once ``done`` (a queued kernel the host does not wait
    for): ``events`` stands in for ``torch.cuda.Event``."""

    def __init__(self, step_ms: float) -> None:
        self.step_ms, self.now_ms, self.done = step_ms, 0.0, False

    def events(self, enable_timing: bool = True) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at_ms = device, None

    def record(self) -> None:
        self.device.now_ms += self.device.step_ms
        self.at_ms = self.device.now_ms

    def query(self) -> bool:
        return self.device.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_a_span_is_handed_on_once_the_device_has_passed_it_with_the_device_time():
    device = FakeDevice(step_ms=5000.0)
    clock = DeviceClock(CPU, events=device.events)
    got: list[float] = []
    t0 = time.monotonic()
    host_ms = clock.stop(clock.start(), got.append)
    assert host_ms <= (time.monotonic() - t0) * 1000 + 1  # the host's time, at once
    assert got == [] and clock.collect() == 0  # queued, not waited for
    device.done = True
    assert clock.collect() == 1 and got == [5000.0]  # the device's, the longer
    assert clock.collect() == 0


def test_a_batch_total_is_handed_on_once_every_part_is_in():
    got: list[float] = []
    total = BatchTotal(got.append)
    a, b = total.part(), total.part()
    a(1.0)
    b(2.0)
    assert got == []  # more parts may come until it is closed
    total.close()
    assert got == [3.0]
    empty = BatchTotal(got.append)
    empty.close()
    assert got == [3.0]  # nothing ranked: no cost


def test_the_ladder_sees_the_ranking_time_the_device_spent_not_the_launch():
    """A forward pass queued on a device returns at once; the full tier's cost the ladder
    reads is the events' time, once the device has passed them, not the host's."""
    rig = DeviceRig(CPU, SMALL)
    device = FakeDevice(step_ms=10_000.0)
    rig.ranking.clock = DeviceClock(CPU, events=device.events)
    choices, _ = rig.serve(rig.batch(), "wide_deep")
    assert {c.tier for c in choices} == {"full"}
    assert rig.ranking.full_cost_ms is None  # queued: the device has not passed it yet
    device.done = True
    rig.ranking.collect_costs()
    # the batch's span holds the model's: four events, three steps of the device
    assert rig.ranking.full_cost_ms == 30_000.0
    assert rig.ranking.light_cost_ms is None
    rig.serve(rig.batch(), "light")
    rig.ranking.collect_costs()
    assert rig.ranking.light_cost_ms == 30_000.0
