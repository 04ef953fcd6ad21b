"""The evaluation gate: a held-out suite run on every new version before it is pinned.

The gate serves each version exactly as a worker does — pulled from the repository into a
bf16 module through the in-process engine, digest-checked — so what it scores is the
published artifact, not the trainer's copy. Its score is the mean partial-credit reward
of sampled answers (temperature 1) on a fixed held-out suite: the policy's own expected
reward, the figure RL optimises. The sampler is seeded the same for every version, so
two versions are compared on the same random numbers (deterministic, low variance).

A version *passes* when its score is at least the pinned version's score minus
``tolerance`` (the first version always passes). Pins go through ``Repository.pin``, the
same ``refs/pin`` that ``deltasync subscribe`` agents follow:

* ``follow="gated"``: every version that passes is pinned; workers serve pinned versions
  only. A regression leaves the previous version pinned.
* ``follow="canary"``: the pin is cleared while versions pass, so workers serve each new
  version at once; a regression pins the last good version and the workers roll back to
  it, until a newer version passes.

In both, the trainer rolls its own state back to the pinned version after a regression
(see loop.py), so training continues from weights that passed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import ChecksumMismatchError
from .config import GateConfig, ModelConfig
from .serving import ServedPolicy
from .task import AdditionTask


@dataclass(frozen=True)
class Evaluation:
    version: int
    score: float
    """Mean reward of sampled answers on the suite (temperature 1, fixed seed): the gate's score."""
    exact: float
    """Fraction of sampled answers exactly right."""
    greedy_reward: float | None
    """Mean reward of greedy answers (measured for the first and the final version only)."""
    greedy_exact: float | None
    seconds: float


@dataclass(frozen=True)
class Verdict:
    evaluation: Evaluation
    passed: bool
    reference: float | None
    """Score of the version pinned before (None for the first version)."""
    pinned: int
    """Last version that passed (the one serving falls back to)."""
    ref: int | None
    """What ``refs/pin`` holds after the verdict (None: subscribers follow the latest)."""

    @property
    def version(self) -> int:
        return self.evaluation.version


class EvalGate:
    def __init__(self, repo_url: str, model: ModelConfig, task: AdditionTask, config: GateConfig, *, seed: int) -> None:
        self.config = config
        self.task = task
        self.suite = task.eval_suite(config.suite_size, seed=1234 + seed)
        self.policy = ServedPolicy(repo_url, model)
        self.seed = seed
        self.pinned: int | None = None
        self.pinned_score: float | None = None

    def evaluate(self, version: int, *, greedy: bool = False) -> Evaluation:
        """Score ``version`` on the suite (served from the repository, digest-checked)."""
        start = time.perf_counter()
        swap = self.policy.update(version)
        if swap is not None and not swap.bit_exact:
            raise ChecksumMismatchError(version=version, tensor="<served module>", chunk=-1,
                                        expected=swap.expected, actual=swap.digest)
        # The same random numbers for every version: differences between versions are the
        # policy's, not the sampler's.
        sampler = torch.Generator().manual_seed(10_000 + self.seed)
        _, sampled = self.policy.generate(self.suite, self.task.answer_len, generator=sampler)
        s = self.task.reward(self.suite, sampled.completions)
        g_reward = g_exact = None
        if greedy:
            _, decoded = self.policy.generate(self.suite, self.task.answer_len, greedy=True)
            g = self.task.reward(self.suite, decoded.completions)
            g_reward, g_exact = float(g.mean()), float((g == 1).mean())
        return Evaluation(version, float(s.mean()), float((s == 1).mean()), g_reward, g_exact, time.perf_counter() - start)

    def judge(self, version: int, *, greedy: bool = False) -> Verdict:
        """Evaluate ``version``, then pin it or keep (canary: re-pin) the last good version."""
        ev = self.evaluate(version, greedy=greedy)
        reference = self.pinned_score
        passed = reference is None or ev.score >= reference - self.config.tolerance
        if not self.config.enabled:
            return Verdict(ev, True, reference, version, None)
        repo = self.policy.repo
        if passed:
            self.pinned, self.pinned_score = version, ev.score
            ref = version if self.config.follow == "gated" else None
        else:
            assert self.pinned is not None
            ref = self.pinned
        if repo.pinned() != ref:
            repo.pin(ref)
        return Verdict(ev, passed, reference, self.pinned if self.pinned is not None else version, ref)

    def close(self) -> None:
        self.policy.close()
