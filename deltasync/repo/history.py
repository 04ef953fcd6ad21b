"""History only moves forward (DESIGN.md invariant 8): does a version extend the one held?

Every manifest names the version committed before it (``history_parent``), that version's
history digest, and its own (format/manifest.py ``history_digest``: cumulative, BLAKE2b-128).
So two versions have one history back to version N exactly when walking back from the newer
one reaches N with N's history digest. A follower records the history digest of the version
it holds (local/state.py) and, before taking a newer version, walks back from it: through the
manifests still stored, and through gc's records of the versions it deleted
(``history/<version:020d>.json``, written before the manifest goes: ops/retention.py), so a
follower that fell behind the retention still checks. Each link is recomputed from its fields
and compared with the digest the later version names, so the walk trusts nothing but the
newer version's manifest (signed, with trusted keys): an unsigned record or manifest can only
be used when it hashes to what that manifest committed to.

A walk ends in one of three answers: it extends (it reached N with N's digest), it does not
(it reached N with another digest, or passed below N, or began after it: a fork), or unknown
(the newer version carries no history, having been committed by older deltasync; or a link
is missing: deleted without gc's record, or unreadable). :func:`check_extends` turns them into
what a follower does (docs/trust.md).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from ..errors import CorruptObjectError, HistoryError, ObjectNotFoundError
from ..format.digest import DIGEST_SIZE
from ..format.manifest import MAX_MANIFEST_BYTES, ManifestInfo, history_digest, manifest_key
from ..storage import Store
from ..v1 import manifest_pb2 as pb

HISTORY = "history/"
#: A record is a few hundred bytes; a larger object is not one.
MAX_RECORD_BYTES = 4096
#: Links followed at most in one check (each a manifest or record read): beyond, unknown.
MAX_WALK = 100_000

log = logging.getLogger(__name__)


def history_key(version: int) -> str:
    return f"{HISTORY}{version:020d}.json"


def version_from_history_key(key: str) -> int | None:
    m = re.fullmatch(r"history/(\d{20})\.json", key)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Link:
    """One version's place in its history, its digest recomputed from its fields."""

    version: int
    parent: int  # 0: the first version of its history
    parent_digest: bytes  # empty: the parent's history is unknown (committed before history digests)
    digest: bytes


def link_of(m: pb.Manifest) -> Link | None:
    """The link a manifest (or squash) states; None when it carries no history."""
    if len(m.history_digest) != DIGEST_SIZE:
        return None
    computed = history_digest(m.history_parent_digest, m.version, m.version_digest, m.repository_id)
    return Link(m.version, m.history_parent, bytes(m.history_parent_digest), computed)


def record(m: pb.Manifest) -> bytes | None:
    """What gc stores for a version it deletes, so followers can still walk through it (None:
    the version carries no history)."""
    if link_of(m) is None:
        return None
    body = {"format": 1, "version": m.version, "history_parent": m.history_parent,
            "history_parent_digest": m.history_parent_digest.hex(), "version_digest": m.version_digest.hex(),
            "repository_id": m.repository_id.hex(), "history_digest": m.history_digest.hex()}
    return json.dumps(body, sort_keys=True).encode()


def _read_record(store: Store, version: int) -> Link | None:
    try:
        body = json.loads(store.get(history_key(version), max_bytes=MAX_RECORD_BYTES))
        m = pb.Manifest(version=int(body["version"]), history_parent=int(body["history_parent"]),
                        history_parent_digest=bytes.fromhex(body["history_parent_digest"]),
                        version_digest=bytes.fromhex(body["version_digest"]),
                        repository_id=bytes.fromhex(body["repository_id"]),
                        history_digest=bytes.fromhex(body["history_digest"]))
    except ObjectNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, RecursionError, CorruptObjectError):
        return None  # damaged: as if missing (the walk then cannot tell)
    return link_of(m) if m.version == version else None


def _stored_link(store: Store, version: int) -> Link | None:
    """The link of ``version`` as the store holds it: its manifest, else gc's record."""
    try:
        raw = store.get(manifest_key(version), max_bytes=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError:
        return _read_record(store, version)
    except CorruptObjectError:
        return None
    try:
        m = pb.Manifest.FromString(raw)
    except DecodeError:
        return None
    # Not validated: the caller compares its recomputed digest with a digest it trusts.
    return link_of(m) if m.version == version else None


def extends(store: Store, held_version: int, held_history: bytes, target: ManifestInfo) -> bool | None:
    """Whether ``target``'s history passes through version ``held_version`` with history
    digest ``held_history``: True, False (a fork), None (cannot tell; module doc)."""
    link = link_of(target.pb)
    if link is None or not held_history:
        return None
    for _ in range(MAX_WALK):
        if link.version == held_version:
            return link.digest == held_history
        if link.version < held_version or link.parent < held_version:
            return False  # it passes below the version held without going through it
        if link.parent == held_version:
            return link.parent_digest == held_history
        if not link.parent_digest:
            return None  # older versions' history is unknown
        older = _stored_link(store, link.parent)
        if older is None or older.digest != link.parent_digest:
            return None  # missing, damaged, or another history's version stored in its place
        link = older
    return None


def check_extends(store: Store, url: str, held_version: int | None, held_history: str, target: ManifestInfo,
                  *, strict: bool) -> None:
    """Refuse (HistoryError, one line naming the repository and both versions) a version newer
    than the one held whose history does not extend the held one's. When that cannot be told,
    ``strict`` (trusted keys) refuses too, unless the newer version carries no history at all
    (committed by older deltasync: accepted, as before history digests); without it, a warning."""
    if held_version is None or not held_history or target.version <= held_version:
        return
    try:
        held = bytes.fromhex(held_history)
    except ValueError:
        return
    answer = extends(store, held_version, held, target)
    if answer:
        return
    if answer is False:
        raise HistoryError(url, f"version {target.version} does not extend version {held_version} held here "
                                f"(history {held_history[:16]}…): a fork (another run copied over this one, or versions "
                                "replaced); refused, staying on the version held")
    what = (f"version {target.version} carries no history (published by older deltasync)" if link_of(target.pb) is None
            else f"the versions between {held_version} and {target.version} are gone without gc's record")
    if strict and link_of(target.pb) is not None:
        raise HistoryError(url, f"cannot check that version {target.version} extends version {held_version} held "
                                f"here: {what}; refused, staying on the version held")
    log.warning("%s: cannot check that version %d extends version %d held here: %s; taking it",
                url, target.version, held_version, what)
