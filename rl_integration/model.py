"""The policy: a small Llama-style decoder (or Mixtral-style, with mixture-of-experts MLPs), in plain torch.

Parameter names and ``config.json`` are Hugging Face's (``LlamaForCausalLM`` /
``MixtralForCausalLM``: ``model.layers.N.self_attn.q_proj.weight``,
``model.layers.N.block_sparse_moe.experts.E.w1.weight``, ...), so a checkpoint this module
writes — or ``deltasync pull`` brings back — is served by vLLM as it is, and loads with
:meth:`TinyTransformer.from_pretrained` here without ``transformers``.

Two ways to run it:

* ``forward(tokens)``: the whole sequence at once, computing in ``compute_dtype`` (fp32 by
  default: parameters are upcast, which is exact from bf16). Attention is written out
  (matmul, mask, softmax, matmul), so the logits at a position depend only on the tokens
  up to it, in a fixed order of operations: scoring a buffer reproduces the generation
  that filled it bit for bit (the ``exact`` workers), and the trainer recomputes with it.
* :meth:`TinyTransformer.decode_step` with a :class:`KVCache`: incremental decoding, a
  prompt's prefill then one token at a time — the other kernels, shapes and reduction
  orders an inference engine runs (the ``kv_bf16`` workers run it in bf16).

The MoE MLP routes each token to the top ``num_experts_per_tok`` of ``num_local_experts``
experts (softmax over the router's logits, top-k, renormalized: Mixtral's rule). Every
forward records the experts it chose (:attr:`TinyTransformer.routing`, shape
``(layers, batch, time, k)``); given ``replay`` (same shape, -1 where nothing is replayed)
it routes as told instead — *router replay*: the trainer uses the experts the inference
engine used, with gate weights from its own router.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, UsageError
from .config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the compute dtype, then back (as Hugging Face's and vLLM's kernels do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class KVCache:
    """Keys and values of the positions decoded so far, per layer: (batch, kv_heads, time, head_dim)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        dt = x.dtype
        q = F.linear(x, self.q_proj.weight.to(dt)).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.k_proj.weight.to(dt)).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.v_proj.weight.to(dt)).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            if layer < len(cache.keys):
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
                cache.keys[layer], cache.values[layer] = k, v
            else:
                cache.keys.append(k)
                cache.values.append(v)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(dt)  # softmax in fp32, as attention kernels do
        out = (probs @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return F.linear(out, self.o_proj.weight.to(dt))


class _MLP(nn.Module):
    """Llama's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = F.silu(F.linear(x, self.gate_proj.weight.to(dt))) * F.linear(x, self.up_proj.weight.to(dt))
        return F.linear(h, self.down_proj.weight.to(dt))


class _Expert(nn.Module):
    """Mixtral's expert: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        return F.linear(F.silu(F.linear(x, self.w1.weight.to(dt))) * F.linear(x, self.w3.weight.to(dt)),
                        self.w2.weight.to(dt))


class _SparseMoE(nn.Module):
    """Mixtral's ``block_sparse_moe``: a router (``gate``) and ``num_local_experts`` experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(cfg) for _ in range(cfg.num_local_experts))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and the experts chosen per token, (batch, time, k), sorted ascending."""
        dt = x.dtype
        probs = torch.softmax(F.linear(x, self.gate.weight.to(dt)).float(), dim=-1)
        chosen = probs.topk(self.top_k, dim=-1).indices
        if replay is not None:  # the experts the inference engine used, where it reported them
            chosen = torch.where((replay >= 0).all(-1, keepdim=True), replay, chosen)
        chosen = chosen.sort(dim=-1).values
        w = probs.gather(-1, chosen)
        w = (w / w.sum(-1, keepdim=True)).to(dt)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # Dense over tokens (every expert sees every token, weighted 0 where not chosen):
            # the same shapes for any routing, so the arithmetic of a token never depends on
            # which other tokens share its experts.
            we = (w * (chosen == e).to(dt)).sum(-1, keepdim=True)
            out = out + we * expert(x)
        return out, chosen


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: _MLP | None = None if cfg.moe else _MLP(cfg)
        self.block_sparse_moe: _SparseMoE | None = _SparseMoE(cfg) if cfg.moe else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        h = self.post_attention_layernorm(x)
        if self.block_sparse_moe is not None:
            out, chosen = self.block_sparse_moe(h, replay)
            return x + out, chosen
        assert self.mlp is not None
        return x + self.mlp(h), None


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyTransformer(nn.Module):
    """Llama/Mixtral-style causal LM: ``forward(tokens) -> logits`` (in ``compute_dtype``)."""

    def __init__(self, cfg: ModelConfig, *, compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.compute_dtype = compute_dtype
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n = cfg.max_position_embeddings
        self.register_buffer("causal_mask", torch.ones(n, n, dtype=torch.bool).triu(1), persistent=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        # Plain attributes, not buffers: ``.to(bfloat16)`` casts parameters, never these fp32 tables.
        self.rope_cos, self.rope_sin = angles.cos(), angles.sin()
        self.routing: torch.Tensor | None = None
        """Experts chosen by the last forward (MoE only): (layers, batch, time, k), int64."""
        std = cfg.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)

    def _run(self, tokens: torch.Tensor, start: int, cache: KVCache | None,
             replay: torch.Tensor | None) -> torch.Tensor:
        t = tokens.shape[1]
        if start + t > self.config.max_position_embeddings:
            raise UsageError(f"sequence of {start + t} tokens exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        dt = self.compute_dtype
        m = self.model
        x = F.embedding(tokens, m.embed_tokens.weight.to(dt))
        cos = self.rope_cos[start : start + t].to(dt)
        sin = self.rope_sin[start : start + t].to(dt)
        mask: torch.Tensor | None = None
        if t > 1:
            mask = self.causal_mask[start : start + t, : start + t]  # type: ignore[index]
        chosen: list[torch.Tensor] = []
        for i, block in enumerate(m.layers):
            x, c = block(x, cos, sin, mask, cache, i, None if replay is None else replay[i])
            if c is not None:
                chosen.append(c)
        self.routing = torch.stack(chosen) if chosen else None
        return F.linear(m.norm(x), self.lm_head.weight.to(dt))

    def forward(self, tokens: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab) for int64 ``tokens`` (batch, time), the whole sequence at once.

        ``replay`` (MoE): experts to use, (layers, batch, time, k); -1 rows route as usual.
        """
        return self._run(tokens, 0, None, replay)

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of ``tokens`` (batch, new) following the ``cache.length`` positions in ``cache``
        (which grows by them): a prefill, then one token per call."""
        return self._run(tokens, cache.length, cache, None)

    # -- checkpoints ----------------------------------------------------------------------------

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The serving state: every parameter cast to bf16 (round to nearest even), contiguous."""
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                        metadata: dict[str, str] | None = None, extra_config: dict[str, Any] | None = None) -> Path:
        """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` (weights cast to ``dtype``)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
        dtype_name = str(dtype).removeprefix("torch.")
        cfg = self.config.to_hf(torch_dtype=dtype_name, **(extra_config or {}))
        (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (out / GENERATION_CONFIG_FILE).write_text(json.dumps(gen, indent=1, sort_keys=True) + "\n")
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
        try:
            cfg = ModelConfig.from_hf(raw)
        except UsageError as e:
            raise CheckpointError(str(root / CONFIG_FILE), str(e)) from None
        state = load_file(str(root / WEIGHTS_FILE))
        model = cls(cfg)
        stored = next(iter(state.values())).dtype
        model.to(dtype or stored)
        model.load_state_dict(state, strict=True)
        return model
