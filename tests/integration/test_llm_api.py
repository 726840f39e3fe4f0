"""The offline API (`LLM`) and the CLI on the embedded model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill import SamplingParams


@pytest.fixture(scope="module")
def llm(embedded_loaded):
    from tokenmill.engine import Engine
    from tokenmill.llm import LLM

    obj = LLM.__new__(LLM)
    obj.engine = Engine(loaded=embedded_loaded, num_kv_blocks=256, device="cpu")
    return obj


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_generate_shapes(llm):
    outs = llm.generate(["Hello, my name is", [504, 3458, 314]], SamplingParams(max_tokens=5, temperature=0))
    assert len(outs) == 2
    assert outs[1].prompt_token_ids == [504, 3458, 314]
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 5 or completion.finish_reason == "stop"
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
        assert out.finished


def test_generate_with_eos_stops(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=200, temperature=0))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.get_tokenizer().eos_token_ids


def test_llm_rejects_unknown_option():
    from tokenmill.llm import LLM

    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(max_batch=3)


def test_unknown_model_path_raises():
    from tokenmill.llm import LLM

    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/tmp/does-not-exist/model")


def test_cli_chat_streams_an_answer():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "chat",
            "What is the largest ocean on Earth?",
            "--max-tokens",
            "24",
            "--num-kv-blocks",
            "64",
            "--temperature",
            "0",  # greedy: the 135M says Pacific on both arithmetics
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Pacific" in proc.stdout


def test_cli_reports_bad_input_cleanly():
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "generate", "hi", "--max-tokens", "-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr


def test_llm_speculates_by_prompt_lookup_by_default_and_greedy_output_is_unchanged():
    from tokenmill.config import SpeculativeConfig
    from tokenmill.llm import LLM

    llm = LLM(num_kv_blocks=64)
    assert isinstance(llm.engine.config.speculative_config, SpeculativeConfig)
    assert llm.engine.config.speculative_config.method == "ngram"
    plain = LLM(num_kv_blocks=64, speculative_config={"method": "none"})
    assert plain.engine.config.speculative_config is None
    prompt = "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday,"
    params = SamplingParams(max_tokens=24, temperature=0)
    assert (
        llm.generate([prompt], params)[0].outputs[0].token_ids
        == plain.generate([prompt], params)[0].outputs[0].token_ids
    )
    assert llm.engine.stats.num_spec_draft_tokens > 0  # it did propose
