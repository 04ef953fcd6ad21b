"""Reference asynchronous RL loop built on deltasync (``deltasync.rl_integration``).

Weights move only through a deltasync repository: the trainer publishes every update as a
bf16 version, rollout workers serve it through the in-process engine, and the only other
channel is a queue of rollouts. Run it with ``deltasync rl run`` or::

    from deltasync.rl_integration import load_config, run

    if __name__ == "__main__":  # local workers are spawned processes: they import this module
        result = run(load_config(steps=100))

Modules: ``task`` (addition, verifiable reward), ``model`` (the policy: a Llama- or
Mixtral-style decoder in plain torch, saved as Hugging Face checkpoints vLLM serves),
``sampling`` (generation with log-probs, full-sequence or KV-cache bf16; rescoring, router
replay), ``serving`` (a policy kept current by the engine), ``vllm_rollout`` (a vLLM server
kept current by deltasync's vLLM backend), ``worker`` (rollout workers), ``trainer`` (warm
start, GRPO with truncated importance sampling, publishing), ``gate`` (evaluation gate and pins),
``feedback`` (live feedback over HTTP), ``backends`` (local processes or Ray),
``metrics`` / ``plot`` (figures), ``loop`` (the run).

Importing this package is cheap; torch is imported by the modules that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GateConfig, LiveConfig, RLConfig, WarmStartConfig, WorkersConfig, load_config

if TYPE_CHECKING:
    from .loop import RunResult, run

__all__ = [
    "GateConfig",
    "LiveConfig",
    "RLConfig",
    "RunResult",
    "WarmStartConfig",
    "WorkersConfig",
    "load_config",
    "run",
]


def __getattr__(name: str) -> Any:
    if name in ("run", "RunResult"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
