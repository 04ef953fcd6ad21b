"""Shared fixtures: repositories on every in-process store kind, and a working directory per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.storage import open_store

# Test modules have unique names across the folders that mirror the packages, and a few share
# helpers (``from test_distributed import _run``): every folder is importable, whatever ran first.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and _folder.name.isidentifier() and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


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


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test, and every process it starts, runs in a directory of its own: never in the
    checkout, whose source tree would shadow the installed package (a plain ``pip install .``).
    (Not through ``monkeypatch``: a test's own patches must be undone before other fixtures'
    teardown, as they are when the test asks for ``monkeypatch`` first.)"""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)
