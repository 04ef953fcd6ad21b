"""Build a tiny Qwen2 checkpoint with random weights and a word-level tokenizer, offline.

Run by the vLLM environment's python (it needs ``transformers`` and ``tokenizers``, which the
project's own environment does not install)::

    .venv-vllm/bin/python tests/vllm_model.py OUT TOKENIZER [--seed 0] [--hidden 128] [--layers 2]

OUT gets what ``save_pretrained`` writes (config.json, model.safetensors,
generation_config.json); TOKENIZER a word-level tokenizer (``w2 w3 ...``). They are kept
apart because transformers picks the tokenizer class from a model's config (Qwen2's BPE),
and serve with ``--model OUT --tokenizer TOKENIZER``: no hub.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def build(out: Path, tokenizer: Path, *, seed: int, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    # Typed loosely: the transformers vLLM pins and a newer one (in other environments) name
    # and type these differently, and only the vLLM environment's is run.
    options: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, torch_dtype="bfloat16",
    )
    config = Qwen2Config(**options)
    causal_lm: Any = Qwen2ForCausalLM
    model = causal_lm(config).to(torch.bfloat16)
    # Random weights, larger than the default init, so a perturbed version generates
    # differently (the tests compare generations across versions).
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.ndim == 1 else 0.2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    words = {"[UNK]": 0, "<|endoftext|>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast_tokenizer: Any = PreTrainedTokenizerFast
    fast = fast_tokenizer(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("tokenizer", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128, help="a multiple of 64 (vLLM CPU attention wants head_dim 64+)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args()
    build(a.out, a.tokenizer, seed=a.seed, hidden=a.hidden, layers=a.layers, vocab=a.vocab)


if __name__ == "__main__":
    main()
