"""PNG of a run: reward and sync figures over versions (matplotlib, ``deltasync[rl]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt


def _legend_below(ax: Any, extra: Any = None) -> None:
    """The axes' legend under its x label, outside the plotting area: it never hides a curve."""
    handles, labels = ax.get_legend_handles_labels()
    if extra is not None:
        more_handles, more_labels = extra.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def plot_metrics(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Six panels over versions: reward; bytes stored per version and compression ratio;
    time from publish to every worker serving it; engine pause per swap; the trainer-vs-worker
    log-prob gap; importance-weight spread and (MoE) routing mismatch."""
    fig = draw_metrics(records)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw_metrics(records: list[dict[str, Any]]) -> Any:
    """The figure :func:`plot_metrics` saves (a matplotlib Figure; the caller closes it)."""
    steps = [r for r in records if r["event"] == "step"]
    syncs = [r for r in records if r["event"] == "sync"]
    swaps = [r for r in records if r["event"] == "swap"]
    warm = next((r for r in records if r["event"] == "warm_start"), None)
    summary = next((r for r in records if r["event"] == "summary"), None)

    fig, axes = plt.subplots(3, 2, figsize=(12, 13), constrained_layout=True)
    ax_r, ax_b, ax_l, ax_p = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    draw_numerics(axes[2, 0], axes[2, 1], steps)

    versions = [s["version"] for s in steps]
    ax_r.plot(versions, [s["reward"] for s in steps], color="0.7", lw=1, label="training batch reward")
    ax_r.plot(versions, [s["eval"]["reward"] for s in steps], color="tab:blue", lw=2, label="held-out reward (gate)")
    ax_r.plot(versions, [s["eval"]["exact"] for s in steps], color="tab:green", lw=1.5, label="held-out exact answers")
    if warm is not None:
        ax_r.axhline(warm["eval"]["reward"], color="tab:blue", ls="--", lw=1, label="warm-start reward")
        ax_r.axhline(warm["eval"]["exact"], color="tab:green", ls="--", lw=1, label="warm-start exact")
        if warm.get("teacher_reward") is not None:
            ax_r.axhline(warm["teacher_reward"], color="0.3", ls=":", lw=1, label="teacher the warm start imitates")
    rejected = [s for s in steps if not s["gate_passed"]]
    if rejected:
        ax_r.scatter([s["version"] for s in rejected], [s["eval"]["reward"] for s in rejected], marker="x",
                     color="tab:red", s=60, zorder=5, label="rejected by the gate")
    ax_r.set(title="Reward", xlabel="version", ylabel="reward (partial credit)")
    _legend_below(ax_r)
    ax_r.grid(alpha=0.3)

    deltas = [s for s in steps if s["kind"] == "delta"]
    snapshots = [s["version"] for s in steps if s["kind"] != "delta"]
    note = f" (snapshots {', '.join(map(str, snapshots))} not shown)" if snapshots else ""
    ax_b.bar([s["version"] for s in deltas], [s["stored_bytes"] / 1024 for s in deltas], color="tab:orange", width=0.9,
             label=f"stored per delta version{note}")
    ax_b.set(title="Bytes shipped per version", xlabel="version", ylabel="KiB")
    if deltas:
        raw = deltas[0]["raw_bytes"] / 1024
        ax_b.axhline(raw, color="0.4", ls="--", lw=1, label=f"full bf16 weights ({raw:.0f} KiB)")
        ax2 = ax_b.twinx()
        ax2.plot([s["version"] for s in deltas], [s["ratio"] for s in deltas], color="tab:purple", lw=1.5,
                 label="compression ratio (right axis)")
        ax2.set_ylabel("compression ratio (raw / stored)", color="tab:purple")
        ax2.set_ylim(bottom=0)
        _legend_below(ax_b, extra=ax2)
    else:
        _legend_below(ax_b)
    ax_b.grid(alpha=0.3)

    ax_l.plot([s["version"] for s in syncs], [s["latency_s"] * 1e3 for s in syncs], ".-", color="tab:cyan", lw=1,
              label="publish → every worker serving (incl. gate)")
    ax_l.plot([s["version"] for s in syncs], [s["serve_latency_s"] * 1e3 for s in syncs], ".-", color="tab:brown", lw=1,
              label="pinned → every worker serving")
    ax_l.set(title="Time until every worker serves a version", xlabel="version", ylabel="ms")
    _legend_below(ax_l)
    ax_l.set_ylim(bottom=0)
    ax_l.grid(alpha=0.3)

    workers = sorted({s["worker"] for s in swaps})
    for w in workers:
        mine = [s for s in swaps if s["worker"] == w]
        ax_p.plot([s["version"] for s in mine], [s["pause_s"] * 1e3 for s in mine], ".", ms=4, label=f"worker {w}")
    ax_p.set(title="Engine pause per swap (serving lock held for the write)", xlabel="version", ylabel="ms")
    ax_p.set_ylim(bottom=0)
    if workers:
        _legend_below(ax_p)
    ax_p.grid(alpha=0.3)

    if summary is not None:
        fig.suptitle(
            f"deltasync RL: held-out reward {summary['warm_start_reward']:.3f} -> "
            f"{summary['final_reward']:.3f} in {summary['steps']} steps; "
            f"{summary['swaps_bit_exact']}/{summary['swaps']} swaps bit-exact; "
            f"max log-prob gap {summary['logprob_gap_max']:.1g}",
            fontsize=11,
        )
    return fig


def draw_numerics(ax_g: Any, ax_m: Any, steps: list[dict[str, Any]], label: str = "") -> None:
    """Train-inference numerics per step: the log-prob gap (mean and max per token), and the
    importance-weight spread with, for MoE policies, the fraction of positions routed to other experts."""
    versions = [s["version"] for s in steps]
    pre = f"{label}: " if label else ""
    ax_g.plot(versions, [s.get("logprob_gap_mean", 0.0) for s in steps], lw=1.5, label=f"{pre}mean |gap| per token")
    ax_g.plot(versions, [s["logprob_gap"] for s in steps], lw=1, ls="--", label=f"{pre}max |gap|")
    ax_g.set(title="Log-prob gap, trainer vs worker (same version)", xlabel="version", ylabel="nats")
    ax_g.set_ylim(bottom=0)
    _legend_below(ax_g)
    ax_g.grid(alpha=0.3)
    ax_m.plot(versions, [s.get("mismatch_is_std", 0.0) for s in steps], lw=1.5,
              label=f"{pre}std of exp(trainer - behaviour)")
    ax_m.plot(versions, [s.get("is_weight_std", 0.0) for s in steps], lw=1, ls=":",
              label=f"{pre}std of the importance weight")
    routed = [s for s in steps if s.get("routing_mismatch") is not None]
    if routed:
        ax_m.plot([s["version"] for s in routed], [s["routing_mismatch"] for s in routed], lw=1.5, ls="--",
                  label=f"{pre}positions routed to other experts (fraction)")
    ax_m.set(title="Importance-weight spread and routing mismatch", xlabel="version")
    ax_m.set_ylim(bottom=0)
    _legend_below(ax_m)
    ax_m.grid(alpha=0.3)


def plot_compare(runs: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Several runs on one figure (e.g. router replay on and off), one color per run: held-out
    and training reward; the log-prob gap (mean and max per token); the spread of the
    train-inference ratio; and, for MoE runs, the positions the trainer's own router sends to
    other experts and those its forward actually routed differently (0 with replay)."""
    fig, axes = plt.subplots(3, 2, figsize=(12, 13), constrained_layout=True)
    (ax_r, ax_t), (ax_gm, ax_gx), (ax_s, ax_m) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        steps = [r for r in records if r["event"] == "step"]
        v = [s["version"] for s in steps]
        ax_r.plot(v, [s["eval"]["reward"] for s in steps], color=c, lw=2, label=f"{label}: held-out reward")
        warm = next((r for r in records if r["event"] == "warm_start"), None)
        if warm is not None:
            ax_r.axhline(warm["eval"]["reward"], color=c, ls="--", lw=1, label=f"{label}: warm start")
        ax_t.plot(v, [s["reward"] for s in steps], color=c, lw=1, label=f"{label}: training batch reward")
        ax_gm.plot(v, [s.get("logprob_gap_mean", 0.0) for s in steps], color=c, lw=1.5, label=label)
        ax_gx.plot(v, [s["logprob_gap"] for s in steps], color=c, lw=1, label=label)
        ax_s.plot(v, [s.get("mismatch_is_std", 0.0) for s in steps], color=c, lw=1.5,
                  label=f"{label}: std of exp(trainer - behaviour)")
        routed = [s for s in steps if s.get("routing_mismatch") is not None]
        if routed:
            rv = [s["version"] for s in routed]
            ax_m.plot(rv, [100 * s["routing_mismatch"] for s in routed], color=c, lw=1.5,
                      label=f"{label}: own router picks other experts")
            ax_m.plot(rv, [100 * s["routing_mismatch_used"] / max(s["routing_positions"] or 1, 1) for s in routed],
                      color=c, lw=1, ls=":", label=f"{label}: routed differently by the trainer's forward")
    ax_r.set(title="Held-out reward (gate)", xlabel="version", ylabel="reward (partial credit)")
    ax_t.set(title="Training batch reward", xlabel="version", ylabel="reward (partial credit)")
    ax_gm.set(title="Mean |log-prob gap| per token, trainer vs worker", xlabel="version", ylabel="nats")
    ax_gx.set(title="Max |log-prob gap| per step", xlabel="version", ylabel="nats")
    ax_s.set(title="Spread of the train-inference ratio", xlabel="version")
    ax_m.set(title="MoE routing mismatch", xlabel="version", ylabel="% of positions")
    for ax in (ax_r, ax_t, ax_gm, ax_gx, ax_s, ax_m):
        if ax is not ax_r and ax is not ax_t:
            ax.set_ylim(bottom=0)
        _legend_below(ax)
        ax.grid(alpha=0.3)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
