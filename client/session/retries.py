"""How both clients send a unary call: a refusal raised as radixkv's exception, and a mutating call retried.

A mutating call carries a request id. After UNAVAILABLE or DEADLINE_EXCEEDED the client cannot know
whether it was applied, so it re-sends it with the same id: the server answers a repeat with its
first result or refuses it, and never applies it twice (server/rules/sessions.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from radixkv.client.errors import error_from_rpc

Response = TypeVar("Response")
Metadata = tuple[tuple[str, str], ...] | None

RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
MAX_ATTEMPTS = 3


def retry_delay(attempt: int) -> float:
    """Seconds before re-sending after failed attempt `attempt` (0-based): 0.1, 0.2, ..."""
    return 0.1 * 2**attempt


def call(method: Callable[..., Response], request: Any, metadata: Metadata, timeout: float) -> Response:
    """One call; a refusal raised as its radixkv exception."""
    try:
        return method(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as e:
        raise error_from_rpc(e) from e


def apply(method: Callable[..., Response], request: Any, metadata: Metadata, timeout: float) -> Response:
    """A mutating call (its request id set), re-sent with the same id after UNAVAILABLE or DEADLINE_EXCEEDED."""
    for attempt in itertools.count():
        try:
            return method(request, metadata=metadata, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() not in RETRIED_CODES or attempt + 1 >= MAX_ATTEMPTS:
                raise error_from_rpc(e) from e
        time.sleep(retry_delay(attempt))
    raise AssertionError("unreachable")


async def call_async(
    method: Callable[..., Awaitable[Response]], request: Any, metadata: Metadata, timeout: float
) -> Response:
    """`call` on grpc.aio."""
    try:
        return await method(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as e:
        raise error_from_rpc(e) from e


async def apply_async(
    method: Callable[..., Awaitable[Response]], request: Any, metadata: Metadata, timeout: float
) -> Response:
    """`apply` on grpc.aio."""
    for attempt in itertools.count():
        try:
            return await method(request, metadata=metadata, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() not in RETRIED_CODES or attempt + 1 >= MAX_ATTEMPTS:
                raise error_from_rpc(e) from e
        await asyncio.sleep(retry_delay(attempt))
    raise AssertionError("unreachable")
