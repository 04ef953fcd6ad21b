"""Live feedback: rewards that arrive later, over HTTP, for completion ids.

In live mode a worker ships its completions without rewards. The trainer keeps them in a
:class:`FeedbackStore` until feedback arrives for each completion id through the
:class:`FeedbackServer`::

    POST /feedback   {"completion_id": "w0-17-3", "verdict": "accepted"}
                     {"completion_id": "w0-17-4", "verdict": "edited", "score": 0.6}
                     (or a JSON list of such objects)
    GET  /pending?limit=N   completions still waiting for feedback (id, prompt, completion)
    GET  /stats             counts

The reward of a completion is ``score`` when given (0..1), else 1.0 for ``accepted``, 0.5
for ``edited`` and 0.0 for ``rejected``. Feedback for an unknown or already-rated id is
refused (404 / 409), so a client can retry safely. A rollout batch goes to the trainer
once all its completions are rated, or after ``timeout`` with whatever was rated (groups
with fewer than two rated completions then teach nothing).

:class:`SimulatedUsers` stands in for people in demos and tests: it reads ``/pending``,
checks each answer with the task's verifier and posts ``accepted`` (right),
``edited`` with the partial credit as score (half right or better) or ``rejected``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np

from ..errors import UsageError
from .errors import FeedbackError
from .task import VOCAB, AdditionTask
from .worker import RolloutBatch

VERDICT_REWARD = {"accepted": 1.0, "edited": 0.5, "rejected": 0.0}


def feedback_reward(verdict: Any, score: Any = None) -> float:
    """The reward a piece of feedback stands for (validates both fields)."""
    if verdict not in VERDICT_REWARD:
        raise FeedbackError(f"verdict must be one of {', '.join(VERDICT_REWARD)}, got {verdict!r}", 400)
    if score is None:
        return VERDICT_REWARD[verdict]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= float(score) <= 1.0:
        raise FeedbackError(f"score must be a number in [0, 1], got {score!r}", 400)
    return float(score)


@dataclass
class _Entry:
    batch: RolloutBatch
    row: int


class FeedbackStore:
    """Completions awaiting feedback, joined to their rollout batch by completion id."""

    def __init__(self, task: AdditionTask, *, timeout: float) -> None:
        self.task = task
        self.timeout = timeout
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._batches: OrderedDict[tuple[int, int], RolloutBatch] = OrderedDict()
        self.received = 0
        self.refused = 0
        self.released = 0
        self.expired = 0

    def add(self, batch: RolloutBatch) -> None:
        # Own, writable reward arrays (a batch deserialized by Ray maps read-only memory).
        batch.rewards = batch.rewards.copy()
        batch.rated = batch.rated.copy()
        with self._lock:
            self._batches[(batch.worker, batch.seq)] = batch
            for row, cid in enumerate(batch.completion_ids):
                self._entries[cid] = _Entry(batch, row)

    def record(self, completion_id: Any, verdict: Any, score: Any = None) -> float:
        """Join one piece of feedback to its completion; returns the reward recorded."""
        reward = feedback_reward(verdict, score)
        if not isinstance(completion_id, str):
            raise FeedbackError("completion_id must be a string", 400)
        with self._lock:
            entry = self._entries.get(completion_id)
            if entry is None:
                self.refused += 1
                raise FeedbackError(f"unknown completion id {completion_id!r} (never served, or already trained on)", 404)
            if entry.batch.rated[entry.row]:
                self.refused += 1
                raise FeedbackError(f"completion {completion_id!r} already has feedback", 409)
            entry.batch.rewards[entry.row] = reward
            entry.batch.rated[entry.row] = True
            self.received += 1
        return reward

    def pending(self, limit: int) -> list[dict[str, Any]]:
        """Completions without feedback, oldest first."""
        out: list[dict[str, Any]] = []
        with self._lock:
            for batch in self._batches.values():
                g = batch.generation
                for row in np.flatnonzero(~batch.rated):
                    if len(out) >= limit:
                        return out
                    out.append({
                        "completion_id": batch.completion_ids[row],
                        "prompt": self.task.render(g.tokens[row, : g.prompt_len]),
                        "completion": self.task.render(g.completions[row][g.mask[row]]),
                        "version": batch.version,
                    })
        return out

    def ready(self, now: float | None = None) -> list[RolloutBatch]:
        """Batches whose completions are all rated, or whose time is up; removed from the store."""
        now = time.time() if now is None else now
        out: list[RolloutBatch] = []
        with self._lock:
            for key, batch in list(self._batches.items()):
                complete = bool(batch.rated.all())
                if complete or now - batch.created_unix >= self.timeout:
                    del self._batches[key]
                    for cid in batch.completion_ids:
                        self._entries.pop(cid, None)
                    self.released += 1
                    if not complete:
                        self.expired += 1
                    out.append(batch)
        return out

    def discard(self, keep: Callable[[RolloutBatch], bool]) -> int:
        """Forget the batches ``keep`` rejects (e.g. too stale to train on); returns how many."""
        with self._lock:
            gone = [k for k, b in self._batches.items() if not keep(b)]
            for k in gone:
                for cid in self._batches[k].completion_ids:
                    self._entries.pop(cid, None)
                del self._batches[k]
        return len(gone)

    def stats(self) -> dict[str, int]:
        with self._lock:
            waiting = sum(int((~b.rated).sum()) for b in self._batches.values())
            return {"received": self.received, "refused": self.refused, "waiting": waiting,
                    "batches_released": self.released, "batches_expired": self.expired}


class FeedbackServer:
    """``http.server`` on a background thread serving the feedback endpoint of one store."""

    def __init__(self, store: FeedbackStore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = store
        handler = _handler_for(store)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} for feedback: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="deltasync-rl-feedback", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FeedbackServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def _handler_for(store: FeedbackStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "deltasync-rl-feedback"

        def log_message(self, format: str, *args: Any) -> None:
            return  # no line per request on stderr

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/pending":
                try:
                    limit = int(parse_qs(url.query).get("limit", ["100"])[0])
                except ValueError:
                    return self._send(400, {"error": "limit must be an integer"})
                return self._send(200, store.pending(max(0, min(limit, 10_000))))
            if url.path == "/stats":
                return self._send(200, store.stats())
            self._send(404, {"error": f"no such endpoint {url.path}"})

        def do_POST(self) -> None:
            if urlparse(self.path).path != "/feedback":
                return self._send(404, {"error": f"no such endpoint {self.path}"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= 16 << 20:
                    raise ValueError("body must be 1 byte to 16 MiB")
                body = json.loads(self.rfile.read(length))
            except ValueError as e:
                return self._send(400, {"error": f"expected a JSON body ({e})"})
            items = body if isinstance(body, list) else [body]
            results: list[dict[str, Any]] = []
            status = 200
            for item in items:
                if not isinstance(item, dict):
                    results.append({"error": "each feedback must be a JSON object", "status": 400})
                    status = 400 if len(items) == 1 else 207
                    continue
                try:
                    reward = store.record(item.get("completion_id"), item.get("verdict"), item.get("score"))
                    results.append({"completion_id": item["completion_id"], "reward": reward})
                except FeedbackError as e:
                    results.append({"completion_id": item.get("completion_id"), "error": str(e), "status": e.status})
                    status = e.status if len(items) == 1 else 207
            self._send(status, results[0] if not isinstance(body, list) else results)

    return Handler


def post_feedback(url: str, feedback: dict[str, Any] | list[dict[str, Any]], *, timeout: float = 10.0) -> tuple[int, Any]:
    """POST feedback to a server at ``url``; returns (HTTP status, decoded answer)."""
    req = urllib.request.Request(f"{url}/feedback", data=json.dumps(feedback).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class SimulatedUsers:
    """People stand-ins: read pending completions over HTTP, judge them, post feedback."""

    def __init__(self, url: str, task: AdditionTask, *, delay: float, seed: int = 0, batch: int = 256) -> None:
        self.url = url
        self.task = task
        self.delay = delay
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.posted = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltasync-rl-users", daemon=True)

    def start(self) -> SimulatedUsers:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def judge(self, prompt: str, completion: str) -> dict[str, Any]:
        """The feedback a careful user would give: the verifier's partial credit as a verdict."""
        tokens = np.array([[_token(c) for c in prompt]], np.int64)
        answer = [_token(c) for c in completion][: self.task.answer_len]
        padded = np.full((1, self.task.answer_len), -1, np.int64)
        padded[0, : len(answer)] = answer
        credit = float(self.task.reward(tokens, padded)[0])
        if credit == 1.0:
            return {"verdict": "accepted"}
        if credit >= 0.5:
            return {"verdict": "edited", "score": round(credit, 4)}
        return {"verdict": "rejected"}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(f"{self.url}/pending?limit={self.batch}", timeout=10) as resp:
                    pending = json.loads(resp.read())
            except (OSError, ValueError):
                self.errors += 1
                self._stop.wait(0.1)
                continue
            if not pending:
                self._stop.wait(0.01)
                continue
            wait = float(self.rng.exponential(self.delay)) if self.delay > 0 else 0.0
            if self._stop.wait(min(wait, 5 * self.delay if self.delay > 0 else 0.0)):
                return
            answers = [{"completion_id": p["completion_id"], **self.judge(p["prompt"], p["completion"])} for p in pending]
            try:
                _, results = post_feedback(self.url, answers)
                self.posted += sum(1 for r in results if "reward" in r)
            except (OSError, ValueError):
                self.errors += 1


def _token(ch: str) -> int:
    return VOCAB.index(ch) if ch in VOCAB else -1
