"""The client side of fleet reports (``proto/deltasync/v1/fleet.proto``): send reports to a
relay, read its fleet view. Shared by agents' reporters (:mod:`deltasync.agents.report`),
relays forwarding their table upstream (:mod:`deltasync.relay.fleet`) and the ``fleet`` and
``pin --wait`` commands.

Reports carry a report token in ``x-deltasync-report-token`` (``--report-token-file``,
``$DELTASYNC_REPORT_TOKEN(_FILE)``); every call also carries the relay's read token when there
is one (``$DELTASYNC_RELAY_TOKEN(_FILE)``), as reads do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc

from ..errors import StoreError, UsageError
from ..v1 import fleet_pb2 as fpb
from ._grpc import CHANNEL_OPTIONS, describe, parse_grpc_url
from .wire import CA_ENV, read_token

FLEET_SERVICE = "deltasync.v1.Fleet"
REPORT_HEADER = "x-deltasync-report-token"
REPORT_TOKEN_ENV = "DELTASYNC_REPORT_TOKEN"
REPORT_TOKEN_FILE_ENV = "DELTASYNC_REPORT_TOKEN_FILE"
#: Reports per call: a batch stays well under the relay's 1 MiB message limit (a report is
#: ~150 bytes; its error text is cut to MAX_ERROR_CHARS).
BATCH = 2000
MAX_ERROR_CHARS = 300
#: Largest serialized report a relay keeps (longer ones are refused: INVALID_ARGUMENT).
MAX_REPORT_BYTES = 1024


def report_path(name: str) -> str:
    return f"/{FLEET_SERVICE}/{name}"


def read_report_token(token_file: str | os.PathLike[str] | None = None) -> str | None:
    """The report token: from ``token_file``, else ``$DELTASYNC_REPORT_TOKEN_FILE``, else
    ``$DELTASYNC_REPORT_TOKEN`` (None: none)."""
    return read_token(None, token_file, env=REPORT_TOKEN_ENV, file_env=REPORT_TOKEN_FILE_ENV)


@dataclass
class FleetView:
    """What a relay knows of the fleet: every node's latest report (``age``: seconds since the
    relay heard it) and the repository's latest and pinned versions as it sees them."""

    nodes: list[fpb.NodeReport] = field(default_factory=list)
    latest: int | None = None
    pinned: int | None = None
    now_unix: float = 0.0


class FleetClient:
    """Calls to the Fleet service of one relay (the first address of a ``grpc://`` URL that answers)."""

    def __init__(
        self,
        url: str,
        *,
        report_token: str | None = None,
        token: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.targets, _ = parse_grpc_url(url)
        self.url = url
        self.timeout = timeout
        tls = urlparse(url).scheme.lower() == "grpcs"
        self._metadata: list[tuple[str, str]] = []
        read = read_token(token)
        if read:
            self._metadata.append(("authorization", f"Bearer {read}"))
        if report_token:
            self._metadata.append((REPORT_HEADER, report_token))
        self._channels: list[Any] = []
        for target in self.targets:
            if tls:
                ca_path = os.environ.get(CA_ENV)
                ca = Path(ca_path).read_bytes() if ca_path else None
                channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca),
                                              options=CHANNEL_OPTIONS)
            else:
                channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
        self._preferred = 0

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, action: str, fn: Any) -> Any:
        """``fn(channel)`` on the relay that answered last, then the others; the last failure raised."""
        error: grpc.RpcError | None = None
        n = len(self._channels)
        for i in range(n):
            at = (self._preferred + i) % n
            try:
                result = fn(self._channels[at])
            except grpc.RpcError as e:
                error = e
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
                break
            self._preferred = at
            return result
        assert error is not None
        code = error.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
            raise UsageError(f"{action} at {self.url}: {describe(error)}") from None
        raise StoreError(f"{action} at {self.url}: {describe(error)}") from None

    def report(self, reports: Iterable[fpb.NodeReport]) -> int:
        """Send reports (in batches); returns how many the relay took."""
        batch = list(reports)
        taken = 0
        for start in range(0, len(batch), BATCH):
            request = fpb.ReportBatch(reports=batch[start : start + BATCH])

            def send(channel: Any, request: fpb.ReportBatch = request) -> fpb.ReportAck:
                call = channel.unary_unary(report_path("Report"), request_serializer=fpb.ReportBatch.SerializeToString,
                                           response_deserializer=fpb.ReportAck.FromString)
                ack: fpb.ReportAck = call(request, timeout=self.timeout, metadata=self._metadata)
                return ack

            taken += int(self._call("fleet report", send).accepted)
        return taken

    def view(self) -> FleetView:
        """The relay's fleet view."""

        def read(channel: Any) -> FleetView:
            call = channel.unary_stream(report_path("View"), request_serializer=fpb.ViewRequest.SerializeToString,
                                        response_deserializer=fpb.FleetView.FromString)
            out = FleetView()
            for part in call(fpb.ViewRequest(), timeout=self.timeout, metadata=self._metadata):
                out.nodes.extend(part.nodes)
                out.latest = int(part.latest) or None
                out.pinned = int(part.pinned) or None
                out.now_unix = part.now_unix
            return out

        result: FleetView = self._call("fleet view", read)
        return result


def batches(reports: list[fpb.NodeReport], size: int = BATCH) -> Iterator[list[fpb.NodeReport]]:
    for start in range(0, len(reports), size):
        yield reports[start : start + size]


__all__ = ["FleetClient", "FleetView", "read_report_token"]
