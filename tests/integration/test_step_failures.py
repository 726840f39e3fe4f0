"""Fault injection: a forward that raises costs only its own step's requests, in the engine and the server.

The engine test runs the embedded model with its runner made to raise on chosen calls; the server tests run
``tokenmill serve`` as a process (``faulty_launch``) with the same fault, and talk to it over HTTP.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serverproc import ServerProcess

from tokenmill.engine import STEP_FAILED
from tokenmill.sampling_params import SamplingParams


def _fail_on(engine: Any, calls: set[int]) -> list[int]:
    """Make engine's runner raise on these forward numbers (1-based); returns the running call count."""
    real = engine.runner.execute
    count = [0]

    def execute(scheduler_output: Any) -> Any:
        count[0] += 1
        if count[0] in calls:
            raise RuntimeError(f"injected fault in forward {count[0]}")
        return real(scheduler_output)

    engine.runner.execute = execute
    return count


def _run(engine: Any) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            assert out.request_id not in outputs, "a request ended twice"
            outputs[out.request_id] = out
    return outputs


def test_a_failed_forward_ends_only_its_own_requests(make_engine: Any) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = make_engine(max_model_len=256)
    ref = {o.request_id: o for o in (reference.generate(["Hello", "The sky is"], params, use_tqdm=False))}
    expected = [o.outputs[0].token_ids for o in ref.values()]

    engine = make_engine(max_model_len=256)
    _fail_on(engine, {3})
    engine.add_request("Hello", params, request_id="a")
    engine.add_request("The sky is", params, request_id="b")
    first = engine.step()  # forward 1: both prompts
    assert first.error is None
    engine.step()  # forward 2: one decode step each
    failed = engine.step()  # forward 3 raises
    assert isinstance(failed.error, RuntimeError)
    assert {o.request_id for o in failed.finished} == {"a", "b"}
    for out in failed.finished:
        assert out.outputs[0].finish_reason == "error"
        assert out.outputs[0].error is not None and out.outputs[0].error.startswith(STEP_FAILED)
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_integrity()
    assert engine.stats.num_failed_steps == 1

    # the engine goes on: new requests get the same greedy tokens as an engine that never failed
    engine.add_request("Hello", params, request_id="c")
    engine.add_request("The sky is", params, request_id="d")
    later = _run(engine)
    assert [later["c"].outputs[0].token_ids, later["d"].outputs[0].token_ids] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in later.values())
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_request_aborted_before_the_failed_step_is_reported_once(make_engine: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = make_engine(max_model_len=256)
    _fail_on(engine, {2})
    engine.add_request("one", params, request_id="x")
    engine.add_request("two", params, request_id="y")
    engine.step()
    assert engine.abort("x")
    outputs = _run(engine)  # forward 2 (y alone) fails; x's abort still comes out
    assert outputs["x"].outputs[0].finish_reason == "abort"
    assert outputs["y"].outputs[0].finish_reason == "error"
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.fixture(scope="module")
def flaky_server() -> Any:
    """Forwards 2 and 3 raise; every other one works."""
    proc = ServerProcess(
        "--max-num-seqs", "8", module="faulty_launch", env={"TOKENMILL_TEST_FAIL_CALLS": "2,3"}
    ).start()
    yield proc
    proc.stop()


def test_server_survives_failed_steps(flaky_server: ServerProcess) -> None:
    url = f"{flaky_server.base_url}/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    ok = httpx.post(url, json={**body, "max_tokens": 1}, timeout=60)  # forward 1: fine
    assert ok.status_code == 200, ok.text
    failed = httpx.post(url, json=body, timeout=60)  # forward 2 raises
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "step_failed"
    assert "injected fault" in error["message"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:  # forward 3 raises
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"step_failed"' in events[-2]
    # the server goes on: healthy, the next requests answer, every block back
    assert httpx.get(f"{flaky_server.base_url}/health", timeout=5).status_code == 200
    for _ in range(2):
        again = httpx.post(url, json=body, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["finish_reason"] == "length"
    assert flaky_server.metric("vllm:num_requests_running") == 0
    assert flaky_server.metric("vllm:kv_cache_usage_perc") == 0


def test_server_exits_nonzero_after_failures_in_a_row() -> None:
    proc = ServerProcess(
        "--max-consecutive-step-failures",
        "3",
        module="faulty_launch",
        env={"TOKENMILL_TEST_FAIL_CALLS": "from:1"},
    ).start()
    try:
        url = f"{proc.base_url}/v1/completions"
        statuses = []
        for _ in range(3):
            try:
                statuses.append(
                    httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code
                )
            except httpx.HTTPError:
                statuses.append(None)  # the server shutting down under the third
        assert statuses[:2] == [500, 500]
        assert statuses[2] in (500, 503, None)  # its own step failed; the server may be closing already
        assert proc.proc is not None
        assert proc.proc.wait(60) == 3
        assert "the engine is broken" in proc.output()
    finally:
        proc.stop()
