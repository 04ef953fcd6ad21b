"""Shared fixtures: repositories on every in-process store kind."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.storage import open_store


def _clear_memory_store(url: str) -> None:
    # memory:// stores live for the whole process; empty them so tests don't pile up bytes.
    store = open_store(url)
    for key in list(store.list()):
        store.delete(key)


@pytest.fixture
def memory_repo_url() -> Iterator[str]:
    """A fresh, empty ``memory://`` repository URL, emptied afterwards."""
    url = f"memory://test-{uuid.uuid4().hex}"
    yield url
    _clear_memory_store(url)


@pytest.fixture
def local_repo_url(tmp_path: Path) -> str:
    """A path (not yet created) for a repository on the local filesystem."""
    return str(tmp_path / "repo")


@pytest.fixture(params=["local", "memory"])
def repo_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh repository URL on each in-process store: a local directory, then memory://."""
    if request.param == "local":
        yield str(tmp_path / "repo")
    else:
        url = f"memory://test-{uuid.uuid4().hex}"
        yield url
        _clear_memory_store(url)
