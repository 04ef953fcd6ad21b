"""Generating completions with per-token log-probs, and scoring them again.

Both run the model on the same fixed-shape buffer, ``(batch, prompt_len + answer_len)``:
generation fills it left to right (positions not generated yet hold PAD) and reads the
logits at the position before each new token; scoring runs the filled buffer once. The
model is causal with an explicit mask, so the logits at a position are a function of the
tokens up to it only, computed by the same kernels on the same shapes: scoring a batch
with the weights that generated it reproduces the behaviour log-probs bit for bit
(single-threaded, deterministic CPU kernels; see ``torch.set_num_threads(1)`` in the
worker and the trainer). That is what the trainer's log-prob gap checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from .model import TinyTransformer
from .task import EOS, PAD


@dataclass
class Generation:
    """A batch of completions. Arrays, so it pickles cheaply across processes."""

    tokens: npt.NDArray[np.int64]
    """(batch, prompt_len + answer_len): prompt, completion, PAD after an early EOS."""
    logprobs: npt.NDArray[np.float32]
    """(batch, answer_len): log-prob of each generated token under the sampling policy; 0 where masked."""
    mask: npt.NDArray[np.bool_]
    """(batch, answer_len): generated tokens up to and including the first EOS."""
    prompt_len: int

    @property
    def completions(self) -> npt.NDArray[np.int64]:
        return self.tokens[:, self.prompt_len :]


@torch.no_grad()
def generate(
    model: TinyTransformer,
    prompts: npt.NDArray[np.int64],
    answer_len: int,
    *,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> Generation:
    """Sample (temperature 1) or greedily decode ``answer_len`` tokens after each prompt."""
    n, p = prompts.shape
    buf = torch.full((n, p + answer_len), PAD, dtype=torch.int64)
    buf[:, :p] = torch.from_numpy(prompts)
    logprobs = torch.zeros(n, answer_len, dtype=torch.float32)
    mask = torch.zeros(n, answer_len, dtype=torch.bool)
    done = torch.zeros(n, dtype=torch.bool)
    for i in range(answer_len):
        logp = torch.log_softmax(model(buf), dim=-1)[:, p - 1 + i]
        tok = logp.argmax(dim=-1) if greedy else torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        live = ~done
        buf[:, p + i] = torch.where(live, tok, PAD)
        logprobs[:, i] = torch.where(live, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        mask[:, i] = live
        done |= tok == EOS
    return Generation(buf.numpy(), logprobs.numpy(), mask.numpy(), p)


def token_logprobs(model: TinyTransformer, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs (batch, answer_len) of the completion tokens in ``tokens`` (differentiable).

    Same computation as :func:`generate`: one forward over the whole buffer, log-softmax
    over the vocabulary, then the entries of the completion tokens.
    """
    logp = torch.log_softmax(model(tokens), dim=-1)
    answer_len = tokens.shape[1] - prompt_len
    pred = logp[:, prompt_len - 1 : prompt_len - 1 + answer_len]
    return pred.gather(2, tokens[:, prompt_len:, None]).squeeze(2)
