"""``deltasync inspect``: a readable description of one version."""

from __future__ import annotations

from collections import Counter

from ..format.codec import ENCODING_NAMES
from ..progress import human_bytes
from ..repo.repository import Repository
from ..v1 import manifest_pb2 as pb


def describe_version(url: str | Repository, version: int | None = None, *, top: int = 10) -> list[str]:
    repo = url if isinstance(url, Repository) else Repository(url)
    v = repo.resolve(version)
    m = repo.manifest(v).pb
    kind = "snapshot" if m.kind == pb.SNAPSHOT else "delta"
    lines = [
        f"version {v}: {kind}, parent {m.parent if m.has_parent else '-'}, nearest snapshot {m.snapshot}",
        f"digest {m.version_digest.hex()}",
        f"codec {m.codec.name} v{m.codec.codec_version}, zstd {m.codec.zstd_level}, "
        f"chunks of {human_bytes(m.codec.chunk_bytes)}",
        f"raw {human_bytes(m.raw_bytes)}, stored {human_bytes(m.stored_bytes)} in {len(m.packs)} pack(s)"
        + (f", {m.raw_bytes / m.stored_bytes:.1f}x" if m.stored_bytes else ""),
    ]
    if m.metadata:
        lines.append("metadata " + ", ".join(f"{k}={val}" for k, val in sorted(m.metadata.items())))
    for f in m.files:
        what = "safetensors" if f.kind == pb.File.SAFETENSORS else f"blob, {len(f.blob_parts)} part(s)"
        lines.append(f"file {f.path} ({what}, {human_bytes(f.size)})")
    encodings: Counter[str] = Counter()
    per_tensor: list[tuple[int, str, str]] = []
    for t in m.tensors:
        stored = 0
        for c in t.chunks:
            encodings[ENCODING_NAMES.get(c.encoding, "?")] += 1
            stored += c.length
        per_tensor.append((stored, t.name, f"{t.dtype}{list(t.shape)}"))
    lines.append(f"{len(m.tensors)} tensors, chunks: " + ", ".join(f"{n} {k}" for k, n in sorted(encodings.items())))
    per_tensor.sort(reverse=True)
    for stored, name, desc in per_tensor[:top]:
        lines.append(f"  {human_bytes(stored):>10}  {name}  {desc}")
    return lines
