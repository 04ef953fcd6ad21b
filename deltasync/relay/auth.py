"""What a client may ask of a relay: the bearer tokens for reads and for writes
(:class:`RequireToken`, a server interceptor), and the keys inside the repository layout that
it reads (:func:`check_served`) and writes (:func:`check_writable`)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from ..errors import UsageError
from ..repo.repository import LAYOUT_NAMES, is_layout_key
from ..storage import check_key
from ..storage.wire import BIDI_STREAM, CLIENT_STREAM, METHODS, SERVER_STREAM, UNARY, WRITE_METHODS
from .cache import SERVED_KEYS, SERVED_PREFIXES, served
from .fleet import FLEET_METHODS

#: grpc's handler for each kind of call (the service binds its methods with them, and the
#: interceptor its refusals).
HANDLER_FACTORIES: dict[str, Callable[..., Any]] = {
    UNARY: grpc.unary_unary_rpc_method_handler,
    SERVER_STREAM: grpc.unary_stream_rpc_method_handler,
    CLIENT_STREAM: grpc.stream_unary_rpc_method_handler,
    BIDI_STREAM: grpc.stream_stream_rpc_method_handler,
}


def check_served(key: str) -> None:
    """UsageError (INVALID_ARGUMENT) for a malformed key or one outside the repository layout."""
    check_key(key)
    if not served(key):
        layout = ", ".join((*SERVED_KEYS, *SERVED_PREFIXES))
        raise UsageError(f"{key} is not a repository key; a relay serves only {layout}")


def check_writable(key: str) -> None:
    """UsageError (INVALID_ARGUMENT) unless ``key`` is exactly a name of the repository layout
    that the relay serves: a client writes or deletes nothing else through a relay (no store
    temp files, no keys beside the layout, no gc state, which it does not serve either)."""
    check_served(key)
    if not is_layout_key(key):
        raise UsageError(f"{key} is not a name of the repository layout; a relay writes only {WRITABLE_NAMES}")


WRITABLE_NAMES = LAYOUT_NAMES.replace(", gc/pending.json", "")


class RequireToken(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks ``authorization: Bearer <token>`` (constant-time compares): reads need the read
    token (when one is set) or the write token; writes need the write token (a read token
    gets PERMISSION_DENIED, none or a wrong one UNAUTHENTICATED)."""

    def __init__(self, token: str | None, write_token: str | None = None) -> None:
        self._read = f"Bearer {token}".encode() if token else None
        self._write = f"Bearer {write_token}".encode() if write_token else None

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        name = details.method.rsplit("/", 1)[-1]
        got: bytes | None = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
        is_reader = got is not None and self._read is not None and hmac.compare_digest(got, self._read)
        is_writer = got is not None and self._write is not None and hmac.compare_digest(got, self._write)
        if name in WRITE_METHODS:
            if is_writer:
                return await continuation(details)
            if self._write is None:
                code, message = grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes"
            elif is_reader:
                code, message = grpc.StatusCode.PERMISSION_DENIED, "a read token cannot write: writes need the write token"
            else:
                code, message = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong write token"
        elif self._read is None or is_reader or is_writer:
            return await continuation(details)
        else:
            code, message = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
        kind = METHODS[name][2] if name in METHODS else FLEET_METHODS.get(name, UNARY)

        async def deny(request: Any, context: Any) -> Any:
            await context.abort(code, message)

        return HANDLER_FACTORIES[kind](deny)
