"""The ``deltasync`` command line: thin click commands over the library.

Heavy imports (numpy, torch, zstd) happen inside commands so ``--help`` is instant. Every
DeltasyncError becomes one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from click.decorators import FC

from deltasync.errors import DeltasyncError, UsageError


def _cache_base() -> Path:
    """Where deltasync keeps its local caches: $DELTASYNC_CACHE, else ~/.cache/deltasync."""
    return Path(os.environ.get("DELTASYNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deltasync"
    ))


def _repo_key(repo: str) -> str:
    return repo if "://" in repo else os.path.abspath(repo)


def _default_cache(repo: str) -> Path:
    return _cache_base() / "publish" / hashlib.sha256(_repo_key(repo).encode()).hexdigest()[:16]


def _emit_json(obj: object) -> None:
    click.echo(json.dumps(obj, sort_keys=True, default=_json_default))


def _json_default(o: object) -> object:
    """JSON for what results hold besides plain values: dataclasses, sets, paths."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)  # Path and anything else: its text


def _local_dir(positional: Path | None, out: Path | None, command: str) -> Path:
    """The local directory, given as the DIR argument or as --out DIR (either, for every command)."""
    if positional is not None and out is not None and os.path.abspath(positional) != os.path.abspath(out):
        raise UsageError(f"two directories given ({positional} and --out {out}); give DIR or --out DIR")
    directory = positional if positional is not None else out
    if directory is None:
        raise UsageError(f"give the local directory: deltasync {command} DIR (or --out DIR)")
    return directory


def _ca_hint(message: str) -> str:
    """A TLS failure against a relay: say how to trust its certificate."""
    if "CERTIFICATE_VERIFY_FAILED" not in message and "certificate verify failed" not in message.lower():
        return message
    ca = os.environ.get("DELTASYNC_RELAY_CA")
    if ca:
        return f"{message} [the relay's certificate is not signed by $DELTASYNC_RELAY_CA={ca}]"
    return (f"{message} [the relay's certificate is self-signed or from a private CA: "
            "set DELTASYNC_RELAY_CA=/path/to/relay-ca.pem (for a self-signed relay, its --tls-cert file)]")


def _progress(quiet: bool) -> bool | None:
    return False if quiet else None  # None: only on a terminal


def _parse_meta(items: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--meta expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deltasync")
def cli() -> None:
    """deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets."""


def _repo_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value.lower().startswith("memory://"):
        raise click.BadParameter(
            "memory:// repositories live inside one process and vanish when the command exits; "
            "use a path, file:///abs/path, s3://bucket/prefix or grpc://host:port"
        )
    return value


#: Every form --repo takes (memory:// is the library's only: it vanishes with the process).
REPO_FORMS = ("a path (./repo), file:///abs/path, s3://bucket/prefix, grpc://host:port[,host2:port2] "
              "or grpcs://host:port[,...] (relays, TLS with $DELTASYNC_RELAY_CA; writable with "
              "$DELTASYNC_RELAY_WRITE_TOKEN(_FILE) when they serve --accept-writes)")

repo_option = click.option(
    "--repo", required=True, metavar="URL", callback=_repo_url, help=f"Repository: {REPO_FORMS}.",
)
move_aside_option = click.option(
    "--move-aside", is_flag=True,
    help="Move files in the directory that are not the repository's (weights, configs a loader would read) into "
         "DIR/.deltasync/aside/ [default: refuse, naming them].",
)
fsync_option = click.option(
    "--fsync", is_flag=True,
    help="Flush each version to disk before serving it [default: no flush; after a power loss the copy is checked "
         "and repaired before its next update].",
)
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress output.")
workers_option = click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                              help="Threads for encoding/decoding (0: one per core).")
dir_argument = click.argument("directory", required=False, type=click.Path(path_type=Path), metavar="[DIR]")


def out_option(help_text: str) -> Callable[[FC], FC]:
    return click.option("--out", type=click.Path(path_type=Path), default=None, metavar="DIR", help=help_text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts) instead of text.")
trusted_key_option = click.option(
    "--trusted-key", "trusted_keys", multiple=True, type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Refuse versions not signed by this ed25519 public key (PEM, see keygen; repeatable for key rotation).",
)


@cli.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@repo_option
@click.option("--base", "base_dir", type=click.Path(path_type=Path), default=None,
              help="Directory holding the repository's latest version (e.g. the previous checkpoint).")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path), default=None,
              help="Local copy of the latest version kept for diffing [default: ~/.cache/deltasync/publish/<repo>].")
@click.option("--no-cache", is_flag=True, help="Keep no local copy (each version without --base is a snapshot).")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, help="Version id [default: latest+1].")
@click.option("--snapshot-every", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--max-delta-fraction", type=click.FloatRange(min=0, min_open=True, max=10), default=0.5,
              show_default=True, help="Store a snapshot when a delta exceeds this fraction of one.")
@click.option("--chunk-mib", type=click.FloatRange(min=0.001, max=64), default=4.0, show_default=True)
@click.option("--zstd-level", type=click.IntRange(1, 22), default=3, show_default=True)
@click.option("--context-classes", type=click.IntRange(0, 8), default=6, show_default=True, metavar="N",
              help="Code a delta's changed positions in up to N classes of the base's magnitude (smaller deltas; "
                   "0: context-free chunks, which also reverse for rollbacks without downloads).")
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Producer metadata (repeatable).")
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Sign the manifest with this ed25519 private key (PEM, see keygen).")
@click.option("--squash-stride", "squash_strides", multiple=True, type=click.IntRange(min=2), metavar="S",
              help="When S divides the new version id V, also store V as one delta from V-S (repeatable).")
@click.option("--allow-empty", is_flag=True,
              help="Publish a new version even when nothing changed since the latest [default: publish none].")
@click.option("--follow-symlinks", is_flag=True,
              help="Publish files reached through symbolic links out of CHECKPOINT or into other directories (a Hugging "
                   "Face cache snapshot) [default: such a link is an error naming it].")
@workers_option
@quiet_option
@json_option
def publish(
    checkpoint: Path, repo: str, base_dir: Path | None, cache_dir: Path | None, no_cache: bool,
    version: int | None, snapshot_every: int, max_delta_fraction: float, chunk_mib: float,
    zstd_level: int, context_classes: int, meta: tuple[str, ...], signing_key: Path | None,
    squash_strides: tuple[int, ...], allow_empty: bool, follow_symlinks: bool, workers: int, quiet: bool,
    as_json: bool,
) -> None:
    """Publish a checkpoint directory (safetensors, single or sharded) as a new version.

    Once the version is committed the command succeeds: a later problem (the publish cache
    cannot be refreshed, a squash cannot be written) is a warning on stderr."""
    from deltasync import PlanesZstdCodec, Publisher, PublisherConfig

    chunk_bytes = int(chunk_mib * (1 << 20)) // 8 * 8
    config = PublisherConfig(
        codec=PlanesZstdCodec(chunk_bytes=chunk_bytes, zstd_level=zstd_level, max_classes=context_classes),
        workers=workers, snapshot_every=snapshot_every, max_delta_fraction=max_delta_fraction,
        progress=_progress(quiet), squash_strides=squash_strides, skip_unchanged=not allow_empty,
        follow_symlinks=follow_symlinks,
    )
    start = time.monotonic()
    pub = Publisher(repo, config, signing_key=signing_key)
    cache = None if no_cache or base_dir is not None else (cache_dir or _default_cache(repo))
    # First use: this default cache was never recorded (`deltasync cache --clear` forgets it).
    first_use = cache is not None and cache_dir is None and not _cache_owner(cache).exists()
    r = pub.publish_dir(checkpoint, base_dir=base_dir, cache_dir=cache, version=version, metadata=_parse_meta(meta))
    seconds = time.monotonic() - start  # all of it: the cache brought to the latest version included
    if cache is not None and cache_dir is None:
        try:
            _record_cache_owner(cache, repo)
        except OSError as e:  # committed already: a retry would publish it twice
            click.echo(f"deltasync: warning: cannot record the publish cache {cache} ({e.strerror or e})", err=True)
            first_use = False
    if as_json:
        _emit_json({
            "version": r.version, "kind": r.kind, "parent": r.parent if r.kind == "delta" else None,
            "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
            "ratio": round(r.ratio, 2) if r.stored_bytes else None, "seconds": round(seconds, 3),
            "published": r.kind != "unchanged", "squashes": [dataclasses.asdict(sq) for sq in r.squashes],
            "warnings": list(r.warnings),
        })
    elif r.kind == "unchanged":
        click.echo(f"nothing changed since version {r.version} (tensors, files and metadata are equal): "
                   f"no version published (--allow-empty publishes one)")
    else:
        # A snapshot depends on no other version: no parent is shown for it (log shows the same).
        parent = f" parent {r.parent}" if r.kind == "delta" and r.parent is not None else ""
        click.echo(
            f"published version {r.version} ({r.kind}{parent}): {_mib(r.raw_bytes)} raw, "
            f"{_mib(r.stored_bytes)} stored, {_ratio(r.raw_bytes, r.stored_bytes)}, {seconds:.2f}s"
        )
        for sq in r.squashes:
            click.echo(sq.summary())
    if first_use and cache is not None:
        click.echo(
            f"note: publish keeps a local copy of the latest version of each repository it publishes to (up to twice "
            f"the checkpoint's size), to diff against without downloading: {cache} ({_mib(_tree_bytes(cache))} now). "
            f"`deltasync cache` lists these copies, "
            f"`deltasync cache --clear` removes them; --base DIR or --no-cache keep none, --cache DIR or "
            f"$DELTASYNC_CACHE put them elsewhere.", err=as_json,
        )


def _fields(obj: object) -> dict[str, Any]:
    """A result dataclass as a dict of JSON values."""
    out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(obj), default=_json_default))  # type: ignore[call-overload]
    return out


def _ratio(raw: int, stored: int) -> str:
    """raw / stored as publish, log and inspect all print it."""
    return f"{raw / stored:.1f}x" if stored else "inf"


def _tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _cache_owner(cache: Path) -> Path:
    return cache.parent / f"{cache.name}.json"


def _record_cache_owner(cache: Path, repo: str) -> None:
    """Beside a default publish cache, the repository it copies (for `deltasync cache`)."""
    owner = _cache_owner(cache)
    if not owner.exists() and cache.exists():
        owner.write_text(json.dumps({"repo": _repo_key(repo)}) + "\n")


@cli.command()
@repo_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per version.")
@click.option(
    "--trusted-key", "trusted_keys", multiple=True, type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Also say, per version, whether it is signed by this ed25519 public key and whether pull --trusted-key "
         "accepts it (its chain back to a snapshot signed too); repeatable.",
)
def log(repo: str, as_json: bool, trusted_keys: tuple[Path, ...]) -> None:
    """List versions: id, kind, parent (deltas), raw size, stored size, ratio, time, --meta given at publish."""
    from deltasync import Repository
    from deltasync.errors import SignatureError

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
            f"{row['version']:>8}  {row['kind']:8}  {parent:>6}  {_mib(row['raw_bytes']):>10}  "
            f"{_mib(row['stored_bytes']):>10}  {_ratio(row['raw_bytes'], row['stored_bytes']):>8}  {row['time']:19}"
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


@cli.command()
@dir_argument
@repo_option
@out_option("Directory to bring to the version (or DIR).")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, help="[default: latest]")
@move_aside_option
@fsync_option
@trusted_key_option
@workers_option
@quiet_option
@json_option
def pull(
    directory: Path | None, repo: str, out: Path | None, version: int | None, move_aside: bool, fsync: bool,
    trusted_keys: tuple[Path, ...], workers: int, quiet: bool, as_json: bool,
) -> None:
    """Bring a directory to a version, byte for byte, verifying every chunk written.

    The directory keeps two slots of files in DIR/.deltasync; the one not served is brought
    forward in place (only what changed is written) and one atomic switch serves it. The
    files in DIR are links into the served slot.
    """
    from deltasync import Repository, Subscriber
    from deltasync.local.cache import CachedStore
    from deltasync.local.state import StateDB

    out = _local_dir(directory, out, "pull")

    upstream = Repository(repo, trusted_keys=trusted_keys)
    counting = CachedStore(upstream.store)
    # With trusted keys, the newest signed refs accepted are remembered in the copy: an older one is a replay.
    memory = StateDB.open(out) if trusted_keys and version is None else None
    sub = Subscriber(Repository(counting, trusted_keys=trusted_keys, ref_memory=memory), workers=workers,
                     progress=_progress(quiet))
    start = time.monotonic()
    result = sub.update_dir(out, version, move_aside=move_aside, fsync=fsync)
    seconds = time.monotonic() - start
    if as_json:
        _emit_json({**_fields(result), "directory": str(out), "how": str(result),
                    "fetched_bytes": counting.fetched_bytes, "seconds": round(seconds, 3)})
        return
    click.echo(f"pulled version {result.version} into {out} ({result}, {_mib(counting.fetched_bytes)} fetched, "
               f"{seconds:.2f}s)")


@cli.command()
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
    from deltasync import Repository
    from deltasync.ops.verify import verify_repository

    r = Repository(repo, trusted_keys=trusted_keys)
    report = verify_repository(r, version=version, workers=workers, progress=_progress(quiet))
    if as_json:  # a problem is an error (one line on stderr, exit status 1), as without --json
        _emit_json({**_fields(report), "ok": True})
        return
    for line in report.notes:
        click.echo(f"note: {line}")
    squashes = f"{len(report.squashes)} squash(es), " if report.squashes else ""
    click.echo(
        f"verified {len(report.versions)} version(s), {squashes}{report.chunks} chunks, "
        f"{report.packs} packs, {report.blobs} blobs: ok"
    )


@cli.command()
@repo_option
@click.option("--version", "version", type=click.IntRange(min=1), default=None, help="[default: latest]")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, metavar="N",
              help="List the N tensors that take the most stored bytes (0: every tensor).")
@trusted_key_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the version, its files and every tensor.")
def inspect(repo: str, version: int | None, top: int, trusted_keys: tuple[Path, ...], as_json: bool) -> None:
    """Describe one version: lineage, codec, files, tensors and how their chunks are encoded."""
    from deltasync import Repository
    from deltasync.ops.describe import describe_version

    r = Repository(repo, trusted_keys=trusted_keys)
    if as_json:
        _emit_json(_describe_json(r, version))
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
    from deltasync.format.codec import ENCODING_NAMES
    from deltasync.v1 import manifest_pb2 as pb

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


@cli.command()
@repo_option
@click.option("--from", "a", type=click.IntRange(min=1), default=None, metavar="A", help="Older version (with --to).")
@click.option("--to", "c", type=click.IntRange(min=1), default=None, metavar="C", help="Newer version (with --from).")
@click.option("--stride", "strides", multiple=True, type=click.IntRange(min=2), metavar="S",
              help="Every missing squash V-S -> V for V a multiple of S (repeatable), instead of --from/--to.")
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Sign the squash with this ed25519 private key (PEM, see keygen).")
@workers_option
@quiet_option
def squash(repo: str, a: int | None, c: int | None, strides: tuple[int, ...], signing_key: Path | None,
           workers: int, quiet: bool) -> None:
    """Store version C once more as one delta from version A, so subscribers at A skip the versions between."""
    from deltasync import PublisherConfig
    from deltasync.publish.squash import write_squash, write_squashes

    if strides and (a is not None or c is not None):
        raise UsageError("give either --from and --to, or --stride")
    config = PublisherConfig(workers=workers, progress=_progress(quiet))
    if strides:
        results = write_squashes(repo, strides, config=config, signing_key=signing_key)
        if not results:
            click.echo("no squash missing")
    elif a is None or c is None:
        raise UsageError("give --from A and --to C (or --stride S)")
    else:
        results = [write_squash(repo, a, c, config=config, signing_key=signing_key)]
    for r in results:
        click.echo(r.summary())


@cli.command()
@click.option("--out", "prefix", required=True, metavar="PREFIX",
              help="Write PREFIX.key (private, mode 0600) and PREFIX.pub (public); never overwrites.")
def keygen(prefix: str) -> None:
    """Create an ed25519 key pair: publish --signing-key PREFIX.key, pull --trusted-key PREFIX.pub."""
    from deltasync.format.signing import generate_keypair

    key, pub, kid = generate_keypair(prefix)
    click.echo(f"wrote {key} (private: keep it with the publisher) and {pub} (public: for subscribers), key id {kid.hex()}")


@cli.command()
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
    from deltasync import Repository
    from deltasync.ops.retention import collect

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
        _emit_json({**_fields(report), "kept_by_policy": sorted(policy & set(report.versions_kept)),
                    "kept_as_chain": chain})
        return
    line = report.summary()
    if chain:  # one line still: which kept versions the policy did not ask for, and why they stay
        snapshots = [v for v in chain if r.manifest(v).is_snapshot]
        back_to = f" (snapshot {_ranges(snapshots)})" if snapshots else ""
        line += (f"; {_ranges(sorted(policy & set(report.versions_kept)))} kept by --keep-last/--keep-every/the pin, "
                 f"{_ranges(chain)} only as the delta chain back to their snapshot{back_to}")
    click.echo(line)


@cli.command()
@click.option("--repo", required=True, metavar="URL",
              callback=_repo_url, help=f"Upstream repository: {REPO_FORMS}; a relay's upstream may be another relay.")
@click.option("--listen", required=True, metavar="HOST:PORT", help="Address to serve on (port 0: any free port).")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path), default=None,
              help="Cache directory (LMDB index + object files), kept across restarts [default: a temporary one].")
@click.option("--cache-max-bytes", default=None, metavar="SIZE",
              help="Evict least recently used objects beyond this size, e.g. 500G [default: no limit].")
@click.option("--poll-interval", type=click.FloatRange(0.01, 60), default=0.5, show_default=True, metavar="SECONDS",
              help="How often the upstream is checked for a new version.")
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Serve TLS with this PEM certificate (clients use grpcs://).")
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False), default=None, help="PEM key of --tls-cert.")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Require this bearer token from every client [default: $DELTASYNC_RELAY_TOKEN(_FILE) if set].")
@click.option("--accept-writes", is_flag=True, default=False,
              help="Let publishers holding the write token write the repository through this relay (Put, Delete).")
@click.option("--write-token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The write token (distinct from the read token; it also reads) "
                   "[default: $DELTASYNC_RELAY_WRITE_TOKEN(_FILE) with --accept-writes].")
@click.option("--max-object-bytes", default="256M", show_default=True, metavar="SIZE",
              help="Largest object a publisher may upload.")
@click.option("--max-uploads", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Uploads received at once (each held in memory until written); more wait.")
@click.option("--write-quota", default=None, metavar="SIZE",
              help="Most bytes the upstream repository may hold (counted at start, then through this relay's writes); "
                   "uploads past it are refused [default: none].")
def serve(
    repo: str, listen: str, cache_dir: Path | None, cache_max_bytes: str | None, poll_interval: float,
    tls_cert: Path | None, tls_key: Path | None, token_file: Path | None, accept_writes: bool,
    write_token_file: Path | None, max_object_bytes: str, max_uploads: int, write_quota: str | None,
) -> None:
    """Serve a repository to subscribers as a caching gRPC relay (grpc://HOST:PORT; relays chain)."""
    import logging

    from deltasync.relay import build_server, parse_size, run_until_signalled
    from deltasync.storage._wire import read_token, read_write_token

    logging.getLogger("deltasync").removeHandler(_WARNINGS)  # the relay logs every line its own way
    logging.basicConfig(level=logging.INFO, format="deltasync relay: %(message)s")
    limit = parse_size(cache_max_bytes) if cache_max_bytes is not None else None
    if write_token_file is not None and not accept_writes:
        raise UsageError("--write-token-file needs --accept-writes (a read-only relay takes no write token)")

    server = build_server(
        repo, listen, cache_dir, cache_max_bytes=limit, poll_interval=poll_interval,
        tls_cert=tls_cert, tls_key=tls_key, token=read_token(None, token_file),
        accept_writes=accept_writes,
        write_token=read_write_token(None, write_token_file) if accept_writes else None,
        max_object_bytes=parse_size(max_object_bytes), max_uploads=max_uploads,
        write_quota=parse_size(write_quota) if write_quota is not None else None,
    )

    def ready() -> None:
        writes = ", accepting writes" if accept_writes else ""
        click.echo(f"serving {server.upstream_url} on {server.address} (cache {server.cache_dir}{writes}); SIGTERM stops")

    run_until_signalled(server, on_ready=ready)
    click.echo("relay stopped")


class _WarningLines(logging.Handler):
    """Warnings of the library's loggers as one `deltasync: warning: ...` line each on stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"deltasync: warning: {record.getMessage()}", err=True)


_WARNINGS = _WarningLines()


class _RetryLog(logging.Handler):
    """The agent's "update failed" warnings, one line each on stderr.

    A failure the agent retries is a warning naming the attempt; the failure that ends the
    command is not printed here: the command's own error line says it, once.
    """

    def __init__(self, retries: int | None, follow: bool) -> None:
        super().__init__(logging.WARNING)
        self.retries, self.follow, self.failures = retries, follow, 0

    def emit(self, record: logging.LogRecord) -> None:
        from deltasync.local.agent import FINAL

        message = record.getMessage()
        if not message.startswith("update failed: "):
            click.echo(f"deltasync: warning: {message}", err=True)
            return
        self.failures += 1
        error = sys.exc_info()[1]
        if not self.follow and (self.retries is None or self.failures >= self.retries or isinstance(error, FINAL)):
            return  # it ends the command, whose error line says it
        attempt = "retrying" if self.follow else f"attempt {self.failures} of {self.retries}; retrying"
        click.echo(f"deltasync: warning: update failed ({attempt}): {_ca_hint(message.removeprefix('update failed: '))}",
                   err=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        logger = logging.getLogger("deltasync.local.agent")
        before = logger.propagate
        logger.addHandler(self)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.propagate = before


@cli.command()
@dir_argument
@repo_option
@out_option("Directory to keep at the version to serve (or DIR).")
@click.option("--follow", is_flag=True, help="Keep running: bring the directory to every new target (SIGTERM stops).")
@click.option("--poll-interval", type=click.FloatRange(0.01, 3600), default=0.5, show_default=True, metavar="SECONDS",
              help="How often the repository's latest and pin refs are read.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port).")
@click.option("--metrics-host", default="", metavar="HOST", help="Address for --metrics-port [default: every interface].")
@click.option("--keep-versions", type=click.IntRange(min=0), default=8, show_default=True, metavar="K",
              help="Keep the delta payloads of the last K versions in DIR/.deltasync: rollbacks among them download nothing.")
@click.option("--retries", type=click.IntRange(min=1), default=5, show_default=True,
              help="Attempts per update (with backoff) before a run without --follow gives up.")
@click.option("--engine", "engine_spec", default=None, metavar="SPEC",
              help="Also swap each version into an engine: torch:MODULE:FACTORY (MODULE is imported from the "
                   "current directory or the Python path; FACTORY() takes no arguments and returns the torch.nn.Module "
                   "(or a dict of name -> tensor) to keep at each version, built on the device it serves from; its "
                   "tensors are overwritten in place), fanout[:MODULE:FACTORY] (the same, for rank 0 of a "
                   "torch.distributed group), vllm@URL (a vLLM with the deltasync backend: loads only what "
                   "changed), or http:sglang|vllm|generic@URL (the server reloads from the copy).")
@click.option("--pause-mode", type=click.Choice(["keep", "wait", "abort"]), default="keep", show_default=True,
              help="vllm@URL: what the server does with requests in flight during a swap (keep: frozen, then resumed).")
@move_aside_option
@fsync_option
@trusted_key_option
@click.option("--ref-grace", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="With --trusted-key: keep following a signed ref this long past its expiry, with a warning "
                   "(a quiet publisher late with `deltasync refresh-refs`); beyond it the ref is refused.")
@workers_option
@quiet_option
def subscribe(
    directory: Path | None, repo: str, out: Path | None, follow: bool, poll_interval: float, metrics_port: int | None,
    metrics_host: str,
    keep_versions: int, retries: int, engine_spec: str | None, pause_mode: str, move_aside: bool, fsync: bool,
    trusted_keys: tuple[Path, ...], ref_grace: float, workers: int, quiet: bool,
) -> None:
    """Bring a directory to the version to serve (the pinned one, else the latest); with --follow, keep it there.

    Resumes where a killed run stopped. State, figures and kept payloads live in DIR/.deltasync
    (see `deltasync status DIR`). SIGTERM or SIGINT stops after the current chunk, exit status 0.
    """
    import signal

    from deltasync.local.agent import Agent, AgentConfig, Update

    out = _local_dir(directory, out, "subscribe")
    retry_log = _RetryLog(retries, follow)
    config = AgentConfig(
        poll_interval=poll_interval, metrics_port=metrics_port, metrics_host=metrics_host,
        keep_versions=keep_versions, retries=retries, workers=workers, progress=_progress(quiet),
        move_aside=move_aside, fsync=fsync, ref_grace=ref_grace,
    )

    engine = None
    if engine_spec is not None:
        from deltasync.engines import build_engine

        options: dict[str, object] = {"repo": repo}
        if engine_spec.startswith(("http", "vllm@")):
            options["model_dir"] = str(out)  # the server loads (from) the copy the agent serves
            if engine_spec.startswith("vllm@"):
                options["pause_mode"] = pause_mode
        else:
            options["copy"] = str(out)  # changed chunks come from the agent's copy: one fetch, one decode
            # MODULE from the current directory, as `python -m deltasync` finds it (the console
            # script's sys.path starts with its own bin directory instead).
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
        if trusted_keys:
            options["trusted_keys"] = trusted_keys
        engine = build_engine(engine_spec, **options)

    def report(u: Update) -> None:
        retry_log.failures = 0
        click.echo(f"version {u.version} ({u.how}, {_mib(u.fetched_bytes)} fetched, {u.seconds:.2f}s)")
        if engine is not None:
            to_engine(u.version)
        sys.stdout.flush()

    def to_engine(version: int | None) -> None:
        # The engine stages (the changed chunks, read from the copy and verified) before its
        # pause; a failed swap leaves it serving its previous version, and the next update
        # tries again.
        assert engine is not None
        try:
            swap = engine.update(version)
        except DeltasyncError as e:
            click.echo(f"deltasync: error: engine update to version {version}: {e}", err=True)
            return
        if swap is not None:
            click.echo(f"engine serves version {swap.version} (pause {swap.pause_s * 1e3:.1f} ms, "
                       f"{swap.chunks_changed} chunks changed, {_mib(swap.fetched_bytes)} fetched)")

    def ready(a: Agent) -> None:
        held = a.current()
        if engine is not None and held is not None:
            to_engine(held)  # the version the copy holds now; updates follow
        if a.metrics_port is not None:
            click.echo(f"metrics on http://{metrics_host or '0.0.0.0'}:{a.metrics_port}/metrics")
        if follow:
            click.echo(f"following {repo} into {out}; SIGTERM stops")
        sys.stdout.flush()

    agent = Agent(repo, out, config, trusted_keys=trusted_keys, on_update=report, on_ready=ready)

    def on_signal(signum: int, frame: object) -> None:
        agent.stop()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    before = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with retry_log.installed():
            version = agent.run(follow=follow)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if agent.stopping:
        if version is None:
            click.echo("stopped before any version was held; the next run resumes any update in progress")
        else:
            click.echo(f"stopped at version {version}; the next run resumes any update in progress")
    else:
        click.echo(f"{out} is at version {version}")


@cli.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def status(directory: Path | None, out: Path | None, as_json: bool) -> None:
    """Show a local copy's version, lag, agent, bytes fetched, apply time and last error (safe while an agent runs)."""
    from deltasync.local.agent import read_status

    directory = _local_dir(directory, out, "status")

    s = read_status(directory)
    if as_json:
        click.echo(json.dumps(s, sort_keys=True))
        return

    def ago(t: float | None) -> str:
        return "-" if t is None else f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({time.time() - t:.1f}s ago)"

    def opt(v: object) -> str:
        return "-" if v is None else str(v)

    lag = "-" if s["lag_versions"] is None else f"{s['lag_versions']} version(s)"
    if s["lag_seconds"] is not None:
        lag += f", {s['lag_seconds']:.1f}s"
    agent = f"running (pid {s.get('pid')}, {s.get('state')})" if s["running"] else "not running"
    rows = [
        ("directory", s["directory"]),
        ("repository", s["repo"] or "-"),
        ("version", f"{opt(s['version'])}, installed {ago(s['installed_unix'])}"),
        ("latest", f"{opt(s.get('latest_version'))}, first seen {ago(s.get('latest_seen_unix'))}"),
        ("pinned", opt(s.get("pinned_version"))),
        ("lag", lag),
        ("agent", agent),
        ("fetched", f"{_mib(int(s.get('bytes_fetched_total') or 0))} in total, {s.get('updates_total') or 0} update(s)"),
    ]
    last = s.get("last_update")
    if last:
        moved = (f"{last['previous']} -> {last['version']}" if last.get("previous") is not None
                 else f"to {last['version']} (none held before)")
        rows.append(("last update", f"{moved}: {last['how']}, "
                                    f"{_mib(int(last['fetched_bytes']))} fetched, applied in {last['seconds']:.2f}s"))
    wip = s.get("wip")
    if wip:
        done = f"{wip['chunks_done']}/{wip['chunks_total']} chunks"
        rows.append(("in progress", f"version {wip['target']} ({wip['phase']}, {done})"))
    if s.get("last_error"):
        rows.append(("last error", f"{ago(s.get('last_error_unix'))}: {s['last_error']}"))
    for name, value in rows:
        click.echo(f"{name:12} {value}")


@cli.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--repair", is_flag=True, help="Fetch only the drifted chunks (from the nearest snapshot) and fix them in place.")
@click.option("--repo", default=None, metavar="URL", callback=_repo_url,
              help=f"Repository: {REPO_FORMS} [default: the repository the copy was pulled from].")
@move_aside_option
@trusted_key_option
@workers_option
@json_option
def check(
    directory: Path | None, out: Path | None, repair: bool, repo: str | None, move_aside: bool,
    trusted_keys: tuple[Path, ...], workers: int, as_json: bool,
) -> None:
    """Compare a local copy with the manifest of its version, chunk by chunk, and list files in it that are not the
    version's (exit status 1 on drift or such files without --repair / --move-aside)."""
    from deltasync.local.check import check_copy

    directory = _local_dir(directory, out, "check")
    report = check_copy(directory, repo=repo, repair=repair, workers=workers, trusted_keys=trusted_keys,
                        move_aside=move_aside and repair)
    if as_json:  # exit status as without --json
        _emit_json({**_fields(report), "drifted": [str(d) for d in report.drifted], "ok": report.ok})
        if not report.ok:
            sys.exit(1)
        return
    for d in report.drifted:
        click.echo(f"drifted: {d}")
    for rel in report.foreign:
        click.echo(f"not the version's: {rel} (a loader may read it; check --repair --move-aside moves it aside)")
    if report.foreign and not report.drifted:
        sys.exit(1)
    summary = f"version {report.version}: {report.files} files, {report.chunks} chunks"
    if report.repaired:
        click.echo(f"{summary}: repaired {len(report.drifted)} ({_mib(report.fetched_bytes)} fetched)")
    elif report.drifted:
        click.echo(f"{summary}: {len(report.drifted)} drifted (run with --repair to fix)")
        sys.exit(1)
    else:
        click.echo(f"{summary}: ok")


@cli.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--to", "version", type=click.IntRange(min=1), required=True, metavar="N", help="Version to move to.")
@click.option("--repo", default=None, metavar="URL", callback=_repo_url,
              help=f"Repository: {REPO_FORMS} [default: the repository the copy was pulled from].")
@trusted_key_option
@workers_option
@quiet_option
@json_option
def rollback(directory: Path | None, out: Path | None, version: int, repo: str | None, trusted_keys: tuple[Path, ...],
             workers: int, quiet: bool, as_json: bool) -> None:
    """Move a local copy to an earlier version N, reversing the deltas in between where it can.

    Nothing is downloaded for deltas whose payloads the copy kept (see subscribe --keep-versions);
    what cannot be reversed comes from the snapshot plus chain.
    """
    from deltasync.local.agent import AgentConfig, rollback as rollback_copy

    directory = _local_dir(directory, out, "rollback")
    with _RetryLog(None, False).installed():
        u = rollback_copy(directory, version, repo=repo, config=AgentConfig(workers=workers, progress=_progress(quiet)),
                          trusted_keys=trusted_keys)
    if as_json:
        _emit_json({"directory": str(directory), "version": version, "moved": u is not None,
                    **({} if u is None else {"previous": u.previous, "how": u.how, "fetched_bytes": u.fetched_bytes,
                                             "seconds": round(u.seconds, 3)})})
    elif u is None:
        click.echo(f"{directory} is already at version {version}")
    else:
        was = f"from version {u.previous} " if u.previous is not None else "(it held no version) "
        click.echo(f"moved {directory} {was}to version {u.version} "
                   f"({u.how}, {_mib(u.fetched_bytes)} fetched, {u.seconds:.2f}s)")


@cli.command()
@repo_option
@click.argument("version", type=click.IntRange(min=1), required=False)
@click.option("--clear", is_flag=True, help="Remove the pin: subscribers follow the latest again.")
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Sign the pin (or its clearing) with this ed25519 key: subscribers with --trusted-key refuse "
                   "unsigned pins.")
@click.option("--ref-ttl", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="With --signing-key: how long the signed pin stays valid [default: 7 days].")
def pin(repo: str, version: int | None, clear: bool, signing_key: Path | None, ref_ttl: float | None) -> None:
    """Pin the version following subscribers serve, forward or back (e.g. after an evaluation gate fails); no VERSION: show it."""
    from deltasync import Repository
    from deltasync.repo.repository import DEFAULT_REF_TTL

    r = Repository(repo, signing_key=signing_key, ref_ttl=ref_ttl or DEFAULT_REF_TTL)
    r.ensure_exists()
    if clear and version is not None:
        raise UsageError("give a VERSION to pin or --clear, not both")
    if clear:
        r.pin(None)
        click.echo(f"pin cleared: subscribers follow the latest (version {r.latest()})")
    elif version is not None:
        r.pin(version)
        click.echo(f"pinned version {version}: following subscribers move to it")
    else:
        pinned = r.pinned()
        latest = r.latest()
        click.echo(f"pinned version {pinned}" if pinned is not None else f"not pinned: subscribers follow the latest ({latest})")


@cli.command("refresh-refs")
@repo_option
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), required=True, metavar="FILE",
              help="The publisher's ed25519 key (the one its versions are signed with).")
@click.option("--ref-ttl", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="How long the re-signed refs stay valid [default: 7 days].")
def refresh_refs(repo: str, signing_key: Path, ref_ttl: float | None) -> None:
    """Re-sign refs/latest and refs/pin with a new counter and expiry. Subscribers with --trusted-key refuse
    expired refs: a publisher with nothing new to publish runs this (cron) well within --ref-ttl."""
    from deltasync import Repository
    from deltasync.repo.repository import DEFAULT_REF_TTL

    r = Repository(repo, signing_key=signing_key, ref_ttl=ref_ttl or DEFAULT_REF_TTL)
    latest, pinned = r.refresh_refs()
    pin_text = f"pin: version {pinned}" if pinned is not None else "no pin"
    expires = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(time.time() + r.ref_ttl))
    click.echo(f"signed refs/latest (version {latest}) and {pin_text}, valid until {expires}")


@cli.command()
@click.option("--repo", default=None, metavar="URL", help="Only the cache of this repository.")
@click.option("--clear", is_flag=True, help="Remove the listed caches (the next publish to a repository without "
                                            "one pulls its latest version again, or starts a snapshot with --no-cache).")
@json_option
def cache(repo: str | None, clear: bool, as_json: bool) -> None:
    """List (or --clear) publish's local copies: one full copy of the latest version per repository published to.

    They live under $DELTASYNC_CACHE/publish, else ~/.cache/deltasync/publish; --cache DIR copies are not listed.
    """
    import shutil

    from deltasync.local.state import read_local_state

    root = _cache_base() / "publish"
    wanted = _default_cache(repo).name if repo is not None else None
    rows: list[dict[str, Any]] = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not d.is_dir() or (wanted is not None and d.name != wanted):
            continue
        owner = _cache_owner(d)
        try:
            url = str(json.loads(owner.read_text()).get("repo", ""))
        except (OSError, ValueError):
            url = ""
        try:
            held = read_local_state(d)
        except (DeltasyncError, OSError):
            held = None
        rows.append({"path": str(d), "repo": url or None, "version": held.version if held is not None else None,
                     "bytes": _tree_bytes(d)})
        if clear:
            shutil.rmtree(d)
            owner.unlink(missing_ok=True)
    if as_json:
        _emit_json({"root": str(root), "caches": rows, "cleared": clear})
        return
    if not rows:
        click.echo(f"no publish cache{' for ' + str(repo) if repo else ''} under {root}")
        return
    for row in rows:
        version = f"version {row['version']}" if row["version"] is not None else "no version"
        click.echo(f"{_mib(row['bytes']):>10}  {version:12}  {row['repo'] or '(repository not recorded)'}  {row['path']}")
    total = _mib(sum(row["bytes"] for row in rows))
    click.echo(f"removed {len(rows)} cache(s), {total}" if clear else f"{len(rows)} cache(s), {total} (--clear removes them)")


@cli.command()
@click.option("--dir", "workdir", type=click.Path(path_type=Path), default=Path("deltasync-demo"), show_default=True)
@click.option("--steps", type=click.IntRange(2, 50), default=5, show_default=True)
@quiet_option
def demo(workdir: Path, steps: int, quiet: bool) -> None:
    """Train a tiny transformer for a few steps, publish each checkpoint, pull and verify."""
    from deltasync.demo import run_demo

    run_demo(workdir, steps=steps, echo=click.echo, progress=_progress(quiet))


@cli.group()
def rl() -> None:
    """Reference asynchronous RL loop whose weights move only through deltasync."""


@rl.command("run")
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              metavar="FILE", help="Settings (TOML or JSON, sections as in deltasync.rl_integration.config).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="RL steps, one version each [default: 150].")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Rollout workers [default: 2].")
@click.option("--backend", type=click.Choice(["local", "ray"]), default=None,
              help="Workers as local processes, or as Ray actors (pip install 'deltasync[ray]') [default: local].")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Run directory: repository, checkpoints, metrics.jsonl, plot.png [default: deltasync-rl].")
@click.option("--repo", default=None, metavar="URL", help="Repository to publish to (empty) [default: OUT/repo].")
@click.option("--seed", type=int, default=None, help="[default: 0]")
@click.option("--live", is_flag=True, default=None,
              help="Train on feedback posted over HTTP (with simulated users unless the config turns them off).")
@click.option("--feedback-port", type=click.IntRange(0, 65535), default=None, help="Port of the feedback endpoint (--live).")
@click.option("--rollout", type=click.Choice(["exact", "kv_bf16", "vllm"]), default=None,
              help="How workers generate: the trainer's own arithmetic (gap 0), incremental bf16 KV-cache decoding, "
                   "or vLLM servers (scripts/install_vllm.sh) [default: exact].")
@click.option("--experts", type=click.IntRange(min=0), default=None,
              help="Mixture-of-experts policy with this many experts per layer (Mixtral-style, top-2) [default: 0, dense].")
@click.option("--router-replay/--no-router-replay", default=None,
              help="MoE: the trainer routes every token to the experts the worker reported [default: off].")
@click.option("--force", is_flag=True, help="Replace the outputs of a previous run in --out [default: refuse].")
@click.option("--no-warm-cache", is_flag=True,
              help="Always train the warm start [default: reuse the weights of an earlier run with the same model, "
                   "task, seed and warm-start settings, kept under $DELTASYNC_CACHE/rl-warm-start, else "
                   "~/.cache/deltasync/rl-warm-start].")
@quiet_option
def rl_run(config_file: Path | None, steps: int | None, workers: int | None, backend: str | None, out_dir: Path | None,
           repo: str | None, seed: int | None, live: bool | None, feedback_port: int | None, rollout: str | None,
           experts: int | None, router_replay: bool | None, force: bool, no_warm_cache: bool, quiet: bool) -> None:
    """Warm-start a small transformer on addition, then improve it with asynchronous RL.

    \b
    A progress line per step (every ~10% when not on a terminal), e.g.
      rl 12/150 v13  reward 0.412  eval 0.455 (warm 0.398)  stale 1:1 2:1  gap 0  1.2 KiB/v 52.3x  sync 35 ms
    reward: mean reward of the step's training batches; eval: held-out score of the version served
    (warm: after the warm start); stale K:N: N of the batches trained on were sampled from weights K
    updates old; gap: the largest log-prob difference between trainer and worker for the same tokens
    (0: workers served exactly the trainer's weights); then bytes stored per version and its ratio,
    and the time from publish to every worker serving it.
    """
    from deltasync.rl_integration import load_config, run

    config = load_config(
        config_file, steps=steps, seed=seed, repo=repo,
        out_dir=str(out_dir) if out_dir is not None else None,
        router_replay=router_replay,
        **{"workers.count": workers, "workers.backend": backend, "live.enabled": live, "live.port": feedback_port,
           "workers.inference": rollout, "model.num_local_experts": experts},
    )
    result = run(config, echo=click.echo, progress=False if quiet else None, force=force,
                 warm_start_cache=None if no_warm_cache else _cache_base() / "rl-warm-start")
    for line in result.lines():
        click.echo(line)


@rl.command("compare")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--label", "labels", multiple=True, help="A name per run, in order [default: the directory names].")
@click.option("--out", "out_path", type=click.Path(path_type=Path, dir_okay=False), default=Path("compare.png"),
              show_default=True, help="PNG to write.")
def rl_compare(runs: tuple[Path, ...], labels: tuple[str, ...], out_path: Path) -> None:
    """Plot several runs' reward curves, log-prob gaps and routing mismatch on one figure."""
    from deltasync.rl_integration.metrics import read_metrics
    from deltasync.rl_integration.plot import plot_compare

    if labels and len(labels) != len(runs):
        raise click.UsageError(f"{len(labels)} --label for {len(runs)} runs")
    names = list(labels) or [r.name for r in runs]
    plot_compare({n: read_metrics(r / "metrics.jsonl") for n, r in zip(names, runs, strict=True)}, out_path)
    click.echo(f"wrote {out_path}")


def _mib(n: int) -> str:
    from deltasync.progress import human_bytes

    return human_bytes(n)


def main(argv: list[str] | None = None) -> None:
    # gRPC's C core logs to stderr on its own (TLS handshake failures, connection resets):
    # the command's one-line errors say what matters. GRPC_VERBOSITY=INFO brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    logging.getLogger("deltasync").addHandler(_WARNINGS)
    try:
        rc = cli.main(args=argv, prog_name="deltasync", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("deltasync: aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        # One line, like every other error; the command's --help is named for the details.
        where = f" (see deltasync {e.ctx.command_path.split(' ', 1)[1]} --help)" if e.ctx and " " in e.ctx.command_path else ""
        click.echo(f"deltasync: error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DeltasyncError as e:
        click.echo(f"deltasync: error: {_ca_hint(str(e))}", err=True)
        sys.exit(e.exit_code)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        click.echo(f"deltasync: error: {e.strerror or e}{where}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("deltasync: interrupted", err=True)
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
