"""The current RPC's deadline, so the service never applies a call its client has stopped waiting for.

A call may wait for its pool's lock behind slower ones. If its deadline passes meanwhile, the
client has already seen DEADLINE_EXCEEDED; applying it then would change state the client
believes unchanged. So the servicer records each call's deadline here, and the service checks it
after taking the pool's lock and before applying anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

import grpc

from radixkv.errors import DeadlineExceeded

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("radixkv_deadline", default=None)
_NO_DEADLINE_SECONDS = 10**8  # grpc reports a call without a deadline as one this far away, or further


@contextlib.contextmanager
def call_deadline(context: grpc.ServicerContext) -> Iterator[None]:
    """Within: `check_deadline()` refers to this call's deadline (when it has one)."""
    remaining = context.time_remaining()
    deadline = None if remaining is None or remaining > _NO_DEADLINE_SECONDS else time.monotonic() + remaining
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_deadline() -> None:
    """Raises DeadlineExceeded when the current call's deadline has passed (nothing is applied after it)."""
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded()
