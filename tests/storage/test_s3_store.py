"""S3Store against moto's S3 server over real HTTP (or $DELTASYNC_TEST_S3_URL; see s3server.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from botocore.exceptions import ConnectionClosedError

from deltasync.errors import CorruptObjectError, ObjectExistsError, ObjectNotFoundError, StoreError, UsageError
from deltasync.storage import Store, open_store
from deltasync.storage._s3 import MiB, S3Store
from deltasync.storage.testing import StoreConformance

if TYPE_CHECKING:
    from s3server import S3TestServer

pytest_plugins = ["s3server"]  # the s3_server / s3_url fixtures

PART = 5 * MiB  # S3's smallest part: multipart tests stay small


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store(self, s3_url: str) -> Iterator[Store]:
        store = S3Store(s3_url)
        yield store
        store.close()


@pytest.fixture
def small_parts(s3_url: str) -> Iterator[S3Store]:
    store = S3Store(s3_url, part_size=PART, multipart_threshold=PART, max_concurrency=4)
    yield store
    store.close()


def pending_uploads(store: S3Store) -> list[dict[str, Any]]:
    response = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/")
    uploads: list[dict[str, Any]] = response.get("Uploads", [])
    return uploads


def test_open_store_s3_url(s3_url: str) -> None:
    store = open_store(s3_url + "/")
    assert isinstance(store, S3Store)
    assert store.url == s3_url
    store.put("k", b"v")
    assert S3Store(store.bucket, store.prefix).get("k") == b"v"


def test_url_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)  # creating a client must not need a real profile
    store = S3Store("s3://bkt/a/b/?conditional_writes=false&region=eu-west-1")
    assert (store.bucket, store.prefix, store.url) == ("bkt", "a/b", "s3://bkt/a/b")
    assert store.conditional_writes is False
    assert store.client.meta.region_name == "eu-west-1"
    assert S3Store("s3://bkt").prefix == ""
    for bad in ["s3://", "s3:///x", "s3://bkt/a//b", "s3://bkt/a?bogus=1", "s3://bkt?conditional_writes=maybe"]:
        with pytest.raises(UsageError):
            S3Store(bad)
    with pytest.raises(UsageError, match="part_size"):
        S3Store("bkt", part_size=MiB)


def test_keys_live_under_the_prefix(s3_url: str) -> None:
    store = S3Store(s3_url + "/p")
    sibling = S3Store(s3_url + "/p2")
    store.put("a/b", b"1")
    sibling.put("c", b"2")
    base = s3_url.removeprefix(f"s3://{store.bucket}/")
    raw = store.client.list_objects_v2(Bucket=store.bucket, Prefix=f"{base}/")
    assert sorted(obj["Key"] for obj in raw["Contents"]) == [f"{base}/p/a/b", f"{base}/p2/c"]
    assert list(store.list()) == ["a/b"]
    assert list(sibling.list()) == ["c"]
    # A console "folder" marker under the prefix is not a store key.
    store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/dir/", Body=b"")
    assert list(store.list()) == ["a/b"]


def test_multipart_roundtrip_and_ranged_reads(small_parts: S3Store) -> None:
    store = small_parts
    data = os.urandom(2 * PART + 12345)
    store.put("big", memoryview(bytearray(data)))
    head = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/big")
    assert head["ETag"].endswith('-3"')  # three parts, so it really went up as multipart
    assert store.size("big") == len(data)
    assert store.get("big") == data
    for offset, length in [(PART - 10, 20), (2 * PART - 1, 2), (0, len(data)), (len(data) - 5, 5), (PART, PART)]:
        assert store.get("big", (offset, length)) == data[offset : offset + length]
    with pytest.raises(CorruptObjectError):
        store.get("big", (len(data) - 5, 10))
    with pytest.raises(CorruptObjectError):
        store.get("big", (len(data) + 1, 1))
    with pytest.raises(CorruptObjectError):
        store.get("big", (len(data) + 1, 0))
    assert pending_uploads(store) == []


def test_multipart_if_absent_race_exactly_one_wins(small_parts: S3Store) -> None:
    store = small_parts
    payloads = [bytes([i]) * (PART + 1000 * i + 1) for i in range(4)]
    winners: list[int] = []
    losers: list[int] = []
    barrier = threading.Barrier(len(payloads))

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            store.put("commit", payloads[i], if_absent=True)
            winners.append(i)
        except ObjectExistsError:
            losers.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert len(losers) == len(payloads) - 1
    assert store.get("commit") == payloads[winners[0]]
    assert pending_uploads(store) == []  # losers aborted their uploads
    with pytest.raises(ObjectExistsError):
        store.put("commit", payloads[0], if_absent=True)
    assert pending_uploads(store) == []


def test_failed_multipart_leaves_nothing(small_parts: S3Store) -> None:
    store = small_parts

    def fail_part_2(params: dict[str, Any], **_: Any) -> None:
        if params.get("PartNumber") == 2:
            raise ConnectionClosedError(endpoint_url=store.client.meta.endpoint_url)

    store.client.meta.events.register("provide-client-params.s3.UploadPart", fail_part_2)
    with pytest.raises(StoreError, match=r"upload part 2 of s3://.*/broken"):
        store.put("broken", os.urandom(3 * PART))
    assert not store.exists("broken")
    assert list(store.list()) == []
    assert pending_uploads(store) == []


def test_lost_response_is_not_a_lost_commit(s3_url: str) -> None:
    """S3 stored the object but the response was lost: botocore resends, gets 412, and the
    store must recognise its own write instead of reporting that someone else committed."""
    store = S3Store(s3_url)

    def resend_first_success(attempts: int, response: Any, **_: Any) -> float | None:
        if attempts == 1 and response is not None and response[0].status_code == 200:
            return 0.0  # retry after 0 s as if the connection had reset
        return None

    store.client.meta.events.register("needs-retry.s3.PutObject", resend_first_success)
    store.put("manifest", b"ours", if_absent=True)
    assert store.get("manifest") == b"ours"
    with pytest.raises(ObjectExistsError):  # a retried 412 on someone else's object still loses
        store.put("manifest", b"theirs", if_absent=True)
    assert store.get("manifest") == b"ours"


def test_conditional_writes_off_falls_back_to_head_then_put(s3_url: str) -> None:
    store = S3Store(s3_url + "?conditional_writes=false")
    sent: list[dict[str, Any]] = []
    store.client.meta.events.register("provide-client-params.s3.PutObject", lambda params, **_: sent.append(dict(params)))
    store.put("k", b"1", if_absent=True)
    with pytest.raises(ObjectExistsError):
        store.put("k", b"2", if_absent=True)
    assert store.get("k") == b"1"
    assert all("IfNoneMatch" not in params for params in sent)


def test_missing_bucket_is_a_clear_store_error(s3_server: S3TestServer, s3_url: str) -> None:
    store = S3Store(s3_server.missing_bucket_url())
    for operation in (
        lambda: store.get("k"),
        lambda: store.get("k", (0, 1)),
        lambda: store.size("k"),
        lambda: store.exists("k"),
        lambda: store.put("k", b"x"),
        lambda: store.put("k", b"x", if_absent=True),
        lambda: list(store.list()),
        lambda: store.delete("k"),
    ):
        with pytest.raises(StoreError, match=f"bucket '{store.bucket}' does not exist") as info:
            operation()
        assert "\n" not in str(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_object(s3_url: str) -> None:
    store = S3Store(s3_url)
    with pytest.raises(ObjectNotFoundError, match="object not found: nope"):
        store.size("nope")
    store.delete("nope")


def test_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    store = S3Store("s3://bkt/p", endpoint_url="http://127.0.0.1:9", region="us-east-1", max_attempts=1)
    with pytest.raises(StoreError, match=r"cannot reach S3 endpoint http://127.0.0.1:9 to read s3://bkt/p/k"):
        store.get("k")
