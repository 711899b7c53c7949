"""The error table: every caller error has one stable reason and one gRPC code, and rebuilds from the wire."""

from __future__ import annotations

import pytest

import radixkv.errors as errors
from radixkv.errors import ERRORS_BY_REASON, OutOfBlocks, RadixKVError, ServerRestarted, UnknownSession

# grpc.StatusCode's names, spelled out: the core (and its tests) never import grpc.
GRPC_CODES = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}  # fmt: skip


def _subclasses(cls: type[RadixKVError]) -> set[type[RadixKVError]]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_error_class_is_in_the_table_under_its_own_reason() -> None:
    defined = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, RadixKVError)}
    assert _subclasses(RadixKVError) == defined - {RadixKVError}
    assert set(ERRORS_BY_REASON.values()) == defined - {RadixKVError}
    assert all(reason == cls.reason for reason, cls in ERRORS_BY_REASON.items())


def test_every_code_is_a_grpc_status_name_and_never_ok() -> None:
    codes = {cls.grpc_code for cls in ERRORS_BY_REASON.values()}
    assert codes <= GRPC_CODES - {"OK"}, codes - GRPC_CODES


def test_from_wire_rebuilds_the_class_with_numbers_as_ints() -> None:
    sent = OutOfBlocks(needed=12, free=3)
    assert sent.metadata == {"needed": "12", "free": "3"}  # on the wire, metadata are strings
    received = ERRORS_BY_REASON[sent.reason].from_wire(sent.message, sent.metadata)
    assert type(received) is OutOfBlocks and received.message == sent.message
    assert (received.needed, received.free) == (12, 3)  # type: ignore[attr-defined]


def test_a_restarted_server_is_also_an_unknown_session() -> None:
    received = ERRORS_BY_REASON["SERVER_RESTARTED"].from_wire("gone", {"session_id": "0badcafe-1"})
    with pytest.raises(UnknownSession):
        raise received
    assert isinstance(received, ServerRestarted) and received.grpc_code == UnknownSession.grpc_code
