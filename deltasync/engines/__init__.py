"""Engines: where verified versions are swapped in (DESIGN.md "engine").

* :class:`TorchEngine` — a ``torch.nn.Module`` served in this process; only changed
  elements are written, in place.
* :class:`FanoutEngine` — ranks of a torch.distributed group: one rank fetches and decodes,
  broadcasts the changes, every rank writes the part it holds, all switch together.
* :class:`PackcastNode` — the nodes of a cluster, each with its own engine: node 0 fetches a
  version's stored bytes once and broadcasts them; every node decodes what its engine holds
  (reading through a :class:`PackCache`), so adding nodes does not add time (the agent of
  each node, ``subscribe --packcast``, is :class:`deltasync.agents.PackcastAgent`).
* :class:`VllmEngine` — a vLLM server running the deltasync weight-transfer backend: its
  workers load only the modules that change, read from the agent's copy.
* :class:`HttpEngine` — an inference server (SGLang, vLLM, or any with the same shape of
  endpoints) that reloads weights from a directory.

All share :class:`Engine` (stage, then pause / write / resume; ``swaps`` records every
pause). :func:`build_engine` makes one from a short spec string, for the command line, through
the registry (``engines/registry.py``: one :class:`EngineKind` per kind, :func:`register_engine`).
Backends import torch lazily, so importing this package is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy
from .base import (
    Engine as Engine,
    EngineError as EngineError,
    ServingLock as ServingLock,
    Staged as Staged,
    StaleUpdateError as StaleUpdateError,
    SwapRecord as SwapRecord,
)
from .registry import (
    EngineKind as EngineKind,
    build_engine as build_engine,
    register_engine as register_engine,
    specs,
)

#: public name -> module (imported on first use: torch stays out until an engine is built)
_LAZY: _lazy.Table = {
    "TorchEngine": "torch_engine",
    "FanoutEngine": "fanout",
    "FanoutOptions": "fanout",
    "PackCache": "packcast",
    "PackcastNode": "packcast",
    "HttpEngine": "http_engine",
    "HttpPreset": "http_engine",
    "PRESETS": "http_engine",
    "ReferenceServer": "http_engine",
    "VllmEngine": "vllm.engine",
}
__all__ = sorted(["Engine", "EngineError", "EngineKind", "ServingLock", "Staged", "StaleUpdateError", "SwapRecord",
                  "build_engine", "register_engine", *_LAZY])
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals(), lambda name: f"the {name} engine")

if TYPE_CHECKING:
    from .fanout import FanoutEngine as FanoutEngine, FanoutOptions as FanoutOptions
    from .http_engine import (
        PRESETS as PRESETS,
        HttpEngine as HttpEngine,
        HttpPreset as HttpPreset,
        ReferenceServer as ReferenceServer,
    )
    from .packcast import PackCache as PackCache, PackcastNode as PackcastNode
    from .torch_engine import TorchEngine as TorchEngine
    from .vllm.engine import VllmEngine as VllmEngine


#: every spec form ``build_engine`` takes (``registry.specs()`` also counts kinds registered later)
SPECS = specs()
