"""Peer identity: an Ed25519 key, its libp2p peer id, and signatures attributable to it.

The key is made on first use and stored as PKCS#8 PEM in `<data_dir>/identity.key` with mode
0600 (a more permissive file is refused, as ssh does). A lock file next to it stops a second
process from using the same identity at once: two processes announcing one peer id would make
each other's connections flap. The lock is released by `Identity.close()` or by process exit.

Peer ids follow libp2p: the identity multihash of the protobuf-encoded public key, base58btc
encoded (`12D3KooW...`). Because the id embeds the public key, `verify(peer_id, ...)` needs
no key registry. Signatures are domain-separated so a signature made for one purpose cannot be
replayed as another.

This module imports neither trio nor libp2p.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from pathlib import Path

import filelock
import platformdirs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from files.atomic import write_atomic
from p2p.errors import IdentityError, IdentityInUse

KEY_FILE = "identity.key"
LOCK_FILE = "identity.lock"
DATA_DIR_ENV = "FUSIONAI_DATA_DIR"

# protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}, wrapped in an identity multihash.
_PUBKEY_PROTO_PREFIX = b"\x08\x01\x12\x20"
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def default_data_dir() -> Path:
    """The data directory: `$FUSIONAI_DATA_DIR` if set, else the platform's user data dir."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("fusionai", appauthor=False))


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise ValueError(f"invalid base58 character {c!r}") from None
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def peer_id_from_public_key(raw_public_key: bytes) -> str:
    """The libp2p peer id (`12D3KooW...`) of a raw 32-byte Ed25519 public key."""
    if len(raw_public_key) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(raw_public_key)}")
    return _b58encode(_IDENTITY_MULTIHASH_PREFIX + _PUBKEY_PROTO_PREFIX + raw_public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key embedded in a peer id; ValueError if it embeds none."""
    raw = _b58decode(peer_id)
    prefix = _IDENTITY_MULTIHASH_PREFIX + _PUBKEY_PROTO_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise ValueError(f"{peer_id!r} is not an Ed25519 peer id")
    return raw[len(prefix) :]


def _signed_bytes(domain: str, data: bytes) -> bytes:
    if not domain or "\0" in domain:
        raise ValueError("a signature domain must be a non-empty string without NUL")
    return domain.encode() + b"\0" + data


@functools.lru_cache(maxsize=4096)
def _public_key(peer_id: str) -> Ed25519PublicKey:
    """`peer_id`'s key, kept: a chained step's route is verified at every hop, by the same
    few origins (a ValueError is not kept)."""
    return Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))


def verify(peer_id: str, data: bytes, signature: bytes, *, domain: str) -> bool:
    """True if `signature` is `peer_id`'s signature of `data` in `domain`; never raises."""
    try:
        key = _public_key(peer_id)
        key.verify(signature, _signed_bytes(domain, data))
    except (ValueError, InvalidSignature):
        return False
    return True


class Identity:
    """An Ed25519 key pair and its peer id.

    Use `Identity.load_or_create(data_dir)` for a persistent identity (holds a lock until
    `close()`), or `Identity.ephemeral()` for one kept in memory only.
    """

    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        *,
        key_path: Path | None = None,
        lock: filelock.BaseFileLock | None = None,
    ) -> None:
        self._key = private_key
        self._lock = lock
        self.key_path = key_path
        self.public_key = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def ephemeral(cls) -> Identity:
        """A fresh identity that is never written to disk."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: Path | str | None = None) -> Identity:
        """Load the identity in `data_dir` (default: `default_data_dir()`), making it if absent.

        Raises `IdentityInUse` if another process holds it, `IdentityError` if the key file is
        unreadable, corrupt or readable by other users.
        """
        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = filelock.FileLock(str(directory / LOCK_FILE), timeout=0, mode=0o600)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise IdentityInUse(
                f"another FusionAI process is using the identity in {directory}; stop it, or "
                f"give this one its own directory with --data-dir or ${DATA_DIR_ENV}"
            ) from None
        try:
            key = cls._load_or_make_key(directory / KEY_FILE)
        except BaseException:
            lock.release()
            raise
        return cls(key, key_path=directory / KEY_FILE, lock=lock)

    @staticmethod
    def _load_or_make_key(path: Path) -> Ed25519PrivateKey:
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            write_atomic(path, pem, mode=0o600)
            return key
        if sys.platform != "win32":
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise IdentityError(
                    f"{path} is readable by other users (mode {mode:04o}); "
                    f"run `chmod 600 {path}` and start again"
                )
        try:
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise IdentityError(
                f"cannot read the identity key {path}: {exc}; restore it from a backup, or "
                f"delete it to start with a new peer id"
            ) from exc
        if not isinstance(loaded, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(loaded).__name__}, not an Ed25519 key")
        return loaded

    def private_key_bytes(self) -> bytes:
        """The raw 32-byte private key (seed), for handing to the libp2p host."""
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes, *, domain: str) -> bytes:
        """Sign `data` for `domain` (for example `"fusionai/join/1"`)."""
        return self._key.sign(_signed_bytes(domain, data))

    def close(self) -> None:
        """Release the lock on the data directory (idempotent)."""
        if self._lock is not None and self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> Identity:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


def check_multiaddr(addr: str) -> str:
    """`addr` if it is a well-formed multiaddr (e.g. /ip4/1.2.3.4/tcp/4001), else ValueError."""
    import multiaddr

    try:
        multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise ValueError(f"{addr!r} is not a multiaddr like /ip4/1.2.3.4/tcp/4001: {exc}") from None
    return addr
