"""The machine's event bus (vbmc/machine/events.py): what the Redfish EventService and the IPMI SEL follow."""

from __future__ import annotations

from vbmc.machine import BootEnabled, BootOverride, BootTarget, PowerState, ResetType
from vbmc.machine.events import POWER_STATE_CHANGED, Event, EventBus
from vbmc.machine.memory import MemoryMachine


def test_power_changes_boot_and_media_actions_are_published_in_order() -> None:
    machine = MemoryMachine("vm1")
    heard: list[Event] = []
    machine.events.subscribe(heard.append)
    machine.set_boot_override(BootOverride(BootTarget.PXE, BootEnabled.ONCE))
    machine.reset(ResetType.ON)
    machine.insert_media("http://user:secret@images.example/boot.iso")
    machine.eject_media()
    machine.reset(ResetType.FORCE_OFF)
    reasons = [e.reason for e in heard]
    assert reasons == ["BootOverrideSet", "BootOverrideConsumed", POWER_STATE_CHANGED, "VirtualMediaInserted",
                       "VirtualMediaEjected", POWER_STATE_CHANGED]
    assert [e.seq for e in heard] == sorted(e.seq for e in heard)
    assert heard[2].detail == {"from": "Off", "to": "On"}
    assert heard[-1].detail == {"from": "On", "to": "Off"}
    assert "secret" not in heard[3].message  # image credentials never reach a subscriber
    assert all(e.timestamp > 1e9 for e in heard)  # wall-clock time, for Redfish EventTimestamp and the SEL


def test_an_unchanged_power_state_publishes_nothing() -> None:
    machine = MemoryMachine("vm1", power=PowerState.ON)
    heard: list[Event] = []
    machine.events.subscribe(heard.append)
    machine.reset(ResetType.ON)  # already on: no call, no change
    machine.notify_changed()
    assert heard == []


def test_late_consumers_catch_up_and_a_failing_listener_does_not_stop_the_others() -> None:
    bus = EventBus(history=3, clock=lambda: 1700000000.0)

    def broken(_: Event) -> None:
        raise RuntimeError("listener bug")

    heard: list[Event] = []
    bus.subscribe(broken)
    unsubscribe = bus.subscribe(heard.append)
    for n in range(5):
        bus.publish("Test", f"event {n}")
    assert [e.message for e in heard] == [f"event {n}" for n in range(5)]
    assert [e.seq for e in bus.since(0)] == [3, 4, 5]  # the history keeps the last three
    assert [e.seq for e in bus.since(4)] == [5]
    unsubscribe()
    bus.publish("Test", "after")
    assert len(heard) == 5
    assert bus.last_seq == 6
