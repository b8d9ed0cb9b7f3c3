"""Revocations that spread peer to peer (docs/design.md, "Trust that spreads"): the
swarm's CRL, signed by its CA and numbered (the CRL number, a monotonic serial), travels as
a retained message on the swarm's trust topic; every daemon takes a newer one without a
restart and drops the revoked identities' messages from then on.

The CRL authenticates itself (the CA's signature), so any member may carry it, and an
older one, replayed, is told by its number and ignored. Pure functions here; the daemon
(:mod:`p2pfl.sites.trust.crl_updates`) applies them.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from p2pfl.errors import P2PFLError
from p2pfl.security.certs import crl_number

MAX_CRL_BYTES = 200 * 1024
"""The largest CRL taken from a peer (some 6,000 revoked certificates; a site message is
at most 256 KiB)."""


class TrustError(P2PFLError, ValueError):
    """A CRL from a peer that is not the swarm CA's, or not readable; says why."""


def verify_crl(pem: str, ca: x509.Certificate) -> x509.CertificateRevocationList:
    """The CRL in ``pem`` (PEM text, as a trust message carries it) when the swarm CA
    ``ca`` issued and signed it and it carries a CRL number; :class:`TrustError`
    otherwise."""
    if not isinstance(pem, str) or len(pem) > MAX_CRL_BYTES:
        raise TrustError(f"a CRL is PEM text of at most {MAX_CRL_BYTES} characters")
    try:
        crl = x509.load_pem_x509_crl(pem.encode())
    except ValueError as exc:
        raise TrustError(f"not a PEM CRL: {exc}") from None
    if crl.issuer != ca.subject:
        raise TrustError(f"issued by {crl.issuer.rfc4514_string()}, not the swarm CA")
    if not crl.is_signature_valid(ca.public_key()):
        raise TrustError("not signed by the swarm CA")
    if crl_number(crl) < 1:
        raise TrustError("no CRL number (made by p2pfl certs --revoke, it has one)")
    return crl


def crl_text(crl: x509.CertificateRevocationList) -> str:
    """``crl`` as a trust message carries it (PEM text)."""
    return crl.public_bytes(serialization.Encoding.PEM).decode()


def revoked_serials_of(crl: x509.CertificateRevocationList) -> frozenset[int]:
    """The certificate serials ``crl`` revokes."""
    return frozenset(r.serial_number for r in crl)


def is_newer(crl: x509.CertificateRevocationList, than: int) -> bool:
    """Whether ``crl`` is newer than the CRL numbered ``than`` (an equal or older one, a
    retained copy heard again or a replay, changes nothing)."""
    return crl_number(crl) > than
