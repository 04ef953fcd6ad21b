"""The upload half of the ``grpc://`` store: an object's bytes sent under the relay's credit.

A relay serving ``--accept-writes`` grants byte credit (``UploadCredit.send_until``) and the
client sends only within it, so the bytes of every upload in the relay's memory stay within
one budget (``deltasync/relay/uploads.py``). Two calls carry uploads:

* ``Upload``: one object per call; its credit counts the object's bytes from its start.
* ``UploadSession``: objects one after another on one call (:class:`UploadSession`), under
  credit counted over the whole call, which the relay keeps granting past each object while
  its budget is not wanted, so the next object's first bytes go out with its header.

Both send through one loop, :func:`credited_pieces` over a :class:`Credit`: send up to the
granted offset, wait for the next grant or the end of the call. :class:`~._grpc.GrpcStore`
chooses the call (session, else Upload, else the old Put) and fails over between relays.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import grpc

from ..v1 import relay_pb2 as pb
from .wire import CHUNK_BYTES, UPLOAD_CHECKS, UPLOAD_COMMITS, UPLOAD_WAITS

#: Opens a call given its request iterator (a bound client-streaming or bidi method).
OpenCall = Callable[[Iterator[pb.PutChunk]], Any]
#: Reads a call's answers on a helper thread (``_grpc._Stream``), raising its error.
ReadAnswers = Callable[[Any], Iterable[pb.UploadCredit]]

#: Codes a relay ends an upload session with when it refuses an object (wire.STATUS_CODES and
#: its own refusals: a token, a cap, a quota): it wrote none of the objects behind that one.
_REFUSALS = frozenset({
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})
#: Sessions an object is sent on that the relay ends before answering, then Upload.
SESSION_TRIES = 3
def _checks_references(metadata: Any) -> tuple[bool, bool, bool]:
    """Whether a relay's initial metadata says :data:`~.wire.UPLOAD_CHECKS`, and whether it also
    says :data:`~.wire.UPLOAD_WAITS` and :data:`~.wire.UPLOAD_COMMITS`."""
    key, value = UPLOAD_CHECKS
    said = [set(str(v).split(",")) for k, v in metadata or () if k == key]
    checks = any(set(value.split(",")) <= s for s in said)
    return checks, checks and any(UPLOAD_WAITS in s for s in said), checks and any(UPLOAD_COMMITS in s for s in said)


class Credit:
    """The credit of one call: the offset its bytes may be sent to, raised by the relay's
    grants (read on one thread), waited on by the request iterator (grpc's thread)."""

    def __init__(self) -> None:
        self._until = 0
        self._over = False
        self._changed = threading.Condition()
        self.waits = 0  # times the sender waited for a grant (for tests: counted, not timed)

    def grant(self, until: int) -> None:
        with self._changed:
            self._until = max(self._until, until)
            self._changed.notify_all()

    def stop(self) -> None:
        """The call is over: a sender waiting for a grant stops."""
        with self._changed:
            self._over = True
            self._changed.notify_all()

    @property
    def over(self) -> bool:
        return self._over

    def has_room(self, offset: int) -> bool:
        """Whether credit past ``offset`` is already granted."""
        with self._changed:
            return self._until > offset

    def beyond(self, offset: int) -> int | None:
        """The granted offset once it is past ``offset``; None once the call is over."""
        with self._changed:
            if self._until <= offset and not self._over:
                self.waits += 1
            while self._until <= offset and not self._over:
                self._changed.wait()
            return None if self._over else self._until


def credited_pieces(view: memoryview, offset: int, credit: Credit, at: int) -> Iterator[pb.PutChunk]:
    """``view[offset:]`` in pieces of at most :data:`CHUNK_BYTES`, never past ``credit``;
    ``at`` is the credit offset of ``view[offset]``. Stops early once the call is over."""
    size = len(view)
    while offset < size:
        until = credit.beyond(at)
        if until is None:
            return
        while offset < size and at < until:
            n = min(CHUNK_BYTES, size - offset, until - at)
            yield pb.PutChunk(data=bytes(view[offset : offset + n]))
            offset += n
            at += n


def upload(open_call: OpenCall, read: ReadAnswers, header: pb.PutChunk, view: memoryview) -> None:
    """One Upload call: the header, then the object's bytes as the relay grants credit;
    returns once it is stored (the call ends OK), raises its error otherwise."""
    credit = Credit()

    def requests() -> Iterator[pb.PutChunk]:  # consumed by grpc on a thread of its own
        yield header
        yield from credited_pieces(view, len(header.data), credit, len(header.data))

    call = open_call(requests())
    try:
        for grant in read(call):
            credit.grant(grant.send_until)
    finally:
        credit.stop()
        call.cancel()


class SessionFailed(grpc.RpcError):  # type: ignore[misc]
    """An upload session's failure as an RpcError, for the failover (a deadline, mostly)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Stored(NamedTuple):
    """A relay's answer to an object on an upload session: stored; for a manifest committed at
    the relay (``commit_latest``), the packs and blobs it names found gone after the write,
    unless ``checked`` is False (the relay could not look: the writer checks itself)."""

    gone: list[str]
    checked: bool = True


class UploadSession:
    """One UploadSession call: objects sent one after another, their bytes under one
    :class:`Credit` counted over the call (header data aside). Several threads may
    :meth:`put` on one session at once: objects are *pipelined*, each sent as soon as the one
    before it is (under the credit), not once it is answered ``stored``; the relay takes them
    in order and answers each in order, so an object's answer is the ``stored`` count that
    reaches its place. A stream then idles no round trip between objects, and the relay's
    credit still bounds the bytes on their way. Its answers are read on a helper thread; the
    request iterator runs on grpc's."""

    def __init__(self, open_call: OpenCall, read: ReadAnswers,
                 on_checks: Callable[[bool, bool], None] | None = None) -> None:
        """``on_checks``: called once the relay says (in the call's initial metadata) that it
        refuses a manifest whose packs, blobs or delta parent are missing; with True first when
        it also waits for the uploads of those it is receiving (:data:`~.wire.UPLOAD_WAITS`),
        and second when it commits manifests sent so (:data:`~.wire.UPLOAD_COMMITS`)."""
        self._on_checks = on_checks
        self._jobs: queue.SimpleQueue[tuple[pb.PutChunk, memoryview] | None] = queue.SimpleQueue()
        self._credit = Credit()
        self._changed = threading.Condition()
        self._sent = 0  # credited bytes sent (header data aside)
        self._queued = 0  # objects handed to the request iterator
        self._stored = 0  # objects the relay answered stored
        self._gone: dict[int, list[str] | None] = {}  # by answer (1: the first's): a commit's missing objects (None: unchecked)
        self._over = False  # the call ended (OK: the relay ended it; else _error)
        self._error: grpc.RpcError | None = None
        self._closed_here = False  # ended by close() (a deadline, or the store closing), not by the relay
        self.pending_bytes = 0  # bytes of objects put and not yet answered
        self.taken = False  # handed out for a put that has not counted its bytes yet (GrpcStore)
        self.most_pending = 0  # for tests: the most objects put and not yet answered at once
        self.headers_sent = 0  # for tests: headers sent, and of them those with credit already there
        self.headers_with_credit = 0
        self._call = open_call(self._requests())
        threading.Thread(target=self._read, args=(read,), name="deltasync-upload-session", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._over

    @property
    def credit_waits(self) -> int:
        """Times the request iterator waited for a grant."""
        return self._credit.waits

    def _read(self, read: ReadAnswers) -> None:
        error: grpc.RpcError | None = None
        try:
            checks, waits, commits = _checks_references(self._call.initial_metadata())
            if self._on_checks is not None and checks:
                self._on_checks(waits, commits)
            for answer in read(self._call):
                self._credit.grant(answer.send_until)
                with self._changed:
                    if answer.gone or answer.unchecked:
                        self._gone[answer.stored] = None if answer.unchecked else list(answer.gone)
                    self._stored = max(self._stored, answer.stored)
                    self._changed.notify_all()
        except grpc.RpcError as e:
            error = e
        except BaseException as e:  # handed to the uploader
            error = SessionFailed(grpc.StatusCode.UNKNOWN, str(e))
        self._end(error)

    def _end(self, error: grpc.RpcError | None) -> None:
        with self._changed:
            if not self._over:
                self._over, self._error = True, error
            self._changed.notify_all()
        self._credit.stop()
        self._jobs.put(None)  # grpc's thread reading the requests returns (else it waits for ever)

    def _requests(self) -> Iterator[pb.PutChunk]:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            header, view = job
            self.headers_sent += 1
            self.headers_with_credit += self._credit.has_room(self._sent)
            yield header
            yield from credited_pieces(view, len(header.data), self._credit, self._sent)
            if self._credit.over:
                return
            self._sent += len(view) - len(header.data)
            del job, header, view

    def put(self, header: pb.PutChunk, view: memoryview, timeout: float) -> bool:
        """:meth:`answered`: whether it was stored."""
        return self.answered(header, view, timeout) is not None

    def answered(self, header: pb.PutChunk, view: memoryview, timeout: float) -> Stored | None:
        """Send one object (after those put before it) and wait for the relay's answer: once
        stored, the objects its answer names gone (a manifest committed at the relay,
        ``commit_latest``; else none), None when the relay ended the call first (not written,
        "False" below); its error,
        raised, when the call failed on it. A call that fails ends on the first object not
        answered (the relay takes them in order): that one gets the error; when the relay
        refused it, those behind it were not written and get False (sent again on another
        call); when the call broke, or this side closed it, the others may have been stored
        and raise UNAVAILABLE (failed over: the retry finds our own bytes there). ``timeout``: the
        longest the session may go without storing an object (this one or one before it)
        while this one waits."""
        deadline = time.monotonic() + timeout
        size = len(view)
        with self._changed:
            if self._over:
                return None
            place = self._queued  # answered once the relay has stored place + 1 objects
            self._queued += 1
            self.pending_bytes += size + 1  # never 0 while it waits, even for an empty object
            self.taken = False
            self.most_pending = max(self.most_pending, self._queued - self._stored)
            self._jobs.put((header, view))  # under the lock: the queue's order is the places' order
        try:
            with self._changed:
                progress = self._stored
                while self._stored <= place and not self._over:
                    if self._stored > progress:  # an object before it was stored: the session moves
                        progress, deadline = self._stored, time.monotonic() + timeout
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                if self._stored > place:
                    gone = self._gone.pop(place + 1, [])
                    return Stored([], checked=False) if gone is None else Stored(gone)
                error, over, unknown = self._error, self._over, False
                if over and self._closed_here:
                    # This side ended the call (another object's deadline, the store closing):
                    # the relay may have stored this one, its answer still on its way.
                    unknown, error = True, None
                elif over and place > self._stored:
                    # The call ended on an object before this one. The relay's own word (it
                    # ended the call, or refused that object) means it wrote none behind it:
                    # not written. A call that broke (a transport error) may have stored it.
                    unknown = error is not None and error.code() not in _REFUSALS
                    error = None
        finally:
            with self._changed:
                self.pending_bytes -= size + 1
        if not over:
            self.close()
            raise SessionFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout:g} s")
        if unknown:  # failed over as a lost answer: the retry finds our own bytes there (_holds)
            raise SessionFailed(grpc.StatusCode.UNAVAILABLE,
                                "the upload session ended before this object's answer (it may be stored)")
        if error is not None:
            raise error
        return None

    def close(self) -> None:
        with self._changed:
            self._closed_here = self._closed_here or not self._over
        self._end(None)
        self._call.cancel()
