"""``p2pfl enroll request`` on a new device and ``p2pfl enroll approve`` at an approver
site or the CA holder: a node's certificate issued while its key stays on the device
(:mod:`p2pfl.security.enroll`; docs/design.md, "Enrolment"). The admission rule, M of the
listed approvers, is the CA holder's site file's ``admission:``."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from p2pfl.config.schema import ID_PATTERN
from p2pfl.security.certs import (
    SwarmCerts,
    load_certificate,
    revoked_serials,
    write_certificate,
)
from p2pfl.security.enroll import (
    EnrollError,
    approve_as_site,
    create_request,
    issue_from_request,
    read_request,
    require_approvals,
    tally_approvals,
)

out = Console(highlight=False, soft_wrap=True)  # a command's answer: on stdout


def enroll(args: argparse.Namespace) -> int:
    """Run ``p2pfl enroll request`` or ``p2pfl enroll approve``; a bad request, approval
    or certificate raises a :class:`~p2pfl.errors.P2PFLError` (exit 2, one line)."""
    return _request(args) if args.enroll_command == "request" else _approve(args)


def _request(args: argparse.Namespace) -> int:
    key_path, pem = create_request(
        args.site, Path(args.certs), name_pattern=ID_PATTERN, force=args.force
    )
    request = Path(args.out or f"{args.site}.request.pem")
    request.write_bytes(pem)
    out.print(
        f"[green]ok[/] key {escape(str(key_path))} (stays here), request {escape(str(request))}"
    )
    out.print(
        f"send {escape(request.name)} to the CA holder (p2pfl enroll approve), then put the "
        f"{escape(args.site)}.crt it returns in {escape(str(key_path.parent))}/ and ca.crt in "
        f"{escape(args.certs)}/"
    )
    return 0


def _approve(args: argparse.Namespace) -> int:
    if not args.certs and not args.site:
        raise EnrollError(
            "p2pfl enroll approve: give --certs CA_DIR to issue the certificate, or --site "
            "SITE.yaml to approve the request as that site"
        )
    request = read_request(Path(args.request), name_pattern=ID_PATTERN)
    site = None
    if args.site:
        from p2pfl.sites.daemon.site_file import load_site

        site = load_site(args.site)
    if not args.certs:  # an approver site: sign with its node key, issue nothing
        assert site is not None
        if site.certs is None:
            raise EnrollError(
                f"{args.site}: certs: not set (an approval is signed with the site's node key)"
            )
        path = approve_as_site(request, Path(site.certs), site.site)
        out.print(
            f"[green]ok[/] {escape(str(path))}: {escape(site.site)} approves "
            f"{escape(request.name)}'s request; give it to the CA holder, beside "
            f"{escape(request.path.name)}"
        )
        return 0
    ca_dir = Path(args.certs)
    if site is not None and site.admission.approvals:
        paths = SwarmCerts(ca_dir)
        paths.require(paths.ca_cert)
        ca = load_certificate(paths.ca_cert)
        tally = tally_approvals(
            request,
            ca,
            revoked_serials(paths, ca),
            site.admission.approvals,
            site.admission.approvers,
        )
        require_approvals(tally, request, f"admission.approvals of {args.site}")
    cert, kept = issue_from_request(request, ca_dir, days=args.days, replace=args.replace)
    target = Path(args.out) if args.out else request.path.with_name(f"{request.name}.crt")
    write_certificate(target, cert)
    ca_cert = SwarmCerts(ca_dir).ca_cert
    out.print(
        f"[green]ok[/] {escape(str(target))} (and {escape(str(kept))}): {escape(request.name)}'s "
        f"certificate, {args.days} days"
    )
    out.print(
        f"on the device: copy {escape(target.name)} to nodes/{escape(request.name)}.crt and "
        f"{escape(str(ca_cert))} to ca.crt in its certificate folder"
    )
    return 0
