"""The run: warm start, then asynchronous RL with workers kept current through deltasync.

::

    trainer ──publish(bf16 checkpoint dir)──▶ repository ◀──poll refs/pin, refs/latest── workers
       ▲            │                                                                     │
       │        eval gate: serve the version, score the held-out suite, pin (or keep)     │
       └────────── rollout queue: (version, tokens, behaviour log-probs, rewards) ◀───────┘

Workers start first (their processes import torch while the warm start runs) and serve
version 1 as soon as it is published. Each RL step takes ``batches_per_step`` rollout
batches, dropping those generated more than ``max_staleness`` updates ago or by a version
the gate rejected, updates the policy, publishes a version and has the gate judge it. A
rejected version leaves the last good version pinned and rolls the trainer back to it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import queue
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import Repository, Subscriber
from ..errors import ChecksumMismatchError, DeltasyncError, UsageError
from .backends import get_reports, make_backend
from .config import RLConfig, to_dict
from .errors import WorkerError
from .feedback import FeedbackServer, FeedbackStore, SimulatedUsers
from .gate import EvalGate, Evaluation, Verdict
from .metrics import MetricsLog, SyncTracker
from .model import TinyTransformer
from .report import PROGRESS_LEGEND, Echo, ProgressLine, eval_dict, format_summary, progress_line, summarize
from .serving import serving_target
from .task import AdditionTask
from .trainer import Trainer
from .worker import RolloutBatch, SyncReport, WorkerFailed, WorkerNote, WorkerSpec


@dataclass
class RunResult:
    out_dir: Path
    metrics_path: Path
    plot_path: Path | None
    final_dir: Path
    warm_start: Evaluation
    final: Evaluation
    """Evaluation of the version pinned at the end (the last one the gate let through)."""
    summary: dict[str, Any]

    def lines(self) -> list[str]:
        """The run in a few lines, for people."""
        return format_summary(self.summary, out_dir=self.out_dir, plot_path=self.plot_path, final_dir=self.final_dir)


#: What a run writes in its directory (and what a rerun there would replace).
RUN_OUTPUTS = ("repo", "checkpoints", "final", "workers", "metrics.jsonl", "plot.png")


def _prepare_out_dir(config: RLConfig, force: bool) -> Path:
    out = Path(config.out_dir)
    previous = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if previous and not force:
        raise UsageError(f"{out} holds a previous run ({', '.join(previous)}): --force replaces it, "
                         f"--out DIR writes this run elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("repo", "checkpoints", "final", "workers"):  # only what a previous run wrote
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "plot.png"):
        (out / name).unlink(missing_ok=True)
    repo = Repository(config.repo_url)
    if repo.exists() and repo.versions():
        raise UsageError(f"repository {config.repo_url} already has versions; an RL run needs an empty one")
    return out


def _vllm_python(config: RLConfig) -> str | None:
    """The vLLM environment's python for ``inference = "vllm"``, found once, as an absolute
    path (workers run elsewhere); a UsageError before the run starts when there is none."""
    if config.workers.inference != "vllm":
        return config.workers.vllm_python
    from .vllm_rollout import find_vllm_python

    py, why = find_vllm_python(config.workers.vllm_python)
    if py is None:
        raise UsageError(f"workers.inference = 'vllm': {why}")
    return str(py)


def run(config: RLConfig, *, echo: Echo = print, progress: bool | None = None, force: bool = False,
        warm_start_cache: str | Path | None = None) -> RunResult:
    """Run warm start and RL as configured; returns where everything was written.

    A directory holding a previous run's outputs is refused unless ``force``. With
    ``warm_start_cache`` (a directory), the warm-started weights are kept there, keyed by
    everything that determines them, and a later run with the same settings starts from them
    (bit for bit what the warm start would compute again).
    """
    vllm_python = _vllm_python(config)  # before anything is written: a missing environment fails first
    out = _prepare_out_dir(config, force)
    task = AdditionTask(config.digits)
    torch.set_num_threads(1)  # deterministic kernels, and the cores go to the workers
    backend = make_backend(config.workers.backend, queue_size=config.workers.queue_size,
                           ray_address=config.workers.ray_address)
    metrics = MetricsLog(out / "metrics.jsonl")
    metrics.log("config", **to_dict(config))
    specs = [
        WorkerSpec(worker_id=i, repo=config.repo_url, model=config.model, digits=config.digits,
                   group_size=config.group_size, prompts_per_batch=config.workers.prompts_per_batch, seed=config.seed,
                   poll_interval=config.workers.poll_interval, live=config.live.enabled,
                   torch_threads=config.workers.torch_threads, inference=config.workers.inference,
                   work_dir=str((out / "workers").resolve()), vllm_python=vllm_python,
                   vllm_start_timeout=config.workers.vllm_start_timeout)
        for i in range(config.workers.count)
    ]
    state = _RunState(config, task, metrics, backend, echo)
    state.warm_cache = warm_start_dir(Path(warm_start_cache), config) if warm_start_cache is not None else None
    try:
        backend.start(specs)
        return state.run(out, progress)
    finally:
        state.close()


WARM_DONE = "warm_start.json"


def warm_start_dir(root: Path, config: RLConfig) -> Path:
    """Where ``config``'s warm-started weights are kept under ``root``: keyed by everything
    that determines them (model, task, seed, warm-start settings, torch version)."""
    ws = {k: v for k, v in to_dict(config)["warm_start"].items() if k != "init_from"}
    key = {"model": to_dict(config)["model"], "digits": config.digits, "seed": config.seed, "warm_start": ws,
           "torch": torch.__version__, "layout": 1}
    return root / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _keep_warm_start(trainer: Trainer, where: Path, loss: float) -> None:
    """Save the fp32 weights (the trainer's master copy, exactly) for later runs; best effort."""
    staging = where.with_name(f"{where.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        trainer.policy.save_pretrained(staging, dtype=torch.float32)
        (staging / WARM_DONE).write_text(json.dumps({"loss": loss}) + "\n")
        shutil.rmtree(where, ignore_errors=True)
        os.replace(staging, where)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


class _RunState:
    def __init__(self, config: RLConfig, task: AdditionTask, metrics: MetricsLog, backend: Any, echo: Echo) -> None:
        self.config = config
        self.task = task
        self.metrics = metrics
        self.backend = backend
        self.echo = echo
        self.sync = SyncTracker(config.workers.count)
        self.swaps: dict[int, list[dict[str, Any]]] = {}
        self.rejected: set[int] = set()
        self.position: dict[int, int] = {}  # version -> RL updates in its weights' history
        self.current = 0  # position of the trainer's weights
        self.dropped: Counter[str] = Counter()
        self.backlog: list[RolloutBatch] = []  # usable batches beyond what the last step needed
        self.store: FeedbackStore | None = None
        self.server: FeedbackServer | None = None
        self.users: SimulatedUsers | None = None
        self.gate: EvalGate | None = None
        self.bar: ProgressLine | None = None
        self.synced: list[dict[str, Any]] = []  # sync figures completed since the last step record
        self.warm_cache: Path | None = None  # where warm-started weights for this config are kept
        self.closed = False

    # -- reports from workers ------------------------------------------------------------------

    def pump_reports(self, items: list[Any] | None = None) -> None:
        for item in items if items is not None else get_reports(self.backend.reports):
            if isinstance(item, SyncReport):
                s = item.swap
                rec = self.metrics.log(
                    "swap", worker=item.worker, version=s.version, previous=s.previous, digest=s.digest,
                    expected=s.expected, bit_exact=s.bit_exact, served_unix=s.served_unix, pause_s=s.pause_s,
                    stage_s=s.stage_s, fetched_bytes=s.fetched_bytes, elements_changed=s.elements_changed,
                    digest_of=s.digest_of,
                )
                self.swaps.setdefault(item.worker, []).append(rec)
                if not s.bit_exact:  # the engine verifies every chunk, so this is a bug: stop the run
                    raise ChecksumMismatchError(version=s.version, tensor=f"<module of worker {item.worker}>", chunk=-1,
                                                expected=s.expected, actual=s.digest)
                self.sync.swap(item.worker, s)
            elif isinstance(item, WorkerFailed):
                raise WorkerError(item.worker, item.error)
            elif isinstance(item, WorkerNote):
                self.metrics.log("note", worker=item.worker, message=item.message)
        for fig in self.sync.complete():
            self.metrics.log("sync", **fig)
            self.synced.append({k: fig[k] for k in ("version", "latency_s", "serve_latency_s", "pause_max_s")})

    # -- rollouts ------------------------------------------------------------------------------

    def usable(self, batch: RolloutBatch) -> str | None:
        """Why ``batch`` cannot be trained on (None: it can)."""
        if batch.version in self.rejected:
            return "rejected_version"
        if self.current - self.position.get(batch.version, -(10**9)) > self.config.max_staleness:
            return "stale"
        return None

    def collect(self, need: int) -> tuple[list[RolloutBatch], float]:
        """``need`` usable batches; returns them and the seconds spent waiting."""
        start = time.monotonic()
        got: list[RolloutBatch] = []
        for batch in self.backlog:
            why = self.usable(batch)
            if why is None:
                got.append(batch)
            else:
                self.dropped[why] += 1
        self.backlog = []
        last_progress = start
        while len(got) < need:
            self.pump_reports()
            if self.backend.alive() < self.config.workers.count:
                self.pump_reports()
                raise WorkerError(None, None)
            candidates: list[RolloutBatch] = []
            try:
                first = self.backend.rollouts.get(timeout=0.05)
            except queue.Empty:
                first = None
            if first is not None:
                if self.store is not None:
                    self.store.add(first)
                else:
                    candidates.append(first)
            if self.store is not None:
                gone = self.store.discard(lambda b: self.usable(b) is None)
                if gone:
                    self.dropped["stale_awaiting_feedback"] += gone
                candidates += self.store.ready()
            for batch in candidates:
                why = self.usable(batch)
                if why is None:
                    got.append(batch)
                    last_progress = time.monotonic()
                else:
                    self.dropped[why] += 1
            limit = 120.0 + (self.config.workers.vllm_start_timeout if self.config.workers.inference == "vllm" else 0.0)
            if time.monotonic() - last_progress > limit:
                raise DeltasyncError(f"no usable rollouts for {limit:.0f} s (are the workers serving a version?)")
        self.backlog = got[need:]
        return got[:need], time.monotonic() - start

    # -- the run ---------------------------------------------------------------------------------

    def run(self, out: Path, progress: bool | None) -> RunResult:
        config, task, metrics, echo = self.config, self.task, self.metrics, self.echo
        checkpoints = out / "checkpoints"
        trainer = Trainer(config, task, checkpoints=checkpoints)
        self.gate = gate = EvalGate(config.repo_url, config.model, task, config.gate, seed=config.seed)
        n_params = sum(p.numel() for p in trainer.policy.parameters())
        echo(f"rl: {config.digits}-digit addition, {n_params / 1e3:.0f}k-parameter transformer, "
             f"{config.workers.count} {config.workers.backend} workers, repository {config.repo_url}")

        ws_start = time.monotonic()
        bar = ProgressLine(echo, max(config.warm_start.steps, 1), progress)

        def ws_progress(step: int, loss: float) -> None:
            if step % 25 == 0 or step == config.warm_start.steps:
                bar.update(step, f"warm start {step}/{config.warm_start.steps}  loss {loss:.3f}")

        cached = self.warm_cache if self.warm_cache is not None and (self.warm_cache / WARM_DONE).exists() else None
        if config.warm_start.init_from is not None:
            trainer.load(config.warm_start.init_from)
            loss = math.nan
        elif cached is not None:
            trainer.load(cached)
            loss = float(json.loads((cached / WARM_DONE).read_text())["loss"])
        else:
            loss = trainer.warm_start(on_progress=ws_progress)
            if self.warm_cache is not None and config.warm_start.steps:
                _keep_warm_start(trainer, self.warm_cache, loss)
        bar.finish()
        trainer.start_rl()
        version = 1
        pub = trainer.publish(version, {"rl.phase": "warm_start", "rl.position": "0"})
        self.sync.publish(version, pub.published_unix)
        self.sync.target(version, pub.published_unix)  # nothing pinned yet: workers take it at once
        self.position[version] = 0
        verdict = gate.judge(version, greedy=True)
        warm = verdict.evaluation
        snapshot = trainer.snapshot()
        suite = gate.suite
        teacher = task.reward(suite, task.teacher_answers(*task.operands_of(suite), np.random.default_rng(config.seed),
                                                          config.warm_start.teacher_carry_error))
        metrics.log("warm_start", loss=loss, seconds=time.monotonic() - ws_start, version=version,
                    reused_from=str(cached) if cached is not None else None,
                    stored_bytes=pub.stored_bytes, raw_bytes=pub.raw_bytes, eval=eval_dict(warm), pinned=verdict.pinned,
                    teacher_reward=float(teacher.mean()), teacher_exact=float((teacher == 1).mean()))
        if config.warm_start.init_from is not None:
            how = f"weights from {config.warm_start.init_from}"
        elif cached is not None:
            how = f"{config.warm_start.steps} steps, reused from {cached} (same settings), loss {loss:.3f}"
        else:
            how = f"{config.warm_start.steps} steps in {time.monotonic() - ws_start:.1f}s, loss {loss:.3f}"
        echo(f"warm start: {how}; held-out reward {warm.score:.3f} sampled ({warm.exact:.1%} exact), "
             f"{warm.greedy_reward:.3f} greedy ({warm.greedy_exact:.1%} exact) -> version 1")

        if config.live.enabled:
            self._start_live()

        echo(PROGRESS_LEGEND)
        bar = self.bar = ProgressLine(echo, config.steps, progress)
        rl_start = time.monotonic()
        last_eval = warm
        repo = Repository(config.repo_url)
        for step in range(1, config.steps + 1):
            batches, waited = self.collect(config.batches_per_step)
            staleness = Counter(self.current - self.position[b.version] for b in batches)
            stats = trainer.rl_step(batches)
            injected = config.gate.inject_regression_at == step
            if injected:
                trainer.damage(seed=config.seed + step)
            version += 1
            parent_position = self.current
            pub = trainer.publish(version, {"rl.phase": "rl", "rl.step": str(step),
                                            "rl.position": str(parent_position + 1),
                                            "rl.injected_regression": str(injected).lower()})
            self.sync.publish(version, pub.published_unix)
            self.position[version] = parent_position + 1
            self.current = parent_position + 1
            followed_latest = not config.gate.enabled or (config.gate.follow == "canary" and repo.pinned() is None)
            verdict = gate.judge(version)
            if followed_latest:
                self.sync.target(version, pub.published_unix)
            elif verdict.passed:
                self.sync.target(version, time.time())
            if verdict.passed:
                snapshot = trainer.snapshot()
                last_eval = verdict.evaluation
            else:
                self._reject(verdict)
                trainer.restore(snapshot)
                self.current = self.position[verdict.pinned]
            keep = {v for v in self.position if self.current - self.position[v] <= config.max_staleness}
            trainer.prune(keep | {verdict.pinned}, [checkpoints / f"version-{verdict.pinned:06d}"])
            self.pump_reports()
            feedback = self.store.stats() if self.store is not None else None
            rec = metrics.log(
                "step", step=step, version=version, kind=pub.kind, reward=stats.reward, exact=stats.exact,
                loss=stats.loss, logprob_gap=stats.logprob_gap, logprob_gap_mean=stats.logprob_gap_mean,
                gap_over_tolerance=stats.gap_over_tolerance, gap_by_version=stats.by_version,
                mismatch_is_std=stats.mismatch_is_std, mismatch_is_max=stats.mismatch_is_max,
                is_weight_std=stats.is_weight_std, routing_mismatch=stats.routing_mismatch,
                routing_mismatch_used=stats.routing_mismatch_used, router_replay=config.router_replay,
                routing_mismatch_differing=stats.routing_mismatch_differing, routing_positions=stats.routing_positions,
                rerouted_tokens=stats.rerouted_tokens, rerouted_gap_mean=stats.rerouted_gap_mean,
                rerouted_gap_max=stats.rerouted_gap_max,
                is_weight=stats.is_weight, truncated=stats.truncated,
                kl=stats.kl, samples=stats.samples, groups=stats.groups, groups_with_signal=stats.groups_with_signal,
                grad_norm=stats.grad_norm, staleness={str(k): n for k, n in sorted(staleness.items())},
                dropped=dict(self.dropped), raw_bytes=pub.raw_bytes, stored_bytes=pub.stored_bytes, ratio=pub.ratio,
                publish_s=pub.seconds, train_s=stats.seconds, wait_s=waited, eval=eval_dict(verdict.evaluation),
                gate_passed=verdict.passed, pinned=verdict.pinned, pin_ref=verdict.ref, injected_regression=injected,
                feedback=feedback, rollouts=[{"worker": b.worker, "version": b.version, "seq": b.seq} for b in batches],
                synced=self.synced,
            )
            self.synced = []
            bar.update(step, progress_line(metrics, config.steps, rec, warm, last_eval))
        bar.finish()
        rl_seconds = time.monotonic() - rl_start
        pinned = gate.pinned or version
        final = gate.evaluate(pinned, greedy=True)
        self._settle()
        final_dir = self._pull_final(out, pinned)
        summary = summarize(metrics, warm, final, rl_seconds=rl_seconds, last_version=version, pinned=pinned,
                            dropped=self.dropped, rejected=self.rejected,
                            feedback=self.store.stats() if self.store is not None else None)
        metrics.log("summary", **summary)
        plot_path = self._plot(out)
        return RunResult(out, metrics.path, plot_path, final_dir, warm, final, summary)

    def _reject(self, verdict: Verdict) -> None:
        """A regression: the version is never trained on again; the trainer rolls back."""
        self.rejected.add(verdict.version)
        self.sync.skip(verdict.version)
        self.metrics.log("rollback", version=verdict.version, pinned=verdict.pinned, score=verdict.evaluation.score,
                         reference=verdict.reference, follow=self.config.gate.follow)
        say = self.bar.message if self.bar is not None else self.echo
        say(f"gate: version {verdict.version} regressed (held-out reward {verdict.evaluation.score:.3f} < "
                  f"{verdict.reference or 0:.3f} - {self.config.gate.tolerance}); version {verdict.pinned} stays pinned "
                  "and the trainer rolls back to it")

    def _start_live(self) -> None:
        live = self.config.live
        self.store = FeedbackStore(self.task, timeout=live.timeout)
        self.server = FeedbackServer(self.store, live.host, live.port).start()
        self.metrics.log("live", url=self.server.url)
        self.echo(f"live feedback: POST {self.server.url}/feedback, pending completions at {self.server.url}/pending")
        if live.simulate_users:
            self.users = SimulatedUsers(self.server.url, self.task, delay=live.user_delay, seed=self.config.seed).start()

    def _settle(self, timeout: float = 10.0) -> None:
        """Wait (briefly) until every worker serves the final target, so its sync is measured."""
        target = serving_target(Repository(self.config.repo_url))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump_reports()
            served = [reps[-1]["version"] for reps in self.swaps.values() if reps]
            if len(served) == self.config.workers.count and all(v == target for v in served):
                return
            time.sleep(0.02)

    def _pull_final(self, out: Path, version: int) -> Path:
        """``deltasync pull`` of the pinned version, loaded back as a model: the checkpoint round trip."""
        final = out / "final"
        Subscriber(self.config.repo_url, workers=1, progress=False).update_dir(final, version)
        TinyTransformer.from_pretrained(final)
        return final

    def _plot(self, out: Path) -> Path | None:
        try:
            from .plot import plot_metrics
        except ImportError:
            self.echo("plot: matplotlib is not installed (pip install 'deltasync[rl]'); metrics are in metrics.jsonl")
            return None
        return plot_metrics(self.metrics.records, out / "plot.png")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.users is not None:
            self.users.stop()
        # Already raising, or a worker failed while stopping: the run's outcome stands.
        with contextlib.suppress(DeltasyncError):
            self.pump_reports(self.backend.stop())
        if self.server is not None:
            self.server.close()
        if self.gate is not None:
            self.gate.close()
        self.metrics.close()
