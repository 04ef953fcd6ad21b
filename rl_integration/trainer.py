"""The trainer: fp32 master weights, AdamW, and a bf16 version published for every update.

Warm start: supervised training on the sloppy teacher's answers (``task.teacher_answers``).

RL step, on rollout batches that each carry the version that generated them and the
per-token log-probs ``mu`` of their sampled tokens under that version:

1. *Recompute.* The trainer keeps the bf16 weights of the versions it may still receive
   rollouts from and scores each batch with its version, on the same buffer the worker
   generated into (``sampling.token_logprobs``), full sequence, fp32 arithmetic. With
   ``exact`` workers (same bits, same arithmetic, same shapes, one thread) the result equals
   ``mu`` exactly: anything but a 0 ``logprob_gap`` means the worker did not serve the bits
   the trainer published. With ``kv_bf16`` or ``vllm`` workers the gap is the real
   train-inference mismatch, logged per step and per version (mean and max per token), with
   the spread of the ratio exp(trainer - behaviour). For MoE policies the workers report the
   experts they used: ``routing_mismatch`` is the fraction of positions the trainer's own
   router sends elsewhere, and with ``router_replay`` the trainer's forward (recompute and
   update) uses the reported experts instead (``routing_mismatch_used`` is then 0).
2. *Advantages* (GRPO): per group of samples of one prompt,
   ``A = (r - mean(r)) / (std(r) + 1e-6)``; a group whose rewards are all equal teaches
   nothing and gets A = 0. Only rated completions count (live feedback may be missing).
3. *Truncated importance sampling.* The policy being updated (fp32 master weights, with
   gradients) is newer than the one that sampled: per token,
   ``rho = exp(log pi_theta - mu)``, ``w = min(rho, is_truncation)`` (no gradient), and the
   loss is ``-sum(w * A * log pi_theta) / tokens``: the off-policy policy gradient with
   truncated weights. Batches staler than ``max_staleness`` updates never get here.

The bf16 cast of the master weights (round to nearest even) is what is published, saved
as a Hugging Face style directory and committed with ``Publisher.publish_dir`` against
the previous checkpoint, so only changed chunks are stored.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .. import Publisher, PublisherConfig
from .config import RLConfig
from .model import TinyTransformer
from .sampling import token_logprobs
from .task import AdditionTask
from .worker import RolloutBatch


@dataclass(frozen=True)
class Published:
    version: int
    kind: str
    raw_bytes: int
    stored_bytes: int
    seconds: float
    published_unix: float
    checkpoint: Path

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else math.inf


@dataclass(frozen=True)
class StepStats:
    reward: float
    """Mean reward of the rated completions trained on."""
    exact: float
    """Fraction of those completions that are exactly right."""
    loss: float
    logprob_gap: float
    """Largest |trainer log-prob - behaviour log-prob| over the tokens, each scored with the version that generated it."""
    is_weight: float
    """Mean importance weight (before truncation) over the tokens."""
    truncated: float
    """Fraction of tokens whose weight was truncated."""
    kl: float
    """Estimate of KL(behaviour || current) per token (k3 estimator)."""
    samples: int
    tokens: int
    groups_with_signal: int
    groups: int
    grad_norm: float
    seconds: float
    logprob_gap_mean: float = 0.0
    """Mean |trainer log-prob - behaviour log-prob| per token (same version, as for ``logprob_gap``)."""
    gap_over_tolerance: int = 0
    """Tokens whose gap exceeds ``config.logprob_tolerance``."""
    mismatch_is_std: float = 0.0
    """Spread (standard deviation) of the train-inference ratio exp(trainer - behaviour) at the
    same version, over the tokens: 0 when trainer and workers agree bit for bit."""
    mismatch_is_max: float = 1.0
    """Largest train-inference ratio exp(|trainer - behaviour|) over the tokens."""
    is_weight_std: float = 0.0
    """Standard deviation of the importance weight pi_theta / behaviour (before truncation)."""
    routing_mismatch: float | None = None
    """MoE: fraction of positions (fed to the model by the worker) for which the trainer's own
    router, recomputing, picks other experts than the worker reported (in any layer)."""
    routing_mismatch_differing: int | None = None
    """MoE: positions counted in ``routing_mismatch`` (of ``routing_positions``)."""
    routing_positions: int | None = None
    """MoE: positions the worker reported experts for."""
    rerouted_tokens: int | None = None
    """MoE: answer tokens at or after a position the trainer's own router routes differently
    from the worker (the tokens router replay is for)."""
    rerouted_gap_mean: float | None = None
    """MoE: mean |trainer - behaviour| over those tokens (with replay: what replay left of it)."""
    rerouted_gap_max: float | None = None
    routing_mismatch_used: int | None = None
    """MoE: positions the trainer's forward actually routed differently from the worker (0 with router replay)."""
    by_version: dict[str, dict[str, float]] | None = None
    """Per version that generated the step's rollouts: gap mean and max, tokens."""


class Trainer:
    """Policy, optimizer, publisher and the bf16 scorers of recent versions."""

    def __init__(self, config: RLConfig, task: AdditionTask, *, checkpoints: Path) -> None:
        self.config = config
        self.task = task
        torch.manual_seed(config.seed)
        self.policy = TinyTransformer(config.model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.publisher = Publisher(
            config.repo_url, PublisherConfig(snapshot_every=config.snapshot_every, workers=1, progress=False)
        )
        self.checkpoints = checkpoints
        self.scorers: dict[int, TinyTransformer] = {}
        self._last_checkpoint: Path | None = None
        self._kept: list[Path] = []

    # -- warm start ---------------------------------------------------------------------------

    def warm_start(self, *, on_progress: Callable[[int, float], None] | None = None) -> float:
        """Supervised training on teacher answers; returns the last loss."""
        ws = self.config.warm_start
        if ws.steps == 0:
            return math.nan
        opt = torch.optim.AdamW(self.policy.parameters(), lr=ws.lr, weight_decay=0.01, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
        rng = np.random.default_rng([self.config.seed, 7])
        loss = torch.zeros(())
        for step in range(1, ws.steps + 1):
            a, b = self.task.sample_operands(rng, ws.batch_size)
            seqs = np.concatenate([self.task.prompts(a, b), self.task.teacher_answers(a, b, rng, ws.teacher_carry_error)], 1)
            loss = -token_logprobs(self.policy, torch.from_numpy(seqs), self.task.prompt_len).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            if on_progress is not None:
                on_progress(step, loss.item())
        return loss.item()

    def load(self, path: str | Path) -> None:
        """Take the weights of a checkpoint directory (fp32 master copy of its values)."""
        from ..errors import UsageError

        loaded = TinyTransformer.from_pretrained(path, dtype=torch.float32)
        if loaded.config != self.config.model:
            raise UsageError(f"{path}: model config {loaded.config} differs from the run's {self.config.model}")
        self.policy.load_state_dict(loaded.state_dict())

    def start_rl(self) -> None:
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.config.lr, weight_decay=0.0,
                                           betas=(0.9, 0.98))

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, version: int, metadata: dict[str, str]) -> Published:
        """Save the bf16 cast as a checkpoint directory and commit it as ``version``."""
        ckpt = self.checkpoints / f"version-{version:06d}"
        if ckpt.exists():
            shutil.rmtree(ckpt)
        self.policy.save_pretrained(ckpt, metadata={"deltasync.rl.version": str(version)},
                                    extra_config={"deltasync_task": {"name": "addition", "digits": self.task.digits}})
        r = self.publisher.publish_dir(ckpt, base_dir=self._last_checkpoint, version=version, metadata=metadata)
        published = time.time()
        v = r.version
        assert v == version
        scorer = TinyTransformer(self.config.model).to(torch.bfloat16).requires_grad_(False).eval()
        scorer.load_state_dict(self.policy.bf16_state())
        self.scorers[version] = scorer
        self._last_checkpoint = ckpt
        self._kept.append(ckpt)
        return Published(v, r.kind, r.raw_bytes, r.stored_bytes, r.seconds, published, ckpt)

    def prune(self, keep_versions: Iterable[int], keep_dirs: Iterable[Path]) -> None:
        """Forget scorers and checkpoint directories no longer needed."""
        keep = set(keep_versions)
        for v in [v for v in self.scorers if v not in keep]:
            del self.scorers[v]
        protected = {*keep_dirs, *self._kept[-self.config.keep_checkpoints :]}
        if self._last_checkpoint is not None:
            protected.add(self._last_checkpoint)
        for d in [d for d in self._kept if d not in protected]:
            shutil.rmtree(d, ignore_errors=True)
            self._kept.remove(d)

    # -- state snapshots (for rolling back to a pinned version) -----------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": copy.deepcopy(self.policy.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        self.policy.load_state_dict(snap["policy"])
        if self.optimizer is not None and snap["optimizer"] is not None:
            self.optimizer.load_state_dict(snap["optimizer"])

    @torch.no_grad()
    def damage(self, scale: float = 0.05, seed: int = 0) -> None:
        """Add noise to every weight matrix (fault injection: a bad update the gate must catch)."""
        gen = torch.Generator().manual_seed(seed)
        for p in self.policy.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale)

    # -- one RL update ----------------------------------------------------------------------------

    def rl_step(self, batches: list[RolloutBatch]) -> StepStats:
        assert self.optimizer is not None, "start_rl() first"
        start = time.perf_counter()
        p = self.task.prompt_len
        tokens_l: list[torch.Tensor] = []
        mu_l: list[torch.Tensor] = []
        mask_l: list[torch.Tensor] = []
        adv_l: list[torch.Tensor] = []
        replay_l: list[torch.Tensor] = []
        diffs_l: list[torch.Tensor] = []
        rewards_l: list[npt.NDArray[np.float32]] = []
        per_version: dict[int, list[torch.Tensor]] = {}
        affected_l: list[torch.Tensor] = []
        routed = routed_differently = used_differently = 0
        moe = self.config.model.moe
        groups = with_signal = 0
        for b in batches:
            g = b.generation
            # Copies: arrays that crossed a process boundary may be read-only (Ray maps them).
            b_tokens = torch.tensor(g.tokens)
            b_mu = torch.tensor(g.logprobs)
            b_mask = torch.tensor(g.mask & b.rated[:, None])
            reported = torch.tensor(g.routing.astype(np.int64)) if moe and g.routing is not None else None
            replay = reported if self.config.router_replay else None
            scorer = self.scorers[b.version]
            with torch.no_grad():
                if reported is not None:
                    valid = (reported >= 0).all(-1)  # (layers, batch, time)
                    if replay is not None:  # what the router would have picked without replay
                        scorer(b_tokens)
                        assert scorer.routing is not None
                        own = scorer.routing
                    recomputed = token_logprobs(scorer, b_tokens, p, replay)
                    used = scorer.routing
                    assert used is not None
                    if replay is None:
                        own = used
                    pos_valid = valid.all(0)
                    routed += int(pos_valid.sum())
                    differs = (own != reported).any(-1).any(0) & pos_valid  # (batch, time)
                    routed_differently += int(differs.sum())
                    # An answer token is affected when its position, or one before it (through
                    # attention), is routed differently by the trainer's own router.
                    upto = differs.cumsum(dim=1) > 0
                    affected = upto[:, p - 1 : p - 1 + b_mu.shape[1]]
                    affected_l.append(((recomputed - b_mu)[b_mask & affected]).abs())
                    used_differently += int(((used != reported).any(-1).any(0) & pos_valid).sum())
                else:
                    recomputed = token_logprobs(scorer, b_tokens, p)
            diff = (recomputed - b_mu)[b_mask]
            diffs_l.append(diff)
            per_version.setdefault(b.version, []).append(diff)
            b_adv, n_groups, n_signal = group_advantages(b.rewards, b.rated, b.group_size)
            groups += n_groups
            with_signal += n_signal
            tokens_l.append(b_tokens)
            mu_l.append(b_mu)
            mask_l.append(b_mask)
            adv_l.append(torch.from_numpy(b_adv))
            if replay is not None:
                replay_l.append(replay)
            rewards_l.append(b.rewards[b.rated])
        tokens = torch.cat(tokens_l)
        mu = torch.cat(mu_l)
        mask = torch.cat(mask_l).float()
        adv = torch.cat(adv_l)
        replay_all = torch.cat(replay_l, dim=1) if replay_l else None
        logp = token_logprobs(self.policy, tokens, p, replay_all)
        log_ratio = (logp.detach() - mu) * mask
        rho = log_ratio.exp()
        weight = rho.clamp(max=self.config.is_truncation)
        n_tokens = max(float(mask.sum()), 1.0)
        loss = -(weight * adv[:, None] * logp * mask).sum() / n_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0))
        self.optimizer.step()
        rewards = np.concatenate(rewards_l) if rewards_l else np.zeros(0, np.float32)
        kl = ((rho - 1 - log_ratio) * mask).sum() / n_tokens
        diffs = torch.cat(diffs_l) if diffs_l else torch.zeros(0)
        gaps = diffs.abs()
        rho_m = rho[mask.bool()]
        mism = diffs.exp()
        affected_gaps = torch.cat(affected_l) if affected_l else torch.zeros(0)
        return StepStats(
            reward=float(rewards.mean()) if rewards.size else math.nan,
            exact=float((rewards == 1).mean()) if rewards.size else math.nan,
            loss=loss.item(), logprob_gap=float(gaps.max()) if gaps.numel() else 0.0,
            is_weight=float((rho * mask).sum() / n_tokens),
            truncated=float(((rho > self.config.is_truncation).float() * mask).sum() / n_tokens),
            kl=float(kl), samples=int(rewards.size), tokens=int(n_tokens), groups_with_signal=with_signal,
            groups=groups, grad_norm=grad_norm, seconds=time.perf_counter() - start,
            logprob_gap_mean=float(gaps.mean()) if gaps.numel() else 0.0,
            gap_over_tolerance=int((gaps > self.config.logprob_tolerance).sum()),
            mismatch_is_std=float(mism.std()) if mism.numel() > 1 else 0.0,
            mismatch_is_max=float(gaps.max().exp()) if gaps.numel() else 1.0,
            is_weight_std=float(rho_m.std()) if rho_m.numel() > 1 else 0.0,
            routing_mismatch=routed_differently / routed if routed else None,
            routing_mismatch_used=used_differently if routed else None,
            routing_mismatch_differing=routed_differently if routed else None,
            routing_positions=routed if routed else None,
            rerouted_tokens=int(affected_gaps.numel()) if routed else None,
            rerouted_gap_mean=float(affected_gaps.mean()) if affected_gaps.numel() else None,
            rerouted_gap_max=float(affected_gaps.max()) if affected_gaps.numel() else None,
            by_version={str(v): {"gap_mean": float(torch.cat(d).abs().mean()) if torch.cat(d).numel() else 0.0,
                                 "gap_max": float(torch.cat(d).abs().max()) if torch.cat(d).numel() else 0.0,
                                 "tokens": int(torch.cat(d).numel())} for v, d in sorted(per_version.items())},
        )


def group_advantages(
    rewards: npt.NDArray[np.float32], rated: npt.NDArray[np.bool_], group_size: int
) -> tuple[npt.NDArray[np.float32], int, int]:
    """GRPO advantages per group of ``group_size`` consecutive samples, over rated samples only.

    Returns (advantages, groups, groups with signal). Unrated samples, groups with fewer
    than two rated samples and groups whose rated rewards are all equal get 0.
    """
    n = len(rewards)
    adv = np.zeros(n, np.float32)
    groups = signal = 0
    for start in range(0, n, group_size):
        sl = slice(start, min(start + group_size, n))
        r, ok = rewards[sl], rated[sl]
        groups += 1
        if ok.sum() < 2:
            continue
        vals = r[ok].astype(np.float64)
        std = vals.std()
        if std == 0:
            continue
        signal += 1
        a = np.zeros(len(r), np.float32)
        a[ok] = ((vals - vals.mean()) / (std + 1e-6)).astype(np.float32)
        adv[sl] = a
    return adv, groups, signal
