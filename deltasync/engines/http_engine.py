"""Inference servers over HTTP: SGLang, vLLM, or any server with the same shape of endpoints.

Such a server loads weights from a directory. Staging brings that directory to the target
version (``Subscriber.update_dir``: the slot not served is brought forward in place, verified,
and served by one atomic switch; under ``deltasync subscribe`` it is the agent's own copy,
already at the version, so staging finds nothing to do). The swap then calls the server's pause, update-from-disk and resume
endpoints, and afterwards asks the server which version it serves and refuses a mismatch.

Presets (paths and payloads are templates; ``{model_path}`` and ``{version}`` are filled in):

* ``sglang`` — ``POST /pause_generation``, ``POST /update_weights_from_disk``
  ``{"model_path", "weight_version"}``, ``POST /continue_generation``, version from
  ``GET /model_info`` (``weight_version``), as SGLang documents for RL.
* ``vllm`` — ``POST /pause``, ``POST /collective_rpc`` ``{"method": "reload_weights",
  "kwargs": {"weights_path"}}``, ``POST /resume`` (vLLM's dev-mode RL endpoints,
  ``VLLM_SERVER_DEV_MODE=1``). vLLM reports no weight version, so none is checked unless
  a ``version`` call is configured.
* ``generic`` — ``POST /pause``, ``POST /update_weights`` ``{"model_path", "version"}``,
  ``POST /resume``, ``GET /version`` (``version``): what :class:`ReferenceServer` serves.

:class:`ReferenceServer` is a small inference server with all three sets of endpoints,
used to test this engine end to end and by the reference RL loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..format.digest import StreamDigest
from ..format.signing import PublicKeyLike
from ..local import read_local_state
from ..pull.subscriber import Subscriber
from ..repo.repository import Repository
from ..storage import Store
from .base import Engine, EngineError, ServingLock, Staged, SwapRecord

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call of a preset."""

    path: str
    """Path under the server URL, e.g. ``/update_weights_from_disk``."""
    method: str = "POST"
    body: Any = None
    """JSON body template: during a swap every string in it is formatted with ``model_path``
    and ``version`` (the version being loaded); the ``version`` query has neither."""
    query: Mapping[str, str] = field(default_factory=dict)
    """Query parameters (templates too)."""


@dataclass(frozen=True, kw_only=True)
class HttpPreset:
    """The endpoints an :class:`HttpEngine` drives; ``dataclasses.replace`` one to adapt it."""

    name: str
    update: Call
    """Load the weights in ``{model_path}``: the write."""
    pause: Call | None = None
    """Stop serving before the update (requests in flight finish, or wait, per the server)."""
    resume: Call | None = None
    version: Call | None = None
    """Ask which version is served; None: the server cannot say, nothing is checked."""
    version_field: str = "version"
    """Dotted path of the version in the ``version`` call's JSON response."""
    success_field: str | None = "success"
    """A JSON response with this field false is a failure (SGLang answers 200 with it)."""


PRESETS: dict[str, HttpPreset] = {
    "sglang": HttpPreset(
        name="sglang",
        pause=Call(path="/pause_generation", body={"mode": "retract"}),
        update=Call(path="/update_weights_from_disk", body={"model_path": "{model_path}", "weight_version": "{version}"}),
        resume=Call(path="/continue_generation", body={}),
        version=Call(method="GET", path="/model_info"),
        version_field="weight_version",
    ),
    "vllm": HttpPreset(
        name="vllm",
        pause=Call(path="/pause"),
        update=Call(path="/collective_rpc", body={"method": "reload_weights", "kwargs": {"weights_path": "{model_path}"}}),
        resume=Call(path="/resume"),
        version=None,
    ),
    "generic": HttpPreset(
        name="generic",
        pause=Call(path="/pause"),
        update=Call(path="/update_weights", body={"model_path": "{model_path}", "version": "{version}"}),
        resume=Call(path="/resume"),
        version=Call(method="GET", path="/version"),
        version_field="version",
    ),
}


@dataclass
class HttpStaged(Staged):
    model_path: str = ""


class HttpEngine(Engine):
    """Drive an inference server that loads weights from ``model_dir``.

    >>> engine = HttpEngine("http://127.0.0.1:30000", repo="s3://bucket/run-7",
    ...                     model_dir="/models/policy", preset="sglang")
    >>> engine.update()          # pull into model_dir, pause, load, resume, check the version

    ``model_dir`` must be a directory the server can read at the same path. ``preset`` is a
    name from ``PRESETS`` or an :class:`HttpPreset`; ``headers`` go with every call (an
    API key, say); ``timeout`` bounds each call in seconds.
    """

    kind = "http"
    needs_files = True

    def __init__(
        self,
        url: str,
        repo: str | Store | Repository,
        *,
        model_dir: str | os.PathLike[str],
        preset: str | HttpPreset = "generic",
        headers: Mapping[str, str] | None = None,
        timeout: float = 600.0,
        version: int | None = None,
        workers: int = 0,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        progress: bool | None = False,
    ) -> None:
        super().__init__(version=version)
        if isinstance(preset, str):
            if preset not in PRESETS:
                raise UsageError(f"unknown HTTP preset {preset!r}; expected one of: {', '.join(PRESETS)}")
            preset = PRESETS[preset]
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"server URL must be http(s)://HOST:PORT, got {url!r}")
        if timeout <= 0:
            raise UsageError(f"timeout must be positive, got {timeout}")
        self.url = url.rstrip("/")
        self.preset = preset
        self.model_dir = Path(model_dir).absolute()
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.subscriber = Subscriber(repo, workers=workers, progress=progress, trusted_keys=trusted_keys)
        self._target: HttpStaged | None = None

    # -- hooks -------------------------------------------------------------------------------------

    def _resolve(self, version: int | None) -> int:
        return self.subscriber.repo.resolve(version)

    def _stage(self, version: int) -> Staged:
        # The directory switches to the version atomically once it is verified; the server
        # keeps serving what it loaded into memory, and reads the directory only when told to.
        result = self.subscriber.update_dir(self.model_dir, version)
        info = self.subscriber.repo.manifest(version)
        chunks = sum(len(t.chunks) for t in info.pb.tensors)
        return HttpStaged(
            version, model_path=str(self.model_dir), fetched_bytes=result.fetched_bytes,
            chunks_total=chunks, bytes_to_write=info.pb.raw_bytes, extra={"preset": self.preset.name, "copy": str(result)},
        )

    def swap(self, staged: Staged) -> SwapRecord:
        # Every call of a swap may name what it loads (a pause tagged with the version, say).
        self._target = staged if isinstance(staged, HttpStaged) else None
        try:
            return super().swap(staged)
        finally:
            self._target = None

    def _values(self) -> dict[str, Any]:
        t = self._target
        return {} if t is None else {"model_path": t.model_path, "version": t.version}

    def _pause(self) -> None:
        super()._pause()
        try:
            if self.preset.pause is not None:
                self._call(self.preset.pause, "pause", **self._values())
        except BaseException:
            super()._resume()
            raise

    def _write(self, staged: Staged) -> int:
        assert isinstance(staged, HttpStaged)
        self._call(self.preset.update, "update", **self._values())
        return staged.bytes_to_write  # the server reloads every tensor from the directory

    def _resume(self) -> None:
        try:
            if self.preset.resume is not None:
                self._call(self.preset.resume, "resume", **self._values())
        finally:
            super()._resume()

    def _after_swap(self, staged: Staged) -> None:
        if self.preset.version is None:
            return
        reported = self._served_version()
        if reported != staged.version:
            self._version = reported
            raise EngineError(
                f"{self.preset.name} server at {self.url} reports version {reported} after loading version "
                f"{staged.version} from {self.model_dir}", version=staged.version, serving=reported,
            )

    def _served_version(self) -> int | None:
        if self.preset.version is None:
            return self._version  # the server cannot say: what we last loaded into it
        found: Any = self._call(self.preset.version, "version")
        for part in self.preset.version_field.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        try:
            return int(found)
        except (TypeError, ValueError):
            return None  # e.g. SGLang's "default" before any versioned update

    # -- HTTP --------------------------------------------------------------------------------------

    def _call(self, call: Call, what: str, **values: Any) -> Any:
        subst = {k: str(v) for k, v in values.items()}
        path = _fill(call.path, subst)
        query = {k: _fill(v, subst) for k, v in call.query.items()}
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        body = None if call.body is None else json.dumps(_fill(call.body, subst)).encode()
        if body is None and call.method == "POST":
            body = b""
        req = urllib.request.Request(url, data=body, method=call.method,
                                     headers={"Content-Type": "application/json", **self.headers})
        where = f"{self.preset.name} server at {self.url}: {what} ({call.method} {path})"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace").strip()
            raise EngineError(f"{where} failed: HTTP {e.code} {detail}", serving=self._version) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EngineError(f"{where} failed: {reason}", serving=self._version) from None
        try:
            out = json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")
        if self.preset.success_field and isinstance(out, dict) and out.get(self.preset.success_field) is False:
            raise EngineError(f"{where} failed: {out.get('message', out)}", serving=self._version)
        return out


def _fill(template: Any, values: Mapping[str, str]) -> Any:
    if isinstance(template, str):
        try:
            return template.format_map(values)
        except (KeyError, IndexError, ValueError) as e:
            raise UsageError(f"bad HTTP template {template!r}: {e}") from None
    if isinstance(template, Mapping):
        return {k: _fill(v, values) for k, v in template.items()}
    if isinstance(template, list | tuple):
        return [_fill(v, values) for v in template]
    return template


def replace_preset(preset: str | HttpPreset, **changes: Any) -> HttpPreset:
    """A preset with some fields changed, e.g. ``replace_preset("vllm", version=Call(...))``."""
    base = PRESETS[preset] if isinstance(preset, str) else preset
    return dataclasses.replace(base, **changes)


# -- a reference inference server ------------------------------------------------------------------


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path``."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Hex xxh3-128 over every tensor's name and bits, in name order: "which weights"."""
    from ..format.tensors import tensor_bits

    d = StreamDigest()
    for name in sorted(state):
        d.update(name.encode())
        d.update(tensor_bits(state[name]))
    return d.digest().hex()


class ReferenceServer:
    """A tiny inference server with the generic, SGLang and vLLM weight-update endpoints.

    >>> with ReferenceServer() as server:                 # http://127.0.0.1:<free port>
    ...     engine = HttpEngine(server.url, repo, model_dir=d)

    Weights live in ``state`` (loaded with ``load``, by default every safetensors file of
    the directory). ``POST /generate`` stands in for inference: it reads every weight
    under the serving lock and answers the version and a digest of what it read. While
    paused, new requests wait; pausing waits for requests in flight. The version it
    reports is the one recorded in the directory's state (``.deltasync/state.lmdb``),
    checked against the one the caller names; a mismatch refuses the update.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        load: Callable[[Path], dict[str, torch.Tensor]] = load_safetensors_dir,
        on_load: Callable[[dict[str, torch.Tensor], int | None], None] | None = None,
    ) -> None:
        self.load = load
        self.on_load = on_load
        self.state: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.calls: list[str] = []
        """Every weight-control call, in order (pause, update, resume, ...)."""
        self.fail_next_update: str | None = None
        """Set to make the next update fail with this message (tests)."""
        self._lock = ServingLock()
        self._cond = threading.Condition()
        self._paused = False
        self._active = 0
        if model_path is not None:
            self._load(Path(model_path), None)
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ReferenceServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="reference-server", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> ReferenceServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- what the endpoints do --------------------------------------------------------------------

    @contextmanager
    def serving(self) -> Iterator[dict[str, torch.Tensor]]:
        """Hold around one inference call in this process: waits while the server is paused,
        and the weights it yields do not change until it is released."""
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._active += 1
        try:
            with self._lock.shared():
                yield self.state
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def generate(self) -> dict[str, Any]:
        """What ``POST /generate`` answers: the version served and a digest of every weight read."""
        with self.serving() as state:
            return {"version": self.version, "digest": state_digest(state)}

    def pause(self) -> None:
        self.calls.append("pause")
        with self._cond:
            self._paused = True
            while self._active:  # requests in flight finish first
                self._cond.wait()

    def resume(self) -> None:
        self.calls.append("resume")
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update(self, model_path: str, version: str | None) -> int | None:
        self.calls.append("update")
        if self.fail_next_update is not None:
            message, self.fail_next_update = self.fail_next_update, None
            raise RuntimeError(message)
        claimed = int(version) if version not in (None, "") else None
        return self._load(Path(model_path), claimed)

    def _load(self, path: Path, claimed: int | None) -> int | None:
        recorded = read_local_state(path)
        on_disk = recorded.version if recorded is not None else None
        if claimed is not None and on_disk is not None and claimed != on_disk:
            raise ValueError(f"{path} holds version {on_disk}, not {claimed}")
        state = self.load(path)
        version = on_disk if on_disk is not None else claimed
        self._lock.acquire_exclusive()
        try:
            self.state, self.version = state, version
        finally:
            self._lock.release_exclusive()
        if self.on_load is not None:
            self.on_load(state, version)
        return version


def _handler(server: ReferenceServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet

        def _json(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            out = json.loads(raw) if raw.strip() else {}
            return out if isinstance(out, dict) else {}

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == "/version":
                self._json(200, {"version": server.version})
            elif path in ("/model_info", "/get_weight_version"):
                self._json(200, {"weight_version": str(server.version) if server.version is not None else "default"})
            elif path == "/health":
                self._json(200, {"ok": True})
            else:
                self._json(404, {"error": f"no route {path}"})

        def do_POST(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            try:
                body = self._body()
                if path in ("/pause", "/pause_generation"):
                    server.pause()
                    self._json(200, {"success": True})
                elif path in ("/resume", "/continue_generation"):
                    server.resume()
                    self._json(200, {"success": True})
                elif path == "/update_weights":
                    v = server.update(str(body["model_path"]), body.get("version"))
                    self._json(200, {"success": True, "version": v})
                elif path == "/update_weights_from_disk":  # SGLang's shape: 200 with success false on failure
                    try:
                        v = server.update(str(body["model_path"]), body.get("weight_version"))
                    except Exception as e:
                        self._json(200, {"success": False, "message": str(e)})
                        return
                    self._json(200, {"success": True, "message": f"loaded version {v}", "num_paused_requests": 0})
                elif path == "/collective_rpc":  # vLLM's shape
                    if body.get("method") != "reload_weights":
                        self._json(400, {"error": f"unsupported method {body.get('method')!r}"})
                        return
                    kwargs = body.get("kwargs") or {}
                    server.update(str(kwargs["weights_path"]), None)
                    self._json(200, {"results": [None]})
                elif path == "/generate":
                    self._json(200, server.generate())
                else:
                    self._json(404, {"error": f"no route {path}"})
            except Exception as e:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler
