"""Prometheus metrics over HTTP, in the text exposition format (no client library needed).

>>> server = MetricsServer(lambda: [Metric("deltasync_up", "gauge", "1 while running", 1)], port=0)
>>> server.port  # doctest: +SKIP
9464
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .errors import UsageError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    value: float | None  # None: not known yet (the sample is left out)
    labels: dict[str, str] = field(default_factory=dict)


def render(metrics: Iterable[Metric]) -> str:
    """The text exposition of ``metrics`` (one HELP/TYPE header per name)."""
    lines: list[str] = []
    seen: set[str] = set()
    for m in metrics:
        if m.name not in seen:
            seen.add(m.name)
            lines.append(f"# HELP {m.name} {_escape_help(m.help)}")
            lines.append(f"# TYPE {m.name} {m.kind}")
        if m.value is None:
            continue
        labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(m.labels.items()))
        lines.append(f"{m.name}{{{labels}}} {_number(m.value)}" if labels else f"{m.name} {_number(m.value)}")
    return "\n".join(lines) + "\n"


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class MetricsServer:
    """Serves ``collect()`` at ``/metrics`` on a daemon thread until :meth:`close`."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], *, port: int, host: str = "") -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(collect()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds: not worth a line each

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {host or '*'}:{port}: {e.strerror or e}") from None
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="deltasync-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
