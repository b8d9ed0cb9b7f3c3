"""A swarm's certificate authority and per-node identities (``p2pfl certs``; docs/wire.md,
"Security").

:func:`make_swarm_certs` writes one directory per swarm::

    ca.crt   ca.key          the swarm CA (keep ca.key off the devices)
    broker.crt broker.key    the broker's TLS server certificate (SANs: the broker hosts)
    bridge.crt bridge.key    the identity a site broker's bridge presents to another site's
                             broker (CN ``p2pfl:bridge``, :data:`BRIDGE_CN`)
    observer.crt observer.key  the dashboard's read-only identity (CN ``p2pfl:observer``,
                             :data:`OBSERVER_CN`): it may read presence and status telemetry,
                             and publish nothing
    nodes/<id>.crt <id>.key  one Ed25519 identity per node (CN = node id)
    acl                      the Mosquitto ACL: each node publishes only its own topics;
                             the bridge relays the whole swarm; the observer only reads
    crl.pem                  revoked certificates (:func:`revoke`: nodes', the bridge's, the
                             observer's), when any are

A node's Ed25519 key is both its TLS client key and its message-signing key, so its
certificate is also how peers learn its public key (:class:`Keyring`). A device needs only
``ca.crt`` and its own ``nodes/<id>.crt`` + ``.key``; peers' certificates travel in their
signed presence messages and are checked against the CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pfl.errors import P2PFLError

DEFAULT_DAYS = 825
MAX_CERT_BYTES = 4096  # a peer's certificate is untrusted input
# the bridge's CN (its MQTT username on the remote broker): ':' is not allowed in a node id,
# so no node can be named it and inherit the bridge's rights in the ACL
BRIDGE_CN = "p2pfl:bridge"
# the dashboard's observer identity (its MQTT username): like the bridge's, no node can be
# named it; the ACL lets it read presence and status telemetry and nothing else
OBSERVER_CN = "p2pfl:observer"


class CertError(P2PFLError, ValueError):
    """A missing, unreadable or untrusted certificate or key; the message names the file."""


@dataclass(frozen=True)
class SwarmCerts:
    """Where a swarm's certificate directory keeps each file."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def broker_cert(self) -> Path:
        return self.root / "broker.crt"

    @property
    def broker_key(self) -> Path:
        return self.root / "broker.key"

    @property
    def bridge_cert(self) -> Path:
        return self.root / "bridge.crt"

    @property
    def bridge_key(self) -> Path:
        return self.root / "bridge.key"

    @property
    def observer_cert(self) -> Path:
        return self.root / "observer.crt"

    @property
    def observer_key(self) -> Path:
        return self.root / "observer.key"

    @property
    def acl(self) -> Path:
        return self.root / "acl"

    @property
    def crl(self) -> Path:
        return self.root / "crl.pem"

    def node_cert(self, node_id: str) -> Path:
        return self.root / "nodes" / f"{node_id}.crt"

    def node_key(self, node_id: str) -> Path:
        return self.root / "nodes" / f"{node_id}.key"

    def identity_cert(self, name: str) -> Path:
        """The certificate of identity ``name``: :data:`BRIDGE_CN`, :data:`OBSERVER_CN`, or
        a node id."""
        return {BRIDGE_CN: self.bridge_cert, OBSERVER_CN: self.observer_cert}.get(
            name, self.node_cert(name)
        )

    def identity_files(self, name: str) -> str:
        """The files holding identity ``name``, as a user deletes them to issue it anew."""
        cert = self.identity_cert(name)
        key = cert.with_suffix(".key")
        return f"{cert.relative_to(self.root)} and {key.relative_to(self.root)}"

    def require(self, *paths: Path) -> None:
        """Raise :class:`CertError` naming the first missing file."""
        for p in paths:
            if not p.is_file():
                raise CertError(
                    f"{p}: missing (create the swarm's certificates with `p2pfl certs`)"
                )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "p2pfl"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def write_private_key(path: Path, key) -> None:
    """Write ``key`` unencrypted (PKCS#8 PEM) to ``path``, readable by its owner only (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a key written over an older file: its mode too
        f.write(data)


def write_certificate(path: Path, cert: x509.Certificate) -> None:
    """Write ``cert`` as PEM to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    subject: x509.Name,
    public_key,
    ca_key,
    ca_name: x509.Name,
    days: int,
    *,
    ca: bool = False,
    usage: list | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    # Ed25519 signs without a separate digest; ECDSA keys sign with SHA-256
    algorithm = None if isinstance(ca_key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(ca_key, algorithm)


def _write_client_identity(
    key_path: Path, cert_path: Path, cn: str, ca_key, ca_cert: x509.Certificate, days: int
) -> None:
    """A client-auth-only certificate for ``cn`` on a fresh ECDSA P-256 key (any Mosquitto
    build has it), which also keeps it from ever passing as a node identity (Ed25519)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(
        _name(cn),
        key.public_key(),
        ca_key,
        ca_cert.subject,
        days,
        usage=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    write_private_key(key_path, key)
    write_certificate(cert_path, cert)


def node_subject(node_id: str) -> x509.Name:
    """The subject of node ``node_id``'s certificate (and of its enrolment request)."""
    return _name(node_id)


def issue_node_certificate(
    node_id: str,
    public_key: ed25519.Ed25519PublicKey,
    ca_key,
    ca_cert: x509.Certificate,
    days: int = DEFAULT_DAYS,
) -> x509.Certificate:
    """Node ``node_id``'s identity: ``public_key`` (Ed25519) certified by the swarm CA for
    ``days``, CN = ``node_id``, usable as a TLS client and server. The one way p2pfl issues
    a node's certificate (:func:`make_swarm_certs`, ``p2pfl enroll approve``)."""
    return _issue(
        _name(node_id),
        public_key,
        ca_key,
        ca_cert.subject,
        days,
        # client: to the broker and to peers' direct lanes; server: its own direct lane
        usage=[ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH],
    )


def reserved_identity(name: str) -> bool:
    """Whether ``name`` is the CN of an identity that is no node's: the bridge's, the
    observer's, a swarm CA's or a broker's (``p2pfl <swarm> CA``, ``p2pfl <swarm> broker``)."""
    if name in (BRIDGE_CN, OBSERVER_CN):
        return True
    return name.startswith("p2pfl ") and name.endswith((" CA", " broker"))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def mosquitto_acl(swarm: str | None, revoked: list[str] | tuple[str, ...] = ()) -> str:
    """ACL for a TLS listener with ``use_identity_as_username``: ``%u`` is the client's
    certificate CN, i.e. its node id. Each node writes only its own presence, gossip and
    status topics and reads only its own inbox; any member may write any inbox (requests
    and replies), where signatures say who really sent what. Status telemetry (docs/wire.md,
    "Status telemetry") is readable by any client with a swarm certificate, for observers.
    ``swarm=None``: every swarm.

    A site daemon (``p2pfl daemon``, username its site) writes only its own site messages
    (``p2pfl/<swarm>/sites/<kind>/<run_id>/<site>``) and reads every site's.

    The bridge of another site's broker (username :data:`BRIDGE_CN`) reads and writes every
    topic of the swarm, since it relays all of them both ways, and its connection state
    (``$SYS/broker/connection/<id>/state``: its notifications and its Will).

    The dashboard's observer (username :data:`OBSERVER_CN`) reads presence and status
    telemetry, what the dashboard shows, and nothing else; it publishes nothing. The
    ``pattern`` lines apply to every client, so they would let it write any inbox and its
    own presence, gossip and status topics, and read gossip: its ``deny`` lines take those
    away (Mosquitto checks a user's denials before anything else).

    A revoked identity (``revoked``: its CN) is denied every topic, so a broker that
    reloads its ACL (Mosquitto on SIGHUP) cuts it off without a restart, even before it
    reloads its CRL."""
    s = swarm or "+"
    denied = [line for name in revoked for line in (f"user {name}", "topic deny #")]
    return "\n".join(
        [
            "# generated by p2pfl: each node publishes only its own topics",
            f"pattern readwrite p2pfl/{s}/presence/%u",
            f"pattern read p2pfl/{s}/presence/+",
            f"pattern write p2pfl/{s}/gossip/%u",
            f"pattern read p2pfl/{s}/gossip/+",
            f"pattern read p2pfl/{s}/inbox/%u",
            f"pattern write p2pfl/{s}/inbox/+",
            f"pattern write p2pfl/{s}/status/%u",
            f"pattern read p2pfl/{s}/status/+",
            "# site daemons (p2pfl daemon): each writes only its own specs, votes, commits",
            f"pattern write p2pfl/{s}/sites/+/+/%u",
            f"pattern read p2pfl/{s}/sites/#",
            "# every client may read the state of the broker's bridges (reachability)",
            "pattern read $SYS/broker/connection/+/state",
            "# the dashboard's observer reads presence and status telemetry, publishes nothing",
            f"user {OBSERVER_CN}",
            *(f"topic deny {t}" for t in observer_denied(s)),
            f"topic read p2pfl/{s}/presence/+",
            f"topic read p2pfl/{s}/status/+",
            "# a bridge between site brokers relays the whole swarm, both ways",
            f"user {BRIDGE_CN}",
            f"topic readwrite p2pfl/{s}/#",
            "topic readwrite $SYS/broker/connection/+/state",
            *(["# revoked identities (crl.pem): denied everything", *denied] if denied else []),
            "",
        ]
    )


def observer_denied(swarm: str) -> list[str]:
    """The topics of swarm ``swarm`` (``+``: any) the ACL's ``pattern`` lines would open to
    the observer and its ``deny`` lines close: every inbox, its own presence, gossip and
    status topics (its username is :data:`OBSERVER_CN`), and every node's gossip."""
    return [
        f"p2pfl/{swarm}/inbox/+",
        f"p2pfl/{swarm}/gossip/+",
        f"p2pfl/{swarm}/presence/{OBSERVER_CN}",
        f"p2pfl/{swarm}/status/{OBSERVER_CN}",
        f"p2pfl/{swarm}/sites/#",
    ]


def make_swarm_certs(
    out: Path,
    swarm: str,
    node_ids: list[str],
    broker_hosts: list[str] | None = None,
    *,
    days: int = DEFAULT_DAYS,
    overwrite: bool = False,
) -> SwarmCerts:
    """Create (or extend) a swarm's CA, broker certificate, bridge, observer and node
    identities, and ACL.

    An existing CA is reused, so adding a node later signs it with the same CA; existing
    node identities (and the bridge's and observer's) are kept unless ``overwrite``. The broker certificate is always
    re-issued for ``broker_hosts`` (plus ``127.0.0.1`` and ``localhost``)."""
    paths = SwarmCerts(Path(out))
    paths.root.mkdir(parents=True, exist_ok=True)
    if paths.ca_cert.exists() and not overwrite:  # extend: sign with the same CA
        paths.require(paths.ca_key)
        ca_key = load_private_key(paths.ca_key)
        ca_cert = load_certificate(paths.ca_cert)
    else:
        ca_key = ed25519.Ed25519PrivateKey.generate()
        ca_name = _name(f"p2pfl {swarm} CA")  # self-signed: issuer = subject
        ca_cert = _issue(ca_name, ca_key.public_key(), ca_key, ca_name, days, ca=True)
        write_private_key(paths.ca_key, ca_key)
        write_certificate(paths.ca_cert, ca_cert)
    hosts = list(dict.fromkeys([*(broker_hosts or []), "127.0.0.1", "localhost"]))
    # the broker's server key is ECDSA P-256: every TLS client and Mosquitto build has it
    broker_key = ec.generate_private_key(ec.SECP256R1())
    broker_cert = _issue(
        _name(f"p2pfl {swarm} broker"),
        broker_key.public_key(),
        ca_key,
        ca_cert.subject,
        days,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[_san(h) for h in hosts],
    )
    write_private_key(paths.broker_key, broker_key)
    write_certificate(paths.broker_cert, broker_cert)
    # two client identities of other kinds than a node: a client of other site brokers, and
    # the dashboard's observer
    for key_path, cert_path, cn in (
        (paths.bridge_key, paths.bridge_cert, BRIDGE_CN),
        (paths.observer_key, paths.observer_cert, OBSERVER_CN),
    ):
        if overwrite or not (key_path.exists() and cert_path.exists()):
            _write_client_identity(key_path, cert_path, cn, ca_key, ca_cert, days)
    for nid in node_ids:
        if paths.node_key(nid).exists() and paths.node_cert(nid).exists() and not overwrite:
            continue
        key = ed25519.Ed25519PrivateKey.generate()
        cert = issue_node_certificate(nid, key.public_key(), ca_key, ca_cert, days)
        write_private_key(paths.node_key(nid), key)
        write_certificate(paths.node_cert(nid), cert)
    paths.acl.write_text(mosquitto_acl(swarm))
    return paths


def revoke(root: Path, names: list[str], days: int = DEFAULT_DAYS) -> SwarmCerts:
    """Add the current certificates of the identities ``names`` (node ids, or
    :data:`BRIDGE_CN` / :data:`OBSERVER_CN`) to the swarm's CRL (``crl.pem``, signed by the
    CA; earlier revocations are kept). A broker given the directory refuses them at the TLS
    handshake, nodes refuse a revoked node's signatures, and the dashboard and a bridging
    broker refuse to start with a revoked identity of theirs (:func:`check_not_revoked`).
    A new identity is issued by deleting the revoked one's files and running ``p2pfl
    certs`` again."""
    paths = SwarmCerts(Path(root))
    paths.require(paths.ca_cert, paths.ca_key, *(paths.identity_cert(n) for n in names))
    ca_key, ca_cert = load_private_key(paths.ca_key), load_certificate(paths.ca_cert)
    now = dt.datetime.now(dt.timezone.utc)
    entries = {r.serial_number: r for r in load_crl(paths, ca_cert) or []}
    for name in names:
        serial = load_certificate(paths.identity_cert(name)).serial_number
        entries.setdefault(
            serial,
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build(),
        )
    previous = load_crl(paths, ca_cert)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(now + dt.timedelta(days=days))
        # the CRL number: a monotonic serial, so a newer CRL is told from an older one
        .add_extension(x509.CRLNumber(crl_number(previous) + 1), critical=False)
    )
    for entry in entries.values():
        builder = builder.add_revoked_certificate(entry)
    crl = builder.sign(ca_key, None)
    paths.crl.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    swarm = swarm_of(ca_cert)
    if swarm is not None:  # the broker's ACL denies the revoked identities everything
        paths.acl.write_text(mosquitto_acl(swarm, revoked_names(paths, ca_cert)))
    return paths


def crl_number(crl: x509.CertificateRevocationList | None) -> int:
    """A CRL's number (its monotonic serial); 0 for none, or a CRL without one."""
    if crl is None:
        return 0
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


def swarm_of(ca_cert: x509.Certificate) -> str | None:
    """The swarm a ``p2pfl certs`` CA is for (its CN is ``p2pfl <swarm> CA``)."""
    cn = common_name(ca_cert) or ""
    if cn.startswith("p2pfl ") and cn.endswith(" CA"):
        return cn[len("p2pfl ") : -len(" CA")]
    return None


def revoked_names(paths: SwarmCerts, ca: x509.Certificate) -> list[str]:
    """The identities of the folder (nodes, bridge, observer) whose certificate the CRL
    revokes, sorted."""
    revoked = revoked_serials(paths, ca)
    names = [BRIDGE_CN, OBSERVER_CN]
    nodes = paths.root / "nodes"
    if nodes.is_dir():
        names += [p.stem for p in nodes.glob("*.crt")]
    found = []
    for name in names:
        cert = paths.identity_cert(name)
        if cert.is_file() and load_certificate(cert).serial_number in revoked:
            found.append(name)
    return sorted(found)


def load_crl(paths: SwarmCerts, ca: x509.Certificate) -> x509.CertificateRevocationList | None:
    """The swarm's CRL, checked against its CA; None when there is none."""
    if not paths.crl.is_file():
        return None
    try:
        crl = x509.load_pem_x509_crl(paths.crl.read_bytes())
    except ValueError as exc:
        raise CertError(f"{paths.crl}: not a PEM CRL: {exc}") from None
    if not crl.is_signature_valid(ca.public_key()):
        raise CertError(f"{paths.crl}: not signed by the swarm CA")
    return crl


def revoked_serials(paths: SwarmCerts, ca: x509.Certificate) -> frozenset[int]:
    crl = load_crl(paths, ca)
    return frozenset(r.serial_number for r in crl) if crl is not None else frozenset()


def check_not_revoked(paths: SwarmCerts, name: str) -> None:
    """Raise :class:`CertError` when the certificate of identity ``name`` (as
    :meth:`SwarmCerts.identity_cert`) is in the directory's CRL: the broker would refuse it
    at the handshake, which a client only sees as a dropped connection."""
    cert = paths.identity_cert(name)
    if not paths.crl.is_file():
        return
    serial = load_certificate(cert).serial_number
    if serial in revoked_serials(paths, load_certificate(paths.ca_cert)):
        raise CertError(
            f"{cert}: revoked (in {paths.crl}); to issue a new {name} identity, delete "
            f"{paths.identity_files(name)} and run `p2pfl certs` again"
        )


def load_certificate(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except OSError as exc:
        raise CertError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise CertError(f"{path}: not a PEM certificate: {exc}") from None


def load_private_key(path: Path):
    try:
        return serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise CertError(f"{path}: cannot read: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise CertError(f"{path}: not an unencrypted PEM private key: {exc}") from None


def common_name(cert: x509.Certificate) -> str | None:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else None
    return value if isinstance(value, str) else None


def verify_member_certificate(
    pem: bytes,
    ca: x509.Certificate,
    expected_id: str | None = None,
    revoked: frozenset[int] = frozenset(),
) -> ed25519.Ed25519PublicKey:
    """Check an untrusted node certificate: PEM, issued by ``ca`` (signature and validity),
    not ``revoked`` (serial numbers), a client certificate, an Ed25519 key, and CN =
    ``expected_id`` when given. Returns the public key; raises :class:`CertError` saying
    what is wrong."""
    if not isinstance(pem, (bytes, bytearray)) or len(pem) > MAX_CERT_BYTES:
        raise CertError("certificate missing or too large")
    try:
        cert = x509.load_pem_x509_certificate(bytes(pem))
    except ValueError as exc:
        raise CertError(f"not a PEM certificate: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise CertError("not issued by the swarm CA") from None
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CertError("certificate expired or not yet valid")
    if cert.serial_number in revoked:
        raise CertError("certificate revoked")
    try:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise CertError("not a p2pfl node certificate") from None
    if basic.ca or ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise CertError("not a node (client) certificate")
    key = cert.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise CertError("node key is not Ed25519")
    cn = common_name(cert)
    if expected_id is not None and cn != expected_id:
        raise CertError(f"certificate is for {cn!r}, not {expected_id!r}")
    return key
