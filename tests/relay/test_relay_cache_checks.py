"""The relay's cache keeps only what its names promise, and never stops serving for a full
disk (issue 33 items 4 and 5)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ckpt_helpers import make_state, write_checkpoint

from deltasync import Publisher, Subscriber
from deltasync.errors import CorruptObjectError
from deltasync.relay import build_server
from deltasync.relay.cache import DEFAULT_DISK_SHARE, ObjectCache
from deltasync.storage import Store, WrappingStore, open_store


class _FlakyOnce(WrappingStore):
    """The upstream as a flaky link delivers it: the first read of each named key comes back damaged."""

    def __init__(self, inner: Store, damage: dict[str, bytes]) -> None:
        super().__init__(inner)
        self.damage = dict(damage)  # key -> what its first read returns

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        bad = self.damage.pop(key, None)
        return bad if bad is not None else self.inner.get(key, byte_range)


def _repo(tmp: Path) -> str:
    url = str(tmp / "repo")
    Publisher(url).publish_dir(write_checkpoint(tmp / "ckpt", make_state(0)), snapshots=True)
    return url


def test_a_transiently_corrupt_manifest_or_blob_is_not_cached(tmp_path: Path) -> None:
    url = _repo(tmp_path)
    store = open_store(url)
    manifest = next(iter(store.list("manifests/")))
    blob = next(iter(store.list("blobs/")))
    good_m, good_b = store.get(manifest), store.get(blob)
    def flip(data: bytes) -> bytes:
        out = bytearray(data)
        out[len(out) // 2] ^= 0x10
        return bytes(out)

    damage = {manifest: flip(good_m), blob: flip(good_b)}
    upstream = _FlakyOnce(store, damage)
    cache = ObjectCache(tmp_path / "cache", max_bytes=1 << 30)
    for key, good in ((manifest, good_m), (blob, good_b)):
        with pytest.raises(CorruptObjectError, match="upstream's bytes are not that object"):
            cache.fetch(key, upstream)
        assert cache.lookup(key) is None
        entry = cache.fetch(key, upstream)  # the link is fine again
        assert entry.path.read_bytes() == good
    cache.close()


def test_a_damaged_cached_object_is_dropped_and_fetched_again_across_restarts(tmp_path: Path) -> None:
    url = _repo(tmp_path)
    cache_dir = tmp_path / "cache"
    relay = build_server(url, "127.0.0.1:0", cache_dir, warm=False).start()
    try:
        Subscriber(relay.url, progress=False).update_dir(tmp_path / "first")
    finally:
        relay.stop()
    # Damage every cached manifest and blob (as an older relay that cached them unchecked
    # could have, or the disk under it).
    cache = ObjectCache(cache_dir)
    damaged = [k for k in open_store(url).list() if k.startswith(("manifests/", "blobs/"))]
    for key in damaged:
        entry = cache.lookup(key)
        assert entry is not None, key
        entry.path.write_bytes(entry.path.read_bytes()[:-1] + b"\0")
    cache.close()
    relay = build_server(url, "127.0.0.1:0", cache_dir, warm=False).start()
    try:
        Subscriber(relay.url, progress=False).update_dir(tmp_path / "second")
        assert relay.metrics()["upstream_fetches"] >= len(damaged)
    finally:
        relay.stop()


def test_the_default_limit_is_a_share_of_the_free_disk(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path / "cache")
    free = shutil.disk_usage(tmp_path).free
    assert cache.max_bytes is not None and abs(cache.max_bytes - free * DEFAULT_DISK_SHARE) < 0.05 * free
    assert "free disk space" in cache.limit_note
    cache.close()


_FULL_DISK = textwrap.dedent('''
    import os, subprocess, sys
    from pathlib import Path
    disk = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], check=True)
    from deltasync import Subscriber
    from deltasync.relay import build_server
    from deltasync.relay.cache import CacheFullError, ObjectCache
    from deltasync.storage import LocalStore
    from deltasync.format.digest import digest
    upstream = LocalStore(sys.argv[2])
    keys = []
    for i in range(12):  # 12 MiB of 1 MiB packs onto a 6 MiB disk, the limit far above it
        data = os.urandom(1 << 20)
        keys.append(f"packs/{digest(data).hex()}.pack")
        upstream.put(keys[-1], data)
    cache = ObjectCache(disk / "c1", max_bytes=1 << 40)
    for key in keys:
        cache.fetch(key, upstream)
    print("evictions", cache.evictions)
    data = os.urandom(8 << 20)
    upstream.put(f"packs/{digest(data).hex()}.pack", data)
    try:
        cache.fetch(f"packs/{digest(data).hex()}.pack", upstream)
    except CacheFullError:
        print("cache full")
    cache.close()
    relay = build_server(sys.argv[3], "127.0.0.1:0", disk / "c2", warm=False).start()
    try:
        Subscriber(relay.url, progress=False).update_dir(sys.argv[4])
        print("pulled, passed through", relay.metrics().get("passed_through", 0))
    finally:
        relay.stop()
''')


def test_a_full_disk_evicts_and_passes_through(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -Urm) for a small tmpfs")
    import torch

    big = {"w": torch.randn(2048, 1536)}  # 12 MiB of float32: a pack larger than the 6 MiB disk
    url = str(tmp_path / "repo")
    Publisher(url).publish(big)
    (tmp_path / "disk").mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    r = subprocess.run(["unshare", "-Urm", sys.executable, str(script), str(tmp_path / "disk"), str(tmp_path / "up"),
                        url, str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**os.environ})
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert int(lines["evictions"]) > 0, r.stdout
    assert "cache full" in r.stdout, r.stdout
    assert "pulled, passed through" in r.stdout and not r.stdout.rstrip().endswith(" 0"), r.stdout
