"""Every error a caller can cause, with a stable `reason` and the gRPC status it maps to.

The core raises these; the server turns them into a status code plus an `ErrorInfo` carrying
`reason` and `metadata`; the client turns that back into the same class, so user code catches
`OutOfBlocks` whether it runs the core in-process or over gRPC. Broken internal invariants are
`AssertionError`s, never one of these.
"""

from __future__ import annotations

from typing import ClassVar


class RadixKVError(Exception):
    """Base class: a caller mistake or a refused request. Changes nothing in the cache."""

    reason: ClassVar[str] = "INTERNAL"
    grpc_code: ClassVar[str] = "INTERNAL"  # a grpc.StatusCode name; kept as text so the core needs no grpc
    retry_delay: float | None = None  # seconds after which a retry may succeed (TOKEN_BUDGET); None: not said

    def __init__(self, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}

    @classmethod
    def from_wire(cls, message: str, metadata: dict[str, str]) -> RadixKVError:
        """Rebuild an error received as (reason, message, metadata); numeric metadata become ints."""
        err = cls.__new__(cls)
        RadixKVError.__init__(err, message, **metadata)
        for key, value in metadata.items():
            setattr(err, key, int(value) if value.lstrip("-").isdigit() else value)
        if isinstance(getattr(err, "retry_after_ms", None), int):  # TOKEN_BUDGET (a stream's refusal has no RetryInfo)
            err.retry_delay = err.retry_after_ms / 1000  # type: ignore[attr-defined]
        return err


class InvalidArgument(RadixKVError):
    """A request field is malformed: `field` names it (`token_ids`, `items[3].num_children`, ...)."""

    reason = "INVALID_ARGUMENT"
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)
        self.field = field


class OutOfBlocks(RadixKVError):
    """The pool cannot supply `needed` blocks even after evicting every unlocked cached block."""

    reason = "OUT_OF_BLOCKS"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of blocks: needed {needed}, free (incl. evictable) {free}", needed=needed, free=free)
        self.needed = needed
        self.free = free


class NotAdmitted(RadixKVError):
    """Admission by token budget refused a request: its uncached prompt blocks plus its reserved growth
    (`blocks_needed`) do not fit in the free and evictable blocks left after others' reservations and the
    watermark (`blocks_available`)."""

    reason = "NOT_ADMITTED"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, blocks_needed: int, blocks_available: int) -> None:
        super().__init__(
            f"not admitted: needs {blocks_needed} blocks (prompt and reserved growth), {blocks_available} available",
            blocks_needed=blocks_needed,
            blocks_available=blocks_available,
        )
        self.blocks_needed = blocks_needed
        self.blocks_available = blocks_available


class TokenBudget(RadixKVError):
    """A tenant's token bucket (`max_tokens_per_second`) cannot pay for this open's prompt plus max_new_tokens
    now; retry after `retry_after_ms` (also sent as a google.rpc.RetryInfo)."""

    reason = "TOKEN_BUDGET"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, tenant: str, num_tokens: int, retry_after_ms: int) -> None:
        super().__init__(
            f"tenant {tenant!r} token budget: {num_tokens} tokens asked, retry in {retry_after_ms} ms",
            tenant=tenant,
            num_tokens=num_tokens,
            retry_after_ms=retry_after_ms,
        )
        self.tenant = tenant
        self.num_tokens = num_tokens
        self.retry_after_ms = retry_after_ms
        self.retry_delay = retry_after_ms / 1000


class LimitExceeded(RadixKVError):
    """A configured limit (`limit` names it: max_tokens_per_request, pinned_blocks, ...) refuses the request."""

    reason = "LIMIT_EXCEEDED"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, limit: str, requested: int, allowed: int) -> None:
        super().__init__(
            f"{limit}: requested {requested}, allowed {allowed}", limit=limit, requested=requested, allowed=allowed
        )
        self.limit = limit
        self.requested = requested
        self.allowed = allowed


class QuotaExceeded(RadixKVError):
    """A tenant's block quota refuses the request."""

    reason = "QUOTA_EXCEEDED"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, tenant: str, needed: int, available: int) -> None:
        super().__init__(
            f"tenant {tenant!r} block quota: needed {needed}, available {available}",
            limit="max_blocks",
            tenant=tenant,
            needed=needed,
            available=available,
        )
        self.tenant = tenant
        self.needed = needed
        self.available = available


class UnknownSequence(RadixKVError):
    """No live sequence has this id (never opened, or already released)."""

    reason = "UNKNOWN_SEQUENCE"
    grpc_code = "NOT_FOUND"

    def __init__(self, seq_id: int) -> None:
        super().__init__(f"unknown sequence {seq_id}", seq_id=seq_id)
        self.seq_id = seq_id


class NotPinned(RadixKVError):
    """`unpin` named a prefix that holds no pin."""

    reason = "NOT_PINNED"
    grpc_code = "NOT_FOUND"

    def __init__(self, namespace: str) -> None:
        super().__init__(f"no pin on that prefix in namespace {namespace!r}", namespace=namespace)


class UnknownSession(RadixKVError):
    """No live session has this id (never opened, closed, or its lease expired)."""

    reason = "UNKNOWN_SESSION"
    grpc_code = "NOT_FOUND"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"unknown or expired session {session_id!r}", session_id=session_id)


class UnknownPool(RadixKVError):
    """The server has no pool of this name."""

    reason = "UNKNOWN_POOL"
    grpc_code = "NOT_FOUND"

    def __init__(self, pool: str) -> None:
        super().__init__(f"unknown pool {pool!r}", pool=pool)


class PermissionDenied(RadixKVError):
    """The caller may not touch this sequence or namespace (another session's or tenant's)."""

    reason = "PERMISSION_DENIED"
    grpc_code = "PERMISSION_DENIED"


class Unauthenticated(RadixKVError):
    """No valid bearer token was presented to a server that requires one."""

    reason = "UNAUTHENTICATED"
    grpc_code = "UNAUTHENTICATED"


class FailedPrecondition(RadixKVError):
    """The request is well-formed but the system is not in a state to serve it (e.g. server draining)."""

    reason = "FAILED_PRECONDITION"
    grpc_code = "FAILED_PRECONDITION"


class SequencePreempted(FailedPrecondition):
    """The sequence is preempted: only `resume` and `release` may name it until it is resumed."""

    reason = "SEQUENCE_PREEMPTED"
    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, seq_id: int, field: str = "seq_id") -> None:
        super().__init__(f"{field}: sequence {seq_id} is preempted (resume it first)", seq_id=seq_id, field=field)
        self.seq_id = seq_id
        self.field = field


class DeadlineExceeded(RadixKVError):
    """The call's deadline passed before it was applied (waiting for the pool): nothing changed."""

    reason = "DEADLINE_EXCEEDED"
    grpc_code = "DEADLINE_EXCEEDED"

    def __init__(self) -> None:
        super().__init__("the deadline passed before the call was applied; nothing changed")


class ServerRestarted(UnknownSession):
    """The session is from an earlier run of the server: it, its sequences and its pins are gone.

    NOT_FOUND, not UNAVAILABLE: retrying the same call can never succeed. Open a new session
    (`RadixKVClient.reopen()`), open new sequences, and have workers map the pool again (a restarted
    server has new pool memory). A subclass of `UnknownSession`: code that handles any lost session
    (an expired lease too) catches that one.
    """

    reason = "SERVER_RESTARTED"
    grpc_code = "NOT_FOUND"

    def __init__(self, session_id: str) -> None:
        RadixKVError.__init__(
            self, f"session {session_id!r} is from an earlier run of the server: open a new one", session_id=session_id
        )


class ServerRestarting(RadixKVError):
    """The server is stopping to restart (SIGTERM, an upgrade) and has written its snapshot: nothing changed.

    UNAVAILABLE: retry after a moment; the next server adopts the snapshot, so the session, its
    sequences and their ids are still there.
    """

    reason = "SERVER_RESTARTING"
    grpc_code = "UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__("the server is restarting and took no more changes; retry, the next server continues")


class SnapshotRefused(RadixKVError):
    """A snapshot that must not be adopted: nothing of it is used, and the pool starts cold.

    `why` says which check refused it: TRUNCATED, NOT_A_SNAPSHOT, VERSION, CORRUPTED (checksum),
    OTHER_POOL, LAYOUT, HASH_CONTRACT, MEMORY (the memory is fresh or not the memory the snapshot
    describes), KV_CHECKSUM (the memory's bytes differ from the snapshot's), INCONSISTENT.
    """

    reason = "SNAPSHOT_REFUSED"
    grpc_code = "FAILED_PRECONDITION"

    def __init__(self, why: str, message: str) -> None:
        super().__init__(f"snapshot refused ({why}): {message}", why=why)
        self.why = why


ERRORS_BY_REASON: dict[str, type[RadixKVError]] = {
    cls.reason: cls
    for cls in (
        InvalidArgument,
        OutOfBlocks,
        NotAdmitted,
        TokenBudget,
        LimitExceeded,
        QuotaExceeded,
        UnknownSequence,
        NotPinned,
        UnknownSession,
        UnknownPool,
        PermissionDenied,
        Unauthenticated,
        FailedPrecondition,
        SequencePreempted,
        ServerRestarted,
        DeadlineExceeded,
        SnapshotRefused,
        ServerRestarting,
    )
}
