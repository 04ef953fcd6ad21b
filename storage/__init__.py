"""Stores: where a repository's objects live. Backends are private modules re-exported here."""

from __future__ import annotations

# This folder is deltasync.storage, reached through the link deltasync/storage; imported from the
# checkout root as plain `storage` it would be a second copy of every module and class in it.
if __name__ != "deltasync.storage":
    raise ImportError(f"import deltasync.storage, not {__name__}: the folder storage/ is the package deltasync.storage "
                      "(one module, one identity)")

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from .. import _lazy
from ..errors import UsageError
from ._base import Store, WrappingStore, check_key, read_held, read_limit, valid_key
from ._local import LocalStore, TempFile, is_temp_name
from ._memory import MemoryStore
from ._throttle import ThrottledStore

# GrpcStore, S3Store, VersionWatch and Download (one checked ranged read) are importable by name too (lazily, below), but are
# left out of __all__: a star import must work where their extras are not installed.
__all__ = ["LocalStore", "MemoryStore", "Store", "TempFile", "ThrottledStore", "WrappingStore", "check_key", "is_temp_name",
           "open_store", "read_held", "read_limit", "valid_key"]

#: Backends whose dependencies are extras: imported on first use (``deltasync.storage.S3Store``).
_LAZY: _lazy.Table = {"S3Store": "_s3", "GrpcStore": "_grpc", "VersionWatch": "_grpc", "Download": "_grpc"}
__getattr__, __dir__ = _lazy.exports(
    __name__, _LAZY, globals(), lambda name: "an s3:// repository" if name == "S3Store" else "a grpc:// repository"
)

if TYPE_CHECKING:
    from ._grpc import Download as Download, GrpcStore as GrpcStore, VersionWatch as VersionWatch
    from ._s3 import S3Store as S3Store

_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


#: The schemes written SCHEME://…, with what follows the slashes (for the error naming a malformed URL).
_SCHEMES = {"memory": "name", "s3": "bucket/prefix", "grpc": "host:port", "grpcs": "host:port"}


def open_store(url: str) -> Store:
    """Open a store by URL: a plain path or ``file://``, ``memory://name`` (per process),
    ``s3://bucket/prefix`` (AWS configuration from the environment; see :class:`S3Store`), or
    ``grpc://host:port[,host:port…]`` (through relays; writable where a relay serves
    ``--accept-writes`` and a write token is given; see :class:`GrpcStore`)."""
    if not url:
        raise UsageError("empty repository URL")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise UsageError(
                f"{url!r} names the host {parsed.netloc!r}: a file:// URL takes an absolute path "
                f"(file:///abs/path); give a relative path without file://"
            )
        path = parsed.path if scheme == "file" else url
        return LocalStore(path)
    if scheme in _SCHEMES and not url[len(scheme) + 1:].startswith("//"):
        # s3:/bucket/x, grpc:host:port: a slash left out, not a bucket or host with a bad name.
        raise UsageError(f"malformed repository URL {url!r}: write {scheme}://{_SCHEMES[scheme]} "
                         f"(two slashes after '{scheme}:')")
    if scheme == "memory":
        name = url[len("memory://") :]
        with _memory_lock:
            store = _memory_stores.get(name)
            if store is None:
                store = _memory_stores[name] = MemoryStore(url)
        return store
    if scheme == "s3":
        # boto3 is imported only when an s3:// URL is opened
        s3_store: Callable[[str], Store] = __getattr__("S3Store")
        return s3_store(url)
    if scheme in ("grpc", "grpcs"):
        # grpcio is imported only when a grpc:// URL is opened
        grpc_store: Callable[[str], Store] = __getattr__("GrpcStore")
        return grpc_store(url)
    raise UsageError(f"unsupported repository URL {url!r} (use a path, file://, memory://, s3://, grpc:// or grpcs://)")
