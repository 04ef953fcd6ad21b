"""Streams of bf16 model versions that look like consecutive RL training steps.

Three parts, used by ``benchmarks/bench_codec.py``:

* :func:`rl_state_dicts` / :func:`rl_stream` — a real one: a small random-init decoder-only
  transformer trained with real backward passes and ``torch.optim.AdamW`` on fp32 master
  weights; after every optimizer step the published version is the bf16 cast of the
  master weights (what a mixed-precision trainer hands to inference).
* :func:`measure_change_stats` — what changes between consecutive real versions: the
  fraction of changed elements per tensor kind, and the distribution of the wrapping int16
  difference of the bf16 bit patterns (mostly ±1 ulp).
* :func:`synthetic_stream` — a stream of any size (1 GiB and more, too large to train on a
  laptop-class CPU) on a transformer-shaped layout (:func:`transformer_layout`) that
  reproduces those statistics: each step changes the measured fraction of each kind's
  elements, at uniformly random positions, by differences drawn from the measured
  distribution.

A version is a :class:`FlatModel`: every tensor's bf16 bit patterns back to back in one
uint16 buffer, so "the whole checkpoint" and "one tensor" are both cheap views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

U16 = npt.NDArray[np.uint16]
I16 = npt.NDArray[np.int16]
I64 = npt.NDArray[np.int64]

INIT_STD = 0.02
"""Standard deviation of the random init of every matrix (GPT-2 / Llama convention)."""


# -- versions as flat bit-pattern buffers -----------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    offset: int
    """Offset of the tensor's first element in the flat buffer (elements, not bytes)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        return tensor_kind(self.name)


Layout = tuple[TensorSpec, ...]


def make_layout(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> Layout:
    specs: list[TensorSpec] = []
    offset = 0
    for name, shape in shapes:
        spec = TensorSpec(name, tuple(shape), offset)
        specs.append(spec)
        offset += spec.numel
    return tuple(specs)


def layout_numel(layout: Layout) -> int:
    return layout[-1].offset + layout[-1].numel if layout else 0


@dataclass(frozen=True)
class FlatModel:
    """One version: the bf16 bit patterns of every tensor, back to back."""

    layout: Layout
    bits: U16

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def tensor(self, spec: TensorSpec) -> U16:
        return self.bits[spec.offset : spec.offset + spec.numel]


def tensor_kind(name: str) -> str:
    """The kind of a tensor, from Llama-style names: embed, attn, mlp, norm, lm_head."""
    if "embed" in name:
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    if "norm" in name:
        return "norm"
    if "attn" in name:
        return "attn"
    if "mlp" in name:
        return "mlp"
    return "other"


def flatten_bf16(state: Mapping[str, torch.Tensor]) -> FlatModel:
    """A bf16 state dict as one flat buffer of bit patterns (copied)."""
    layout = make_layout((name, tuple(t.shape)) for name, t in state.items())
    bits = np.empty(layout_numel(layout), dtype=np.uint16)
    for spec, t in zip(layout, state.values(), strict=True):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{spec.name}: expected bfloat16, got {t.dtype}")
        src = t.detach().reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)
        bits[spec.offset : spec.offset + spec.numel] = src
    return FlatModel(layout, bits)


# -- the real stream: a small transformer trained with AdamW ----------------------------------


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    """A small Llama-shaped decoder-only transformer, trainable on a CPU in seconds per step."""

    vocab: int = 4096
    """Vocabulary size."""
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads (d_model must divide evenly)."""
    d_ff: int = 704
    """SwiGLU hidden width (~8/3 d_model, rounded to 64)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch: int = 8
    """Sequences per optimizer step."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        # No positional encoding: the synthetic task only needs the previous token, which
        # causal attention can find without one; it keeps the model to the tensors that matter.
        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class _MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class TinyTransformer(nn.Module):
    """Parameter names follow Hugging Face Llama, so tensor kinds match the synthetic layout."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits


class _BigramTask:
    """Next-token prediction on a fixed random sparse bigram language (4 successors per token)."""

    def __init__(self, cfg: TinyConfig, gen: torch.Generator) -> None:
        self.cfg = cfg
        self.gen = gen
        self.successors = torch.randint(cfg.vocab, (cfg.vocab, 4), generator=gen)
        self.probs = torch.rand(cfg.vocab, 4, generator=gen) + 0.1

    def batch(self) -> torch.Tensor:
        cfg = self.cfg
        tokens = torch.empty(cfg.batch, cfg.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab, (cfg.batch,), generator=self.gen)
        for i in range(1, cfg.seq_len + 1):
            prev = tokens[:, i - 1]
            pick = torch.multinomial(self.probs[prev], 1, generator=self.gen).squeeze(1)
            tokens[:, i] = self.successors[prev, pick]
        return tokens


def bf16_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer publishes: the bf16 cast of the fp32 master weights."""
    return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}


def rl_state_dicts(
    lr: float, steps: int, *, warmup: int = 10, cfg: TinyConfig | None = None, seed: int = 0,
    weight_decay: float = 0.01,
) -> Iterator[dict[str, torch.Tensor]]:
    """``steps + 1`` successive bf16 state dicts of a model trained with AdamW at ``lr``.

    ``warmup`` optimizer steps run first (same lr) so Adam's moments are not at their
    first-step values; the first dict yielded is the version after warm-up, then one per step.
    """
    cfg = cfg or TinyConfig()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = TinyTransformer(cfg)
    task = _BigramTask(cfg, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)

    def step() -> float:
        tokens = task.batch()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return float(loss.detach())

    for _ in range(warmup):
        step()
    yield bf16_state_dict(model)
    for _ in range(steps):
        step()
        yield bf16_state_dict(model)


def rl_stream(
    lr: float, steps: int, *, warmup: int = 10, cfg: TinyConfig | None = None, seed: int = 0
) -> Iterator[FlatModel]:
    """:func:`rl_state_dicts` as flat bit-pattern versions."""
    for state in rl_state_dicts(lr, steps, warmup=warmup, cfg=cfg, seed=seed):
        yield flatten_bf16(state)


# -- statistics of the changes ----------------------------------------------------------------


def bit_change(old: U16, new: U16) -> tuple[I64, I16]:
    """Indices of changed elements and the wrapping int16 difference ``new - old`` of their bits."""
    idx = np.flatnonzero(old != new)
    diff = (new[idx] - old[idx]).view(np.int16)  # uint16 arithmetic wraps
    return idx.astype(np.int64, copy=False), diff


@dataclass(frozen=True)
class DiffDistribution:
    """Empirical distribution of int16 bit-pattern differences."""

    values: I16
    counts: I64

    @staticmethod
    def of(diffs: I16) -> DiffDistribution:
        values, counts = np.unique(diffs, return_counts=True)
        return DiffDistribution(values.astype(np.int16), counts.astype(np.int64))

    @staticmethod
    def merge(parts: Iterable[DiffDistribution]) -> DiffDistribution:
        parts = list(parts)
        vals = [p.values for p in parts]
        if not vals:
            return DiffDistribution(np.zeros(0, np.int16), np.zeros(0, np.int64))
        allv = np.concatenate(vals)
        allc = np.concatenate([p.counts for p in parts])
        values, inverse = np.unique(allv, return_inverse=True)
        counts = np.zeros(len(values), dtype=np.int64)
        np.add.at(counts, inverse, allc)
        return DiffDistribution(values.astype(np.int16), counts)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def probs(self) -> npt.NDArray[np.float64]:
        return self.counts / max(1, self.total)

    @property
    def entropy_bits(self) -> float:
        """Zero-order entropy per changed element, in bits."""
        return entropy_bits(self.counts)

    def share(self, predicate: npt.NDArray[np.bool_]) -> float:
        return float(self.counts[predicate].sum()) / max(1, self.total)

    def describe(self, top: int = 6) -> str:
        order = np.argsort(-self.counts)[:top]
        parts = [f"{int(self.values[i]):+d}:{100 * self.probs[i]:.1f}%" for i in order]
        small = np.abs(self.values.astype(np.int32)) <= 1
        return f"{' '.join(parts)}  (|d|<=1 ulp: {100 * self.share(small):.2f}%, H={self.entropy_bits:.3f} bit)"


def entropy_bits(counts: npt.NDArray[np.integer]) -> float:
    c = counts[counts > 0].astype(np.float64)
    if c.size == 0:
        return 0.0
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


@dataclass(frozen=True)
class KindStats:
    elements: int
    """Elements of this kind in one version."""
    changed: int
    """Changed elements summed over all measured deltas."""
    deltas: int
    diffs: DiffDistribution

    @property
    def fraction(self) -> float:
        return self.changed / max(1, self.elements * self.deltas)


@dataclass(frozen=True)
class ChangeStats:
    kinds: dict[str, KindStats]
    overall: KindStats
    per_delta_fraction: tuple[float, ...]

    def for_kind(self, kind: str) -> tuple[float, DiffDistribution]:
        """Fraction and distribution to reproduce for ``kind``; the overall ones if unmeasured."""
        ks = self.kinds.get(kind)
        if ks is None:
            return self.overall.fraction, self.overall.diffs
        diffs = ks.diffs if ks.diffs.total >= 100 else self.overall.diffs
        return ks.fraction, diffs


def measure_change_stats(versions: Iterable[FlatModel]) -> ChangeStats:
    """Change statistics over consecutive pairs of ``versions`` (all with one layout)."""
    changed: dict[str, int] = {}
    elements: dict[str, int] = {}
    dists: dict[str, list[DiffDistribution]] = {}
    per_delta: list[float] = []
    prev: FlatModel | None = None
    for cur in versions:
        if prev is not None:
            if prev.layout != cur.layout:
                raise ValueError("versions have different layouts")
            total = 0
            for spec in cur.layout:
                idx, diff = bit_change(prev.tensor(spec), cur.tensor(spec))
                changed[spec.kind] = changed.get(spec.kind, 0) + len(idx)
                dists.setdefault(spec.kind, []).append(DiffDistribution.of(diff))
                total += len(idx)
            per_delta.append(total / max(1, layout_numel(cur.layout)))
        else:
            for spec in cur.layout:
                elements[spec.kind] = elements.get(spec.kind, 0) + spec.numel
        prev = cur
    n = len(per_delta)
    if n == 0:
        raise ValueError("need at least two versions to measure changes")
    kinds = {
        k: KindStats(elements[k], changed.get(k, 0), n, DiffDistribution.merge(dists.get(k, [])))
        for k in elements
    }
    overall = KindStats(
        sum(elements.values()), sum(changed.values()), n, DiffDistribution.merge(k.diffs for k in kinds.values())
    )
    return ChangeStats(kinds, overall, tuple(per_delta))


# -- the synthetic stream ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    vocab: int
    d_model: int
    n_layers: int
    d_ff: int

    def describe(self) -> str:
        return f"d_model {self.d_model}, {self.n_layers} layers, d_ff {self.d_ff}, vocab {self.vocab}"


# (d_model, vocab, d_ff) of Llama-like families, smallest first.
_FAMILIES = ((128, 1024, 384), (256, 4096, 704), (512, 8192, 1408), (1024, 32000, 2816),
             (2048, 32000, 5632), (4096, 32000, 11008), (8192, 128256, 28672))


def shape_for_size(size_bytes: int) -> TransformerShape:
    """The widest Llama-like shape with at least 4 layers whose bf16 size is at least ``size_bytes``."""
    params = max(1, size_bytes // 2)
    best = _FAMILIES[0]
    for fam in _FAMILIES:
        d, v, ff = fam
        if 2 * v * d + 4 * _layer_params(d, ff) <= params:
            best = fam
    d, v, ff = best
    layers = max(1, math.ceil((params - 2 * v * d - d) / _layer_params(d, ff)))
    return TransformerShape(vocab=v, d_model=d, n_layers=layers, d_ff=ff)


def _layer_params(d: int, ff: int) -> int:
    return 4 * d * d + 3 * d * ff + 2 * d


def transformer_layout(shape: TransformerShape) -> Layout:
    """Tensor names and shapes of a Llama-style model, in state-dict order."""
    d, ff = shape.d_model, shape.d_ff
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (shape.vocab, d))]
    for i in range(shape.n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)),
            (p + "self_attn.k_proj.weight", (d, d)),
            (p + "self_attn.v_proj.weight", (d, d)),
            (p + "self_attn.o_proj.weight", (d, d)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (ff, d)),
            (p + "mlp.up_proj.weight", (ff, d)),
            (p + "mlp.down_proj.weight", (d, ff)),
        ]
    shapes += [("norm.weight", (d,)), ("lm_head.weight", (shape.vocab, d))]
    return make_layout(shapes)


def _to_bf16_bits(x: npt.NDArray[np.float32]) -> U16:
    """Round-to-nearest-even float32 -> bf16 bit patterns (finite inputs)."""
    u = x.view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)


def random_init(layout: Layout, rng: np.random.Generator, block: int = 1 << 24) -> FlatModel:
    """bf16 weights ~ N(0, 0.02), norm scales 1.0; generated in blocks so temporaries stay small."""
    bits = np.empty(layout_numel(layout), dtype=np.uint16)
    one = _to_bf16_bits(np.ones(1, dtype=np.float32))[0]
    for spec in layout:
        out = bits[spec.offset : spec.offset + spec.numel]
        if spec.kind == "norm":
            out[:] = one
            continue
        for start in range(0, spec.numel, block):
            n = min(block, spec.numel - start)
            x = rng.standard_normal(n, dtype=np.float32)
            x *= np.float32(INIT_STD)
            out[start : start + n] = _to_bf16_bits(x)
    return FlatModel(layout, bits)


def bernoulli_positions(n: int, p: float, rng: np.random.Generator) -> I64:
    """Sorted positions of a Bernoulli(p) process over ``n`` elements, in O(n p) memory and time."""
    if p <= 0.0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    if p >= 1.0:
        return np.arange(n, dtype=np.int64)
    parts: list[I64] = []
    last = -1
    while last < n - 1:
        expect = (n - 1 - last) * p
        gaps = rng.geometric(p, size=int(expect + 6 * math.sqrt(expect) + 64))
        pos = last + np.cumsum(gaps)
        parts.append(pos[pos < n])
        last = int(pos[-1])
    return np.concatenate(parts).astype(np.int64, copy=False)


def apply_synthetic_step(model: FlatModel, stats: ChangeStats, rng: np.random.Generator) -> None:
    """Change ``model`` in place like one measured step: per kind, the measured fraction of
    elements at uniformly random positions, by differences drawn from the measured distribution."""
    for spec in model.layout:
        p, dist = stats.for_kind(spec.kind)
        pos = bernoulli_positions(spec.numel, p, rng)
        if len(pos) == 0 or dist.total == 0:
            continue
        diffs = rng.choice(dist.values, size=len(pos), p=dist.probs).astype(np.int16)
        t = model.tensor(spec)
        t[pos] += diffs.view(np.uint16)  # wrapping, like the measured int16 difference


def synthetic_stream(layout: Layout, stats: ChangeStats, steps: int, *, seed: int = 0) -> Iterator[FlatModel]:
    """``steps + 1`` versions: a random init, then ``steps`` synthetic steps.

    Each version is a fresh buffer; the generator keeps only the latest, so a consumer that
    keeps the previous one holds two versions of the model.
    """
    rng = np.random.default_rng(seed)
    cur = random_init(layout, rng)
    yield cur
    for _ in range(steps):
        nxt = FlatModel(layout, cur.bits.copy())
        del cur
        apply_synthetic_step(nxt, stats, rng)
        cur = nxt
        yield cur
