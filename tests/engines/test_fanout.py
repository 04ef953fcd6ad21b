"""Fan-out to the ranks of a real multi-process gloo group: tensor-parallel slices, all-or-nothing
swaps, rollback, and dead ranks that surface as errors (never hangs)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.codec import PlanesZstdCodec
from deltasync.testing import spawn_ranks

ROWS, COLS = 64, 48


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    state = {
        "col": torch.randn(ROWS, COLS, generator=g).bfloat16(),  # column-parallel: rows split across ranks
        "row": torch.randn(COLS, ROWS, generator=g),  # row-parallel: columns split
        "cplx": torch.randn(8, 6, generator=g, dtype=torch.complex128),  # 16-byte items, rows split
        "norm": torch.randn(COLS, generator=g).half(),  # replicated on every rank
        "head": torch.arange(12, dtype=torch.int64),  # whole, on the last rank only
    }
    out = []
    for step in range(4):
        state = {k: v.clone() for k, v in state.items()}
        if step:
            for t in state.values():
                flat = t.view(-1)
                flat[(step * 7) % flat.numel()] += 1
                flat[(step * 131) % flat.numel()] += 1
            if step == 2:
                state["row"] += 0.5  # every element: dense chunks
        out.append(state)
    return out


def _publish(repo: str) -> None:
    pub = deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1024)))
    for s in _states():
        pub.publish(s)


def _parts(rank: int, world: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """Region each tensor's slice covers on ``rank`` (None: the whole tensor); absent: not held."""
    r = ROWS // world
    c = ROWS // world
    k = 8 // world if world <= 8 else 1
    parts: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None] = {
        "col": ((rank * r, 0), (r, COLS)),
        "row": ((0, rank * c), (COLS, c)),
        "cplx": ((rank * k, 0), (k, 6)),
        "norm": None,
    }
    if rank == world - 1:
        parts["head"] = None
    return parts


def _held(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    shapes = {n: t for n, t in _states()[0].items()}
    held: dict[str, Any] = {}
    for name, part in _parts(rank, world).items():
        full = shapes[name]
        if part is None:
            held[name] = torch.zeros_like(full, device=device)
        else:
            tensor = torch.zeros(part[1], dtype=full.dtype, device=device)
            held[name] = deltasync.Slice(tensor, part[0], tuple(full.shape))
    return held


def _check(held: dict[str, Any], rank: int, world: int, version: int) -> None:
    want = _states()[version - 1]
    for name, part in _parts(rank, world).items():
        value = held[name]
        t = value.tensor if isinstance(value, deltasync.Slice) else value
        expect = want[name]
        if part is not None:
            (o0, o1), (n0, n1) = part
            expect = expect[o0 : o0 + n0, o1 : o1 + n1]
        got = t.cpu().contiguous().view(-1).view(torch.uint8)
        if not torch.equal(got, expect.contiguous().view(-1).view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {name} differs from version {version}")


def _expect_error(fn: Any, engine: Any) -> Any:
    from deltasync.engines import EngineError

    start = time.monotonic()
    try:
        fn()
    except EngineError as e:
        return (type(e).__name__, str(e), time.monotonic() - start, engine.version)
    return "no error"


def _worker(rank: int, world: int, port: int, repo: str, scenario: str, queue: Any, backend: str = "auto") -> None:
    import torch.distributed as dist

    from deltasync.engines import EngineError, FanoutEngine, fanout as fanout_mod

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        happy = scenario in ("happy", "gpu")
        # happy: rank 0 serves slices too, and keeps its copy of the served version in files;
        # otherwise rank 0 is a pure agent that holds nothing
        device = "cpu"
        if scenario == "gpu":  # one GPU per rank where there are enough, else ranks share one
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = "cuda"
        held = _held(rank, world, device) if happy or rank else {}
        host_cache = str(Path(repo).parent / "host-copy") if happy and rank == 0 else None
        engine = FanoutEngine(held, repo if rank == 0 else None, timeout=60.0 if happy else 4.0, heartbeat=0.5,
                              host_cache=host_cache, backend=backend)
        out: dict[str, Any] = {"events": [], "backend": engine.backend}
        events: list[Any] = out["events"]
        if scenario == "gpu":
            if rank == 0:
                for v in (1, 2, 3, 4, 1, 3):
                    rec = engine.update(v)
                    assert rec is not None
                    events.append((v, rec.extra["bytes_broadcast"], rec.pause_s))
                    _check(held, rank, world, v)
                engine.close()
            else:
                while (rec := engine.update()) is not None:
                    _check(held, rank, world, rec.version)
                    events.append(rec.version)
        elif scenario == "happy":
            if rank == 2:  # this rank's 4th write fails: every rank must keep the old version
                real, calls = fanout_mod.apply_writes, [0]

                def flaky(plan: Any, pool: Any = None, workers: int = 1) -> int:
                    calls[0] += 1
                    if calls[0] == 4:
                        raise RuntimeError("injected write failure")
                    return real(plan, pool, workers)

                fanout_mod.apply_writes = flaky
            if rank == 0:
                for v in (1, 2, 3, 4, 4, 1, 3):
                    try:
                        rec = engine.update(v)
                        assert rec is not None
                        events.append((v, rec.extra["bytes_broadcast"], rec.extra["full_bytes"]))
                    except EngineError as e:
                        events.append(("error", str(e), engine.version))
                    _check(held, rank, world, engine.version or 0)
                engine.close()
            else:
                while (rec := engine.update()) is not None:
                    _check(held, rank, world, rec.version)
                    events.append(rec.version)
        elif scenario in ("follower dies", "follower hangs"):
            if rank == 0:
                engine.update(1)
                time.sleep(1.0)
                events.append(_expect_error(lambda: engine.update(2), engine))
            else:
                assert engine.update() is not None
                _check(held, rank, world, 1)
                if rank == world - 1 and scenario == "follower dies":
                    os._exit(3)  # dies without a word
                if rank == world - 1:
                    time.sleep(8)  # alive and connected, but not answering (past the 4 s timeout)
                    os._exit(0)
                events.append(_expect_error(engine.follow, engine))
                _check(held, rank, world, 1)  # survivors keep serving the old version
        elif scenario == "agent dies":
            if rank == 0:
                engine.update(1)
                os._exit(3)
            assert engine.update() is not None
            events.append(_expect_error(engine.follow, engine))
        out["swaps"] = [(r.version, r.pause_s) for r in engine.swaps]
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    queue.close()
    queue.join_thread()
    os._exit(0)  # peers may be dead: skip process-group teardown


def _run(repo: str, scenario: str, world: int, expect: int, backend: str = "auto") -> dict[int, dict[str, Any]]:
    return spawn_ranks(_worker, world, lambda r, port, queue: (r, world, port, repo, scenario, queue, backend),
                       expect=expect, timeout=180)


@pytest.mark.slow
def test_four_ranks_switch_together_bit_exact(tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    _publish(repo)
    world = 4
    results = _run(repo, "happy", world, world)
    assert sorted(p.name for p in (tmp_path / "host-copy").iterdir()) == sorted(f"{n}.bits" for n in _states()[0])
    events = results[0]["events"]
    assert [e[0] for e in events] == [1, 2, 3, "error", 4, 1, 3]
    _, message, kept = events[3]
    assert "writing version 4 failed on rank 2: RuntimeError: injected write failure" in message
    assert "every rank kept version 3" in message and kept == 3
    first, deltas = events[0], [e for e in events[1:] if e[0] != "error"]
    assert first[1] >= first[2]  # nothing to diff against: the first sync sends every element
    for v, sent, full in deltas:
        # afterwards only the changes travel: a few elements for versions 2 and 4; versions 3
        # and 1 (from 4) rewrite "row" whole, still less than everything
        assert sent < (full / 10 if v in (2, 4) else full), (v, sent, full)
    versions = [v for v, _ in results[0]["swaps"]]
    assert versions == [1, 2, 3, 4, 1, 3]
    for rank in range(1, world):
        assert results[rank]["events"] == versions  # every rank swapped exactly when rank 0 did
        assert [v for v, _ in results[rank]["swaps"]] == versions


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tensors on GPUs, nccl)")
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gpu_ranks_switch_together_bit_exact(tmp_path: Path, backend: str) -> None:
    # nccl needs a GPU per rank; over gloo, ranks may share one GPU
    world = max(1, min(4, torch.cuda.device_count())) if backend == "nccl" else 4
    repo = str(tmp_path / "repo")
    _publish(repo)
    results = _run(repo, "gpu", world, world, backend)
    assert all(out["backend"] == backend for out in results.values())
    events = results[0]["events"]
    assert [v for v, _, _ in events] == [1, 2, 3, 4, 1, 3]
    full = sum(t.numel() * t.element_size() for t in _states()[0].values())
    assert all(sent < full / 10 for v, sent, _ in events if v in (2, 4))  # only the changes travel
    for rank in range(1, world):
        assert results[rank]["events"] == [1, 2, 3, 4, 1, 3]


@pytest.mark.slow
@pytest.mark.parametrize("who", ["follower dies", "agent dies", "follower hangs"])
def test_a_dead_rank_is_an_error_not_a_hang(tmp_path: Path, who: str) -> None:
    repo = str(tmp_path / "repo")
    _publish(repo)
    world = 3
    results = _run(repo, who, world, world - 1)
    for rank, out in results.items():
        (event,) = out["events"]
        assert event != "no error", rank
        kind, message, waited, version = event
        assert kind == "GroupError"
        assert "fan-out group failed" in message and "a rank died or did not answer within 4s" in message
        assert waited < 30  # the group's timeout (4 s) bounds it, plus process start-up noise
        if who == "follower hangs":
            assert waited > 2  # nothing was closed: only the timeout could tell
        assert version == 1  # survivors keep serving what they had
