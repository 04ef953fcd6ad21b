"""A repository: the layout of versions inside a Store, and the commit protocol.

Layout (all keys relative to the store root)::

    deltasync.json                  format marker and the repository's identity, written once
    packs/<xxh3-128>.pack           immutable, content-addressed encoded chunks
    blobs/<xxh3-128>                zstd of one part of a non-tensor file, content-addressed
    manifests/<version:020d>.pb     one per committed version: its presence is the commit
    squashes/<C:020d>-<A:020d>.pb   optional: version C as a delta against version A (see squash.py)
    refs/latest                     the newest committed version id (a hint; manifests rule)
    refs/pin                        optional: the version subscribers should serve instead (see pin)
    leases/<32 hex>.json            a publish in flight, renewed while it runs: gc deletes no pack or
                                    blob while one is live (repo/leases.py)
    history/<version:020d>.json     the history digests of a version gc deleted (repo/history.py)

Commit order (DESIGN.md invariant 2): packs and blobs, then the manifest with a conditional
put, then ``refs/latest``. A reader only trusts versions whose manifest exists.

Refs come in two forms. An unsigned repository writes ``"<id>\n"``, as always. A publisher
with a signing key writes a signed ref instead: one line of JSON naming the ref, the version
(``null``: a cleared pin), a counter that only grows, when it was issued and when it expires,
and the xxh3-128 of the named manifest's bytes, signed with ed25519 (format/signing.py). A
reader with trusted keys (TUF's timestamp and snapshot roles, in small) refuses a ref that is
unsigned, wrongly signed, expired (beyond ``ref_grace``), older than one it has seen
(``ref_memory``: an agent keeps the highest counter per ref in its copy's state), or naming a
manifest that is missing or other than the one signed; and a pin that is missing or older than
the one it has seen or the one the signed ``refs/latest`` names (its ``pin_counter``).
So a store writer can neither roll a trusting subscriber back with an old or unsigned pin, nor
freeze it unnoticed by withholding the newest manifest or replaying an old ``refs/latest``:
at worst it stops updates, and that is an error on the subscriber, not silence. A quiet
publisher keeps its refs fresh with :meth:`Repository.refresh_refs` (``deltasync refresh-refs``).

**Identity.** A repository is created with an identity: 16 random bytes, the ``"id"`` of
``deltasync.json`` (``{"format": 1, "id": "<32 hex>"}``), so one deleted and created again at
the same URL is another repository. Every manifest names it (``repository_id``) and every
signed ref too (``"repository"``), both covered by their signatures: one key signing many
repositories (one key per team, many runs) cannot have a version, a ref or a chain of one
accepted as another's. A reader refuses (RepositoryIdentityError) a manifest naming another
identity than the marker's, a chain mixing identities, and, with trusted keys, a signed ref
naming another identity or none while the repository has one. A copy or an agent records the
identity it holds (local/state.py) and compares it, with the version digest, before calling
itself current; with trusted keys it refuses a repository at the same URL whose identity
changed (objects of another repository copied over it). A repository created before
identities has a marker without ``"id"``: its next publisher (:meth:`Repository.create`) writes
one, derived from the stored bytes of its oldest manifest so that racing publishers write the
same; versions committed before then name none and are read as before (bound by their
signature and the refs' manifest digests only), and a signing publisher's first version that
names the identity is a snapshot (publish/commit.py ``signing_policy``), so that no chain
mixes them. A repository whose marker was lost (deleted by hand, a partial copy) gets it
back from its next publisher with the identity its manifests name (the oldest and the
newest; derived as above when they name none); when they name two, the publish is refused
with one line and nothing is written: a new identity is never written over versions that
name another, which would make every reader refuse them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import zstandard
from google.protobuf.message import DecodeError

from ..errors import (
    CorruptObjectError,
    DeltasyncError,
    EmptyRepositoryError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    RefError,
    RepositoryFormatError,
    RepositoryIdentityError,
    RepositoryNotFoundError,
    SignatureError,
    StoreError,
    UsageError,
    VersionConflictError,
    VersionNotFoundError,
)
from ..format.codec import FULL
from ..format.digest import digest
from ..format.manifest import (
    BLOB_PART_SIZE,
    MAX_MANIFEST_BYTES,
    ManifestInfo,
    key_of,
    manifest_key,
    parse_manifest,
    seal,
    seal_history,
    serialize,
    version_from_key,
)
from ..format.signing import (
    PrivateKeyLike,
    PublicKeyLike,
    TrustedKeys,
    load_signing_key,
    ref_signed_by,
    sign_manifest,
    sign_ref,
)
from ..storage import Store, open_store
from ..v1 import manifest_pb2 as pb
from .history import _read_record, history_key

REPO_FORMAT = 1
MARKER = "deltasync.json"
LATEST = "refs/latest"
PIN = "refs/pin"
BLOB_PART_BYTES = BLOB_PART_SIZE  # bytes of every part of a non-tensor file but its last
MAX_MARKER_BYTES = 4096  # deltasync.json is '{"format": 1, "id": "..."}': anything much larger is not one
#: Bytes of a repository's identity (deltasync.json "id", a manifest's repository_id).
IDENTITY_BYTES = 16
REF_KEYS = {"latest": LATEST, "pin": PIN}
#: A ref is a few hundred bytes; a larger object is not one (and is refused before parsing).
MAX_REF_BYTES = 4096
#: How long a signed ref stays valid (seconds) unless the publisher chooses otherwise.
DEFAULT_REF_TTL = 7 * 24 * 3600.0
#: Counters stay far below where JSON readers lose integer precision.
_MAX_COUNTER = (1 << 53) - 1

log = logging.getLogger(__name__)
_warned: set[tuple[str, str, int]] = set()  # (url, key, counter or version) already warned of: once, not per poll


def blob_key(d: bytes) -> str:
    return f"blobs/{d.hex()}"


SQUASHES = "squashes/"


def squash_key(a: int, c: int) -> str:
    """Key of the squash that takes version ``a`` to version ``c``."""
    return f"{SQUASHES}{c:020d}-{a:020d}.pb"


def squash_from_key(key: str) -> tuple[int, int] | None:
    """(a, c) of a squash key, or None for any other key."""
    m = re.fullmatch(r"squashes/(\d{20})-(\d{20})\.pb", key)
    return (int(m.group(2)), int(m.group(1))) if m else None


#: Every name of the layout (module doc), and gc's record of what it found unreferenced
#: (``gc/pending.json``, ops/retention.py): what a writer of a repository writes, and nothing
#: else (not a store's own temp files such as ``packs/<x>.pack.tmp-deltasync``).
_LAYOUT_KEY = re.compile(
    r"packs/[0-9a-f]{32}\.pack|blobs/[0-9a-f]{32}|manifests/\d{20}\.pb|squashes/\d{20}-\d{20}\.pb"
    r"|refs/latest|refs/pin|deltasync\.json|gc/pending\.json|leases/[0-9a-f]{32}\.json|history/\d{20}\.json"
)
LAYOUT_NAMES = (
    "packs/<xxh3>.pack, blobs/<xxh3>, manifests/<version>.pb, squashes/<C>-<A>.pb, refs/latest, refs/pin, "
    "deltasync.json, leases/<id>.json, history/<version>.json, gc/pending.json"
)


def is_layout_key(key: str) -> bool:
    """Whether ``key`` is a name of a repository's layout (:data:`LAYOUT_NAMES`)."""
    return _LAYOUT_KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class Ref:
    """What ``refs/latest`` or ``refs/pin`` says (see the module doc for the two forms)."""

    name: str  # "latest" or "pin"
    version: int | None  # None: a cleared pin
    signed: bool = False
    counter: int = 0
    issued_unix: int = 0
    expires_unix: int = 0
    manifest_digest: bytes = b""  # xxh3-128 of the named manifest's stored bytes
    body: Mapping[str, Any] | None = None  # the parsed signed ref, for signature checks
    pin_counter: int = 0  # latest only: the counter of the signed pin when it was signed (0: none)

    @property
    def key(self) -> str:
        return REF_KEYS[self.name]

    def describe(self) -> str:
        what = f"version {self.version}" if self.version is not None else "no version (cleared)"
        return f"{what}, counter {self.counter}" if self.signed else f"{what} (unsigned)"


def parse_ref(name: str, raw: bytes) -> Ref:
    """Either form of a ref; CorruptObjectError when it is neither. Checks nothing else: a
    signed ref's signature, expiry and counter are the reader's to check (Repository.read_ref)."""
    key = REF_KEYS[name]
    if len(raw) > MAX_REF_BYTES:
        raise CorruptObjectError(key, f"{len(raw)} bytes is larger than any ref")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CorruptObjectError(key, f"not a ref: {raw[:40]!r}") from None
    if not text.startswith("{"):
        if not text:
            return Ref(name, None)
        if not text.isdigit() or len(text) > 19:
            raise CorruptObjectError(key, f"not a version id: {raw[:40]!r}")
        return Ref(name, int(text) or None)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise CorruptObjectError(key, "not a ref: unreadable JSON") from None

    def number(field: str, *, nullable: bool = False) -> int | None:
        value = body.get(field)
        if value is None and nullable:
            return None
        if type(value) is not int or not 0 <= value <= _MAX_COUNTER:  # bools are ints: refused
            raise CorruptObjectError(key, f"signed ref has a bad {field!r}")
        return value

    if not isinstance(body, dict) or body.get("format") != 1 or body.get("name") != name:
        raise CorruptObjectError(key, f"not a signed {name} ref (format 1)")
    version = number("version", nullable=True)
    if version == 0 or (version is None and name == "latest"):
        raise CorruptObjectError(key, "signed ref names no valid version")
    try:
        whole = bytes.fromhex(str(body.get("manifest") or ""))
    except ValueError:
        raise CorruptObjectError(key, "signed ref has a bad 'manifest' digest") from None
    if len(whole) not in ((0,) if version is None else (16,)):
        raise CorruptObjectError(key, "signed ref has a bad 'manifest' digest")
    counter, issued, expires = number("counter"), number("issued_unix"), number("expires_unix")
    assert counter is not None and issued is not None and expires is not None
    pin_counter = number("pin_counter") if name == "latest" and "pin_counter" in body else 0
    return Ref(name, version, True, counter, issued, expires, whole, body, pin_counter or 0)


def _is_signed(store: Store) -> bool:
    """Whether the repository's ``refs/latest`` is a signed ref (its publisher signs)."""
    try:
        return parse_ref("latest", store.get(LATEST, max_bytes=MAX_REF_BYTES)).signed
    except (ObjectNotFoundError, CorruptObjectError):
        return False


def ref_hint(raw: bytes) -> int | None:
    """The version a ref names, unchecked (a hint for readers without keys, and relays);
    None when it names none or cannot be read."""
    try:
        return parse_ref("latest", raw).version
    except CorruptObjectError:
        try:
            return parse_ref("pin", raw).version
        except CorruptObjectError:
            return None


class RefMemory(Protocol):
    """Where a reader keeps the newest signed refs it has accepted, per ref name."""

    def seen_ref(self, name: str) -> tuple[int, int | None] | None:
        """(counter, version) of the newest accepted ``name`` ref, or None."""

    def saw_ref(self, name: str, counter: int, version: int | None) -> None:
        """Record an accepted ref (kept only if its counter is the highest so far)."""


class MemoryRefs:
    """A :class:`RefMemory` for one process (an agent keeps its own in the copy's state)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int | None]] = {}
        self._lock = threading.Lock()

    def seen_ref(self, name: str) -> tuple[int, int | None] | None:
        with self._lock:
            return self._seen.get(name)

    def saw_ref(self, name: str, counter: int, version: int | None) -> None:
        with self._lock:
            held = self._seen.get(name)
            if held is None or counter > held[0]:
                self._seen[name] = (counter, version)


def open_repository(
    repo: Store | str | Repository,
    *,
    signing_key: PrivateKeyLike | None = None,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
) -> Repository:
    """``repo`` as a Repository with these keys (a Repository passed in keeps its own)."""
    if isinstance(repo, Repository):
        if signing_key is not None or trusted_keys is not None:
            raise UsageError("give signing_key / trusted_keys to the Repository, not alongside it")
        return repo
    return Repository(repo, signing_key=signing_key, trusted_keys=trusted_keys)


class Repository:
    """Versions in a store. Safe for one publisher and many concurrent readers."""

    def __init__(
        self,
        store: Store | str,
        *,
        signing_key: PrivateKeyLike | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        ref_ttl: float = DEFAULT_REF_TTL,
        ref_grace: float = 0.0,
        ref_memory: RefMemory | None = None,
    ) -> None:
        """``signing_key`` (an ed25519 key or its PEM file) signs every manifest committed here,
        and the refs (valid ``ref_ttl`` seconds). With ``trusted_keys`` (one or several: key
        rotation; none or empty: no check) a manifest is refused with SignatureError unless one
        of them signed it, before it is used; and refs with RefError unless signed, unexpired
        (``ref_grace`` seconds past their expiry are accepted with a warning) and no older than
        the newest in ``ref_memory`` (default: this object's own)."""
        if not ref_ttl > 0 or not ref_grace >= 0:
            raise UsageError(f"ref_ttl must be positive and ref_grace not negative, got {ref_ttl}, {ref_grace}")
        self.store = open_store(store) if isinstance(store, str) else store
        self.url = self.store.url
        self.signing_key = load_signing_key(signing_key) if signing_key is not None else None
        trusted = TrustedKeys.of(trusted_keys) if trusted_keys is not None else None
        self.trusted_keys = trusted or None
        self.ref_ttl = ref_ttl
        self.ref_grace = ref_grace
        self.ref_memory: RefMemory = ref_memory if ref_memory is not None else MemoryRefs()
        # Parsed manifests, most recently used last; bounded, so that an agent following a
        # repository for weeks does not keep every version it ever read.
        self._manifests: OrderedDict[int, ManifestInfo] = OrderedDict()
        self._squashes: OrderedDict[tuple[int, int], ManifestInfo] = OrderedDict()
        self._lock = threading.Lock()
        self._identity: tuple[bytes | None] | None = None  # (identity,) once read
        self._assumed = False  # the identity was given (assume_identity), not read
        self._created = False  # create() succeeded through this object: later calls cost no round trip

    # -- existence ---------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.store.exists(MARKER)

    def ensure_exists(self) -> None:
        """Raise RepositoryNotFoundError / RepositoryFormatError unless this is a repository."""
        self._read_marker()

    def _read_marker(self) -> bytes | None:
        """Check ``deltasync.json`` and return the identity it names (None: created before identities)."""
        try:
            raw = self.store.get(MARKER, max_bytes=MAX_MARKER_BYTES)
        except ObjectNotFoundError:
            raise RepositoryNotFoundError(self.url) from None
        try:
            marker = json.loads(raw)
            fmt = marker["format"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise CorruptObjectError(MARKER, "not a deltasync repository marker") from None
        if fmt != REPO_FORMAT:
            raise RepositoryFormatError(f"repository {self.url} has format {fmt}; this deltasync reads {REPO_FORMAT}")
        found = marker.get("id")
        if found is None:
            return None
        try:
            identity = bytes.fromhex(found) if isinstance(found, str) else b""
        except ValueError:
            identity = b""
        if len(identity) != IDENTITY_BYTES:
            raise CorruptObjectError(MARKER, f"the repository identity is not {IDENTITY_BYTES} bytes of hex")
        return identity

    def identity(self) -> bytes | None:
        """The repository's identity (``deltasync.json`` "id", see the module doc); None for a
        repository created before identities, or none at all. Read once per Repository."""
        with self._lock:
            if self._identity is not None:
                return self._identity[0]
        try:
            found = self._read_marker()
        except RepositoryNotFoundError:
            return None  # not cached: the publisher may create it
        with self._lock:
            self._identity = (found,)
        return found

    def assume_identity(self, identity: bytes | None) -> None:
        """Take ``identity`` as the repository's without reading the marker: one that the caller
        read from it recently (an agent reads it on every look, and keeps objects by it)."""
        with self._lock:
            self._identity = (identity,)
            self._assumed = True

    def create(self) -> None:
        """Mark the store as a repository with a new identity (idempotent); a repository of
        older deltasync, without one, gets one here, and one whose marker was lost gets back
        the identity its manifests name (see the module doc)."""
        if self._created:
            return  # the marker is there (a publisher asks before every version: one round trip less)
        marker: dict[str, Any] = {"format": REPO_FORMAT}
        written = False  # the marker is the one written here: its identity is known
        # The listing a marker without an identity needs is read beside it (one round trip).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-create") as pool:
            listing = pool.submit(self.versions)
            try:
                found = self._read_marker()
                absent = False
            except RepositoryNotFoundError:
                found, absent = None, True
            finally:
                listed = listing.exception() is None
        if absent:
            versions = listing.result() if listed else self.versions()
            # Never a new identity over versions naming one: they would all be refused as
            # another repository's (issue 33). A repository without versions gets a new one.
            marker["id"] = (_identity_from_manifests(self, versions) if versions
                            else secrets.token_bytes(IDENTITY_BYTES).hex())
            try:
                self.store.put(MARKER, json.dumps(marker).encode(), if_absent=True)
            except ObjectExistsError:
                pass  # another publisher wrote it meanwhile: read below
            else:
                written = True
                if versions:
                    log.warning("repository %s had lost %s: its identity %s is restored from its manifests",
                                self.url, MARKER, marker["id"])
        else:
            if found is not None:
                with self._lock:
                    self._identity, self._assumed = (found,), False
                self._created = True
                return
            versions = listing.result() if listed else self.versions()
            # Racing publishers upgrading the same repository write the same identity.
            marker["id"] = (_derived_identity(self, versions[0]) if versions
                            else secrets.token_bytes(IDENTITY_BYTES).hex())
            self.store.put(MARKER, json.dumps(marker).encode())
            log.info("repository %s had no identity (created by older deltasync): it is %s from now on", self.url,
                     marker["id"])
        with self._lock:
            # Read again (what the store holds now), unless it is the marker written here.
            self._identity = (bytes.fromhex(marker["id"]),) if written else None
            self._assumed = False
        self._created = True

    def _check_identity(self, info: ManifestInfo, what: str) -> None:
        """A manifest naming an identity must name this repository's (module doc)."""
        named = info.pb.repository_id
        if not named:
            return
        mine = self.identity()
        if mine is not None and named != mine:
            raise RepositoryIdentityError(self.url, f"{what} belongs to repository {named.hex()}, not to this one "
                                          f"({mine.hex()}): an object of another repository, refused")

    # -- versions ----------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Committed version ids, ascending."""
        out = [v for k in self.store.list("manifests/") if (v := version_from_key(k)) is not None]
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed version, or None for an empty repository. With trusted keys,
        ``refs/latest`` must be a valid signed ref (RefError otherwise, see the module doc)."""
        if self.trusted_keys is not None:
            return self._trusted_latest()
        return self._listed_latest()

    def _listed_latest(self) -> int | None:
        # The ref and the listing are read together (one round trip, not two: a publisher
        # asks before every version). A ref naming a version the listing missed was written
        # after it, by a commit in between: listed again once, it is there.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-ref") as pool:
            reading = pool.submit(self._ref_hint)
            versions = self.versions()
            hint = reading.result()
        if hint and hint not in versions and (not versions or hint > versions[-1]):
            versions = self.versions()
        # The ref is a hint: a publisher may die between manifest and ref. Manifests rule.
        newest = versions[-1] if versions else None
        if newest is None:
            return None
        if hint > newest and (self.url, LATEST, hint) not in _warned:
            # A ref is written after its manifest, and gc keeps the latest: only a deletion
            # gets here. Without keys nothing stops serving the newest listed, but say so.
            _warned.add((self.url, LATEST, hint))
            log.warning("refs/latest names version %d, whose manifest is missing (deleted or withheld?); the newest "
                        "listed is %d", hint, newest)
        return max(newest, hint) if hint in versions else newest

    def _ref_hint(self) -> int:
        try:
            return ref_hint(self.store.get(LATEST, max_bytes=MAX_REF_BYTES)) or 0
        except (ObjectNotFoundError, ObjectTooLargeError):  # no hint, or none readable
            return 0

    def _trusted_latest(self) -> int | None:
        ref = self.read_ref("latest")  # before listing: a ref is written after its manifest
        versions = self.versions()
        if ref is None:
            if versions:
                raise RefError(LATEST, "is missing, and a trusted key is configured: the newest version cannot "
                               "be told apart from a withheld one (the publisher writes it on every commit)")
            return None
        assert ref.version is not None  # parse_ref: a latest ref names a version
        if ref.version not in versions:
            raise RefError(LATEST, f"names {ref.describe()}, whose manifest is missing: the newest version is "
                           "withheld or deleted from the store")
        self.accept_ref(ref)
        newest = versions[-1]
        if newest > ref.version:
            # A publisher died between its manifest and its ref: the newer manifest is signed
            # (checked here), so serving it moves forward, never back.
            self.manifest(newest)
            return newest
        return ref.version

    def latest_ref(self) -> int | None:
        """The version ``refs/latest`` names, checked as :meth:`latest` checks it but without
        listing the manifests (cheap enough to poll); None when there is no ref. Without
        trusted keys, the unchecked hint."""
        if self.trusted_keys is None:
            try:
                return ref_hint(self.store.get(LATEST, max_bytes=MAX_REF_BYTES))
            except (ObjectNotFoundError, ObjectTooLargeError):
                return None
        ref = self.read_ref("latest")
        if ref is None:
            return None
        self.accept_ref(ref)
        return ref.version

    # -- refs: reading, checking, writing ----------------------------------------------------

    def read_ref(self, name: str) -> Ref | None:
        """``refs/<name>`` parsed (None when absent); with trusted keys, checked: signed by one
        of them, unexpired (a warning within ``ref_grace``), no older than the newest seen."""
        key = REF_KEYS[name]
        try:
            raw = self.store.get(key, max_bytes=MAX_REF_BYTES)  # never read a hostile 2 GiB ref whole
        except ObjectNotFoundError:
            return None
        ref = parse_ref(name, raw)
        trusted = self.trusted_keys
        if trusted is None:
            return ref
        try:
            if not ref.signed or ref.body is None:
                raise RefError(key, f"is unsigned (it names {ref.describe().removesuffix(' (unsigned)')}) and a trusted "
                               "key is configured: refusing it "
                               "(a publisher with a signing key signs its refs; `deltasync refresh-refs` signs old ones)")
            trusted.verify_ref(key, ref.body)
            self._check_ref_identity(ref)
        except RefError:
            if ref.version is not None:
                # A repository not signed by our keys says so best through its manifest's refusal.
                with contextlib.suppress(VersionNotFoundError, CorruptObjectError):
                    self.manifest(ref.version)
            raise
        now = time.time()
        if now > ref.expires_unix:
            late = now - ref.expires_unix
            expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ref.expires_unix))
            if late > self.ref_grace:
                raise RefError(key, f"expired at {expired} ({late:.0f}s ago; {ref.describe()}): the publisher "
                               "re-signs it on every publish and pin, and with `deltasync refresh-refs`")
            if (self.url, key, ref.counter) not in _warned:  # once per ref, not once per poll
                _warned.add((self.url, key, ref.counter))
                log.warning("%s expired at %s (%.0fs ago); accepted within the %.0fs grace: run `deltasync "
                            "refresh-refs` on the publisher", key, expired, late, self.ref_grace)
        seen = self.ref_memory.seen_ref(self._remembered(name))
        if seen is not None:
            counter, version = seen
            if ref.counter < counter:
                shown = f"version {version}" if version is not None else "no version"
                raise RefError(key, f"is older than one already seen ({ref.describe()}; seen counter {counter}, "
                               f"{shown}): a replayed ref, refused")
            if ref.counter == counter and ref.version != version:
                raise RefError(key, f"names {ref.describe()}, but counter {counter} named version {version}")
        return ref

    def _check_ref_identity(self, ref: Ref) -> None:
        """A signed ref must name this repository's identity, and must name one when it has one."""
        assert ref.body is not None
        named, mine = ref.body.get("repository"), self.identity()
        if mine is None:
            if named is not None:
                raise RepositoryIdentityError(self.url, f"{ref.key} names repository {str(named)[:40]!r}, but this "
                                              "repository has no identity: a ref of another repository, refused")
            return
        if named is None:
            raise RefError(ref.key, f"names no repository (it names {ref.describe()}) while this repository has "
                           f"identity {mine.hex()}: a ref from before identities or of another repository; the "
                           "publisher's next publish or `deltasync refresh-refs` signs one naming it")
        if named != mine.hex():
            raise RepositoryIdentityError(self.url, f"{ref.key} names repository {str(named)[:40]}, not this one "
                                          f"({mine.hex()}): a ref of another repository, refused")

    def _remembered(self, name: str) -> str:
        """The name the newest accepted ``name`` ref is remembered under: per repository
        identity, so a copy moved to another repository (pulled from another URL) is not held
        to the first one's counters; refs of one repository name it, so nothing is lost."""
        identity = self.identity()
        return f"{name}@{identity.hex()}" if identity is not None else name

    def accept_ref(self, ref: Ref) -> None:
        """Check that a signed ref's version is committed with the manifest it signed, then
        remember it (later refs must be at least as new). Without trusted keys: nothing."""
        if self.trusted_keys is None or not ref.signed:
            return
        if self.ref_memory.seen_ref(self._remembered(ref.name)) == (ref.counter, ref.version):
            # Accepted before, manifest checked then: a poll costs no manifest read. A manifest
            # deleted since is noticed by the listing (latest) or when the version is read.
            return
        if ref.version is not None:
            try:
                info = self.manifest(ref.version)
            except VersionNotFoundError:
                raise RefError(ref.key, f"names {ref.describe()}, whose manifest is missing: withheld or deleted "
                               "from the store") from None
            if digest(serialize(info.pb)) != ref.manifest_digest:
                raise RefError(ref.key, f"names {ref.describe()} with another manifest than the one stored")
        self.ref_memory.saw_ref(self._remembered(ref.name), ref.counter, ref.version)

    def _own_ref(self, name: str) -> Ref | None:
        """Our signing key's own ref ``name`` as stored, None when absent, unsigned or not ours."""
        assert self.signing_key is not None
        try:
            ref = parse_ref(name, self.store.get(REF_KEYS[name], max_bytes=MAX_REF_BYTES))
        except (ObjectNotFoundError, CorruptObjectError):
            return None
        if not ref.signed or ref.body is None or not ref_signed_by(ref.body, self.signing_key.public_key()):
            return None
        return ref

    def _write_ref(self, name: str, version: int | None) -> None:
        """Write ``refs/<name>``: plain without a signing key (None: delete it), else signed."""
        key = REF_KEYS[name]
        if self.signing_key is None:
            if name == "pin" and _is_signed(self.store):
                raise UsageError("this repository's refs are signed: sign the pin with the publisher's key "
                                 "(--signing-key); subscribers with trusted keys refuse an unsigned one")
            if version is None:
                self.store.delete(key)
            else:
                self.store.put(key, f"{version}\n".encode())
            return
        # Higher than any counter of ours in the store, and at least the time in milliseconds,
        # so a store rolled back under the publisher does not make it reuse counters.
        own_pin = self._own_ref("pin")
        own = [r.counter + 1 for r in (self._own_ref("latest"), own_pin) if r is not None]
        counter = min(max([time.time_ns() // 1_000_000, *own]), _MAX_COUNTER)
        now = int(time.time())
        whole = digest(serialize(self.manifest(version).pb)).hex() if version is not None else ""
        body: dict[str, Any] = {"format": 1, "name": name, "version": version, "counter": counter, "issued_unix": now,
                                "expires_unix": now + max(1, round(self.ref_ttl)), "manifest": whole}
        identity = self.identity()
        if identity is not None:
            body["repository"] = identity.hex()  # signed with the rest: a ref of this repository only
        if name == "latest":
            # TUF's snapshot role, in small: the latest ref names the pin it goes with, so even a
            # reader that has seen no pin yet refuses a deleted or older one. The pin is always
            # written before the latest ref that names it.
            body["pin_counter"] = own_pin.counter if own_pin is not None else 0
        signed = sign_ref(body, self.signing_key)
        self.store.put(key, (json.dumps(signed, sort_keys=True, separators=(",", ":")) + "\n").encode())

    def refresh_refs(self) -> tuple[int | None, int | None]:
        """Re-sign ``refs/latest`` (and ``refs/pin``, if one of ours) with a new counter and
        expiry: what a publisher that has nothing new to publish runs within every ``ref_ttl``.
        Returns (latest, pinned)."""
        if self.signing_key is None:
            raise UsageError("refreshing refs needs the publisher's signing key")
        self.ensure_exists()
        own_latest = self._own_ref("latest")
        listed = self._listed_latest()
        if own_latest is not None and own_latest.version is not None and own_latest.version not in self.versions():
            raise RefError(LATEST, f"names {own_latest.describe()}, whose manifest is missing: refusing to sign an "
                           "older latest (that would hide it); restore the manifest or publish again")
        latest = max((v for v in (listed, own_latest.version if own_latest else None) if v is not None), default=None)
        pinned: int | None = None
        try:
            pin: Ref | None = parse_ref("pin", self.store.get(PIN, max_bytes=MAX_REF_BYTES))
        except ObjectNotFoundError:
            pin = None
        if pin is not None:
            if self._own_ref("pin") is None and pin.version is not None:
                raise RefError(PIN, f"names {pin.describe()} but is not signed by this key: pin it again with the "
                               "signing key (`deltasync pin --signing-key`) or clear it")
            pinned = pin.version
            self._write_ref("pin", pinned)  # before the latest ref, which names its counter
        if latest is not None:
            self._write_ref("latest", latest)
        return latest, pinned

    # -- the pin: which version following subscribers serve ---------------------------------

    def pinned(self) -> int | None:
        """The pinned version, or None when subscribers follow the latest. With trusted keys,
        ``refs/pin`` must be a valid signed ref (RefError otherwise), and a pin seen before
        may not vanish (the publisher clears a pin by signing an empty one), nor be older than
        the pin the signed ``refs/latest`` names."""
        # The latest ref first: a pin read after it is at least as new as the one it names
        # (publishers write the pin, then the latest ref).
        latest = self.read_ref("latest") if self.trusted_keys is not None else None
        expected = latest.pin_counter if latest is not None else 0
        ref = self.read_ref("pin")
        if ref is None:
            seen = self.ref_memory.seen_ref(self._remembered("pin")) if self.trusted_keys is not None else None
            if seen is not None and seen[1] is not None:
                raise RefError(PIN, f"is missing, but a signed pin to version {seen[1]} was seen (counter "
                               f"{seen[0]}): deleted from the store? (a publisher clears a pin by signing an empty one)")
            if expected:
                raise RefError(PIN, f"is missing, but refs/latest names a pin with counter {expected}: deleted "
                               "from the store? (a publisher clears a pin by signing an empty one)")
            return None
        if ref.signed and ref.counter < expected:
            raise RefError(PIN, f"is older than the pin refs/latest names ({ref.describe()}; refs/latest names "
                           f"counter {expected}): a replayed pin, refused")
        self.accept_ref(ref)
        return ref.version

    def pin(self, version: int | None) -> None:
        """Make following subscribers serve ``version`` (a committed one), forward or back,
        e.g. after an evaluation gate failed; None clears the pin: they follow the latest again.
        With a signing key the pin is signed (and a cleared pin is a signed empty one)."""
        if version is not None:
            self.ensure_exists()
            self.manifest(version)  # only a committed version can be pinned
        self._write_ref("pin", version)
        if self.signing_key is not None:
            own_latest = self._own_ref("latest")
            latest = own_latest.version if own_latest is not None else self._listed_latest()
            if latest is not None:
                self._write_ref("latest", latest)  # now naming this pin's counter

    def manifest(self, version: int) -> ManifestInfo:
        """The validated manifest of ``version`` (cached: versions are immutable)."""
        with self._lock:
            cached = self._manifests.get(version)
            if cached is not None:
                self._manifests.move_to_end(version)
        if cached is not None:
            return cached
        try:
            raw = self.store.get(manifest_key(version), max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            if not self.exists():
                raise RepositoryNotFoundError(self.url) from None
            raise VersionNotFoundError(version, self.url) from None
        info = parse_manifest(raw, expect_version=version, authenticate=self._authenticator(version))
        self._check_identity(info, f"version {version}")
        with self._lock:
            self._manifests[version] = info
            _trim(self._manifests)
        return info

    def _authenticator(self, version: int) -> Callable[[pb.Manifest], None] | None:
        trusted = self.trusted_keys
        if trusted is None:
            return None
        return lambda m: trusted.verify(m, version)

    def resolve(self, version: int | None) -> int:
        """``version``, or the latest when None; raises if there is none. A given version of a
        repository whose identity was assumed (:meth:`assume_identity`) is checked by reading
        its manifest alone: an agent restoring what it kept reads nothing else."""
        with self._lock:
            assumed = self._assumed
        if version is None or not assumed:
            self.ensure_exists()
        if version is None:
            latest = self.latest()
            if latest is None:
                raise EmptyRepositoryError(self.url)
            return latest
        self.manifest(version)
        return version

    def chain(self, version: int, *, stop_at: int | None = None) -> list[ManifestInfo]:
        """Manifests from the nearest snapshot (or ``stop_at``) up to ``version``, oldest first."""
        out: list[ManifestInfo] = []
        v: int | None = version
        while v is not None:
            try:
                info = self.manifest(v)
            except SignatureError as e:
                if v == version:
                    raise
                raise SignatureError(
                    version, f"its delta chain goes through version {v}: {e.detail}; a signed chain starts at a signed "
                    "snapshot (the first version published with a signing key after unsigned ones is one)"
                ) from None
            if out and info.pb.repository_id != out[0].pb.repository_id and (
                info.pb.repository_id or self.trusted_keys is not None
            ):
                raise RepositoryIdentityError(
                    self.url, f"version {version}: its delta chain goes through version {v}, which names "
                    f"{_named(info.pb.repository_id)} where version {version} names {_named(out[0].pb.repository_id)}: "
                    "a chain mixing repositories, refused")
            out.append(info)
            if info.is_snapshot or v == stop_at:
                break
            v = info.parent
            if v is None:
                raise CorruptObjectError(f"manifest {info.version}", "delta chain ends without a snapshot")
        out.reverse()
        return out

    def commit(self, manifest: pb.Manifest, *, alongside: Sequence[Callable[[], None]] = (),
               known_latest: tuple[int | None] | None = None, release: str | None = None,
               checked_at_store: Callable[[list[str]], None] | None = None) -> ManifestInfo:
        """Commit a version whose packs and blobs are already durable.

        Of racing publishers of the same id exactly one succeeds; the others get
        VersionConflictError and nothing of theirs becomes visible.

        ``alongside``: functions (that raise nothing) a successful commit runs on threads beside
        its ref update, once the manifest is written: a publisher's check after the commit and
        its lease release cost no round trip of their own. Given per call, so that threads
        committing through one Repository never run each other's.

        ``known_latest``: (the latest version,) as the caller listed it before this commit
        began. When the version is the one after it, the history parent is that version, read
        without listing the manifests again (see :meth:`_seal_history`).

        ``checked_at_store``: given, and the repository unsigned, a store that can
        (``Store.commits_refs``: a writable relay) commits the manifest where the repository
        is, in its one round trip: it updates ``refs/latest`` as :meth:`update_latest_ref`
        does, deletes ``release`` (the publish's lease) and checks the manifest's packs and
        blobs again after the write. ``checked_at_store`` is then handed the keys of those
        missing, and neither ``alongside`` nor the ref update runs here (the caller's
        ``alongside`` are the same check and the lease's release).
        """
        manifest.repository_id = self.identity() or b""
        self._seal_history(manifest, known_latest)
        if self.signing_key is not None:
            sign_manifest(manifest, self.signing_key)
        data = seal(manifest)  # last: the whole-manifest digest covers the signature too
        # Never commit what we can't read (a signer not among our own trusted keys included).
        info = parse_manifest(data, expect_version=manifest.version, authenticate=self._authenticator(manifest.version))
        at_store = checked_at_store is not None and self.signing_key is None and self.store.commits_refs
        try:
            if at_store:
                gone = self.store.put_commit(manifest_key(manifest.version), data, release=release)
            else:
                self.store.put(manifest_key(manifest.version), data, if_absent=True)
                gone = None
        except ObjectExistsError:
            raise VersionConflictError(manifest.version) from None
        with self._lock:
            self._manifests[manifest.version] = info
            _trim(self._manifests)
        if gone is not None and checked_at_store is not None:
            checked_at_store(gone)
            return info
        with ThreadPoolExecutor(max_workers=max(1, len(alongside)), thread_name_prefix="deltasync-commit") as pool:
            for fn in alongside:
                pool.submit(fn)
            self.update_latest_ref(manifest.version)
        return info

    def update_latest_ref(self, version: int) -> None:
        """After the commit of ``version``: point ``refs/latest`` at it unless a newer version
        is committed. Never raises: the version is committed, and the caller would remove packs
        it needs; the ref is a hint, readers find the version by listing."""
        try:
            if self.signing_key is not None:
                latest = self._listed_latest()
                if latest is None or version >= latest:
                    self._write_ref("latest", version)
                return
            # Unsigned: the ref is written while the manifests are listed (one round trip, not
            # three); a newer version committed meanwhile (another publisher's) gets the ref back.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-ref") as pool:
                listing = pool.submit(self.versions)
                self._write_ref("latest", version)
                versions = listing.result()
            if versions and versions[-1] > version:
                self._write_ref("latest", versions[-1])
        except DeltasyncError as e:
            log.warning("version %d is committed, but refs/latest was not updated (%s): readers find it by listing; "
                        "the next publish, or `deltasync refresh-refs`, rewrites the ref", version, e)

    def _seal_history(self, manifest: pb.Manifest, known_latest: tuple[int | None] | None = None) -> None:
        """The version follows the newest one committed below it (repo/history.py): its
        history fields name that version and extend its history digest.

        Which one that is: when ``known_latest`` (the caller's listing, before the commit) is
        the version just below this one, that one, without listing again: a version committed
        since then is either this id (our conditional put then fails) or below it. Otherwise
        the newest listed below this one.

        A version found so whose manifest is gone by the time it is read (a concurrent
        deletion) is still the one this version follows: its history comes from gc's record
        of it. Without one the commit fails: linking past the version would show every
        follower holding it a fork, and they would refuse every later version."""
        version = manifest.version
        if known_latest is not None and (known_latest[0] or 0) + 1 == version:
            below = known_latest[0]
        else:
            below = max((v for v in self.versions() if v < version), default=None)
        if below is None:
            seal_history(manifest, None, b"")
            return
        try:
            try:
                before = self.manifest(below).pb
            except SignatureError:  # unsigned (before a key): its history is still its own
                raw = self.store.get(manifest_key(below), max_bytes=MAX_MANIFEST_BYTES)
                before = parse_manifest(raw, expect_version=below).pb
        except (VersionNotFoundError, ObjectNotFoundError):
            link = _read_record(self.store, below)
            if link is None:
                raise StoreError(
                    f"version {version} not committed: version {below}, the newest before it, was deleted while "
                    f"publishing, and no readable history record of it ({history_key(below)}) was left: committing "
                    f"past it would show every follower holding version {below} a fork; nothing of version {version} "
                    "is visible, publish again") from None
            seal_history(manifest, below, link.digest)
            return
        except CorruptObjectError as e:
            log.warning("version %d follows version %d, whose manifest is damaged (%s): its history is "
                        "unknown to followers", version, below, e)
            seal_history(manifest, below, b"")
            return
        seal_history(manifest, below, before.history_digest)

    # -- squashes: extra edges A -> C of the version graph, never commits ---------------------

    def squashes(self) -> list[tuple[int, int]]:
        """(a, c) of every stored squash, by c then a (endpoints may since have been deleted)."""
        found = [ac for k in self.store.list(SQUASHES) if (ac := squash_from_key(k)) is not None and ac[0] < ac[1]]
        return sorted(found, key=lambda ac: (ac[1], ac[0]))

    def squash(self, a: int, c: int) -> ManifestInfo:
        """The validated squash ``a`` -> ``c`` (cached). Besides what every manifest is checked
        for (and its signature, with trusted keys), it must be a delta from ``a`` whose tensors
        and chunk digests are exactly those of committed version ``c``, and whose every chunk
        stored against a base names the digest of that chunk in committed version ``a``."""
        with self._lock:
            cached = self._squashes.get((a, c))
            if cached is not None:
                self._squashes.move_to_end((a, c))
        if cached is not None:
            return cached
        key = squash_key(a, c)
        try:
            raw = self.store.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            raise CorruptObjectError(f"squash {a}->{c}", f"{key} is missing") from None
        try:
            info = parse_manifest(raw, expect_version=c, authenticate=self._authenticator(c))
        except CorruptObjectError as e:
            raise CorruptObjectError(f"squash {a}->{c}", e.detail) from None
        except SignatureError as e:
            raise SignatureError(c, f"squash {a}->{c}: {e.detail}") from None
        self._check_identity(info, f"squash {a}->{c}")
        _check_squash(info, self.manifest(a), self.manifest(c))
        with self._lock:
            self._squashes[(a, c)] = info
            _trim(self._squashes)
        return info

    def put_squash(self, manifest: pb.Manifest) -> ManifestInfo:
        """Store a squash whose packs are already durable (signed like a commit). Raises
        ObjectExistsError when one is stored for the same pair already (it stays: any valid
        one serves)."""
        a, c = manifest.parent, manifest.version
        manifest.repository_id = self.identity() or b""
        target = self.manifest(c).pb  # the squash is version c: it carries c's history
        manifest.history_parent = target.history_parent
        manifest.history_parent_digest = target.history_parent_digest
        manifest.history_digest = target.history_digest
        if self.signing_key is not None:
            sign_manifest(manifest, self.signing_key)
        data = seal(manifest)
        info = parse_manifest(data, expect_version=c, authenticate=self._authenticator(c))
        _check_squash(info, self.manifest(a), self.manifest(c))
        self.store.put(squash_key(a, c), data, if_absent=True)
        with self._lock:
            self._squashes[(a, c)] = info
            _trim(self._squashes)
        return info

    # -- blobs -------------------------------------------------------------------------------

    def put_blob(self, data: bytes) -> tuple[bytes, int]:
        """Store one part of a non-tensor file; returns (digest, stored bytes written)."""
        d = digest(data)
        key = blob_key(d)
        if self.store.exists(key):
            return d, 0  # deduplicated across versions
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
        self.store.put(key, packed)
        return d, len(packed)

    def get_blob(self, d: bytes, *, max_size: int = BLOB_PART_BYTES) -> bytes:
        key = blob_key(d)
        # Read no more than a part of max_size bytes compresses to at worst.
        return unpack_blob(key, self.store.get(key, max_bytes=_zstd_bound(max_size)), max_size=max_size)


def unpack_blob(key: str, packed: bytes | bytearray | memoryview, *, max_size: int = BLOB_PART_BYTES) -> bytes:
    """The content of blob object ``key`` (``blobs/<xxh3>``) stored as ``packed``: exactly one
    zstd frame of at most ``max_size`` bytes whose content has the digest in its name, nothing
    after it (bytes appended to a stored blob are damage, not padding); CorruptObjectError
    otherwise."""
    try:
        size = zstandard.frame_content_size(packed)
        if size < 0 or size > max_size:
            raise CorruptObjectError(key, f"blob claims {size} bytes (at most {max_size} expected)")
        frame = zstandard.ZstdDecompressor().decompressobj()
        data = frame.decompress(packed)  # bounded: the frame's declared size is checked above and by zstd
    except zstandard.ZstdError as e:
        raise CorruptObjectError(key, f"cannot decompress ({e})") from None
    if not frame.eof or len(data) != size:
        raise CorruptObjectError(key, "the blob's zstd frame is cut short")
    if frame.unused_data:
        raise CorruptObjectError(key, f"{len(frame.unused_data)} bytes follow the blob's zstd frame")
    if key != blob_key(digest(data)):
        raise CorruptObjectError(key, "blob content does not match its digest")
    return data


def _derived_identity(repo: Repository, oldest: int) -> str:
    """The identity a repository created before identities gets: derived from its oldest
    manifest's stored bytes, so that publishers upgrading it at once agree."""
    raw = repo.store.get(manifest_key(oldest), max_bytes=MAX_MANIFEST_BYTES)
    return digest(b"deltasync repository identity\0" + raw).hex()


def _identity_from_manifests(repo: Repository, versions: list[int]) -> str:
    """The identity of a repository whose marker is lost, as its oldest and newest manifests
    name it; derived as for a repository of older deltasync when they name none. Manifests
    naming two identities are refused: which one is the repository's is for a person to say."""
    named: dict[int, bytes] = {}
    for v in sorted({versions[0], versions[-1]}, reverse=True):
        try:
            named[v] = pb.Manifest.FromString(repo.store.get(manifest_key(v), max_bytes=MAX_MANIFEST_BYTES)).repository_id
        except (DecodeError, ObjectTooLargeError, CorruptObjectError):
            raise CorruptObjectError(MARKER, f"{MARKER} is missing and version {v}'s manifest, which would name the "
                                     "repository's identity, cannot be read: restore the marker by hand") from None
    ids = {i for i in named.values() if i}
    if len(ids) > 1:
        described = ", ".join(f"version {v}: {i.hex()}" for v, i in sorted(named.items()) if i)
        raise RepositoryIdentityError(repo.url, f"{MARKER} is missing and the manifests name more than one identity "
                                      f"({described}); refusing to guess: restore {MARKER} "
                                      '({"format": 1, "id": "<32 hex>"}) by hand')
    if ids:
        (identity,) = ids
        if len(identity) == IDENTITY_BYTES:
            return identity.hex()
        raise CorruptObjectError(MARKER, f"{MARKER} is missing and the manifests name an identity that is not "
                                 f"{IDENTITY_BYTES} bytes: restore the marker by hand")
    return _derived_identity(repo, versions[0])


def _named(identity: bytes) -> str:
    return f"repository {identity.hex()}" if identity else "no repository"


def _zstd_bound(size: int) -> int:
    """The most bytes a zstd frame of ``size`` content bytes takes (ZSTD_COMPRESSBOUND plus
    the frame header), so a stored blob part is never read beyond what it can hold."""
    return size + (size >> 7) + (64 << 10)


def _check_squash(info: ManifestInfo, base: ManifestInfo, target: ManifestInfo) -> None:
    """A squash must rebuild exactly ``target`` (same entries, same chunk digests) from
    ``base``: every chunk not stored in full is a change of ``base``'s chunk."""
    a = base.version
    what = f"squash {a}->{target.version}"
    if info.is_snapshot or info.parent != a:
        raise CorruptObjectError(what, f"is not a delta from version {a}")
    base_entries = base.entries()
    if info.pb.version_digest != target.pb.version_digest or len(info.pb.tensors) != len(target.pb.tensors):
        raise CorruptObjectError(what, f"does not describe the chunks of version {target.version}")
    if info.pb.history_digest and info.pb.history_digest != target.pb.history_digest:
        raise CorruptObjectError(what, f"names another history than version {target.version}")
    for mine, theirs in zip(info.pb.tensors, target.pb.tensors, strict=True):
        if (
            (mine.name, mine.dtype, mine.nbytes) != (theirs.name, theirs.dtype, theirs.nbytes)
            or list(mine.shape) != list(theirs.shape)
            or list(mine.slice_offsets) != list(theirs.slice_offsets)
            or [c.target_digest for c in mine.chunks] != [c.target_digest for c in theirs.chunks]
        ):
            raise CorruptObjectError(what, f"tensor {mine.name!r} differs from version {target.version}")
        held = base_entries.get(key_of(mine))
        held_digests = [c.target_digest for c in held.chunks] if held is not None else []
        for idx, c in enumerate(mine.chunks):
            if c.encoding != FULL and (idx >= len(held_digests) or held_digests[idx] != c.base_digest):
                raise CorruptObjectError(what, f"tensor {mine.name!r} chunk {idx} has a base that version {a} does not hold")


#: Parsed manifests (and squashes) a Repository keeps, most recently used first.
MANIFEST_CACHE_ENTRIES = 256


def _trim(cache: OrderedDict[Any, ManifestInfo]) -> None:
    while len(cache) > MANIFEST_CACHE_ENTRIES:
        cache.popitem(last=False)
