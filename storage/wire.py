"""The relay's wire definition, shared by the server (:mod:`deltasync.relay`) and its
clients (the ``grpc://`` store, :mod:`deltasync.storage`): service and method names, message
sizes, the status codes that carry errors (:data:`STATUS_CODES`), and where a client's bearer
token comes from.

The service binds by hand with generic handlers instead of generated ``*_pb2_grpc`` code,
which would pin grpcio at runtime to the version of grpcio-tools that generated it. Nothing
here imports grpcio.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptObjectError,
    DeltasyncError,
    MissingReferencesError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRangeError,
    UsageError,
)
from ..v1 import relay_pb2 as pb
from ._base import MAX_OFFSET as MAX_OFFSET  # the largest offset or length a Get may name

SERVICE = "deltasync.v1.Relay"
CHUNK_BYTES = 1 << 20  # bytes per GetChunk: big packs stream under flow control
LIST_BATCH = 1000  # keys per ListResponse
#: An object this small is sent whole in an Upload's header, before any credit (one round trip,
#: as a Put: a lease, a ref, a manifest); a relay holds at most this per waiting uploader.
UNCREDITED_BYTES = 256 << 10

#: An UploadSession's initial metadata from a relay that refuses (FAILED_PRECONDITION) a
#: manifest whose packs or blobs, or whose delta parent's manifest, are missing: a publisher
#: then skips its own check right before its commit (``Store.checks_references``).
UPLOAD_CHECKS = ("deltasync-upload-checks", "references,parent")
#: Also in that metadata's value, from a relay that, before it checks a manifest, waits for the
#: uploads it is receiving right then of the packs and blobs the manifest names: a publisher may
#: then send its manifest without waiting for its last packs' answers (``Store.orders_references``).
UPLOAD_WAITS = "inflight"
#: Also in that value, from a relay that commits a version's manifest sent with
#: ``commit_latest`` on an upload session: after writing it, it updates ``refs/latest``, deletes
#: the publish's lease and checks the manifest's objects again, its answer naming any missing
#: (``Store.commits_refs``): the publisher's round trip after its commit, saved.
UPLOAD_COMMITS = "commit"

UNARY, SERVER_STREAM, CLIENT_STREAM, BIDI_STREAM = "unary", "server_stream", "client_stream", "bidi_stream"

#: (method, request type, response type, kind of call)
METHODS: dict[str, tuple[Any, Any, str]] = {
    "Get": (pb.GetRequest, pb.GetChunk, SERVER_STREAM),
    "Stat": (pb.StatRequest, pb.StatResponse, UNARY),
    "List": (pb.ListRequest, pb.ListResponse, SERVER_STREAM),
    "Watch": (pb.WatchRequest, pb.VersionEvent, SERVER_STREAM),
    "Put": (pb.PutChunk, pb.PutResponse, CLIENT_STREAM),
    "Upload": (pb.PutChunk, pb.UploadCredit, BIDI_STREAM),
    "UploadSession": (pb.PutChunk, pb.UploadCredit, BIDI_STREAM),
    "Delete": (pb.DeleteRequest, pb.DeleteResponse, UNARY),
}
#: Methods that change the repository: only a relay serving with --accept-writes takes them,
#: and only from a client carrying its write token.
WRITE_METHODS = frozenset({"Put", "Upload", "UploadSession", "Delete"})


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


#: The errors a relay answers with and the gRPC status codes (by name: nothing here imports
#: grpcio) that carry them, most specific first. The relay ends a call with the code of the
#: first row whose error the failure is; the client raises that row's error back. The last row
#: is the relay's upstream failing: the client tries another relay, then gives up with a
#: StoreError. Codes outside the table are the relay's own refusals (a token, a cap, a quota).
STATUS_CODES: tuple[tuple[type[DeltasyncError], str], ...] = (
    (ObjectNotFoundError, "NOT_FOUND"),
    (ObjectExistsError, "ALREADY_EXISTS"),
    (ObjectRangeError, "OUT_OF_RANGE"),  # a range past the object's end: an answer, not damage
    (CorruptObjectError, "DATA_LOSS"),  # damaged, wrong size, over its kind's cap (ObjectTooLargeError)
    (UsageError, "INVALID_ARGUMENT"),
    # a manifest naming objects the repository lacks: a refusal, passed on along a chain of
    # writable relays (the publisher stores them again and puts once more: publish/commit.py)
    (MissingReferencesError, "FAILED_PRECONDITION"),
    (DeltasyncError, "UNAVAILABLE"),
)


def status_code(error: BaseException) -> str | None:
    """The name of the status code that carries ``error``; None for an error outside the table
    (a bug, a cache file that cannot be read: the relay decides)."""
    return next((code for cls, code in STATUS_CODES if isinstance(error, cls)), None)


def status_error(code: str) -> type[DeltasyncError] | None:
    """The error a status code (by name) carries; None for a code outside the table.

    Relays before the table sent every corrupt object as OUT_OF_RANGE: a client reads it as an
    :class:`~deltasync.errors.ObjectRangeError`, which is a ``CorruptObjectError`` too."""
    return next((cls for cls, name in STATUS_CODES if name == code), None)


TOKEN_ENV = "DELTASYNC_RELAY_TOKEN"
TOKEN_FILE_ENV = "DELTASYNC_RELAY_TOKEN_FILE"
WRITE_TOKEN_ENV = "DELTASYNC_RELAY_WRITE_TOKEN"
WRITE_TOKEN_FILE_ENV = "DELTASYNC_RELAY_WRITE_TOKEN_FILE"
CA_ENV = "DELTASYNC_RELAY_CA"


def read_token(
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    *,
    env: str = TOKEN_ENV,
    file_env: str = TOKEN_FILE_ENV,
) -> str | None:
    """The bearer token: given, else from a file, else ``$DELTASYNC_RELAY_TOKEN(_FILE)``
    (the write token: ``env``/``file_env`` = ``$DELTASYNC_RELAY_WRITE_TOKEN(_FILE)``)."""
    if token:
        return token
    path = token_file or os.environ.get(file_env)
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read token file {path}: {e.strerror}") from None
        if not text:
            raise UsageError(f"token file {path} is empty")
        return text
    return os.environ.get(env) or None


def read_write_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None) -> str | None:
    """The write token: given, else from a file, else ``$DELTASYNC_RELAY_WRITE_TOKEN(_FILE)``."""
    return read_token(token, token_file, env=WRITE_TOKEN_ENV, file_env=WRITE_TOKEN_FILE_ENV)
