"""API keys, artifact download tokens, and TLS certificates for the broker's HTTP API.

With API keys set, every route but `/healthz`, the dashboard page and `/openapi.json` needs
`Authorization: Bearer KEY` (or `X-API-Key: KEY`); others get 401. Keys are compared by their
SHA-256 in constant time. Providers have no API key: their assignments (sent over the
authenticated p2p channel) carry artifact URLs with a token, an HMAC of the artifact's hash
under a secret kept in the broker's data directory, so a URL works only for what it names.

`self_signed(dir, hosts)` makes (or reuses) an ECDSA certificate and key with `cryptography`;
its SHA-256 fingerprint goes to providers with each assignment, so they can pin it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Iterable
from pathlib import Path

from files.atomic import write_atomic


class KeyFileError(ValueError):
    """A keys file cannot be read; the message says where and why."""


def load_keys(path: Path) -> list[str]:
    """API keys from a file: one per line (anything after the key is a comment, and so are
    lines starting with '#'). Keys are at least 16 characters."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read keys file {path}: {exc.strerror}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key = line.split()[0]
        check_key(key, f"{path}:{n}")
        keys.append(key)
    if not keys:
        raise KeyFileError(f"keys file {path} holds no key")
    return keys


def check_key(key: str, where: str = "--api-key") -> None:
    if len(key) < 16 or not key.isprintable():
        raise KeyFileError(f"{where}: an API key has at least 16 printable characters")


def new_key() -> str:
    return "fai-" + secrets.token_urlsafe(24)


class Keys:
    """The accepted API keys (none: the API is open)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def valid(self, key: str | None) -> bool:
        if key is None:
            return False
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = False
        for d in self._digests:  # compare with every key: the time does not tell which matched
            found |= hmac.compare_digest(d, digest)
        return found


class ArtifactTokens:
    """Tokens in artifact URLs: HMAC-SHA256(secret, sha256) in hex."""

    def __init__(self, data_dir: Path) -> None:
        path = data_dir / "artifact-secret"
        try:
            secret = path.read_bytes()
        except FileNotFoundError:
            secret = b""
        if len(secret) != 32:
            secret = secrets.token_bytes(32)
            write_atomic(path, secret, mode=0o600)
        self._secret = secret

    def token(self, sha: str) -> str:
        return hmac.new(self._secret, sha.encode("utf-8", "surrogateescape"), "sha256").hexdigest()

    def valid(self, sha: str, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode("utf-8", "surrogateescape")  # any bytes: compared, never decoded
        return hmac.compare_digest(self.token(sha).encode(), given)


def self_signed(directory: Path, hosts: Iterable[str]) -> tuple[Path, Path]:
    """A self-signed certificate and its key in `directory` (made once, then reused), valid
    for `hosts` (names or IP addresses) for 825 days."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusionai broker")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(key_path, pem, mode=0o600)
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the certificate (DER), in hex: what providers pin."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex()
