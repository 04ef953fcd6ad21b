"""An S3 endpoint for tests: moto's S3 server in this process on 127.0.0.1, or a real endpoint.

Fixtures (import them into a test module or ``tests/conftest.py``)::

    from s3server import s3_server, s3_url  # noqa: F401

``s3_url`` is a fresh ``s3://bucket/prefix`` per test, with the AWS environment set so that
``open_store(s3_url)`` / ``S3Store(s3_url)`` reach the endpoint; the objects and pending
multipart uploads under the prefix are removed afterwards.

Set ``DELTASYNC_TEST_S3_URL=s3://bucket/prefix`` (plus the usual ``AWS_*`` variables and
``AWS_ENDPOINT_URL`` for a non-AWS endpoint) to run against a real endpoint instead of moto.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

ENV_URL = "DELTASYNC_TEST_S3_URL"

# Dummy credentials for moto; the config-file variables point nowhere so that a developer's
# ~/.aws profile, SSO session or instance role never leaks into the tests.
_MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.path.join(os.sep, "nonexistent", "deltasync-test", "config"),
    "AWS_SHARED_CREDENTIALS_FILE": os.path.join(os.sep, "nonexistent", "deltasync-test", "credentials"),
    "AWS_EC2_METADATA_DISABLED": "true",
}
_MOTO_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3")


class _SerializedWrites:
    """WSGI middleware: one object write at a time (part uploads stay parallel).

    moto 5.2.1 evaluates ``If-None-Match: *`` and then writes without a lock, so racing
    conditional writers can both win (reliably on CompleteMultipartUpload), and concurrent
    writes of one key can close each other's buffers. S3 decides conditional writes atomically;
    serializing here makes the fixture behave like S3. moto has finished the write when the
    application returns, so holding the lock for the call is enough.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        is_part = "partNumber=" in environ.get("QUERY_STRING", "")
        if environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE") and not is_part:
            with self.lock:
                result: Iterable[bytes] = self.app(environ, start_response)
                return result
        result = self.app(environ, start_response)
        return result


class _MotoServer:
    """moto's S3 over real HTTP in a daemon thread (like moto's ThreadedMotoServer, plus the
    middleware above, a port chosen by the OS and no access log)."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                pass

        app = _SerializedWrites(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


_lock = threading.Lock()
_server: _MotoServer | None = None
_users = 0


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """The endpoint URL of the process's one moto server, started on first use and stopped when
    its last user leaves (so importing the fixtures in several places still starts one)."""
    global _server, _users
    with _lock:
        if _server is None:
            _server = _MotoServer()
        _users += 1
        server = _server
    try:
        yield server.endpoint_url
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                server.stop()
                _server = None


@dataclass
class S3TestServer:
    """Where the tests' objects go. ``env``: variables each test sets (empty for a real endpoint)."""

    bucket: str
    prefix: str
    endpoint_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    is_moto: bool = False

    def client(self) -> Any:
        """A plain boto3 client for checks and cleanup, independent of the code under test."""
        import boto3

        if self.is_moto:
            return boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.env["AWS_REGION"],
                aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            )
        return boto3.client("s3", endpoint_url=self.endpoint_url)

    def new_url(self) -> str:
        """A fresh, unique ``s3://bucket/prefix`` for one test."""
        head = f"{self.prefix}/" if self.prefix else ""
        return f"s3://{self.bucket}/{head}test-{uuid.uuid4().hex[:12]}"

    def missing_bucket_url(self) -> str:
        return f"s3://deltasync-missing-{uuid.uuid4().hex}/x"

    def cleanup(self, url: str) -> None:
        """Delete every object and abort every pending multipart upload under ``url``."""
        prefix = url[len(f"s3://{self.bucket}/") :].rstrip("/") + "/"
        client = self.client()
        try:
            for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
                for upload in page.get("Uploads", ()):
                    client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                objects = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
                if objects:
                    client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
        finally:
            client.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3TestServer]:
    """One S3 endpoint for the session: moto (started once) or ``$DELTASYNC_TEST_S3_URL``."""
    external = os.environ.get(ENV_URL)
    if external:
        from deltasync.storage._s3 import parse_s3_url

        bucket, prefix, _ = parse_s3_url(external)
        # endpoint_url None: boto3 reads AWS_ENDPOINT_URL(_S3) itself, exactly as S3Store does
        yield S3TestServer(bucket=bucket, prefix=prefix, endpoint_url=None)
        return
    with moto_endpoint() as endpoint:
        env = {**_MOTO_ENV, "AWS_ENDPOINT_URL": endpoint}
        server = S3TestServer(
            bucket=f"deltasync-test-{uuid.uuid4().hex[:8]}", prefix="", endpoint_url=endpoint, env=env, is_moto=True
        )
        client = server.client()
        client.create_bucket(Bucket=server.bucket)
        client.close()
        yield server


@pytest.fixture
def s3_url(s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh ``s3://bucket/prefix`` with the AWS environment pointing at the test endpoint."""
    for name in _MOTO_UNSET if s3_server.is_moto else ():
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    url = s3_server.new_url()
    yield url
    s3_server.cleanup(url)
