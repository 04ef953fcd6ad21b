"""Reference asynchronous RL loop built on deltasync (``deltasync.rl_integration``).

Weights move only through a deltasync repository: the trainer publishes every update as a
bf16 version, rollout workers serve it through the in-process engine, and the only other
channel is a queue of rollouts. Run it with ``deltasync rl run`` or::

    from . import load_config, run

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

# This folder is deltasync.rl_integration, reached through the link deltasync/rl_integration; imported from the
# checkout root as plain `rl_integration` it would be a second copy of every module and class in it.
if __name__ != "deltasync.rl_integration":
    raise ImportError(f"import deltasync.rl_integration, not {__name__}: the folder rl_integration/ is the package "
                      "deltasync.rl_integration (one module, one identity)")

from typing import TYPE_CHECKING

from .. import _lazy
from .config import (
    GateConfig as GateConfig,
    LiveConfig as LiveConfig,
    RLConfig as RLConfig,
    WarmStartConfig as WarmStartConfig,
    WorkersConfig as WorkersConfig,
    load_config as load_config,
)

#: public name -> module (the loop pulls in torch: imported on first use)
_LAZY: _lazy.Table = {"RunResult": "loop", "run": "loop"}
__all__ = sorted(["GateConfig", "LiveConfig", "RLConfig", "WarmStartConfig", "WorkersConfig", "load_config", *_LAZY])
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals(), lambda name: "deltasync rl run")

if TYPE_CHECKING:
    from .loop import RunResult as RunResult, run as run
