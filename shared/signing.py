"""Upload signatures: the second layer of participant identity, which also holds where IAM does not.

EventBridge's S3 events name only the account as requester, so the ingest function cannot tell from
the event who uploaded an object. Each participant therefore signs what it uploads with an Ed25519
key whose public half it registered in its join request; ingest refuses unsigned or mis-signed
objects. The signature covers the object's key and the SHA-256 of its bytes, so it cannot be moved
to another key or another body. It travels as S3 user metadata (`x-amz-meta-fed-signature`).
"""

from __future__ import annotations

import base64
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.digest import digest

SIGNATURE_METADATA = "fed-signature"


class SignatureError(ValueError):
    pass


def _message(key: str, content_digest: str) -> bytes:
    """What is signed: the key and the content digest (shared.digest), so a file can be signed and checked
    while it streams, without holding it."""
    return f"fed-upload:v2\n{key}\n{content_digest}".encode()


class Signer:
    """A participant's signing key, kept in its state directory (created on first use, mode 600)."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> Signer:
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise SignatureError(f"{path} does not hold an Ed25519 key")
            return cls(key)
        signer = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = signer._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.touch(mode=0o600)
        path.write_bytes(pem)
        return signer

    @property
    def public_key(self) -> str:
        raw = self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()

    def sign(self, key: str, content_digest: str) -> str:
        return base64.b64encode(self._private.sign(_message(key, content_digest))).decode()

    def metadata(self, key: str, data: bytes) -> dict[str, str]:
        """S3 user metadata carrying the signature of `data` at `key`."""
        return self.metadata_for_digest(key, digest(data))

    def metadata_for_digest(self, key: str, content_digest: str) -> dict[str, str]:
        """The same for a file whose digest was computed as it was written or read (`shared.digest`)."""
        return {SIGNATURE_METADATA: self.sign(key, content_digest)}


def parse_public_key(text: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError):
        raise SignatureError("public_key is not a base64 Ed25519 public key") from None


def verify(public_key: str, key: str, data: bytes, metadata: dict[str, str]) -> None:
    """Raise SignatureError unless `metadata` carries a valid signature of `data` at `key`."""
    verify_digest(public_key, key, digest(data), metadata)


def verify_digest(public_key: str, key: str, content_digest: str, metadata: dict[str, str]) -> None:
    """The same check for an object whose digest was computed as it streamed."""
    signature = metadata.get(SIGNATURE_METADATA)
    if not signature:
        raise SignatureError("unsigned upload")
    try:
        parse_public_key(public_key).verify(base64.b64decode(signature, validate=True), _message(key, content_digest))
    except (InvalidSignature, ValueError):
        raise SignatureError("signature does not match the participant's registered key") from None
