"""Sampling defaults from a model's generation_config.json, else tokenmill's documented ones (pure Python)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.generation_defaults import FALLBACK, for_request, resolve


def _dir(tmp_path: Path, **config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_model_directory_gives_its_own_values(tmp_path: Path) -> None:
    d = _dir(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
             max_new_tokens=64, eos_token_id=[1, 2], bos_token_id=1)  # fmt: skip
    got = resolve("auto", d)
    assert got.values == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    assert "generation_config.json" in got.source


def test_do_sample_false_means_greedy(tmp_path: Path) -> None:
    assert resolve("auto", _dir(tmp_path, do_sample=False, temperature=0.7)).values == {"temperature": 0.0}


def test_no_file_and_gguf_get_the_documented_defaults(tmp_path: Path) -> None:
    assert resolve("auto", tmp_path).values == FALLBACK  # a directory without the file
    assert resolve("auto", tmp_path / "model.gguf").values == FALLBACK
    assert resolve("auto", None).values == FALLBACK
    assert FALLBACK["temperature"] > 0  # sampled, not greedy


def test_none_and_an_explicit_directory(tmp_path: Path) -> None:
    assert resolve("none", _dir(tmp_path, temperature=0.2)).values == {}
    other = _dir(tmp_path / "other", temperature=0.2) if (tmp_path / "other").mkdir() is None else None
    assert other is not None and resolve(str(other), None).values == {"temperature": 0.2}
    with pytest.raises(ValueError, match="generation_config"):
        resolve(str(tmp_path / "missing"), None)


def test_a_greedy_request_takes_no_sampling_filter() -> None:
    assert for_request(FALLBACK, 0.0) == {"temperature": 0.8}  # its own temperature 0 wins over this one
    assert for_request(FALLBACK, None) == FALLBACK
    assert for_request({**FALLBACK, "temperature": 0.0}, None) == {"temperature": 0.0}  # do_sample false
    assert for_request(FALLBACK, 1.0)["repetition_penalty"] == 1.1
