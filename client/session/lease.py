"""Keeping a session alive: a daemon thread renews the lease every third of its ttl."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from radixkv.errors import RadixKVError, UnknownSession

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Calls `renew` every `interval` seconds until stopped, or until the session is gone for good.

    A transient failure (server busy or briefly unreachable) is retried at the next tick; the lease
    outlives two missed renewals. Once the session has ended renewing stops; the client's next call
    then raises the same UnknownSession (or its subclass ServerRestarted).
    """

    def __init__(self, renew: Callable[[], object], interval: float) -> None:
        self._renew = renew
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._renew()
            except UnknownSession as e:  # ServerRestarted too
                log.warning("session lease lost", extra={"reason": e.reason})
                return
            except (RadixKVError, grpc.RpcError) as e:
                log.warning("lease renewal failed; retrying", extra={"error": repr(e)})
