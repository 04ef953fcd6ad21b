"""Fleet reports: the relay's bounded table, states, report tokens, forwarding up a relay
tree, and real agent processes reporting through `deltasync subscribe` to `deltasync fleet`
and `deltasync pin --wait`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository
from deltasync.errors import UsageError
from deltasync.relay import build_server
from deltasync.relay.fleet import FleetTable, classify, parse_report_tokens
from deltasync.storage.fleet import FleetClient
from deltasync.v1 import fleet_pb2 as fpb

TOKEN = "report-secret-1"
CLUSTER_TOKEN = "report-secret-east"


def report(node: str, version: int, **kw: object) -> fpb.NodeReport:
    fields: dict[str, object] = {"node": node, "version": version, "interval": 1.0, "engine": "torch"}
    fields.update(kw)
    return fpb.NodeReport(**fields)  # type: ignore[arg-type]


# -- the table and the states ---------------------------------------------------------------------


def test_states_from_reports() -> None:
    assert classify(report("a", 3), age=0.1, latest=3, pinned=None) == "current"
    assert classify(report("a", 2), age=0.1, latest=3, pinned=None) == "behind"
    assert classify(report("a", 0), age=0.1, latest=3, pinned=None) == "behind"  # serves nothing: never current
    assert classify(report("a", 2), age=0.1, latest=3, pinned=2) == "pinned"
    assert classify(report("a", 3), age=0.1, latest=3, pinned=2) == "behind"
    assert classify(report("a", 3), age=3.5, latest=3, pinned=None) == "silent"  # three 1 s intervals
    assert classify(report("a", 3, agent_state="stopped"), age=0.1, latest=3, pinned=None) == "silent"
    assert classify(report("a", 3, check="drift"), age=0.1, latest=3, pinned=None) == "drift"
    assert classify(report("a", 3, last_error="boom"), age=0.1, latest=3, pinned=None) == "failing"


def test_table_keeps_the_newest_report_per_node_bounded_and_drops_old_ones() -> None:
    table = FleetTable(ttl=100.0, max_nodes=3)
    now = 1000.0
    assert table.put(report("a", 1), now=now)
    assert table.put(report("a", 2), now=now + 1)
    # A forwarded copy of an older report (heard 5 s before) does not replace the newer one.
    assert table.put(report("a", 1, age=5.0), now=now + 2)
    assert [r.version for r in table.reports(now=now + 2)] == [2]
    assert table.put(report("b", 1), now=now) and table.put(report("c", 1), now=now)
    assert not table.put(report("d", 1), now=now + 3)  # full of live nodes
    assert table.refused == 1
    assert table.put(report("a", 3), now=now + 3)  # a known node is always updated
    later = now + 150  # b and c were last heard 150 s ago: dropped, d fits
    assert table.put(report("d", 1), now=later)
    assert sorted(r.node for r in table.reports(now=later)) == ["d"]
    ages = {r.node: r.age for r in table.reports(now=later + 2)}
    assert ages == {"d": 2.0}


def test_report_tokens_file_format() -> None:
    assert parse_report_tokens("# agents\nabc\neast def\n") == [("abc", None), ("def", "east")]
    with pytest.raises(UsageError, match="line 1"):
        parse_report_tokens("a b c\n")
    with pytest.raises(UsageError, match="no token"):
        parse_report_tokens("# nothing\n")


# -- over gRPC ------------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    pub = Publisher(str(path), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096), workers=1, progress=False))
    pub.publish({"w": torch.arange(4096, dtype=torch.float32)})
    return path


def test_reports_need_a_report_token_scoped_to_their_cluster(repo: Path) -> None:
    tokens = [(TOKEN, None), (CLUSTER_TOKEN, "east")]
    with build_server(str(repo), "127.0.0.1:0", report_tokens=tokens, cluster="here") as relay:
        with FleetClient(relay.url) as none, pytest.raises(UsageError, match="unauthenticated"):
            none.report([report("a", 1)])
        with FleetClient(relay.url, report_token="wrong") as wrong, pytest.raises(UsageError, match="unauthenticated"):
            wrong.report([report("a", 1)])
        with FleetClient(relay.url, report_token=CLUSTER_TOKEN) as east:
            assert east.report([report("e1", 1, cluster="east")]) == 1
            with pytest.raises(UsageError, match=r"permission_denied.*'east' only"):
                east.report([report("w1", 1, cluster="west")])
        with FleetClient(relay.url, report_token=TOKEN) as agent:
            assert agent.report([report("a", 1)]) == 1  # no cluster: the relay's
            with pytest.raises(UsageError, match="invalid_argument"):
                agent.report([report("", 1)])
            view = agent.view()
        assert view.latest == 1 and view.pinned is None
        assert {(r.node, r.cluster, r.via) for r in view.nodes} == {
            ("a", "here", relay.address), ("e1", "east", relay.address)}
    with (build_server(str(repo), "127.0.0.1:0") as closed, FleetClient(closed.url, report_token=TOKEN) as c,
          pytest.raises(UsageError, match="takes no fleet reports")):
        c.report([report("a", 1)])


def test_relays_forward_their_table_to_the_root(repo: Path) -> None:
    tokens = [(TOKEN, None)]
    with (build_server(str(repo), "127.0.0.1:0", report_tokens=tokens, cluster="root") as root,
          build_server(root.url, "127.0.0.1:0", report_tokens=tokens, cluster="east", report_interval=0.2) as east):
        with FleetClient(east.url, report_token=TOKEN) as agent:
            agent.report([report("e1", 1), report("e2", 1)])
        with FleetClient(root.url) as viewer:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                nodes = {(r.node, r.cluster) for r in viewer.view().nodes}
                if nodes == {("e1", "east"), ("e2", "east")}:
                    break
                time.sleep(0.05)
            assert nodes == {("e1", "east"), ("e2", "east")}


# -- real agents ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "DELTASYNC_REPORT_TOKEN": TOKEN}


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


@pytest.fixture
def agents(tmp_path: Path, repo: Path) -> Iterator[tuple[object, list[subprocess.Popen[str]]]]:
    procs: list[subprocess.Popen[str]] = []
    with build_server(str(repo), "127.0.0.1:0", report_tokens=[(TOKEN, None)], cluster="c0") as relay:
        for i in range(3):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deltasync", "subscribe", "--repo", relay.url, "--out",
                 str(tmp_path / f"copy{i}"), "--follow", "--poll-interval", "0.1", "--node", f"n{i}",
                 "--report-interval", "0.3", "--quiet"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()))
        try:
            yield relay, procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.communicate(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()


def _fleet_json(url: str) -> tuple[int, dict[str, object]]:
    done = _cli("fleet", "--repo", url, "--json")
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def _wait_states(url: str, want: dict[str, tuple[int, str]], timeout: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        _rc, view = _fleet_json(url)
        got = {n["node"]: (n["version"], n["state"]) for n in view["nodes"]}  # type: ignore[attr-defined]
        if got == want or time.monotonic() > deadline:
            assert got == want, view
            return view
        time.sleep(0.2)


def test_agents_report_and_pin_wait_names_the_node_held_back(
    tmp_path: Path, repo: Path, agents: tuple[object, list[subprocess.Popen[str]]]
) -> None:
    relay, procs = agents
    url = relay.url  # type: ignore[attr-defined]
    view = _wait_states(url, {f"n{i}": (1, "current") for i in range(3)})
    assert all(n["cluster"] == "c0" and n["engine"] == "copy" for n in view["nodes"])  # type: ignore[attr-defined]
    digest = Repository(str(repo)).manifest(1).pb.version_digest.hex()
    assert {n["version_digest"] for n in view["nodes"]} == {digest}  # type: ignore[attr-defined]

    pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096), workers=1, progress=False))
    pub.publish({"w": torch.arange(4096, dtype=torch.float32) + 1})
    # publish --wait's confirmation, through the same relay: every node serves version 2.
    waited = _cli("pin", "--repo", str(repo), "2", "--wait", "--fleet", url, "--timeout", "30")
    assert waited.returncode == 0, waited.stderr
    assert "3/3 reporting engines serve version 2" in waited.stdout
    # The relay reads the repository's refs at most once a second: the pin shows within that.
    _wait_states(url, {f"n{i}": (2, "pinned") for i in range(3)})
    rc, view = _fleet_json(url)
    assert rc == 0 and {n["state"] for n in view["nodes"]} == {"pinned"}, view  # type: ignore[attr-defined]

    # One node held back: its agent stopped. A pin back to 1 cannot be confirmed by all.
    procs[2].send_signal(signal.SIGTERM)
    procs[2].communicate(timeout=20)
    start = time.monotonic()
    held = _cli("pin", "--repo", str(repo), "1", "--wait", "--fleet", url, "--timeout", "4")
    assert held.returncode == 1
    assert time.monotonic() - start < 60  # --timeout 4 plus a CLI start on loaded cores
    assert "only 2/3 reporting engines serve version 1" in held.stderr, held.stderr
    assert "c0/n2: silent, version 2" in held.stderr, held.stderr
    # A quorum the two running nodes meet is confirmed.
    quorum = _cli("pin", "--repo", str(repo), "1", "--wait", "--fleet", url, "--quorum", "0.6", "--timeout", "30")
    assert quorum.returncode == 0, quorum.stderr
    # --clear waits for the latest.
    cleared = _cli("pin", "--repo", str(repo), "--clear", "--wait", "--fleet", url, "--quorum", "0.6",
                   "--timeout", "30")
    assert cleared.returncode == 0, cleared.stderr
    view = _wait_states(url, {"n0": (2, "current"), "n1": (2, "current"), "n2": (2, "silent")})
    text = _cli("fleet", "--repo", url)
    assert text.returncode == 0 and "cluster c0" in text.stdout and "n2" in text.stdout


def test_relay_metrics_count_nodes_by_state_and_lag_per_cluster(repo: Path) -> None:
    from deltasync.metrics import render

    with build_server(str(repo), "127.0.0.1:0", report_tokens=[(TOKEN, None)]) as relay:
        with FleetClient(relay.url, report_token=TOKEN) as agent:
            agent.report([report("a", 1, cluster="east"), report("b", 0, cluster="east", lag_seconds=4.5),
                          report("c", 1, cluster="west", check="drift")])
        text = render(relay.fleet.metrics())
    assert 'deltasync_fleet_nodes{state="current"} 1.0' in text
    assert 'deltasync_fleet_nodes{state="behind"} 1.0' in text
    assert 'deltasync_fleet_nodes{state="drift"} 1.0' in text
    assert 'deltasync_fleet_lag_seconds{cluster="east"} 4.5' in text
    assert 'deltasync_fleet_cluster_nodes{cluster="west",state="drift"} 1.0' in text


def test_a_relay_with_a_read_token_refuses_views_and_reports_without_it(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DELTASYNC_RELAY_TOKEN", raising=False)
    monkeypatch.delenv("DELTASYNC_RELAY_TOKEN_FILE", raising=False)
    with build_server(str(repo), "127.0.0.1:0", token="read-secret", report_tokens=[(TOKEN, None)]) as relay:
        with FleetClient(relay.url, report_token=TOKEN) as outsider:
            with pytest.raises(UsageError, match="unauthenticated"):
                outsider.view()
            with pytest.raises(UsageError, match="unauthenticated"):
                outsider.report([report("a", 1)])
        with FleetClient(relay.url, report_token=TOKEN, token="read-secret") as agent:
            assert agent.report([report("a", 1)]) == 1
            assert [r.node for r in agent.view().nodes] == ["a"]


def test_a_report_names_what_the_engine_holds_not_the_target() -> None:
    from deltasync.agents.report import ReportConfig, report_of

    config = ReportConfig(to="grpc://127.0.0.1:1", node="n", interval=1.0)
    status = {"engine_kind": "torch", "engine_version": 4, "engine_version_digest": "ab" * 16, "target_version": 5,
              "state": "backoff", "last_error": "engine refused version 5", "last_error_unix": 10.0,
              "engine_last_error": "engine refused version 5", "engine_last_error_unix": 10.0,
              "engine_updated_unix": 5.0, "lag_seconds": 3.0, "bytes_fetched_total": 7}
    r = report_of(status, config, served=4)
    assert (r.version, r.version_digest.hex(), r.target_version) == (4, "ab" * 16, 5)
    assert classify(r, age=0.0, latest=5, pinned=None) == "failing"
    # An engine that holds nothing known yet (a restarted agent before its first check) serves
    # nothing, whatever its state last recorded; the recorded digest is not sent with it.
    idle = {**status, "state": "idle", "engine_updated_unix": 20.0}
    r = report_of(idle, config, served=None)
    assert r.version == 0 and r.version_digest == b"" and not r.last_error
    assert classify(r, age=0.0, latest=4, pinned=None) == "behind"
    # Recovered: an engine error older than its last update is no current error.
    r = report_of(idle, config, served=4)
    assert classify(r, age=0.0, latest=4, pinned=None) == "current"
