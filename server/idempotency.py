"""Request ids: a mutating call retried with the same id is answered with its first result, not applied again.

A client that sees UNAVAILABLE or DEADLINE_EXCEEDED cannot tell whether its call was applied
(the server may have applied it and lost the response on the way back). With a request id it
retries safely: each session keeps a bounded window of its recent successful results by id,
and a repeat is answered from there. Only successes are kept: a refused call changed nothing, so
applying its repeat is as safe as applying it the first time.

The caller makes lookup, apply and record one step by holding the lock that serialises the
apply (the pool's lock for unary RPCs), so two copies of one request in flight at once apply it
once. The window's own lock is a leaf: it guards only its map and is never held while calling out.
A request id names one call: reused for a different method or pool it is refused, never answered
with another call's result.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Final, TypeVar

from radixkv.errors import InvalidArgument

T = TypeVar("T")

DEFAULT_MAX_RESULTS = 64  # per session; a client retries within seconds, long before 64 newer calls
DEFAULT_MAX_COST = 1 << 20  # per session, in the caller's units (tokens and slots held by results)
MISSING: Final = object()  # lookup found no result for the id


class RequestWindow:
    """One session's recent results by request id: at most `max_results` of them, costing at most `max_cost`.

    `cost` is what a result keeps alive (the caller counts tokens and slots), so a window of large
    results keeps fewer of them; a result costing more than `max_cost` on its own is not kept.
    """

    def __init__(self, max_results: int = DEFAULT_MAX_RESULTS, max_cost: int = DEFAULT_MAX_COST) -> None:
        self.max_results = max_results
        self.max_cost = max_cost
        self._results: collections.OrderedDict[int, tuple[str, object, int]] = collections.OrderedDict()
        self._cost = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._results)

    def lookup(self, request_id: int, call: str) -> object:
        """The first result of `request_id`, or `MISSING`.

        Raises:
            InvalidArgument: `request_id` was used by a different call (method or pool) of this session.
        """
        with self._lock:
            found = self._results.get(request_id)
        if found is None:
            return MISSING
        if found[0] != call:
            raise InvalidArgument("request_id", f"already names another call of this session ({found[0]})")
        return found[1]

    def record(self, request_id: int, call: str, result: object, cost: int = 1) -> None:
        """Keep `result` as `request_id`'s answer, dropping the oldest results past the bounds."""
        if cost > self.max_cost:
            return
        with self._lock:
            old = self._results.pop(request_id, None)
            if old is not None:
                self._cost -= old[2]
            self._results[request_id] = (call, result, cost)
            self._cost += cost
            while len(self._results) > self.max_results or self._cost > self.max_cost:
                _, (_, _, dropped) = self._results.popitem(last=False)
                self._cost -= dropped

    def once(self, request_id: int, call: str, apply: Callable[[], T], cost: Callable[[T], int] = lambda _: 1) -> T:
        """`apply()` unless `request_id` already has a result; request id 0 means none (always apply).

        Call it holding the lock that serialises `apply`, so lookup, apply and record are one step.
        """
        if not request_id:
            return apply()
        found = self.lookup(request_id, call)
        if found is not MISSING:
            return found  # type: ignore[return-value]  # recorded from this same call's apply()
        result = apply()
        self.record(request_id, call, result, cost(result))
        return result

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._results) <= self.max_results, "request window holds too many results"
            assert self._cost == sum(c for _, _, c in self._results.values()), "request window cost stale"
            assert self._cost <= self.max_cost, "request window over its cost bound"
