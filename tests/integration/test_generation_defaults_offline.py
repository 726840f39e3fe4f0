"""Generation defaults through the offline API: a model directory's generation_config.json fills what a
request leaves unset (its own values win); the embedded GGUF gets tokenmill's documented defaults."""

from __future__ import annotations

import json
from pathlib import Path

from test_model_vs_hf import _save_with_tokenizer, _tiny_hf_model

from tokenmill import LLM, SamplingParams
from tokenmill.generation_defaults import FALLBACK

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.3, "top_p": 0.7, "top_k": 5,
                     "repetition_penalty": 1.2, "max_new_tokens": 7, "eos_token_id": 2}  # fmt: skip


def test_directory_defaults_fill_unset_fields_and_requests_win(tmp_path: Path) -> None:
    _save_with_tokenizer(_tiny_hf_model(seed=3), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64)
    params = llm.engine.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.3, 0.7, 5, 1.2, 7,
    )  # fmt: skip
    prompt = "w5 w9 w11"
    [unset] = llm.generate(prompt, use_tqdm=False)
    assert len(unset.outputs[0].token_ids) == 7 or unset.outputs[0].finish_reason == "stop"
    spelled = LLM(str(tmp_path), device="cpu", num_kv_blocks=64).generate(
        prompt,
        SamplingParams(temperature=0.3, top_p=0.7, top_k=5, repetition_penalty=1.2, max_tokens=7),
        use_tqdm=False,
    )[0]
    assert spelled.outputs[0].token_ids == unset.outputs[0].token_ids  # same engine seed, same fields
    [own] = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(own.outputs[0].token_ids) == 3  # the request's own values win
    greedy = llm.engine.default_sampling_params(temperature=0)
    assert greedy.temperature == 0 and greedy.max_tokens == 7  # one flag away ...
    assert (greedy.top_k, greedy.top_p, greedy.repetition_penalty) == (
        -1,
        1.0,
        1.0,
    )  # ... over the raw distribution


def test_generation_config_none_keeps_sampling_params_own_defaults(tmp_path: Path) -> None:
    _save_with_tokenizer(_tiny_hf_model(seed=3), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64, generation_config="none")
    assert llm.engine.default_sampling_params() == SamplingParams()


def test_the_embedded_gguf_gets_the_documented_defaults(make_engine) -> None:
    engine = make_engine()
    assert engine.generation_defaults.values == FALLBACK
    params = engine.default_sampling_params()
    assert params.temperature == FALLBACK["temperature"] and params.top_k == FALLBACK["top_k"]
