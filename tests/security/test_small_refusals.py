"""Issue 23, item 6 (three of the smaller ones), each refused with one clear line:

* without torch, ``deltasync demo`` and ``deltasync rl run`` name the extra to install
  instead of printing a traceback;
* a file named ``.deltasync*`` in a checkpoint directory is refused, not silently left out
  of the version (a local copy's own ``.deltasync`` state directory is still skipped);
* a writable relay writes and deletes only the repository layout's names, never e.g.
  ``packs/x.pack.tmp-deltasync`` (a store's temp file, which gc and verify treat as a killed
  writer's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.errors import CheckpointError, DeltasyncError
from deltasync.format.digest import digest
from deltasync.relay.server import RelayServer, build_server
from deltasync.storage import GrpcStore, LocalStore

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)
WRITE = "write-token-for-tests"

# -- (a) without torch, one line naming the extra ---------------------------------------------------

#: Runs ``python -m deltasync ARGS`` in a process where ``import torch`` fails as it does
#: where torch is not installed.
_WITHOUT_TORCH = """
import runpy, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
sys.argv = ["deltasync", *sys.argv[1:]]
runpy.run_module("deltasync", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "args",
    [["demo", "--dir", "demo-out", "--steps", "2"], ["rl", "run", "--out", "rl-out", "--steps", "1"]],
    ids=["demo", "rl-run"],
)
def test_commands_needing_torch_name_the_extra_without_a_traceback(args: list[str], tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "needs torch" in lines[0] and "pip install 'deltasync[torch]'" in lines[0], lines[0]
    assert not (tmp_path / args[2]).exists()  # nothing started


# -- (b) .deltasync* names in a checkpoint directory ------------------------------------------------


@pytest.mark.parametrize(
    "name", [".deltasync-notes.txt", ".deltasync", "extra/.deltasync", "extra/.deltasync.json", ".deltasyncx/a.txt"]
)
def test_a_deltasync_named_entry_in_a_checkpoint_is_refused(name: str, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", make_state(1, LAYOUT))
    (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
    (ckpt / name).write_text("user data\n")
    url = str(tmp_path / "repo")
    first = name.split("/")[-1] if not name.startswith(".deltasyncx/") else ".deltasyncx"
    with pytest.raises(CheckpointError, match=rf"{first.replace('.', '[.]')}.*reserved for deltasync"):
        Publisher(url, CONFIG).publish_dir(ckpt)
    assert not (Path(url) / "manifests").exists() or not os.listdir(Path(url) / "manifests")


def test_the_cli_refuses_it_with_one_line(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", make_state(1, LAYOUT))
    (ckpt / ".deltasync-notes.txt").write_text("user data\n")
    r = subprocess.run([sys.executable, "-m", "deltasync", "publish", str(ckpt), "--repo", str(tmp_path / "repo")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and ".deltasync-notes.txt" in lines[0], r.stderr


def test_a_pulled_copy_still_publishes_without_its_state(tmp_path: Path) -> None:
    """A local copy keeps its state in a top-level ``.deltasync`` directory: publishing the
    copy again publishes its files, not that state."""
    ckpt = write_checkpoint(tmp_path / "ckpt", make_state(1, LAYOUT))
    Publisher(str(tmp_path / "a"), CONFIG).publish_dir(ckpt)
    copy = tmp_path / "copy"
    Subscriber(str(tmp_path / "a")).pull_to_dir(copy)
    assert (copy / ".deltasync").is_dir()
    Publisher(str(tmp_path / "b"), CONFIG).publish_dir(copy)
    assert not any(f.path.startswith(".deltasync") for f in Repository(str(tmp_path / "b")).manifest(1).pb.files)
    Subscriber(str(tmp_path / "b")).pull_to_dir(tmp_path / "again")
    assert tree_digests(tmp_path / "again") == tree_digests(ckpt)


# -- (c) a writable relay writes only the layout's names --------------------------------------------


@pytest.fixture
def writable(tmp_path: Path) -> Iterator[tuple[GrpcStore, RelayServer, LocalStore]]:
    origin = LocalStore(tmp_path / "origin")
    with build_server(origin, "127.0.0.1:0", accept_writes=True, write_token=WRITE) as relay:
        store = GrpcStore(relay.url, write_token=WRITE)
        try:
            yield store, relay, origin
        finally:
            store.close()


PACK = os.urandom(1000)
PACK_KEY = f"packs/{digest(PACK).hex()}.pack"
NOT_LAYOUT = [
    "leases/x",  # leases/ is served (publishes in flight, repo/leases.py), only as leases/<32 hex>.json
    "packs/x.pack.tmp-deltasync",
    f"{PACK_KEY}.tmp-deltasync",
    f"packs/.{digest(PACK).hex()}.pack.tmp-deltasync",
    "packs/conformance/x",
    f"packs/{digest(PACK).hex().upper()}.pack",
    "blobs/abc",
    "manifests/1.pb",
    "manifests/00000000000000000001.pb.tmp-deltasync",
    "squashes/00000000000000000002.pb",
    "refs/x",
    "refs/latest.tmp-deltasync",
]
#: Names beside what a relay serves (it serves no gc state): refused as before.
NOT_SERVED = ["gc/pending.json", "gc/other.json", "deltasync.json.bak"]


@pytest.mark.parametrize("key", NOT_LAYOUT)
def test_a_writable_relay_refuses_names_outside_the_layout(key: str, writable: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    store, _, origin = writable
    with pytest.raises(DeltasyncError, match="not a name of the repository layout") as refused:
        store.put(key, PACK)
    assert "\n" not in str(refused.value)
    assert not (origin.root / key).exists()
    # Nor is such an object (a killed writer's temp file, say) deleted through the relay.
    (origin.root / key).parent.mkdir(parents=True, exist_ok=True)
    (origin.root / key).write_bytes(b"left by someone else")
    with pytest.raises(DeltasyncError, match="not a name of the repository layout"):
        store.delete(key)
    assert (origin.root / key).read_bytes() == b"left by someone else"


def test_a_writable_relay_takes_the_layouts_names(writable: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    store, _, origin = writable
    store.put(PACK_KEY, PACK, if_absent=True)
    for key in ("refs/latest", "refs/pin", "deltasync.json", f"leases/{'e' * 32}.json"):
        store.put(key, b"{}")
        assert origin.get(key) == b"{}"
        store.delete(key)
        assert not origin.exists(key)
    assert origin.get(PACK_KEY) == PACK
    for key in NOT_SERVED:
        with pytest.raises(DeltasyncError, match="not a repository key"):
            store.put(key, b"{}")
        assert not origin.exists(key)
