"""The publisher's commands: publish, squash, keygen, pin, refresh-refs, and cache (publish's local copies)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import click

from ..errors import DeltasyncError, UsageError
from ._common import (
    cache_base,
    emit_json,
    json_option,
    mib,
    quiet_option,
    ratio,
    repo_option,
    show_progress,
    workers_option,
)
from .fleet_cmds import fleet_url_of, version_digest_of, wait_for_fleet, wait_options


def _repo_key(repo: str) -> str:
    return repo if "://" in repo else os.path.abspath(repo)


def _default_cache(repo: str) -> Path:
    return cache_base() / "publish" / hashlib.sha256(_repo_key(repo).encode()).hexdigest()[:16]


def _shown_location(url: str) -> str:
    """A repository's location as a user reads it: a local one as an absolute path, with a
    hint when its name looks like a relay's HOST:PORT."""
    if "://" in url:
        return url
    where = os.path.abspath(url)
    host, colon, port = os.path.basename(url.rstrip("/")).rpartition(":")
    if colon and host and port.isdigit():
        return f"{where} (a local folder; a relay is grpc://{host}:{port})"
    return where


def _parse_meta(items: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--meta expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@click.command()
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
@wait_options
@workers_option
@quiet_option
@json_option
def publish(
    checkpoint: Path, repo: str, base_dir: Path | None, cache_dir: Path | None, no_cache: bool,
    version: int | None, snapshot_every: int, max_delta_fraction: float, chunk_mib: float,
    zstd_level: int, context_classes: int, meta: tuple[str, ...], signing_key: Path | None,
    squash_strides: tuple[int, ...], allow_empty: bool, follow_symlinks: bool, workers: int, quiet: bool,
    as_json: bool, wait: bool, quorum: float, wait_timeout: float, fleet_url: str | None,
) -> None:
    """Publish a checkpoint directory (safetensors, single or sharded) as a new version.

    Once the version is committed the command succeeds: a later problem (the publish cache
    cannot be refreshed, a squash cannot be written) is a warning on stderr."""
    from .. import PlanesZstdCodec, Publisher, PublisherConfig

    if checkpoint.is_file():
        # A version is a whole directory: one file of it would drop the config, tokenizer and
        # other shards the next `from_pretrained` needs.
        raise UsageError(f"{checkpoint} is a file, not a checkpoint directory: publish the directory that holds it "
                         f"({checkpoint.parent}), with its config, tokenizer and other shards")
    chunk_bytes = int(chunk_mib * (1 << 20)) // 8 * 8
    config = PublisherConfig(
        codec=PlanesZstdCodec(chunk_bytes=chunk_bytes, zstd_level=zstd_level, max_classes=context_classes),
        workers=workers, snapshot_every=snapshot_every, max_delta_fraction=max_delta_fraction,
        progress=show_progress(quiet), squash_strides=squash_strides, skip_unchanged=not allow_empty,
        follow_symlinks=follow_symlinks,
    )
    report_url = fleet_url_of(repo, fleet_url) if wait else None
    start = time.monotonic()
    pub = Publisher(repo, config, signing_key=signing_key)
    cache = None if no_cache or base_dir is not None else (cache_dir or _default_cache(repo))
    # First use: this default cache was never recorded (`deltasync cache --clear` forgets it).
    first_use = cache is not None and cache_dir is None and not _cache_owner(cache).exists()
    # A repository the publish creates is named: `--repo 127.0.0.1:17070` (grpc:// forgotten) is a
    # new folder of that name, not the relay.
    created = not pub.repo.exists() and not pub.repo.versions()
    r = pub.publish_dir(checkpoint, base_dir=base_dir, cache_dir=cache, version=version, metadata=_parse_meta(meta),
                        snapshots=no_cache)
    seconds = time.monotonic() - start  # all of it: the cache brought to the latest version included
    if cache is not None and cache_dir is None:
        try:
            _record_cache_owner(cache, repo)
        except OSError as e:  # committed already: a retry would publish it twice
            click.echo(f"deltasync: warning: cannot record the publish cache {cache} ({e.strerror or e})", err=True)
            first_use = False
    if as_json:
        emit_json({
            "version": r.version, "kind": r.kind, "parent": r.parent if r.kind == "delta" else None,
            "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
            "ratio": round(r.ratio, 2) if r.stored_bytes else None, "seconds": round(seconds, 3),
            "published": r.kind != "unchanged", "squashes": [dataclasses.asdict(sq) for sq in r.squashes],
            "warnings": list(r.warnings),
            **({"created_repository": _shown_location(pub.repo.store.url)} if created else {}),
        })
    elif r.kind == "unchanged":
        click.echo(f"nothing changed since version {r.version} (tensors, files and metadata are equal): "
                   f"no version published (--allow-empty publishes one)")
    else:
        # A snapshot depends on no other version: no parent is shown for it (log shows the same).
        parent = f" parent {r.parent}" if r.kind == "delta" and r.parent is not None else ""
        click.echo(
            f"published version {r.version} ({r.kind}{parent}): {mib(r.raw_bytes)} raw, "
            f"{mib(r.stored_bytes)} stored, {ratio(r.raw_bytes, r.stored_bytes)}, {seconds:.2f}s"
        )
        for sq in r.squashes:
            click.echo(sq.summary())
    if created and not as_json:
        click.echo(f"created a new repository at {_shown_location(pub.repo.store.url)}")
    if first_use and cache is not None:
        click.echo(
            f"note: publish keeps a local copy of the latest version of each repository it publishes to (up to twice "
            f"the checkpoint's size), to diff against without downloading: {cache} ({mib(_tree_bytes(cache))} now). "
            f"`deltasync cache` lists these copies, "
            f"`deltasync cache --clear` removes them; --base DIR or --no-cache keep none, --cache DIR or "
            f"$DELTASYNC_CACHE put them elsewhere.", err=as_json,
        )
    if report_url is not None:
        published = r.version
        wait_for_fleet(report_url, lambda: published, digest=version_digest_of(repo), quorum=quorum,
                       timeout=wait_timeout, what=f"version {published}")


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


@click.command()
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
    from .. import PublisherConfig
    from ..publish.squash import write_squash, write_squashes

    if strides and (a is not None or c is not None):
        raise UsageError("give either --from and --to, or --stride")
    config = PublisherConfig(workers=workers, progress=show_progress(quiet))
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


@click.command()
@click.option("--out", "prefix", required=True, metavar="PREFIX",
              help="Write PREFIX.key (private, mode 0600) and PREFIX.pub (public); never overwrites.")
def keygen(prefix: str) -> None:
    """Create an ed25519 key pair: publish --signing-key PREFIX.key, pull --trusted-key PREFIX.pub."""
    from ..format.signing import generate_keypair

    key, pub, kid = generate_keypair(prefix)
    click.echo(f"wrote {key} (private: keep it with the publisher) and {pub} (public: for subscribers), key id {kid.hex()}")


@click.command()
@repo_option
@click.argument("version", type=click.IntRange(min=1), required=False)
@click.option("--clear", is_flag=True, help="Remove the pin: subscribers follow the latest again.")
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE",
              help="Sign the pin (or its clearing) with this ed25519 key: subscribers with --trusted-key refuse "
                   "unsigned pins.")
@click.option("--ref-ttl", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="With --signing-key: how long the signed pin stays valid [default: 7 days].")
@wait_options
def pin(
    repo: str, version: int | None, clear: bool, signing_key: Path | None, ref_ttl: float | None, wait: bool,
    quorum: float, wait_timeout: float, fleet_url: str | None,
) -> None:
    """Pin the version following subscribers serve, forward or back (e.g. after an evaluation gate fails); no VERSION: show it.

    With --wait, the command returns once the reporting engines serve it (fleet-wide confirmation)."""
    from .. import Repository
    from ..repo.repository import DEFAULT_REF_TTL

    r = Repository(repo, signing_key=signing_key, ref_ttl=ref_ttl or DEFAULT_REF_TTL)
    r.ensure_exists()
    if clear and version is not None:
        raise UsageError("give a VERSION to pin or --clear, not both")
    if wait and not clear and version is None:
        raise UsageError("--wait waits for a pin or --clear to land: give a VERSION or --clear")
    report_url = fleet_url_of(repo, fleet_url) if wait else None
    if clear:
        r.pin(None)
        latest = r.latest()
        click.echo(f"pin cleared: subscribers follow the latest (version {latest})")
        if report_url is not None:
            wait_for_fleet(report_url, lambda: Repository(repo).latest(), digest=version_digest_of(repo),
                           quorum=quorum, timeout=wait_timeout, what="pin cleared")
    elif version is not None:
        r.pin(version)
        click.echo(f"pinned version {version}: following subscribers move to it")
        if report_url is not None:
            wait_for_fleet(report_url, lambda: version, digest=version_digest_of(repo), quorum=quorum,
                           timeout=wait_timeout, what=f"pin {version}")
    else:
        pinned = r.pinned()
        latest = r.latest()
        click.echo(f"pinned version {pinned}" if pinned is not None else f"not pinned: subscribers follow the latest ({latest})")


@click.command("refresh-refs")
@repo_option
@click.option("--signing-key", type=click.Path(path_type=Path, dir_okay=False), required=True, metavar="FILE",
              help="The publisher's ed25519 key (the one its versions are signed with).")
@click.option("--ref-ttl", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="How long the re-signed refs stay valid [default: 7 days].")
def refresh_refs(repo: str, signing_key: Path, ref_ttl: float | None) -> None:
    """Re-sign refs/latest and refs/pin with a new counter and expiry. Subscribers with --trusted-key refuse
    expired refs: a publisher with nothing new to publish runs this (cron) well within --ref-ttl."""
    from .. import Repository
    from ..repo.repository import DEFAULT_REF_TTL

    r = Repository(repo, signing_key=signing_key, ref_ttl=ref_ttl or DEFAULT_REF_TTL)
    latest, pinned = r.refresh_refs()
    pin_text = f"pin: version {pinned}" if pinned is not None else "no pin"
    expires = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(time.time() + r.ref_ttl))
    click.echo(f"signed refs/latest (version {latest}) and {pin_text}, valid until {expires}")


@click.command()
@click.option("--repo", default=None, metavar="URL", help="Only the cache of this repository.")
@click.option("--clear", is_flag=True, help="Remove the listed caches (the next publish to a repository without "
                                            "one pulls its latest version again, or starts a snapshot with --no-cache).")
@json_option
def cache(repo: str | None, clear: bool, as_json: bool) -> None:
    """List (or --clear) publish's local copies: one full copy of the latest version per repository published to.

    They live under $DELTASYNC_CACHE/publish, else ~/.cache/deltasync/publish; --cache DIR copies are not listed.
    """
    import shutil

    from ..local.state import read_local_state

    root = cache_base() / "publish"
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
        emit_json({"root": str(root), "caches": rows, "cleared": clear})
        return
    if not rows:
        click.echo(f"no publish cache{' for ' + str(repo) if repo else ''} under {root}")
        return
    for row in rows:
        version = f"version {row['version']}" if row["version"] is not None else "no version"
        click.echo(f"{mib(row['bytes']):>10}  {version:12}  {row['repo'] or '(repository not recorded)'}  {row['path']}")
    total = mib(sum(row["bytes"] for row in rows))
    click.echo(f"removed {len(rows)} cache(s), {total}" if clear else f"{len(rows)} cache(s), {total} (--clear removes them)")

