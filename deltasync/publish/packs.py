"""Packs: payloads appended back to back into content-addressed objects, uploaded in the background."""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ObjectExistsError
from ..format.digest import digest
from ..storage import Store
from ..v1 import manifest_pb2 as pb

__all__ = ["Packer"]


class Packer:
    """Appends payloads to a pack; full packs upload on a background thread."""

    def __init__(self, store: Store, pack_bytes: int) -> None:
        self.store = store
        self.pack_bytes = pack_bytes
        self.packs: list[pb.Pack] = []
        self._parts: list[bytes] = []
        self._size = 0
        self._uploads: deque[Future[None]] = deque()
        # As many uploads in flight as the store wants (several streams over relays), at least 2.
        self._window = max(2, store.upload_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=self._window, thread_name_prefix="deltasync-upload")
        self.created: set[str] = set()  # keys this attempt wrote, the only ones abandon() may delete
        self.stored = 0

    def add(self, payload: bytes) -> tuple[int, int]:
        offset = self._size
        self._parts.append(payload)
        self._size += len(payload)
        index = len(self.packs)
        if self._size >= self.pack_bytes:
            self.flush()
        return index, offset

    def flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts, self._size = [], 0
        key = f"packs/{digest(data).hex()}.pack"
        self.packs.append(pb.Pack(key=key, size=len(data)))
        self.stored += len(data)
        while len(self._uploads) >= self._window:  # bound memory: at most _window packs waiting to upload
            self._uploads.popleft().result()
        self._uploads.append(self._pool.submit(self._upload, key, data))

    def _upload(self, key: str, data: bytes) -> None:
        try:
            self.store.put(key, data, if_absent=True)
        except ObjectExistsError:
            return  # content-addressed: these very bytes are stored, maybe for a committed version
        self.created.add(key)

    def finish(self) -> None:
        self.flush()
        try:
            while self._uploads:
                self._uploads.popleft().result()
        finally:
            self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop and remove what this attempt uploaded (it is referenced by nothing)."""
        for f in self._uploads:
            f.cancel()
        self._pool.shutdown(wait=True)
        for key in self.created:
            with contextlib.suppress(Exception):
                self.store.delete(key)
