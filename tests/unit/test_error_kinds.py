"""Engine-ended requests carry a kind (``tokenmill.errors``) and the server maps the kind, never the message:
503 ``overloaded`` when the load ended it, 500 for a failed step or a failure inside the constraint machinery,
503 when the engine died; 429 is only ever a full queue. (A grammar failure once came back as 429
rate_limit_error, and clients retried it for minutes.) Raised errors map in one place too (``api_error``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill import errors
from tokenmill.outputs import RequestDelta
from tokenmill.server.common import stream_failure


def _delta(kind: str | None, message: str = "went wrong") -> RequestDelta:
    return RequestDelta(
        request_id="r", new_token_ids=[], new_text="", finished=True, finish_reason="error", error=message,
        error_kind=kind,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        (errors.OVERLOADED, 503, "overloaded"),
        (errors.STEP_FAILED, 500, "step_failed"),
        (errors.CONSTRAINT_FAILED, 500, "constraint_failed"),
        (None, 500, "internal_error"),
    ],
)
def test_each_kind_has_its_status(kind: str | None, status: int, code: str) -> None:
    alive = SimpleNamespace(alive=True)
    failure = stream_failure(alive, SimpleNamespace(aborted_by_client=False), _delta(kind))  # type: ignore[arg-type]
    assert failure is not None and failure.status_code == status and failure.info.code == code
    assert failure.info.type == "server_error"


def test_a_message_that_looks_like_load_is_not_load() -> None:
    """The message is for people: "preempted" in the text of a constraint failure is still a 500."""
    alive = SimpleNamespace(alive=True)
    delta = _delta(errors.CONSTRAINT_FAILED, "preempted 9 times (max_num_preemptions=8)")
    failure = stream_failure(alive, SimpleNamespace(aborted_by_client=False), delta)  # type: ignore[arg-type]
    assert failure is not None and failure.status_code == 500


def test_a_dead_engine_is_503() -> None:
    dead = SimpleNamespace(alive=False)
    failure = stream_failure(dead, SimpleNamespace(aborted_by_client=False), _delta(errors.OVERLOADED))  # type: ignore[arg-type]
    assert failure is not None and failure.status_code == 503


@pytest.mark.parametrize(
    ("exc", "status", "param"),
    [
        (errors.BadRequestError("max_tokens: too many", param="max_tokens"), 400, "max_tokens"),
        (errors.NotFoundError("no such response", param="previous_response_id"), 404, "previous_response_id"),
        (errors.QueueFullError("full"), 429, None),
        (errors.UnavailableError("draining"), 503, None),
        (errors.TokenmillError("?"), 500, None),
    ],
)
def test_raised_errors_map_in_one_place(exc: errors.TokenmillError, status: int, param: str | None) -> None:
    from tokenmill.server.common import api_error

    failure = api_error(exc)
    assert failure.status_code == status and failure.info.param == param
    assert (failure.info.type == "rate_limit_error") == (status == 429)
    assert ("Retry-After" in (failure.headers or {})) == (status in (429, 503))


def test_the_library_names_the_field() -> None:
    """SamplingParams, the scheduler and the engine raise BadRequestError (a ValueError) with the field."""
    from tokenmill.sampling_params import SamplingParams

    with pytest.raises(errors.BadRequestError) as info:
        SamplingParams(top_p=0)
    assert info.value.param == "top_p" and isinstance(info.value, ValueError)
    with pytest.raises(errors.BadRequestError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
