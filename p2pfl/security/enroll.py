"""Enrolment of a node whose private key never leaves its device (``p2pfl enroll``;
docs/design.md, "Enrolment").

The device makes its Ed25519 key and a PKCS#10 request signed by it
(:func:`create_request`). The CA holder reads and checks the request
(:func:`read_request`) and issues the node's certificate from it the way
:func:`~p2pfl.security.certs.make_swarm_certs` issues every node's
(:func:`issue_from_request`). A federation may ask that M of its listed approver sites
approve a request first: each signs the request's digest with its own node key
(:func:`approve_as_site`, a JSON file beside the request), and the CA holder counts the
approvals that verify (:func:`tally_approvals`, :func:`require_approvals`).

A request's digest is the SHA-256 of its DER encoding, so re-encoding its PEM changes
nothing; an approval signs that digest, the requested name, the approver's name and the
time, under :data:`APPROVAL_CONTEXT`, so no other message a node key signs can pass for one.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import glob
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from p2pfl.errors import P2PFLError
from p2pfl.security.certs import (
    CertError,
    SwarmCerts,
    issue_node_certificate,
    load_certificate,
    load_private_key,
    node_subject,
    reserved_identity,
    revoked_serials,
    verify_member_certificate,
    write_certificate,
    write_private_key,
)

MAX_REQUEST_BYTES = 16 * 1024  # a request and an approval are untrusted input
MAX_APPROVAL_BYTES = 16 * 1024
APPROVAL_CONTEXT = "p2pfl enroll approval v1"
APPROVAL_FIELDS = ("request_sha256", "name", "approver", "signed_at", "signature", "certificate")


class EnrollError(P2PFLError, ValueError):
    """A request or approval that cannot be read, does not verify, or is not enough; the
    message names the file and what is wrong."""


@dataclass(frozen=True)
class EnrolmentRequest:
    """A request whose signature, name and key were checked (:func:`read_request`)."""

    path: Path
    name: str
    public_key: ed25519.Ed25519PublicKey
    sha256: str  # hex, of the request's DER encoding


def build_request(name: str, key: ed25519.Ed25519PrivateKey) -> x509.CertificateSigningRequest:
    """A PKCS#10 request for node ``name`` (the subject its certificate will carry), signed
    by ``key``; it holds the public key only."""
    return x509.CertificateSigningRequestBuilder().subject_name(node_subject(name)).sign(key, None)


def check_name(name: str, name_pattern: str) -> None:
    """Raise :class:`EnrollError` unless ``name`` can be a node's: it matches
    ``name_pattern`` (a node id's, :data:`p2pfl.config.schema.ID_PATTERN`) and is no
    reserved identity's (:func:`~p2pfl.security.certs.reserved_identity`)."""
    if reserved_identity(name):
        raise EnrollError(f"name {name!r} is reserved (the bridge's, observer's, CA's or broker's)")
    if not re.fullmatch(name_pattern, name):
        raise EnrollError(
            f"name {name!r} is not a valid node id (1 to 64 letters, digits, '_', '.', '-')"
        )


def create_request(
    name: str, certs_dir: Path, *, name_pattern: str, force: bool = False
) -> tuple[Path, bytes]:
    """Make node ``name``'s fresh Ed25519 key in the device's certificate folder
    ``certs_dir`` (``nodes/<name>.key``, mode 0600, where a node looks for it) and return
    its path and the PEM request signed by it. An existing key is kept, and
    :class:`EnrollError` raised, unless ``force``."""
    check_name(name, name_pattern)
    key_path = SwarmCerts(Path(certs_dir)).node_key(name)
    if key_path.exists() and not force:
        raise EnrollError(f"{key_path}: a key already exists (--force makes a new one)")
    key = ed25519.Ed25519PrivateKey.generate()
    write_private_key(key_path, key)
    return key_path, build_request(name, key).public_bytes(serialization.Encoding.PEM)


def _read_small(path: Path, limit: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise EnrollError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > limit:
        raise EnrollError(f"{path}: too large for {what} (over {limit} bytes)")
    return data


def read_request(path: Path, *, name_pattern: str) -> EnrolmentRequest:
    """The request at ``path``, checked: a PEM PKCS#10 request whose signature verifies
    under its own key, for one name that can be a node's (:func:`check_name`), on an
    Ed25519 key (node identities are). :class:`EnrollError` naming the file otherwise."""
    path = Path(path)
    data = _read_small(path, MAX_REQUEST_BYTES, "a certificate request")
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError as exc:
        raise EnrollError(f"{path}: not a PEM certificate request: {exc}") from None
    try:
        key = csr.public_key()
        signed = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise EnrollError(f"{path}: unreadable key or signature: {exc}") from None
    if not signed:
        raise EnrollError(f"{path}: its signature does not verify (altered, or not its key's)")
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1 or not isinstance(names[0].value, str):
        raise EnrollError(f"{path}: the request names no single common name (the node id)")
    name = names[0].value
    try:
        check_name(name, name_pattern)
    except EnrollError as exc:
        raise EnrollError(f"{path}: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise EnrollError(
            f"{path}: its key is {type(key).__name__}, not Ed25519 (node identities are Ed25519)"
        )
    digest = hashlib.sha256(csr.public_bytes(serialization.Encoding.DER)).hexdigest()
    return EnrolmentRequest(path=path, name=name, public_key=key, sha256=digest)


def _holds_valid_certificate(paths: SwarmCerts, name: str, ca: x509.Certificate) -> str | None:
    """Why node ``name``'s current certificate in ``paths`` still stands (its expiry), or
    None when there is none, or it expired, or it is revoked."""
    cert_path = paths.node_cert(name)
    if not cert_path.is_file():
        return None
    cert = load_certificate(cert_path)
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return None
    if cert.serial_number in revoked_serials(paths, ca):
        return None
    return f"valid until {cert.not_valid_after_utc:%Y-%m-%d}"


def issue_from_request(
    request: EnrolmentRequest, ca_dir: Path, *, days: int, replace: bool = False
) -> tuple[x509.Certificate, Path]:
    """Issue ``request``'s node certificate with the CA in ``ca_dir``
    (:func:`~p2pfl.security.certs.issue_node_certificate`, as for every node) and write it
    to ``ca_dir/nodes/<name>.crt``; return it and that path. A name whose current
    certificate there is valid and not revoked is refused unless ``replace`` (the old one
    stays valid until revoked)."""
    paths = SwarmCerts(Path(ca_dir))
    paths.require(paths.ca_cert, paths.ca_key)
    ca_cert = load_certificate(paths.ca_cert)
    standing = _holds_valid_certificate(paths, request.name, ca_cert)
    if standing and not replace:
        raise EnrollError(
            f"{paths.node_cert(request.name)}: {request.name} already holds a certificate, "
            f"{standing}, not revoked (--replace issues another)"
        )
    ca_key = load_private_key(paths.ca_key)
    cert = issue_node_certificate(request.name, request.public_key, ca_key, ca_cert, days)
    write_certificate(paths.node_cert(request.name), cert)
    return cert, paths.node_cert(request.name)


# ----------------------------------------------------------------------------- approvals


def approval_path(request_path: Path, approver: str) -> Path:
    """Where ``approver``'s approval of the request at ``request_path`` lies: beside it,
    ``<stem>.approval.<approver>.json``."""
    return request_path.with_name(f"{request_path.stem}.approval.{approver}.json")


def _signed_bytes(sha256: str, name: str, approver: str, signed_at: str) -> bytes:
    fields = {
        "context": APPROVAL_CONTEXT,
        "request_sha256": sha256,
        "name": name,
        "approver": approver,
        "signed_at": signed_at,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_approval(
    request: EnrolmentRequest,
    approver: str,
    key: ed25519.Ed25519PrivateKey,
    certificate_pem: bytes,
    now: dt.datetime | None = None,
) -> dict[str, str]:
    """``approver``'s approval of ``request``: the request's digest, its name, the
    approver's name and the time, signed by ``key`` (the approver's node key), with the
    approver's certificate ``certificate_pem`` so the CA holder can check who signed.
    :class:`EnrollError` when ``key`` is not the certificate's."""
    try:
        cert = x509.load_pem_x509_certificate(certificate_pem)
    except ValueError as exc:
        raise EnrollError(f"{approver}: its certificate is not PEM: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey) or cert.public_key() != key.public_key():
        raise EnrollError(f"{approver}: its node key is not the one of its certificate")
    signed_at = (now or dt.datetime.now(dt.timezone.utc)).isoformat(timespec="seconds")
    signature = key.sign(_signed_bytes(request.sha256, request.name, approver, signed_at))
    return {
        "request_sha256": request.sha256,
        "name": request.name,
        "approver": approver,
        "signed_at": signed_at,
        "signature": base64.b64encode(signature).decode(),
        "certificate": certificate_pem.decode(),
    }


def approve_as_site(request: EnrolmentRequest, certs_dir: Path, site: str) -> Path:
    """Site ``site`` approves ``request`` with its node key and certificate from its
    certificate folder ``certs_dir``; the approval is written beside the request
    (:func:`approval_path`), whose path is returned."""
    paths = SwarmCerts(Path(certs_dir))
    paths.require(paths.node_cert(site), paths.node_key(site))
    load_certificate(paths.node_cert(site))  # a CertError naming the file
    key = load_private_key(paths.node_key(site))
    try:
        approval = sign_approval(request, site, key, paths.node_cert(site).read_bytes())
    except EnrollError as exc:
        raise EnrollError(f"{paths.node_key(site)}: {exc}") from None
    path = approval_path(request.path, site)
    path.write_text(json.dumps(approval, indent=2) + "\n")
    return path


def verify_approval(
    data: bytes,
    request: EnrolmentRequest,
    ca: x509.Certificate,
    revoked: frozenset[int] = frozenset(),
) -> str:
    """The approver whose approval ``data`` (an approval file's bytes) is of ``request``:
    its certificate is the swarm CA's (``ca``), valid, not ``revoked``, for the approver it
    names; its signature verifies under that certificate's key; and its digest and name
    are ``request``'s. :class:`EnrollError` saying why not (without the file's name)."""
    try:
        approval = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise EnrollError("not JSON") from None
    if not isinstance(approval, dict) or not all(
        isinstance(approval.get(f), str) for f in APPROVAL_FIELDS
    ):
        raise EnrollError(
            f"not an approval (it needs the text fields {', '.join(APPROVAL_FIELDS)})"
        )
    approver = approval["approver"]
    try:
        key = verify_member_certificate(
            approval["certificate"].encode(), ca, expected_id=approver, revoked=revoked
        )
    except CertError as exc:
        raise EnrollError(f"{approver}'s certificate: {exc}") from None
    try:
        signature = base64.b64decode(approval["signature"], validate=True)
        key.verify(
            signature,
            _signed_bytes(
                approval["request_sha256"], approval["name"], approver, approval["signed_at"]
            ),
        )
    except (binascii.Error, InvalidSignature):
        raise EnrollError(f"{approver}'s signature does not verify") from None
    if approval["request_sha256"] != request.sha256 or approval["name"] != request.name:
        raise EnrollError(
            f"{approver} approved another request ({approval['name']!r}, sha256 "
            f"{approval['request_sha256'][:16]}…)"
        )
    return approver


@dataclass(frozen=True)
class ApprovalTally:
    """The approvals found beside a request, against the admission rule."""

    required: int
    approvers: tuple[str, ...]  # admission.approvers: whose approvals count
    valid: tuple[str, ...]  # listed approvers whose approval verifies, distinct
    refused: tuple[tuple[str, str], ...]  # (file name, why it does not count)

    @property
    def missing(self) -> tuple[str, ...]:
        """The listed approvers without a valid approval."""
        return tuple(a for a in self.approvers if a not in self.valid)

    @property
    def enough(self) -> bool:
        return len(self.valid) >= self.required


def tally_approvals(
    request: EnrolmentRequest,
    ca: x509.Certificate,
    revoked: frozenset[int],
    required: int,
    approvers: list[str] | tuple[str, ...],
) -> ApprovalTally:
    """Check every approval file beside ``request`` (:func:`approval_path`'s pattern,
    :func:`verify_approval`); one counts when it verifies and its approver is among
    ``approvers``, each approver once."""
    pattern = f"{glob.escape(request.path.stem)}.approval.*.json"
    valid: list[str] = []
    refused: list[tuple[str, str]] = []
    for path in sorted(request.path.parent.glob(pattern)):
        try:
            data = _read_small(path, MAX_APPROVAL_BYTES, "an approval")
            approver = verify_approval(data, request, ca, revoked)
        except EnrollError as exc:
            refused.append((path.name, str(exc)))
            continue
        if approver not in approvers:
            refused.append((path.name, f"{approver} is not among admission.approvers"))
        elif approver not in valid:
            valid.append(approver)
    return ApprovalTally(required, tuple(approvers), tuple(valid), tuple(refused))


def require_approvals(tally: ApprovalTally, request: EnrolmentRequest, rule: str) -> None:
    """Raise :class:`EnrollError`, one line naming the request, the rule's source
    ``rule``, the approvers missing and each approval that does not count and why, unless
    ``tally`` is enough."""
    if tally.enough:
        return
    parts = [
        f"{request.path}: {len(tally.valid)} of the {tally.required} approvals {rule} asks",
        f"valid: {', '.join(tally.valid) or 'none'}",
        f"missing: {', '.join(tally.missing) or 'none'}",
    ]
    parts += [f"{name} does not count: {why}" for name, why in tally.refused]
    raise EnrollError("; ".join(parts))
