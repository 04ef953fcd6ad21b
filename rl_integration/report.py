"""What a run reports: the progress line, the summary figures, and the summary for people."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..progress import human_bytes
from .gate import Evaluation
from .metrics import MetricsLog, percentile

Echo = Callable[[str], None]


class ProgressLine:
    """One line redrawn on a terminal; a line every ~10% of the steps otherwise."""

    def __init__(self, echo: Echo, total: int, enabled: bool | None) -> None:
        self.echo = echo
        self.total = total
        self.tty = sys.stderr.isatty() if enabled is None else enabled
        self.every = max(1, total // 10)

    def update(self, step: int, line: str) -> None:
        if self.tty:
            sys.stderr.write("\r" + line[:160].ljust(120))
            sys.stderr.flush()
        elif step % self.every == 0 or step == self.total:
            self.echo(line)

    def message(self, text: str) -> None:
        """A line of its own, above the progress line (which the next update redraws)."""
        if self.tty:
            sys.stderr.write("\r" + " " * 120 + "\r")
            sys.stderr.flush()
        self.echo(text)

    def finish(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


#: Printed once above the progress lines: what their fields mean.
PROGRESS_LEGEND = (
    "legend: rl STEP/STEPS vVERSION; reward: mean of the step's training batches; eval: held-out score of the "
    "version served (warm: after the warm start); stale K:N: N of the batches trained on were sampled from weights K "
    "updates old; gap: largest log-prob difference between trainer and worker for the same tokens (0: the workers "
    "served exactly the trainer's weights); bytes stored per version and its compression; sync: publish to every "
    "worker serving it"
)


def progress_line(metrics: MetricsLog, steps: int, rec: Mapping[str, Any], warm: Evaluation, last: Evaluation) -> str:
    """One line on a step: reward, staleness, log-prob gap, bytes per version, sync time."""
    syncs = metrics.events("sync")
    lat = f"{syncs[-1]['latency_s'] * 1e3:.0f} ms" if syncs else "-"
    stale = " ".join(f"{k}:{v}" for k, v in rec["staleness"].items())
    size = (f"{human_bytes(rec['stored_bytes'])}/v {rec['ratio']:.1f}x" if rec["kind"] == "delta"
            else f"snapshot {human_bytes(rec['stored_bytes'])}")
    return (
        f"rl {rec['step']}/{steps} v{rec['version']}  reward {rec['reward']:.3f}  "
        f"eval {last.score:.3f} (warm {warm.score:.3f})  stale {stale}  "
        f"gap {rec['logprob_gap']:.1g}" + (f" route {rec['routing_mismatch']:.1%}"
                                            if rec.get("routing_mismatch") is not None else "")
        + f"  {size}  sync {lat}"
    )


def summarize(metrics: MetricsLog, warm: Evaluation, final: Evaluation, *, rl_seconds: float, last_version: int,
              pinned: int, dropped: Mapping[str, int], rejected: Iterable[int],
              feedback: Mapping[str, int] | None) -> dict[str, Any]:
    """The run in a few figures (the ``summary`` event)."""
    steps = metrics.events("step")
    syncs = metrics.events("sync")
    swaps = metrics.events("swap")
    deltas = [s for s in steps if s["kind"] == "delta"]
    stale: Counter[str] = Counter()
    for s in steps:
        stale.update(s["staleness"])
    return {
        "steps": len(steps),
        "versions": last_version,
        "pinned": pinned,
        "rl_seconds": rl_seconds,
        "warm_start_reward": warm.score,
        "warm_start_exact": warm.exact,
        "warm_start_greedy_reward": warm.greedy_reward,
        "warm_start_greedy_exact": warm.greedy_exact,
        "final_reward": final.score,
        "final_exact": final.exact,
        "final_greedy_reward": final.greedy_reward,
        "final_greedy_exact": final.greedy_exact,
        "logprob_gap_max": max((s["logprob_gap"] for s in steps), default=math.nan),
        "logprob_gap_mean": _mean(s.get("logprob_gap_mean") for s in steps),
        "gap_over_tolerance": sum(s.get("gap_over_tolerance") or 0 for s in steps),
        "mismatch_is_std_mean": _mean(s.get("mismatch_is_std") for s in steps),
        "is_weight_std_mean": _mean(s.get("is_weight_std") for s in steps),
        "routing_mismatch_mean": _mean(s.get("routing_mismatch") for s in steps),
        "rerouted_tokens": sum(s.get("rerouted_tokens") or 0 for s in steps),
        "rerouted_gap_mean": _weighted(steps, "rerouted_gap_mean", "rerouted_tokens"),
        "routing_mismatch_used": (sum(s.get("routing_mismatch_used") or 0 for s in steps)
                                  if any(s.get("routing_mismatch_used") is not None for s in steps) else None),
        "delta_stored_bytes_mean": _mean(s["stored_bytes"] for s in deltas),
        "delta_raw_bytes": deltas[0]["raw_bytes"] if deltas else None,
        "delta_ratio_median": percentile((s["ratio"] for s in deltas), 0.5),
        "sync_latency_p50_s": percentile((s["latency_s"] for s in syncs), 0.5),
        "sync_latency_max_s": max((s["latency_s"] for s in syncs), default=math.nan),
        "serve_latency_p50_s": percentile((s["serve_latency_s"] for s in syncs), 0.5),
        "serve_latency_max_s": max((s["serve_latency_s"] for s in syncs), default=math.nan),
        "pause_p50_s": percentile((s["pause_s"] for s in swaps), 0.5),
        "pause_max_s": max((s["pause_s"] for s in swaps), default=math.nan),
        "staleness": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))),
        "dropped": dict(dropped),
        "swaps": len(swaps),
        "swaps_bit_exact": sum(1 for s in swaps if s["bit_exact"]),
        "swaps_vllm": sum(1 for s in swaps if s.get("digest_of") == "vllm copy"),
        "rejected_versions": sorted(rejected),
        "feedback": dict(feedback) if feedback is not None else None,
    }


def format_summary(s: Mapping[str, Any], *, out_dir: Path, plot_path: Path | None, final_dir: Path) -> list[str]:
    """The run in a few lines, for people."""

    def ms(x: float | None) -> str:
        return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.2f} ms"

    raw = s["delta_raw_bytes"]
    stored = s["delta_stored_bytes_mean"]
    lines = [
        f"reward (held-out, sampled): warm start {s['warm_start_reward']:.3f} -> {s['final_reward']:.3f} after "
        f"{s['steps']} RL steps (exact answers {s['warm_start_exact']:.1%} -> {s['final_exact']:.1%}; "
        f"greedy {s['warm_start_greedy_exact']:.1%} -> {s['final_greedy_exact']:.1%})",
        f"versions: {s['versions']} published, {s['pinned']} pinned"
        + (f", rejected by the gate: {s['rejected_versions']}" if s["rejected_versions"] else "")
        + (f"; a delta stores {human_bytes(stored)} of {human_bytes(raw)} bf16 weights "
           f"(median {s['delta_ratio_median']:.1f}x)" if raw else ""),
        f"sync: publish -> every worker serving p50 {ms(s['sync_latency_p50_s'])} (max {ms(s['sync_latency_max_s'])}), "
        f"of which pinned -> serving p50 {ms(s['serve_latency_p50_s'])}; engine pause p50 {ms(s['pause_p50_s'])} "
        f"(max {ms(s['pause_max_s'])})",
        f"asynchrony: staleness of the batches trained on {s['staleness']}, dropped {s['dropped'] or 'none'}; "
        f"largest trainer-vs-worker log-prob gap {s['logprob_gap_max']:.3g} (mean per token "
        f"{s.get('logprob_gap_mean', math.nan):.3g}; train-inference ratio spread "
        f"{s.get('mismatch_is_std_mean', math.nan):.3g})"
        + (f"; MoE routing differs for {s['routing_mismatch_mean']:.2%} of positions, "
           f"{s['routing_mismatch_used']} routed differently by the trainer; mean gap on the "
           f"{s['rerouted_tokens']} tokens after one {s['rerouted_gap_mean'] or 0:.3g}"
           if s.get("routing_mismatch_mean") is not None and math.isfinite(s["routing_mismatch_mean"]) else ""),
        (f"bit-exact: {s['swaps_bit_exact']}/{s['swaps']} worker swaps served exactly the published bits"
         if not s.get("swaps_vllm") else
         f"bit-exact: {s['swaps_bit_exact']}/{s['swaps']} worker swaps: vLLM reported the version, loaded by deltasync's "
         "backend from a directory copy holding exactly the published bits (vLLM's CPU kernels repack the weights, "
         "so the module itself is not hashed)"),
    ]
    if s.get("feedback"):
        f = s["feedback"]
        lines.append(f"live feedback: {f['received']} received, {f['refused']} refused, "
                     f"{f['batches_expired']} batches trained with feedback missing")
    lines.append(f"wrote {out_dir / 'metrics.jsonl'}" + (f", {plot_path}" if plot_path else "")
                 + f"; {final_dir} is version {s['pinned']} as `deltasync pull` writes it")
    return lines


def eval_dict(ev: Evaluation) -> dict[str, Any]:
    return {"version": ev.version, "reward": ev.score, "exact": ev.exact, "greedy_reward": ev.greedy_reward,
            "greedy_exact": ev.greedy_exact, "seconds": ev.seconds}


def _weighted(steps: list[dict[str, Any]], value: str, weight: str) -> float | None:
    """Mean of ``value`` over the steps, weighted by ``weight`` (None where no step has one)."""
    pairs = [(s[value], s[weight]) for s in steps if s.get(value) is not None and s.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def _mean(values: Any) -> float:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else math.nan
