"""Integrity against a hostile store (issue 12, requirements 1-3), by fault injection.

* Every byte of a stored manifest is covered: a flipped byte at any offset is refused by
  pull and by verify, naming the version, and never renames a file or a tensor.
* ``verify`` checks what ``pull`` checks (safetensors headers against the tensor layout,
  file digests, blob sizes and digests), without writing a copy.
* Signed refs: a trusting subscriber or agent refuses unsigned, tampered, replayed, expired
  refs and a withheld newest manifest, with one clear line, and stays on its version.

Each category's cases are counted by the parametrisations and loops below (see the counts
in the assertions); unsigned repositories keep working exactly as before.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.agents import Agent, AgentConfig, read_status
from deltasync.errors import ChecksumMismatchError, CorruptObjectError, DeltasyncError, RefError, SignatureError
from deltasync.format.manifest import manifest_key, parse_manifest, seal
from deltasync.format.signing import generate_keypair
from deltasync.local.state import StateDB
from deltasync.ops.verify import verify_repository
from deltasync.repo.repository import LATEST, PIN, ref_hint, squash_key
from deltasync.storage import open_store
from deltasync.v1 import manifest_pb2 as pb

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "publisher")
    return key, pub


def _publish(url: str, tmp_path: Path, n: int, *, key: Path | None = None, **repo_kw: object) -> list[Path]:
    """``n`` versions of a checkpoint directory (safetensors plus side files: blobs)."""
    state = make_state(1, LAYOUT)
    pub = Publisher(Repository(url, signing_key=key, **repo_kw) if key is not None or repo_kw else url, CONFIG)  # type: ignore[arg-type]
    dirs: list[Path] = []
    for i in range(n):
        ckpt = tmp_path / f"ckpt{i + 1}"
        write_checkpoint(ckpt, state, step=i + 1)
        pub.publish_dir(ckpt, base_dir=dirs[-1] if dirs else None)
        dirs.append(ckpt)
        state = step_state(state, seed=i + 2)
    return dirs


def _flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    return data[:offset] + bytes([data[offset] ^ mask]) + data[offset + 1 :]


def _rewrite(url: str, version: int, edit: Callable[[pb.Manifest], None]) -> None:
    """What a store writer does who also recomputes the (keyless) whole-manifest digest."""
    store = open_store(url)
    m = pb.Manifest()
    m.ParseFromString(store.get(manifest_key(version)))
    edit(m)
    store.put(manifest_key(version), seal(m))


# -- 1. every byte of a manifest is covered ------------------------------------------------------


def _offsets(data: bytes, m: pb.Manifest) -> list[int]:
    """Every offset inside a file path or tensor name (the renames of issue 12), plus a
    spread over the whole manifest: first and last bytes, tags, lengths, digests."""
    marks = {0, 1, 2, len(data) - 1, len(data) - 2, len(data) - 17}
    for text in [f.path for f in m.files] + [t.name for t in m.tensors]:
        at = data.find(text.encode())
        marks.update(range(at, at + len(text)))
    marks.update(range(0, len(data), max(1, len(data) // 120)))
    return sorted(o for o in marks if 0 <= o < len(data))


def test_a_flipped_byte_anywhere_in_a_manifest_is_refused_and_renames_nothing(local_repo_url: str, tmp_path: Path) -> None:
    _publish(local_repo_url, tmp_path, 2)
    store = open_store(local_repo_url)
    key = manifest_key(2)
    good = store.get(key)
    m = pb.Manifest()
    m.ParseFromString(good)
    assert parse_manifest(good, expect_version=2).pb.manifest_digest
    offsets = _offsets(good, m)
    every = range(len(good))
    # parse_manifest is what pull and verify read manifests with: every offset, two masks.
    refused = 0
    for offset in every:
        for mask in (0x01, 0x0C):  # 0x0C: 'j' -> 'f', config.json -> confif.json
            with pytest.raises(CorruptObjectError) as e:
                parse_manifest(_flip(good, offset, mask), expect_version=2)
            assert str(e.value).startswith("corrupt manifest 2: "), str(e.value)
            refused += 1
    assert refused == 2 * len(good) and len(good) > 500
    # Through the real readers: pull into a fresh directory, pull onto a copy at version 1,
    # and verify, at a spread of offsets (every path and name byte included).
    held = tmp_path / "held"
    Subscriber(local_repo_url).pull_to_dir(held, 1)
    before = tree_digests(held)
    cases = 0
    for offset in offsets[:: max(1, len(offsets) // 40)]:
        store.put(key, _flip(good, offset, 0x0C))
        fresh = tmp_path / f"fresh{offset}"
        for attempt in (lambda: Subscriber(local_repo_url).pull_to_dir(fresh),  # noqa: B023 (called at once)
                        lambda: Subscriber(local_repo_url).pull_to_dir(held, 2),
                        lambda: verify_repository(local_repo_url)):
            with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: "):
                attempt()
            cases += 1
        assert tree_digests(held) == before  # still version 1, nothing renamed
        assert not fresh.exists() or not any(p.suffix in (".json", ".safetensors") for p in fresh.iterdir())
    assert cases >= 120
    store.put(key, good)
    verify_repository(local_repo_url)


@pytest.mark.parametrize("where", ["header", "file-digest", "blob-digest", "tensor-name", "chunk-digest"])
def test_a_flipped_header_or_digest_byte_in_a_stored_manifest_is_refused_by_verify_and_pull(
    local_repo_url: str, tmp_path: Path, where: str
) -> None:
    """The flips issue 12 found accepted by verify: now refused by both, naming the version."""
    _publish(local_repo_url, tmp_path, 2)
    store = open_store(local_repo_url)
    good = store.get(manifest_key(2))
    m = pb.Manifest()
    m.ParseFromString(good)
    st = next(f for f in m.files if f.kind == pb.File.SAFETENSORS)
    blob = next(f for f in m.files if f.kind == pb.File.BLOB)
    needle = {"header": st.header[8:40], "file-digest": st.digest, "blob-digest": blob.digest,
              "tensor-name": m.tensors[0].name.encode(), "chunk-digest": m.tensors[0].chunks[0].target_digest}[where]
    at = good.find(needle)
    assert at > 0
    store.put(manifest_key(2), _flip(good, at + len(needle) // 2))
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: "):
        verify_repository(local_repo_url)
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: "):
        Subscriber(local_repo_url).pull_to_dir(tmp_path / "out")


def test_a_signed_manifest_flipped_anywhere_is_refused_with_and_without_keys(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    key, pub = keys
    _publish(local_repo_url, tmp_path, 1, key=key)
    good = open_store(local_repo_url).get(manifest_key(1))
    trusted = Repository(local_repo_url, trusted_keys=pub)
    auth = trusted._authenticator(1)
    for offset in range(len(good)):  # the signature bytes included: the digest covers them
        bad = _flip(good, offset)
        with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 1: "):
            parse_manifest(bad, expect_version=1)
        with pytest.raises((CorruptObjectError, SignatureError), match=r"^(corrupt manifest 1: |version 1: )"):
            parse_manifest(bad, expect_version=1, authenticate=auth)


def test_a_flipped_squash_is_refused_naming_it(local_repo_url: str, tmp_path: Path) -> None:
    state = make_state(1, LAYOUT)
    pub = Publisher(local_repo_url, PublisherConfig(workers=2, progress=False, squash_strides=(2,)))
    s2 = step_state(state, seed=5)
    for s in (state, s2, step_state(s2, seed=6), s2):  # version 4 = version 2's bits: the squash is tiny
        pub.publish(s)
    repo = Repository(local_repo_url)
    assert repo.squashes() == [(2, 4)]
    store = open_store(local_repo_url)
    good = store.get(squash_key(2, 4))
    for offset in range(0, len(good), max(1, len(good) // 60)):
        store.put(squash_key(2, 4), _flip(good, offset))
        with pytest.raises(CorruptObjectError, match=r"^corrupt squash 2->4: "):
            Repository(local_repo_url).squash(2, 4)
        with pytest.raises(CorruptObjectError, match=r"^corrupt squash 2->4: "):
            verify_repository(local_repo_url)


def test_a_newer_writers_extra_field_is_covered_too(local_repo_url: str, tmp_path: Path) -> None:
    """A field this reader does not know follows the digest field; it is covered all the same."""
    from deltasync.format.digest import digest
    from deltasync.format.manifest import history_digest

    _publish(local_repo_url, tmp_path, 1)
    good = open_store(local_repo_url).get(manifest_key(1))
    m = pb.Manifest()
    m.ParseFromString(good)
    m.ClearField("manifest_digest")
    for name in ("repository_id", "history_parent", "history_parent_digest", "history_digest"):
        m.ClearField(name)
    prefix = m.SerializeToString(deterministic=True)  # fields 1-17
    # Fields 19 (repository_id) and 22 (history_digest, as the first version has it: no parent),
    # which this reader knows.
    known = b"\x9a\x01\x10" + bytes(16) + b"\xb2\x01\x10" + history_digest(b"", 1, m.version_digest, bytes(16))
    extra = b"\xf2\x01\x05hello"  # field 30, length-delimited, as a newer writer might add
    newer = prefix + b"\x92\x01\x10" + digest(prefix + known + extra) + known + extra
    assert parse_manifest(newer, expect_version=1).version == 1
    for offset in range(len(newer)):
        with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 1: "):
            parse_manifest(_flip(newer, offset), expect_version=1)


# -- 2. verify checks what pull checks ----------------------------------------------------------


def _header_edit(kind: str) -> Callable[[pb.Manifest], None]:
    def edit(m: pb.Manifest) -> None:
        f = next(f for f in m.files if f.kind == pb.File.SAFETENSORS)
        meta = json.loads(f.header[8:])
        names = [k for k in meta if k != "__metadata__"]
        if kind == "dtype":
            meta[names[0]]["dtype"] = "F16" if meta[names[0]]["dtype"] != "F16" else "BF16"
        elif kind == "shape":
            meta[names[0]]["shape"] = [*reversed(meta[names[0]]["shape"]), 1]
        elif kind == "bool-shape":  # loaders read true as 1; the manifest says 64
            meta[names[0]]["shape"] = [True, *meta[names[0]]["shape"][1:]]
        elif kind == "offsets":
            a, b = meta[names[0]]["data_offsets"], meta[names[1]]["data_offsets"]
            meta[names[0]]["data_offsets"], meta[names[1]]["data_offsets"] = b, a
        elif kind == "rename":
            meta["x" + names[0][1:]] = meta.pop(names[0])
        elif kind == "extra":
            meta["ghost"] = dict(meta[names[0]])
        elif kind == "not-json":
            f.header = f.header[:8] + b"{" * (len(f.header) - 8)
            return
        raw = json.dumps(meta, separators=(",", ":")).encode()
        raw += b" " * (len(f.header) - 8 - len(raw)) if len(raw) <= len(f.header) - 8 else b""
        f.size += 8 + len(raw) - len(f.header)
        f.header = len(raw).to_bytes(8, "little") + raw
    return edit


HEADER_FORGERIES = ["dtype", "shape", "bool-shape", "offsets", "rename", "extra", "not-json"]


@pytest.mark.parametrize("kind", HEADER_FORGERIES)
def test_a_safetensors_header_at_odds_with_the_tensors_is_refused_by_verify_and_pull(
    local_repo_url: str, tmp_path: Path, kind: str
) -> None:
    _publish(local_repo_url, tmp_path, 2)
    _rewrite(local_repo_url, 2, _header_edit(kind))  # digest recomputed: only the header check can tell
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: file 'model.safetensors': its safetensors header"):
        verify_repository(local_repo_url)
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: file 'model.safetensors': its safetensors header"):
        Subscriber(local_repo_url).pull_to_dir(tmp_path / "out")


def test_a_wrong_safetensors_file_digest_is_refused_by_verify(local_repo_url: str, tmp_path: Path) -> None:
    _publish(local_repo_url, tmp_path, 2)

    def edit(m: pb.Manifest) -> None:
        f = next(f for f in m.files if f.kind == pb.File.SAFETENSORS)
        f.digest = bytes(16)

    _rewrite(local_repo_url, 2, edit)
    with pytest.raises(ChecksumMismatchError, match=r"version 2, tensor '<file model.safetensors>'"):
        verify_repository(local_repo_url)
    verify_repository(local_repo_url, version=1)  # the other version is fine


@pytest.mark.parametrize("kind", ["digest", "size", "part-swapped", "part-missing"])
def test_a_blob_file_that_would_not_pull_does_not_verify(local_repo_url: str, tmp_path: Path, kind: str) -> None:
    _publish(local_repo_url, tmp_path, 1)
    store = open_store(local_repo_url)
    repo = Repository(local_repo_url)
    blobs = [f for f in repo.manifest(1).pb.files if f.kind == pb.File.BLOB]
    config = next(f for f in blobs if f.path == "config.json")
    other = next(f for f in blobs if f.path != "config.json")

    def edit(m: pb.Manifest) -> None:
        f = next(f for f in m.files if f.path == "config.json")
        if kind == "digest":
            f.digest = bytes(16)
        elif kind == "size":
            f.size += 1
        else:
            f.blob_parts[0] = other.blob_parts[0]
            f.size = other.size

    if kind == "part-missing":
        store.delete(f"blobs/{config.blob_parts[0].hex()}")
        expected = "blob of config.json is missing"
    else:
        _rewrite(local_repo_url, 1, edit)
        # A part of another size than the file's share is refused as it is read (pipeline.blob_parts).
        expected = r"^corrupt version 1: (file config\.json|blobs/[0-9a-f]{32}): "
    with pytest.raises(CorruptObjectError, match=expected):
        verify_repository(local_repo_url)
    with pytest.raises(DeltasyncError):
        Subscriber(local_repo_url).pull_to_dir(tmp_path / "out")


# -- 3. signed refs ----------------------------------------------------------------------------------


def _agent(url: str, out: Path, pub: Path, **kw: object) -> Agent:
    return Agent(url, out, AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02, **kw),  # type: ignore[arg-type]
                 trusted_keys=pub)


def _signed_repo(url: str, tmp_path: Path, key: Path, n: int = 3, **kw: object) -> Repository:
    _publish(url, tmp_path, n, key=key, **kw)
    return Repository(url, signing_key=key)


def test_refs_of_a_signing_publisher_are_signed_and_followed(local_repo_url: str, tmp_path: Path,
                                                             keys: tuple[Path, Path]) -> None:
    key, pub = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key)
    latest = json.loads((Path(local_repo_url) / LATEST).read_text())
    assert latest["name"] == "latest" and latest["version"] == 3 and len(latest["signature"]) == 128
    assert ref_hint((Path(local_repo_url) / LATEST).read_bytes()) == 3  # what relays and keyless readers see
    out = tmp_path / "out"
    assert _agent(local_repo_url, out, pub).run() == 3
    publisher.pin(2)
    assert _agent(local_repo_url, out, pub).run() == 2
    publisher.pin(None)  # a signed empty pin, not a deletion
    assert json.loads((Path(local_repo_url) / PIN).read_text())["version"] is None
    assert _agent(local_repo_url, out, pub).run() == 3
    assert Repository(local_repo_url).pinned() is None and Repository(local_repo_url).latest() == 3


ATTACKS = ["unsigned-pin", "unsigned-latest", "replayed-pin", "replayed-latest", "tampered-pin", "pin-as-latest",
           "foreign-key", "deleted-pin", "deleted-latest", "withheld-newest"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_trusting_agent_refuses_forged_refs_and_stays_on_its_version(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path], attack: str
) -> None:
    key, pub = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key)
    root = Path(local_repo_url)
    old_pin = None
    if attack in ("replayed-pin", "deleted-pin"):
        publisher.pin(1)
        old_pin = (root / PIN).read_bytes()
    out = tmp_path / "out"
    assert _agent(local_repo_url, out, pub).run() == (1 if old_pin else 3)
    if attack == "replayed-pin":
        publisher.pin(None)
        assert _agent(local_repo_url, out, pub).run() == 3
    held = _agent(local_repo_url, out, pub).current()
    digests = tree_digests(out)
    old_latest = (root / LATEST).read_bytes()
    expected = {
        "unsigned-pin": r"^refs/pin: is unsigned \(it names version 1\)",
        "unsigned-latest": r"^refs/latest: is unsigned",
        "replayed-pin": r"^refs/pin: is older than one already seen",
        "replayed-latest": r"^refs/latest: is older than one already seen",
        "tampered-pin": r"^refs/pin: signature does not verify",
        "pin-as-latest": r"^corrupt refs/latest: not a signed latest ref",
        "foreign-key": r"^refs/latest: signed by unknown key",
        "deleted-pin": r"^refs/pin: is missing, but a signed pin to version 1 was seen",
        "deleted-latest": r"^refs/latest: is missing",
        "withheld-newest": r"^refs/latest: names version 4, counter \d+, whose manifest is missing",
    }[attack]
    if attack == "unsigned-pin":
        (root / PIN).write_text("1\n")
    elif attack == "unsigned-latest":
        (root / LATEST).write_text("2\n")
    elif attack == "replayed-pin":
        assert old_pin is not None
        (root / PIN).write_bytes(old_pin)
    elif attack == "replayed-latest":
        Publisher(Repository(local_repo_url, signing_key=key), CONFIG).publish_dir(tmp_path / "ckpt2")  # version 4
        assert _agent(local_repo_url, out, pub).run() == 4
        held, digests = 4, tree_digests(out)
        (root / LATEST).write_bytes(old_latest)  # names 3, signed, but older than the 4 seen
        (root / manifest_key(4)).unlink()  # and the newest manifest withheld
    elif attack == "tampered-pin":
        body = json.loads(old_latest)
        body.update(name="pin", version=1)
        (root / PIN).write_text(json.dumps(body))
    elif attack == "pin-as-latest":
        publisher.pin(1)
        signed_pin = (root / PIN).read_bytes()
        publisher.pin(None)
        (root / LATEST).write_bytes(signed_pin)  # a signed pin replayed as the latest
    elif attack == "foreign-key":
        other, _, _ = generate_keypair(tmp_path / "keys" / "other")
        Repository(local_repo_url, signing_key=other)._write_ref("latest", 2)
    elif attack == "deleted-pin":
        (root / PIN).unlink()
    elif attack == "deleted-latest":
        (root / LATEST).unlink()
    elif attack == "withheld-newest":
        Publisher(Repository(local_repo_url, signing_key=key), CONFIG).publish_dir(tmp_path / "ckpt2")  # version 4
        (root / manifest_key(4)).unlink()
    with pytest.raises(DeltasyncError, match=expected) as e:
        _agent(local_repo_url, out, pub).run()
    assert "\n" not in str(e.value)
    assert Agent(local_repo_url, out).current() == held and tree_digests(out) == digests
    assert read_status(out)["last_error"] == str(e.value)
    # A one-shot trusting pull of the latest refuses the same way (ref counters in the copy's state).
    if attack not in ("deleted-pin", "unsigned-pin", "tampered-pin", "replayed-pin"):
        with pytest.raises(DeltasyncError, match=expected):
            Subscriber(Repository(local_repo_url, trusted_keys=pub, ref_memory=StateDB.open(out))).update_dir(out)


@pytest.mark.parametrize("attack", ["deleted-pin", "replayed-pin", "pin-cleared-then-replayed"])
def test_a_fresh_subscriber_refuses_a_pin_the_signed_latest_does_not_name(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path], attack: str
) -> None:
    """refs/latest names the counter of the pin it goes with (TUF's snapshot role, in small):
    a copy with no history refuses a deleted or older pin too."""
    key, pub = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key)
    root = Path(local_repo_url)
    publisher.pin(1)
    old = (root / PIN).read_bytes()
    if attack == "deleted-pin":
        publisher.pin(2)
        (root / PIN).unlink()
        expected = r"^refs/pin: is missing, but refs/latest names a pin with counter \d+"
    else:
        publisher.pin(2 if attack == "replayed-pin" else None)
        (root / PIN).write_bytes(old)
        expected = r"^refs/pin: is older than the pin refs/latest names \(version 1, counter \d+; refs/latest names"
    out = tmp_path / "fresh"
    with pytest.raises(RefError, match=expected):
        _agent(local_repo_url, out, pub).run()
    assert Agent(local_repo_url, out).current() is None
    with pytest.raises(RefError, match=expected):
        verify_repository(Repository(local_repo_url, trusted_keys=pub))
    assert Repository(local_repo_url).pinned() == (None if attack == "deleted-pin" else 1)  # keyless: as before


def test_a_following_agent_records_the_refusal_stays_and_moves_on_once_fixed(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    key, pub = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key)
    out = tmp_path / "out"
    agent = Agent(local_repo_url, out, AgentConfig(poll_interval=0.05, relist_interval=0.1, backoff_initial=0.05,
                                                   backoff_max=0.1), trusted_keys=pub)
    thread = threading.Thread(target=agent.run, kwargs={"follow": True})
    thread.start()
    try:
        _wait(lambda: agent.current() == 3)
        (Path(local_repo_url) / PIN).write_text("1\n")  # the attacker's rollback
        _wait(lambda: agent.figures.errors_total >= 2)
        assert agent.current() == 3
        assert "refs/pin: is unsigned" in (read_status(out)["last_error"] or "")
        publisher.pin(2)  # the publisher's own, signed
        _wait(lambda: agent.current() == 2)
    finally:
        agent.stop()
        thread.join(10)


def test_through_a_relay_signed_refs_are_followed_and_forged_ones_refused(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """The relay holds no keys: it reads a signed refs/latest as a hint (``_poll``) to announce
    versions, and passes refs through; the trusting agent behind it checks them."""
    from deltasync.relay.server import build_server

    key, pub = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key, n=2)
    relay = build_server(local_repo_url, "127.0.0.1:0", poll_interval=0.05, rescan_interval=3600).start()
    out = tmp_path / "out"
    agent = Agent(relay.url, out, AgentConfig(poll_interval=0.05, relist_interval=0.2, backoff_initial=0.05,
                                              backoff_max=0.1), trusted_keys=pub)
    thread = threading.Thread(target=agent.run, kwargs={"follow": True})
    thread.start()
    announced: list[int] = []
    watch = open_store(relay.url).watch(2)  # type: ignore[attr-defined]

    def listen() -> None:
        for v in watch:
            announced.append(v)
            return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        _wait(lambda: agent.current() == 2)
        Publisher(publisher, CONFIG).publish_dir(tmp_path / "ckpt1")  # version 3: a signed refs/latest
        listener.join(20)
        assert announced == [3]  # the relay's _poll read the signed ref as a hint
        _wait(lambda: agent.current() == 3)
        (Path(local_repo_url) / PIN).write_text("1\n")
        _wait(lambda: "refs/pin: is unsigned" in (read_status(out).get("last_error") or ""))
        assert agent.current() == 3
    finally:
        agent.stop()
        thread.join(10)
        watch.close()
        relay.stop(grace=0)


def _wait(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_expired_refs_are_refused_tolerated_within_the_grace_and_refreshed(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    key, pub = keys
    _signed_repo(local_repo_url, tmp_path, key, n=2, ref_ttl=1)
    time.sleep(2.1)
    out = tmp_path / "out"
    with pytest.raises(RefError, match=r"^refs/latest: expired at .* \(\d+s ago; version 2, counter \d+\): the publisher "
                                       r"re-signs it on every publish and pin, and with `deltasync refresh-refs`$"):
        _agent(local_repo_url, out, pub).run()
    assert Agent(local_repo_url, out).current() is None
    with caplog.at_level(logging.WARNING, logger="deltasync.repo.repository"):
        assert _agent(local_repo_url, out, pub, ref_grace=3600).run() == 2
    assert any("expired" in r.getMessage() and "refresh-refs" in r.getMessage() for r in caplog.records)
    assert Repository(local_repo_url, signing_key=key).refresh_refs() == (2, None)  # a quiet publisher's cron
    assert _agent(local_repo_url, out, pub).run() == 2
    body = json.loads((Path(local_repo_url) / LATEST).read_text())
    body["expires_unix"] += 10**6  # an expiry pushed out by the store: the signature covers it
    (Path(local_repo_url) / LATEST).write_text(json.dumps(body))
    with pytest.raises(RefError, match=r"^refs/latest: signature does not verify"):
        _agent(local_repo_url, out, pub).run()


def test_refresh_refs_refuses_to_bless_a_withheld_version_or_an_unsigned_pin(
    local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    key, _ = keys
    publisher = _signed_repo(local_repo_url, tmp_path, key)
    (Path(local_repo_url) / manifest_key(3)).unlink()
    with pytest.raises(RefError, match=r"names version 3, counter .* manifest is missing: refusing to sign an older latest"):
        publisher.refresh_refs()
    tmp = tmp_path / "again"
    local2 = str(tmp / "repo")
    tmp.mkdir()
    publisher2 = _signed_repo(local2, tmp, key, n=2)
    (Path(local2) / PIN).write_text("1\n")
    with pytest.raises(RefError, match=r"refs/pin: names version 1 .*not signed by this key"):
        publisher2.refresh_refs()
    with pytest.raises(DeltasyncError, match="refs are signed: sign the pin"):
        Repository(local2).pin(1)  # no key, on a signing repository


def test_unsigned_repositories_keep_plain_refs(local_repo_url: str, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    _publish(local_repo_url, tmp_path, 3)
    root = Path(local_repo_url)
    assert (root / LATEST).read_text() == "3\n"
    repo = Repository(local_repo_url)
    repo.pin(1)
    assert (root / PIN).read_text() == "1\n" and repo.pinned() == 1
    out = tmp_path / "out"
    assert Agent(local_repo_url, out, AgentConfig(retries=1)).run() == 1
    repo.pin(None)
    assert not (root / PIN).exists()
    assert Agent(local_repo_url, out, AgentConfig(retries=1)).run() == 3
    # A deleted newest manifest: keyless readers fall back to the listing (as before);
    # verify names the ref pointing at nothing.
    (root / manifest_key(3)).unlink()
    with caplog.at_level(logging.WARNING, logger="deltasync.repo.repository"):
        assert Repository(local_repo_url).latest() == 2
    assert any("refs/latest names version 3, whose manifest is missing" in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptObjectError, match=r"^corrupt refs/latest: names version 3, whose manifest is missing"):
        verify_repository(local_repo_url)


def test_verify_with_trusted_keys_checks_the_refs(local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    key, pub = keys
    _signed_repo(local_repo_url, tmp_path, key, n=2)
    report = verify_repository(Repository(local_repo_url, trusted_keys=pub))
    assert report.versions == [1, 2] and not report.notes
    (Path(local_repo_url) / PIN).write_text("1\n")
    with pytest.raises(RefError, match=r"^refs/pin: is unsigned"):
        verify_repository(Repository(local_repo_url, trusted_keys=pub))


def test_cli_one_line_errors_and_refresh(local_repo_url: str, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    key, pub = keys
    _signed_repo(local_repo_url, tmp_path, key, n=2)

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)

    out = tmp_path / "out"
    assert run("subscribe", out, "--repo", local_repo_url, "--trusted-key", pub, "-q").returncode == 0
    r = run("pin", "--repo", local_repo_url, "1")
    assert r.returncode == 2 and r.stderr.startswith("deltasync: error: this repository's refs are signed"), r.stderr
    (Path(local_repo_url) / PIN).write_text("1\n")
    r = run("subscribe", out, "--repo", local_repo_url, "--trusted-key", pub, "-q")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "refs/pin: is unsigned" in r.stderr, r.stderr
    assert run("pin", "--repo", local_repo_url, "--clear", "--signing-key", key).returncode == 0
    r = run("refresh-refs", "--repo", local_repo_url, "--signing-key", key)
    assert r.returncode == 0 and "signed refs/latest (version 2) and no pin" in r.stdout, r.stdout
    good = open_store(local_repo_url).get(manifest_key(2))
    open_store(local_repo_url).put(manifest_key(2), _flip(good, len(good) // 2))
    for cmd in (["pull", tmp_path / "fresh", "--version", "2"], ["verify"]):
        r = run(*cmd, "--repo", local_repo_url)
        assert r.returncode == 1 and r.stderr.startswith("deltasync: error: corrupt manifest 2: "), r.stderr
        assert r.stderr.count("\n") == 1


pytest_plugins = ["s3server"]


def test_on_s3_flipped_manifests_and_forged_refs_are_refused(s3_url: str, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    key, pub = keys
    _signed_repo(s3_url, tmp_path, key, n=2)
    store = open_store(s3_url)
    good = store.get(manifest_key(2))
    out = tmp_path / "out"
    assert _agent(s3_url, out, pub).run() == 2
    for offset in range(0, len(good), max(1, len(good) // 10)):
        store.put(manifest_key(2), _flip(good, offset))
        with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: "):
            verify_repository(s3_url)
    store.put(manifest_key(2), good)
    store.put(PIN, b"1\n")
    with pytest.raises(RefError, match=r"^refs/pin: is unsigned"):
        _agent(s3_url, out, pub).run()
    assert Agent(s3_url, out).current() == 2
