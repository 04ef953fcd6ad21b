"""Snapshots: full payloads of codec version 3 against the zstd byte planes of versions 1 and 2.

    python -m benchmarks.bench_snapshot [--repeats 5] [--numpy]

On the pretrained all-MiniLM-L6-v2 weights cast to bf16 (the bench extra's package; over the
real per-tensor chunks) and on one 4 MiB chunk of N(0, 0.02) bf16 weights, it prints raw bytes
over stored bytes, and encode and decode (``decode_into`` a preallocated buffer) throughput
in MB/s, one thread, best of ``--repeats``, next to ``np.copyto`` of the same bytes in the same
run. ``--numpy`` uses the numpy twin of the entropy coder instead of the C extension.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from deltasync.format import _entropy_py, codec as codec_mod
from deltasync.format.codec import PlanesZstdCodec

Bytes = npt.NDArray[np.uint8]


def best(repeats: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def bf16_bytes(t: torch.Tensor) -> Bytes:
    out: Bytes = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)
    return out


def minilm_chunks(codec: PlanesZstdCodec) -> list[Bytes]:
    from safetensors.torch import load_file

    from .minilm_stream import model_dir

    chunks = []
    for t in load_file(str(model_dir() / "model.safetensors")).values():
        b = bf16_bytes(t)
        chunks += [b[off : off + length] for off, length in codec.chunk_ranges(len(b), 2)]
    return chunks


def measure(name: str, chunks: list[Bytes], repeats: int) -> None:
    raw = sum(len(c) for c in chunks)
    outs = [np.empty_like(c) for c in chunks]

    def copy() -> None:
        for o, c in zip(outs, chunks, strict=True):
            np.copyto(o, c)

    t_copy = best(repeats, copy)
    print(f"{name}: {raw / 1e6:.1f} MB in {len(chunks)} chunks; np.copyto {raw / t_copy / 1e6:.0f} MB/s")
    for label, codec in (("v1/v2 zstd planes", PlanesZstdCodec(full_coder=False)), ("v3", PlanesZstdCodec())):
        encs = [codec.encode(c, None, 2) for c in chunks]
        t_enc = best(repeats, lambda codec=codec: [codec.encode(c, None, 2) for c in chunks])  # type: ignore[misc]

        def decode(codec: PlanesZstdCodec = codec, encs: list[codec_mod.EncodedChunk] = encs) -> None:
            for e, o in zip(encs, outs, strict=True):
                codec.decode_into(e, None, o, 2)

        t_dec = best(repeats, decode)
        if any(o.tobytes() != c.tobytes() for o, c in zip(outs, chunks, strict=True)):
            raise AssertionError("decode mismatch")
        stored = sum(len(e.payload) for e in encs)
        print(f"  {label:18s} {raw / stored:.4f}x smaller than raw   encode {raw / t_enc / 1e6:5.0f} MB/s "
              f"({t_copy / t_enc:.4f}x copy)   decode {raw / t_dec / 1e6:5.0f} MB/s ({t_copy / t_dec:.4f}x copy)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--numpy", action="store_true", help="the entropy coder's numpy twin, not the C extension")
    args = p.parse_args(argv)
    if args.numpy:
        codec_mod._E = _entropy_py
    print(f"entropy coder: {'numpy' if args.numpy else codec_mod.ENTROPY_KERNELS}")
    measure("all-MiniLM-L6-v2, bf16", minilm_chunks(PlanesZstdCodec()), args.repeats)
    w = np.random.default_rng(0).normal(0, 0.02, 2 << 20).astype(np.float32)
    measure("N(0, 0.02) bf16, one 4 MiB chunk", [bf16_bytes(torch.from_numpy(w))], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
