"""A site daemon's part of the trust that spreads (docs/design.md, "Trust that spreads"):
it takes a newer CRL of the swarm CA from the trust messages (kind ``trust``, retained),
applies it at once (the revoked identities' site messages are dropped from then on, with
no restart), keeps it (``state_dir/trust/crl.pem``, and ``crl.pem`` in the site's
certificate folder when it may write there, for the run workers and the next start), and
carries it on under its own name, so a site that was away hears it from any peer.

:class:`TrustUpdates` is a part of the site daemon: it receives the daemon's
:class:`~p2pfl.sites.daemon.context.SiteContext`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from p2pfl.files import write_bytes_atomic
from p2pfl.security.certs import CertError, SwarmCerts, crl_number, load_crl
from p2pfl.security.trust import (
    TrustError,
    crl_text,
    is_newer,
    revoked_serials_of,
    verify_crl,
)
from p2pfl.sites.consent import messages as M
from p2pfl.sites.daemon.context import SiteContext

log = logging.getLogger("p2pfl.sites.daemon")


class TrustUpdates:
    """The swarm's CRL as this site holds it, over the daemon's ``ctx``: at start the newest
    of its certificate folder's and the one it kept (:attr:`number`: its CRL number)."""

    def __init__(self, ctx: SiteContext):
        self.ctx = ctx
        self.number = 0
        if self.ctx.verifier is None:
            return
        for folder in (Path(self.ctx.site.certs or ""), self.ctx.state_dir / "trust"):
            try:
                crl = load_crl(SwarmCerts(folder), self.ctx.verifier.ca)
            except CertError as exc:
                log.warning("%s: %s", self.ctx.name, exc)
                continue
            if crl is not None and is_newer(crl, self.number):
                self._apply_crl(crl)

    def on_trust(self, msg: M.SiteMessage) -> None:
        """A trust message: a newer CRL is applied, kept and carried on."""
        if self.ctx.verifier is None:  # an unsigned federation has no CA to check it with
            return
        try:
            crl = verify_crl(msg.body.get("crl"), self.ctx.verifier.ca)
        except TrustError as exc:
            raise ValueError(f"trust from {msg.site}: {exc}") from None
        if not is_newer(crl, self.number):
            return
        self._apply_crl(crl)
        self._keep_crl(crl)
        log.warning(
            "%s: the swarm's CRL number %d (from %s): %d certificates revoked",
            self.ctx.name,
            self.number,
            msg.site,
            len(self.ctx.verifier.revoked),
        )
        if msg.site != self.ctx.name and self.ctx.identity is not None:
            self.ctx.spawn(None, self.ctx.publish("trust", M.TRUST_RUN, {"crl": crl_text(crl)}))

    def _apply_crl(self, crl: x509.CertificateRevocationList) -> None:
        assert self.ctx.verifier is not None
        self.ctx.verifier.revoke(revoked_serials_of(crl))
        self.number = crl_number(crl)

    def _keep_crl(self, crl: x509.CertificateRevocationList) -> None:
        pem = crl.public_bytes(serialization.Encoding.PEM)
        targets = [self.ctx.state_dir / "trust" / "crl.pem"]
        if self.ctx.site.certs is not None:
            targets.append(SwarmCerts(Path(self.ctx.site.certs)).crl)
        for path in targets:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_bytes_atomic(path, pem)
            except OSError as exc:
                log.warning("%s: %s not written: %s", self.ctx.name, path, exc.strerror or exc)
