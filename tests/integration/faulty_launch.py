"""``tokenmill serve`` whose model runner raises on chosen forwards, for the fault-injection tests.

    TOKENMILL_TEST_FAIL_CALLS=3,4 python -m faulty_launch [serve flags]   # the 3rd and 4th forwards raise
    TOKENMILL_TEST_FAIL_CALLS=from:2 python -m faulty_launch ...          # every forward from the 2nd on

The count starts after start-up (the first forward a request causes is call 1).
"""

from __future__ import annotations

import os
import sys

from tokenmill.server import launch
from tokenmill.worker.model_runner import ModelRunner


def _should_fail(call: int, spec: str) -> bool:
    if spec.startswith("from:"):
        return call >= int(spec.removeprefix("from:"))
    return str(call) in spec.split(",")


def main() -> int:
    spec = os.environ.get("TOKENMILL_TEST_FAIL_CALLS", "")
    real_execute = ModelRunner.execute
    calls = [0]

    def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if _should_fail(calls[0], spec):
            raise RuntimeError(f"injected fault in forward {calls[0]}")
        return real_execute(self, scheduler_output)

    ModelRunner.execute = execute  # type: ignore[method-assign]
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
