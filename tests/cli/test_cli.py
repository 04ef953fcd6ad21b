"""The ``deltasync`` command line, end to end in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint, write_safetensors

from deltasync import Repository

SUBCOMMANDS = ["publish", "log", "pull", "verify", "inspect", "demo"]


def all_subcommands(help_text: str) -> list[str]:
    """Every subcommand ``deltasync --help`` lists (commands added later get checked too)."""
    listed = help_text.split("Commands:", 1)[1].splitlines()
    names = {line.split()[0] for line in listed if line.startswith("  ") and line.strip()}
    return sorted(names | set(SUBCOMMANDS))


@dataclass
class Result:
    rc: int
    out: str
    err: str


@dataclass
class Env:
    tmp: Path
    env: dict[str, str]

    def run(self, *args: str | Path, ok: bool = True) -> Result:
        p = subprocess.run(
            [sys.executable, "-m", "deltasync.cli.main", *map(str, args)],
            capture_output=True, text=True, cwd=self.tmp, env=self.env, timeout=120,
        )
        r = Result(p.returncode, p.stdout, p.stderr)
        if ok:
            assert r.rc == 0, f"{args}: rc {r.rc}\n{r.out}\n{r.err}"
            assert r.err == "", f"{args}: unexpected stderr {r.err!r}"  # no progress when not a terminal
        return r

    def fails(self, *args: str | Path, match: str) -> Result:
        """A user error: exactly one line on stderr, no traceback, non-zero exit."""
        r = self.run(*args, ok=False)
        assert r.rc != 0, f"{args} succeeded:\n{r.out}"
        assert "Traceback" not in r.err, r.err
        lines = r.err.splitlines()
        assert len(lines) == 1, r.err
        assert lines[0].startswith("deltasync: error: "), lines[0]
        assert match in lines[0], lines[0]
        return r


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Env]:
    env = dict(os.environ)
    env["DELTASYNC_CACHE"] = str(tmp_path / "default-cache")  # never the user's ~/.cache
    env.pop("DELTASYNC_TEST_S3_URL", None)
    yield Env(tmp_path, env)


@pytest.fixture
def steps(tmp_path: Path) -> list[Path]:
    """Three sharded checkpoints of one run, ~1% of elements changing per step."""
    state = make_state(0)
    out: list[Path] = []
    for step in range(1, 4):
        if step > 1:
            state = step_state(state, seed=step)
        out.append(write_checkpoint(tmp_path / f"step-{step}", state, shards=2, step=step,
                                    metadata={"step": str(step)}))
    return out


def publish_all(cli: Env, steps: list[Path], repo: str = "repo") -> None:
    for ckpt in steps:
        cli.run("publish", ckpt, "--repo", repo, "--chunk-mib", "0.0625")


# -- the happy path -------------------------------------------------------------------------------


def test_publish_log_pull_verify_inspect(cli: Env, steps: list[Path]) -> None:
    r = cli.run("publish", steps[0], "--repo", "repo", "--chunk-mib", "0.0625", "--meta", "run=abc",
                "--meta", "step=1")
    assert r.out.startswith("published version 1 (snapshot):"), r.out
    r = cli.run("publish", steps[1], "--repo", "repo", "--chunk-mib", "0.0625")  # default cache → delta
    assert r.out.startswith("published version 2 (delta parent 1):"), r.out
    r = cli.run("publish", steps[2], "--repo", "repo", "--base", steps[1], "--quiet")
    assert r.out.startswith("published version 3 (delta parent 2):"), r.out

    r = cli.run("log", "--repo", "repo")
    lines = r.out.splitlines()
    assert lines[0].split()[:6] == ["version", "kind", "parent", "raw", "stored", "ratio"]
    rows = [line.split() for line in lines[1:]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert [row[1] for row in rows] == ["snapshot", "delta", "delta"]
    assert [row[2] for row in rows] == ["-", "1", "2"]
    assert all(row[7].endswith("x") for row in rows)  # ratio column: "<raw> KiB <stored> KiB <r>x"

    r = cli.run("log", "--repo", "repo", "--json")
    entries = [json.loads(line) for line in r.out.splitlines()]
    assert [e["version"] for e in entries] == [1, 2, 3]
    assert [e["kind"] for e in entries] == ["snapshot", "delta", "delta"]
    assert [e["parent"] for e in entries] == [None, 1, 2]
    repo = Repository(str(cli.tmp / "repo"))
    for e in entries:
        m = repo.manifest(e["version"]).pb
        assert e["raw_bytes"] == m.raw_bytes and e["stored_bytes"] == m.stored_bytes
        assert e["ratio"] == pytest.approx(m.raw_bytes / m.stored_bytes, abs=0.01)
        assert set(e) >= {"version", "kind", "parent", "raw_bytes", "stored_bytes", "ratio", "time"}
    assert entries[1]["ratio"] > 10 * entries[0]["ratio"]  # a 1% step is far smaller than a snapshot

    r = cli.run("pull", "--repo", "repo", "--out", "serving")
    assert r.out.startswith("pulled version 3 into serving (pull from a snapshot"), r.out
    assert tree_digests(cli.tmp / "serving") == tree_digests(steps[2])
    r = cli.run("pull", "--repo", "repo", "--out", "serving", "--version", "1", "--workers", "2")
    assert r.out.startswith("pulled version 1 into serving"), r.out
    assert tree_digests(cli.tmp / "serving") == tree_digests(steps[0])
    r = cli.run("pull", "--repo", "repo", "--out", "serving", "--version", "2", "-q")
    assert "(local: " in r.out and "chunks updated in place" in r.out, r.out  # only the delta, applied in place
    assert tree_digests(cli.tmp / "serving") == tree_digests(steps[1])

    r = cli.run("verify", "--repo", "repo")
    assert r.out.strip().endswith(": ok") and "verified 3 version(s)" in r.out, r.out
    r = cli.run("verify", "--repo", "repo", "--version", "2", "--quiet")
    assert "verified 1 version(s)" in r.out, r.out

    r = cli.run("inspect", "--repo", "repo")
    assert r.out.startswith("version 3: delta, parent 2, nearest snapshot 1"), r.out
    assert "file model-00001-of-00002.safetensors (safetensors" in r.out
    assert "file config.json (blob, 1 part(s)" in r.out
    assert "model.embed_tokens.weight" in r.out
    r = cli.run("inspect", "--repo", "repo", "--version", "1")
    assert r.out.startswith("version 1: snapshot\n"), r.out
    assert "metadata run=abc, step=1" in r.out


def test_no_cache_and_explicit_cache(cli: Env, steps: list[Path]) -> None:
    cli.run("publish", steps[0], "--repo", "repo", "--no-cache")
    r = cli.run("publish", steps[1], "--repo", "repo", "--no-cache")
    assert "(snapshot" in r.out  # without a base every version is self-contained
    r = cli.run("publish", steps[2], "--repo", "repo", "--cache", "mycache")  # filled from the repository
    assert "(delta parent 2)" in r.out
    assert tree_digests(cli.tmp / "mycache") == tree_digests(steps[2])
    assert not (cli.tmp / "default-cache").exists()


def test_console_script(cli: Env, steps: list[Path]) -> None:
    exe = shutil.which("deltasync")
    if exe is None:
        pytest.skip("the deltasync console script is not installed")
    p = subprocess.run([exe, "--version"], capture_output=True, text=True, env=cli.env, timeout=60)
    assert p.returncode == 0 and "0.1.0" in p.stdout
    publish_all(cli, steps[:1])
    p = subprocess.run([exe, "log", "--repo", "repo", "--json"], capture_output=True, text=True,
                       cwd=cli.tmp, env=cli.env, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)["version"] == 1


def test_help(cli: Env) -> None:
    r = cli.run("--help")
    assert "Usage: deltasync" in r.out
    for sub in SUBCOMMANDS:
        assert sub in r.out
    for sub in all_subcommands(r.out):
        r = cli.run(sub, "--help")
        assert r.out.startswith(f"Usage: deltasync {sub}"), r.out
        r = cli.run(sub, "-h")
        assert r.out.startswith(f"Usage: deltasync {sub}"), r.out


# -- user errors ----------------------------------------------------------------------------------


def test_checkpoint_errors(cli: Env, steps: list[Path]) -> None:
    cli.fails("publish", "nothere", "--repo", "repo", match="nothere: no such checkpoint directory")
    (cli.tmp / "plain").mkdir()
    (cli.tmp / "plain" / "config.json").write_text("{}")
    cli.fails("publish", "plain", "--repo", "repo", match="no .safetensors files")
    cli.fails("publish", "plain/config.json", "--repo", "repo", match="not a checkpoint directory")
    bad = cli.tmp / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"{garbage")
    cli.fails("publish", "bad", "--repo", "repo", match="bad/model.safetensors: corrupt safetensors header")
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    cli.fails("publish", "bad", "--repo", "repo", match="bad/model.safetensors: corrupt safetensors header")
    (steps[0] / "model-00002-of-00002.safetensors").unlink()
    cli.fails("publish", steps[0], "--repo", "repo", match="missing shard(s): model-00002-of-00002.safetensors")
    assert not (cli.tmp / "repo").exists()


def test_repository_and_version_errors(cli: Env, steps: list[Path]) -> None:
    (cli.tmp / "empty").mkdir()
    for args in (["log"], ["pull", "--out", "o"], ["verify"], ["inspect"]):
        cli.fails(*args, "--repo", "empty", match="repository not found: empty")
        cli.fails(*args, "--repo", "missing", match="repository not found: missing")
    assert not (cli.tmp / "missing").exists()  # reading never creates a repository
    Repository(str(cli.tmp / "fresh")).create()
    cli.fails("pull", "--repo", "fresh", "--out", "o", match="has no committed versions yet")

    publish_all(cli, steps[:2])
    cli.fails("pull", "--repo", "repo", "--out", "o", "--version", "9", match="version 9 not found")
    cli.fails("verify", "--repo", "repo", "--version", "9", match="version 9 not found")
    cli.fails("inspect", "--repo", "repo", "--version", "9", match="version 9 not found")
    cli.fails("publish", steps[2], "--repo", "repo", "--version", "2", match="not newer than the latest version 2")
    cli.fails("publish", steps[2], "--repo", "repo", "--meta", "novalue", match="--meta expects KEY=VALUE")
    cli.fails("publish", steps[2], "--repo", "repo", "--meta", "=x", match="--meta expects KEY=VALUE")
    assert Repository(str(cli.tmp / "repo")).versions() == [1, 2]


def test_checksum_mismatch(cli: Env, tmp_path: Path) -> None:
    # Random bytes do not compress, so zstd stores them verbatim: a flipped byte decodes
    # cleanly to wrong bits, which only the digest catches.
    rng = np.random.default_rng(0)
    ckpt = tmp_path / "ckpt"
    write_safetensors(ckpt / "model.safetensors",
                      {"noise": torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8))})
    cli.run("publish", ckpt, "--repo", "repo")
    cli.run("pull", "--repo", "repo", "--out", "serving")
    before = tree_digests(tmp_path / "serving")  # the state directory keeps a failed pull's work
    pack = next((tmp_path / "repo" / "packs").iterdir())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.write_bytes(bytes(data))
    cli.fails("verify", "--repo", "repo", match="checksum mismatch in version 1, tensor 'noise', chunk 0")
    cli.fails("pull", "--repo", "repo", "--out", "fresh", match="checksum mismatch in version 1, tensor 'noise'")
    # Bytes written through the served link: the pull re-hashes the touched file, and its
    # repair meets the corrupt pack; nothing else in the directory changes.
    with open(tmp_path / "serving" / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    r = cli.run("pull", "--repo", "repo", "--out", "serving", ok=False)
    lines = r.err.splitlines()
    assert r.rc != 0 and "Traceback" not in r.err and len(lines) == 2, r.err
    assert "written since they were verified" in lines[0], r.err
    assert lines[1].startswith("deltasync: error: checksum mismatch in version 1"), r.err
    after = tree_digests(tmp_path / "serving")
    assert {k: v for k, v in after.items() if k != "model.safetensors"} == {
        k: v for k, v in before.items() if k != "model.safetensors"}
    assert after["model.safetensors"] != before["model.safetensors"]


def test_usage_errors_are_one_line(cli: Env) -> None:
    r = cli.run("pull", "--out", "o", ok=False)
    assert r.rc == 2 and "Missing option '--repo'" in r.err and "Traceback" not in r.err
    assert r.err.strip().count("\n") == 0 and r.err.startswith("deltasync: error: ") and "deltasync pull --help" in r.err
    r = cli.run("frobnicate", ok=False)
    assert r.rc == 2 and "No such command" in r.err and r.err.strip().count("\n") == 0


def test_repository_urls_that_cannot_work_are_refused(cli: Env, tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", make_state(seed=1))
    r = cli.run("publish", str(tmp_path / "ckpt"), "--repo", "memory://scratch", ok=False)
    assert r.rc == 2 and "vanish when the command exits" in r.err
    r = cli.run("publish", str(tmp_path / "ckpt"), "--repo", "file://repo", ok=False)
    assert r.rc != 0 and "names the host 'repo'" in r.err and "file:///abs/path" in r.err
    r = cli.run("publish", str(tmp_path / "ckpt"), "--repo", f"file://{tmp_path / 'repo'}")
    assert "published version 1" in r.out


def test_keygen_creates_the_key_directory(cli: Env, tmp_path: Path) -> None:
    r = cli.run("keygen", "--out", str(tmp_path / "keys" / "deep" / "publisher"))
    assert (tmp_path / "keys" / "deep" / "publisher.key").exists() and "wrote" in r.out
    assert (tmp_path / "keys" / "deep").stat().st_mode & 0o777 == 0o700


# -- progress -------------------------------------------------------------------------------------


def _run_on_terminal(cli: Env, *args: str | Path) -> tuple[int, str]:
    """Run with stderr on a pseudo-terminal (stdout captured); returns (rc, terminal output)."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "deltasync.cli.main", *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=slave, cwd=cli.tmp, env=cli.env,
        )
        os.close(slave)
        chunks: list[bytes] = []
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            if not ready:
                break
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = p.wait(timeout=60)
    finally:
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def test_progress_only_on_a_terminal(cli: Env, steps: list[Path]) -> None:
    rc, term = _run_on_terminal(cli, "publish", steps[0], "--repo", "repo")
    assert rc == 0 and "publish v1:" in term and "100.0%" in term, term
    rc, term = _run_on_terminal(cli, "publish", steps[1], "--repo", "repo", "--quiet")
    assert rc == 0 and term == "", term
    rc, term = _run_on_terminal(cli, "pull", "--repo", "repo", "--out", "serving")
    assert rc == 0 and "pull v2:" in term, term
    # And not on pipes (Env.run asserts an empty stderr on success).
    cli.run("publish", steps[2], "--repo", "repo")
    cli.run("pull", "--repo", "repo", "--out", "serving")
    cli.run("verify", "--repo", "repo")


def test_publishing_an_unchanged_checkpoint_publishes_nothing(cli: Env, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, make_state(seed=3))
    repo = str(tmp_path / "repo")
    cli.run("publish", str(ckpt), "--repo", repo)
    r = cli.run("publish", str(ckpt), "--repo", repo)
    assert "nothing changed since version 1" in r.out
    assert Repository(repo).latest() == 1
    r = cli.run("publish", str(ckpt), "--repo", repo, "--meta", "step=2")  # new metadata: a new version
    assert "published version 2" in r.out
    r = cli.run("publish", str(ckpt), "--repo", repo, "--meta", "step=2", "--allow-empty")
    assert "published version 3" in r.out
    rows = cli.run("log", "--repo", repo).out.splitlines()
    assert rows[0].split()[-1] == "meta" and rows[2].endswith("step=2") and rows[3].endswith("step=2")
    assert json.loads(cli.run("log", "--repo", repo, "--json").out.splitlines()[1])["metadata"] == {"step": "2"}


# -- issue 14: newcomer frictions ---------------------------------------------------------------


def _console_script() -> str:
    exe = shutil.which("deltasync")
    if exe is None:
        pytest.skip("the deltasync console script is not installed")
    return exe


def test_engine_factory_is_imported_from_the_current_directory(cli: Env, steps: list[Path]) -> None:
    """`deltasync subscribe --engine torch:MODULE:FACTORY` finds MODULE where `python -m deltasync` does."""
    exe = _console_script()
    publish_all(cli, steps[:1])
    (cli.tmp / "myfactory.py").write_text(
        "import glob\n"
        "from safetensors.torch import load_file\n\n"
        "def make():\n"
        "    out = {}\n"
        f"    for f in sorted(glob.glob({str(steps[0] / '*.safetensors')!r})):\n"
        "        out.update(load_file(f))\n"
        "    return {k: v.clone() for k, v in out.items()}\n"
    )
    p = subprocess.run([exe, "subscribe", "serving", "--repo", "repo", "--engine", "torch:myfactory:make"],
                       capture_output=True, text=True, cwd=cli.tmp, env=cli.env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "engine serves version 1" in p.stdout, p.stdout
    help_text = " ".join(cli.run("subscribe", "--help").out.split())
    assert "current directory" in help_text and "returns the torch.nn.Module" in help_text


def test_publish_cache_is_announced_timed_and_can_be_cleared(cli: Env, steps: list[Path]) -> None:
    r = cli.run("publish", steps[0], "--repo", "repo")
    cache_root = cli.tmp / "default-cache" / "publish"
    assert "note: publish keeps a local copy of the latest version" in r.out and str(cache_root) in r.out, r.out
    assert "deltasync cache --clear" in r.out
    r = cli.run("publish", steps[1], "--repo", "repo")
    assert "note:" not in r.out  # said once, at first use
    # The cache is gone: the next publish first brings a fresh one to the latest version, and
    # the time it prints covers that too (it is the whole command's).
    shutil.rmtree(next(d for d in cache_root.iterdir() if d.is_dir()))
    r = cli.run("publish", steps[2], "--repo", "repo", "--json")
    entry = json.loads(r.out)
    assert entry["version"] == 3 and entry["kind"] == "delta" and entry["parent"] == 2 and entry["seconds"] > 0

    listed = cli.run("cache").out
    assert str(cli.tmp / "repo") in listed and "version 3" in listed and "1 cache(s)" in listed, listed
    entries = json.loads(cli.run("cache", "--json").out)["caches"]
    assert [(e["repo"], e["version"]) for e in entries] == [(str(cli.tmp / "repo"), 3)] and entries[0]["bytes"] > 0
    assert "no publish cache" in cli.run("cache", "--repo", "elsewhere").out
    r = cli.run("cache", "--clear")
    assert "removed 1 cache(s)" in r.out
    assert not [d for d in cache_root.iterdir() if d.is_dir()]
    assert "no publish cache" in cli.run("cache").out


REPO_FORMS = ("a path", "file:///abs/path", "s3://bucket/prefix", "grpc://host:port", "grpcs://host:port")


def test_repo_help_names_every_url_form(cli: Env) -> None:
    for sub in ("publish", "log", "pull", "verify", "inspect", "squash", "gc", "serve", "subscribe", "check",
                "rollback", "pin"):
        text = " ".join(cli.run(sub, "--help").out.split())
        for form in REPO_FORMS:
            assert form in text, (sub, form, text)
        assert "memory://" not in text, sub


def test_gc_names_the_versions_kept_only_as_a_chain(cli: Env, steps: list[Path]) -> None:
    publish_all(cli, steps)
    r = cli.run("gc", "--repo", "repo", "--keep-last", "1", "--dry-run")
    assert r.out.startswith("gc (dry run): kept 3 version(s)") and r.out.count("\n") == 1, r.out  # one line
    assert "; 3 kept by --keep-last/--keep-every/the pin, 1-2 only as the delta chain" in r.out, r.out
    assert r.out.rstrip().endswith("back to their snapshot (snapshot 1)"), r.out
    report = json.loads(cli.run("gc", "--repo", "repo", "--keep-last", "1", "--dry-run", "--json").out)
    assert report["kept_by_policy"] == [3] and report["kept_as_chain"] == [1, 2] and report["versions_deleted"] == []


def test_messages_newcomers_tripped_on(cli: Env, steps: list[Path]) -> None:
    # A snapshot has no parent, in publish and in log; both print the same ratio.
    out = [cli.run("publish", ckpt, "--repo", "repo", "--snapshot-every", "2").out for ckpt in steps]
    assert out[2].startswith("published version 3 (snapshot):"), out[2]
    rows = [line.split() for line in cli.run("log", "--repo", "repo").out.splitlines()[1:]]
    assert [row[2] for row in rows] == ["-", "1", "-"]
    assert [row[7] for row in rows] == [o.split(" stored, ")[1].split(",")[0] for o in out]
    entries = [json.loads(line) for line in cli.run("log", "--repo", "repo", "--json").out.splitlines()]
    assert [(e["parent"], e["previous"]) for e in entries] == [(None, None), (1, 1), (None, 2)]
    assert cli.run("inspect", "--repo", "repo").out.startswith("version 3: snapshot (published after version 2)\n")

    # Moving a directory that held nothing: no "from version None".
    r = cli.run("rollback", "fresh", "--to", "2", "--repo", "repo")
    assert "None" not in r.out and "to version 2" in r.out, r.out
    status = cli.run("status", "fresh").out
    assert "to 2 (none held before)" in status and "None" not in status, status

    # A failed subscribe: one warning per retried attempt, the error once.
    r = cli.run("subscribe", "s", "--repo", "grpc://127.0.0.1:1?timeout=2", "--retries", "2", ok=False)
    lines = r.err.splitlines()
    assert r.rc == 1 and len(lines) == 2 and "Traceback" not in r.err, r.err
    assert lines[0].startswith("deltasync: warning: update failed (attempt 1 of 2; retrying): "), lines[0]
    assert lines[1].startswith("deltasync: error: "), lines[1]
    cli.fails("subscribe", "s", "--repo", "missing", match="repository not found: missing")  # not retried


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "relay.pem", tmp / "relay.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_a_self_signed_relay_names_its_fix_in_one_line(cli: Env, steps: list[Path]) -> None:
    from deltasync.relay.server import build_server

    publish_all(cli, steps[:1])
    cert, key = _self_signed(cli.tmp)
    cli.env.pop("DELTASYNC_RELAY_CA", None)
    cli.env.pop("GRPC_VERBOSITY", None)
    server = build_server(str(cli.tmp / "repo"), "127.0.0.1:0", tls_cert=cert, tls_key=key).start()
    try:
        url = f"grpcs://127.0.0.1:{server.port}?timeout=60"
        r = cli.fails("pull", "o", "--repo", url, match="CERTIFICATE_VERIFY_FAILED")  # gRPC's own log lines: none
        assert "set DELTASYNC_RELAY_CA=" in r.err, r.err
        cli.env["DELTASYNC_RELAY_CA"] = str(cert)
        assert "pulled version 1" in cli.run("pull", "o", "--repo", url).out
    finally:
        server.stop()


def test_log_with_a_trusted_key_marks_unsigned_versions(cli: Env, steps: list[Path]) -> None:
    cli.run("keygen", "--out", "keys/pub")
    cli.run("keygen", "--out", "keys/other")
    cli.run("publish", steps[0], "--repo", "repo")
    cli.run("publish", steps[1], "--repo", "repo", "--signing-key", "keys/pub.key")  # a signed chain starts
    cli.run("publish", steps[2], "--repo", "repo", "--signing-key", "keys/other.key")  # the wrong key
    state = step_state(make_state(0), seed=7)
    write_checkpoint(cli.tmp / "step-4", state, shards=2)
    cli.run("publish", "step-4", "--repo", "repo", "--signing-key", "keys/pub.key")
    r = cli.run("log", "--repo", "repo", "--trusted-key", "keys/pub.pub")  # lists every version all the same
    lines = r.out.splitlines()
    assert "signature" in lines[0] and len(lines) == 6, r.out
    assert "unsigned manifest" in lines[1] and "trusted " in lines[2] and "signed by unknown key" in lines[3], r.out
    assert "trusted; chain untrusted" in lines[4], r.out
    assert "note: pull --trusted-key refuses version(s) 1, 3-4" in lines[5], r.out
    entries = [json.loads(line) for line in cli.run("log", "--repo", "repo", "--trusted-key", "keys/pub.pub",
                                                    "--json").out.splitlines()]
    assert [e["pull_accepts"] for e in entries] == [False, True, False, False]
    assert [e["signature"] for e in entries][:2] == ["unsigned manifest", "trusted"]
    # The library's warnings are one `deltasync: warning:` line each, like its errors.
    state = make_state(seed=9)
    write_checkpoint(cli.tmp / "unsigned", state)
    r = cli.run("publish", "unsigned", "--repo", "repo", ok=False)
    assert r.rc == 0 and "published version 5" in r.out, r.err
    assert r.err.startswith("deltasync: warning: publishing an unsigned version after signed ones"), r.err
    assert r.err.count("\n") == 1, r.err


def test_inspect_says_what_it_leaves_out_and_speaks_json(cli: Env, steps: list[Path]) -> None:
    publish_all(cli, steps[:2])
    r = cli.run("inspect", "--repo", "repo", "--top", "3")
    tensor_lines = [line for line in r.out.splitlines() if line.startswith("  ") and "more tensor" not in line]
    assert len(tensor_lines) == 3 and "... 7 more tensor(s)" in r.out, r.out
    r = cli.run("inspect", "--repo", "repo", "--top", "0")
    assert "more tensor" not in r.out and len([x for x in r.out.splitlines() if x.startswith("  ")]) == 10
    d = json.loads(cli.run("inspect", "--repo", "repo", "--json").out)
    assert d["version"] == 2 and d["kind"] == "delta" and d["parent"] == 1 and len(d["tensors"]) == 10
    assert {"name", "dtype", "shape", "stored_bytes", "encodings"} <= set(d["tensors"][0])
    assert any(f["path"] == "config.json" and f["kind"] == "blob" for f in d["files"])


def test_json_for_scripts_and_the_directory_either_way(cli: Env, steps: list[Path]) -> None:
    r = cli.run("publish", steps[0], "--repo", "repo", "--json", ok=False)
    assert r.rc == 0 and r.err.startswith("note: publish keeps a local copy"), r.err  # stdout stays JSON
    pub = json.loads(r.out)
    assert pub["version"] == 1 and pub["kind"] == "snapshot" and pub["published"] is True
    assert json.loads(cli.run("publish", steps[0], "--repo", "repo", "--json").out)["published"] is False
    cli.run("publish", steps[1], "--repo", "repo")

    pulled = json.loads(cli.run("pull", "a", "--repo", "repo", "--json").out)  # DIR as an argument
    assert pulled["version"] == 2 and pulled["directory"] == "a" and pulled["fetched_bytes"] > 0
    cli.run("pull", "--repo", "repo", "--out", "b", "--version", "1")  # or as --out
    cli.run("pull", "b", "--repo", "repo", "--out", "b")  # both, the same
    cli.fails("pull", "a", "--repo", "repo", "--out", "b", match="two directories given")
    cli.fails("pull", "--repo", "repo", match="give the local directory: deltasync pull DIR (or --out DIR)")
    assert tree_digests(cli.tmp / "a") == tree_digests(cli.tmp / "b") == tree_digests(steps[1])

    v = json.loads(cli.run("verify", "--repo", "repo", "--json").out)
    assert v["ok"] is True and v["versions"] == [1, 2]
    g = json.loads(cli.run("gc", "--repo", "repo", "--keep-last", "5", "--json").out)
    assert g["versions_kept"] == [1, 2] and g["versions_deleted"] == []
    for how in (["a"], ["--out", "a"]):
        c = json.loads(cli.run("check", *how, "--json").out)
        assert c["ok"] is True and c["version"] == 2
        assert json.loads(cli.run("status", *how, "--json").out)["version"] == 2
    rb = json.loads(cli.run("rollback", "--out", "a", "--to", "1", "--json").out)
    assert rb["moved"] is True and rb["previous"] == 2 and rb["version"] == 1
    assert json.loads(cli.run("rollback", "a", "--to", "1", "--json").out)["moved"] is False
    r = cli.run("subscribe", "--out", "c", "--repo", "repo")
    assert "c is at version 2" in r.out
    with open(cli.tmp / "a" / "model-00001-of-00002.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    r = cli.run("check", "a", "--json", ok=False)
    assert r.rc == 1 and json.loads(r.out)["ok"] is False and json.loads(r.out)["drifted"]
    for sub in ("status", "check", "rollback"):
        cli.fails(sub, *(["--to", "1"] if sub == "rollback" else []), match=f"deltasync {sub} DIR (or --out DIR)")
