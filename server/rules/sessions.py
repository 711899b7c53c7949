"""Sessions and their leases: every sequence belongs to a session, and a session that stops renewing ends.

A session's lease runs `ttl` seconds from its last use (any RPC naming it, or KeepAlive), and never
runs out while a Session stream is open on it (the stream's end starts the ttl again). A reaper
thread ends sessions whose lease ran out; `on_end` then releases what they held. Session ids start
with this server instance's id, so an id from before a restart is told apart (SERVER_RESTARTED)
from one that never existed or has ended (UNKNOWN_SESSION).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable

from radixkv.errors import InvalidArgument, LimitExceeded, PermissionDenied, ServerRestarted, UnknownSession
from radixkv.server.rules.idempotency import DEFAULT_MAX_SESSION_BYTES, RequestWindow, WindowBytes
from radixkv.server.rules.tenants import Tenant

log = logging.getLogger(__name__)

_INSTANCE_ID_CHARS = 8
REAP_INTERVAL_SECONDS = 0.05


@dataclasses.dataclass(eq=False, slots=True)
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
        return Session(session_id, tenant, ttl, time.monotonic() + ttl, requests=window)

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
