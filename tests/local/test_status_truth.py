"""An agent's status says what it holds and what it refused (issue 33: items 7, 8, 13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import make_state, step_state, write_checkpoint

from deltasync import Publisher, Repository
from deltasync.agents import Agent, AgentConfig, read_status
from deltasync.errors import CorruptObjectError, DeltasyncError, RefError, SignatureError
from deltasync.format.signing import generate_keypair
from deltasync.ops.verify import verify_repository
from deltasync.storage import open_store


def _publish(url: str, states: int, *, key: Path | None = None, start: int = 0) -> None:
    pub = Publisher(Repository(url, signing_key=key) if key is not None else url)
    state = make_state(0)
    for i in range(start + states):
        if i >= start:
            pub.publish(state)
        state = step_state(state, seed=i + 1)


def _status_text(tmp: Path, *args: str | Path) -> str:
    r = subprocess.run([sys.executable, "-m", "deltasync.cli.main", "status", *map(str, args)], capture_output=True,
                       text=True, env={**os.environ, "DELTASYNC_CACHE": str(tmp / "cache")}, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_refused_unsigned_latest_is_shown_beside_the_version_accepted(tmp_path: Path) -> None:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "publisher")
    url = str(tmp_path / "repo")
    _publish(url, 3, key=key)
    out = tmp_path / "out"
    config = AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02)
    assert Agent(url, out, config, trusted_keys=pub).run() == 3
    Publisher(url).publish(step_state(make_state(0), seed=99))  # v4, unsigned: refused
    with pytest.raises((RefError, SignatureError), match="unsigned"):
        Agent(url, out, config, trusted_keys=pub).run()
    status = read_status(out)
    assert status["version"] == 3
    assert status["refused_ref"]["version"] == 4, status
    text = _status_text(tmp_path, out)
    latest = next(line for line in text.splitlines() if line.startswith("latest"))
    assert "version 4: refused" in latest, text
    # Once a signed version is accepted again, nothing refused is shown.
    Publisher(Repository(url, signing_key=key)).publish(make_state(5))
    assert Agent(url, out, config, trusted_keys=pub).run() == 5
    assert read_status(out)["refused_ref"] is None


def test_bytes_appended_to_a_blob_fail_verify(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    write_checkpoint(tmp_path / "ckpt", make_state(0))
    Publisher(url).publish_dir(tmp_path / "ckpt", snapshots=True)
    store = open_store(url)
    blob = next(k for k in store.list("blobs/"))
    store.put(blob, store.get(blob) + b"appended")
    with pytest.raises(CorruptObjectError, match="follow the blob's zstd frame"):
        verify_repository(url)
    with pytest.raises(DeltasyncError):
        Agent(url, tmp_path / "out", AgentConfig(retries=1)).run()


def test_status_of_a_copy_whose_state_was_deleted_under_its_agent_says_so(tmp_path: Path) -> None:
    import shutil
    import threading
    import time

    from deltasync.errors import UsageError

    url = str(tmp_path / "repo")
    _publish(url, 2)
    out = tmp_path / "out"
    agent = Agent(url, out, AgentConfig(poll_interval=0.05))
    thread = threading.Thread(target=agent.run, kwargs={"follow": True})
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while agent.current() != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_status(out)["running"]
        shutil.rmtree(out / ".deltasync")
        with pytest.raises(UsageError, match=r"\.deltasync is missing.*its state was deleted under it"):
            read_status(out)
        shutil.rmtree(out)
        with pytest.raises(UsageError, match=r"does not exist.*its state was deleted under it"):
            read_status(out)
    finally:
        agent.stop()
        thread.join(30)
