"""Signed manifests: ed25519 keys on disk, signing on commit, verification on read.

The signature covers the manifest serialized deterministically with its ``signature`` and
``manifest_digest`` fields cleared (``signing_key_id`` included): every byte of it but its two
seals, the same bytes the whole-manifest digest covers (format/manifest.py), so it binds every
field a reader uses: files, tensors, chunk digests, packs, parent and version id. A signed manifest moved to
another version's key is still refused, because its own ``version`` field disagrees.

Keys are PEM files: PKCS8 for the private key (unencrypted, mode 0600), SubjectPublicKeyInfo
for the public key. A key is named by its id, the first 8 bytes of the sha256 of the raw
32-byte public key, which every signed manifest records; a reader may trust several keys
at once, so a publisher can rotate keys without breaking subscribers that follow it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import RefError, SignatureError, UsageError
from ..v1 import manifest_pb2 as pb

KEY_ID_BYTES = 8
SIGNATURE_BYTES = 64
#: Prefixed to what a ref signature covers, so no signed ref can pass for a signed manifest
#: (a protobuf) or the other way round.
REF_CONTEXT = b"deltasync signed ref v1\n"

#: A private key, or the path of its PEM file.
PrivateKeyLike: TypeAlias = "Ed25519PrivateKey | str | os.PathLike[str]"
#: A public key, or the path of its PEM file.
PublicKeyLike: TypeAlias = "Ed25519PublicKey | str | os.PathLike[str]"


def key_id(public_key: Ed25519PublicKey) -> bytes:
    """The id recorded in manifests signed by this key's private half."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).digest()[:KEY_ID_BYTES]


# -- keys on disk --------------------------------------------------------------------------------


def generate_keypair(prefix: str | os.PathLike[str]) -> tuple[Path, Path, bytes]:
    """Write a new key pair to ``PREFIX.key`` (0600) and ``PREFIX.pub``; refuses to overwrite.
    The directory of PREFIX is created (0700) when missing.

    Returns (private key path, public key path, key id).
    """
    base = os.fspath(prefix)
    key_path, pub_path = Path(base + ".key"), Path(base + ".pub")
    for p in (key_path, pub_path):
        if os.path.lexists(p):
            raise UsageError(f"{p} already exists; refusing to overwrite a key")
    try:
        key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create {key_path.parent} for the keys: {e.strerror}") from None
    private = Ed25519PrivateKey.generate()
    key_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(key_path, key_pem, 0o600)
    try:
        _write_new(pub_path, pub_pem, 0o644)
    except BaseException:
        with contextlib.suppress(OSError):
            key_path.unlink()
        raise
    return key_path, pub_path, key_id(private.public_key())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise UsageError(f"{path} already exists; refusing to overwrite a key") from None
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what we asked for
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_pem(path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read key {os.fspath(path)}: {e.strerror or e}") from None


def load_signing_key(key: PrivateKeyLike) -> Ed25519PrivateKey:
    """An ed25519 private key, or one read from a PEM (PKCS8, unencrypted) file."""
    if isinstance(key, Ed25519PrivateKey):
        return key
    pem = _read_pem(key)  # its own one-line error (a UsageError is a ValueError: not caught below)
    try:
        loaded = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{os.fspath(key)}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise UsageError(f"{os.fspath(key)}: not an ed25519 private key")
    return loaded


def load_public_key(key: PublicKeyLike) -> Ed25519PublicKey:
    """An ed25519 public key, or one read from a PEM (SubjectPublicKeyInfo) file."""
    if isinstance(key, Ed25519PublicKey):
        return key
    pem = _read_pem(key)
    if b"PRIVATE KEY" in pem:
        raise UsageError(f"{os.fspath(key)}: is a private key; trust the public half (the .pub file)")
    try:
        loaded = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{os.fspath(key)}: not a PEM public key ({e})") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise UsageError(f"{os.fspath(key)}: not an ed25519 public key")
    return loaded


# -- signing and verifying -----------------------------------------------------------------------


def signed_payload(manifest: pb.Manifest) -> bytes:
    """The bytes a signature covers: the deterministic serialization without ``signature``
    and ``manifest_digest`` (the digest is computed after signing, over the signature too,
    so it cannot be inside what is signed). For manifests written before the digest existed
    this is what they were signed over, so their signatures still verify."""
    signature, whole = manifest.signature, manifest.manifest_digest
    manifest.ClearField("signature")
    manifest.ClearField("manifest_digest")
    try:
        return manifest.SerializeToString(deterministic=True)
    finally:
        if signature:
            manifest.signature = signature
        if whole:
            manifest.manifest_digest = whole


def sign_manifest(manifest: pb.Manifest, key: Ed25519PrivateKey) -> None:
    """Set ``signing_key_id`` and ``signature`` of ``manifest`` in place."""
    manifest.signing_key_id = key_id(key.public_key())
    manifest.ClearField("signature")
    manifest.ClearField("manifest_digest")  # stale once anything changed; format.manifest.seal sets it after
    manifest.signature = key.sign(signed_payload(manifest))


def ref_payload(body: Mapping[str, Any]) -> bytes:
    """The bytes a ref signature covers: the context, then the ref's fields (all but
    ``signature``) as canonical JSON (sorted keys, no spaces, ASCII)."""
    return REF_CONTEXT + json.dumps(dict(body), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_ref(body: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """``body`` with ``key_id`` and ``signature`` (hex) added: a signed ref (repo/repository.py)."""
    signed = {k: v for k, v in body.items() if k not in ("key_id", "signature")}
    signed["key_id"] = key_id(key.public_key()).hex()
    signed["signature"] = key.sign(ref_payload(signed)).hex()
    return signed


def ref_signed_by(body: Mapping[str, Any], public: Ed25519PublicKey) -> bool:
    """Whether ``body`` (a parsed signed ref) carries a valid signature by ``public``."""
    try:
        signature = bytes.fromhex(str(body.get("signature", "")))
        public.verify(signature, ref_payload({k: v for k, v in body.items() if k != "signature"}))
    except (ValueError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a reader accepts manifests from, by key id (several: key rotation)."""

    keys: Mapping[bytes, Ed25519PublicKey]

    @classmethod
    def of(cls, keys: PublicKeyLike | Iterable[PublicKeyLike]) -> TrustedKeys:
        items = [keys] if isinstance(keys, (Ed25519PublicKey, str, os.PathLike)) else list(keys)
        loaded = [load_public_key(k) for k in items]
        return cls({key_id(k): k for k in loaded})

    def __bool__(self) -> bool:
        return bool(self.keys)

    def verify(self, manifest: pb.Manifest, version: int) -> None:
        """Raise SignatureError unless ``manifest`` is signed by one of these keys."""
        if not manifest.signature:
            raise SignatureError(version, "unsigned manifest (a trusted key is configured)")
        kid = manifest.signing_key_id
        public = self.keys.get(kid)
        if public is None:
            shown = kid[:32].hex() or "(none)"
            raise SignatureError(version, f"signed by unknown key {shown}")
        if len(manifest.signature) != SIGNATURE_BYTES:
            raise SignatureError(version, "signature does not verify")
        try:
            public.verify(manifest.signature, signed_payload(manifest))
        except InvalidSignature:
            raise SignatureError(version, "signature does not verify") from None

    def verify_ref(self, key: str, body: Mapping[str, Any]) -> None:
        """Raise RefError unless the signed ref ``body`` (read from ``key``) is signed by one of these keys."""
        try:
            kid = bytes.fromhex(str(body.get("key_id", "")))
        except ValueError:
            kid = b""
        public = self.keys.get(kid)
        if public is None:
            raise RefError(key, f"signed by unknown key {kid[:32].hex() or '(none)'}")
        if not ref_signed_by(body, public):
            raise RefError(key, "signature does not verify (altered, or not written by the publisher)")
