"""Publish and pull through a loopback S3 server, against single-stream transfers.

    python -m benchmarks.bench_s3 [--size-gib 1.0] [--deltas 2] [--quick]

A moto S3 server runs in its own process on 127.0.0.1 (real HTTP through boto3). The model is
the core benchmark's synthetic RL-like stream (lr 1e-6 change statistics measured on a
real AdamW run of a small transformer), transformer-shaped bf16 of at least ``--size-gib``.
Per version it prints wall time, throughput (model bytes / wall), stored bytes and HTTP
request count, next to one single-stream PUT and GET of the same raw bytes in the same run,
and splits the time into encode (the same publish into memory://) and transfer (the rest);
likewise decode and transfer for pulls.

Note: the server shares this machine's cores with the client, so loopback throughput is a
lower bound on what a real endpoint gives; ratios within the run are what to read.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from benchmarks.rl_stream import (
    FlatModel,
    TinyConfig,
    measure_change_stats,
    rl_stream,
    shape_for_size,
    synthetic_stream,
    transformer_layout,
)

T = TypeVar("T")
GB = 1e9


@dataclass
class Timed:
    seconds: float
    requests: int


class RequestCounter:
    """Counts HTTP requests a boto3 client sends (botocore's before-send event)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, **_: Any) -> None:
        with self._lock:
            self.count += 1

    def measure(self, fn: Callable[[], T]) -> tuple[T, Timed]:
        before = self.count
        t0 = time.perf_counter()
        out = fn()
        return out, Timed(time.perf_counter() - t0, self.count - before)


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in a process of its own (so it does not share our GIL) on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def state_of(model: FlatModel) -> dict[str, torch.Tensor]:
    return {
        spec.name: torch.from_numpy(model.tensor(spec)).view(torch.bfloat16).reshape(spec.shape)
        for spec in model.layout
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="64 MiB model, one delta (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.deltas = 1 / 16, 1

    import deltasync
    from deltasync.storage._s3 import S3Store

    for k, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, value)
    server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        store = S3Store(f"s3://{bucket}/repo")
        store.client.create_bucket(Bucket=bucket)
        counter = RequestCounter()
        store.client.meta.events.register("before-send.s3", counter)

        t0 = time.perf_counter()
        real = list(rl_stream(1e-6, 4, warmup=10, cfg=TinyConfig(), seed=0))
        stats = measure_change_stats(real)
        layout = transformer_layout(shape_for_size(int(args.size_gib * 2**30)))
        print(f"# python -m benchmarks.bench_s3 --size-gib {args.size_gib:g} --deltas {args.deltas}")
        print(f"# stats from a real lr=1e-6 AdamW stream ({time.perf_counter() - t0:.1f}s); S3 = moto on {endpoint}")
        print(f"# cores: {os.cpu_count()}, client and server share them")

        pub_s3 = deltasync.Publisher(store, deltasync.PublisherConfig(progress=False))
        pub_mem = deltasync.Publisher(f"memory://bench-{uuid.uuid4().hex}", deltasync.PublisherConfig(progress=False))
        rows: list[str] = []
        raw = 0
        versions: list[FlatModel] = []
        for model in synthetic_stream(layout, stats, args.deltas, seed=1):
            state = state_of(model)
            raw = model.nbytes
            t_enc = time.perf_counter()
            pub_mem.publish(state)
            t_enc = time.perf_counter() - t_enc
            published, timed = counter.measure(functools.partial(pub_s3.publish, state))
            r = published
            rows.append(
                f"publish v{published} {r.kind:8} {timed.seconds:7.2f}s {raw / timed.seconds / GB:6.2f} GB/s "
                f"{r.stored_bytes / 2**20:9.1f} MiB {timed.requests:6d} req   "
                f"encode {t_enc:6.2f}s  transfer+commit {max(timed.seconds - t_enc, 0):6.2f}s"
            )
            versions.append(model)
            if len(versions) > 2:
                versions.pop(0)

        sub_s3 = deltasync.Subscriber(store)
        mem_repo = pub_mem.repo
        sub_mem = deltasync.Subscriber(mem_repo)
        for version in mem_repo.versions():
            t_dec = time.perf_counter()
            sub_mem.pull(version)
            t_dec = time.perf_counter() - t_dec
            pulled, timed = counter.measure(functools.partial(sub_s3.pull, version))
            plan = pulled.plan
            how = "from snapshot" if plan.base is None else f"from v{plan.base}"
            rows.append(
                f"pull    v{version} {how:13} {timed.seconds:7.2f}s {raw / timed.seconds / GB:6.2f} GB/s "
                f"{(plan.fetch_bytes if plan else 0) / 2**20:9.1f} MiB {timed.requests:6d} req   "
                f"decode {t_dec:6.2f}s  transfer        {max(timed.seconds - t_dec, 0):6.2f}s"
            )

        blob = versions[-1].bits.tobytes()
        client = store.client
        _, up = counter.measure(lambda: client.put_object(Bucket=bucket, Key="single/blob", Body=blob))
        got, down = counter.measure(lambda: client.get_object(Bucket=bucket, Key="single/blob")["Body"].read())
        assert got == blob
        got = b""
        print(f"\nmodel: {raw / 2**30:.2f} GiB bf16, {len(layout)} tensors")
        for line in rows:
            print(line)
        print(f"single-stream PUT of the raw model: {up.seconds:7.2f}s {raw / up.seconds / GB:6.2f} GB/s {up.requests} req")
        print(f"single-stream GET of the raw model: {down.seconds:7.2f}s {raw / down.seconds / GB:6.2f} GB/s {down.requests} req")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
