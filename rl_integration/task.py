"""The task: n-digit addition with a verifiable, partial-credit reward.

A prompt is ``BOS a + b =`` with both operands written with exactly ``digits`` digits
(zero-padded, most significant first); the answer is the sum's ``digits + 1`` digits
*least significant first*, then ``EOS``. Writing the answer reversed lets a left-to-right
model emit each digit right after the carry it needs, which is what makes the task
learnable by a 2-layer model on a CPU in minutes (Lee et al., "Teaching Arithmetic to
Small Transformers", 2023). Every sequence has the same length, so there is no padding
inside a prompt.

The reward is the fraction of the ``digits + 2`` answer tokens (digits and ``EOS``) that
match the reference position by position: 1.0 is an exact answer, a wrong carry costs one
or two tokens' worth. A held-out split of operand pairs (about 1 in 16, chosen by a hash)
never appears in training prompts; the evaluation suite draws from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import UsageError

PLUS, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14
VOCAB = "0123456789+=^$_"  # one character per token id: ^ BOS, $ EOS, _ PAD
VOCAB_SIZE = len(VOCAB)
HELDOUT_MODULUS = 16

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class AdditionTask:
    """Addition of two ``digits``-digit numbers."""

    digits: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 8:
            raise UsageError(f"digits must be in [1, 8], got {self.digits}")

    @property
    def prompt_len(self) -> int:
        return 2 * self.digits + 3  # BOS, a, +, b, =

    @property
    def answer_len(self) -> int:
        return self.digits + 2  # digits of the sum (one more than an operand), then EOS

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len

    # -- operands -----------------------------------------------------------------------------

    def is_heldout(self, a: IntArray, b: IntArray) -> npt.NDArray[np.bool_]:
        """Whether each pair (a, b) belongs to the held-out split (a fixed hash, ~1/16)."""
        h = (a.astype(np.uint64) * np.uint64(1_000_003) + b.astype(np.uint64)) * np.uint64(2_654_435_761)
        out: npt.NDArray[np.bool_] = ((h >> np.uint64(16)) % np.uint64(HELDOUT_MODULUS)) == 0
        return out

    def sample_operands(self, rng: np.random.Generator, n: int, *, heldout: bool = False) -> tuple[IntArray, IntArray]:
        """``n`` operand pairs, uniform over the training split (or the held-out split)."""
        hi = 10**self.digits
        out_a: list[IntArray] = [np.zeros(0, np.int64)]
        out_b: list[IntArray] = [np.zeros(0, np.int64)]
        have = 0
        while have < n:
            a = rng.integers(0, hi, size=2 * n + 16, dtype=np.int64)
            b = rng.integers(0, hi, size=2 * n + 16, dtype=np.int64)
            keep = self.is_heldout(a, b) == heldout
            out_a.append(a[keep])
            out_b.append(b[keep])
            have += int(keep.sum())
        return np.concatenate(out_a)[:n], np.concatenate(out_b)[:n]

    # -- tokens -------------------------------------------------------------------------------

    def _digits_msb(self, x: IntArray, width: int) -> IntArray:
        powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
        return (x[:, None] // powers[None, :]) % 10

    def prompts(self, a: IntArray, b: IntArray) -> IntArray:
        """Prompt tokens, shape (n, prompt_len)."""
        n = len(a)
        return np.concatenate(
            [
                np.full((n, 1), BOS, np.int64),
                self._digits_msb(a, self.digits)[:, ::-1],
                np.full((n, 1), PLUS, np.int64),
                self._digits_msb(b, self.digits)[:, ::-1],
                np.full((n, 1), EQUALS, np.int64),
            ],
            axis=1,
        )

    def answers(self, a: IntArray, b: IntArray) -> IntArray:
        """Reference answer tokens (sum reversed, then EOS), shape (n, answer_len)."""
        reversed_digits = self._digits_msb(a + b, self.digits + 1)[:, ::-1]
        return np.concatenate([reversed_digits, np.full((len(a), 1), EOS, np.int64)], axis=1)

    def teacher_answers(self, a: IntArray, b: IntArray, rng: np.random.Generator, carry_error: float) -> IntArray:
        """Answers from a sloppy teacher that forgets each carry with probability ``carry_error``.

        The warm start imitates these: the policy learns the format and the digit sums,
        and is right about as often as the teacher (the reward alone says which answers
        were right). ``carry_error=0`` gives the reference answers.
        """
        n = len(a)
        out = np.empty((n, self.answer_len), np.int64)
        carry = np.zeros(n, np.int64)
        for i in range(self.digits):  # least significant digit first, as the answer is written
            s = (a // 10**i) % 10 + (b // 10**i) % 10 + carry
            out[:, i] = s % 10
            carry = (s >= 10).astype(np.int64)
            carry[rng.random(n) < carry_error] = 0
        out[:, self.digits] = carry
        out[:, self.digits + 1] = EOS
        return out

    def operands_of(self, prompts: IntArray) -> tuple[IntArray, IntArray]:
        """Recover (a, b) from prompt tokens (the reward needs nothing else)."""
        powers = 10 ** np.arange(self.digits, dtype=np.int64)
        a = (prompts[:, 1 : 1 + self.digits] * powers).sum(axis=1)
        b = (prompts[:, 2 + self.digits : 2 + 2 * self.digits] * powers).sum(axis=1)
        return a, b

    # -- reward -------------------------------------------------------------------------------

    def reward(self, prompts: IntArray, completions: IntArray) -> FloatArray:
        """Partial credit in [0, 1]: fraction of answer tokens right, position by position.

        ``completions`` are the generated tokens, shape (n, answer_len); tokens after an
        early EOS are PAD and count as wrong, so stopping early is never rewarded.
        """
        a, b = self.operands_of(prompts)
        ref = self.answers(a, b)
        credit: FloatArray = (completions[:, : self.answer_len] == ref).mean(axis=1).astype(np.float32)
        return credit

    def render(self, tokens: IntArray) -> str:
        """Human-readable tokens, e.g. ``^123+456=9750$`` (the answer reads reversed)."""
        return "".join(VOCAB[int(t)] if 0 <= int(t) < VOCAB_SIZE else "?" for t in tokens)

    def eval_suite(self, size: int, seed: int = 1234) -> IntArray:
        """A fixed held-out suite of ``size`` prompts."""
        a, b = self.sample_operands(np.random.default_rng(seed), size, heldout=True)
        return self.prompts(a, b)
