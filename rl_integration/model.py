"""The policy: a small decoder-only transformer, defined here (random init, no downloads).

Parameters may be held in any float dtype; the forward pass always computes in fp32
(``_f32`` upcasts, which is exact from bf16). So a serving copy holds the bf16 weights the
trainer published, bit for bit, and the trainer scores a version with a bf16 copy of its
own: both run the same fp32 arithmetic on the same values. Attention is written out
(matmul, mask, softmax, matmul) rather than a fused kernel, so the logits at a position
depend only on the tokens up to it, in a fixed order of operations: the tokens after it
(padding while generating, the sampled tail when scoring) cannot change a bit of them.

Checkpoints are Hugging Face style directories: ``config.json`` plus ``model.safetensors``
with ``model.layers.N...`` tensor names, so the output of ``deltasync pull`` loads with
:meth:`TinyTransformer.from_pretrained`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltasync.errors import CheckpointError, UsageError

from .config import MODEL_TYPE, ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, _f32(layer.weight), None if layer.bias is None else _f32(layer.bias))


def _norm(x: torch.Tensor, layer: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, layer.normalized_shape, _f32(layer.weight), _f32(layer.bias), layer.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = _linear(x, self.qkv_proj).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return _linear(out, self.o_proj)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(F.gelu(_linear(x, self.up_proj)), self.down_proj)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(_norm(x, self.input_layernorm), mask)
        out: torch.Tensor = x + self.mlp(_norm(x, self.post_attention_layernorm))
        return out


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)


class TinyTransformer(nn.Module):
    """Pre-norm GPT-style causal LM: ``forward(tokens) -> fp32 logits``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n = cfg.max_position_embeddings
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        self.register_buffer("causal_mask", causal, persistent=False)
        self.apply(_init)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) in fp32 for int64 ``tokens`` (batch, time)."""
        t = tokens.shape[1]
        if t > self.config.max_position_embeddings:
            raise UsageError(f"sequence of {t} tokens exceeds max_position_embeddings {self.config.max_position_embeddings}")
        m = self.model
        pos = torch.arange(t, device=tokens.device)
        x = F.embedding(tokens, _f32(m.embed_tokens.weight)) + F.embedding(pos, _f32(m.embed_positions.weight))
        mask: torch.Tensor = self.causal_mask[:t, :t]  # type: ignore[index]
        for block in m.layers:
            x = block(x, mask)
        return F.linear(_norm(x, m.norm), _f32(self.lm_head.weight))

    # -- checkpoints ----------------------------------------------------------------------------

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The serving state: every parameter cast to bf16 (round to nearest even), contiguous."""
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                        metadata: dict[str, str] | None = None, extra_config: dict[str, Any] | None = None) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (weights cast to ``dtype``)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
        dtype_name = str(dtype).removeprefix("torch.")
        cfg = self.config.to_hf(torch_dtype=dtype_name, **(extra_config or {}))
        (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None) -> TinyTransformer:
        """Load a directory written by :meth:`save_pretrained` (or pulled by deltasync).

        Parameters keep the stored dtype (bit for bit) unless ``dtype`` is given.
        """
        from safetensors.torch import load_file

        root = Path(path)
        try:
            raw = json.loads((root / CONFIG_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(str(root / CONFIG_FILE), f"cannot read model config ({e})") from None
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(str(root / CONFIG_FILE), f"model_type is {raw.get('model_type')!r}, not {MODEL_TYPE!r}")
        state = load_file(str(root / WEIGHTS_FILE))
        model = cls(ModelConfig.from_hf(raw))
        stored = next(iter(state.values())).dtype
        model.to(dtype or stored)
        model.load_state_dict(state, strict=True)
        return model


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
