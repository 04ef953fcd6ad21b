"""The fan-out pause on every rank's write pool (real multi-process gloo group): pieces of the
writes land from several threads, bit-exact against the same engine writing on one thread,
and a piece failing half way restores the old bits on every rank."""

from __future__ import annotations

import os
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.codec import PlanesZstdCodec
from deltasync.testing import spawn_ranks

N = 1 << 20  # bf16 elements of "big": 2 MiB, in chunks of 1 MiB (512 Ki words: cut in two per worker)
ROWS, COLS = 512, 256  # "mat": rows split across the two ranks


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(N, generator=g).bfloat16(), "mat": torch.randn(ROWS, COLS, generator=g)}
    out = [state]
    for step in range(1, 4):
        state = {k: v.clone() for k, v in state.items()}
        big = state["big"].view(torch.int16)
        if step == 2:  # every element: rewritten whole
            big += 1
            state["mat"] += 0.25
        else:  # 1 in 8 elements: sparse writes of 128 Ki positions (cut into pieces)
            pos = torch.randperm(N, generator=g)[: N // 8]
            big[pos] += 1
            state["mat"].view(-1)[torch.randperm(ROWS * COLS, generator=g)[: ROWS * COLS // 8]] += 1.0
        out.append(state)
    return out


def _publish(repo: str) -> None:
    pub = deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1 << 20)))
    for s in _states():
        pub.publish(s)


def _held(rank: int) -> dict[str, Any]:
    rows = ROWS // 2
    return {"big": torch.zeros(N, dtype=torch.bfloat16),
            "mat": deltasync.Slice(torch.zeros(rows, COLS), (rank * rows, 0), (ROWS, COLS))}


def _bits(held: dict[str, Any]) -> dict[str, bytes]:
    return {n: (v.tensor if isinstance(v, deltasync.Slice) else v).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for n, v in held.items()}


def _expected(rank: int, version: int) -> dict[str, bytes]:
    want = _states()[version - 1]
    rows = ROWS // 2
    return {"big": want["big"].view(torch.uint8).numpy().tobytes(),
            "mat": want["mat"][rank * rows : (rank + 1) * rows].contiguous().view(torch.uint8).numpy().tobytes()}


def _worker(rank: int, world: int, port: int, repo: str, queue: Any) -> None:
    import torch.distributed as dist

    from deltasync.engines import EngineError, FanoutEngine, FanoutOptions, torch_engine

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        threads: set[str] = set()
        real = torch_engine.TensorWrite.apply_part
        fail_at: list[int] = [0]  # on rank 1: the piece that raises (0: none)
        calls = [0]
        lock = threading.Lock()

        def watched(self: Any, kind: str, i: int, lo: int, hi: int) -> None:
            with lock:
                threads.add(threading.current_thread().name)
                calls[0] += 1
                fail = calls[0] == fail_at[0]
            if fail:
                raise RuntimeError("injected failure in a piece of the pause")
            real(self, kind, i, lo, hi)

        torch_engine.TensorWrite.apply_part = watched  # type: ignore[method-assign]
        out: dict[Any, Any] = {}
        for workers in (2, 1):  # pooled, then the same versions written on one thread
            held = _held(rank)
            engine = FanoutEngine(held, repo if rank == 0 else None, options=FanoutOptions(timeout=60.0, heartbeat=0.5),
                                  workers=workers)
            seen: list[dict[str, bytes]] = []
            if rank == 0:
                for v in (1, 2, 3):
                    assert engine.update(v) is not None
                    seen.append(_bits(held))
            else:
                for _ in (1, 2, 3):
                    assert engine.update() is not None
                    seen.append(_bits(held))
            out[workers] = seen
            if workers == 2:  # a piece of version 4's pause fails on rank 1, after others landed
                if rank == 1:
                    with lock:
                        fail_at[0] = calls[0] + 3
                if rank == 0:
                    try:
                        engine.update(4)
                        out["failed"] = "no error"
                    except EngineError as e:
                        out["failed"] = str(e)
                    out["after failure"] = (engine.version, _bits(held))
                    engine.close()
                else:
                    engine.follow()  # the failed swap, then rank 0 closes
                    out["after failure"] = (engine.version, _bits(held))
                    out["pieces"] = calls[0] - (fail_at[0] - 3)
                    engine.close()
                with lock:
                    fail_at[0] = 0
            elif rank == 0:
                engine.close()
            else:
                engine.follow()
                engine.close()
        out["threads"] = sorted(threads)
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.mark.slow
def test_pooled_pause_is_bit_exact_and_undone_on_failure(tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    _publish(repo)
    world = 2
    results = spawn_ranks(_worker, world, lambda r, port, queue: (r, world, port, repo, queue), timeout=180)
    for rank, out in results.items():
        for v in (1, 2, 3):
            assert out[2][v - 1] == _expected(rank, v), (rank, v)  # pooled: the version's bits
            assert out[2][v - 1] == out[1][v - 1], (rank, v)  # and what one thread writes
        assert any(name.startswith("deltasync-write") for name in out["threads"]), out["threads"]
        version, bits = out["after failure"]
        assert version == 3 and bits == _expected(rank, 3), rank  # the old bits, everywhere
    assert results[1]["pieces"] >= 3  # the failing piece came after others had been handed out
    assert "failed on rank 1: RuntimeError: injected failure in a piece of the pause" in results[0]["failed"]
    assert "every rank kept version 3" in results[0]["failed"]
