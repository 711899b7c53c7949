"""Request ids (server/idempotency.py): an id returns its own first result or is refused, never applies twice.

The attacks of issue 32 item 2, at the window itself: a retried call whose result was too large to
keep, the same id with another body, and a client re-sending more steps than the window keeps (the
64-result window used to cascade: each re-sent step evicted the next one's result and applied again).
The same over a real dropped connection: tests/reliability/test_request_ids.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import FailedPrecondition, InvalidArgument, QuotaExceeded
from radixkv.server.idempotency import RequestKey, RequestWindow, request_key
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
    window, applied = RequestWindow(max_results=100, max_cost=10), []
    for request_id in range(1, 6):
        window.once(_key(request_id, f"open {request_id}"), lambda: "r", cost=lambda _: 4)
    assert len(window) == 2  # 2 * 4 <= 10 < 3 * 4

    def big_open() -> str:
        applied.append(1)
        return "a million slots"

    assert window.once(_key(9, "open big"), big_open, cost=lambda _: 11) == "a million slots"
    with pytest.raises(FailedPrecondition):  # it applied, and its result was not kept: refused, not opened again
        window.once(_key(9, "open big"), big_open, cost=lambda _: 11)
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
    st.integers(4, 40),
)
def test_an_id_answers_its_own_first_result_or_is_refused(
    calls: list[tuple[int, str, int]], max_results: int, max_cost: int
) -> None:
    """Whatever ids and bodies arrive in whatever order: each (id, body) applies at most once per id, and an answer
    is always the result that id's first application returned."""
    window = RequestWindow(max_results=max_results, max_cost=max_cost)
    first: dict[int, tuple[str, tuple[int, str]]] = {}  # id -> (body, its first result)
    for n, (request_id, body, cost) in enumerate(calls):

        def apply(request_id: int = request_id, body: str = body, n: int = n) -> tuple[int, str]:
            assert request_id not in first, f"id {request_id} applied twice"
            return (n, body)

        try:
            result = window.once(_key(request_id, body), apply, cost=lambda _, cost=cost: cost)
        except (FailedPrecondition, InvalidArgument):
            continue
        if request_id in first:
            assert first[request_id] == (body, result), "answered with another request's result"
        else:
            first[request_id] = (body, result)
        window.check_invariants()


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
