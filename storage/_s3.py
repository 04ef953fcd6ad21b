"""S3 store (AWS or any S3-compatible endpoint): ``s3://bucket/prefix``, objects stored under the prefix.

Configuration is the standard AWS one: credentials from the default chain (environment, profile,
SSO, instance role), region from ``AWS_REGION``/profile, endpoint from ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) unless ``endpoint_url`` is given. Retries are botocore's: "standard" mode
(or "adaptive" when configured) with exponential backoff and jitter on throttling, 5xx and
connection errors, 8 attempts unless ``AWS_MAX_ATTEMPTS`` or the profile says otherwise.

Commit semantics: ``put(if_absent=True)`` is a conditional write (``If-None-Match: *`` on
PutObject or CompleteMultipartUpload), which S3 decides atomically.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import parse_qsl, urlparse

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from ..errors import (
    DeltasyncError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRangeError,
    StoreError,
    UsageError,
)
from ..retry import Backoff
from . import _base
from ._base import Store, check_key, listing_too_long, read_limit, too_large, valid_key

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's minimum for every part but the last
_MAX_PART = 5 * 1024 * MiB
_MAX_PARTS = 10_000
_DEFAULT_MAX_ATTEMPTS = 8
_READ_ATTEMPTS = 4  # body reads are outside botocore's retry loop
_CONFLICT_ATTEMPTS = 4  # 409 ConditionalRequestConflict: S3 asks the client to retry
_WRITE_ID = "deltasync-write-id"  # user metadata naming the put() call that wrote an object

_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
_PRECONDITION = frozenset({"PreconditionFailed", "412"})
_CONFLICT = frozenset({"ConditionalRequestConflict", "409"})
_BAD_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
)
_STREAM_ERRORS = (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError)
_URL_OPTIONS = ("endpoint_url", "region", "conditional_writes")


class _Precondition(Exception):
    """The conditional write lost: the key exists. ``retried``: botocore resent the request."""

    def __init__(self, retried: bool) -> None:
        self.retried = retried


class _Conflict(Exception):
    """409: a concurrent operation on the key interfered; the write must be redone."""


def parse_s3_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``s3://bucket/prefix?option=value`` → (bucket, prefix without slashes, options)."""
    parsed = urlparse(url)
    if parsed.scheme.lower() != "s3" or not parsed.netloc:
        raise UsageError(f"invalid S3 URL {url!r} (expected s3://bucket/prefix)")
    options = dict(parse_qsl(parsed.query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_URL_OPTIONS))
    if unknown:
        raise UsageError(f"unknown S3 URL option(s) {', '.join(unknown)} in {url!r} (known: {', '.join(_URL_OPTIONS)})")
    return parsed.netloc, parsed.path.strip("/"), options


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"S3 URL option {name}={value!r} is not a boolean")


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _backoff() -> Backoff:
    """Waits between attempts of one request: 50 ms doubling to 2 s, full jitter."""
    return Backoff(0.05, 2.0, low=0.0)


class S3Store(Store):
    """Objects in an S3 bucket under a key prefix.

    ``S3Store("s3://bucket/prefix")`` or ``S3Store("bucket", "prefix")``. URL options:
    ``?endpoint_url=…``, ``?region=…``, ``?conditional_writes=false``.

    Args:
        endpoint_url: S3-compatible endpoint (MinIO, R2, Ceph, …). Default: ``AWS_ENDPOINT_URL``
            or AWS itself.
        region: region name. Default: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / profile.
        max_concurrency: parts uploaded in parallel by one store (a shared thread pool); also
            sizes the HTTP connection pool (twice this, leaving room for callers' own threads).
        part_size: multipart part size (5 MiB to 5 GiB). Grown automatically for objects that
            would need more than 10,000 parts.
        multipart_threshold: objects larger than this go up as a parallel multipart upload.
        conditional_writes: use ``If-None-Match: *`` for ``put(if_absent=True)`` (AWS S3 and
            most current S3-compatible servers). For endpoints that reject or ignore it, pass
            ``False``: ``if_absent`` then becomes HEAD-then-PUT, which is **racy**: two
            publishers committing the same version at the same moment can both succeed and the
            later write wins. Only use it when a single publisher writes the repository.
        max_attempts: total attempts per request, overriding ``AWS_MAX_ATTEMPTS``/profile.

    A multipart upload that fails is aborted, so no partial object or pending upload is left
    behind. (A process killed mid-upload cannot abort; an ``AbortIncompleteMultipartUpload``
    lifecycle rule on the bucket is the backstop for that.)
    """

    def __init__(
        self,
        location: str,
        prefix: str | None = None,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_concurrency: int = 16,
        part_size: int = 16 * MiB,
        multipart_threshold: int = 16 * MiB,
        conditional_writes: bool = True,
        max_attempts: int | None = None,
    ) -> None:
        if location.lower().startswith("s3://"):
            if prefix is not None:
                raise UsageError("give either an s3:// URL or a bucket and a prefix, not both")
            bucket, prefix, options = parse_s3_url(location)
            endpoint_url = endpoint_url or options.get("endpoint_url") or None
            region = region or options.get("region") or None
            if "conditional_writes" in options:
                conditional_writes = _parse_bool("conditional_writes", options["conditional_writes"])
        else:
            bucket, prefix = location, (prefix or "").strip("/")
        if not bucket or "/" in bucket:
            raise UsageError(f"invalid S3 bucket name {bucket!r}")
        if prefix:
            check_key(prefix)
        if max_concurrency < 1:
            raise UsageError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if not _MIN_PART <= part_size <= _MAX_PART:
            raise UsageError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        if multipart_threshold < part_size:
            raise UsageError(f"multipart_threshold ({multipart_threshold}) must be at least part_size ({part_size})")
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.max_concurrency = max_concurrency
        self.io_concurrency = max_concurrency
        self.overlap_uploads = True
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.conditional_writes = conditional_writes
        self._root = f"{prefix}/" if prefix else ""
        self._client = self._make_client(endpoint_url, region, max_attempts)
        # Follow botocore's checksum setting (AWS_REQUEST_CHECKSUM_CALCULATION) for multipart too,
        # as s3transfer does: CRC32 per part unless the user asked for checksums only when required.
        self._part_checksums = self._client.meta.config.request_checksum_calculation == "when_supported"
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._bucket_seen = False  # a bucket that answered once is not re-checked on 404s

    def _make_client(self, endpoint_url: str | None, region: str | None, max_attempts: int | None) -> Any:
        try:
            core = botocore.session.Session()
            mode = "adaptive" if core.get_config_variable("retry_mode") == "adaptive" else "standard"
            attempts = max_attempts or core.get_config_variable("max_attempts") or _DEFAULT_MAX_ATTEMPTS
            config = Config(
                retries={"mode": mode, "total_max_attempts": attempts},
                max_pool_connections=2 * self.max_concurrency,
                tcp_keepalive=True,
            )
            session = boto3.session.Session(botocore_session=core)
            return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        except (BotoCoreError, ValueError) as e:  # ProfileNotFound, a malformed endpoint URL, …
            raise StoreError(f"cannot open {self.url}: {e}") from None

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe); for operations the Store interface does not cover."""
        return self._client

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._client.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # -- reads ---------------------------------------------------------------------------------

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        request: dict[str, Any] = {"Key": self._root + key}
        if byte_range is not None:
            offset, length = byte_range
            if length == 0:  # an empty HTTP range cannot be expressed; check bounds with HEAD
                size = self._size(key)
                if offset > size:
                    raise ObjectRangeError(key, f"range {offset}+0 past end of {size}-byte object")
                return b""
            request["Range"] = f"bytes={offset}-{offset + length - 1}"
        limit = read_limit() if byte_range is None else None
        backoff = _backoff()
        for attempt in range(_READ_ATTEMPTS):
            response = self._call("read", key, self._client.get_object, **request)
            body = response["Body"]
            data: bytes
            try:
                if byte_range is not None:
                    # At most the range (the prefix up to it from an endpoint that ignores
                    # Range): never the rest of an object a hostile endpoint sends.
                    ranged = "ContentRange" in response
                    data = body.read(byte_range[1] + 1 if ranged else byte_range[0] + byte_range[1])
                    break
                if limit is None:
                    data = body.read()
                    break
                # The size is known before the body is read: a larger object is never read.
                announced = response.get("ContentLength")
                if announced is not None and int(announced) > limit:
                    raise too_large(key, int(announced), limit)
                data = body.read(limit + 1)  # an endpoint may send more than it announced
                if len(data) > limit:
                    raise too_large(key, None, limit)
                break
            except _STREAM_ERRORS as e:
                if attempt == _READ_ATTEMPTS - 1:
                    raise self._error(e, "read", key) from None
                backoff.sleep()
            finally:
                body.close()
        if byte_range is None:
            return data
        if "ContentRange" not in response:  # the endpoint ignored Range and sent the whole object
            data = data[offset : offset + length]
        if len(data) != length:
            raise ObjectRangeError(key, f"range {offset}+{length} past end of object (got {len(data)} bytes)")
        return data

    def _size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def _head(self, key: str) -> dict[str, Any]:
        response: dict[str, Any] = self._call("stat", key, self._client.head_object, Key=self._root + key)
        return response

    def _listing(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under ``prefix``, page by page."""
        count = 0
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._root + prefix):
                self._bucket_seen = True
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self._root) :]
                    # Objects a Store cannot have written (e.g. console "folder/" markers) are
                    # skipped rather than handed out as keys that get() would reject.
                    if valid_key(key):
                        count += 1
                        yield key, int(obj.get("Size", 0))
                if count > _base.MAX_LIST_KEYS:  # checked per page: an endless listing stops here
                    raise listing_too_long(prefix, f"s3://{self.bucket}/{self._root}")
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "list", prefix or None) from None

    def _list(self, prefix: str) -> Iterator[str]:
        keys = [key for key, _ in self._listing(prefix)]
        keys.sort()  # S3 lists in UTF-8 byte order already; not every compatible server does
        return iter(keys)

    def _total_bytes(self, prefix: str) -> int:
        # The listing carries every object's size: one request per 1,000 keys, not one per key.
        return sum(size for _, size in self._listing(prefix))

    # -- writes --------------------------------------------------------------------------------

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        view = memoryview(data).cast("B")  # byte offsets even for a typed memoryview
        if if_absent and not self.conditional_writes:
            if self._exists(key):  # racy by construction; see the class docstring
                raise ObjectExistsError(key)
            if_absent = False
        write_id = uuid.uuid4().hex if if_absent else None
        backoff = _backoff()
        for _attempt in range(_CONFLICT_ATTEMPTS):
            try:
                if view.nbytes > self.multipart_threshold:
                    self._put_multipart(key, view, write_id)
                else:
                    self._put_single(key, view, write_id)
                return
            except _Precondition as lost:
                # A response lost after S3 stored the object makes botocore resend the request,
                # which then fails its own precondition: a retried 412 may be our success.
                if lost.retried and self._written_by(key, write_id):
                    return
                raise ObjectExistsError(key) from None
            except _Conflict:
                # S3 saw a concurrent write or delete of the key. If it now exists, that writer
                # won (or it was us); otherwise S3 asks for the write to be redone.
                if self._exists(key):
                    if self._written_by(key, write_id):
                        return
                    raise ObjectExistsError(key) from None
                backoff.sleep()
        raise StoreError(f"conditional write of {self._where(key)} kept conflicting with concurrent writes")

    def _put_single(self, key: str, view: memoryview, write_id: str | None) -> None:
        conditions: dict[str, Any] = {}
        if write_id is not None:
            conditions = {"IfNoneMatch": "*", "Metadata": {_WRITE_ID: write_id}}
        body = view.obj if type(view.obj) is bytes and view.nbytes == len(view.obj) else view.tobytes()
        self._call("write", key, self._client.put_object, Key=self._root + key, Body=body, **conditions)

    def _put_multipart(self, key: str, view: memoryview, write_id: str | None) -> None:
        if write_id is not None and self._exists(key):
            raise _Precondition(retried=False)  # don't upload gigabytes only to fail at commit
        size = view.nbytes
        part_size = max(self.part_size, -(-size // _MAX_PARTS))
        create: dict[str, Any] = {"Metadata": {_WRITE_ID: write_id}} if write_id else {}
        if self._part_checksums:
            create["ChecksumAlgorithm"] = "CRC32"
        full = self._root + key
        started = self._call("start a multipart upload of", key, self._client.create_multipart_upload, Key=full, **create)
        upload_id = started["UploadId"]
        futures: list[Future[dict[str, Any]]] = []
        try:
            pool = self._executor()
            for number, start in enumerate(range(0, size, part_size), start=1):
                part = view[start : start + part_size]
                futures.append(pool.submit(self._upload_part, key, upload_id, number, part))
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # re-raise the first failure
            parts = [future.result() for future in futures]
            complete: dict[str, Any] = {"IfNoneMatch": "*"} if write_id else {}
            self._call(
                "complete the multipart upload of",
                key,
                self._client.complete_multipart_upload,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **complete,
            )
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)  # a part still in flight would outlive the abort and be billed
            with contextlib.suppress(BotoCoreError, ClientError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise

    def _upload_part(self, key: str, upload_id: str, number: int, part: memoryview) -> dict[str, Any]:
        extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32"} if self._part_checksums else {}
        # One copy per part in flight keeps memory at O(part_size x max_concurrency).
        response = self._call(
            f"upload part {number} of",
            key,
            self._client.upload_part,
            Key=self._root + key,
            UploadId=upload_id,
            PartNumber=number,
            Body=part.tobytes(),
            **extra,
        )
        entry: dict[str, Any] = {"PartNumber": number, "ETag": response["ETag"]}
        if "ChecksumCRC32" in response:
            entry["ChecksumCRC32"] = response["ChecksumCRC32"]
        return entry

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="deltasync-s3")
            return self._pool

    def _delete(self, key: str) -> None:
        self._call("delete", key, self._client.delete_object, Key=self._root + key)

    # -- helpers -------------------------------------------------------------------------------

    def _exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFoundError:
            return False
        return True

    def _written_by(self, key: str, write_id: str | None) -> bool:
        try:
            metadata = self._head(key).get("Metadata", {})
        except ObjectNotFoundError:
            return False
        return write_id is not None and metadata.get(_WRITE_ID) == write_id

    def _call(self, action: str, key: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        """Run one S3 request; translate its failure into a deltasync error naming the object."""
        try:
            response = method(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            code = _code(e)
            if code in _NOT_FOUND:
                if code != "NoSuchKey":  # HEAD has no body: a missing bucket is a 404 as well
                    self._check_bucket()
                raise ObjectNotFoundError(key) from None
            if code in _PRECONDITION and "IfNoneMatch" in kwargs:
                retried = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                raise _Precondition(retried) from None
            if code in _CONFLICT and "IfNoneMatch" in kwargs:
                raise _Conflict from None
            if code == "InvalidRange":
                raise ObjectRangeError(key, f"{kwargs.get('Range', 'range')} is past the end of the object") from None
            raise self._error(e, action, key) from None
        except BotoCoreError as e:
            raise self._error(e, action, key) from None
        self._bucket_seen = True
        return response

    def _check_bucket(self) -> None:
        if self._bucket_seen:
            return
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) in ("404", "NoSuchBucket", "NotFound"):
                raise self._no_bucket() from None
            return  # e.g. 403 on the bucket with access to objects: assume it exists
        except BotoCoreError as e:
            raise self._error(e, "check bucket", None) from None
        self._bucket_seen = True

    def _no_bucket(self) -> StoreError:
        return StoreError(f"bucket {self.bucket!r} does not exist{self._at()} (opening {self.url})")

    def _at(self) -> str:
        endpoint = str(self._client.meta.endpoint_url)
        return "" if endpoint.endswith(".amazonaws.com") else f" at {endpoint}"

    def _where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{self._root}{key or ''}"

    def _error(self, e: Exception, action: str, key: str | None) -> DeltasyncError:
        """One line naming the object and what went wrong; no botocore traceback."""
        where = self._where(key)
        if isinstance(e, ClientError):
            code = _code(e)
            message = e.response.get("Error", {}).get("Message", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            if code == "NoSuchBucket":
                return self._no_bucket()
            if code in ("AccessDenied", "403", "AllAccessDisabled"):
                return StoreError(f"access denied: cannot {action} {where} (check credentials and bucket policy)")
            if code in _BAD_CREDENTIALS:
                return StoreError(f"S3 rejected the credentials ({code}) when trying to {action} {where}")
            detail = f"{code or status}: {message}" if message else (code or f"HTTP {status}")
            return StoreError(f"cannot {action} {where}: {detail}")
        if isinstance(e, NoCredentialsError):
            return StoreError(
                f"no AWS credentials found to {action} {where} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            )
        if isinstance(e, EndpointConnectionError):
            return StoreError(f"cannot reach S3 endpoint {self._client.meta.endpoint_url} to {action} {where}")
        return StoreError(f"cannot {action} {where}: {e}")
