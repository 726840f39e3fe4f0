"""The grammar mask on the logits (against a hand-built bitmask), and the engine-side advance."""

from __future__ import annotations

import ctypes

import torch

from tokenmill.structured_outputs import advance, apply_masks


class FakeMatcher:
    """Allows exactly ``allowed``; writes its bitmask the way llguidance does (32 tokens per int32 word)."""

    def __init__(self, allowed: set[int], stop_after: int | None = None) -> None:
        self.allowed = allowed
        self.consumed: list[int] = []
        self.stop_after = stop_after

    def unsafe_compute_mask_ptr(self, ptr: int, num_bytes: int) -> None:
        words = (ctypes.c_uint32 * (num_bytes // 4)).from_address(ptr)
        for w in range(len(words)):
            words[w] = sum(1 << j for j in range(32) if 32 * w + j in self.allowed)

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return token in self.allowed

    def get_error(self) -> str:
        return "not allowed"

    def is_stopped(self) -> bool:
        return self.stop_after is not None and len(self.consumed) >= self.stop_after


def test_mask_applies_to_constrained_rows_only() -> None:
    logits = torch.randn(3, 80)
    before = logits.clone()
    apply_masks(logits, [(1, FakeMatcher({1, 33, 70, 79}))])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    keep = torch.zeros(80, dtype=torch.bool)
    keep[[1, 33, 70, 79]] = True
    assert torch.equal(logits[1][keep], before[1][keep])
    assert torch.isinf(logits[1][~keep]).all() and (logits[1][~keep] < 0).all()
    assert int(logits[1].argmax()) in (1, 33, 70, 79)


def test_no_constrained_rows_leaves_logits_alone() -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    apply_masks(logits, [])
    assert torch.equal(logits, before)


def test_advance_reports_completion_and_bad_tokens() -> None:
    m = FakeMatcher({5, 6}, stop_after=2)
    assert advance(m, [5]) is None
    assert advance(m, [6]) == "stop"
    bad = FakeMatcher({5})
    message = advance(bad, [7])
    assert message is not None and "does not fit the grammar" in message


class NoisyMatcher(FakeMatcher):
    """Fails the way llguidance can: a message carrying its parser state and a Rust panic backtrace."""

    def get_error(self) -> str:
        state = "Parser state: " + "row 17 item 3 [lexeme 9] " * 200
        return (
            "token 5 not allowed by the lexer\n"
            + state
            + "\nstack backtrace:\n   0: rust_panic\n   1: llguidance::earley"
        )


def test_a_constraint_failing_mid_decode_says_one_short_line() -> None:
    message = advance(NoisyMatcher({1}), [1, 5])
    assert message is not None and message.startswith("structured output: token 5 does not fit the grammar")
    assert "\n" not in message and "backtrace" not in message and "Parser state" not in message
    assert len(message) < 500
