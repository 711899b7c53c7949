"""Request ids (server/rules/sessions.py): an id returns its own first result or is refused, never applies twice.

The attacks of issue 32 item 2, at the window itself: a retried call whose result was too large to
keep, the same id with another body, and a client re-sending more steps than the window keeps (the
64-result window used to cascade: each re-sent step evicted the next one's result and applied again).
The same over a real dropped connection: tests/reliability/test_request_ids.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import FailedPrecondition, InvalidArgument, LimitExceeded, QuotaExceeded
from radixkv.server.rules.sessions import ENTRY_BYTES, RequestKey, RequestWindow, WindowBytes, request_key
from radixkv.v1 import kvcache_pb2 as pb


def _key(request_id: int, body: str = "fork 1") -> RequestKey:
    return RequestKey(request_id, hash(body))


def test_a_request_id_is_applied_once_and_answered_with_its_first_result() -> None:
    window, applied = RequestWindow(max_results=2), []

    def apply() -> int:
        applied.append(1)
        return len(applied)

    assert window.once(_key(5), apply) == window.once(_key(5), apply) == 1
    assert window.once(_key(0), apply) == 2 and window.once(_key(0), apply) == 3  # no id: always applied
    with pytest.raises(InvalidArgument) as reused:
        window.once(_key(5, "pin"), apply)  # the same id with another body (another method, pool or prompt)
    assert reused.value.field == "request_id"
    window.once(_key(6), apply)
    window.once(_key(7), apply)  # the window keeps 2: id 5 is dropped, and with it every id up to 5
    with pytest.raises(FailedPrecondition) as too_old:
        window.once(_key(5), apply)
    assert too_old.value.metadata["field"] == "request_id"
    assert len(applied) == 5, "nothing applied twice"
    window.check_invariants()


def test_steps_resent_past_the_window_are_refused_not_applied_again() -> None:
    """A hundred steps applied, then all re-sent in order (a reconnect): those still in the window answer with
    their own results, the older ones are refused; none applies again, however far past the window they go."""
    window, applied = RequestWindow(max_results=64), []

    def append() -> int:
        applied.append(1)
        return len(applied)

    first = [window.once(_key(i, f"append {i}"), append) for i in range(1, 101)]
    again: list[int | str] = []
    for i in range(1, 101):
        try:
            again.append(window.once(_key(i, f"append {i}"), append))
        except FailedPrecondition:
            again.append("too old")
    assert len(applied) == 100, "a re-sent step applied again"
    assert again == ["too old"] * 36 + first[36:]
    window.check_invariants()


def test_a_result_too_large_to_keep_refuses_its_retry() -> None:
    window, applied = RequestWindow(max_results=100, max_bytes=2 * ENTRY_BYTES + 10), []
    for request_id in range(1, 6):
        window.once(_key(request_id, f"open {request_id}"), lambda: "r", size=lambda _: 4)
    assert len(window) == 2  # 2 * (entry + 4) <= max_bytes < 3 * (entry + 4)

    def big_open() -> str:
        applied.append(1)
        return "a million slots"

    assert window.once(_key(9, "open big"), big_open, size=lambda _: 2 * ENTRY_BYTES) == "a million slots"
    with pytest.raises(FailedPrecondition):  # it applied, and its result was not kept: refused, not opened again
        window.once(_key(9, "open big"), big_open, size=lambda _: 2 * ENTRY_BYTES)
    with pytest.raises(InvalidArgument):  # its id still names its own body
        window.once(_key(9, "open other"), big_open)
    assert applied == [1]
    window.check_invariants()


def test_a_failed_call_is_not_kept() -> None:
    window = RequestWindow()

    def refuse() -> int:
        raise QuotaExceeded("a", 1, 0)

    with pytest.raises(QuotaExceeded):
        window.once(_key(3), refuse)
    assert window.once(_key(3), lambda: 42) == 42  # the retry applies: the refusal changed nothing


@given(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["a", "b"]), st.integers(1, 6)), max_size=120),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(1, 16),
)
def test_an_id_answers_its_own_first_result_or_is_refused(
    calls: list[tuple[int, str, int]], max_results: int, max_entries: int, tenant_entries: int
) -> None:
    """Whatever ids and bodies arrive in whatever order, whatever the bounds: each (id, body) applies at most once
    per id, an answer is always the result that id's first application returned, and no bound is exceeded."""
    budget = WindowBytes(max_bytes=tenant_entries * ENTRY_BYTES)
    window = RequestWindow(max_results=max_results, max_bytes=max_entries * ENTRY_BYTES, budget=budget, tenant="t")
    first: dict[int, tuple[str, tuple[int, str]]] = {}  # id -> (body, its first result)
    for n, (request_id, body, cost) in enumerate(calls):

        def apply(request_id: int = request_id, body: str = body, n: int = n) -> tuple[int, str]:
            assert request_id not in first, f"id {request_id} applied twice"
            return (n, body)

        try:
            result = window.once(_key(request_id, body), apply, size=lambda _, cost=cost: cost * 100)
        except (FailedPrecondition, InvalidArgument, LimitExceeded):
            continue
        if request_id in first:
            assert first[request_id] == (body, result), "answered with another request's result"
        else:
            first[request_id] = (body, result)
        window.check_invariants()
        assert budget.num_bytes == window.num_bytes <= budget.max_bytes
    window.clear()
    assert budget.num_bytes == 0


def test_windows_share_their_tenants_bytes_and_refuse_by_name_when_none_is_left() -> None:
    """A tenant's sessions draw on one share: a window drops its own oldest to make room; a window with nothing
    of its own to drop, when the share is full, refuses the call before it applies, naming the bound."""
    budget, applied = WindowBytes(max_bytes=10 * ENTRY_BYTES, max_bytes_per_tenant=4 * ENTRY_BYTES), []
    first, second, other = (RequestWindow(budget=budget, tenant=t) for t in ("a", "a", "b"))
    for request_id in range(1, 9):
        first.once(_key(request_id), lambda: applied.append(1))
    assert len(first) == 4 and budget.held("a") == 4 * ENTRY_BYTES  # its own oldest went first
    with pytest.raises(LimitExceeded) as caught:
        second.once(_key(1), lambda: applied.append(1))
    assert caught.value.limit == "max_request_window_bytes_per_tenant" and len(applied) == 8  # not applied
    for request_id in range(1, 5):
        other.once(_key(request_id), lambda: applied.append(1))  # another tenant's share is its own
    assert budget.num_bytes == 8 * ENTRY_BYTES
    first.clear()
    second.once(_key(1), lambda: applied.append(1))  # room again once the first session ended
    assert budget.held("a") == ENTRY_BYTES
    with pytest.raises(LimitExceeded) as server_wide:
        RequestWindow(budget=WindowBytes(ENTRY_BYTES - 1, 2 * ENTRY_BYTES), tenant="c").once(_key(1), lambda: 0)
    assert server_wide.value.limit == "max_request_window_bytes"


def test_the_digest_reads_the_body_and_method_not_the_ids() -> None:
    request = pb.OpenSequencesRequest(session_id="s-1", pool="p", request_id=7, prompts=[pb.Prompt(token_ids=[1, 2])])
    key = request_key("OpenSequences", request)
    assert (request.request_id, request.session_id) == (7, "s-1"), "the request is left as it was"
    assert key == request_key("OpenSequences", pb.OpenSequencesRequest(
        pool="p", request_id=7, prompts=[pb.Prompt(token_ids=[1, 2])]
    ))  # fmt: skip  # a step re-sent on a new stream may leave its session to the stream
    other_prompt = pb.OpenSequencesRequest(pool="p", request_id=7, prompts=[pb.Prompt(token_ids=[1, 3])])
    other_pool = pb.OpenSequencesRequest(pool="q", request_id=7, prompts=[pb.Prompt(token_ids=[1, 2])])
    digests = {key.digest, request_key("OpenSequences", other_prompt).digest, request_key("Pin", request).digest}
    assert len(digests | {request_key("OpenSequences", other_pool).digest}) == 4
    assert request_key("OpenSequences", pb.OpenSequencesRequest(pool="p")).request_id == 0
