"""An idle SWIM task's ticking thread is woken only when a timer it sleeps on moved.

A received message that moves no timer (a ping, answered at once, or the ack of a probe)
must not wake the thread that ticks the state machine: an idle task would otherwise pay a
thread wake-up for every message on top of its rounds (issue 33's idle cost).
"""

from __future__ import annotations

import threading

from conftest import wait_for

from clusterwire import swim
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.membership import View
from clusterwire.swim_driver import SwimDriver

# Rounds far apart, so that no timer of the state machine falls due during the test; a
# ping-req's nack is due 0.8 s after it comes (0.8 of what the round leaves after the probe).
CONFIG = swim.Config(probe_interval=600.0, probe_timeout=599.0)
VIEW = View.of(0, ClusterSpec({"w": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}))


class _CountedEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_messages_that_move_no_timer_do_not_wake_the_ticker():
    def send(address: str, data: bytes, timeout: float) -> bytes:
        return b""  # no peer answers: the test's messages are the only ones taken

    driver = SwimDriver(("w", 0), lambda: VIEW, send, CONFIG)
    driver._wake = wake = _CountedEvent()
    ticks = []
    driver.start()
    try:
        machine = driver._swim
        tick = machine.tick
        machine.tick = lambda now: ticks.append(now) or tick(now)
        wake.set()  # a tick through the wrapper: the ticker sleeps on its timers after it
        wait_for(lambda: ticks, timeout=30)
        wake.sets = 0
        for seq in range(1, 41):
            ping = swim.Message(swim.Kind.PING, seq, "w:1", "w:0")
            answer = swim.Message.from_bytes(driver.receive(("w", 1), ping.to_bytes()))
            assert (answer.kind, answer.seq, answer.sender) == (swim.Kind.ACK, seq, "w:0")
        assert wake.sets == 0
        # A ping-req sets a timer (its nack's), in 0.8 s: it wakes the ticker if that is
        # before the round the ticker sleeps until (the first round's start is random).
        before = machine.next_wakeup()
        request = swim.Message(swim.Kind.PING_REQ, 99, "w:1", "w:2")
        driver.receive(("w", 1), request.to_bytes())
        assert wake.sets == (1 if machine.next_wakeup() < before else 0)
    finally:
        driver.close()
