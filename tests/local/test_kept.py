"""KeptObjects (local/kept.py): the one way the copy agent, the engine agent and a vLLM worker
keep the chain of objects they follow: capture, drop on damage (and retry once), prune."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltasync
from deltasync.errors import ChecksumMismatchError, CorruptObjectError
from deltasync.local.cache import CachedStore, LocalCache
from deltasync.local.kept import KeptObjects, chain_packs
from deltasync.storage import open_store


def _states() -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    out = {}
    for v in (1, 2, 3):
        w = w.clone()
        w[v, :8] += 1.0  # a small change per version: stored as deltas
        out[v] = {"w": w, "b": torch.full((64,), float(v))}
    return out


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    repo = str(tmp_path / "repo")
    pub = deltasync.Publisher(repo)
    states = _states()
    for v, state in states.items():
        assert pub.publish(state) == v
    assert not deltasync.Repository(repo).manifest(3).is_snapshot
    return repo, states


def _kept(repo: str, root: Path) -> tuple[KeptObjects, deltasync.Subscriber]:
    kept = KeptObjects(LocalCache(root), CachedStore(open_store(repo)), what="test objects")
    return kept, deltasync.Subscriber(kept.store)


def _pull(kept: KeptObjects, sub: deltasync.Subscriber, version: int, *, retry: bool) -> dict[str, torch.Tensor]:
    kept.capture(chain_packs(sub.repo, version))
    pulled: dict[str, torch.Tensor] = kept.read(lambda: sub.pull(version), retry=retry)
    return pulled


def _packs_fetched(kept: KeptObjects) -> int:
    return kept.store.fetched_by_kind().get("packs", 0)


def test_a_kept_chain_is_read_locally_the_next_time(published: tuple[str, dict[int, dict[str, torch.Tensor]]],
                                                    tmp_path: Path) -> None:
    repo, states = published
    kept, sub = _kept(repo, tmp_path / "objects")
    got = _pull(kept, sub, 3, retry=True)
    assert all(torch.equal(got[n], states[3][n]) for n in states[3])
    first = _packs_fetched(kept)
    assert first > 0 and kept.store.capture == set()  # the capture ends with the read
    again, sub2 = _kept(repo, tmp_path / "objects")
    got = _pull(again, sub2, 3, retry=True)
    assert _packs_fetched(again) == 0 and all(torch.equal(got[n], states[3][n]) for n in states[3])


def test_a_damaged_kept_pack_is_dropped_and_read_again_once(published: tuple[str, dict[int, dict[str, torch.Tensor]]],
                                                            tmp_path: Path) -> None:
    repo, states = published
    root = tmp_path / "objects"
    kept, sub = _kept(repo, root)
    _pull(kept, sub, 3, retry=True)
    for piece in (root / "packs").rglob("*"):
        if piece.is_file():
            piece.write_bytes(b"\0" * piece.stat().st_size)
    # Without retry the damage goes to the caller (an agent's loop retries), and the kept packs are gone.
    strict, sub2 = _kept(repo, root)
    with pytest.raises((CorruptObjectError, ChecksumMismatchError)):
        _pull(strict, sub2, 3, retry=False)
    assert not (root / "packs").exists() and strict.store.capture == set()
    # With retry (a worker) the pull is done again from the repository, bit-exact.
    _pull(strict, sub2, 3, retry=True)  # kept again
    for piece in (root / "packs").rglob("*"):
        if piece.is_file():
            piece.write_bytes(b"\0" * piece.stat().st_size)
    worker, sub3 = _kept(repo, root)
    got = _pull(worker, sub3, 3, retry=True)
    assert _packs_fetched(worker) > 0 and all(torch.equal(got[n], states[3][n]) for n in states[3])


def test_prune_keeps_what_the_versions_named_need(published: tuple[str, dict[int, dict[str, torch.Tensor]]],
                                                  tmp_path: Path) -> None:
    repo, _ = published
    kept, sub = _kept(repo, tmp_path / "objects")
    _pull(kept, sub, 3, retry=True)
    r = deltasync.Repository(repo)
    assert kept.recent(3, 2) == {2, 3} and kept.recent(3, 8) == {1, 2, 3}
    kept.prune({3}, chains=[1, 2, 3])  # an engine agent's: the chain from the snapshot, whole
    snapshot = {p.key for p in r.manifest(1).pb.packs}
    assert kept.cache.versions() == [1, 2, 3]
    assert snapshot & {f"packs/{p.name}" for p in (tmp_path / "objects" / "packs").iterdir()}
    kept.prune({3})  # a copy's agent: a delta's own packs, not its snapshot's
    packs = {f"packs/{p.name}" for p in (tmp_path / "objects" / "packs").iterdir()}
    assert packs and packs <= {p.key for p in r.manifest(3).pb.packs}
    assert kept.cache.versions() == [3]
