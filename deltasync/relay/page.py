"""The fleet page: ``deltasync serve --http HOST:PORT`` serves ``/fleet``, one self-contained
HTML page (no external assets: it works offline), and ``/fleet.json``, the view it polls.

The page shows each cluster as a table (node, engine, version, state, lag, last report,
live check, error) and plots, over the last hour, the largest lag and the count of nodes
not current (behind, silent, failing, drift), sampled every ``sample_every`` seconds by the
page server itself (an hour of samples is a few hundred small tuples).

Read-only: nothing on the page changes state. When the relay has a read token, both routes
need it (``Authorization: Bearer …``), as the relay's own calls do.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from ..errors import UsageError
from .fleet import STATES, FleetService, node_row

HISTORY_SECONDS = 3600.0


class FleetPage:
    """Serves the fleet page of ``service`` on ``listen`` (``HOST:PORT``; port 0: any free one)."""

    def __init__(self, service: FleetService, listen: str, *, token: str | None = None,
                 sample_every: float = 5.0) -> None:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"invalid --http address {listen!r} (expected HOST:PORT)")
        self.service, self.sample_every = service, sample_every
        self._auth = f"Bearer {token}".encode() if token else None
        self.history: deque[tuple[float, float, int]] = deque(maxlen=int(HISTORY_SECONDS / sample_every) + 1)
        self._html = resources.files(__package__).joinpath("fleet.html").read_bytes()
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the relay logs its own way; a page poll per second is not news

        try:
            self._server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
        except OSError as e:
            raise UsageError(f"cannot serve the fleet page on {listen}: {e.strerror or e}") from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]') else host}:{self.port}/fleet"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._server.serve_forever, name="deltasync-page", daemon=True),
                         threading.Thread(target=self._sample, name="deltasync-page-sample", daemon=True)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for t in self._threads:
            t.join(5)

    def _sample(self) -> None:
        while True:
            rows = self.view()["nodes"]
            lag = max((r["lag_seconds"] for r in rows), default=0.0)
            off = sum(1 for r in rows if r["state"] not in ("current", "pinned"))
            self.history.append((time.time(), lag, off))
            if self._stop.wait(self.sample_every):
                return

    def view(self) -> dict[str, Any]:
        latest, pinned = self.service.targets()
        rows = [node_row(r, latest, pinned) for r in self.service.table.reports()]
        counts = {s: sum(1 for r in rows if r["state"] == s) for s in STATES}
        return {"latest": latest, "pinned": pinned, "nodes": rows, "counts": counts, "now_unix": time.time(),
                "history": [list(h) for h in self.history]}

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        if self._auth is not None:
            got = (request.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(got, self._auth):
                self._send(request, 401, b"missing or wrong bearer token\n", "text/plain; charset=utf-8")
                return
        path = request.path.split("?", 1)[0]
        if path in ("/", "/fleet"):
            self._send(request, 200, self._html, "text/html; charset=utf-8")
        elif path == "/fleet.json":
            self._send(request, 200, json.dumps(self.view()).encode(), "application/json")
        else:
            self._send(request, 404, b"not found\n", "text/plain; charset=utf-8")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, code: int, body: bytes, kind: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        request.wfile.write(body)


__all__ = ["FleetPage"]
