"""A vLLM server that runs the deltasync weight-transfer backend, driven over its RL routes.

``deltasync subscribe --engine vllm@URL --out DIR`` keeps DIR at the version to serve and,
for each version, calls::

    POST /start_weight_update, /update_weights {"update_info": {..., "stage": true}},
         /finish_weight_update     (staging, while serving: workers read and verify)
    POST /start_weight_update
    POST /pause?mode=keep           (or wait / abort: --pause-mode)
    POST /update_weights            {"update_info": {"version": N, "copy": DIR, "repo": URL}}
    POST /finish_weight_update      {"weight_version": "N"}
    POST /resume
    GET  /weight_info               → {"weight_version": "N"}, checked

Each vLLM worker loads only the modules whose tensors change, reading them from DIR (the
server must run on the same host; without ``model_dir`` only the repository URL is sent and
workers pull the tensors themselves). The server is started with ``VLLM_SERVER_DEV_MODE=1``
and ``--weight-transfer-config '{"backend": "deltasync"}'``, deltasync installed next to vLLM.
A failed update leaves the server on the version it served (the workers restore it) and
resumes it.

Engine-first (``deltasync subscribe --engine vllm@URL --state S``, no ``model_dir``): nothing
of the model is written on the agent's side; each worker pulls what changes from the
repository URL and checks every chunk against the manifest whose version digest the agent
names. A server started from a directory deltasync pulled (``deltasync pull --snapshot DIR``)
knows the version it holds, so its first update loads only what differs from it. The server's
own answer is the truth: :meth:`VllmEngine.holds` asks ``/weight_info`` (a restarted server
says ``default`` and is brought forward again), and an engine object that knows no version
(an agent restarted) adopts the version the server serves when ``/weight_info`` and every
worker's held version digest (``deltasync_status``) agree with the target, with no swap.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ...errors import DeltasyncError, UsageError
from ...format.manifest import ManifestInfo
from ...format.signing import PublicKeyLike
from ...repo.repository import Repository
from ...storage import Store
from ..base import EngineError, LiveCheck, Staged, SwapRecord
from ..http_engine import Call, HttpEngine, HttpPreset, HttpStaged
from .weights import DEFAULT_STAGE_MAX_BYTES, group_key, names_to_load

PAUSE_MODES = ("keep", "wait", "abort")

#: What most vLLM decoder models fuse (the worker uses the model's own mapping; this only
#: estimates, agent side, how many bytes an update loads).
COMMON_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class VllmEngine(HttpEngine):
    """Drive a vLLM server with the deltasync backend.

    >>> engine = VllmEngine("http://127.0.0.1:8000", repo="s3://bucket/run-7", model_dir="/srv/policy")
    >>> engine.update()   # pause, load what changed from /srv/policy in every worker, resume

    ``model_dir``: the directory copy the workers read (kept by ``deltasync subscribe
    --out``, on the server's host), brought to the version first; None: engine-first, the
    workers pull from the repository and no copy is needed (``needs_files`` is False). ``repo_url`` (default:
    ``repo`` when it is a URL or path): where workers pull what the copy does not hold, or
    everything when there is no ``model_dir``. ``pause_mode``: what vLLM does with requests in flight
    (``keep``: frozen and resumed after the swap, ``wait``: finished first, ``abort``).
    ``stage_max_bytes``: how much of what changes each worker reads and verifies before the
    pause, while serving (0: everything is read during the pause).
    """

    kind = "vllm"
    needs_files = True

    def __init__(
        self,
        url: str,
        repo: str | Store | Repository,
        *,
        model_dir: str | os.PathLike[str] | None = None,
        repo_url: str | None = None,
        pause_mode: str = "keep",
        stage_max_bytes: int = DEFAULT_STAGE_MAX_BYTES,
        headers: Mapping[str, str] | None = None,
        timeout: float = 600.0,
        version: int | None = None,
        workers: int = 0,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        progress: bool | None = False,
    ) -> None:
        if stage_max_bytes < 0:
            raise UsageError(f"stage_max_bytes must be >= 0, got {stage_max_bytes}")
        if pause_mode not in PAUSE_MODES:
            raise UsageError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        if repo_url is None and isinstance(repo, str) and not repo.startswith("memory://"):
            repo_url = repo
        if repo_url is not None:
            if repo_url.startswith("memory://"):
                raise UsageError("the vLLM workers cannot read a memory:// repository (it lives in this process)")
            # where workers pull what the copy does not hold (a path: absolute, workers run elsewhere)
            repo_url = repo_url if "://" in repo_url else str(Path(repo_url).absolute())
        if model_dir is None and repo_url is None:
            raise UsageError("the vllm engine needs model_dir= (a copy the server can read) or a repository URL")
        preset = HttpPreset(
            name="vllm", pause=Call(path="/pause", query={"mode": pause_mode}),
            update=Call(path="/update_weights"), resume=Call(path="/resume"),
            version=Call(method="GET", path="/weight_info"), version_field="weight_version", success_field=None,
        )
        super().__init__(url, repo, model_dir=model_dir or ".", preset=preset, headers=headers, timeout=timeout,
                         version=version, workers=workers, trusted_keys=trusted_keys, progress=progress)
        self.copy = None if model_dir is None else Path(model_dir).absolute()
        self.needs_files = self.copy is not None
        self.repo_url = repo_url
        self.pause_mode = pause_mode
        self.stage_max_bytes = stage_max_bytes
        self._held_info: ManifestInfo | None = None
        self._repair = False  # in a forced update: the workers also repair what drifted

    # -- what the server holds -------------------------------------------------------------------

    def server_state(self) -> dict[str, Any]:
        """What the server says it holds: ``weight_version`` (``/weight_info``; ``None`` where it
        is no version number, e.g. ``default`` after a start) and ``workers``, each worker's
        ``held`` version and ``held_digest`` (hex; None where the worker knows none or runs a
        plugin too old to say)."""
        served = self._served_version()
        try:
            answer = self._post("/collective_rpc", {"method": "deltasync_status"}, "worker status")
        except EngineError:
            answer = None  # no dev routes, or an older plugin: the workers cannot say
        states = answer.get("results") if isinstance(answer, dict) else None
        workers = [{"held": s.get("held"), "held_digest": s.get("held_digest")}
                   for s in (states if isinstance(states, list) else []) if isinstance(s, dict)]
        return {"weight_version": served, "workers": workers}

    def holds(self, version: int) -> bool:
        """Whether the engine holds ``version`` and the server says it serves it (a server
        restarted meanwhile serves what it was started from, and says ``default``; one out
        of reach holds nothing known)."""
        if not super().holds(version):
            return False
        try:
            return self._served_version() == version
        except EngineError:
            return False

    def verify(self, version: int | None = None) -> LiveCheck:
        """The live check (``deltasync check --state``, ``--verify-every``): every worker hashes
        the parameters it holds now (``/collective_rpc`` ``deltasync_verify``, see
        :mod:`deltasync.engines.vllm.live`): tensors held whole in one parameter against the
        manifest's chunk digests, the rest (fused, sharded, converted parameters and the
        repacked kernel copies) against digests recorded right after the last checked load.
        Drifted items are named ``(tensor, chunk)``, or ``(runtime name, -1)`` for a recorded
        one (``...qkv_proj#repacked``: a module's kernel copy). Holds the engine's mutex (no
        update interleaves); the server serves meanwhile (vLLM runs the call between steps)."""
        self._check_open()
        with self._mutex:
            target = self._version if version is None else version
            if target is None:
                raise UsageError("the engine holds no known version to check")
            key = self.subscriber.repo.manifest(target).pb.version_digest.hex()
            answer = self._post("/collective_rpc", {"method": "deltasync_verify"}, "live check")
            results = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(results, list) or not results:
                raise EngineError("the vLLM server returned no live check (is deltasync its weight-transfer backend?)")
            drifted: list[tuple[str, int]] = []
            checked = 0
            for rank, r in enumerate(results):
                if not isinstance(r, dict):
                    raise EngineError(f"worker {rank} runs no deltasync backend: its live weights cannot be checked")
                if r.get("error"):
                    raise EngineError(f"worker {rank}: {r['error']}")
                if r.get("version") != target or r.get("held_digest") != key:
                    # the worker holds another version: every chunk of the target is in question
                    raise EngineError(f"worker {rank} holds version {r.get('version')} "
                                      f"(digest {r.get('held_digest')}), not version {target}")
                checked += int(r.get("chunks_checked", 0)) + int(r.get("recorded_checked", 0))
                for item in r.get("drifted", []):
                    name, idx = str(item[0]), int(item[1])
                    if (name, idx) not in drifted:
                        drifted.append((name, idx))
            return LiveCheck(version=target, chunks_checked=checked, drifted=drifted)

    def update(self, version: int | None = None, *, force: bool = False) -> SwapRecord | None:
        """As :meth:`Engine.update`; an engine that knows no version first asks the server
        (:meth:`server_state`): one already serving the target, every worker holding its
        version digest, is adopted as it is (None, no swap; resumed if an agent killed before
        its resume left it paused). Otherwise the workers go from what they hold to the target
        (every tensor when they hold nothing known)."""
        self._check_open()
        if self._version is None and (version is None or (isinstance(version, int) and version >= 1)):
            with self._mutex:
                target = self._resolve(version)
                # adopted as it serves, with no swap (its live bits: the live check's job)
                if self._adopt(target):
                    return None
        self._repair = force
        try:
            return super().update(version, force=force)
        finally:
            self._repair = False

    def _adopt(self, target: int) -> bool:
        try:
            state = self.server_state()
        except EngineError:
            return False  # out of reach: the update says so
        info = self.subscriber.repo.manifest(target)
        digest = info.pb.version_digest.hex()
        workers = state["workers"]
        if state["weight_version"] != target or not workers or any(
                w["held"] != target or w["held_digest"] != digest for w in workers):
            return False
        # An agent killed between the finish and the resume left it paused: nobody else resumes it.
        try:
            paused = self._call(Call(method="GET", path="/is_paused"), "pause status")
        except EngineError:
            paused = None  # a vLLM without the route: nothing to learn
        if isinstance(paused, dict) and paused.get("is_paused") is True:
            self._post("/resume", {}, "resume a server left paused")
        self._version = target
        self._version_key = self.version_key(target)
        self._generation += 1
        self._held_info = info
        return True

    def _held_by_workers(self) -> ManifestInfo | None:
        """The manifest of the version every worker says it holds, when they agree and the
        repository has it under the same version digest (None otherwise)."""
        try:
            workers = self.server_state()["workers"]
        except EngineError:
            return None
        held = {(w["held"], w["held_digest"]) for w in workers}
        if len(held) != 1:
            return None
        ((version, digest),) = held
        if isinstance(version, bool) or not isinstance(version, int) or version < 1 or not digest:
            return None
        try:
            info = self.subscriber.repo.manifest(version)
        except DeltasyncError:
            return None
        return info if info.pb.version_digest.hex() == digest else None

    def _stage(self, version: int) -> Staged:
        info = self.subscriber.repo.manifest(version)
        if self.copy is not None:
            staged = super()._stage(version)  # the copy at the version (a no-op under `subscribe`)
        else:
            chunks = sum(len(t.chunks) for t in info.pb.tensors)
            staged = HttpStaged(version, model_path="", chunks_total=chunks, extra={"preset": "vllm"})
        held = self._held_info if self._held_info is not None and self.holds(self._held_info.version) else None
        if held is None:
            held = self._held_by_workers()  # e.g. a server started from `pull --snapshot`
        names = set(names_to_load(held, info, COMMON_PACKED))
        staged.bytes_to_write = sum(t.nbytes for t in info.pb.tensors if t.name in names)
        staged.chunks_changed = _chunks_changed(held, info)
        staged.extra = {**staged.extra, "tensors_loaded_estimate": len(names)}
        if self.stage_max_bytes:
            # The workers read and verify what they will load now, while the server serves;
            # the update after the pause finds it in memory.
            self._start("start staging")
            # A failed update_weights is closed by vLLM itself (its worker ends the update on any
            # error): a finish after it would only fail, in the worker, as an unmatched finish.
            self._post("/update_weights", {"update_info": {**self._update_info(version), "stage": True,
                                                           "stage_max_bytes": self.stage_max_bytes}}, "stage")
            self._post("/finish_weight_update", {}, "finish staging")
            self._wait_staged(version)
        return staged

    def _wait_staged(self, version: int) -> None:
        """Until every worker has read what it stages (the server serves meanwhile); the
        update would otherwise wait for it inside the pause."""
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while time.monotonic() < deadline:
            try:
                answer = self._post("/collective_rpc", {"method": "deltasync_status"}, "staging status")
            except EngineError:
                return  # an older plugin or no dev routes: the update waits for staging itself
            states = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(states, list) or not states:
                return
            pending = [s for s in states if isinstance(s, dict) and isinstance(s.get("staging"), dict)
                       and s["staging"].get("version") == version and not s["staging"].get("done")]
            if not pending:
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.02)  # a status call costs a few ms; oversleeping lengthens the update

    def _update_info(self, version: int) -> dict[str, Any]:
        update: dict[str, Any] = {"version": version}
        key = self.version_key(version)
        if key:  # the version of this repository, not another's under the same number
            update["version_digest"] = key[:16].hex()
        if self.copy is not None:
            update["copy"] = str(self.copy)
        if self.repo_url is not None:
            update["repo"] = self.repo_url
        return update

    def _start(self, what: str) -> None:
        """``POST /start_weight_update``; an update left open (one whose end never reached the
        server: a connection lost mid-call) is closed first, so the next update always starts."""
        try:
            self._post("/start_weight_update", {}, what)
        except EngineError as e:
            if "already active" not in str(e):
                raise
            self._post("/finish_weight_update", {}, "close an update left open")
            self._post("/start_weight_update", {}, what)

    def _pause(self) -> None:
        # Opening the update is bookkeeping (no weights move): done while the server still
        # serves, before the pause.
        self._start("start weight update")
        try:
            super()._pause()
        except BaseException:
            # vLLM may have paused its scheduler before the error (a drain that timed out):
            # resume it, and close the update, best effort.
            with contextlib.suppress(EngineError):
                self._post("/resume", {}, "resume after a failed pause")
            with contextlib.suppress(EngineError):
                self._post("/finish_weight_update", {}, "close the update")
            raise

    def _write(self, staged: Staged) -> int:
        update = self._update_info(staged.version)
        if self._repair:
            # A forced update (the agent's restage, a live check's repair): each worker checks
            # its live bits first and writes back, in place, the chunks that drifted; only a
            # module vLLM keeps as a repacked kernel copy that cannot be patched reloads whole.
            update["repair"] = True
        # On failure the workers restore the version they held, and vLLM closes the update
        # (its worker ends it on any error; a finish now would fail there as unmatched, and one
        # left open is closed by the next start). The engine serves the held version.
        self._post("/update_weights", {"update_info": update}, "update weights")
        self._post("/finish_weight_update", {"weight_version": str(staged.version)}, "finish weight update")
        if self._repair:
            self._count_repair(staged)
        return staged.bytes_to_write

    def _count_repair(self, staged: Staged) -> None:
        """What a repair rewrote, as the workers measured it (the swap record's
        ``chunks_changed`` and ``bytes_to_write``): the chunks they wrote back in place (each
        checkpoint chunk once, whatever number of workers hold a part of it) and every chunk
        of the tensors of the modules they reloaded whole; ``extra`` names the modules
        (``repaired_modules``, of which ``reloaded_modules``) and the chunks (``rewritten``:
        tensor → chunk indices)."""
        try:
            states = self._post("/collective_rpc", {"method": "deltasync_status"}, "worker status").get("results")
        except (EngineError, AttributeError):
            return
        info = self.subscriber.repo.manifest(staged.version)
        modules: set[str] = set()
        reloaded: set[str] = set()
        chunks: dict[str, set[int]] = {}
        written = 0
        for s in states if isinstance(states, list) else []:
            last = s.get("last") if isinstance(s, dict) else None
            if not isinstance(last, dict) or last.get("version") != staged.version:
                continue
            modules.update(str(m) for m in last.get("repaired") or [])
            reloaded.update(str(m) for m in last.get("repair_reloaded") or [])
            for name, what in (last.get("rewritten") or {}).items():
                chunks.setdefault(str(name), set()).update(int(i) for i in what.get("chunks") or [])
                written += int(what.get("bytes") or 0)
        if not modules:
            return
        packed = COMMON_PACKED  # the agent's estimate of the model's fusing (see names_to_load)
        whole = [t for t in info.pb.tensors if group_key(t.name, packed) in reloaded]
        staged.chunks_changed = sum(len(c) for c in chunks.values()) + sum(len(t.chunks) for t in whole)
        staged.bytes_to_write = written + sum(t.nbytes for t in whole)
        staged.extra = {**staged.extra, "repaired_modules": sorted(modules), "reloaded_modules": sorted(reloaded),
                        "rewritten": {n: sorted(c) for n, c in sorted(chunks.items())}}

    def _after_swap(self, staged: Staged) -> None:
        super()._after_swap(staged)
        self._held_info = self.subscriber.repo.manifest(staged.version)

    def _post(self, path: str, body: Any, what: str) -> Any:
        return self._call(Call(path=path, body=_literal(body)), what)


def _chunks_changed(held: ManifestInfo | None, target: ManifestInfo) -> int:
    """Chunks of ``target`` whose digest the held version does not have at the same place."""
    before = {} if held is None else {
        (t.name, tuple(t.slice_offsets), i): c.target_digest for t in held.pb.tensors for i, c in enumerate(t.chunks)}
    return sum(before.get((t.name, tuple(t.slice_offsets), i)) != c.target_digest
               for t in target.pb.tensors for i, c in enumerate(t.chunks))


def _literal(obj: Any) -> Any:
    """``obj`` with braces in strings escaped (HttpEngine fills templates)."""
    if isinstance(obj, str):
        return obj.replace("{", "{{").replace("}", "}}")
    if isinstance(obj, dict):
        return {k: _literal(v) for k, v in obj.items()}
    return obj
