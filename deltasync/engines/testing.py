"""The engine conformance suite. Every Engine implementation runs it:

    class TestMyEngine(EngineConformance):
        @pytest.fixture
        def make_engine(self) -> Iterator[MakeEngine]:
            def make(repo: str, initial: dict[str, torch.Tensor]) -> tuple[Engine, Served]:
                ...  # an engine serving ``initial`` (version unknown), and a way to read what it serves
            yield make

The suite publishes a few versions of a small model (several dtypes, sparse and dense
changes) to a fresh repository and checks the interface contract: bit-exact swaps, the
version reported, no-ops, stage-then-swap, stale updates, rollback and pinning, swap
records, failures that leave the engine as it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import pytest

from ..errors import DeltasyncError, UsageError
from .base import Engine, StaleUpdateError

if TYPE_CHECKING:
    import torch

Served = Callable[[], Mapping[str, "torch.Tensor"]]
MakeEngine = Callable[[str, dict[str, "torch.Tensor"]], tuple[Engine, Served]]


def suite_states(steps: int = 4) -> list[dict[str, torch.Tensor]]:
    """Versions 1..steps of a small model: a few elements change each step (sparse chunks),
    and one tensor is rewritten whole at step 3 (dense chunks)."""
    import torch

    g = torch.Generator().manual_seed(7)
    state = {
        "w.bf16": torch.randn(64, 40, generator=g).bfloat16(),
        "w.f32": torch.randn(33, 17, generator=g),
        "n.f16": torch.randn(40, generator=g).half(),
        "steps.i64": torch.arange(12, dtype=torch.int64),
    }
    out = []
    for step in range(steps):
        state = {k: v.clone() for k, v in state.items()}
        if step:
            for t in state.values():
                flat = t.view(-1)
                flat[(step * 11) % flat.numel()] += 1
            if step == 2:
                state["w.f32"] += 0.25
        out.append(state)
    return out


def bits(t: torch.Tensor) -> bytes:
    import torch

    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_serves(served: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    for name, t in want.items():
        assert name in served, name
        assert bits(served[name]) == bits(t), f"{name} differs"


class EngineConformance:
    """Behaviour every Engine must have. Subclasses provide a ``make_engine`` fixture."""

    @pytest.fixture
    def published(self) -> Iterator[tuple[str, list[dict[str, torch.Tensor]]]]:
        from .. import Publisher, PublisherConfig
        from ..format.codec import PlanesZstdCodec
        from ..storage import open_store

        url = f"memory://engine-suite-{uuid.uuid4().hex}"
        states = suite_states()
        pub = Publisher(url, PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1024)))  # several chunks per tensor
        for s in states:
            pub.publish(s)
        yield url, states
        store = open_store(url)
        for key in list(store.list()):
            store.delete(key)

    @pytest.fixture
    def engine(
        self, make_engine: MakeEngine, published: tuple[str, list[dict[str, torch.Tensor]]]
    ) -> Iterator[tuple[Engine, Served, list[dict[str, torch.Tensor]]]]:
        import torch

        url, states = published
        eng, served = make_engine(url, {k: torch.zeros_like(v) for k, v in states[0].items()})
        yield eng, served, states
        eng.close()

    def test_update_to_latest_is_bit_exact(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        record = eng.update()
        assert record is not None and record.version == len(states)
        assert eng.version == eng.served_version() == len(states)
        assert_serves(served(), states[-1])

    def test_every_version_in_turn(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        for v in range(1, len(states) + 1):
            record = eng.update(v)
            assert record is not None and record.version == v
            assert record.previous == (v - 1 if v > 1 else None)
            assert_serves(served(), states[v - 1])
        assert [r.version for r in eng.swaps] == list(range(1, len(states) + 1))

    def test_same_version_is_a_no_op_unless_forced(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        assert eng.update(2) is not None
        assert eng.update(2) is None
        assert len(eng.swaps) == 1
        forced = eng.update(2, force=True)
        assert forced is not None and forced.version == 2
        assert_serves(served(), states[1])

    def test_stage_then_swap(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        eng.update(1)
        staged = eng.stage(3)
        assert staged.version == 3 and staged.base == 1
        assert_serves(served(), states[0])  # staging changes nothing that is served
        record = eng.swap(staged)
        assert record.version == 3 and record.stage_s == staged.stage_s
        assert_serves(served(), states[2])

    def test_a_stale_staged_update_is_refused(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        eng.update(1)
        staged = eng.stage(2)
        eng.update(3)
        with pytest.raises(StaleUpdateError, match="stage it again"):
            eng.swap(staged)
        assert eng.version == 3
        assert_serves(served(), states[2])

    def test_rollback_and_pin_reach_the_engine(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, served, states = engine
        eng.update()
        rollback = eng.update(1)
        assert rollback is not None and rollback.version == 1 and rollback.previous == len(states)
        assert_serves(served(), states[0])
        eng.update(3)
        assert eng.served_version() == 3
        assert_serves(served(), states[2])

    def test_swaps_record_their_pause(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, _, _ = engine
        eng.update(1)
        eng.update(2)
        assert len(eng.swaps) == 2
        for r in eng.swaps:
            assert r.pause_s >= 0 and r.drain_s >= 0 and r.stage_s > 0
            assert r.blocked_s == r.drain_s + r.pause_s
            assert r.bytes_written > 0

    def test_a_missing_version_leaves_the_engine_as_it_was(
        self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]
    ) -> None:
        eng, served, states = engine
        eng.update(2)
        with pytest.raises(DeltasyncError, match="not found"):
            eng.update(99)
        with pytest.raises(UsageError):
            eng.update(0)
        assert eng.version == 2 and len(eng.swaps) == 1
        assert_serves(served(), states[1])

    def test_a_staged_update_belongs_to_its_engine(
        self, make_engine: MakeEngine, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]],
        published: tuple[str, list[dict[str, torch.Tensor]]],
    ) -> None:
        import torch

        eng, _, states = engine
        other, _ = make_engine(published[0], {k: torch.zeros_like(v) for k, v in states[0].items()})
        try:
            with pytest.raises(UsageError, match="another engine"):
                eng.swap(other.stage(1))
        finally:
            other.close()

    def test_a_closed_engine_refuses_work(self, engine: tuple[Engine, Served, list[dict[str, torch.Tensor]]]) -> None:
        eng, _, _ = engine
        eng.close()
        eng.close()  # idempotent
        with pytest.raises(UsageError, match="closed"):
            eng.update()
