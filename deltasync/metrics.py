"""Prometheus metrics over HTTP, through ``prometheus_client``.

The agent describes what it knows as :class:`Metric` values, computed fresh at every scrape
(``collect``); this module turns them into metric families of a registry of their own and
serves them with ``prometheus_client``'s HTTP server.

>>> server = MetricsServer(lambda: [Metric("deltasync_up", "gauge", "1 while running", 1)], port=0)
>>> server.port  # doctest: +SKIP
9464
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric as Family
from prometheus_client.registry import Collector

from .errors import UsageError


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    value: float | None  # None: not known yet (the sample is left out)
    labels: dict[str, str] = field(default_factory=dict)


class _Collector(Collector):
    """Metric families from ``collect()``, one per name, in the order names first appear."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Family]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for m in self._collect():
            family = families.get(m.name)
            if family is None:
                if m.kind not in ("gauge", "counter"):
                    raise ValueError(f"metric {m.name}: unknown kind {m.kind!r}")
                make = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                family = families[m.name] = make(m.name, m.help, labels=sorted(m.labels))
            if m.value is not None:
                family.add_metric([m.labels[k] for k in sorted(m.labels)], float(m.value))
        yield from families.values()


def registry_of(collect: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A registry holding only what ``collect()`` reports (not the process defaults)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(collect))
    return registry


def render(metrics: Iterable[Metric]) -> str:
    """The text exposition of ``metrics``."""
    listed = list(metrics)
    return generate_latest(registry_of(lambda: listed)).decode()


class MetricsServer:
    """Serves ``collect()`` at ``/metrics`` on a daemon thread until :meth:`close`."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], *, port: int, host: str = "") -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=host or "0.0.0.0", registry=registry_of(collect))
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {host or '*'}:{port}: {e.strerror or e}") from None
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
