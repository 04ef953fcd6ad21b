"""A repository's identity (issue 23, items 0 and 3).

* A copy is at version N of a repository only when it holds that repository's version
  digest of N: a copy of another repository's version N (another URL, or the same path
  deleted and created again) is rebuilt, never reported current, by pull, the agent, check
  and engines.
* Manifests and signed refs name the repository they were made for, under the signature: a
  ``--trusted-key`` reader refuses another repository's objects signed by the same key
  (a swap, a replay, a mixed chain) with one line, and stays on its version.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.agents import Agent, AgentConfig, read_status
from deltasync.errors import RefError, RepositoryIdentityError
from deltasync.format.manifest import manifest_key, parse_manifest, seal
from deltasync.format.signing import generate_keypair
from deltasync.local.check import check_copy
from deltasync.repo.repository import LATEST, MARKER
from deltasync.storage import open_store
from deltasync.v1 import manifest_pb2 as pb

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


def _publish(url: str, ckpts: Path, n: int, *, seed: int, key: Path | None = None, shards: int = 1) -> list[Path]:
    """``n`` versions of a checkpoint directory, each step changing 1% of the elements."""
    state = make_state(seed, LAYOUT)
    pub = Publisher(Repository(url, signing_key=key) if key is not None else url, CONFIG)
    dirs: list[Path] = []
    for i in range(n):
        ckpt = ckpts / f"ckpt{i + 1}"
        write_checkpoint(ckpt, state, step=i + 1, shards=shards)
        pub.publish_dir(ckpt, base_dir=dirs[-1] if dirs else None)
        dirs.append(ckpt)
        state = step_state(state, seed=seed * 100 + i)
    return dirs


def _agent(url: str, out: Path, pub: Path | None = None) -> Agent:
    return Agent(url, out, AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02), trusted_keys=pub)


def _copy_objects(src: Path, dst: Path, *, marker: bool = True, only: tuple[str, ...] = ()) -> None:
    """What a store writer does: put another repository's objects over this one's."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        if not path.is_file() or (rel == MARKER and not marker) or (only and rel not in only):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst / rel)


# -- the identity is made with the repository, and named by what is signed -----------------------


def test_a_repository_is_created_with_an_identity_that_manifests_and_signed_refs_name(tmp_path: Path) -> None:
    key, _, _ = generate_keypair(tmp_path / "keys" / "team")
    url = str(tmp_path / "repo")
    _publish(url, tmp_path / "a", 2, seed=1, key=key)
    repo = Repository(url)
    identity = repo.identity()
    assert identity is not None and len(identity) == 16
    assert json.loads((Path(url) / MARKER).read_text())["id"] == identity.hex()
    assert all(repo.manifest(v).pb.repository_id == identity for v in (1, 2))
    assert json.loads((Path(url) / LATEST).read_text())["repository"] == identity.hex()
    other = str(tmp_path / "other")
    _publish(other, tmp_path / "b", 1, seed=1, key=key)
    assert Repository(other).identity() not in (None, identity)  # random per repository, not per content


def test_a_manifest_of_another_repository_is_refused_even_without_keys(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _publish(a, tmp_path / "ca", 2, seed=1)
    _publish(b, tmp_path / "cb", 3, seed=2)
    _copy_objects(Path(b), Path(a), marker=False, only=(manifest_key(3),))
    with pytest.raises(RepositoryIdentityError, match=r"^repository .*: version 3 belongs to repository [0-9a-f]{32}, "
                       r"not to this one"):
        Repository(a).manifest(3)


def test_a_repository_of_older_deltasync_gets_an_identity_from_its_next_publisher(tmp_path: Path) -> None:
    """Created before identities: a marker without "id" and versions naming none. The next
    publisher writes an identity derived from the oldest manifest (racing publishers agree);
    versions before it are read as before; a signing publisher starts a bound chain with a snapshot."""
    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")
    url = str(tmp_path / "repo")
    dirs = _publish(url, tmp_path / "c", 2, seed=1, key=key)
    store = open_store(url)
    store.put(MARKER, json.dumps({"format": 1}).encode())  # as older deltasync wrote it
    for v in (1, 2):  # and its manifests, naming no repository (re-signed: as that publisher signed them)
        m = pb.Manifest()
        m.ParseFromString(store.get(manifest_key(v)))
        for name in ("repository_id", "history_parent", "history_parent_digest", "history_digest"):
            m.ClearField(name)
        from deltasync.format.signing import load_signing_key, sign_manifest
        sign_manifest(m, load_signing_key(key))
        store.put(manifest_key(v), seal(m))
    Repository(url, signing_key=key).refresh_refs()
    assert Repository(url).identity() is None
    assert Repository(url, trusted_keys=pub).latest() == 2  # read as before
    expected = Repository(url)
    expected.create()  # what the next publisher does first
    identity = expected.identity()
    assert identity is not None
    again = Repository(url)
    store.put(MARKER, json.dumps({"format": 1}).encode())
    again.create()
    assert again.identity() == identity  # derived, not random: racing upgraders write the same
    state = step_state(make_state(1, LAYOUT), seed=5)
    ckpt = write_checkpoint(tmp_path / "c" / "ckpt3", state, step=3)
    result = Publisher(Repository(url, signing_key=key), CONFIG).publish_dir(ckpt, base_dir=dirs[-1])
    assert result.kind == "snapshot" and Repository(url).manifest(3).pb.repository_id == identity
    out = tmp_path / "out"
    assert Subscriber(Repository(url, trusted_keys=pub)).pull_to_dir(out) == 3
    assert tree_digests(out) == tree_digests(ckpt)


# -- item 0: at version N means holding that repository's version N ------------------------------------


def test_a_copy_of_another_repositorys_version_n_is_rebuilt_not_current(tmp_path: Path) -> None:
    repo_dir, repo_x = str(tmp_path / "repo_dir"), str(tmp_path / "repo_x")
    _publish(repo_dir, tmp_path / "d", 3, seed=1)
    x = _publish(repo_x, tmp_path / "x", 3, seed=2)
    out = tmp_path / "dirA"
    Subscriber(repo_dir).update_dir(out, 3)
    result = Subscriber(repo_x).update_dir(out)
    assert result.version == 3 and not result.held
    assert tree_digests(out) == tree_digests(x[-1])
    assert check_copy(out, repo=repo_x).ok
    report = check_copy(out, repo=repo_dir)
    assert not report.ok and "holds another version 3" in report.other_repository
    # and back: a copy of repo_x's version 3 is not repo_dir's either
    assert not Subscriber(repo_dir).update_dir(out, 3).held
    assert check_copy(out, repo=repo_dir).ok


def test_a_repository_deleted_and_created_again_is_another_repository(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path / "run1", 3, seed=1)
    first = Repository(url).identity()
    out, followed = tmp_path / "copy", tmp_path / "agent"
    Subscriber(url).update_dir(out)
    assert _agent(url, followed).run() == 3
    shutil.rmtree(url)
    new = _publish(url, tmp_path / "run2", 3, seed=2)  # a new run: versions restart at 1
    assert Repository(url).identity() not in (None, first)
    assert not Subscriber(url).update_dir(out).held
    assert tree_digests(out) == tree_digests(new[-1])
    agent = _agent(url, followed)
    assert agent.run() == 3  # an unsigned follower follows the repository now at that URL
    assert tree_digests(followed) == tree_digests(new[-1])
    assert read_status(followed)["repository_id"] == Repository(url).identity().hex()  # type: ignore[union-attr]


@pytest.mark.slow
def test_cli_pull_into_a_copy_of_another_repository_rebuilds_and_check_says_which(tmp_path: Path) -> None:
    repo_dir, repo_x = str(tmp_path / "repo_dir"), str(tmp_path / "repo_x")
    _publish(repo_dir, tmp_path / "d", 3, seed=1)
    x = _publish(repo_x, tmp_path / "x", 3, seed=2)
    out = tmp_path / "dirA"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True, timeout=120)

    assert cli("pull", str(out), "--repo", repo_dir, "--version", "3", "-q").returncode == 0
    pulled = cli("pull", str(out), "--repo", repo_x, "-q")
    assert pulled.returncode == 0, pulled.stderr
    assert "already at" not in pulled.stdout and pulled.stdout.startswith("pulled version 3")
    assert tree_digests(out) == tree_digests(x[-1])
    ok = cli("check", str(out), "--repo", repo_x)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(": ok"), ok.stdout + ok.stderr
    wrong = cli("check", str(out), "--repo", repo_dir)
    assert wrong.returncode == 1 and "not that repository's version" in wrong.stdout
    identity = Repository(repo_x).identity()
    assert identity is not None and f"(identity {identity.hex()})" in cli("status", str(out)).stdout


def test_an_engine_holds_a_version_only_with_its_digest(tmp_path: Path) -> None:
    from deltasync.engines.torch_engine import TorchEngine

    url = str(tmp_path / "repo")
    _publish(url, tmp_path / "run1", 2, seed=1)
    state = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in LAYOUT}
    engine = TorchEngine(state, url)
    assert engine.update(2) is not None and engine.update(2) is None
    shutil.rmtree(url)
    new = _publish(url, tmp_path / "run2", 2, seed=2)
    engine.subscriber = Subscriber(url)  # what an agent does when it sees a new identity
    assert engine.version == 2 and not engine.holds(2)
    assert engine.update(2) is not None  # restaged against the new version 2's digests
    from safetensors.torch import load_file

    want = load_file(new[-1] / "model.safetensors")
    assert all(torch.equal(state[k], want[k]) for k in want)


# -- item 3: a trusting reader refuses another repository signed by the same key -------------------------


@pytest.mark.parametrize("attack", ["swap", "replay", "mixed-chain"])
def test_a_trusting_agent_refuses_another_repository_signed_by_the_same_key(tmp_path: Path, attack: str) -> None:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")  # one key per team, many runs
    a, b = tmp_path / "A", tmp_path / "B"
    _publish(str(a), tmp_path / "ca", 4, seed=1, key=key, shards=2)
    _publish(str(b), tmp_path / "cb", 6, seed=2, key=key)
    out = tmp_path / "copy"
    assert _agent(str(a), out, pub).run() == 4
    held = tree_digests(out)
    if attack == "swap":  # B's objects over A's, its marker (identity) included
        _copy_objects(b, a)
    elif attack == "replay":  # B's manifests and refs replayed into A
        _copy_objects(b, a, marker=False)
    else:  # a chain mixing the two: B's version 5, a delta whose chain goes through A's 1..4
        m = pb.Manifest()
        m.ParseFromString((b / manifest_key(5)).read_bytes())
        _copy_objects(b, a, marker=False, only=(manifest_key(5), *(f"packs/{p.key.split('/')[1]}" for p in m.packs)))
    with pytest.raises((RepositoryIdentityError, RefError)) as err:
        _agent(str(a), out, pub).run()
    assert "\n" not in str(err.value) and ("repository" in str(err.value))
    assert tree_digests(out) == held and _agent(str(a), out).current() == 4
    # the same store read by a fresh trusting reader: nothing of B is taken as A's
    if attack != "swap":
        with pytest.raises((RepositoryIdentityError, RefError)):
            Subscriber(Repository(str(a), trusted_keys=pub)).pull_to_dir(tmp_path / "fresh")


def test_a_signed_ref_of_another_repository_is_refused_by_a_fresh_trusting_reader(tmp_path: Path) -> None:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")
    a, b = tmp_path / "A", tmp_path / "B"
    _publish(str(a), tmp_path / "ca", 2, seed=1, key=key)
    _publish(str(b), tmp_path / "cb", 2, seed=2, key=key)
    # B's version 2 and its ref replayed into A: each signed, each naming B
    _copy_objects(b, a, marker=False, only=(LATEST,))
    with pytest.raises(RepositoryIdentityError, match=r"refs/latest names repository [0-9a-f]{32}, not this one"):
        Repository(str(a), trusted_keys=pub).latest()
    body = json.loads((b / LATEST).read_text())
    body.pop("repository")  # a ref naming no repository in a repository that has one: refused too
    (a / LATEST).write_text(json.dumps(body))
    with pytest.raises(RefError):
        Repository(str(a), trusted_keys=pub).latest()
    assert parse_manifest((a / manifest_key(2)).read_bytes()).pb.repository_id == Repository(str(a)).identity()


def test_a_trusting_copy_moved_to_another_repository_is_not_held_to_the_first_ones_ref_counters(
    tmp_path: Path,
) -> None:
    """Ref counters are remembered per repository identity: repo_x, published before repo_dir
    (lower counters), is pulled into a copy that followed repo_dir, not refused as a replay."""
    from deltasync.local.state import StateDB

    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")
    repo_x, repo_dir = str(tmp_path / "repo_x"), str(tmp_path / "repo_dir")
    x = _publish(repo_x, tmp_path / "x", 3, seed=2, key=key)
    _publish(repo_dir, tmp_path / "d", 3, seed=1, key=key)
    out = tmp_path / "dirA"

    def pull(url: str) -> int:
        db = StateDB.open(out)
        return Subscriber(Repository(url, trusted_keys=pub, ref_memory=db)).update_dir(out).version

    out.mkdir()
    assert pull(repo_dir) == 3
    assert pull(repo_x) == 3 and tree_digests(out) == tree_digests(x[-1])
    # the memory still refuses a replay within one repository
    old = (Path(repo_x) / LATEST).read_bytes()
    Repository(repo_x, signing_key=key).refresh_refs()
    assert pull(repo_x) == 3
    (Path(repo_x) / LATEST).write_bytes(old)
    with pytest.raises(RefError, match="replayed"):
        pull(repo_x)
