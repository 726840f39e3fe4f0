"""Why the engine, not the caller, ended a request: one word per cause, set where the cause is decided.

A request the engine gave up on ends with ``finish_reason="error"``, a message for people (``error``) and one of
these kinds (``error_kind``) for programs: the server maps the kind, never the message, to an HTTP status.

- ``OVERLOADED``: it could not be finished under this load (preempted more than ``max_num_preemptions`` times):
  a retry later may succeed (429 on the server, as a full queue).
- ``STEP_FAILED``: the forward of a step it was in raised; the server's fault (500, ``step_failed``).
- ``CONSTRAINT_FAILED``: its structured-output matcher refused a token it had allowed, or failed inside: a fault
  of the constraint machinery, not of the request (500, ``constraint_failed``).
"""

from __future__ import annotations

OVERLOADED = "overloaded"
STEP_FAILED = "step_failed"
CONSTRAINT_FAILED = "constraint_failed"
ERROR_KINDS = (OVERLOADED, STEP_FAILED, CONSTRAINT_FAILED)
