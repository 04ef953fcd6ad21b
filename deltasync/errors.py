"""One exception hierarchy for deltasync.

Every error a user can cause derives from :class:`DeltasyncError` and carries the
structured fields that name what is wrong (version, tensor, chunk, key, path), so the
command line can print one clear line and library users can branch on fields. Where an
error is one of Python's own kinds it also derives from that built-in (a bad argument is a
``ValueError``, a missing version or object a ``LookupError``), so generic handlers work.
All of them are defined here and exported from ``deltasync``.
"""

from __future__ import annotations


class DeltasyncError(Exception):
    """Base of every deltasync error. ``exit_code`` is what the command line exits with."""

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(DeltasyncError, ValueError):
    """A bad argument or configuration value."""

    exit_code = 2


class RepositoryNotFoundError(DeltasyncError):
    def __init__(self, url: str) -> None:
        super().__init__(f"repository not found: {url} (no deltasync.json; publish to it first)")
        self.url = url


class RepositoryFormatError(DeltasyncError):
    """The repository was written by an incompatible deltasync."""


class VersionNotFoundError(DeltasyncError, LookupError):
    def __init__(self, version: int, url: str = "") -> None:
        where = f" in {url}" if url else ""
        super().__init__(f"version {version} not found{where}")
        self.version = version
        self.url = url


class EmptyRepositoryError(VersionNotFoundError):
    def __init__(self, url: str) -> None:
        super().__init__(0, url)
        self.message = f"repository {url} has no committed versions yet"


class VersionConflictError(DeltasyncError):
    """Another publisher committed the same version id first."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"version {version} was committed by another publisher first; "
            "nothing of this attempt is visible (retry to publish as the next version)"
        )
        self.version = version


class ObjectNotFoundError(DeltasyncError, LookupError):
    def __init__(self, key: str) -> None:
        super().__init__(f"object not found: {key}")
        self.key = key


class ObjectExistsError(DeltasyncError):
    def __init__(self, key: str) -> None:
        super().__init__(f"object already exists: {key}")
        self.key = key


class CorruptObjectError(DeltasyncError):
    """A stored object (manifest, pack, blob) cannot be parsed or is truncated."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"corrupt {what}: {detail}")
        self.what = what
        self.detail = detail


class ObjectTooLargeError(CorruptObjectError):
    """A stored object is larger than any valid object of its kind; it was not read."""

    def __init__(self, key: str, size: int | None, limit: int) -> None:
        found = f"{size} bytes" if size is not None else "more bytes"
        super().__init__(key, f"{found} is more than the {limit} a valid one can hold; not read")
        self.size = size
        self.limit = limit


class ObjectRangeError(CorruptObjectError):
    """A byte range runs past the end of the object: the request is wrong, or the object is
    shorter than whoever named the range expected (a relay answers OUT_OF_RANGE)."""


class ChecksumMismatchError(DeltasyncError):
    """Decoded bits do not match the digest recorded in the manifest."""

    def __init__(self, *, version: int, tensor: str, chunk: int, expected: str, actual: str) -> None:
        super().__init__(
            f"checksum mismatch in version {version}, tensor {tensor!r}, chunk {chunk}: "
            f"expected {expected}, got {actual}"
        )
        self.version = version
        self.tensor = tensor
        self.chunk = chunk
        self.expected = expected
        self.actual = actual


class CheckpointError(DeltasyncError):
    """A checkpoint directory or file is missing, not safetensors, or malformed."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


class MissingDependencyError(DeltasyncError, ImportError):
    """An optional dependency is not installed; ``extra`` names what to install."""

    def __init__(self, module: str, extra: str, what: str) -> None:
        super().__init__(f"{what} needs {module}, which is not installed: pip install 'deltasync[{extra}]'")
        self.module = module
        self.extra = extra


class StoreError(DeltasyncError):
    """A store backend failed (I/O error, permission, network)."""


class MissingReferencesError(StoreError):
    """A store refused a manifest because an object it names (a pack, a blob, a delta's parent
    manifest) is missing there: nothing was written (a writable relay checks them)."""


class CommittedError(StoreError):
    """Raised after a version's manifest was committed: the version exists (its id is
    ``version``), so nothing of it may be removed, but something went wrong with it."""

    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version


class SignatureError(DeltasyncError):
    """A manifest is unsigned, or its signature does not verify, while trusted keys are configured."""

    def __init__(self, version: int, detail: str) -> None:
        super().__init__(f"version {version}: {detail}")
        self.version = version
        self.detail = detail


class RefError(DeltasyncError):
    """``refs/latest`` or ``refs/pin`` cannot be trusted by a reader with trusted keys: unsigned,
    wrongly signed, expired, older than one already seen, or naming a missing manifest."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key = key
        self.detail = detail


class RepositoryIdentityError(DeltasyncError):
    """Something read from a repository belongs to another one: a manifest or signed ref naming
    another repository's identity, or a repository whose identity is not the one a copy or agent
    recorded on first contact (objects of another repository copied over it, or a repository
    deleted and created again at the same URL)."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"repository {url}: {detail}")
        self.url = url
        self.detail = detail


class HistoryError(RepositoryIdentityError):
    """A newer version whose history does not extend the version a copy, engine or agent holds
    (repo/history.py): a fork, such as another run copied over this one. Refused; the holder
    stays on its version."""


# -- local copies and pulls --------------------------------------------------------------------


class CopyInUseError(DeltasyncError):
    """Another process is changing this local copy (an agent following it, or a pull)."""

    def __init__(self, root: str, holder: str) -> None:
        super().__init__(f"{root} is in use by another deltasync process{holder}; stop it first")
        self.root = root


class PullStopped(DeltasyncError):
    """A pull stopped on request between chunks; its staged work is kept for a resume."""

    exit_code = 130

    def __init__(self, version: int) -> None:
        super().__init__(f"pull of version {version} stopped; running it again resumes it")
        self.version = version


# -- publishing from many ranks ----------------------------------------------------------------


class DistributedPublishError(DeltasyncError):
    """Publishing failed on some rank; nothing was committed."""

    def __init__(self, version: int | None, failures: dict[int, str]) -> None:
        first = min(failures)
        where = f"version {version}" if version is not None else "publish"
        more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        super().__init__(f"{where} failed on rank {first}: {failures[first]}{more}; nothing was committed")
        self.version = version
        self.failures = failures


# -- engines -----------------------------------------------------------------------------------


class EngineError(DeltasyncError):
    """An engine could not stage or swap a version; the version it serves is in ``serving``."""

    def __init__(self, message: str, *, version: int | None = None, serving: int | None = None) -> None:
        super().__init__(message)
        self.version = version
        self.serving = serving


class StaleUpdateError(EngineError):
    """A staged update was made against a version the engine no longer serves."""


class GroupError(EngineError):
    """The rank group failed (a rank died or timed out); this engine cannot be used again."""


class SparseVerifyError(DeltasyncError):
    """A parameter a vLLM worker patched (or restored) does not hold the bits it should
    (``engines/vllm/sparse.py``)."""


class InjectedFailure(DeltasyncError):
    """Raised by the vLLM backend's ``fail_after`` (tests): a load that fails part way."""
