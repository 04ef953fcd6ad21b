"""Relays with TLS and a bearer token refuse clients without them."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import deltasync
from deltasync.errors import StoreError, UsageError
from deltasync.relay.server import RelayServer, build_server
from deltasync.storage._grpc import GrpcStore

TOKEN = "s3cret-token-for-tests"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "deltasync-test-relay")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "relay.pem", tmp / "relay.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RelayServer, Path, dict[str, torch.Tensor]]]:
    for var in ("DELTASYNC_RELAY_TOKEN", "DELTASYNC_RELAY_TOKEN_FILE", "DELTASYNC_RELAY_CA"):
        monkeypatch.delenv(var, raising=False)
    repo = tmp_path / "repo"
    state = {"w": torch.randn(64, 32), "b": torch.arange(10)}
    deltasync.Publisher(str(repo)).publish(state)
    cert, key = _self_signed(tmp_path)
    server = build_server(str(repo), "127.0.0.1:0", tls_cert=cert, tls_key=key, token=TOKEN).start()
    try:
        yield server, cert, state
    finally:
        server.stop()


def _url(server: RelayServer, scheme: str = "grpcs") -> str:
    return f"{scheme}://127.0.0.1:{server.port}?timeout=60"  # a deadline for a loaded machine; refusals come at once


def test_tls_and_token_admit_a_proper_client(secured: tuple[RelayServer, Path, dict[str, torch.Tensor]]) -> None:
    server, cert, state = secured
    store = GrpcStore(_url(server), token=TOKEN, ca_file=cert)
    got = deltasync.Subscriber(store).pull()
    for name, t in state.items():
        assert torch.equal(got[name], t)


def test_token_and_ca_from_the_environment(
    secured: tuple[RelayServer, Path, dict[str, torch.Tensor]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert, _ = secured
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("DELTASYNC_RELAY_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("DELTASYNC_RELAY_CA", str(cert))
    assert deltasync.Repository(_url(server)).latest() == 1


def test_missing_or_wrong_token_is_refused(secured: tuple[RelayServer, Path, dict[str, torch.Tensor]]) -> None:
    server, cert, _ = secured
    for token in (None, "wrong-token"):
        store = GrpcStore(_url(server), token=token, ca_file=cert)
        with pytest.raises(StoreError, match=r"refused.*bearer token"):
            store.get("deltasync.json")
        with pytest.raises(StoreError, match="refused"):
            list(store.list("manifests/"))


def test_plaintext_or_untrusted_clients_fail(secured: tuple[RelayServer, Path, dict[str, torch.Tensor]]) -> None:
    server, _, _ = secured
    with pytest.raises(StoreError):
        GrpcStore(_url(server, "grpc"), token=TOKEN).get("deltasync.json")  # no TLS against a TLS port
    with pytest.raises(StoreError):
        GrpcStore(_url(server), token=TOKEN).get("deltasync.json")  # TLS, but the self-signed CA is not trusted


def test_bad_server_options(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="both a certificate and its key"):
        build_server(str(tmp_path), "127.0.0.1:0", tls_cert=tmp_path / "x.pem")
    with pytest.raises(UsageError, match="token is empty"):
        build_server(str(tmp_path), "127.0.0.1:0", token="  ")
