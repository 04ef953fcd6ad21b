"""Many ranks, one version: a real multi-process gloo group publishing to the S3 test server."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.slices import Region
from deltasync.ops.verify import verify_repository
from deltasync.testing import spawn_ranks

pytest_plugins = ["s3server"]

WORLD = 3
ROWS, COLS = 96, 40


def _full_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    state = {
        "fsdp.w": torch.randn(ROWS, COLS, generator=g).bfloat16(),  # dim-0 shards (FSDP-like)
        "tp.v": torch.randn(COLS, ROWS, generator=g),  # dim-1 shards (row-parallel TP)
        "norm": torch.randn(COLS, generator=g),  # replicated on every rank
        "head": torch.randn(17, 3, generator=g).half(),  # whole, on one rank
    }
    for k in range(step):  # a few elements move per step, like an RL update
        for t in state.values():
            flat = t.view(-1)
            flat[(k * 7) % flat.numel()] += 0.5
    return state


def _rank_state(full: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    rows = ROWS // WORLD
    cols = ROWS // WORLD
    part: dict[str, Any] = {
        "fsdp.w": deltasync.Slice(full["fsdp.w"][rank * rows : (rank + 1) * rows].clone(), (rank * rows, 0), (ROWS, COLS)),
        "tp.v": deltasync.Slice(full["tp.v"][:, rank * cols : (rank + 1) * cols].clone(), (0, rank * cols), (COLS, ROWS)),
        "norm": full["norm"].clone(),
    }
    if rank == WORLD - 1:
        part["head"] = full["head"].clone()
    return part


def _worker(rank: int, port: int, url: str, scenario: str, queue: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        pub = deltasync.DistributedPublisher(url, timeout=30)
        out: list[Any] = []
        if scenario == "happy":
            for step in range(3):
                out.append(pub.publish(_rank_state(_full_state(step), rank), metadata={"step": str(step)}))
        elif scenario == "failure":
            out.append(pub.publish(_rank_state(_full_state(0), rank)))
            state = _rank_state(_full_state(1), rank)
            if rank == 1:
                state["norm"] = "not a tensor"  # this rank fails while preparing its part
            try:
                pub.publish(state)
                out.append("no error")
            except deltasync.DeltasyncError as e:
                out.append(f"error: {e}")
            store = pub.repo.store
            real_put = store.put
            if rank == 2:  # this rank's uploads fail after encoding started

                def failing_put(key: str, data: Any, *, if_absent: bool = False) -> None:
                    if key.startswith("packs/"):
                        raise deltasync.errors.StoreError("injected upload failure")
                    real_put(key, data, if_absent=if_absent)

                store.put = failing_put  # type: ignore[method-assign]
            try:
                pub.publish(_rank_state(_full_state(1), rank))
                out.append("no error")
            except deltasync.DeltasyncError as e:
                out.append(f"error: {e}")
            store.put = real_put  # type: ignore[method-assign]
            out.append(pub.publish(_rank_state(_full_state(1), rank)))
        queue.put((rank, out, None))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _run(url: str, scenario: str) -> dict[int, list[Any]]:
    return spawn_ranks(_worker, WORLD, lambda r, port, queue: (r, port, url, scenario, queue), timeout=120)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_ranks_publish_one_version_together(s3_url: str) -> None:
    results = _run(s3_url, "happy")
    assert results[0] == results[1] == results[2] == [1, 2, 3]
    repo = deltasync.Repository(s3_url)
    kinds = [repo.manifest(v).pb.kind for v in (1, 2, 3)]
    assert kinds == [1, 2, 2]  # a snapshot, then deltas built by every rank against its own bits
    # "norm" is replicated: stored once; slices keep their offsets
    entries = repo.manifest(3).entries()
    assert sorted(entries) == sorted(
        ["norm", "head"] + [f"fsdp.w@{r * 32},0" for r in range(WORLD)] + [f"tp.v@0,{r * 32}" for r in range(WORLD)]
    )
    sub = deltasync.Subscriber(s3_url)
    for v in (1, 2, 3):
        got = sub.pull(v)
        want = _full_state(v - 1)
        assert set(got) == set(want)
        for name in want:
            assert _bits(got[name]) == _bits(want[name]), (v, name)
    # an inference rank that needs only its tensor-parallel columns
    region = deltasync.Subscriber(s3_url).pull(3, regions={"tp.v": Region((0, 16), (COLS, 40))})["tp.v"]
    assert torch.equal(region, _full_state(2)["tp.v"][:, 16:56])
    assert verify_repository(s3_url).versions == [1, 2, 3]


@pytest.mark.slow
def test_a_failing_rank_fails_the_version_everywhere(s3_url: str) -> None:
    results = _run(s3_url, "failure")
    for rank in range(WORLD):
        first, bad_input, bad_upload, retried = results[rank]
        assert first == 1
        assert bad_input.startswith("error: publish failed on rank 1: state['norm'] is not a tensor")
        assert bad_upload.startswith("error: version 2 failed on rank 2: injected upload failure")
        assert "nothing was committed" in bad_input and "nothing was committed" in bad_upload
        assert retried == 2
    repo = deltasync.Repository(s3_url)
    assert repo.versions() == [1, 2]
    assert repo.manifest(2).pb.kind == 1  # after a failure every rank's base is void: a snapshot
    referenced = {p.key for v in (1, 2) for p in repo.manifest(v).pb.packs}
    assert set(repo.store.list("packs/")) == referenced  # the failed attempts left nothing behind
    got = deltasync.Subscriber(s3_url).pull(2)
    for name, t in _full_state(1).items():
        assert _bits(got[name]) == _bits(t)
    assert os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("DELTASYNC_TEST_S3_URL")
