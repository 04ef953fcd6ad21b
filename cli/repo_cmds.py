"""Commands that read or tidy a repository: log, verify, inspect, gc."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ._common import (
    emit_json,
    json_fields,
    json_option,
    mib,
    quiet_option,
    ratio,
    repo_option,
    show_progress,
    trusted_key_option,
    workers_option,
)


@click.command()
@repo_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per version.")
@click.option(
    "--trusted-key", "trusted_keys", multiple=True, type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Also say, per version, whether it is signed by this ed25519 public key and whether pull --trusted-key "
         "accepts it (its chain back to a snapshot signed too); repeatable.",
)
def log(repo: str, as_json: bool, trusted_keys: tuple[Path, ...]) -> None:
    """List versions: id, kind, parent (deltas), raw size, stored size, ratio, time, --meta given at publish."""
    from .. import Repository
    from ..errors import SignatureError

    r = Repository(repo)
    r.ensure_exists()
    trusted = Repository(r.store, trusted_keys=trusted_keys) if trusted_keys else None
    rows: list[dict[str, Any]] = []
    pullable: dict[int, bool] = {}
    for v in r.versions():
        m = r.manifest(v).pb
        snapshot = m.kind == 1
        row: dict[str, Any] = {
            "version": v,
            "kind": "snapshot" if snapshot else "delta",
            # A snapshot depends on no other version; "previous" is the version published before it.
            "parent": m.parent if m.has_parent and not snapshot else None,
            "previous": m.parent if m.has_parent else None,
            "raw_bytes": m.raw_bytes,
            "stored_bytes": m.stored_bytes,
            "ratio": round(m.raw_bytes / m.stored_bytes, 2) if m.stored_bytes else None,
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix)),
            "metadata": dict(sorted(m.metadata.items())),
        }
        if trusted is not None:
            try:
                trusted.manifest(v)
                row["signature"] = "trusted"
            except SignatureError as e:
                row["signature"] = e.detail.removesuffix(" (a trusted key is configured)")
            parent_ok = snapshot or pullable.get(m.parent, False)
            pullable[v] = row["signature"] == "trusted" and parent_ok
            row["pull_accepts"] = pullable[v]
        rows.append(row)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    for row in rows:
        if trusted is not None and row["signature"] == "trusted" and not row["pull_accepts"]:
            row["signature_shown"] = "trusted; chain untrusted"
    width = max((len(row.get("signature_shown", row.get("signature", ""))) for row in rows), default=0)
    sig = f"  {'signature':{width}}" if trusted is not None else ""
    click.echo(f"{'version':>8}  {'kind':8}  {'parent':>6}  {'raw':>10}  {'stored':>10}  {'ratio':>8}  {'time':19}{sig}  meta")
    for row in rows:
        parent = str(row["parent"]) if row["parent"] is not None else "-"
        signature = ""
        if trusted is not None:
            signature = f"  {row.pop('signature_shown', row['signature']):{width}}"
        click.echo(
            f"{row['version']:>8}  {row['kind']:8}  {parent:>6}  {mib(row['raw_bytes']):>10}  "
            f"{mib(row['stored_bytes']):>10}  {ratio(row['raw_bytes'], row['stored_bytes']):>8}  {row['time']:19}"
            f"{signature}  " + " ".join(f"{k}={v}" for k, v in row["metadata"].items())
        )
    refused = [row["version"] for row in rows if trusted is not None and not row["pull_accepts"]]
    if refused:
        click.echo(
            f"note: pull --trusted-key refuses version(s) {_ranges(refused)}: each is unsigned (or not by a trusted key) "
            f"or its delta chain back to a snapshot goes through one that is; a signed chain starts at a signed snapshot."
        )


def _ranges(ids: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    out: list[str] = []
    for v in sorted(ids):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


@click.command()
@repo_option
@click.option("--version", "version", type=click.IntRange(min=1), default=None,
              help="Verify one version [default: every version].")
@trusted_key_option
@workers_option
@quiet_option
@json_option
def verify(repo: str, version: int | None, trusted_keys: tuple[Path, ...], workers: int, quiet: bool,
           as_json: bool) -> None:
    """Check every object, digest and chain of the repository."""
    from .. import Repository
    from ..ops.verify import verify_repository

    r = Repository(repo, trusted_keys=trusted_keys)
    report = verify_repository(r, version=version, workers=workers, progress=show_progress(quiet))
    if as_json:  # a problem is an error (one line on stderr, exit status 1), as without --json
        emit_json({**json_fields(report), "ok": True})
        return
    for line in report.notes:
        click.echo(f"note: {line}")
    squashes = f"{len(report.squashes)} squash(es), " if report.squashes else ""
    click.echo(
        f"verified {len(report.versions)} version(s), {squashes}{report.chunks} chunks, "
        f"{report.packs} packs, {report.blobs} blobs: ok"
    )


@click.command()
@repo_option
@click.option("--version", "version", type=click.IntRange(min=1), default=None, help="[default: latest]")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, metavar="N",
              help="List the N tensors that take the most stored bytes (0: every tensor).")
@trusted_key_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the version, its files and every tensor.")
def inspect(repo: str, version: int | None, top: int, trusted_keys: tuple[Path, ...], as_json: bool) -> None:
    """Describe one version: lineage, codec, files, tensors and how their chunks are encoded."""
    from .. import Repository
    from ..ops.describe import describe_version

    r = Repository(repo, trusted_keys=trusted_keys)
    if as_json:
        emit_json(_describe_json(r, version))
        return
    m = r.manifest(r.resolve(version)).pb
    shown = len(m.tensors) if top == 0 else min(top, len(m.tensors))
    lines = describe_version(r, version, top=shown)
    if m.kind == 1:  # a snapshot depends on no version (log shows no parent either): say which it followed
        after = f" (published after version {m.parent})" if m.has_parent else ""
        lines[0] = f"version {m.version}: snapshot{after}"
    for line in lines:
        click.echo(line)
    if shown < len(m.tensors):
        click.echo(f"  ... {len(m.tensors) - shown} more tensor(s), each storing less (--top 0 lists every tensor, "
                   f"--json describes them all)")


def _describe_json(r: Any, version: int | None) -> dict[str, Any]:
    from ..format.codec import ENCODING_NAMES
    from ..v1 import manifest_pb2 as pb

    v = r.resolve(version)
    m = r.manifest(v).pb
    snapshot = m.kind == pb.SNAPSHOT
    tensors = []
    for t in m.tensors:
        encodings: dict[str, int] = {}
        for c in t.chunks:
            name = ENCODING_NAMES.get(c.encoding, "?")
            encodings[name] = encodings.get(name, 0) + 1
        tensors.append({"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "chunks": len(t.chunks),
                        "stored_bytes": sum(c.length for c in t.chunks), "encodings": encodings})
    files = [{"path": f.path, "kind": "safetensors" if f.kind == pb.File.SAFETENSORS else "blob", "size": f.size}
             for f in m.files]
    return {
        "version": v, "kind": "snapshot" if snapshot else "delta",
        "parent": m.parent if m.has_parent and not snapshot else None,
        "previous": m.parent if m.has_parent else None, "snapshot": m.snapshot,
        "digest": m.version_digest.hex(),
        "codec": {"name": m.codec.name, "version": m.codec.codec_version, "zstd_level": m.codec.zstd_level,
                  "chunk_bytes": m.codec.chunk_bytes},
        "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes, "packs": len(m.packs),
        "ratio": round(m.raw_bytes / m.stored_bytes, 2) if m.stored_bytes else None,
        "metadata": dict(sorted(m.metadata.items())), "signed": bool(m.signature),
        "files": files, "tensors": tensors,
    }


@click.command()
@repo_option
@click.option("--keep-last", type=int, required=True, metavar="N", help="Keep the N newest versions (N >= 1).")
@click.option("--keep-every", type=int, default=None, metavar="M", help="Also keep every version whose id is a multiple of M.")
@click.option("--grace", type=float, default=3600.0, show_default=True, metavar="SECONDS",
              help="Delete unreferenced objects (maybe a publish in flight) only once an earlier gc saw them this long ago.")
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@json_option
def gc(repo: str, keep_last: int, keep_every: int | None, grace: float, dry_run: bool, as_json: bool) -> None:
    """Delete old versions (keeping the chains retained versions need) and unreferenced packs and blobs.

    A delta needs every version back to its snapshot: those are kept too, and named.
    """
    from .. import Repository
    from ..ops.retention import collect

    r = Repository(repo)
    r.ensure_exists()
    pinned = r.pinned()
    report = collect(r, keep_last=keep_last, keep_every=keep_every, grace_seconds=grace, dry_run=dry_run)
    listed = sorted(set(report.versions_kept) | set(report.versions_deleted))
    policy = set(listed[-keep_last:]) | {v for v in listed if keep_every and v % keep_every == 0}
    if pinned is not None:
        policy.add(pinned)
    chain = sorted(v for v in report.versions_kept if v not in policy)
    if as_json:
        emit_json({**json_fields(report), "kept_by_policy": sorted(policy & set(report.versions_kept)),
                    "kept_as_chain": chain})
        return
    line = report.summary()
    if chain:  # one line still: which kept versions the policy did not ask for, and why they stay
        snapshots = [v for v in chain if r.manifest(v).is_snapshot]
        back_to = f" (snapshot {_ranges(snapshots)})" if snapshots else ""
        line += (f"; {_ranges(sorted(policy & set(report.versions_kept)))} kept by --keep-last/--keep-every/the pin, "
                 f"{_ranges(chain)} only as the delta chain back to their snapshot{back_to}")
    click.echo(line)

