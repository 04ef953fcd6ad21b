"""Issue 23, item 2: a manifest without its whole-manifest digest is refused everywhere.

Nothing was ever released without ``manifest_digest``, so a manifest lacking it was cut or
forged: cutting the last 19 bytes (the field) and flipping a byte of a file name must not
turn the check off. Pull, verify, the agent, a read relay's subscribers and a writable relay
all refuse it, naming the manifest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import make_state, step_state, tree_digests
from test_hostile_integrity import LAYOUT, _publish  # the same checkpoints the other hostile-manifest tests publish

from deltasync import Publisher, PublisherConfig, Subscriber
from deltasync.errors import CorruptObjectError, DeltasyncError
from deltasync.format.manifest import manifest_key, parse_manifest, seal
from deltasync.relay.server import build_server
from deltasync.storage import GrpcStore, LocalStore, open_store
from deltasync.v1 import manifest_pb2 as pb

DIGEST_FIELD_BYTES = 19  # the whole-manifest digest field, as stored
WRITE = "write-token-for-tests"



def _cut_and_rename(url: str, version: int) -> bytes:
    """The issue's attack: drop the digest field, then rename config.json to bonfig.json."""
    store = open_store(url)
    data = store.get(manifest_key(version))
    m = pb.Manifest()
    m.ParseFromString(data)
    field = b"\x92\x01\x10" + m.manifest_digest  # tag (2 bytes), length (1), xxh3-128 (16)
    assert len(field) == DIGEST_FIELD_BYTES and data.count(field) == 1
    cut = data.replace(field, b"")  # the last 19 bytes, unless fields numbered above it follow
    at = cut.index(b"config.json")
    forged = cut[:at] + b"b" + cut[at + 1 :]
    store.put(manifest_key(version), forged)
    return forged


@pytest.fixture
def forged_repo(tmp_path: Path) -> tuple[str, list[Path]]:
    url = str(tmp_path / "repo")
    ckpts = _publish(url, tmp_path, 2)
    assert (ckpts[1] / "config.json").exists()
    _cut_and_rename(url, 2)
    return url, ckpts


def test_pull_and_verify_refuse_a_manifest_cut_before_its_digest(forged_repo: tuple[str, list[Path]], tmp_path: Path) -> None:
    from deltasync.ops.verify import verify_repository

    url, ckpts = forged_repo
    out = tmp_path / "out"
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 2: .*no whole-manifest digest"):
        Subscriber(url).pull_to_dir(out)
    assert not (out / "bonfig.json").exists()
    with pytest.raises(CorruptObjectError, match=r"manifest 2: .*no whole-manifest digest"):
        verify_repository(url)
    # Version 1 is untouched and still pulls.
    Subscriber(url).pull_to_dir(tmp_path / "v1", 1)
    assert tree_digests(tmp_path / "v1") == tree_digests(ckpts[0])


def test_the_cli_refuses_it_with_one_line(forged_repo: tuple[str, list[Path]], tmp_path: Path) -> None:
    url, _ = forged_repo
    for args in (["pull", str(tmp_path / "out"), "--repo", url], ["verify", "--repo", url]):
        r = subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, (args, r.stdout)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "manifest 2" in lines[0] and "whole-manifest digest" in lines[0], r.stderr
    assert not (tmp_path / "out" / "bonfig.json").exists()


def test_a_canonical_manifest_without_the_digest_is_refused(tmp_path: Path) -> None:
    """Not only a cut one: a manifest serialized canonically but never sealed is refused too
    (manifests and squashes alike: both are read through parse_manifest)."""
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, 1)
    good = open_store(url).get(manifest_key(1))
    assert parse_manifest(good, expect_version=1).version == 1
    m = pb.Manifest()
    m.ParseFromString(good)
    m.ClearField("manifest_digest")
    with pytest.raises(CorruptObjectError, match=r"^corrupt manifest 1: .*no whole-manifest digest"):
        parse_manifest(m.SerializeToString(deterministic=True), expect_version=1)
    with pytest.raises(CorruptObjectError, match=r"no whole-manifest digest"):
        parse_manifest(m.SerializeToString(deterministic=True))
    assert parse_manifest(seal(m), expect_version=1).version == 1  # the same manifest, sealed: read


def test_the_agent_refuses_it_and_keeps_its_version(forged_repo: tuple[str, list[Path]], tmp_path: Path) -> None:
    from deltasync.agents import Agent, AgentConfig

    url, _ = forged_repo
    out = tmp_path / "agent"
    Subscriber(url).pull_to_dir(out, 1)
    before = tree_digests(out)
    agent = Agent(url, out, AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02))
    with pytest.raises(DeltasyncError, match=r"manifest 2: .*no whole-manifest digest"):
        agent.run()
    assert tree_digests(out) == before and not (out / "bonfig.json").exists()


def test_relays_refuse_it(forged_repo: tuple[str, list[Path]], tmp_path: Path) -> None:
    url, _ = forged_repo
    # A read relay checks a manifest before it caches or serves its last bytes (issue 33, item 4):
    # its subscribers get the refusal, naming the object.
    with build_server(url, "127.0.0.1:0", poll_interval=0.05) as relay, pytest.raises(
        CorruptObjectError, match=r"manifests/0+2\.pb: .*no whole-manifest digest"
    ):
        Subscriber(relay.url).pull_to_dir(tmp_path / "via-relay")
    assert not (tmp_path / "via-relay" / "bonfig.json").exists()
    # A writable relay refuses to store it: nothing is committed.
    origin = LocalStore(tmp_path / "origin")
    forged = open_store(url).get(manifest_key(2))
    with build_server(origin, "127.0.0.1:0", accept_writes=True, write_token=WRITE) as writable:
        store = GrpcStore(writable.url, write_token=WRITE)
        try:
            with pytest.raises(DeltasyncError, match=r"no whole-manifest digest"):
                store.put(manifest_key(2), forged, if_absent=True)
        finally:
            store.close()
    assert not origin.exists(manifest_key(2))


def test_a_writable_relay_stores_what_a_publisher_writes_squashes_included(tmp_path: Path) -> None:
    """The relay's manifest check reads a squash ``squashes/<C>-<A>.pb`` as version C, as readers do."""
    from deltasync.repo.repository import Repository

    origin = tmp_path / "origin"
    with build_server(str(origin), "127.0.0.1:0", accept_writes=True, write_token=WRITE) as relay:
        store = GrpcStore(relay.url, write_token=WRITE)
        try:
            pub = Publisher(store, PublisherConfig(workers=2, progress=False, squash_strides=(2,)))
            state = make_state(1, LAYOUT)
            s2 = step_state(state, seed=5)
            for s in (state, s2, step_state(s2, seed=6), s2):
                pub.publish(s)
        finally:
            store.close()
    repo = Repository(str(origin))
    assert repo.versions() == [1, 2, 3, 4] and repo.squashes() == [(2, 4)]
    assert repo.squash(2, 4).version == 4
