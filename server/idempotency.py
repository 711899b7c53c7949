"""Request ids: a call retried with the same id returns its own first result or is refused; it never applies twice.

A client that sees UNAVAILABLE or DEADLINE_EXCEEDED cannot tell whether its call was applied
(the server may have applied it and lost the response on the way back), and a client whose stream
broke re-sends every step still unanswered. With a request id it retries safely: each session keeps
a window of its recent successful results by id, and a repeat is answered from there. Only
successes are kept: a refused call changed nothing, so applying its repeat is as safe as applying
it the first time.

Three rules keep a repeat from applying twice or answering for another request:
  - the window remembers a digest of each request's body (method, pool and every field but the
    ids, `request_key`): an id reused with another body is refused (INVALID_ARGUMENT, `request_id`);
  - a result too large to keep (`max_cost`) keeps its id and digest: a repeat is refused
    (FAILED_PRECONDITION), not applied again;
  - ids increase within a session (both clients number their calls 1, 2, ...), so an id at or below
    the highest one the window has dropped is refused as too old (FAILED_PRECONDITION), never taken
    for a new call. The window is sized above what a client can have in flight (the clients hold at
    most `client.step_stream.MAX_IN_FLIGHT` steps unanswered), so the steps a broken stream re-sends
    are all still in it.

The caller makes lookup, apply and record one step by holding the lock that serialises the apply
(the pool's lock), so two copies of one request in flight at once apply it once. The window's own
lock is a leaf: it guards only its map and is never held while calling out.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

from radixkv.errors import FailedPrecondition, InvalidArgument

T = TypeVar("T")

DEFAULT_MAX_RESULTS = 1024  # per session: four times the steps a client keeps unanswered, plus its unary calls
DEFAULT_MAX_COST = 1 << 20  # per session, in the caller's units (tokens and slots held by results)
MISSING: Final = object()  # lookup found no result for the id
_UNKEPT: Final = object()  # the id applied, but its result was too large to keep


class _Identified(Protocol):
    """A request message that may carry a request id (every mutating request, and SessionRequest)."""

    request_id: int
    session_id: str

    def SerializeToString(self, *, deterministic: bool = ...) -> bytes: ...  # noqa: N802 -- protobuf's name


@dataclasses.dataclass(frozen=True, slots=True)
class RequestKey:
    """A call's request id (0: none) and the digest of its method and body: Python's keyed hash (SipHash, seeded
    per process, 64 bits), which a client cannot steer without the server's seed; an honest client never reuses
    an id with another body. 2-3 us for a decode step's 3 KB, where a cryptographic digest took 8-10 us."""

    request_id: int
    digest: int = 0


NO_REQUEST: Final = RequestKey(0)


def request_key(method: str, request: _Identified) -> RequestKey:
    """The request's id and the digest of its method and body, its ids left out (a step re-sent on a new stream
    may name its session or leave it to the stream). The request is as it was when this returns."""
    request_id = request.request_id
    if not request_id:
        return NO_REQUEST
    session_id = request.session_id
    request.request_id, request.session_id = 0, ""
    try:
        body = request.SerializeToString(deterministic=True)
    finally:
        request.request_id, request.session_id = request_id, session_id
    return RequestKey(request_id, hash((method, body)))


class RequestWindow:
    """One session's recent results by request id: at most `max_results` of them, costing at most `max_cost`.

    `cost` is what a result keeps alive (the caller counts tokens and slots), so a window of large
    results keeps fewer of them; a result costing more than `max_cost` alone keeps only its id.
    """

    def __init__(self, max_results: int = DEFAULT_MAX_RESULTS, max_cost: int = DEFAULT_MAX_COST) -> None:
        self.max_results = max_results
        self.max_cost = max_cost
        self._results: collections.OrderedDict[int, tuple[int, object, int]] = collections.OrderedDict()
        self._cost = 0
        self._floor = 0  # the highest id dropped from the window: ids up to it are too old
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._results)

    def lookup(self, request: RequestKey) -> object:
        """The first result of `request`'s id, or `MISSING` for an id never seen.

        Raises:
            InvalidArgument: the id named another request of this session (another method, pool or body).
            FailedPrecondition: the id applied and its result was not kept, or it is older than the window.
        """
        with self._lock:
            found = self._results.get(request.request_id)
            floor = self._floor
        if found is None:
            if request.request_id <= floor:
                raise FailedPrecondition(
                    f"request_id {request.request_id} is older than this session's window (ids up to {floor} are "
                    "forgotten): it may have applied; read the state back instead of retrying",
                    field="request_id",
                )
            return MISSING
        digest, result, _ = found
        if digest != request.digest:
            raise InvalidArgument("request_id", "already names another request of this session")
        if result is _UNKEPT:
            raise FailedPrecondition(
                f"request_id {request.request_id} applied, and its result was too large to keep for a retry",
                field="request_id",
            )
        return result

    def record(self, request: RequestKey, result: object, cost: int = 1) -> None:
        """Keep `result` as the answer to `request`'s id, dropping the oldest results past the bounds."""
        if cost > self.max_cost:
            result, cost = _UNKEPT, 0
        with self._lock:
            old = self._results.pop(request.request_id, None)
            if old is not None:
                self._cost -= old[2]
            self._results[request.request_id] = (request.digest, result, cost)
            self._cost += cost
            while len(self._results) > self.max_results or self._cost > self.max_cost:
                dropped_id, (_, _, dropped) = self._results.popitem(last=False)
                self._cost -= dropped
                self._floor = max(self._floor, dropped_id)

    def once(self, request: RequestKey, apply: Callable[[], T], cost: Callable[[T], int] = lambda _: 1) -> T:
        """`apply()` unless `request`'s id already has a result; request id 0 means none (always apply).

        Call it holding the lock that serialises `apply`, so lookup, apply and record are one step.
        """
        if not request.request_id:
            return apply()
        found = self.lookup(request)
        if found is not MISSING:
            return found  # type: ignore[return-value]  # recorded from this same request's apply()
        result = apply()
        self.record(request, result, cost(result))
        return result

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._results) <= self.max_results, "request window holds too many results"
            assert self._cost == sum(c for _, _, c in self._results.values()), "request window cost stale"
            assert self._cost <= self.max_cost, "request window over its cost bound"
