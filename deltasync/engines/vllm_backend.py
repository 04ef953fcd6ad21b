"""The ``deltasync`` weight-transfer backend, run by vLLM in each of its workers.

vLLM selects it with ``--weight-transfer-config '{"backend": "deltasync"}'`` once the plugin
(:mod:`deltasync.engines.vllm_plugin`, an entry point in ``vllm.general_plugins``) has
registered it. The agent drives it over vLLM's RL routes (``deltasync subscribe --engine
vllm@URL``): ``/pause``, ``/start_weight_update``, ``/update_weights`` with ``update_info``
``{"version": N, "copy": DIR}`` (or ``"repo": URL``; see
:class:`~deltasync.engines.vllm_weights.UpdateRequest`), ``/finish_weight_update`` with
``weight_version`` ``"N"``, ``/resume``.

An update loads, through vLLM's layerwise reload and the model's own weight loader, only the
checkpoint tensors of modules that change between the version the worker holds and the
target (:func:`~deltasync.engines.vllm_weights.names_to_load`), read from the agent's copy
with every chunk checked against the manifest's digest. Modules given nothing keep their
weights. If loading fails part way, the worker loads the same tensors of the version it
held (from the copy's other slot, or the repository) before it reports the failure, so the
server goes on serving the old version, whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import DeltasyncError, UsageError
from ..manifest import ManifestInfo
from .vllm_weights import Source, UpdateRequest, copy_manifests, names_to_load

# A child of vLLM's logger: the workers' log lines go where vLLM's own go.
log = logging.getLogger("vllm.deltasync")


@dataclass
class DeltasyncInitInfo(WeightTransferInitInfo):
    """``/init_weight_transfer_engine`` (optional): defaults for later updates."""

    copy: str | None = None
    repo: str | None = None


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):
    request: UpdateRequest


class InjectedFailure(DeltasyncError):
    """Raised by ``fail_after`` (tests): a load that fails part way."""


class DeltasyncWeightTransferEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):
    """Applies deltasync versions to this worker's model: only the modules that change."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.defaults = DeltasyncInitInfo()
        self.held: ManifestInfo | None = None
        # A server started from a deltasync copy holds the version that copy served.
        started_from = str(getattr(vllm_config.model_config, "model", "") or "")
        found = copy_manifests(started_from) if started_from else []
        if found:
            self.held = found[0]
            log.info("deltasync: serving version %d (from the copy at %s)", self.held.version, started_from)
        self.last: dict[str, Any] = {}
        self._staging: _Staging | None = None

    # -- vLLM's interface -------------------------------------------------------------------------

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltasyncUpdateInfo:
        raw = dict(update_dict)
        for key, default in (("copy", self.defaults.copy), ("repo", self.defaults.repo)):
            if default and key not in raw:
                raw[key] = default
        try:
            return DeltasyncUpdateInfo(UpdateRequest.parse(raw))
        except UsageError as e:
            raise ValueError(str(e)) from None

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        self.defaults = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: each update_weights call is one whole version."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: the version is recorded by vLLM from ``weight_version``."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        req = update_info.request
        started = time.perf_counter()
        source = Source(req.copy, req.repo, req.trusted_keys)
        target = source.manifest(req.version)
        held = self.held
        if held is None and req.from_version is not None:
            held = source.manifest(req.from_version)
        names = names_to_load(held, target, _packed(self.model))
        if req.stage:
            self._start_staging(source, held, target, names, req.stage_max_bytes)
            return
        staged = self._take_staged(held, target)
        n_staged = len(staged)
        where = "nothing"
        if names:
            try:
                where = self._load(source, target, names, staged=staged, fail_after=req.fail_after)
            except BaseException as e:
                self._restore(source, held, target, e)
                raise
        self.held = target
        self.last = {
            "version": target.version, "from": None if held is None else held.version, "tensors_loaded": len(names),
            "tensors_total": len({t.name for t in target.pb.tensors}), "source": where,
            "staged": n_staged, "seconds": round(time.perf_counter() - started, 4),
        }
        log.info("deltasync: version %d loaded (%s)", target.version, self.last)

    # -- staging (before the pause) -----------------------------------------------------------

    def _start_staging(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, names: list[str],
                       limit: int) -> None:
        """Read and verify (up to ``limit`` bytes of) the tensors the update will load, in a
        thread: the call returns at once and the server keeps serving meanwhile."""
        self._take_staged(None, None)  # drop an earlier staging
        sizes: dict[str, int] = {}
        for t in target.pb.tensors:
            sizes[t.name] = sizes.get(t.name, 0) + t.nbytes
        chosen: list[str] = []
        for n in names:
            if sizes[n] > limit:
                break
            limit -= sizes[n]
            chosen.append(n)
        staging = _Staging((None if held is None else held.version, target.version), {})

        def work() -> None:
            t0 = time.perf_counter()
            try:
                with source.tensors(target, chosen) as (_where, stream):
                    for n, tensor in stream:
                        staging.tensors[n] = tensor
            except BaseException as e:  # the update reads them itself
                staging.error = e
            staging.seconds = time.perf_counter() - t0

        staging.thread = threading.Thread(target=work, name="deltasync-stage", daemon=True)
        staging.thread.start()
        self._staging = staging
        log.info("deltasync: staging %d of %d tensors of version %d", len(chosen), len(names), target.version)

    def _take_staged(self, held: ManifestInfo | None, target: ManifestInfo | None) -> dict[str, torch.Tensor]:
        """The tensors staged for going from ``held`` to ``target`` (waiting for the staging
        to end); empty when none were. Any staging is dropped."""
        staging, self._staging = self._staging, None
        if staging is None:
            return {}
        staging.thread.join()
        key = (None if held is None else held.version, None if target is None else target.version)
        if staging.key != key:
            return {}
        if staging.error is not None:
            log.warning("deltasync: staging version %s failed (%s); reading during the update", key[1], staging.error)
            return {}
        return staging.tensors

    def shutdown(self) -> None:
        """Nothing held open between updates."""

    def stage_status(self) -> dict[str, Any]:
        """What this worker holds and stages (the agent polls it through ``/collective_rpc``
        ``{"method": "deltasync_status"}`` before it pauses)."""
        st = self._staging
        staging = None if st is None else {
            "version": st.key[1], "done": not st.thread.is_alive(), "tensors": len(st.tensors),
            "error": None if st.error is None else str(st.error),
        }
        return {"held": None if self.held is None else self.held.version, "staging": staging}

    # -- loading ----------------------------------------------------------------------------------

    def _load(self, source: Source, info: ManifestInfo, names: list[str], *,
              staged: dict[str, torch.Tensor] | None = None, fail_after: int = 0) -> str:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged = staged or {}
        rest = [n for n in names if n not in staged]
        with source.tensors(info, rest) as (where, read):
            stream = _merge(names, staged, read)
            if not rest:
                where = "staged"
            elif staged:
                where = f"staged + {where}"
            if fail_after:
                stream = _fail_after(stream, fail_after)
            initialize_layerwise_reload(self.model)
            # Modules given nothing get their own weights back at finalize; vLLM warns once per
            # such module ("Failed to load weights"), which is what a partial update means here.
            quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                self.model.load_weights(stream)
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
                quiet.setLevel(level)
        return where

    def _restore(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, error: BaseException) -> None:
        """After a failed load towards ``target``: load the held version's tensors of every
        module the load may have touched (the same modules, named as ``held`` names them)."""
        if held is None:
            self.held = None
            log.error("deltasync: loading failed (%s) and the version held before is unknown: the server's "
                      "weights may be mixed until the next update completes (it loads every tensor)", error)
            return
        try:
            self._load(source, held, names_to_load(target, held, _packed(self.model)))
        except BaseException as again:
            self.held = None
            log.error("deltasync: loading failed (%s) and restoring version %d failed too (%s): the server's "
                      "weights may be mixed until the next update completes (it loads every tensor)",
                      error, held.version, again)
            return
        log.warning("deltasync: loading failed (%s); version %d restored", error, held.version)


@dataclass
class _Staging:
    key: tuple[int | None, int]
    """(held version, target version) it was staged for."""
    tensors: dict[str, torch.Tensor]
    thread: threading.Thread = field(default_factory=threading.Thread)
    error: BaseException | None = None
    seconds: float = 0.0


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


def _packed(model: torch.nn.Module) -> dict[str, list[str]]:
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(x) for x in v] for k, v in dict(packed).items()}


def _fail_after(stream: Iterator[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(stream):
        if i == n:
            raise InjectedFailure(f"injected failure after {n} tensors (fail_after)")
        yield item
