"""Where rollout workers run: local processes, or Ray actors.

Both start the same :class:`~deltasync.rl_integration.worker.RolloutWorker` and hand the
trainer two queues (rollouts, reports) and a stop flag; weights never travel through
them, only through the repository. There is no cluster manager here: Ray places, starts
and restarts actors; locally, ``multiprocessing`` with the ``spawn`` start method (no
fork of a process holding torch threads).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any, Protocol

from ..errors import UsageError
from .worker import WorkerSpec, worker_main


class Backend(Protocol):
    rollouts: Any
    reports: Any

    def start(self, specs: list[WorkerSpec]) -> None: ...

    def alive(self) -> int: ...

    def stop(self, timeout: float = 10.0) -> list[Any]: ...


def get_reports(reports: Any) -> list[Any]:
    """Everything waiting on a report queue, without blocking."""
    out: list[Any] = []
    while True:
        try:
            out.append(reports.get_nowait())
        except queue.Empty:
            return out


class LocalBackend:
    """Workers as local processes (spawn), talking through multiprocessing queues."""

    def __init__(self, queue_size: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.rollouts: Any = self.ctx.Queue(maxsize=queue_size)
        self.reports: Any = self.ctx.Queue()
        self._stop = self.ctx.Event()
        self._procs: list[Any] = []

    def start(self, specs: list[WorkerSpec]) -> None:
        for spec in specs:
            p = self.ctx.Process(target=worker_main, args=(spec, self.rollouts, self.reports, self._stop),
                                 name=f"deltasync-rl-worker-{spec.worker_id}", daemon=True)
            p.start()
            self._procs.append(p)

    def alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)

    def stop(self, timeout: float = 10.0) -> list[Any]:
        """Stop every worker; returns the reports they sent meanwhile."""
        self._stop.set()
        reports: list[Any] = []
        end = time.monotonic() + timeout
        while any(p.is_alive() for p in self._procs) and time.monotonic() < end:
            reports += get_reports(self.reports)  # a worker exits only once its reports are read
            time.sleep(0.02)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
        return reports + get_reports(self.reports)


class RayBackend:
    """Workers as Ray actors (``pip install 'deltasync[ray]'``), one CPU each.

    The repository URL must be reachable from every node (a shared path, ``s3://``, or a
    relay's ``grpc://``); the queues are ``ray.util.queue.Queue`` actors.
    """

    def __init__(self, queue_size: int, address: str | None = None) -> None:
        try:
            import ray
            from ray.util.queue import Queue
        except ImportError:
            raise UsageError("the ray backend needs Ray: pip install 'deltasync[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True)
        self.rollouts: Any = RayQueue(Queue(maxsize=queue_size))
        self.reports: Any = RayQueue(Queue())
        self._flag: Any = ray.remote(_Flag).remote()  # actor handles: Ray's stubs do not type their methods' .remote
        self._actors: list[Any] = []
        self._runs: list[Any] = []

    def start(self, specs: list[WorkerSpec]) -> None:
        from .worker import RolloutWorker

        actor_cls = self.ray.remote(num_cpus=1)(RolloutWorker)
        stop = RayStopFlag(self._flag)
        for spec in specs:
            actor: Any = actor_cls.remote(spec)
            self._actors.append(actor)
            self._runs.append(actor.run.remote(self.rollouts, self.reports, stop))

    def alive(self) -> int:
        done, _ = self.ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            self.ray.get(ref)  # re-raises a worker's failure here
        return len(self._runs) - len(done)

    def stop(self, timeout: float = 10.0) -> list[Any]:
        self.ray.get(self._flag.set.remote())
        self.ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        reports = get_reports(self.reports)
        for actor in self._actors:
            self.ray.kill(actor)
        return reports


class RayQueue:
    """``ray.util.queue.Queue`` with the standard library's ``queue.Full`` / ``queue.Empty``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        from ray.util.queue import Full

        try:
            self.inner.put(item, block=block, timeout=timeout)
        except Full:
            raise queue.Full from None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        from ray.util.queue import Empty

        try:
            return self.inner.get(block=block, timeout=timeout)
        except Empty:
            raise queue.Empty from None

    def get_nowait(self) -> Any:
        return self.get(block=False)


class _Flag:
    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class RayStopFlag:
    """A stop flag a Ray actor can poll (an actor holding one boolean)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def is_set(self) -> bool:
        import ray

        return bool(ray.get(self.handle.is_set.remote()))


def make_backend(kind: str, *, queue_size: int, ray_address: str | None = None) -> LocalBackend | RayBackend:
    if kind == "local":
        return LocalBackend(queue_size)
    if kind == "ray":
        return RayBackend(queue_size, ray_address)
    raise UsageError(f"unknown backend {kind!r} (local or ray)")
