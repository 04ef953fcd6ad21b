"""Engines: where verified versions are swapped in (DESIGN.md "engine").

* :class:`TorchEngine` — a ``torch.nn.Module`` served in this process; only changed
  elements are written, in place.
* :class:`FanoutEngine` — ranks of a torch.distributed group: one rank fetches and decodes,
  broadcasts the changes, every rank writes the part it holds, all switch together.
* :class:`PackcastNode` — the nodes of a cluster, each with its own engine: node 0 fetches a
  version's stored bytes once and broadcasts them; every node decodes what its engine holds
  (reading through a :class:`PackCache`), so adding nodes does not add time;
  :class:`PackcastAgent` is the engine-first agent of each node (``subscribe --packcast``).
* :class:`VllmEngine` — a vLLM server running the deltasync weight-transfer backend: its
  workers load only the modules that change, read from the agent's copy.
* :class:`HttpEngine` — an inference server (SGLang, vLLM, or any with the same shape of
  endpoints) that reloads weights from a directory.

All share :class:`Engine` (stage, then pause / write / resume; ``swaps`` records every
pause). :func:`build_engine` makes one from a short spec string, for the command line.
Backends import torch lazily, so importing this package is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .. import _lazy
from ..errors import UsageError
from .base import (
    Engine as Engine,
    EngineError as EngineError,
    ServingLock as ServingLock,
    Staged as Staged,
    StaleUpdateError as StaleUpdateError,
    SwapRecord as SwapRecord,
)

#: public name -> module (imported on first use: torch stays out until an engine is built)
_LAZY: _lazy.Table = {
    "TorchEngine": "torch_engine",
    "FanoutEngine": "fanout",
    "PackCache": "packcast",
    "PackcastNode": "packcast",
    "PackcastAgent": "packcast_agent",
    "HttpEngine": "http_engine",
    "HttpPreset": "http_engine",
    "PRESETS": "http_engine",
    "ReferenceServer": "http_engine",
    "VllmEngine": "vllm.engine",
}
__all__ = sorted(["Engine", "EngineError", "ServingLock", "Staged", "StaleUpdateError", "SwapRecord", "build_engine", *_LAZY])
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals(), lambda name: f"the {name} engine")

if TYPE_CHECKING:
    from .fanout import FanoutEngine as FanoutEngine
    from .http_engine import (
        PRESETS as PRESETS,
        HttpEngine as HttpEngine,
        HttpPreset as HttpPreset,
        ReferenceServer as ReferenceServer,
    )
    from .packcast import PackCache as PackCache, PackcastNode as PackcastNode
    from .packcast_agent import PackcastAgent as PackcastAgent
    from .torch_engine import TorchEngine as TorchEngine
    from .vllm.engine import VllmEngine as VllmEngine


SPECS = (
    "torch:MODULE:FACTORY",
    "fanout[:MODULE:FACTORY]",
    "vllm@URL",
    "http:sglang@URL",
    "http:vllm@URL",
    "http:generic@URL",
)


def build_engine(spec: str, **options: Any) -> Engine:
    """An engine from a spec string (what ``deltasync subscribe --engine`` takes).

    * ``torch`` with ``model=<nn.Module or dict of tensors>``, or ``torch:pkg.mod:factory``
      where ``factory()`` returns the module (built on the device it should serve from);
    * ``fanout`` (this process is rank 0 of an initialised torch.distributed group, or
      one is initialised from the ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` environment),
      optionally ``fanout:pkg.mod:factory`` for a module this rank serves too;
    * ``vllm@URL``: a vLLM server with the deltasync backend; ``model_dir=`` the copy its
      workers read (``pause_mode=`` keep, wait or abort);
    * ``http:PRESET@URL`` with ``model_dir=`` (where versions are written for the server
      to load); PRESET is ``sglang``, ``vllm`` or ``generic``.

    ``repo`` (URL, Store or Repository) is required for all; other options go to the
    engine's constructor (e.g. ``version``, ``workers``, ``timeout``, ``trusted_keys``).
    """
    if "repo" not in options:
        raise UsageError("build_engine needs repo=")
    if spec.startswith("vllm@"):
        from .vllm.engine import VllmEngine

        url = spec.removeprefix("vllm@")
        if not url:
            raise UsageError(f"vllm engine spec must be vllm@URL, got {spec!r}")
        return _construct(VllmEngine, url, **options)
    options.pop("pause_mode", None)
    kind, _, rest = spec.partition(":")
    if kind == "torch":
        from .torch_engine import TorchEngine

        model = options.pop("model", None)
        if rest:
            if model is not None:
                raise UsageError("give either a torch:MODULE:FACTORY spec or model=, not both")
            model = _call_factory(rest)
        if model is None:
            raise UsageError("the torch engine needs a model: --engine torch:MODULE:FACTORY, or model= from Python")
        repo = options.pop("repo")
        return _construct(TorchEngine, model, repo, **options)
    if kind == "fanout":
        from .fanout import FanoutEngine, init_from_env

        model = options.pop("model", None)
        if rest:
            model = _call_factory(rest)
        init_from_env()
        return _construct(FanoutEngine, model, **options)
    if kind == "http":
        from .http_engine import HttpEngine

        preset, at, url = rest.partition("@")
        if not at or not preset or not url:
            raise UsageError(f"http engine spec must be http:PRESET@URL, got {spec!r}")
        if not options.get("model_dir"):
            raise UsageError("the http engine needs model_dir=: a directory the server can read, where versions are written")
        return _construct(HttpEngine, url, preset=preset, **options)
    raise UsageError(f"unknown engine {spec!r}; expected one of: {', '.join(SPECS)}")


def _construct(cls: Any, *args: Any, **options: Any) -> Engine:
    try:
        engine: Engine = cls(*args, **options)
    except TypeError as e:  # an option the engine does not take
        raise UsageError(f"{cls.kind} engine: {e}") from None
    return engine


def _call_factory(ref: str) -> Any:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{module_name}:{attr} is not a callable factory")
    return factory()
