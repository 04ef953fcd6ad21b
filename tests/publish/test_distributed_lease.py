"""A DistributedPublisher's version is one publish in flight for gc (issue 23, item 4): rank 0
writes the lease before any rank uploads, and removes it after its commit. A real 2-rank
gloo group on 127.0.0.1, publishing to a local repository."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.repo.leases import LEASES
from deltasync.testing import spawn_ranks

WORLD = 2


def _worker(rank: int, port: int, url: str, queue: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        pub = deltasync.DistributedPublisher(url, timeout=30)
        store = pub.repo.store
        real_put = store.put
        leased: list[bool] = []

        def watching_put(key: str, data: Any, *, if_absent: bool = False) -> None:
            if key.startswith("packs/"):
                leased.append(bool(list(store.list(LEASES))))  # a lease is there before any upload
            real_put(key, data, if_absent=if_absent)

        store.put = watching_put  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(rank)
        state = {f"rank{rank}.w": torch.randn(256, 64, generator=g)}
        version = pub.publish(state).version
        dist.barrier()
        queue.put((rank, [version, leased, list(store.list(LEASES))], None))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
def test_rank_0_holds_one_lease_for_every_ranks_uploads(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    results = spawn_ranks(_worker, WORLD, lambda r, port, queue: (r, port, url, queue), timeout=120)
    for rank in range(WORLD):
        version, leased, after = results[rank]
        assert version == 1 and leased and all(leased), (rank, leased)
        assert after == []  # removed after the commit
    assert deltasync.Repository(url).versions() == [1]
