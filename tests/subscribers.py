"""Connecting a ZMQ subscriber and waiting for its handshake, the event a test waits on before the publisher sends.

A PUB socket drops what it sends before a subscriber's subscription has reached it (ZMQ's slow joiner); the
subscription goes out as soon as the handshake is done. So a test connects, waits for that handshake (bounded by
`patient`, which stretches on a loaded machine) and only then makes the publisher send, instead of sleeping a fixed
fraction of a second that a loaded machine outlasts."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from radixkv.server.process.spawn import patient


def connect_and_handshake(sub: zmq.Socket, endpoint: str, timeout: float = 60.0) -> None:
    """`sub.connect(endpoint)`, returning once the handshake with the peer succeeded."""
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        if not monitor.poll(int((bound := patient(timeout)) * 1000)):
            raise AssertionError(f"no handshake with {endpoint} within {bound:.0f} s")
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close()
