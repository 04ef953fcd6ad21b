"""Signed manifests: keygen, sign on commit, verify on read, refusal messages, key rotation."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import CorruptObjectError, Publisher, PublisherConfig, Repository, Subscriber, UsageError
from deltasync.errors import SignatureError
from deltasync.format.manifest import manifest_key
from deltasync.format.signing import generate_keypair, key_id, load_public_key, load_signing_key
from deltasync.storage import open_store
from deltasync.v1 import manifest_pb2 as pb

LAYOUT = (("w", (64, 32), torch.bfloat16), ("b", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2)


def _keypair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    (tmp_path / "keys").mkdir(exist_ok=True)
    key, pub, _ = generate_keypair(tmp_path / "keys" / name)
    return key, pub


@pytest.fixture
def k1(tmp_path: Path) -> tuple[Path, Path]:
    return _keypair(tmp_path, "k1")


@pytest.fixture
def k2(tmp_path: Path) -> tuple[Path, Path]:
    return _keypair(tmp_path, "k2")


def _kid(pub: Path) -> str:
    return key_id(load_public_key(pub)).hex()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8))
        for k in a
    )


def _rewrite(url: str, version: int, edit: object) -> None:
    """Change a committed manifest in place (what an attacker with write access to the store does)."""
    store = open_store(url)
    m = pb.Manifest()
    m.ParseFromString(store.get(manifest_key(version)))
    assert callable(edit)
    edit(m)
    store.put(manifest_key(version), m.SerializeToString(deterministic=True))


# -- keys ---------------------------------------------------------------------------------------


def test_keygen_cli_writes_a_pair_and_never_overwrites(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60)

    r = run("keygen", "--out", "pub-key")
    assert r.returncode == 0, r.stderr
    key, pub = tmp_path / "pub-key.key", tmp_path / "pub-key.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert key_id(load_signing_key(key).public_key()) == key_id(load_public_key(pub))
    assert _kid(pub) in r.stdout
    before = key.read_bytes(), pub.read_bytes()

    r = run("keygen", "--out", "pub-key")
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltasync: error: "), r.stderr
    assert "already exists; refusing to overwrite" in lines[0]
    assert (key.read_bytes(), pub.read_bytes()) == before

    pub.unlink()  # half a pair left: still refused, and the private key is kept
    assert run("keygen", "--out", "pub-key").returncode != 0
    assert key.read_bytes() == before[0] and not pub.exists()


def test_bad_key_files_are_usage_errors(tmp_path: Path, k1: tuple[Path, Path]) -> None:
    key, pub = k1
    (tmp_path / "junk.pem").write_bytes(b"not a key")
    with pytest.raises(UsageError, match="trust the public half"):
        load_public_key(key)
    with pytest.raises(UsageError, match="not a PEM public key"):
        load_public_key(tmp_path / "junk.pem")
    with pytest.raises(UsageError, match="not an unencrypted PEM private key"):
        load_signing_key(pub)
    with pytest.raises(UsageError, match="cannot read key"):
        Subscriber(str(tmp_path / "repo"), trusted_keys=tmp_path / "missing.pub")
    with pytest.raises(UsageError, match="to the Repository"):
        Publisher(Repository(str(tmp_path / "repo")), signing_key=key)


# -- sign and verify -----------------------------------------------------------------------------


def test_signed_versions_roundtrip_and_record_the_key(local_repo_url: str, tmp_path: Path, k1: tuple[Path, Path]) -> None:
    key, pub = k1
    s1 = make_state(1, LAYOUT)
    s2 = step_state(s1, 2)
    publisher = Publisher(local_repo_url, CONFIG, signing_key=key)
    v1, v2 = publisher.publish(s1), publisher.publish(s2)
    repo = Repository(local_repo_url, trusted_keys=pub)
    for v in (v1, v2):
        m = repo.manifest(v).pb
        assert len(m.signature) == 64 and m.signing_key_id.hex() == _kid(pub)
    assert not repo.manifest(v2).is_snapshot

    sub = Subscriber(local_repo_url, trusted_keys=[pub], workers=2)
    assert _same(sub.pull(v1), s1)
    got = sub.pull(v2)
    assert _same(got, s2)  # the delta, applied to the bits pulled before
    assert got.plan.base == v1
    out = tmp_path / "out"
    assert Subscriber(local_repo_url, trusted_keys=pub).pull_to_dir(out) == v2
    assert (out / "model.safetensors").is_file()
    # Readers without a trusted key ignore signatures.
    assert _same(Subscriber(local_repo_url).pull(v2), s2)


def test_unsigned_version_is_refused_before_any_data_is_read(local_repo_url: str, tmp_path: Path,
                                                             k1: tuple[Path, Path]) -> None:
    _, pub = k1
    Publisher(local_repo_url, CONFIG).publish(make_state(1, LAYOUT))
    for p in (Path(local_repo_url) / "packs").iterdir():
        p.unlink()  # had the pull touched any data, it would fail on a missing pack instead
    out = tmp_path / "out"
    with pytest.raises(SignatureError) as e:
        Subscriber(local_repo_url, trusted_keys=pub).pull_to_dir(out)
    assert str(e.value) == "version 1: unsigned manifest (a trusted key is configured)"
    assert e.value.version == 1
    assert not out.exists() or not any(p for p in out.rglob("*") if ".deltasync" not in p.parts)
    with pytest.raises(SignatureError, match="unsigned"):
        Subscriber(local_repo_url, trusted_keys=pub).pull()


def test_wrong_key_is_refused(local_repo_url: str, k1: tuple[Path, Path], k2: tuple[Path, Path]) -> None:
    Publisher(local_repo_url, CONFIG, signing_key=k1[0]).publish(make_state(1, LAYOUT))
    with pytest.raises(SignatureError) as e:
        Subscriber(local_repo_url, trusted_keys=k2[1]).pull()
    assert str(e.value) == f"version 1: signed by unknown key {_kid(k1[1])}"


@pytest.mark.parametrize("tamper", ["metadata", "digest", "signature", "key_id", "strip"])
def test_tampered_signed_manifest_is_refused(local_repo_url: str, tamper: str, k1: tuple[Path, Path],
                                             k2: tuple[Path, Path]) -> None:
    Publisher(local_repo_url, CONFIG, signing_key=k1[0]).publish(make_state(1, LAYOUT), metadata={"step": "1"})
    other_id = key_id(load_public_key(k2[1]))

    def edit(m: pb.Manifest) -> None:
        if tamper == "metadata":
            m.metadata["step"] = "2"
        elif tamper == "digest":  # what an attacker swapping in other weights must change
            c = m.tensors[0].chunks[0]
            c.target_digest = bytes(16)
        elif tamper == "signature":
            m.signature = bytes([m.signature[0] ^ 1]) + m.signature[1:]
        elif tamper == "key_id":
            m.signing_key_id = other_id
        else:
            m.ClearField("signature")
            m.ClearField("signing_key_id")

    _rewrite(local_repo_url, 1, edit)
    expected = "unsigned manifest (a trusted key is configured)" if tamper == "strip" else "signature does not verify"
    with pytest.raises(SignatureError) as e:
        Subscriber(local_repo_url, trusted_keys=[k1[1], k2[1]]).pull()
    assert str(e.value) == f"version 1: {expected}"


def test_signed_manifest_moved_to_another_version_is_refused(local_repo_url: str, k1: tuple[Path, Path]) -> None:
    Publisher(local_repo_url, CONFIG, signing_key=k1[0]).publish(make_state(1, LAYOUT))
    store = open_store(local_repo_url)
    store.put(manifest_key(7), store.get(manifest_key(1)))  # replay v1 as a "newer" version
    with pytest.raises(CorruptObjectError, match="claims version 1"):
        Subscriber(local_repo_url, trusted_keys=k1[1]).pull()


def test_key_rotation(local_repo_url: str, tmp_path: Path, k1: tuple[Path, Path], k2: tuple[Path, Path]) -> None:
    s1 = make_state(1, LAYOUT)
    ckpt1, ckpt2 = tmp_path / "ckpt1", tmp_path / "ckpt2"
    write_checkpoint(ckpt1, s1)
    write_checkpoint(ckpt2, step_state(s1, 2))
    Publisher(local_repo_url, CONFIG, signing_key=k1[0]).publish_dir(ckpt1)
    # The next publisher (restarted with the new key) diffs against v1 through its checkpoint.
    v2 = Publisher(local_repo_url, CONFIG, signing_key=k2[0]).publish_dir(ckpt2, base_dir=ckpt1)
    repo = Repository(local_repo_url)
    assert repo.manifest(v2).parent == 1 and not repo.manifest(v2).is_snapshot
    assert repo.manifest(1).pb.signing_key_id != repo.manifest(v2).pb.signing_key_id

    out = tmp_path / "out"
    assert Subscriber(local_repo_url, trusted_keys=[k1[1], k2[1]]).pull_to_dir(out, v2) == v2
    assert tree_digests(out) == tree_digests(ckpt2)
    with pytest.raises(SignatureError) as e:  # the chain runs through v1, signed by the retired key
        Subscriber(local_repo_url, trusted_keys=[k2[1]]).pull_to_dir(tmp_path / "out2", v2)
    assert str(e.value).startswith(f"version 2: its delta chain goes through version 1: signed by unknown key {_kid(k1[1])}")


def test_commit_refuses_what_its_own_readers_would_refuse(local_repo_url: str, k1: tuple[Path, Path],
                                                          k2: tuple[Path, Path]) -> None:
    repo = Repository(local_repo_url, signing_key=k1[0], trusted_keys=k2[1])
    with pytest.raises(SignatureError, match="signed by unknown key"):
        Publisher(repo, CONFIG).publish(make_state(1, LAYOUT))
    assert Repository(local_repo_url).versions() == []


# -- the command line ----------------------------------------------------------------------------


def test_cli_publish_signed_and_pull_verify_log_inspect_trusted(tmp_path: Path, k1: tuple[Path, Path],
                                                                k2: tuple[Path, Path]) -> None:
    env = dict(os.environ, DELTASYNC_CACHE=str(tmp_path / "cache"))

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    ckpt, repo, out = tmp_path / "ckpt", tmp_path / "repo", tmp_path / "out"
    write_checkpoint(ckpt, make_state(3, LAYOUT))
    r = run("publish", ckpt, "--repo", repo, "--signing-key", k1[0], "-q")
    assert r.returncode == 0, r.stderr
    for cmd in (["pull", "--out", out, "-q"], ["verify", "-q"], ["log"], ["inspect"]):
        r = run(*cmd, "--repo", repo, "--trusted-key", k2[1], "--trusted-key", k1[1])
        assert r.returncode == 0, (cmd, r.stderr)
    assert tree_digests(out) == tree_digests(ckpt)
    for cmd in (["pull", "--out", tmp_path / "out2"], ["verify"], ["inspect"]):
        r = run(*cmd, "--repo", repo, "--trusted-key", k2[1])
        assert r.returncode == 1
        assert r.stderr == f"deltasync: error: version 1: signed by unknown key {_kid(k1[1])}\n", (cmd, r.stderr)
    r = run("log", "--repo", repo, "--trusted-key", k2[1])  # log lists every version with its signature
    assert r.returncode == 0 and f"signed by unknown key {_kid(k1[1])}" in r.stdout, r.stdout
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").glob("*.safetensors"))


# -- starting a signed chain on a repository with unsigned versions ----------------------------------


def test_the_first_signed_version_after_unsigned_ones_is_a_snapshot(
    local_repo_url: str, k1: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    key, pub_key = k1
    s1 = make_state(1, LAYOUT)
    s2 = step_state(s1, seed=2)
    s3 = step_state(s2, seed=3)
    unsigned = Publisher(local_repo_url, CONFIG)
    unsigned.publish(s1)
    assert unsigned.publish(s2).kind == "delta"
    signed = Publisher(local_repo_url, CONFIG, signing_key=key)
    signed._bits, signed._bits_version = unsigned._bits, unsigned._bits_version  # the same base in memory
    r3 = signed.publish(s3)
    assert r3.kind == "snapshot"  # a delta here would sit on the unsigned chain 1-2
    s4 = step_state(s3, seed=4)
    assert signed.publish(s4).kind == "delta"
    sub = Subscriber(local_repo_url, trusted_keys=[pub_key], workers=2)
    assert _same(sub.pull(4), s4)
    with pytest.raises(SignatureError, match="version 2: unsigned manifest"):
        sub.pull(2)
    # An unsigned publish after signed ones works, with a warning naming what trusting readers will do.
    with caplog.at_level("WARNING", logger="deltasync"):
        unsigned.publish(step_state(s4, seed=5))
    assert "unsigned version after signed ones" in caplog.text


def test_a_signed_delta_on_an_unsigned_chain_names_the_chain(
    local_repo_url: str, k1: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repositories written before the rule above can hold one; the refusal says why."""
    import deltasync.publish.publisher as publisher_module

    key, pub_key = k1
    s1 = make_state(1, LAYOUT)
    s2 = step_state(s1, seed=2)
    pub = Publisher(local_repo_url, CONFIG)
    pub.publish(s1)
    pub.publish(s2)
    monkeypatch.setattr(publisher_module, "signing_policy", lambda repo, parent: True)
    signed = Publisher(local_repo_url, CONFIG, signing_key=key)
    signed._bits, signed._bits_version = pub._bits, pub._bits_version
    assert signed.publish(step_state(s2, seed=3)).kind == "delta"
    with pytest.raises(SignatureError, match=r"version 3: its delta chain goes through version 2: unsigned manifest"):
        Subscriber(local_repo_url, trusted_keys=[pub_key]).pull(3)
