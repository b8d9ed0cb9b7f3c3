"""A site daemon's part of the trust that spreads (docs/design.md, "Trust that spreads"):
it takes a newer CRL of the swarm CA from the trust messages (kind ``trust``, retained),
applies it at once (the revoked identities' site messages are dropped from then on, with
no restart), keeps it (``state_dir/trust/crl.pem``, and ``crl.pem`` in the site's
certificate folder when it may write there, for the run workers and the next start), and
carries it on under its own name, so a site that was away hears it from any peer.

:class:`TrustUpdates` is a part of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from p2pfl.security.certs import CertError, SwarmCerts, crl_number, load_crl
from p2pfl.security.trust import (
    TrustError,
    crl_text,
    is_newer,
    revoked_serials_of,
    verify_crl,
)
from p2pfl.sites.consent import messages as M

log = logging.getLogger("p2pfl.sites.daemon")


class TrustUpdates:
    """The daemon's trust updates (a mixin of :class:`~p2pfl.sites.daemon.site_daemon.SiteDaemon`)."""

    def _init_trust(self) -> None:
        """The newest CRL this site holds: its certificate folder's or the one it kept."""
        self.trust_number = 0
        if self.verifier is None:
            return
        for folder in (Path(self.site.certs or ""), self.state_dir / "trust"):
            try:
                crl = load_crl(SwarmCerts(folder), self.verifier.ca)
            except CertError as exc:
                log.warning("%s: %s", self.name, exc)
                continue
            if crl is not None and is_newer(crl, self.trust_number):
                self._apply_crl(crl)

    def _on_trust(self, msg: M.SiteMessage) -> None:
        """A trust message: a newer CRL is applied, kept and carried on."""
        if self.verifier is None:  # an unsigned federation has no CA to check it with
            return
        try:
            crl = verify_crl(msg.body.get("crl"), self.verifier.ca)
        except TrustError as exc:
            raise ValueError(f"trust from {msg.site}: {exc}") from None
        if not is_newer(crl, self.trust_number):
            return
        self._apply_crl(crl)
        self._keep_crl(crl)
        log.warning(
            "%s: the swarm's CRL number %d (from %s): %d certificates revoked",
            self.name,
            self.trust_number,
            msg.site,
            len(self.verifier.revoked),
        )
        if msg.site != self.name and self.identity is not None:
            self._spawn(None, self._publish("trust", M.TRUST_RUN, {"crl": crl_text(crl)}))

    def _apply_crl(self, crl: x509.CertificateRevocationList) -> None:
        assert self.verifier is not None
        self.verifier.revoke(revoked_serials_of(crl))
        self.trust_number = crl_number(crl)

    def _keep_crl(self, crl: x509.CertificateRevocationList) -> None:
        pem = crl.public_bytes(serialization.Encoding.PEM)
        targets = [self.state_dir / "trust" / "crl.pem"]
        if self.site.certs is not None:
            targets.append(SwarmCerts(Path(self.site.certs)).crl)
        for path in targets:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
                tmp.write_bytes(pem)
                os.replace(tmp, path)
            except OSError as exc:
                log.warning("%s: %s not written: %s", self.name, path, exc.strerror or exc)
