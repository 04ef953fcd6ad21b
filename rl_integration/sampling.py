"""Generating completions with per-token log-probs (and, for MoE, the experts used), and scoring them again.

Two generation paths. :func:`generate` (the ``exact`` workers) is described below: it
reproduces the trainer's arithmetic bit for bit. :func:`generate_kv` (the ``kv_bf16``
workers) decodes incrementally with a KV cache, computing in bf16: other kernels, other
shapes, other reduction orders than the trainer's full-sequence fp32 recompute — the gap
between an inference engine and a trainer, measured by the loop (and, in MoE models,
tokens routed to other experts).

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

from .model import KVCache, TinyTransformer
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
    routing: npt.NDArray[np.int16] | None = None
    """MoE only: experts chosen at each position, (layers, batch, prompt_len + answer_len, k);
    -1 at positions the worker never ran (the last token)."""

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
    routing = None
    if model.routing is not None:  # the last forward saw every position but the last token
        r = model.routing.clone()
        r[:, :, p + answer_len - 1 :] = -1
        routing = r.to(torch.int16).numpy()
    return Generation(buf.numpy(), logprobs.numpy(), mask.numpy(), p, routing)


@torch.no_grad()
def generate_kv(
    model: TinyTransformer,
    prompts: npt.NDArray[np.int64],
    answer_len: int,
    *,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> Generation:
    """Like :func:`generate`, by incremental decoding: a prefill of the prompts, then one
    token per step through a :class:`~.model.KVCache`, in the model's ``compute_dtype``
    (log-softmax in fp32, as inference engines do)."""
    n, p = prompts.shape
    buf = torch.full((n, p + answer_len), PAD, dtype=torch.int64)
    buf[:, :p] = torch.from_numpy(prompts)
    logprobs = torch.zeros(n, answer_len, dtype=torch.float32)
    mask = torch.zeros(n, answer_len, dtype=torch.bool)
    done = torch.zeros(n, dtype=torch.bool)
    cache = KVCache()
    logits = model.decode_step(buf[:, :p], cache)[:, -1]
    routes: list[torch.Tensor] = [] if model.routing is None else [model.routing]
    for i in range(answer_len):
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1) if greedy else torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        live = ~done
        buf[:, p + i] = torch.where(live, tok, PAD)
        logprobs[:, i] = torch.where(live, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        mask[:, i] = live
        done |= tok == EOS
        if i + 1 < answer_len:
            logits = model.decode_step(buf[:, p + i : p + i + 1], cache)[:, -1]
            if model.routing is not None:
                routes.append(model.routing)
    routing = None
    if routes:
        r = torch.cat(routes, dim=2)
        last = torch.full((r.shape[0], n, 1, r.shape[3]), -1, dtype=r.dtype)
        routing = torch.cat([r, last], dim=2).to(torch.int16).numpy()
    return Generation(buf.numpy(), logprobs.numpy(), mask.numpy(), p, routing)


def token_logprobs(model: TinyTransformer, tokens: torch.Tensor, prompt_len: int,
                   replay: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs (batch, answer_len) of the completion tokens in ``tokens`` (differentiable).

    Same computation as :func:`generate`: one forward over the whole buffer, log-softmax
    over the vocabulary, then the entries of the completion tokens. ``replay`` (MoE): the
    experts to route each position to (router replay), as in ``Generation.routing``.
    """
    logp = torch.log_softmax(model(tokens, replay).float(), dim=-1)
    answer_len = tokens.shape[1] - prompt_len
    pred = logp[:, prompt_len - 1 : prompt_len - 1 + answer_len]
    return pred.gather(2, tokens[:, prompt_len:, None]).squeeze(2)
