"""The cryptographic primitives of secure aggregation, all from ``cryptography``.

- **Key agreement**: X25519. Each member has two fresh key pairs per round context: ``c``
  (encrypting shares to their recipient) and ``s`` (pairwise masks; its private key is
  Shamir-shared so a dropped member's masks can be recomputed).
- **KDF**: HKDF-SHA256, 32 bytes, no salt, with ``info`` = the round context and the use
  (:meth:`RoundContext.info`): :func:`agree` turns an X25519 shared secret into a key,
  :func:`derive` a secret seed into a mask key.
- **AEAD**: AES-256-GCM, a random 96-bit nonce prepended to the ciphertext
  (:func:`seal`, :func:`open_sealed`); the associated data names context, sender and
  recipient, so the aggregator cannot replay a bundle to another member or attempt.
- **PRG**: :func:`expand` is the ChaCha20 keystream (RFC 8439, 256-bit key, zero nonce and
  counter) read as little-endian ``uint64``. ChaCha20 is a cryptographic PRG (numpy's
  PCG64/Philox are not: their outputs reveal their state), its output is fixed by the RFC,
  and ``<u8`` fixes the byte order, so every machine expands a seed to the same vector.
  A zero nonce is safe because every key is used for one stream only: each key is derived
  by HKDF for one (context, use, members).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2pfl.privacy.secagg.errors import SecAggError

KEY_BYTES = 32
SEED_BYTES = 16  # a self-mask seed b_u: 128 bits, X25519's security level, one Shamir block
NONCE_BYTES = 12
RandomBytes = Callable[[int], bytes]


def private_key(random_bytes: RandomBytes) -> X25519PrivateKey:
    """A fresh X25519 private key from 32 bytes of ``random_bytes``."""
    return X25519PrivateKey.from_private_bytes(random_bytes(KEY_BYTES))


def private_bytes(key: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of an X25519 private key (what Shamir shares)."""
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def load_private(raw: bytes) -> X25519PrivateKey:
    """An X25519 private key from its 32 raw bytes."""
    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of the public key of ``key``."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_public(raw: bytes, what: str) -> X25519PublicKey:
    """An X25519 public key from 32 raw bytes; :class:`SecAggError` naming ``what``."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise SecAggError(f"{what}: an X25519 public key is {KEY_BYTES} bytes")
    return X25519PublicKey.from_public_bytes(raw)


def derive(secret: bytes, info: bytes) -> bytes:
    """``HKDF-SHA256(secret, salt=None, info, 32 bytes)``."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def agree(mine: X25519PrivateKey, theirs: bytes, info: bytes, what: str) -> bytes:
    """``derive(X25519(mine, theirs), info)``; :class:`SecAggError` naming ``what`` for a
    malformed or low-order public key (an all-zero shared secret)."""
    try:
        shared = mine.exchange(load_public(theirs, what))
    except ValueError as exc:
        raise SecAggError(f"{what}: key agreement failed ({exc})") from exc
    return derive(shared, info)


def seal(key: bytes, plaintext: bytes, aad: bytes, random_bytes: RandomBytes) -> bytes:
    """``nonce ‖ AES-256-GCM(key, nonce, plaintext, aad)`` with a random 12-byte nonce."""
    nonce = random_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes, what: str) -> bytes:
    """The plaintext of :func:`seal`'s output; :class:`SecAggError` naming ``what`` when it
    fails authentication (wrong key, sender, recipient, context, or altered bytes)."""
    if not isinstance(sealed, bytes) or len(sealed) < NONCE_BYTES + 16:
        raise SecAggError(f"{what}: malformed encrypted bundle")
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except InvalidTag as exc:
        raise SecAggError(f"{what}: the encrypted bundle fails authentication") from exc


def expand(seed: bytes, length: int) -> np.ndarray:
    """``length`` uint64 of the ChaCha20 keystream under key ``seed`` (32 bytes), zero
    nonce and counter, read little-endian: a mask vector, the same on every machine."""
    if len(seed) != KEY_BYTES:
        raise SecAggError(f"prg: the seed must be {KEY_BYTES} bytes")
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)
