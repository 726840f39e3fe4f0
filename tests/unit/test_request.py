"""Request: the status transition table is the only way to change status."""

from __future__ import annotations

import pytest

from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

S = RequestStatus
LEGAL: set[tuple[RequestStatus, RequestStatus]] = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.RUNNING, S.WAITING),
    (S.RUNNING, S.FINISHED_STOPPED),
    (S.RUNNING, S.FINISHED_LENGTH),
    (S.RUNNING, S.FINISHED_ABORTED),
}
# How to reach each status from a fresh request through legal edges.
PATHS: dict[RequestStatus, list[RequestStatus]] = {
    S.WAITING: [],
    S.RUNNING: [S.RUNNING],
    S.FINISHED_STOPPED: [S.RUNNING, S.FINISHED_STOPPED],
    S.FINISHED_LENGTH: [S.RUNNING, S.FINISHED_LENGTH],
    S.FINISHED_ABORTED: [S.FINISHED_ABORTED],
}


def make(status: RequestStatus = S.WAITING, max_tokens: int = 16) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for step in PATHS[status]:
        r.transition(step)
    return r


@pytest.mark.parametrize("src,dst", sorted(LEGAL, key=repr))
def test_legal_transitions(src: RequestStatus, dst: RequestStatus) -> None:
    r = make(src)
    r.transition(dst)
    assert r.status is dst


ILLEGAL = [(a, b) for a in S for b in S if (a, b) not in LEGAL]


@pytest.mark.parametrize("src,dst", ILLEGAL)
def test_illegal_transitions_raise(src: RequestStatus, dst: RequestStatus) -> None:
    r = make(src)
    with pytest.raises(RuntimeError, match="illegal transition"):
        r.transition(dst)
    assert r.status is src


@pytest.mark.parametrize("end", [S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED])
def test_double_finish_raises(end: RequestStatus) -> None:
    r = make(end)
    assert r.is_finished
    for again in [S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED]:
        with pytest.raises(RuntimeError):
            r.transition(again)


def test_finish_reason() -> None:
    assert make(S.FINISHED_STOPPED).finish_reason == "stop"
    assert make(S.FINISHED_LENGTH).finish_reason == "length"
    assert make(S.FINISHED_ABORTED).finish_reason == "abort"
    r = make(S.FINISHED_ABORTED)
    r.error = "boom"
    assert r.finish_reason == "error"
    assert make(S.RUNNING).finish_reason is None


def test_token_accounting_and_timestamps() -> None:
    r = make(S.RUNNING, max_tokens=5)
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens, r.max_num_tokens) == (3, 0, 3, 8)
    assert r.num_tokens_to_compute == 3
    r.num_computed_tokens = 3
    r.append_output_token(7, now_s=1.5)
    r.append_output_token(8, now_s=2.5)
    assert r.all_token_ids == [1, 2, 3, 7, 8]
    assert (r.first_token_time_s, r.last_token_time_s) == (1.5, 2.5)
    assert r.num_tokens_to_compute == 2
    assert r.take_new_token_ids() == [7, 8]
    assert r.take_new_token_ids() == []


def test_append_while_not_running_raises() -> None:
    with pytest.raises(RuntimeError):
        make(S.WAITING).append_output_token(1, 0.0)


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValueError, match="prompt"):
        Request("r", [], SamplingParams())
