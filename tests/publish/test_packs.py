"""The Packer (``deltasync.publish.packs``): full packs, early flushes for remote stores, bounds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deltasync.format.digest import digest
from deltasync.publish import packs
from deltasync.publish.packs import EARLY_MIN_BYTES, Packer
from deltasync.storage import LocalStore, MemoryStore, Store, WrappingStore
from deltasync.storage._grpc import GrpcStore
from deltasync.storage._s3 import S3Store
from deltasync.v1 import manifest_pb2 as pb

MiB = 1 << 20


def payloads(n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def add(packer: Packer, part: bytes, tensor: pb.Tensor) -> pb.Chunk:
    """``part`` placed as the next chunk of ``tensor`` (as the encoder does): the chunk says where it is."""
    chunk = tensor.chunks.add(encoding=pb.FULL)
    packer.place(part, chunk)
    return chunk


def pack_all(packer: Packer, parts: list[bytes]) -> list[pb.Chunk]:
    tensor = pb.Tensor(name="t")
    where = [add(packer, p, tensor) for p in parts]
    packer.finish()
    return where


def assert_readable(store: Store, packer: Packer, parts: list[bytes], where: list[pb.Chunk]) -> None:
    """Every pack is stored under the digest of its bytes, and every payload is where its chunk says."""
    for pack in packer.packs:
        data = store.get(pack.key)
        assert pack.key == f"packs/{digest(data).hex()}.pack" and len(data) == pack.size
    for part, chunk in zip(parts, where, strict=True):
        pack = packer.packs[chunk.pack - packer.first_pack]
        assert chunk.length == len(part) and store.get(pack.key, (chunk.offset, chunk.length)) == part
    assert packer.stored == sum(len(p) for p in parts) == sum(p.size for p in packer.packs)
    assert packer.created == {p.key for p in packer.packs}


def test_local_stores_fill_packs_before_uploading(tmp_path: Path) -> None:
    for store in (MemoryStore(), LocalStore(tmp_path / "repo")):
        assert not store.overlap_uploads
        packer = Packer(store, 64 * MiB)
        parts = payloads(12, MiB)
        where = pack_all(packer, parts)
        assert [p.size for p in packer.packs] == [12 * MiB] and packer.early_flushes == 0
        assert_readable(store, packer, parts, where)


def test_remote_stores_overlap_uploads_and_wrappers_say_so(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret")
    writable = GrpcStore("grpc://127.0.0.1:1", write_token_file=token)
    read_only = GrpcStore("grpc://127.0.0.1:1")
    s3 = S3Store("s3://bucket/prefix", endpoint_url="http://127.0.0.1:1", region="us-east-1")  # no request made
    try:
        assert writable.overlap_uploads and not read_only.overlap_uploads and s3.overlap_uploads
        assert WrappingStore(writable).overlap_uploads and Packer(WrappingStore(writable), 64 * MiB).early
        assert not Packer(read_only, 64 * MiB).early
    finally:
        writable.close()
        read_only.close()
        s3.close()


def test_early_flushes_start_uploads_with_a_floor_and_a_bounded_count() -> None:
    store = WrappingStore(MemoryStore())
    store.upload_concurrency = 64  # a stream is always free (else how fast puts end decides, under load)
    packer = Packer(store, 64 * MiB, early=True)
    parts = payloads(41, MiB // 2)  # a 20.5 MiB version in 512 KiB chunks
    where = pack_all(packer, parts)
    sizes = [p.size for p in packer.packs]
    assert packer.early_flushes >= 4 and len(sizes) == packer.early_flushes + 1, sizes
    assert all(s >= EARLY_MIN_BYTES for s in sizes[:-1]), sizes  # no tiny packs
    flushed = 0
    for s in sizes[:-1]:  # each early pack waited for a quarter of what went before
        assert s >= flushed // 4, sizes
        flushed += s
    assert sizes[-1] < max(EARLY_MIN_BYTES, flushed // 4), sizes  # little left when encoding ends
    assert_readable(store, packer, parts, where)


def test_early_flushes_stop_after_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packs, "EARLY_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(packs, "MAX_EARLY_PACKS", 3)
    store = WrappingStore(MemoryStore())
    store.upload_concurrency = 8  # streams to spare: only the cap stops early flushes
    packer = Packer(store, 4 * MiB, early=True)
    parts = payloads(768, 16 << 10)  # 12 MiB in 16 KiB chunks
    where = pack_all(packer, parts)
    assert packer.early_flushes == 3
    assert [p.size for p in packer.packs] == [64 << 10] * 3 + [4 * MiB] * 2 + [12 * MiB - 8 * MiB - (192 << 10)]
    assert_readable(store, packer, parts, where)


class Gate(WrappingStore):
    """Pack puts wait until the gate opens; counts the puts done."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.upload_concurrency = 2
        self.open = threading.Event()
        self.done = 0

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        assert self.open.wait(30)
        self.inner.put(key, data, if_absent=if_absent)
        self.done += 1


def test_no_early_flush_while_every_upload_stream_is_busy() -> None:
    store = Gate(MemoryStore())
    packer = Packer(store, 64 * MiB, early=True)
    parts = payloads(9, MiB)
    tensor = pb.Tensor(name="t")
    where = [add(packer, p, tensor) for p in parts[:2]]  # 2 MiB: the first early pack, uploading
    where += [add(packer, p, tensor) for p in parts[2:4]]  # the second, on the second stream
    assert [p.size for p in packer.packs] == [2 * MiB, 2 * MiB]
    where += [add(packer, p, tensor) for p in parts[4:8]]  # both streams busy: the bytes wait
    assert len(packer.packs) == 2
    store.open.set()
    deadline = time.monotonic() + 30
    while store.done < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    where.append(add(packer, parts[8], tensor))  # a stream is free: what waited goes now
    assert [p.size for p in packer.packs] == [2 * MiB, 2 * MiB, 5 * MiB]
    packer.finish()
    assert_readable(store, packer, parts, where)


def test_a_failed_early_upload_surfaces_and_abandon_removes_the_rest() -> None:
    class Failing(WrappingStore):
        def __init__(self, inner: Store) -> None:
            super().__init__(inner)
            self.puts = 0

        def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
            self.puts += 1
            if self.puts == 2:
                raise OSError("link down")
            self.inner.put(key, data, if_absent=if_absent)

    inner = MemoryStore()
    packer = Packer(Failing(inner), 64 * MiB, early=True)
    with pytest.raises(OSError, match="link down"):
        tensor = pb.Tensor(name="t")
        for p in payloads(16, MiB):
            add(packer, p, tensor)
        packer.finish()
    packer.abandon()
    assert list(inner.list("packs/")) == []


class CountingGate(Gate):
    """A Gate that also counts the pack puts started (uploads in flight while it is shut)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.started = 0

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        self.started += 1
        super()._put(key, data, if_absent)


def test_full_packs_larger_than_the_byte_bound_still_go_two_at_a_time() -> None:
    # A writable relay's byte bound (upload_bytes: 96 MiB per relay) is smaller than two full
    # packs: the next pack must still be on its way behind the one being answered (else the
    # link idles a round trip per pack), and no third goes out beside them.
    store = CountingGate(MemoryStore())
    store.upload_concurrency = 8
    store.upload_bytes = 3 * MiB
    packer = Packer(store, 2 * MiB, early=False)
    parts = payloads(6, MiB)
    where: list[pb.Chunk] = []
    tensor = pb.Tensor(name="t")

    def add_all() -> None:
        where.extend(add(packer, p, tensor) for p in parts)
        packer.finish()

    adder = threading.Thread(target=add_all)
    adder.start()
    deadline = time.monotonic() + 30
    while len(packer.packs) < 3 and time.monotonic() < deadline:  # the third is closed and waits
        time.sleep(0.01)
    time.sleep(0.2)  # had the bound let the third start, its put would have begun by now
    assert store.started == 2 and store.done == 0
    store.open.set()
    adder.join(30)
    assert not adder.is_alive()
    assert_readable(store, packer, parts, where)


def test_the_last_bytes_split_into_packs_for_every_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 30 (two relays sharing a transfer): what is left when encoding ends would go over
    # one relay's link alone; over two it becomes up to 2 x 2 packs of about equal size.
    monkeypatch.setattr(packs, "MAX_EARLY_PACKS", 0)  # everything is left for the finish
    store = WrappingStore(MemoryStore())
    store.upload_targets = 2
    packer = Packer(store, 64 * MiB, early=True, first_pack=3)
    parts = payloads(10, MiB)
    where = pack_all(packer, parts)
    assert [p.size for p in packer.packs] == [3 * MiB, 2 * MiB, 3 * MiB, 2 * MiB]
    assert [c.pack for c in where] == [3, 3, 3, 4, 4, 5, 5, 5, 6, 6]
    assert_readable(store, packer, parts, where)


def test_packs_over_several_relays_close_at_16_mib() -> None:
    store = WrappingStore(MemoryStore())
    store.upload_targets = 2
    packer = Packer(store, 64 * MiB, early=False)
    parts = payloads(40, MiB)
    where = pack_all(packer, parts)
    assert [p.size for p in packer.packs] == [16 * MiB, 16 * MiB, 8 * MiB]
    assert_readable(store, packer, parts, where)
    assert Packer(MemoryStore(), 64 * MiB).pack_bytes == 64 * MiB  # one link: as configured


def test_the_last_bytes_stay_one_pack_where_splitting_gains_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packs, "MAX_EARLY_PACKS", 0)
    for targets, early, n, size, want in (
        (1, True, 10, MiB, 1),  # one relay (or any other store): one link either way
        (2, False, 10, MiB, 1),  # packs filled before upload (a local store)
        (2, True, 3, MiB, 1),  # 3 MiB: no two parts of EARLY_MIN_BYTES
        (4, True, 3, 2 * MiB, 3),  # fewer payloads than relays x 2: one pack each
    ):
        store = WrappingStore(MemoryStore())
        store.upload_targets = targets
        packer = Packer(store, 64 * MiB, early=early)
        parts = payloads(n, size)
        where = pack_all(packer, parts)
        assert len(packer.packs) == want, (targets, early, n, [p.size for p in packer.packs])
        assert_readable(store, packer, parts, where)


def test_stores_say_how_many_relays_their_uploads_spread_over(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret")
    two = GrpcStore("grpc://127.0.0.1:1,127.0.0.1:2", write_token_file=token)
    read_only = GrpcStore("grpc://127.0.0.1:1,127.0.0.1:2")
    try:
        assert two.upload_targets == 2 and WrappingStore(two).upload_targets == 2
        assert read_only.upload_targets == 1 and MemoryStore().upload_targets == 1
    finally:
        two.close()
        read_only.close()
