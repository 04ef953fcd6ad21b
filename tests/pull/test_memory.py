"""Bounded memory (DESIGN.md invariant 4): publishing and pulling a checkpoint much larger
than the memory they may use.

A child process publishes a ~1.5 GiB bf16 checkpoint (six 256 MiB shards) as a snapshot,
then the next step (~1% of elements changed) as a delta diffed against a cache directory
on disk, then pulls the latest version into a fresh directory. It reports its resident
set (VmRSS after imports, VmHWM per phase); the growth must stay far below the size of the
checkpoint. Files are read and written with pread/pwrite, so the page cache they fill is
not counted as the process's RSS.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import sha256_file, write_big_safetensors

MiB = 1 << 20
SHARDS = 6
TENSORS_PER_SHARD = 4
SHAPE = (8192, 4096)  # bf16: 64 MiB per tensor, 256 MiB per shard, 1.5 GiB in all
CHECKPOINT_BYTES = SHARDS * TENSORS_PER_SHARD * SHAPE[0] * SHAPE[1] * 2
MAX_GROWTH = 600 * MiB

CHILD = r"""
import json, os, sys, time
from pathlib import Path

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Subscriber


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak():
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


tmp = Path(sys.argv[1])
repo = str(tmp / "repo")
cache = tmp / "cache"
config = PublisherConfig(codec=PlanesZstdCodec(), workers=2, progress=False)
report = {"baseline_rss": status("VmRSS"), "phases": {}}
resettable = reset_peak()
report["resettable"] = resettable
for phase, action in [
    ("publish_snapshot", lambda: Publisher(repo, config).publish_dir(tmp / "v1", cache_dir=cache)),
    ("publish_delta", lambda: Publisher(repo, config).publish_dir(tmp / "v2", cache_dir=cache)),
    ("pull", lambda: Subscriber(repo, workers=2, progress=False).pull_to_dir(tmp / "out")),
]:
    start = time.monotonic()
    action()
    report["phases"][phase] = {"peak_rss": status("VmHWM"), "seconds": round(time.monotonic() - start, 2)}
    reset_peak()
report["final_rss"] = status("VmRSS")
print(json.dumps(report))
"""


def _write_checkpoint(root: Path, *, change_fraction: float) -> None:
    weight_map: dict[str, str] = {}
    for s in range(SHARDS):
        fname = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        names = [f"model.layers.{s * TENSORS_PER_SHARD + i}.mlp.weight" for i in range(TENSORS_PER_SHARD)]
        write_big_safetensors(root / fname, [(n, SHAPE) for n in names], seed=s, change_fraction=change_fraction)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": CHECKPOINT_BYTES}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (root / "config.json").write_text(json.dumps({"hidden_size": SHAPE[1]}) + "\n")


@pytest.mark.slow
def test_publish_and_pull_in_bounded_memory(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "v1", change_fraction=0.0)
    _write_checkpoint(tmp_path / "v2", change_fraction=0.01)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    children_max_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux

    baseline = report["baseline_rss"]
    lines = [f"baseline after imports {baseline / MiB:.0f} MiB; checkpoint {CHECKPOINT_BYTES / MiB:.0f} MiB"]
    peak = 0
    for phase, r in report["phases"].items():
        lines.append(f"{phase}: peak {r['peak_rss'] / MiB:.0f} MiB "
                     f"(+{(r['peak_rss'] - baseline) / MiB:.0f} MiB), {r['seconds']}s")
        peak = max(peak, r["peak_rss"])
    lines.append(f"getrusage(RUSAGE_CHILDREN).ru_maxrss {children_max_rss / MiB:.0f} MiB")
    print("\n".join(lines))  # shown with -s / -rA: the numbers behind the bound
    assert peak - baseline < MAX_GROWTH, "\n".join(lines)
    assert peak - baseline < CHECKPOINT_BYTES / 2.5

    # The pulled copy is the second checkpoint, byte for byte.
    for src in sorted((tmp_path / "v2").iterdir()):
        assert sha256_file(tmp_path / "out" / src.name) == sha256_file(src), src.name
