"""Partial pulls (names, regions) and tensors stored as slices."""

from __future__ import annotations

import pytest
import torch

import deltasync
from deltasync import PlanesZstdCodec, PublisherConfig
from deltasync.errors import UsageError
from deltasync.format.slices import Region, runs


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(512, 64, generator=g).bfloat16(),
        "w": torch.randn(256, 96, generator=g),
        "b": torch.randn(96, generator=g).half(),
        "scalar": torch.tensor(1.5),
    }


def test_pull_only_named_tensors_fetches_only_their_chunks(repo_url: str) -> None:
    cfg = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096))
    pub = deltasync.Publisher(repo_url, cfg)
    state = _state()
    v = pub.publish(state)
    sub = deltasync.Subscriber(repo_url)
    got = sub.pull(v, tensors=["b", "scalar"])
    assert set(got) == {"b", "scalar"}
    assert _bits(got["b"]) == _bits(state["b"]) and _bits(got["scalar"]) == _bits(state["scalar"])
    partial = got.plan
    full = deltasync.Subscriber(repo_url).pull(v).plan
    assert partial.fetch_bytes < full.fetch_bytes / 20


def test_pull_region_of_a_tensor(repo_url: str) -> None:
    cfg = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1024))
    pub = deltasync.Publisher(repo_url, cfg)
    state = _state()
    v = pub.publish(state)
    sub = deltasync.Subscriber(repo_url)
    pulled = sub.pull(v, regions={"w": Region((64, 0), (64, 96))})
    rows = pulled["w"]
    assert torch.equal(rows, state["w"][64:128])
    rows_plan = pulled.plan
    cols = deltasync.Subscriber(repo_url).pull(v, regions={"w": Region((10, 48), (20, 48))})["w"]
    assert torch.equal(cols, state["w"][10:30, 48:96])
    assert rows_plan is not None and rows_plan.fetch_bytes < 0.4 * 256 * 96 * 4
    # the next version, region only, incrementally
    state["w"] = state["w"].clone()
    state["w"][70, 5] += 1.0
    v2 = pub.publish(state)
    pulled = sub.pull(v2, regions={"w": Region((64, 0), (64, 96))})
    assert torch.equal(pulled["w"], state["w"][64:128])
    assert pulled.plan.base == v


def test_bad_requests(repo_url: str) -> None:
    pub = deltasync.Publisher(repo_url)
    v = pub.publish(_state())
    sub = deltasync.Subscriber(repo_url)
    with pytest.raises(UsageError, match="no tensor 'nope'"):
        sub.pull(v, tensors=["nope"])
    with pytest.raises(UsageError, match="outside"):
        sub.pull(v, regions={"w": Region((250, 0), (10, 96))})
    with pytest.raises(UsageError, match="both whole and as a region"):
        sub.pull(v, tensors=["w"], regions={"w": Region((0, 0), (1, 1))})


def test_runs_cover_a_slice_exactly() -> None:
    full, off, shape, isz = (5, 7, 6), (1, 2, 3), (3, 4, 2), 4
    logical = torch.arange(5 * 7 * 6, dtype=torch.int32).reshape(full)
    local = logical[1:4, 2:6, 3:5].contiguous()
    src = local.view(torch.uint8).numpy().reshape(-1)
    out = bytearray(logical.numel() * isz)
    n = src.nbytes
    for start, end in [(0, 40), (40, 64), (64, n)]:
        for dst, rel, length in runs(full, off, shape, isz, start, end):
            out[dst : dst + length] = src[start + rel : start + rel + length].tobytes()
    rebuilt = torch.frombuffer(out, dtype=torch.int32).reshape(full)
    assert torch.equal(rebuilt[1:4, 2:6, 3:5], local)


def test_one_process_may_publish_slices_too(repo_url: str) -> None:
    full = torch.randn(8, 6)
    state = {
        "w": deltasync.Slice(full[:, :4].clone(), (0, 0), (8, 6)),
        "w2": deltasync.Slice(full[2:5].clone(), (2, 0), (8, 6)),
    }
    v = deltasync.Publisher(repo_url).publish(state)
    got = deltasync.Subscriber(repo_url).pull(v)
    assert torch.equal(got["w"][:, :4], full[:, :4]) and not got["w"][:, 4:].any()  # unpublished parts read as zeros
    assert torch.equal(got["w2"][2:5], full[2:5])
