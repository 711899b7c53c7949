"""gRPC failures back into radixkv's domain exceptions: the reason in the ErrorInfo picks the class.

The server sends every refusal as a status plus one `google.rpc.ErrorInfo` (domain "radixkv");
`ERRORS_BY_REASON` maps its reason to the class the core would have raised in-process, so callers
catch `OutOfBlocks` either way. A `google.rpc.RetryInfo` beside it (TOKEN_BUDGET) becomes the
exception's `retry_delay` in seconds. Failures without one (the server unreachable, a deadline passed, a
message over the size limit) stay `grpc.RpcError`.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from radixkv.errors import ERRORS_BY_REASON, RadixKVError

DOMAIN = "radixkv"


def error_from_rpc(error: grpc.RpcError) -> Exception:
    """The domain exception `error` carries, or `error` itself when it carries none."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:  # status details that disagree with the call's code: not ours
        return error
    if status is None:
        return error
    found: RadixKVError | None = None
    retry_delay: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                cls = ERRORS_BY_REASON.get(info.reason, RadixKVError)
                found = cls.from_wire(status.message, dict(info.metadata))
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
    if found is None:
        return error
    found.retry_delay = retry_delay  # seconds, from a google.rpc.RetryInfo (TOKEN_BUDGET); None: none sent
    return found


class HashContractMismatch(RuntimeError):
    """An instance names blocks by another hash scheme than this client or router: mixing them would
    turn every lookup into a silent miss, so it is refused. Raised client-side, never on the wire.
    `differences` maps each field to (ours, theirs)."""

    def __init__(self, endpoint: str, differences: dict[str, tuple[object, object]]) -> None:
        detail = ", ".join(f"{name}: ours {ours!r}, theirs {theirs!r}" for name, (ours, theirs) in differences.items())
        super().__init__(f"{endpoint} uses another block-hash contract ({detail})")
        self.endpoint = endpoint
        self.differences = differences
