"""tokenmill's errors, one small hierarchy from the engine to HTTP. Torch-free: the bottom floor, next to
``request.py``.

Raised (the library and the server's own checks):

- :class:`BadRequestError` (a ``ValueError``): the caller's input is wrong; ``param`` names the field (``prompt``,
  ``max_tokens``, ``stop_token_ids``, ``logit_bias``, ``structured_outputs``, a sampling field). A 400.
- :class:`NotFoundError` (a ``LookupError``): a model or object that does not exist. A 404.
- :class:`QueueFullError`: the bounded queue is full. The only 429.
- :class:`UnavailableError`: the engine is shutting down or has died. A 503.

Request outcomes: a request the engine, not the caller, ended has ``finish_reason="error"``, a message for
people (``error``) and one of these kinds (``error_kind``) for programs, set where the cause is decided:

- ``OVERLOADED``: preempted more than ``max_num_preemptions`` times: the pool is too small for the load (503,
  ``overloaded``: a retry later may succeed, but it is not the queue that was full);
- ``STEP_FAILED``: the forward of a step it was in raised (500, ``step_failed``);
- ``CONSTRAINT_FAILED``: its structured-output matcher refused a token it had allowed, or failed inside (500,
  ``constraint_failed``).

``tokenmill.server.common.api_error`` is the one place that turns any of these into OpenAI's error shape.
"""

from __future__ import annotations

OVERLOADED = "overloaded"
STEP_FAILED = "step_failed"
CONSTRAINT_FAILED = "constraint_failed"
ERROR_KINDS = (OVERLOADED, STEP_FAILED, CONSTRAINT_FAILED)


class TokenmillError(Exception):
    """Every error tokenmill raises on purpose."""


class _AboutAField(TokenmillError):
    """An error about one request field: ``param`` names it, ``code`` is an optional machine code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequestError(_AboutAField, ValueError):
    """Bad input from the caller."""


class ContextLengthError(BadRequestError):
    """Prompt + max_tokens do not fit the model's context (raised where it is checked: the scheduler's intake);
    the numbers travel with it, so each API words it its own way."""

    def __init__(
        self, message: str, max_model_len: int, num_prompt_tokens: int, num_completion_tokens: int
    ) -> None:
        super().__init__(message, param="max_tokens", code="context_length_exceeded")
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = num_completion_tokens


class NotFoundError(_AboutAField, LookupError):
    """What was asked for does not exist."""


class QueueFullError(TokenmillError):
    """The bounded queue is full: 429 with Retry-After."""


class UnavailableError(TokenmillError):
    """The engine admits nothing: shutting down, or dead. 503."""
