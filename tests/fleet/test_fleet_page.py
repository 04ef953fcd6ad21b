"""The fleet page (`deltasync serve --http`): served by a real relay process, read over HTTP,
and loaded in a real headless chromium (playwright from the environment
scripts/install_browser.sh builds, pointed at Debian's chromium): it shows every node and
updates when a version lands. The screenshots are kept in the test's directory (and copied to
``$DELTASYNC_ARTIFACTS`` when set)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig
from deltasync.storage.fleet import FleetClient
from deltasync.v1 import fleet_pb2 as fpb

TOKEN = "page-report-token"
ROOT = Path(__file__).resolve().parents[2]
NODES = [("east", f"e{i}") for i in range(3)] + [("west", f"w{i}") for i in range(2)]


def _report(cluster: str, node: str, version: int) -> fpb.NodeReport:
    return fpb.NodeReport(node=node, cluster=cluster, engine="torch", version=version, interval=30.0,
                          target_version=version, agent_state="idle")


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A `deltasync serve --http` process: (grpc URL, page URL)."""
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096), workers=1, progress=False))
    pub.publish({"w": torch.zeros(1024)})
    tokens = tmp_path / "report-tokens"
    tokens.write_text(f"{TOKEN}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync", "serve", "--repo", str(repo), "--listen", "127.0.0.1:0",
         "--report-token-file", str(tokens), "--http", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grpc_url = page_url = ""
        deadline = time.monotonic() + 60
        while not page_url and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if m := re.search(r" on (127\.0\.0\.1:\d+) ", line):
                grpc_url = f"grpc://{m.group(1)}"
            if m := re.search(r"fleet page on (\S+)", line):
                page_url = m.group(1)
        assert grpc_url and page_url, "the relay printed no addresses"
        yield grpc_url, page_url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_page_and_its_json_are_served(relay: tuple[str, str]) -> None:
    grpc_url, page_url = relay
    with FleetClient(grpc_url, report_token=TOKEN) as client:
        client.report([_report(c, n, 1) for c, n in NODES])
    html = urllib.request.urlopen(page_url, timeout=10).read().decode()
    assert "<title>deltasync fleet</title>" in html and "fleet.json" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # no external asset
    view = json.loads(urllib.request.urlopen(page_url + ".json", timeout=10).read())
    assert view["latest"] == 1
    assert sorted((n["cluster"], n["node"], n["state"]) for n in view["nodes"]) == sorted(
        (c, n, "current") for c, n in NODES)
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(page_url.rsplit("/", 1)[0] + "/other", timeout=10)


SCRIPT = textwrap.dedent('''
    import json, sys
    from playwright.sync_api import sync_playwright

    url, chromium, shots, nodes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

    def rows(page, version):
        return page.wait_for_function(
            """([nodes, version]) => nodes.every(n => {
                   const row = document.querySelector(`tr[data-node="${n}"]`);
                   return row && row.dataset.version === version && row.dataset.state === "current"; })""",
            arg=[nodes, str(version)], timeout=30000)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(url)
        rows(page, 1)
        page.screenshot(path=shots + "/fleet-v1.png", full_page=True)
        print("shown 1", flush=True)
        sys.stdin.readline()  # the test reports version 2 for every node
        rows(page, 2)
        page.screenshot(path=shots + "/fleet-v2.png", full_page=True)
        tables = page.eval_on_selector_all("table[data-cluster]", "ts => ts.map(t => t.dataset.cluster)")
        print("shown 2 " + json.dumps(sorted(tables)), flush=True)
        browser.close()
''')


def _browser() -> tuple[str, str] | None:
    venv_python = Path(os.environ.get("DELTASYNC_BROWSER_VENV", ROOT / ".venv-browser")) / "bin" / "python"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not venv_python.exists() or chromium is None:
        return None
    return str(venv_python), chromium


@pytest.mark.skipif(_browser() is None, reason="no headless browser: bash scripts/install_browser.sh "
                    "(Debian's chromium and playwright in .venv-browser)")
def test_page_in_a_headless_browser_shows_every_node_and_updates(relay: tuple[str, str], tmp_path: Path) -> None:
    found = _browser()
    assert found is not None
    python, chromium = found
    grpc_url, page_url = relay
    with FleetClient(grpc_url, report_token=TOKEN) as client:
        client.report([_report(c, n, 1) for c, n in NODES])
        script = tmp_path / "drive.py"
        script.write_text(SCRIPT)
        shots = tmp_path / "screenshots"
        shots.mkdir()
        proc = subprocess.Popen([python, str(script), page_url, chromium, str(shots), json.dumps([n for _, n in NODES])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            first = proc.stdout.readline()
            assert first.strip() == "shown 1", proc.stderr.read() if proc.stderr else ""
            Publisher(str(Path(tmp_path) / "repo"),
                      PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096), workers=1, progress=False)).publish(
                {"w": torch.ones(1024)})
            client.report([_report(c, n, 2) for c, n in NODES])
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == 'shown 2 ["east", "west"]', out + err
    for name in ("fleet-v1.png", "fleet-v2.png"):
        assert (shots / name).stat().st_size > 1000
    if os.environ.get("DELTASYNC_ARTIFACTS"):
        dest = Path(os.environ["DELTASYNC_ARTIFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        for png in shots.glob("*.png"):
            shutil.copy(png, dest / png.name)
