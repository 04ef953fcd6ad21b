"""Shared fixtures: repositories on every in-process store kind, and a working directory per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import VllmReference

from deltasync.storage import open_store

# Test modules have unique names across the folders that mirror the packages, and a few share
# helpers (``from test_distributed import _run``): every folder is importable, whatever ran first.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and _folder.name.isidentifier() and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


#: The session's :class:`VllmReference` while one is open, and the last test that asks for it.
_REFERENCE: list[VllmReference] = []
_LAST_REFERENCE_USER: list[str] = []


@pytest.fixture(scope="session")
def vllm_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmReference]:
    """Reference observations of vLLM checkpoints, shared by every test of the session that
    asks (tests/vllm_server.py): one plain vLLM server per model shape, stopped after the
    last test that asks for it (not left idle through the rest of the session)."""
    reference = VllmReference(tmp_path_factory.mktemp("vllm-reference"))
    _REFERENCE.append(reference)
    try:
        yield reference
    finally:
        reference.close()
        _REFERENCE.remove(reference)


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if "vllm_reference" in getattr(item, "fixturenames", ())]
    _LAST_REFERENCE_USER[:] = users[-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _REFERENCE and _LAST_REFERENCE_USER and item.nodeid == _LAST_REFERENCE_USER[0]:
        for reference in _REFERENCE:
            reference.close()  # again at the session's end: nothing left to stop then


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
