"""The mixed-request benchmark's workloads: the same seed gives the same requests, and text prompts are windows of
the text with the lengths and output counts the docstring promises."""

from __future__ import annotations

from benchmarks.served_mix import make_requests, make_text_requests


def _is_window(prompt: list[int], text_ids: list[int]) -> bool:
    n = len(prompt)
    return any(text_ids[i : i + n] == prompt for i in range(len(text_ids) - n + 1))


def test_text_prompts_are_seeded_windows_of_the_text() -> None:
    text_ids = [(7 * i) % 1009 for i in range(5000)]  # no window repeats: period 1009
    requests = make_text_requests(12, text_ids, seed=3)
    assert requests == make_text_requests(12, text_ids, seed=3)
    assert requests != make_text_requests(12, text_ids, seed=4)
    for prompt, num_out in requests:
        assert 64 <= len(prompt) <= 512 and 32 <= num_out <= 128
        assert _is_window(prompt, text_ids)


def test_random_prompts_keep_to_ordinary_ids() -> None:
    requests = make_requests(8, vocab_size=5000, seed=1)
    assert requests == make_requests(8, vocab_size=5000, seed=1)
    for prompt, num_out in requests:
        assert 64 <= len(prompt) <= 512 and 32 <= num_out <= 128
        assert all(100 <= t < 4000 for t in prompt)
