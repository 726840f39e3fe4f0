"""The Responses and Messages APIs' requests, translated onto the chat path, and the Responses store: no server,
no model. Each refusal names the field a client of that API sent."""

from __future__ import annotations

import json

import pytest

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import IdleReason, ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.errors import BadRequestError
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol_messages import CountTokensRequest, MessagesRequest
from tokenmill.server.protocol_responses import ResponsesRequest, parse_items, to_chat
from tokenmill.server.response_store import ResponseStore


def responses(**body: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate(body)


def test_responses_items_become_chat_messages() -> None:
    req = responses(
        instructions="Be terse.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Rome?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Milan"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=9, text={"format": {"type": "json_object"}},
    )  # fmt: skip
    chat = to_chat(req, [])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    assert chat.messages[0].content == "Be terse." and chat.messages[2].content == "Weather in Rome?"
    assistant = chat.messages[3]
    assert assistant.content == "Checking." and [c.id for c in assistant.tool_calls or []] == [
        "call_1",
        "call_2",
    ]
    assert chat.messages[4].tool_call_id == "call_1" and chat.messages[5].content == "rain"
    assert chat.max_completion_tokens == 9 and chat.forces_tool_call
    assert chat.response_format is not None and chat.response_format.type == "json_object"


def test_responses_history_comes_before_the_input_and_instructions_first() -> None:
    history = parse_items([{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}])
    chat = to_chat(responses(input="three", instructions="sys"), history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "sys"), ("user", "one"), ("assistant", "two"), ("user", "three"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "file_search"}], "tool_choice": "required"}, "tools[0].type"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
            "tools[0].tools[0].type",
        ),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "x", "include": ["computer_call_output.output.image_url"]}, "include"),
        ({}, "input"),
    ],
)
def test_responses_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        req = responses(**body)
        req.check()
        to_chat(req, [])
    assert info.value.param == param


@pytest.mark.parametrize(
    ("field", "value"),
    [("background", True), ("reasoning", {"effort": "low"}), ("truncation", "auto"), ("prompt", {"id": "p"}),
     ("max_tool_calls", 3), ("conversation", "c")],
)  # fmt: skip
def test_responses_fields_asking_for_what_is_not_done_are_refused(field: str, value: object) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        responses(input="x", **{field: value})
    responses(input="x", **{field: None})  # asking for nothing is accepted


def messages(**body: object) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, **body})


def test_messages_become_chat_messages() -> None:
    req = messages(
        system=[{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}, "input_examples": [{"city": "Oslo"}]}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], top_k=5,
    )  # fmt: skip
    chat = req.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    call = (chat.messages[2].tool_calls or [])[0]
    assert call.id == "toolu_1" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert chat.messages[3].content == "sunny" and chat.messages[4].content == "Error: boom"
    assert chat.forces_tool_call and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 16
    assert "Oslo" in (chat.tools or [])[0].function.description  # type: ignore[operator]
    assert CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ).to_chat()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124", "name": "bash"}]},
         "tools.0.type"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        messages(**body).to_chat()
    assert info.value.param == param


def test_store_evicts_oldest_by_count_and_bytes() -> None:
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        assert store.put({"id": f"r{i}", "pad": "x" * 100}, [])
    assert (
        len(store) == 3
        and store.get("r0") is None
        and store.get("r1") is None
        and store.get("r4") is not None
    )
    assert store.num_evicted == 2
    small = ResponseStore(max_count=100, max_bytes=600)
    for i in range(4):
        small.put({"id": f"r{i}", "pad": "x" * 200}, [])
    assert small.num_bytes <= 600 and small.get("r3") is not None and small.get("r0") is None
    assert not small.put({"id": "huge", "pad": "x" * 1000}, []) and small.num_refused == 1
    assert small.delete("r3") and not small.delete("r3") and small.get("r3") is None
    before = small.num_bytes
    small.put({"id": "r2", "pad": "y"}, [])  # replacing an id does not count twice
    assert small.num_bytes < before


def test_whole_prompt_admission_without_chunked_prefill() -> None:
    """An encoder's prompts: admitted only when all of each fits the step's budget (never a chunk), and one that
    could never fit is refused at intake."""
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=64), "none", enable_caching=False)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=16,
                             enable_chunked_prefill=False)  # fmt: skip
    sched = Scheduler(config, kv, 4)
    params = SamplingParams(max_tokens=0, temperature=0.0)
    for rid, n in (("a", 6), ("b", 6), ("c", 3)):
        sched.add_request(Request(rid, list(range(1, n + 1)), params))
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append([(row.request_id, row.num_new_tokens) for row in out.rows])
        assert all(row.start_position == 0 and not row.sample for row in out.rows)
        sched.update_from_output(out, ModelRunnerOutput(sampled={}), 0.0)
        sched.check_integrity()
        if len(steps) == 1:
            assert out.record.idle_rows.get(IdleReason.TOKEN_BUDGET)  # b waits whole, c waits behind it
    assert steps == [[("a", 6)], [("b", 6), ("c", 3)]]
    assert kv.num_free_blocks == 64
    with pytest.raises(BadRequestError, match="not chunked"):
        sched.add_request(Request("d", list(range(1, 12)), params))


def test_namespace_tools_are_qualified_functions_and_built_in_tools_optional_are_dropped() -> None:
    """Codex CLI's default tools: a namespace of functions and web_search under tool_choice auto."""
    shell = {"type": "function", "name": "exec", "parameters": {"type": "object", "properties": {}}}
    req = responses(
        input=[
            {"role": "user", "content": "list files"},
            {"type": "function_call", "call_id": "c1", "name": "exec", "namespace": "mcp__shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        ],
        tools=[{"type": "namespace", "name": "mcp__shell", "description": "a shell", "tools": [shell]},
               {"type": "web_search"}],
        tool_choice="auto",
    )  # fmt: skip
    offered = req.offered_tools()
    assert [t.name for t in offered.functions] == ["mcp__shell__exec"]
    assert offered.namespaces == {"mcp__shell__exec": ("mcp__shell", "exec")} and offered.dropped == [
        "web_search"
    ]
    chat = to_chat(req, [])
    assert [t.function.name for t in chat.tools or []] == ["mcp__shell__exec"]
    assert chat.messages[1].tool_calls[0].function.name == "mcp__shell__exec"  # the history's call, qualified
