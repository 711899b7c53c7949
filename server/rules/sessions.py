"""Sessions and their leases: every sequence belongs to a session, and a session that stops renewing ends.

A session's lease runs `ttl` seconds from its last use (any RPC naming it, or KeepAlive), and never
runs out while a Session stream is open on it (the stream's end starts the ttl again). A reaper
thread ends sessions whose lease ran out; `on_end` then releases what they held. Session ids start
with this server instance's id, so an id from before a restart is told apart (SERVER_RESTARTED)
from one that never existed or has ended (UNKNOWN_SESSION). Each session's request window (`RequestWindow`:
a call retried with the same id is answered once) is below.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

from radixkv.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    ServerRestarted,
    UnknownSession,
)
from radixkv.server.rules.tenants import Tenant

# -- from rules/idempotency.py (merged, issue 41: one concept, one module):
# Request ids: a call retried with the same id returns its own first result or is refused; it never applies twice.
#
# A client that sees UNAVAILABLE or DEADLINE_EXCEEDED cannot tell whether its call was applied
# (the server may have applied it and lost the response on the way back), and a client whose stream
# broke re-sends every step still unanswered. With a request id it retries safely: each session keeps
# a window of its recent successful results by id, and a repeat is answered from there. Only
# successes are kept: a refused call changed nothing, so applying its repeat is as safe as applying
# it the first time.
#
# Three rules keep a repeat from applying twice or answering for another request:
#   - the window remembers a digest of each request's body (method, pool and every field but the
#     ids, `request_key`): an id reused with another body is refused (INVALID_ARGUMENT, `request_id`);
#   - a result too large to keep (no room in the bounds below) keeps its id and digest: a repeat is
#     refused (FAILED_PRECONDITION), not applied again;
#   - ids increase within a session (both clients number their calls 1, 2, ...), so an id at or below
#     the highest one the window has dropped is refused as too old (FAILED_PRECONDITION), never taken
#     for a new call. The window is sized above what a client can have in flight (the clients hold at
#     most `client.step_stream.MAX_IN_FLIGHT` steps unanswered), so the steps a broken stream re-sends
#     are all still in it.
#
# Windows are bounded in bytes, not only in results: each id and each kept result is counted at what it
# holds in server memory (`ENTRY_BYTES`, `retained_bytes`), against its session's bound
# (`max_request_window_bytes_per_session`), its tenant's share and the server's bound of every window
# together (`max_request_window_bytes`, `WindowBytes`). A window drops its own oldest results to make
# room; when even that leaves none, the call is refused before it applies (LIMIT_EXCEEDED naming the
# bound). A session's end gives its bytes back.
#
# The caller makes lookup, apply and record one step by holding the lock that serialises the apply
# (the pool's lock), so two copies of one request in flight at once apply it once. The window's own
# lock guards only its map and is never held while calling out, but into `WindowBytes`, whose lock is
# a leaf.

T = TypeVar("T")

DEFAULT_MAX_RESULTS = 1024  # per session: four times the steps a client keeps unanswered, plus its unary calls
DEFAULT_MAX_SESSION_BYTES = 16 << 20  # per session: 256 decode steps of 256 sequences' results
DEFAULT_MAX_BYTES = 1 << 30  # every session's window together; a tenant's share of it (`shares.py`) bounds its own
ENTRY_BYTES = 512  # what keeping one id costs besides its result: the map's entry, the id, the digest, a tuple
ID_BYTES = 40  # what a kept result costs per id or count it holds: a Python int in a list (36 B), rounded up
MISSING: Final = object()  # lookup found no result for the id
_UNKEPT: Final = object()  # the id applied, but its result was too large to keep


def retained_bytes(num_ids: int) -> int:
    """The most a kept result holding `num_ids` ids and counts costs in server memory (its entry aside)."""
    return ID_BYTES * num_ids


class WindowBytes:
    """The bytes every session's request window keeps, per tenant and in all: a window takes its bytes here before
    it keeps a result, and gives them back when it drops one or its session ends. Its lock is a leaf."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_bytes_per_tenant: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_tenant = max_bytes if max_bytes_per_tenant is None else max_bytes_per_tenant
        self.num_bytes = 0
        self._per_tenant: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, num_bytes: int) -> tuple[str, int, int] | None:
        """Take `num_bytes` for `tenant`; None, or (the limit, requested, allowed) that refuses them (nothing taken)."""
        with self._lock:
            held = self._per_tenant.get(tenant, 0)
            if held + num_bytes > self.max_bytes_per_tenant:
                return "max_request_window_bytes_per_tenant", held + num_bytes, self.max_bytes_per_tenant
            if self.num_bytes + num_bytes > self.max_bytes:
                return "max_request_window_bytes", self.num_bytes + num_bytes, self.max_bytes
            self._per_tenant[tenant] = held + num_bytes
            self.num_bytes += num_bytes
            return None

    def give(self, tenant: str, num_bytes: int) -> None:
        with self._lock:
            left = self._per_tenant[tenant] - num_bytes
            if left:
                self._per_tenant[tenant] = left
            else:
                del self._per_tenant[tenant]
            self.num_bytes -= num_bytes

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._per_tenant.get(tenant, 0)


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
    """One session's recent results by request id: at most `max_results` of them, in at most `max_bytes`, each
    byte taken from `budget` (its tenant's share and the server's bound) before it is kept.

    Each id costs `ENTRY_BYTES`, taken before its call applies; when no bound has room even after this window
    drops its own oldest results, the call is refused with the bound's name (LIMIT_EXCEEDED) and changes
    nothing. A result's own bytes are taken after it applies, dropping the oldest results as needed; one that
    still has no room keeps only its id, and a retry of it is refused.
    """

    def __init__(
        self,
        *,
        max_results: int = DEFAULT_MAX_RESULTS,
        max_bytes: int = DEFAULT_MAX_SESSION_BYTES,
        budget: WindowBytes | None = None,
        tenant: str = "",
    ) -> None:
        self.max_results = max_results
        self.max_bytes = max_bytes
        self._budget = WindowBytes(max_bytes) if budget is None else budget
        self._tenant = tenant
        self._results: collections.OrderedDict[int, tuple[int, object, int]] = collections.OrderedDict()
        self._bytes = 0  # kept results' bytes, and an entry's for each call applying now (`_num_pending`)
        self._num_pending = 0
        self._floor = 0  # the highest id dropped from the window: ids up to it are too old
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._results)

    @property
    def num_bytes(self) -> int:
        return self._bytes

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

    def _take(self, num_bytes: int) -> tuple[str, int, int] | None:
        """Under `_lock`: take `num_bytes`, dropping this window's oldest results while a bound refuses them; the
        refusing bound (limit, requested, allowed) when even an empty window has no room."""
        while True:
            refused: tuple[str, int, int] | None
            if self._bytes + num_bytes > self.max_bytes:
                refused = ("max_request_window_bytes_per_session", self._bytes + num_bytes, self.max_bytes)
            else:
                refused = self._budget.take(self._tenant, num_bytes)
                if refused is None:
                    self._bytes += num_bytes
                    return None
            if not self._results:
                return refused
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        dropped_id, (_, _, dropped) = self._results.popitem(last=False)
        self._give(dropped)
        self._floor = max(self._floor, dropped_id)

    def _give(self, num_bytes: int) -> None:
        self._bytes -= num_bytes
        self._budget.give(self._tenant, num_bytes)

    def reserve(self) -> None:
        """Room for one more id's entry, before its call applies (pair with `record` or `unreserve`).

        Raises:
            LimitExceeded: no bound has room for it, even with this window's own results dropped.
        """
        with self._lock:
            refused = self._take(ENTRY_BYTES)
            if refused is None:
                self._num_pending += 1
                return
        raise LimitExceeded(*refused)

    def unreserve(self) -> None:
        """The reserved call was refused: it keeps nothing."""
        with self._lock:
            self._num_pending -= 1
            self._give(ENTRY_BYTES)

    def record(self, request: RequestKey, result: object, num_bytes: int) -> None:
        """Keep `result` (holding `num_bytes`) as the answer to `request`'s id, whose entry `reserve` took; the
        oldest results go first to make room, and a result with no room keeps only its id."""
        with self._lock:
            self._num_pending -= 1
            if ENTRY_BYTES + num_bytes > self.max_bytes or self._take(num_bytes) is not None:
                result, num_bytes = _UNKEPT, 0
            old = self._results.pop(request.request_id, None)
            if old is not None:
                self._give(old[2])
            self._results[request.request_id] = (request.digest, result, ENTRY_BYTES + num_bytes)
            while len(self._results) > self.max_results:
                self._drop_oldest()

    def once(self, request: RequestKey, apply: Callable[[], T], size: Callable[[T], int] = lambda _: 0) -> T:
        """`apply()` unless `request`'s id already has a result; request id 0 means none (always apply). `size`:
        the bytes a result holds (`retained_bytes`).

        Call it holding the lock that serialises `apply`, so lookup, apply and record are one step.
        """
        if not request.request_id:
            return apply()
        found = self.lookup(request)
        if found is not MISSING:
            return found  # type: ignore[return-value]  # recorded from this same request's apply()
        self.reserve()
        try:
            result = apply()
        except BaseException:
            self.unreserve()
            raise
        self.record(request, result, size(result))
        return result

    def clear(self) -> None:
        """The session ended: its bytes go back to the budget."""
        with self._lock:
            for _, _, num_bytes in self._results.values():
                self._give(num_bytes)
            self._results.clear()

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._results) <= self.max_results, "request window holds too many results"
            kept = sum(c for _, _, c in self._results.values())
            assert self._bytes == kept + ENTRY_BYTES * self._num_pending, "request window bytes stale"
            assert self._bytes <= self.max_bytes, "request window over its byte bound"


log = logging.getLogger(__name__)

_INSTANCE_ID_CHARS = 8
REAP_INTERVAL_SECONDS = 0.05


@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class Session:
    """A client's lease. What it holds in each pool is that pool's `PoolLedger`'s to know."""

    session_id: str
    tenant: Tenant
    ttl: float
    deadline: float
    closed: bool = False  # set before its sequences are released; pool-locked code re-checks it
    num_streams: int = 0  # open Session streams: while any is open the lease does not run out
    requests: RequestWindow = dataclasses.field(default_factory=RequestWindow)  # recent results by request id

    def renew(self) -> None:
        self.deadline = time.monotonic() + self.ttl


class SessionRegistry:
    """Live sessions by id, with a reaper thread for expired leases. Never held while a pool lock is taken."""

    def __init__(
        self,
        *,
        default_ttl: float,
        max_ttl: float,
        max_sessions: int,
        on_end: Callable[[Session, str], int],
        max_sessions_per_tenant: int | None = None,
        windows: WindowBytes | None = None,
        max_window_bytes_per_session: int = DEFAULT_MAX_SESSION_BYTES,
    ) -> None:
        self.instance_id = secrets.token_hex(_INSTANCE_ID_CHARS // 2)
        self._default_ttl = default_ttl
        self._max_ttl = max_ttl
        self._max_sessions = max_sessions
        self._max_per_tenant = max_sessions if max_sessions_per_tenant is None else max_sessions_per_tenant
        self._per_tenant: dict[str, int] = {}  # live sessions by tenant name
        self._on_end = on_end
        self.windows = WindowBytes() if windows is None else windows  # every session's request window, in bytes
        self._max_window_bytes = max_window_bytes_per_session
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap_forever, name="radixkv-lease-reaper", daemon=True)

    def __len__(self) -> int:
        return len(self._sessions)

    def live(self) -> list[Session]:
        """The sessions live now (a copy: for invariant checks, which read each under the pool's lock)."""
        with self._lock:
            return list(self._sessions.values())

    def start(self) -> None:
        self._reaper.start()

    def pause(self) -> None:
        """Stop reaping, ending nothing: a restart's snapshot keeps the live sessions for the next server."""
        self._stopped.set()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join()

    def stop(self) -> None:
        """Stop reaping and end every session (server shutdown)."""
        self.pause()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._per_tenant.clear()
        for session in sessions:
            self._end(session, "shutdown")

    def open(self, tenant: Tenant, ttl_seconds: float) -> Session:
        """A new session leased for `ttl_seconds` (0: the default), capped at the server's maximum."""
        if not 0 <= ttl_seconds < math.inf:
            raise InvalidArgument("ttl_seconds", "must be a finite number >= 0 (0: the server's default)")
        ttl = min(ttl_seconds or self._default_ttl, self._max_ttl)
        session = self._new(f"{self.instance_id}-{secrets.token_hex(16)}", tenant, ttl)
        with self._lock:
            if len(self._sessions) >= self._max_sessions:
                raise LimitExceeded("max_sessions", len(self._sessions) + 1, self._max_sessions)
            held = self._per_tenant.get(tenant.name, 0)
            if held >= self._max_per_tenant:
                raise LimitExceeded("max_sessions_per_tenant", held + 1, self._max_per_tenant)
            self._sessions[session.session_id] = session
            self._per_tenant[tenant.name] = held + 1
        log.info("session opened", extra={"session_id": session.session_id, "tenant": tenant.name, "ttl_seconds": ttl})
        return session

    def restore(self, session_id: str, tenant: Tenant, ttl: float) -> Session:
        """A session of the previous server, adopted with its snapshot: a full lease from now to reconnect in.

        Idempotent (several pools' snapshots name the same session). Counts against no limit: it was
        admitted once, and refusing it now would strand its sequences until nothing releases them.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = self._new(session_id, tenant, ttl)
                self._sessions[session_id] = session
                self._per_tenant[tenant.name] = self._per_tenant.get(tenant.name, 0) + 1
        return session

    def _new(self, session_id: str, tenant: Tenant, ttl: float) -> Session:
        window = RequestWindow(max_bytes=self._max_window_bytes, budget=self.windows, tenant=tenant.name)
        return Session(session_id=session_id, tenant=tenant, ttl=ttl, deadline=time.monotonic() + ttl, requests=window)

    def get(self, session_id: str, tenant: Tenant) -> Session:
        """The live session `session_id`, its lease renewed.

        Raises:
            UnknownSession: no such live session (or none named).
            ServerRestarted: the id is from an earlier run of this server.
            PermissionDenied: the session belongs to another tenant.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            instance, sep, _ = session_id.partition("-")
            if sep and len(instance) == _INSTANCE_ID_CHARS and instance != self.instance_id:
                raise ServerRestarted(session_id)
            raise UnknownSession(session_id)
        if session.tenant.name != tenant.name:
            raise PermissionDenied("the session belongs to another tenant", field="session_id", session_id=session_id)
        session.renew()
        return session

    def hold(self, session: Session) -> None:
        """A Session stream opened on `session`: its lease stays alive until the matching `unhold`."""
        with self._lock:
            session.num_streams += 1

    def unhold(self, session: Session) -> None:
        """A Session stream ended: the lease runs its ttl from now."""
        with self._lock:
            session.num_streams -= 1
            session.renew()

    def close(self, session_id: str, tenant: Tenant) -> int:
        """End a session now; returns what `on_end` released."""
        session = self.get(session_id, tenant)
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise UnknownSession(session_id)  # closed or expired by another thread meanwhile
            self._uncount(session)
        return self._end(session, "closed")

    def _uncount(self, session: Session) -> None:
        """Under `_lock`: the session left `_sessions`."""
        name = session.tenant.name
        self._per_tenant[name] -= 1
        if not self._per_tenant[name]:
            del self._per_tenant[name]

    def _end(self, session: Session, why: str) -> int:
        session.closed = True
        num_released = self._on_end(session, why)
        session.requests.clear()  # no call of it applies now: each re-checks `closed` under its pool's lock
        log.info(
            "session ended",
            extra={
                "session_id": session.session_id,
                "tenant": session.tenant.name,
                "why": why,
                "num_released_sequences": num_released,
            },
        )
        return num_released

    def _reap_forever(self) -> None:
        while not self._stopped.wait(REAP_INTERVAL_SECONDS):
            now = time.monotonic()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.deadline < now and not s.num_streams]
                for session in expired:
                    del self._sessions[session.session_id]
                    self._uncount(session)
            for session in expired:
                try:
                    self._end(session, "expired")
                except Exception:  # keep reaping other sessions; the failure is a bug to log loudly
                    log.exception("ending an expired session failed", extra={"session_id": session.session_id})
