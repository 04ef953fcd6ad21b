"""One table of errors and status codes (storage/wire.py STATUS_CODES), read both ways: the
relay ends a call with the code of its error, the grpc:// store raises that error back."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from deltasync.errors import (
    CorruptObjectError,
    DeltasyncError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRangeError,
    ObjectTooLargeError,
    StoreError,
    UsageError,
)
from deltasync.format.digest import digest
from deltasync.relay import build_server
from deltasync.repo.repository import LATEST
from deltasync.storage import GrpcStore, LocalStore
from deltasync.storage.wire import STATUS_CODES, method_path, status_code, status_error
from deltasync.v1 import relay_pb2 as pb

WRITE = "write-token"


def test_each_code_carries_one_error_and_each_error_one_code() -> None:
    codes = [code for _, code in STATUS_CODES]
    assert len(set(codes)) == len(codes)
    for cls, code in STATUS_CODES:
        assert status_error(code) is cls
        assert grpc.StatusCode[code].name == code  # a real gRPC code
    examples: list[tuple[BaseException, str | None]] = [
        (ObjectNotFoundError("packs/a.pack"), "NOT_FOUND"),
        (ObjectExistsError("packs/a.pack"), "ALREADY_EXISTS"),
        (ObjectRangeError("packs/a.pack", "range 0+9 past end of 4-byte object"), "OUT_OF_RANGE"),
        (CorruptObjectError("packs/a.pack", "wrong digest"), "DATA_LOSS"),
        (ObjectTooLargeError("manifests/x", 10, 5), "DATA_LOSS"),
        (UsageError("bad key"), "INVALID_ARGUMENT"),
        (StoreError("upstream unreachable"), "UNAVAILABLE"),
        (DeltasyncError("upstream said no"), "UNAVAILABLE"),
        (OSError("disk"), None),
        (RuntimeError("bug"), None),
    ]
    for error, expected in examples:
        assert status_code(error) == expected, error
    assert status_error("RESOURCE_EXHAUSTED") is None  # the relay's own refusals are outside the table


def _raw_get(address: str, request: pb.GetRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(method_path("Get"), request_serializer=pb.GetRequest.SerializeToString,
                                    response_deserializer=pb.GetChunk.FromString)
        try:
            for _ in call(request, timeout=30):
                pass
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_relay_and_its_client_read_the_table_the_same_way(tmp_path: Path) -> None:
    origin = LocalStore(tmp_path / "origin")
    data = b"pack bytes " * 100
    good = f"packs/{digest(data).hex()}.pack"
    corrupt = "packs/" + "0" * 32 + ".pack"  # its bytes do not match its name
    origin.put(good, data)
    origin.put(corrupt, b"not the bytes its name promises")
    origin.put(LATEST, b"1")
    top = build_server(origin, "127.0.0.1:0", accept_writes=True, write_token=WRITE).start()
    below = build_server(top.url, "127.0.0.1:0").start()  # errors cross two relays and back
    try:
        expected = {
            good: (pb.GetRequest(key=good, offset=0, length=len(data) + 1, has_range=True), grpc.StatusCode.OUT_OF_RANGE),
            LATEST: (pb.GetRequest(key=LATEST, offset=0, length=100, has_range=True), grpc.StatusCode.OUT_OF_RANGE),
            corrupt: (pb.GetRequest(key=corrupt), grpc.StatusCode.DATA_LOSS),
            "packs/missing": (pb.GetRequest(key="packs/" + "1" * 32 + ".pack"), grpc.StatusCode.NOT_FOUND),
            "notes.txt": (pb.GetRequest(key="notes.txt"), grpc.StatusCode.INVALID_ARGUMENT),
        }
        for relay in (top, below):
            for name, (request, code) in expected.items():
                assert _raw_get(relay.address, request) == code, (relay.url, name)

        store = GrpcStore(below.url)
        with pytest.raises(ObjectRangeError):
            store.get(good, (0, len(data) + 1))
        with pytest.raises(ObjectRangeError):
            store.get(LATEST, (0, 100))
        with pytest.raises(CorruptObjectError) as damaged:
            store.get(corrupt)
        assert not isinstance(damaged.value, ObjectRangeError)
        with pytest.raises(ObjectNotFoundError):
            store.get("packs/" + "1" * 32 + ".pack")
        with pytest.raises(UsageError):
            store.get("notes.txt")
        assert store.get(good) == data
        store.close()

        writer = GrpcStore(top.url, write_token=WRITE)
        with pytest.raises(ObjectExistsError):
            writer.put(good, data, if_absent=True)
        writer.close()
    finally:
        below.stop(grace=0)
        top.stop(grace=0)
