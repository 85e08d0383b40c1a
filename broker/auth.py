"""API keys and their roles, artifact download tokens, and TLS certificates for the broker's
HTTP API.

With API keys set, every route but `/healthz`, the dashboard page and `/openapi.json` needs
`Authorization: Bearer KEY` or `X-API-Key: KEY`; others get 401. Adding or replacing a model
and uploading artifacts needs an admin key (`--admin-key`, or `admin` after a key in a keys
file); an ordinary key gets 403 there. Keys are compared by their SHA-256 in constant time.

Providers have no API key. Each assignment (sent to one provider over the authenticated p2p
channel) carries an artifact URL `.../v1/artifacts/SHA?peer=PEER&token=EXPIRY.MAC`, MAC an
HMAC-SHA256 of the artifact's hash, the provider's peer id and the expiry under a secret kept
in the broker's data directory: a URL names one artifact for one provider, and works while
that provider is a live member of the swarm and until it expires (`TOKEN_RATE`: long enough
for a slow download of the artifact; a download that outlives it fails and the stage is
placed again). HTTP cannot prove who asks: a leaked URL is good for that artifact, for that
time, while its provider is alive. The URLs are never logged (`files.private.redact`).
`HttpArtifacts` makes them once the broker's HTTP server listens.

`self_signed(dir, hosts)` makes (or reuses) an ECDSA certificate and key with `cryptography`;
its SHA-256 fingerprint goes to providers with each assignment, so they can pin it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from files.atomic import write_atomic


class KeyFileError(ValueError):
    """A keys file cannot be read; the message says where and why."""


def load_keys(path: Path) -> tuple[list[str], list[str]]:
    """(ordinary keys, admin keys) from a file: one key per line, the word `admin` after it
    for an admin key; anything after that is a comment, and so are lines starting with '#'.
    Keys are at least 16 characters."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read keys file {path}: {exc.strerror}") from None
    keys: list[str] = []
    admin: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        check_key(words[0], f"{path}:{n}")
        (admin if words[1:2] == ["admin"] else keys).append(words[0])
    if not keys and not admin:
        raise KeyFileError(f"keys file {path} holds no key")
    return keys, admin


def check_key(key: str, where: str = "--api-key") -> None:
    if len(key) < 16 or not key.isprintable():
        raise KeyFileError(f"{where}: an API key has at least 16 printable characters")


def new_key() -> str:
    return "fai-" + secrets.token_urlsafe(24)


class Keys:
    """The accepted API keys (none: the API is open) and, among them, the admin keys."""

    def __init__(self, keys: Iterable[str], admin: Iterable[str] = ()) -> None:
        self._admin = [_digest(k) for k in admin]
        self._digests = [_digest(k) for k in keys] + self._admin

    @property
    def required(self) -> bool:
        return bool(self._digests)

    @property
    def has_admin(self) -> bool:
        return bool(self._admin)

    def valid(self, key: str | None) -> bool:
        return key is not None and _among(self._digests, key)

    def admin(self, key: str | None) -> bool:
        """Whether `key` may add models and upload artifacts (any caller may on an open API)."""
        return not self.required or (key is not None and _among(self._admin, key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _among(digests: list[bytes], key: str) -> bool:
    digest = _digest(key)
    found = False
    for d in digests:  # compare with every key: the time does not tell which matched
        found |= hmac.compare_digest(d, digest)
    return found


TOKEN_RATE = 1e6  # an artifact link lives its base lifetime plus its size at this rate; B/s


class ArtifactTokens:
    """Tokens in artifact URLs: `EXPIRY.MAC`, EXPIRY in Unix seconds and MAC the hex
    HMAC-SHA256(secret, "SHA|PEER|EXPIRY"). `lifetime_s` is how long a token lives, plus a
    second per `TOKEN_RATE` bytes of its artifact; `clock` gives Unix seconds (tokens outlive
    a restart of the broker: its secret is kept)."""

    def __init__(
        self, data_dir: Path, lifetime_s: float = 900.0, clock: Callable[[], float] = time.time
    ) -> None:
        path = data_dir / "artifact-secret"
        try:
            secret = path.read_bytes()
        except FileNotFoundError:
            secret = b""
        if len(secret) != 32:
            secret = secrets.token_bytes(32)
            write_atomic(path, secret, mode=0o600)
        self._secret = secret
        self.lifetime_s = lifetime_s
        self._clock = clock

    def token(self, sha: str, peer: str, size: int = 0) -> str:
        """A token for `peer` to download `sha` (`size` bytes)."""
        expiry = math.ceil(self._clock() + self.lifetime_s + size / TOKEN_RATE)
        return f"{expiry}.{self._mac(sha, peer, expiry)}"

    def valid(self, sha: str, peer: str, token: str | None) -> bool:
        """Whether `token` was made for `peer` and `sha` by this broker, and is unexpired."""
        if token is None:
            return False
        stamp, _, mac = token.partition(".")
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
            return False
        given = mac.encode("utf-8", "surrogateescape")  # any bytes: compared, never decoded
        right = hmac.compare_digest(self._mac(sha, peer, int(stamp)).encode(), given)
        return right and int(stamp) >= self._clock()

    def _mac(self, sha: str, peer: str, expiry: int) -> str:
        signed = f"{sha}|{peer}|{expiry}".encode("utf-8", "surrogateescape")
        return hmac.new(self._secret, signed, "sha256").hexdigest()


def self_signed(directory: Path, hosts: Iterable[str]) -> tuple[Path, Path]:
    """A self-signed certificate and its key in `directory` (made once, then reused, both
    owner-only), valid for `hosts` (names or IP addresses) for 825 days."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o600)
    return cert_path, key_path


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the certificate (DER), in hex: what providers pin."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex()


class HttpArtifacts:
    """Where providers download artifacts (`serving.ArtifactLinks`): this broker's HTTP
    server, known once it listens (`serve`); assignments are sent only after that."""

    def __init__(self) -> None:
        self._base = ""
        self._tls = ""
        self._token: Callable[[str, str, int], str] | None = None

    def serve(
        self, base: str, tls_sha256: str, token: Callable[[str, str, int], str] | None
    ) -> None:
        self._base, self._tls, self._token = base, tls_sha256, token

    def url(self, sha: str, peer: str, size: int) -> str:
        url = f"{self._base}/v1/artifacts/{sha}"
        if self._token is None:
            return url
        return f"{url}?peer={peer}&token={self._token(sha, peer, size)}"

    def tls_sha256(self) -> str:
        return self._tls
