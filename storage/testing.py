"""The store conformance suite. Every Store implementation runs it:

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self) -> Iterator[Store]:
            yield MyStore(...)

Read-only stores (``grpc://`` through a relay) run the same assertions through
:class:`ReadOnlyStoreConformance`: the suite writes to the store they serve and reads
through them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from ..errors import (
    CorruptObjectError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    UsageError,
)
from ._base import Store, WrappingStore


class StoreConformance:
    """Behaviour every Store must have. Subclasses provide a ``store`` fixture."""

    def test_put_get_roundtrip(self, store: Store) -> None:
        store.put("a/b/c.bin", b"hello world")
        assert store.get("a/b/c.bin") == b"hello world"
        assert store.size("a/b/c.bin") == 11
        assert store.exists("a/b/c.bin")

    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.size("empty") == 0

    def test_binary_and_large(self, store: Store) -> None:
        data = bytes(range(256)) * 40_000  # ~10 MiB
        store.put("big/object", data)
        assert store.get("big/object") == data

    def test_byte_range(self, store: Store) -> None:
        store.put("r", b"0123456789")
        assert store.get("r", (0, 3)) == b"012"
        assert store.get("r", (7, 3)) == b"789"
        assert store.get("r", (4, 0)) == b""

    def test_byte_range_past_end(self, store: Store) -> None:
        store.put("r", b"0123456789")
        with pytest.raises(CorruptObjectError):
            store.get("r", (8, 5))

    def test_negative_range_rejected(self, store: Store) -> None:
        store.put("r", b"0123")
        with pytest.raises(UsageError):
            store.get("r", (-1, 2))

    def test_max_bytes_refuses_larger_objects(self, store: Store) -> None:
        store.put("capped/obj", b"x" * 1000)
        assert store.get("capped/obj", max_bytes=1000) == b"x" * 1000
        with pytest.raises(ObjectTooLargeError) as info:
            store.get("capped/obj", max_bytes=999)
        assert "capped/obj" in str(info.value) and info.value.limit == 999
        assert store.get("capped/obj", (10, 5), max_bytes=5) == b"xxxxx"
        with pytest.raises(ObjectTooLargeError):
            store.get("capped/obj", (10, 6), max_bytes=5)
        with pytest.raises(ObjectNotFoundError):
            store.get("capped/missing", max_bytes=10)

    def test_max_bytes_reaches_through_wrappers(self, store: Store) -> None:
        """A wrapper that knows nothing of limits (its own ``_get``) still passes them on."""

        class Plain(WrappingStore):
            def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
                return self.inner.get(key, byte_range)

        store.put("capped/wrapped", b"y" * 64)
        wrapped = Plain(store)
        assert wrapped.get("capped/wrapped", max_bytes=64) == b"y" * 64
        with pytest.raises(ObjectTooLargeError):
            wrapped.get("capped/wrapped", max_bytes=63)

    def test_huge_ranges_are_refused_without_reading(self, store: Store) -> None:
        store.put("r", b"0123456789")
        for byte_range in [(0, 1 << 40), (1 << 62, 1), (5, (1 << 63) - 1)]:
            with pytest.raises(CorruptObjectError):
                store.get("r", byte_range)
        with pytest.raises(UsageError):
            store.get("r", (1 << 63, 1))

    def test_missing(self, store: Store) -> None:
        with pytest.raises(ObjectNotFoundError) as info:
            store.get("nope/missing")
        assert info.value.key == "nope/missing"
        with pytest.raises(ObjectNotFoundError):
            store.get("nope/missing", (0, 1))
        with pytest.raises(ObjectNotFoundError):
            store.size("nope/missing")
        assert not store.exists("nope/missing")

    def test_overwrite(self, store: Store) -> None:
        store.put("k", b"one")
        store.put("k", b"two")
        assert store.get("k") == b"two"

    def test_if_absent(self, store: Store) -> None:
        store.put("commit", b"first", if_absent=True)
        with pytest.raises(ObjectExistsError):
            store.put("commit", b"second", if_absent=True)
        assert store.get("commit") == b"first"

    def test_if_absent_race_exactly_one_wins(self, store: Store) -> None:
        winners, losers = race_if_absent([store] * 8, "race/key", [f"writer-{i}".encode() for i in range(8)])
        assert len(winners) == 1
        assert len(losers) == 7
        assert store.get("race/key") == f"writer-{winners[0]}".encode()

    def test_list_prefix_sorted(self, store: Store) -> None:
        for key in ["p/b", "p/a", "p/sub/c", "q/x", "pa"]:
            store.put(key, b"x")
        assert list(store.list("p/")) == ["p/a", "p/b", "p/sub/c"]
        assert list(store.list("p/s")) == ["p/sub/c"]
        assert list(store.list("zzz/")) == []
        everything = list(store.list(""))
        assert everything == sorted(everything)
        assert {"p/a", "p/b", "p/sub/c", "q/x", "pa"} <= set(everything)

    def test_total_bytes(self, store: Store) -> None:
        store.put("t/a", b"x" * 10)
        store.put("t/sub/b", b"y" * 5)
        store.put("t/empty", b"")
        store.put("tz", b"z" * 7)
        assert store.total_bytes("t/") == 15
        assert store.total_bytes("t/sub/") == 5
        assert store.total_bytes("nothing/") == 0
        assert store.total_bytes() >= 22
        store.put("t/a", b"x")  # an overwrite counts its new size
        assert store.total_bytes("t/") == 6

    def test_delete(self, store: Store) -> None:
        store.put("d/x", b"1")
        store.delete("d/x")
        assert not store.exists("d/x")
        assert list(store.list("d/")) == []
        store.delete("d/x")  # absent: not an error

    @pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "a/../b", "a/./b", "sp ace", "a/", "é"])
    def test_bad_keys_rejected(self, store: Store, key: str) -> None:
        with pytest.raises(UsageError):
            store.put(key, b"x")
        with pytest.raises(UsageError):
            store.get(key)

    def test_concurrent_readers_and_writer(self, store: Store) -> None:
        payloads = {f"c/{i:03d}": bytes([i]) * (1000 + i) for i in range(50)}
        errors: list[BaseException] = []

        def writer() -> None:
            for key, data in payloads.items():
                store.put(key, data)

        def reader() -> None:
            try:
                for key in store.list("c/"):
                    data = store.get(key)
                    assert data == payloads[key]  # never a partial object
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        run_threads([writer, reader, reader])
        assert not errors
        assert len(list(store.list("c/"))) == 50


def run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def race_if_absent(stores: Sequence[Store], key: str, values: Sequence[bytes]) -> tuple[list[int], list[int]]:
    """Writer i puts ``values[i]`` at ``key`` through ``stores[i]`` with ``if_absent``, all at
    once (a barrier); returns (winners, losers) by index."""
    winners: list[int] = []
    losers: list[int] = []
    barrier = threading.Barrier(len(stores))

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            stores[i].put(key, values[i], if_absent=True)
            winners.append(i)
        except ObjectExistsError:
            losers.append(i)

    run_threads([functools.partial(attempt, i) for i in range(len(stores))])
    return winners, losers


class ReadOnlyStoreConformance(StoreConformance):
    """The suite for a read-only store: writes go to ``backend``, the store it serves, and
    every read goes through ``reader``. Subclasses provide both fixtures:

        class TestGrpcStore(ReadOnlyStoreConformance):
            @pytest.fixture
            def backend(self, tmp_path: Path) -> Iterator[Store]:
                yield LocalStore(tmp_path / "repo")

            @pytest.fixture
            def reader(self, backend: Store) -> Iterator[Store]:
                ...  # serve backend; yield a store reading it
    """

    #: Where the suite's objects live in ``backend``. A relay serves only a repository's
    #: layout, and ``refs/`` is the part of it that is mutable and never cached, as the
    #: suite's overwrites need.
    root = "refs/conformance/"

    @pytest.fixture
    def store(self, backend: Store, reader: Store) -> Iterator[Store]:
        yield WriteThrough(backend, reader, self.root)


class WriteThrough(Store):
    """Writes to ``backend``, reads through ``reader`` (which serves ``backend``); every key
    is ``root`` + the key the suite names."""

    def __init__(self, backend: Store, reader: Store, root: str = "") -> None:
        self.backend = backend
        self.reader = reader
        self.root = root
        self.url = reader.url

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        try:
            return self.reader.get(self.root + key, byte_range)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(key) from None  # the key the suite named

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        self.backend.put(self.root + key, data, if_absent=if_absent)

    def _list(self, prefix: str) -> Iterator[str]:
        return iter([key[len(self.root) :] for key in self.reader.list(self.root + prefix)])

    def _delete(self, key: str) -> None:
        self.backend.delete(self.root + key)

    def _size(self, key: str) -> int:
        try:
            return self.reader.size(self.root + key)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(key) from None
