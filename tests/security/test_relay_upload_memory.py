"""Issue 23, item 5: a writable relay's upload memory is bounded by --max-uploads, not by
how many uploaders wait for a slot.

A real relay (``deltasync serve`` in a subprocess, on 127.0.0.1) takes concurrent 15 MiB pack
uploads from real gRPC clients, each on its own connection; the relay's anonymous memory
(RssAnon, sampled while the uploads run: spooled uploads are file mappings, page cache, not
counted) must grow with ``max_uploads``, not with the number of uploaders. Before the fix
every stream waiting for a slot had megabytes parked in grpc's receive buffers (BDP-grown
flow-control windows): 2 slots, 16 uploaders grew it by about 90 MiB, 2 uploaders by 15.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deltasync.format.digest import digest
from deltasync.v1 import relay_pb2 as pb

pytestmark = pytest.mark.slow

MIB = 1 << 20
OBJECT_BYTES = 15 * MIB
MAX_UPLOADS = 2
TOKEN = "w" * 32


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class _Relay:
    def __init__(self, tmp: Path) -> None:
        (tmp / "repo").mkdir()
        (tmp / "token").write_text(TOKEN)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deltasync", "serve", "--repo", str(tmp / "repo"), "--listen", "127.0.0.1:0",
             "--cache", str(tmp / "cache"), "--accept-writes", "--write-token-file", str(tmp / "token"),
             "--max-uploads", str(MAX_UPLOADS)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert found, f"relay did not start: {line!r}"
        self.address = f"127.0.0.1:{found.group(1)}"
        self.root = tmp / "repo"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[_Relay]:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to read a process's memory")
    r = _Relay(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _upload(address: str, data: bytes, errors: list[str]) -> None:
    # A connection of its own per uploader (no shared subchannel), as separate publishers have.
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    put = channel.stream_unary(
        "/deltasync.v1.Relay/Put",
        request_serializer=pb.PutChunk.SerializeToString,
        response_deserializer=pb.PutResponse.FromString,
    )
    announced = digest(data)
    key = f"packs/{announced.hex()}.pack"

    def pieces() -> Iterator[pb.PutChunk]:
        yield pb.PutChunk(key=key, total_bytes=len(data), digest=announced, data=data[:MIB])
        for offset in range(MIB, len(data), MIB):
            yield pb.PutChunk(data=data[offset : offset + MIB])

    try:
        put(pieces(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=120)
    except grpc.RpcError as e:
        errors.append(f"{e.code()}: {e.details()}")
    finally:
        channel.close()


def _peak_growth(relay: _Relay, uploaders: int, seed: int) -> int:
    """Peak RssAnon growth of the relay while ``uploaders`` upload at once."""
    base = os.urandom(OBJECT_BYTES)
    objects = [base[:-8] + (seed * 1000 + i).to_bytes(8, "little") for i in range(uploaders)]
    start = _status(relay.proc.pid, "RssAnon")
    peak = start
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _status(relay.proc.pid, "RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    errors: list[str] = []
    threads = [threading.Thread(target=_upload, args=(relay.address, o, errors)) for o in objects]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    assert not errors, errors
    assert len(list((relay.root / "packs").iterdir())) >= uploaders  # all of them landed
    return peak - start


def test_waiting_uploaders_do_not_grow_the_relays_memory(relay: _Relay) -> None:
    _peak_growth(relay, 1, seed=0)  # warm up: grpc's and the allocator's own first-use costs
    few = _peak_growth(relay, MAX_UPLOADS, seed=1)
    many = _peak_growth(relay, 8 * MAX_UPLOADS, seed=2)
    # Per upload slot: one 4 MiB in-memory upload or the 1 MiB pieces of a spooled one, grpc's
    # copies of them and allocator slack; per waiting uploader, a 64 KiB window.
    bound = MAX_UPLOADS * 12 * MIB + 16 * MIB
    assert many <= bound, f"{8 * MAX_UPLOADS} uploaders grew the relay by {many / MIB:.0f} MiB (bound {bound / MIB:.0f})"
    assert many <= few + 24 * MIB, (
        f"{8 * MAX_UPLOADS} uploaders grew the relay by {many / MIB:.0f} MiB, {MAX_UPLOADS} by {few / MIB:.0f} MiB"
    )
