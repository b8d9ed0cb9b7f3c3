"""The signed, retained messages site daemons agree on a run with, without a server
(docs/design.md, "Site policy" and "The site daemon"): a proposal (``spec``), the sites'
``vote``, the ``commit`` and a ``cancel``; and what they tell each other beside (a series'
``data``, the swarm's ``trust``, each site's ``status`` of a run).

Each is retained by the broker on its own topic, ``p2pfl/<swarm>/sites/<kind>/<run_id>/
<site>``, where ``site`` is its signer: the proposer of a spec, the voter of a vote, the
committer of a commit, the canceller of a cancel. A site publishes only under its own name,
so its later message of a kind replaces its earlier one, and a daemon that starts late hears
every message still standing. An empty payload is how MQTT clears a retained message:
:func:`decode` returns ``None`` for it.

The payload is a msgpack map of at most :data:`MAX_SITE_MESSAGE_BYTES`::

    {"v": 1, "kind": str, "run_id": str, "site": str, "ts": float, "body": map,
     "sig": bin, "cert": bin}

``ts`` is the signer's clock (seconds since the epoch); ``body`` holds only maps with str
keys, lists, str, int, finite float, bool and None (what the ledger's JSON keeps). With the
site's identity (:class:`SiteIdentity`, from the swarm's ``p2pfl certs`` folder) ``sig`` is
its Ed25519 signature of the topic, a NUL byte and the canonical msgpack of ``[kind, run_id,
site, ts, body]`` (every map's keys sorted, at every depth: :func:`canonical_bytes`), and
``cert`` is its certificate, so a site needs no one's certificate but the CA's. The
signature covers the topic, so a message cannot be re-addressed to another run or claimed
by another site; it covers the values, not the payload's bytes, so a payload re-encoded
without changing a value still verifies.

:func:`decode` refuses a message with :class:`MessageRefused`, whose ``reason`` is one of
:data:`REFUSAL_REASONS` (a bounded set: a metric label); it raises nothing else on bad
bytes. A daemon with a :class:`SiteVerifier` (its site file names ``certs``) takes only
messages signed by the site their topic names, with a certificate of the swarm's CA that
its CRL does not revoke; one without a verifier reads every message unsigned
(``signed=False``), whatever it carries.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from p2pfl.config.schema import ID_PATTERN
from p2pfl.errors import P2PFLError
from p2pfl.security.certs import (
    CertError,
    SwarmCerts,
    load_certificate,
    load_private_key,
    revoked_serials,
    verify_member_certificate,
)
from p2pfl.wire.untrusted import CodecError, unpack_untrusted

__all__ = [
    "KINDS",
    "MAX_SITE_MESSAGE_BYTES",
    "REFUSAL_REASONS",
    "MessageRefused",
    "SiteIdentity",
    "SiteMessage",
    "SiteVerifier",
    "TRUST_RUN",
    "canonical_bytes",
    "decode",
    "encode",
    "parse_topic",
    "subscription",
    "topic",
]

KINDS = ("spec", "vote", "commit", "cancel", "data", "trust", "status")
"""data: a series' data report (on the series' id); trust: the swarm's CRL (on TRUST_RUN);
status: the signer's status of a run (:mod:`~p2pfl.sites.consent.site_status`)."""
TRUST_RUN = "0" * 16
"""The run slot of trust messages: they belong to the swarm, not to a run."""
MAX_SITE_MESSAGE_BYTES = 256 * 1024  # a run spec with its knobs is a few KiB
VERSION = 1
MAX_DEPTH = 32  # nesting of lists and maps in the signed fields, the body's included
REFUSAL_REASONS = (
    "oversize",  # over MAX_SITE_MESSAGE_BYTES, refused before decoding
    "malformed",  # not msgpack, or not the payload's schema
    "topic",  # not a site message topic of this swarm
    "mismatch",  # the payload's kind, run_id or site is not its topic's
    "unsigned",  # no signature where the federation signs
    "bad_certificate",  # not the CA's, expired, not a node's, or not the signing site's
    "revoked",  # the CA's, for the signing site, but in the swarm's CRL
    "forged",  # the certificate's key did not make the signature
)
_RUN_ID = re.compile(r"[0-9a-f]{16}")  # p2pfl.sites.consent.run_spec.run_id
_SIGNATURE_BYTES = 64  # Ed25519
_REQUIRED = frozenset({"v", "kind", "run_id", "site", "ts", "body"})
_OPTIONAL = frozenset({"sig", "cert"})


class MessageRefused(P2PFLError, ValueError):
    """A site message :func:`decode` refuses; ``reason`` is one of :data:`REFUSAL_REASONS`
    and the message says what was wrong, for the log."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REFUSAL_REASONS, reason
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True)
class SiteMessage:
    """One decoded site message: its ``kind``, ``run_id`` and signing ``site`` (its topic's,
    which the payload agrees with), its ``body``, the signer's clock ``ts``, and whether a
    verifier checked its signature (``signed``)."""

    kind: str
    run_id: str
    site: str
    body: dict[str, Any]
    ts: float
    signed: bool


# ----------------------------------------------------------------------------- topics


def _is_id(value: object) -> bool:
    # fullmatch: ID_PATTERN's ``$`` alone would let a trailing newline through
    return isinstance(value, str) and re.fullmatch(ID_PATTERN, value) is not None


def _is_run_id(value: object) -> bool:
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


def topic(swarm: str, kind: str, run_id: str, site: str) -> str:
    """The topic of ``site``'s ``kind`` message on ``run_id`` in ``swarm``; ``ValueError``
    when a part is not one (an unknown kind, a run_id not 16 lowercase hex digits, a swarm
    or site name that is no id)."""
    if not _is_id(swarm):
        raise ValueError(f"swarm {swarm!r} is not a name")
    if kind not in KINDS:
        raise ValueError(f"unknown site message kind {kind!r}; one of {', '.join(KINDS)}")
    if not _is_run_id(run_id):
        raise ValueError(f"run id {run_id!r} is not 16 lowercase hex digits")
    if not _is_id(site):
        raise ValueError(f"site {site!r} is not a name")
    return f"p2pfl/{swarm}/sites/{kind}/{run_id}/{site}"


def subscription(swarm: str) -> str:
    """The subscription that hears every site message of ``swarm``."""
    if not _is_id(swarm):
        raise ValueError(f"swarm {swarm!r} is not a name")
    return f"p2pfl/{swarm}/sites/#"


def parse_topic(swarm: str, topic: str) -> tuple[str, str, str] | None:
    """``(kind, run_id, site)`` of a site message topic of ``swarm``; ``None`` when it is
    not one (another swarm, an unknown kind, a malformed run_id or site, more or fewer
    levels)."""
    parts = topic.split("/")
    if len(parts) != 6 or parts[0] != "p2pfl" or parts[1] != swarm or parts[2] != "sites":
        return None
    kind, run_id, site = parts[3:]
    if kind not in KINDS or not _is_run_id(run_id) or not _is_id(site):
        return None
    return kind, run_id, site


# ----------------------------------------------------------------------------- canonical form


def _canonical(value: Any, depth: int) -> Any:
    """``value`` with every map's keys sorted; ``ValueError`` for what a body may not hold."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")  # JSON, the ledger's, has none
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):  # a tuple travels as a list
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"map key {bad[0]!r} is not a str")
        # msgpack writes a dict in insertion order: insert in sorted order
        return {k: _canonical(value[k], depth + 1) for k in sorted(value)}
    raise ValueError(f"a site message cannot hold a {type(value).__name__}")


def _pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:  # an int out of msgpack's range
        raise ValueError(f"cannot encode: {exc}") from None


def canonical_bytes(value: Any) -> bytes:
    """The canonical msgpack of ``value``: every map's keys sorted at every depth, so two
    mappings equal as values encode alike whatever their keys' order. ``value`` holds only
    maps with str keys, lists (or tuples), str, int, finite float, bool and None, at most
    :data:`MAX_DEPTH` deep; ``ValueError`` otherwise."""
    return _pack(_canonical(value, 1))


def _signed_bytes(
    topic: str, kind: str, run_id: str, site: str, ts: float, body: Mapping[str, Any]
) -> bytes:
    """What a signature covers: the topic, a NUL, the canonical fields."""
    return topic.encode() + b"\x00" + canonical_bytes([kind, run_id, site, ts, body])


# ----------------------------------------------------------------------------- identities


def _raw(key: ed25519.Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class SiteIdentity:
    """A site's signing key and its certificate (issued by the swarm CA, CN = ``site``).
    Build with :meth:`from_certs`."""

    def __init__(self, site: str, private_key: ed25519.Ed25519PrivateKey, certificate_pem: bytes):
        self.site = site
        self._key = private_key
        self.certificate_pem = certificate_pem
        self._not_after = x509.load_pem_x509_certificate(certificate_pem).not_valid_after_utc

    @classmethod
    def from_certs(cls, root: str | Path, site: str) -> SiteIdentity:
        """``site``'s identity from a ``p2pfl certs`` folder (``nodes/<site>.key`` and
        ``.crt``): the certificate must be the CA's, unrevoked, for ``site``, and the key
        its key; :class:`~p2pfl.security.certs.CertError` naming the file otherwise."""
        paths = SwarmCerts(Path(root))
        paths.require(paths.ca_cert, paths.node_cert(site), paths.node_key(site))
        ca = load_certificate(paths.ca_cert)
        pem = paths.node_cert(site).read_bytes()
        try:
            public = verify_member_certificate(pem, ca, site, revoked_serials(paths, ca))
        except CertError as exc:
            raise CertError(f"{paths.node_cert(site)}: {exc}") from None
        key = load_private_key(paths.node_key(site))
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise CertError(f"{paths.node_key(site)}: not an Ed25519 key")
        if _raw(key.public_key()) != _raw(public):
            raise CertError(f"{paths.node_key(site)}: does not match {paths.node_cert(site)}")
        return cls(site, key, pem)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def problem(self) -> str | None:
        """Why peers would refuse what this identity signs now (its certificate expired,
        for a daemon's readiness), or ``None``."""
        if datetime.now(timezone.utc) > self._not_after:
            return f"the certificate of {self.site} expired on {self._not_after:%Y-%m-%d}"
        return None


class SiteVerifier:
    """Checks a site message's signature by the certificate it carries, against the swarm
    CA and the serials its CRL revoked (:meth:`revoke` takes a newer CRL's). Build with
    :meth:`from_certs`.

    A certificate's key is kept once verified, per (site, SHA-256 of the PEM), for the
    ``cache_size`` certificates used last and until the certificate expires, so a daemon
    does not parse a certificate again for every message."""

    def __init__(
        self, ca: x509.Certificate, revoked: frozenset[int] = frozenset(), cache_size: int = 1024
    ):
        self.ca = ca
        self.revoked = revoked
        self.cache_size = cache_size
        # (site, digest) -> (key, expiry), least recently used first
        self._keys: OrderedDict[tuple[str, bytes], tuple[ed25519.Ed25519PublicKey, datetime]] = (
            OrderedDict()
        )

    @classmethod
    def from_certs(cls, root: str | Path) -> SiteVerifier:
        """The verifier of a ``p2pfl certs`` folder: its ``ca.crt`` and ``crl.pem`` (when
        any); :class:`~p2pfl.security.certs.CertError` naming a missing or bad file."""
        paths = SwarmCerts(Path(root))
        paths.require(paths.ca_cert)
        ca = load_certificate(paths.ca_cert)
        return cls(ca, revoked_serials(paths, ca))

    def revoke(self, serials: frozenset[int]) -> None:
        """Take ``serials`` as the revoked certificates from now on (a newer CRL): keys
        verified before are checked again."""
        self.revoked = frozenset(serials)
        self._keys.clear()

    def verify(self, site: str, data: bytes, sig: bytes, pem: bytes) -> str | None:
        """``None`` when ``pem`` is a certificate of the swarm CA for ``site`` (a node's,
        unrevoked, valid now) whose key made ``sig`` over ``data``; otherwise the refusal
        reason: ``bad_certificate``, ``revoked`` or ``forged``."""
        refused = self.check(site, data, sig, pem)
        return None if refused is None else refused[0]

    def check(self, site: str, data: bytes, sig: bytes, pem: bytes) -> tuple[str, str] | None:
        """As :meth:`verify`, with what was wrong, for the log: ``(reason, detail)``."""
        key = self._key(site, pem)
        if isinstance(key, tuple):
            return key
        try:
            key.verify(bytes(sig), bytes(data))
        except InvalidSignature:
            return "forged", f"the signature is not {site}'s"
        return None

    def _key(self, site: str, pem: bytes) -> ed25519.Ed25519PublicKey | tuple[str, str]:
        """The key of ``site``'s certificate ``pem``, from the cache or verified now; else
        ``(reason, detail)``."""
        if not isinstance(pem, (bytes, bytearray)):
            return "bad_certificate", "certificate missing"
        slot = (site, hashlib.sha256(pem).digest())
        cached = self._keys.get(slot)
        if cached is not None:
            key, expiry = cached
            if datetime.now(timezone.utc) <= expiry:
                self._keys.move_to_end(slot)
                return key
            del self._keys[slot]  # expired: verify_member_certificate says so below
        try:
            key = verify_member_certificate(bytes(pem), self.ca, site, self.revoked)
        except CertError as exc:
            if self.revoked and self._valid_but_revoked(site, pem):
                return "revoked", f"{site}'s certificate is in the swarm's CRL"
            return "bad_certificate", f"{site}'s certificate: {exc}"
        # parsed again on a miss only, for its expiry (verify_member_certificate checked it)
        expiry = x509.load_pem_x509_certificate(bytes(pem)).not_valid_after_utc
        self._keys[slot] = (key, expiry)
        while len(self._keys) > self.cache_size:
            self._keys.popitem(last=False)
        return key

    def _valid_but_revoked(self, site: str, pem: bytes) -> bool:
        """Whether ``pem`` passes every check but the CRL: ``revoked``, not a bad one."""
        try:
            verify_member_certificate(bytes(pem), self.ca, site)
        except CertError:
            return False
        return True


# ----------------------------------------------------------------------------- encode, decode


def encode(
    swarm: str,
    kind: str,
    run_id: str,
    site: str,
    body: Mapping[str, Any],
    identity: SiteIdentity | None,
    ts: float | None = None,
) -> tuple[str, bytes]:
    """``(topic, payload)`` of ``site``'s ``kind`` message on ``run_id``, signed with
    ``identity`` when given (None: unsigned), stamped ``ts`` (None: now). ``ValueError``
    when a topic part is not one, ``identity`` is another site's, ``body`` holds what a
    body may not (:func:`canonical_bytes`), ``ts`` is not finite, or the payload would be
    over :data:`MAX_SITE_MESSAGE_BYTES`."""
    where = topic(swarm, kind, run_id, site)
    if identity is not None and identity.site != site:
        raise ValueError(f"the identity of {identity.site!r} cannot sign for {site!r}")
    if not isinstance(body, Mapping):
        raise ValueError(f"a body is a map, not a {type(body).__name__}")
    stamp = time.time() if ts is None else float(ts)
    if not math.isfinite(stamp):
        raise ValueError(f"timestamp {stamp} is not finite")
    clean = _canonical(body, 2)  # the body sits one level into the signed list
    payload: dict[str, Any] = {
        "v": VERSION,
        "kind": kind,
        "run_id": run_id,
        "site": site,
        "ts": stamp,
        "body": clean,
    }
    if identity is not None:
        payload["sig"] = identity.sign(_signed_bytes(where, kind, run_id, site, stamp, clean))
        payload["cert"] = identity.certificate_pem
    data = _pack(payload)
    if len(data) > MAX_SITE_MESSAGE_BYTES:
        raise ValueError(
            f"{kind} of run {run_id}: {len(data)} bytes, over the limit of {MAX_SITE_MESSAGE_BYTES}"
        )
    return where, data


def _unpack(data: bytes) -> Any:
    """One msgpack value of untrusted bytes (:func:`~p2pfl.wire.untrusted.unpack_untrusted`,
    the node's decoder too); :class:`MessageRefused` (``malformed``) otherwise."""
    try:
        return unpack_untrusted(data, MAX_SITE_MESSAGE_BYTES)
    except CodecError as exc:
        raise MessageRefused("malformed", f"not msgpack: {exc}") from None


def _check_body(value: Any, depth: int) -> None:
    """Refuse in a decoded body what :func:`canonical_bytes` would not encode, so the
    signature is checked over exactly what the signer could have signed."""
    if depth > MAX_DEPTH:
        raise MessageRefused("malformed", f"body nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise MessageRefused("malformed", f"body map key {k!r} is not a str")
            _check_body(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_body(v, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise MessageRefused("malformed", f"body holds {value}")
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise MessageRefused("malformed", f"body holds a {type(value).__name__}")


def _fields(obj: Any) -> tuple[str, str, str, float, dict[str, Any], Any, Any]:
    """``(kind, run_id, site, ts, body, sig, cert)`` of a decoded payload, its schema
    checked; :class:`MessageRefused` (``malformed``) otherwise."""
    if not isinstance(obj, dict):
        raise MessageRefused("malformed", f"the payload is a {type(obj).__name__}, not a map")
    keys = set(obj)
    if not _REQUIRED <= keys <= _REQUIRED | _OPTIONAL:
        missing = sorted(_REQUIRED - keys)
        extra = sorted(map(repr, keys - _REQUIRED - _OPTIONAL))
        raise MessageRefused("malformed", f"fields missing {missing} / unexpected {extra}")
    v = obj["v"]
    if isinstance(v, bool) or v != VERSION:
        raise MessageRefused("malformed", f"unsupported version {v!r}")
    for name in ("kind", "run_id", "site"):
        if not isinstance(obj[name], str):
            raise MessageRefused("malformed", f"{name} is not a str")
    ts = obj["ts"]
    if not isinstance(ts, float) or not math.isfinite(ts):
        raise MessageRefused("malformed", f"ts {ts!r} is not a finite float")
    body = obj["body"]
    if not isinstance(body, dict):
        raise MessageRefused("malformed", "body is not a map")
    _check_body(body, 2)
    sig, cert = obj.get("sig"), obj.get("cert")
    if (sig is None) != (cert is None):  # a signature is checked by the certificate with it
        raise MessageRefused("malformed", "a signature without its certificate, or the reverse")
    if sig is not None and (not isinstance(sig, bytes) or len(sig) != _SIGNATURE_BYTES):
        raise MessageRefused("malformed", f"sig is not {_SIGNATURE_BYTES} bytes")
    if cert is not None and not isinstance(cert, bytes):
        raise MessageRefused("malformed", "cert is not bytes")
    return obj["kind"], obj["run_id"], obj["site"], ts, body, sig, cert


def decode(
    swarm: str, topic: str, payload: bytes, verifier: SiteVerifier | None
) -> SiteMessage | None:
    """The site message ``payload`` on ``topic`` of ``swarm``, or ``None`` when the payload
    is empty (its retained message was cleared).

    Checked in this order, each refused with :class:`MessageRefused`: its size
    (``oversize``, before decoding), its topic (``topic``), msgpack and the payload's
    schema (``malformed``), the payload's kind, run_id and site against the topic's
    (``mismatch``); then, with a ``verifier``, its signature: none (``unsigned``), a
    certificate not the CA's for this site (``bad_certificate``) or revoked (``revoked``),
    a signature its key did not make (``forged``); else ``signed=True``. Without a
    verifier the signature is not read, and the message is ``signed=False``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MessageRefused("malformed", f"payload is a {type(payload).__name__}, not bytes")
    data = bytes(payload)
    if len(data) > MAX_SITE_MESSAGE_BYTES:
        raise MessageRefused(
            "oversize", f"{len(data)} bytes, over the limit of {MAX_SITE_MESSAGE_BYTES}"
        )
    parsed = parse_topic(swarm, topic)
    if parsed is None:
        raise MessageRefused("topic", f"not a site message topic of swarm {swarm!r}")
    if not data:
        return None
    kind, run_id, site, ts, body, sig, cert = _fields(_unpack(data))
    if (kind, run_id, site) != parsed:
        raise MessageRefused(
            "mismatch", f"the payload is {kind}/{run_id}/{site}, its topic {'/'.join(parsed)}"
        )
    if verifier is None:
        return SiteMessage(kind, run_id, site, body, ts, signed=False)
    if sig is None:
        raise MessageRefused("unsigned", f"{kind} of {run_id} by {site} is not signed")
    refused = verifier.check(site, _signed_bytes(topic, kind, run_id, site, ts, body), sig, cert)
    if refused is not None:
        raise MessageRefused(*refused)
    return SiteMessage(kind, run_id, site, body, ts, signed=True)
