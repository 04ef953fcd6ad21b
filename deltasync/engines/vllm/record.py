"""A vLLM worker's live record and live check (:class:`Recorder`): which checkpoint tensors the
manifest's chunk digests check directly, the record of everything else
(:class:`~deltasync.engines.vllm.live.LiveRecord`) made in a thread after each checked load,
and the check of what the worker holds now against both. The hashing itself is
:mod:`deltasync.engines.vllm.live`'s. No vLLM import here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ...format import dtypes
from ...format.manifest import ManifestInfo
from .live import Found, LiveRecord, check_chunks
from .sparse import Contract, Placement
from .weights import tensor_chunks, tensor_signatures

# A child of vLLM's logger: the workers' log lines go where vLLM's own go.
log = logging.getLogger("vllm.deltasync")


class Recorder:
    """One worker's live record (:attr:`record`) and the thread that makes it after a load.
    ``contract``: the backend's (its probed placements say what the manifest checks)."""

    def __init__(self, contract: Contract) -> None:
        self.contract = contract
        # Digests of what the manifest cannot check (repacked forms...), recorded after each
        # checked load (deltasync.engines.vllm.live); None until the first one.
        self.record: LiveRecord | None = None
        # The record after a load is made in a thread, while the server serves again.
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def direct(self, info: ManifestInfo, found: Found | None) -> set[int]:
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

    def after_load(self, model: torch.nn.Module, info: ManifestInfo, last: Callable[[], dict[str, Any]]) -> bool:
        """Record the digests of what the manifest cannot check, right after a load of
        ``info`` whose every tensor was checked against its digests (best effort: a failure
        only leaves the check without a record, which it says). Returns whether a record is
        being made. ``last()``: the backend's report of its last update, which gets the
        record's time (``record_s``) if it is still that of ``info``'s load.

        Only once live checks are in use (a first check recorded a baseline): recording hashes
        every parameter and runs each repacked linear layer once, about a prefill's worth of
        work, which a server nobody checks should not pay on every update. It runs in a
        thread, started here, so not in the pause: the update returns and the server resumes
        while the worker records (serving only reads the weights). A live check waits for it;
        the next update stops it (that update records again)."""
        if self.record is None:
            return False
        direct = self.direct(info, None)
        self._stop = stop = threading.Event()

        def work() -> None:
            t0 = time.perf_counter()
            try:
                made = LiveRecord.record(model, info, direct, stop)
            except Exception as e:  # never fail an update that loaded for want of a record
                made = None
                log.warning("deltasync: recording the live digests of version %d failed (%s)", info.version, e)
            took = time.perf_counter() - t0
            if made is None:
                # a record of another version: the next check records a baseline, the next load records
                return
            self.record = made
            report = last()
            if report.get("version") == info.version:
                report["record_s"] = round(took, 4)
            log.info("deltasync: recorded the live digests of version %d in %.3f s (after the update, while "
                     "serving: %d items, %d unreadable)", info.version, took, len(made.digests), len(made.unreadable))

        self._thread = threading.Thread(target=work, name="deltasync-live-record", daemon=True)
        self._thread.start()
        return True

    def stop(self, *, cancel: bool) -> None:
        """Wait for the record being made (``cancel``: stop it first)."""
        thread = self._thread
        if thread is None:
            return
        if cancel:
            self._stop.set()
        thread.join()
        self._thread = None

    def check(self, model: torch.nn.Module, held: ManifestInfo) -> dict[str, Any]:
        """Hash what ``model`` holds now against ``held`` (the backend's live check:
        :meth:`~deltasync.engines.vllm.backend.DeltasyncWeightTransferEngine.live_check`)."""
        self.stop(cancel=False)  # a record after the last load: finished first
        found = Found()
        direct = self.direct(held, found)
        record = self.record
        baseline = record is None or record.key != bytes(held.pb.version_digest)
        if baseline:
            self.record = LiveRecord.record(model, held, direct)
        else:
            assert record is not None
            record.check(model, direct, found)
        return {"version": held.version, "held_digest": held.pb.version_digest.hex(), "baseline": baseline,
                **found.as_dict()}
