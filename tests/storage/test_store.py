from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.errors import UsageError
from deltasync.storage import LocalStore, MemoryStore, Store, ThrottledStore, open_store
from deltasync.storage.testing import StoreConformance


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        yield LocalStore(tmp_path / "repo")

    def test_no_temp_files_left(self, store: Store) -> None:
        assert isinstance(store, LocalStore)
        store.put("a/b", b"x")
        store.put("a/b", b"y")
        leftovers = [p for p in store.root.rglob("*") if p.is_file() and p.name != "b"]
        assert leftovers == []


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        yield MemoryStore()


def test_open_store_by_url(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    local = open_store(f"file://{tmp_path}")
    assert isinstance(local, LocalStore)
    assert local.root == tmp_path
    a = open_store("memory://shared-name")
    assert a is open_store("memory://shared-name")
    with pytest.raises(UsageError, match="unsupported repository URL"):
        open_store("ftp://host/x")


class TestThrottledStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        yield ThrottledStore(MemoryStore(), 1e9)


def test_throttle_limits_read_bandwidth() -> None:
    import time

    inner = MemoryStore()
    inner.put("x", b"a" * 200_000)
    store = ThrottledStore(inner, 1_000_000)  # 1 MB/s: 4 reads of 200 kB take >= 0.6 s after the first
    start = time.monotonic()
    for _ in range(4):
        assert store.get("x") == b"a" * 200_000
    assert time.monotonic() - start >= 0.6
    assert store.bytes_read == 800_000 and store.requests == 4
