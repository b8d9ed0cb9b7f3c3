"""Per-message Ed25519 signatures and replay protection for one node (docs/wire.md,
"Signatures" and "Replay protection").

With ``security.sign`` every envelope a node publishes is signed with its Ed25519 key (the
key of its certificate, :mod:`p2pfl.security.certs`). The signature covers the MQTT topic and the
envelope header — swarm, sender, round, attempt, kind, message id, timestamp and body — so
a message cannot be altered, re-addressed to another inbox, or claimed by another sender.
A transfer chunk's raw bytes are not signed one by one: they are covered by the digest in
the transfer's signed metadata, which the receiver checks before using any tensor.

Peers' public keys come from their certificates, verified against the swarm CA
(:func:`p2pfl.security.certs.verify_member_certificate`): those found in the certificate directory
at start, and those carried in peers' signed presence messages. Only topology members are
accepted.

Certificates in the swarm's CRL (``crl.pem`` in the certificate directory, made by
``p2pfl certs --revoke``) are refused.

Replay protection (:class:`ReplayGuard`): every non-presence message carries a timestamp and
a random id; one older than ``max_age_s`` (or than the oldest id still remembered) is
``stale``, a repeated id is ``replayed``. Presence messages are retained by the broker and
may be hours old, so they are ordered instead: ``(session start, sequence)`` must grow per
sender (the Last Will holds the largest sequence of its session), within bounds of time
(:mod:`p2pfl.security.presence_order`): a session more than ``max_age_s`` in the future is
refused, and a sender whose clock went back is followed.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID

from p2pfl.security.certs import (
    CertError,
    SwarmCerts,
    common_name,
    load_certificate,
    load_private_key,
    revoked_serials,
    verify_member_certificate,
)
from p2pfl.security.presence_order import REWIND_SLACK_S, parse_order, presence_verdict

log = logging.getLogger(__name__)

WILL_SEQUENCE = 1 << 30  # the Last Will's presence sequence: after every update of a session


CRL_CHECK_S = 2.0
"""How often a running node looks for a newer CRL in its certificate folder."""


def _file_mark(path: Path) -> tuple[int, ...]:
    try:
        st = path.stat()
    except OSError:
        return ()
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _signed_bytes(topic: str, header: bytes | memoryview) -> bytes:
    """What a signature covers: the MQTT topic, a NUL, and the envelope header."""
    return topic.encode() + b"\x00" + bytes(header)


class ReplayGuard:
    """Accepts a message id once, and only while its timestamp is fresh.

    ``check(mid, ts)`` returns ``None`` (accept) or a drop reason: ``stale`` when ``ts`` is
    more than ``max_age_s`` in the past or future, or not newer than the oldest id already
    forgotten (the low-water mark: a forgotten id can never be replayed); ``replayed`` when
    the id was seen. At most ``capacity`` ids are remembered."""

    def __init__(self, max_age_s: float = 300.0, capacity: int = 200_000):
        self.max_age_s = max_age_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()  # in arrival order
        self.low_water = 0.0

    def check(self, mid: str, ts: float, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        if abs(now - ts) > self.max_age_s or ts <= self.low_water:
            return "stale"
        if mid in self._seen:
            return "replayed"
        self._seen[mid] = ts
        horizon = now - self.max_age_s
        while self._seen:
            oldest_id, oldest_ts = next(iter(self._seen.items()))
            if len(self._seen) <= self.capacity and oldest_ts >= horizon:
                break
            del self._seen[oldest_id]
            if len(self._seen) >= self.capacity:  # evicted while still fresh
                self.low_water = max(self.low_water, oldest_ts)
        return None


class MessageSecurity:
    """One node's signing key, the swarm's keyring, and its replay state.

    Build with :meth:`from_certs`. ``members`` limits whose keys are accepted."""

    def __init__(
        self,
        node_id: str,
        private_key: ed25519.Ed25519PrivateKey,
        certificate_pem: bytes,
        ca: x509.Certificate,
        members: set[str],
        max_age_s: float = 300.0,
        revoked: frozenset[int] = frozenset(),
    ):
        self.node_id = node_id
        self.revoked = revoked  # certificate serials in the swarm's CRL
        self._key = private_key
        self.certificate_pem = certificate_pem
        self.ca = ca
        self.members = set(members)
        self.keys: dict[str, ed25519.Ed25519PublicKey] = {node_id: private_key.public_key()}
        self.replay = ReplayGuard(max_age_s)
        self._presence_order: dict[str, tuple[float, int]] = {}
        self.session = time.time()
        self._presence_seq = 0
        self.crl_path: Path | None = None  # watched for a newer CRL (from_certs sets it)
        self._crl_mark: tuple[int, ...] = ()
        self._crl_checked = time.monotonic()
        self._serials: dict[str, int] = {}  # node id → the serial of the certificate learned

    @classmethod
    def from_certs(
        cls, root: str | Path, node_id: str, members: list[str], max_age_s: float = 300.0
    ) -> MessageSecurity:
        """Load ``node_id``'s identity from a ``p2pfl certs`` directory, plus every member
        certificate found there; raise :class:`CertError` naming a missing or bad file."""
        paths = SwarmCerts(Path(root))
        paths.require(paths.ca_cert, paths.node_cert(node_id), paths.node_key(node_id))
        ca = load_certificate(paths.ca_cert)
        revoked = revoked_serials(paths, ca)
        key = load_private_key(paths.node_key(node_id))
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise CertError(f"{paths.node_key(node_id)}: not an Ed25519 key")
        pem = paths.node_cert(node_id).read_bytes()
        try:
            own = verify_member_certificate(pem, ca, node_id, revoked)
        except CertError as exc:
            raise CertError(f"{paths.node_cert(node_id)}: {exc}") from None
        raw = serialization.PublicFormat.Raw
        if own.public_bytes(serialization.Encoding.Raw, raw) != key.public_key().public_bytes(
            serialization.Encoding.Raw, raw
        ):
            raise CertError(f"{paths.node_key(node_id)}: does not match {node_id}.crt")
        sec = cls(node_id, key, pem, ca, set(members), max_age_s, revoked)
        sec.crl_path = paths.crl
        sec._crl_mark = _file_mark(paths.crl)
        for other in members:
            path = paths.node_cert(other)
            if other != node_id and path.is_file():
                reason = sec.learn(other, path.read_bytes())
                if reason:
                    log.warning("%s: ignored %s: %s", node_id, path, reason)
        return sec

    # ------------------------------------------------------------------ keys
    def learn(self, node_id: str, pem: bytes) -> str | None:
        """Add ``node_id``'s key from its certificate; returns a reason when refused."""
        if node_id not in self.members:
            return f"{node_id!r} is not a member of the swarm"
        try:
            key = verify_member_certificate(pem, self.ca, node_id, self.revoked)
        except CertError as exc:
            return str(exc)
        self.keys[node_id] = key
        self._serials[node_id] = x509.load_pem_x509_certificate(pem).serial_number
        return None

    def refresh_revocations(self, now: float | None = None) -> bool:
        """Take a newer CRL written to the certificate folder while the node runs (a site
        daemon keeps the one its peers spread there): the keys of revoked certificates are
        forgotten, so their holders' messages are refused from then on. Looks at the file
        at most every :data:`CRL_CHECK_S`; True when the revocations changed."""
        now = time.monotonic() if now is None else now
        if self.crl_path is None or now - self._crl_checked < CRL_CHECK_S:
            return False
        self._crl_checked = now
        mark = _file_mark(self.crl_path)
        if mark == self._crl_mark:
            return False
        self._crl_mark = mark
        try:
            revoked = revoked_serials(SwarmCerts(self.crl_path.parent), self.ca)
        except CertError as exc:
            log.warning("%s: a new CRL was not taken: %s", self.node_id, exc)
            return False
        if revoked == self.revoked:
            return False
        self.revoked = revoked
        for node_id, serial in list(self._serials.items()):
            if serial in revoked and node_id != self.node_id:
                self.keys.pop(node_id, None)
                del self._serials[node_id]
                log.warning(
                    "%s: %s's certificate is revoked: its messages are refused",
                    self.node_id,
                    node_id,
                )
        return True

    def verify_presence(
        self, sender: str, topic: str, header: bytes | memoryview, sig: bytes, pem: object
    ) -> str | None:
        """Verify a presence message, which may carry the sender's certificate: a valid
        certificate (CA-issued, for ``sender``, a member) whose key made the signature
        becomes ``sender``'s key. Without one, the key already known must verify it."""
        if pem is None:
            return self.verify(sender, topic, header, sig)
        if self.crl_path is not None:
            self.refresh_revocations()
        if sender not in self.members:
            return "unknown_signer"
        try:
            key = verify_member_certificate(pem, self.ca, sender, self.revoked)  # type: ignore[arg-type]
        except CertError as exc:
            log.warning("%s: certificate presented by %r refused: %s", self.node_id, sender, exc)
            return "bad_certificate"
        try:
            key.verify(bytes(sig), _signed_bytes(topic, header))
        except InvalidSignature:
            return "forged"
        self.keys[sender] = key
        self._serials[sender] = x509.load_pem_x509_certificate(bytes(pem)).serial_number  # type: ignore[arg-type]
        return None

    # ------------------------------------------------------------------ signatures
    def sign(self, topic: str, header: bytes | memoryview) -> bytes:
        return self._key.sign(_signed_bytes(topic, header))

    def verify(self, sender: str, topic: str, header: bytes | memoryview, sig: bytes) -> str | None:
        """``None`` when ``sig`` is ``sender``'s signature of (topic, header); otherwise the
        drop reason: ``unknown_signer`` or ``forged``."""
        if self.crl_path is not None:
            self.refresh_revocations()
        key = self.keys.get(sender)
        if key is None:
            return "unknown_signer"
        try:
            key.verify(bytes(sig), _signed_bytes(topic, header))
        except InvalidSignature:
            return "forged"
        return None

    # ------------------------------------------------------------------ ordering
    def next_presence(self, will: bool = False) -> list[float | int]:
        """The ``[session, sequence]`` of this node's next presence (or of its Will)."""
        if will:
            return [self.session, WILL_SEQUENCE]
        self._presence_seq += 1
        return [self.session, self._presence_seq]

    def new_session(self) -> None:
        """A fresh session (each MQTT connection), so its Will outranks the previous one. The
        session is this node's clock, kept above the previous session when the clock has not
        moved on (a reconnection within its resolution); when the previous session lies more
        than :data:`~p2pfl.security.presence_order.REWIND_SLACK_S` ahead of the clock, the
        clock went back and the session starts from the clock again (peers rewind to it,
        docs/wire.md, "Presence order"), rather than staying in a future peers refuse."""
        now = time.time()
        if self.session - now > REWIND_SLACK_S:
            self.session = now
        else:
            self.session = max(now, self.session + 1e-6)
        self._presence_seq = 0

    def presence_order(
        self, sender: str, order: object, mid: str, ts: float, now: float | None = None
    ) -> str | None:
        """Admit a presence by its ``[session, sequence]`` ``order``, its message id ``mid``
        and envelope timestamp ``ts`` (:func:`~p2pfl.security.presence_order.presence_verdict`,
        docs/wire.md, "Presence order"): ``None`` (accepted: its order becomes ``sender``'s
        last), ``same`` (a retained copy seen again), or the drop reason ``replayed``,
        ``future_session`` or ``malformed``. A fresh presence (``ts`` within ``max_age_s``)
        also goes through the replay window, so one already seen is ``replayed`` even when
        its order would pass: a rewind admits nothing the window does not."""
        now = time.time() if now is None else now
        max_age = self.replay.max_age_s
        verdict = presence_verdict(order, self._presence_order.get(sender), ts, now, max_age)
        if verdict not in ("accept", "rewind"):
            return verdict
        if abs(now - ts) <= max_age:
            reason = self.replay.check(mid, ts, now)
            if reason == "replayed" or (verdict == "rewind" and reason is not None):
                return "replayed"
        key = parse_order(order)
        assert key is not None
        if verdict == "rewind":
            log.info(
                "%s: presence of %r rewound from session %.3f to %.3f (its clock went back)",
                self.node_id,
                sender,
                self._presence_order[sender][0],
                key[0],
            )
        self._presence_order[sender] = key
        return None


def tls_context(root: str | Path, node_id: str) -> ssl.SSLContext:
    """A TLS client context for ``node_id``: trusts only the swarm CA (hostname checked
    against the broker certificate's SANs) and presents the node's certificate."""
    paths = SwarmCerts(Path(root))
    paths.require(paths.ca_cert, paths.node_cert(node_id), paths.node_key(node_id))
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(paths.ca_cert))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(paths.node_cert(node_id)), str(paths.node_key(node_id)))
    except ssl.SSLError as exc:
        raise CertError(f"{paths.node_cert(node_id)}: cannot be used for TLS: {exc}") from None
    cn = common_name(load_certificate(paths.node_cert(node_id)))
    if cn != node_id:
        raise CertError(f"{paths.node_cert(node_id)}: certificate is for {cn!r}, not {node_id!r}")
    return ctx


def direct_tls_contexts(root: str | Path, node_id: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """Mutual-TLS contexts for the direct lane (docs/wire.md, "Direct lane"): a server
    context that requires a client certificate from the swarm CA, and a client context that
    presents ``node_id``'s certificate and trusts only the swarm CA. Peers are named by
    their certificate CN (checked by the transport), not by a hostname; certificates in
    the swarm's CRL are refused at the handshake. A certificate issued without the
    server-auth usage (by p2pfl before the direct lane) cannot serve it: :class:`CertError`
    (reissue it with ``p2pfl certs``)."""
    paths = SwarmCerts(Path(root))
    client = tls_context(root, node_id)  # checks the files and the CN
    cert = load_certificate(paths.node_cert(node_id))
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usage = []
    if ExtendedKeyUsageOID.SERVER_AUTH not in usage:
        raise CertError(
            f"{paths.node_cert(node_id)}: no server-auth usage, so it cannot serve the "
            "direct lane; reissue the node certificates with p2pfl certs"
        )
    client.check_hostname = False  # the transport checks the peer certificate's CN
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(paths.ca_cert))
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_cert_chain(str(paths.node_cert(node_id)), str(paths.node_key(node_id)))
    if paths.crl.is_file():
        for ctx in (client, server):
            ctx.load_verify_locations(cafile=str(paths.crl))
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return server, client
