"""Loading into a vLLM worker's model: the runtime modules an update reloads, through vLLM's
layerwise reload scoped to those modules, and the restore of the held version after an update
failed part way (:meth:`Loader.restore`).

vLLM is imported inside :meth:`Loader.load` only (this module runs inside vLLM's workers, but
imports without vLLM).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...errors import InjectedFailure
from ...format.manifest import ManifestInfo
from .sparse import Applied, Contract, undo_all, unwrap_reload_loaders
from .weights import Source, UpdatePlan, group_key, names_to_load

# A child of vLLM's logger: the workers' log lines go where vLLM's own go.
log = logging.getLogger("vllm.deltasync")


class Loader:
    """Loads tensors into ``model`` (its vLLM ``model_config`` finalizes the reload); made for
    each call, so it loads into the model the backend targets then. ``contract``: the
    backend's sparse-loader contract, whose placements a whole reload makes stale."""

    def __init__(self, model: torch.nn.Module, model_config: Any, contract: Contract) -> None:
        self.model = model
        self.model_config = model_config
        self.contract = contract

    def load(self, source: Source, info: ManifestInfo, names: list[str], packed: dict[str, list[str]], *,
              staged: dict[str, torch.Tensor] | None = None, fail_after: int = 0, whole: bool = False) -> str:
        """Load ``names`` (whole runtime modules' tensors) through vLLM's layerwise reload,
        set up only on the modules they load into (``whole``: on the whole model, as vLLM's
        own reload does), so a reload costs what those modules hold, not the model."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        groups = {group_key(n, packed) for n in names}
        scope = [self.model] if whole else _modules(self.model, groups)
        staged = staged or {}
        rest = [n for n in names if n not in staged]
        with source.tensors(info, rest, mapped=True) as (where, read):
            stream = _merge(names, staged, read)
            if not rest:
                where = "staged"
            elif staged:
                where = f"staged + {where}"
            if fail_after:
                stream = _fail_after(stream, fail_after)
            for module in scope:
                initialize_layerwise_reload(module)
            # Modules given nothing get their own weights back at finalize; vLLM warns once per
            # such module ("Failed to load weights"), which is what a partial update means here.
            quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                self.model.load_weights(stream)  # type: ignore[operator]  # vLLM's models define it
            finally:
                for module in scope:
                    finalize_layerwise_reload(module, self.model_config)
                quiet.setLevel(level)
                for module in scope:
                    unwrap_reload_loaders(module)
                # A module reload keeps the module's parameters (vLLM copies the processed
                # values back into them), so its placements stay (each is checked at use:
                # Placement.still_valid; probing them all again cost 40-80 ms of the next
                # staging call). After a reload of the whole model every one is probed again.
                if whole or scope == [self.model]:
                    self.contract.forget()
        return where

    def restore(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, plan: UpdatePlan,
                done: list[Applied], packed: dict[str, list[str]], error: BaseException) -> bool:
        """After a failed update towards ``target``: write the held values back where patches
        went (each checked), then load the held version's tensors of every module the reload
        may have touched (the same modules, named as ``held`` names them), and of any module
        whose patch could not be undone. Returns whether ``held`` serves again (if not, the
        caller forgets the version it held: the weights may be mixed)."""
        if held is None:
            log.error("deltasync: loading failed (%s) and the version held before is unknown: the server's "
                      "weights may be mixed until the next update completes (it loads every tensor)", error)
            return False
        groups = {group_key(n, packed) for n in plan.dense}
        for name, why in undo_all(done):
            log.warning("deltasync: undoing the patch of %s failed (%s); reloading its module", name, why)
            groups.add(group_key(name, packed))
        names = [n for n in names_to_load(target, held, packed) if group_key(n, packed) in groups]
        try:
            if names:
                self.load(source, held, names, packed)
        except BaseException as again:
            log.error("deltasync: loading failed (%s) and restoring version %d failed too (%s): the server's "
                      "weights may be mixed until the next update completes (it loads every tensor)",
                      error, held.version, again)
            return False
        log.warning("deltasync: loading failed (%s); version %d restored (%d patched tensor(s) undone, "
                    "%d reloaded)", describe(error), held.version, len(done), len(names))
        return True


def describe(error: BaseException) -> str:
    """``error`` in a few words, also when it has none (a bare ``assert`` in a loader): its
    type and where it was raised."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if text:
        return f"{type(error).__name__}: {text}"[:300]
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    last = frames[-1]
    where = "/".join(Path(last.filename).parts[-2:])
    return (f"{type(error).__name__} at {where}:{last.lineno}" + (f" ({last.line.strip()})" if last.line else ""))[:300]


def _merge(names: list[str], staged: dict[str, torch.Tensor],
           read: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` in order: staged ones from memory, the others from ``read`` (same order)."""
    for n in names:
        if n in staged:
            yield n, staged.pop(n)
        else:
            got, tensor = next(read)
            assert got == n
            yield got, tensor


def _modules(model: torch.nn.Module, groups: set[str]) -> list[torch.nn.Module]:
    """The runtime modules named ``groups`` (checkpoint module paths, fused names as the model
    packs them); the whole model when a name is not a module path (a model that renames its
    checkpoint's tensors): the reload is then set up everywhere, as vLLM's own does."""
    try:
        found = [model.get_submodule(g) for g in sorted(groups)]
    except AttributeError:
        return [model]
    # A module inside another one in the list is set up by its parent's walk already.
    inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inside]


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model's fused modules (vLLM's ``packed_modules_mapping``: fused name → parts)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(x) for x in v] for k, v in dict(packed).items()}


def _fail_after(stream: Iterator[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(stream):
        if i == n:
            raise InjectedFailure(f"injected failure after {n} tensors (fail_after)")
        yield item
