"""Engine-ended requests carry a kind (``tokenmill.errors``) and the server maps the kind, never the message:
429 only for load, 500 for a failed step or a failure inside the constraint machinery, 503 when the engine died.
(A grammar failure once came back as 429 rate_limit_error, and clients retried it for minutes.)"""

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
        (errors.OVERLOADED, 429, "overloaded"),
        (errors.STEP_FAILED, 500, "step_failed"),
        (errors.CONSTRAINT_FAILED, 500, "constraint_failed"),
        (None, 500, "internal_error"),
    ],
)
def test_each_kind_has_its_status(kind: str | None, status: int, code: str) -> None:
    alive = SimpleNamespace(alive=True)
    failure = stream_failure(alive, SimpleNamespace(aborted_by_client=False), _delta(kind))  # type: ignore[arg-type]
    assert failure is not None and failure.status_code == status and failure.info.code == code
    assert (failure.info.type == "rate_limit_error") == (status == 429)


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
