"""Enrolment where the key never leaves the device (``p2pfl enroll``,
:mod:`p2pfl.security.enroll`): the request holds no private key, the certificate the CA
holder issues from it is a node identity like ``p2pfl certs``' own, a tampered, reserved,
non-Ed25519 or already-held name is refused, and with ``admission: {approvals: M}`` only M
valid approvals of listed, unrevoked approvers of this very request let it through."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cli_run import run_p2pfl
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from p2pfl.cli import main
from p2pfl.config.schema import ID_PATTERN
from p2pfl.security.certs import (
    BRIDGE_CN,
    OBSERVER_CN,
    SwarmCerts,
    load_certificate,
    load_private_key,
    make_swarm_certs,
    revoke,
    revoked_serials,
    verify_member_certificate,
)
from p2pfl.security.enroll import (
    EnrollError,
    approval_path,
    approve_as_site,
    build_request,
    create_request,
    issue_from_request,
    read_request,
    require_approvals,
    tally_approvals,
)
from p2pfl.security.signing import tls_context
from p2pfl.sites.daemon.site_file import load_site

ROOT = Path(__file__).resolve().parents[2]
SWARM = "enr"
APPROVERS = ["hospital-a", "hospital-b"]


@pytest.fixture
def ca(tmp_path) -> SwarmCerts:
    """The CA holder's folder: the swarm CA, the approver sites, an unlisted site and the
    CA holder's own site."""
    return make_swarm_certs(tmp_path / "ca", SWARM, [*APPROVERS, "lab-x", "ca-site"])


def site_file(folder: Path, name: str, certs: Path, admission: str = "") -> Path:
    """A site file for ``name`` whose certificate folder is ``certs``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    text = f"site: {name}\nswarm: {SWARM}\ncerts: {certs}\nstate_dir: state-{name}\n"
    path.write_text(text + (f"admission: {admission}\n" if admission else ""))
    return path


def request_for(tmp_path: Path, name: str = "newsite") -> tuple[Path, Path]:
    """The device's certificate folder and the request it made for ``name``."""
    device = tmp_path / "device"
    key_path, pem = create_request(name, device, name_pattern=ID_PATTERN)
    req = tmp_path / "inbox" / f"{name}.request.pem"
    req.parent.mkdir(exist_ok=True)
    req.write_bytes(pem)
    return device, req


def p2pfl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_p2pfl(*args, cwd=cwd, env={"COLUMNS": "200"})


def install(device: Path, name: str, cert: Path, ca: SwarmCerts) -> None:
    """What the device does with the CA holder's answer."""
    shutil.copy(cert, SwarmCerts(device).node_cert(name))
    shutil.copy(ca.ca_cert, SwarmCerts(device).ca_cert)


# ----------------------------------------------------------------------------- request, issue


def test_request_then_approve_through_the_command_line(ca, tmp_path):
    device = tmp_path / "device"
    made = p2pfl("enroll", "request", "--site", "newsite", "--certs", str(device), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    key_path = SwarmCerts(device).node_key("newsite")
    req = tmp_path / "newsite.request.pem"
    assert str(key_path.relative_to(tmp_path)) in made.stdout and req.name in made.stdout
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert b"PRIVATE" not in req.read_bytes()  # the key never left: the request is public
    csr = x509.load_pem_x509_csr(req.read_bytes())
    device_key = load_private_key(key_path)
    assert csr.public_key() == device_key.public_key()

    issued = p2pfl("enroll", "approve", str(req), "--certs", str(ca.root), cwd=tmp_path)
    assert issued.returncode == 0, issued.stderr
    cert_path = tmp_path / "newsite.crt"
    assert "newsite.crt" in issued.stdout and "ca.crt" in issued.stdout
    assert ca.node_cert("newsite").read_bytes() == cert_path.read_bytes()
    key = verify_member_certificate(cert_path.read_bytes(), load_certificate(ca.ca_cert), "newsite")
    assert key == device_key.public_key()
    install(device, "newsite", cert_path, ca)
    assert tls_context(device, "newsite") is not None  # it serves as the node's TLS identity

    again = p2pfl("enroll", "approve", str(req), "--certs", str(ca.root), cwd=tmp_path)
    assert again.returncode == 2
    assert "already holds a certificate" in again.stderr and "Traceback" not in again.stderr


def test_a_bad_request_is_one_line_exit_2_without_a_traceback(ca, tmp_path):
    bad = tmp_path / "bad.request.pem"
    bad.write_text("not a request\n")
    run = p2pfl("enroll", "approve", str(bad), "--certs", str(ca.root), cwd=tmp_path)
    assert run.returncode == 2
    assert f"{bad}: not a PEM certificate request" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_an_enrolled_certificate_is_issued_like_a_generated_one(ca, tmp_path):
    device, req = request_for(tmp_path)
    cert, kept = issue_from_request(read_request(req, name_pattern=ID_PATTERN), ca.root, days=30)
    assert kept == ca.node_cert("newsite") and kept.is_file()
    generated = load_certificate(ca.node_cert("hospital-a"))
    assert cert.issuer == generated.issuer
    assert [a.oid for a in cert.subject] == [a.oid for a in generated.subject]
    assert {e.value for e in cert.extensions} == {e.value for e in generated.extensions}
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert days == 30  # 30 days, from five minutes before now
    pub = cert.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    device_key = load_private_key(SwarmCerts(device).node_key("newsite"))
    assert pub == device_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


def test_an_existing_key_is_kept_unless_forced(tmp_path):
    device, _ = request_for(tmp_path)
    key_path = SwarmCerts(device).node_key("newsite")
    before = key_path.read_bytes()
    with pytest.raises(EnrollError, match="a key already exists"):
        create_request("newsite", device, name_pattern=ID_PATTERN)
    assert key_path.read_bytes() == before
    key_path.chmod(0o644)
    create_request("newsite", device, name_pattern=ID_PATTERN, force=True)
    assert key_path.read_bytes() != before
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_a_tampered_request_is_refused(ca, tmp_path):
    _, req = request_for(tmp_path)
    der = x509.load_pem_x509_csr(req.read_bytes()).public_bytes(serialization.Encoding.DER)
    assert der.count(b"newsite") == 1
    forged = x509.load_der_x509_csr(der.replace(b"newsite", b"evilsit"))
    req.write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(EnrollError, match="signature does not verify"):
        read_request(req, name_pattern=ID_PATTERN)
    assert not ca.node_cert("evilsit").exists()


@pytest.mark.parametrize(
    "name, why",
    [
        (BRIDGE_CN, "reserved"),
        (OBSERVER_CN, "reserved"),
        (f"p2pfl {SWARM} CA", "reserved"),
        (f"p2pfl {SWARM} broker", "reserved"),
        ("two words", "not a valid node id"),
        ("../evil", "not a valid node id"),
    ],
)
def test_a_name_no_node_may_hold_is_refused(tmp_path, name, why):
    req = tmp_path / "req.pem"
    csr = build_request(name, ed25519.Ed25519PrivateKey.generate())
    req.write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(EnrollError, match=why) as exc:
        read_request(req, name_pattern=ID_PATTERN)
    assert str(exc.value).startswith(f"{req}: ")
    with pytest.raises(EnrollError, match=why):  # nor does a device make a key for it
        create_request(name, tmp_path / "device", name_pattern=ID_PATTERN)
    assert not (tmp_path / "device").exists()


def test_a_request_on_another_key_type_is_refused(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "ecsite")]))
        .sign(key, hashes.SHA256())
    )
    req = tmp_path / "ec.request.pem"
    req.write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(EnrollError, match="not Ed25519"):
        read_request(req, name_pattern=ID_PATTERN)


def test_a_name_with_a_valid_certificate_needs_replace(ca, tmp_path):
    _, req = request_for(tmp_path, "hospital-a")
    request = read_request(req, name_pattern=ID_PATTERN)
    before = ca.node_cert("hospital-a").read_bytes()
    with pytest.raises(EnrollError, match="already holds a certificate.*--replace"):
        issue_from_request(request, ca.root, days=30)
    assert ca.node_cert("hospital-a").read_bytes() == before
    cert, _ = issue_from_request(request, ca.root, days=30, replace=True)
    assert cert.public_key() == request.public_key


def test_a_revoked_name_is_issued_anew_without_replace(ca, tmp_path):
    revoke(ca.root, ["hospital-a"])
    _, req = request_for(tmp_path, "hospital-a")
    request = read_request(req, name_pattern=ID_PATTERN)
    cert, _ = issue_from_request(request, ca.root, days=30)
    ca_cert = load_certificate(ca.ca_cert)
    verify_member_certificate(
        ca.node_cert("hospital-a").read_bytes(), ca_cert, "hospital-a", revoked_serials(ca, ca_cert)
    )


# ----------------------------------------------------------------------------- M of N


def test_two_of_two_approvals_are_needed_through_the_command_line(ca, tmp_path, capsys):
    _, req = request_for(tmp_path)
    holder = site_file(
        tmp_path / "sites",
        "ca-site",
        ca.root,
        "{approvals: 2, approvers: [hospital-a, hospital-b]}",
    )
    assert (
        main(
            [
                "enroll",
                "approve",
                str(req),
                "--site",
                str(site_file(tmp_path / "sites", "hospital-a", ca.root)),
            ]
        )
        == 0
    )
    assert approval_path(req, "hospital-a").is_file()
    assert (
        main(["enroll", "approve", str(req), "--certs", str(ca.root), "--site", str(holder)]) == 2
    )
    err = capsys.readouterr().err
    assert "1 of the 2 approvals" in err and "missing: hospital-b" in err, err
    assert f"admission.approvals of {holder}" in err
    assert not ca.node_cert("newsite").exists()

    assert (
        main(
            [
                "enroll",
                "approve",
                str(req),
                "--site",
                str(site_file(tmp_path / "sites", "hospital-b", ca.root)),
            ]
        )
        == 0
    )
    assert (
        main(["enroll", "approve", str(req), "--certs", str(ca.root), "--site", str(holder)]) == 0
    )
    assert (req.parent / "newsite.crt").is_file()
    verify_member_certificate(
        ca.node_cert("newsite").read_bytes(), load_certificate(ca.ca_cert), "newsite"
    )


def test_without_an_admission_rule_the_ca_holder_alone_issues(ca, tmp_path):
    _, req = request_for(tmp_path)
    holder = site_file(tmp_path / "sites", "ca-site", ca.root)
    assert load_site(holder).admission.approvals == 0
    assert (
        main(["enroll", "approve", str(req), "--certs", str(ca.root), "--site", str(holder)]) == 0
    )
    assert ca.node_cert("newsite").is_file()


def test_an_approver_site_needs_its_certificates(ca, tmp_path, capsys):
    _, req = request_for(tmp_path)
    path = tmp_path / "bare.yaml"
    path.write_text(f"site: hospital-a\nswarm: {SWARM}\nstate_dir: state\n")
    assert main(["enroll", "approve", str(req), "--site", str(path)]) == 2
    assert f"{path}: certs: not set" in capsys.readouterr().err
    assert not approval_path(req, "hospital-a").exists()


def tally(ca: SwarmCerts, req: Path, approvers=APPROVERS):
    request = read_request(req, name_pattern=ID_PATTERN)
    ca_cert = load_certificate(ca.ca_cert)
    return request, tally_approvals(request, ca_cert, revoked_serials(ca, ca_cert), 2, approvers)


def test_two_valid_listed_approvals_are_enough(ca, tmp_path):
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    for site in APPROVERS:
        approve_as_site(request, ca.root, site)
    _, counted = tally(ca, req)
    assert counted.valid == tuple(APPROVERS) and counted.enough and counted.refused == ()
    require_approvals(counted, request, "the rule")


def test_one_approver_counts_once_whatever_its_files(ca, tmp_path):
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    path = approve_as_site(request, ca.root, "hospital-a")
    shutil.copy(path, approval_path(req, "hospital-a-again"))
    _, counted = tally(ca, req)
    assert counted.valid == ("hospital-a",) and not counted.enough


def test_a_revoked_approvers_approval_does_not_count(ca, tmp_path):
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    for site in APPROVERS:
        approve_as_site(request, ca.root, site)
    revoke(ca.root, ["hospital-b"])
    _, counted = tally(ca, req)
    assert counted.valid == ("hospital-a",) and counted.missing == ("hospital-b",)
    [(name, why)] = counted.refused
    assert name == approval_path(req, "hospital-b").name and "revoked" in why
    with pytest.raises(EnrollError, match="missing: hospital-b.*revoked"):
        require_approvals(counted, request, "the rule")


def test_an_unlisted_sites_approval_does_not_count(ca, tmp_path):
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    approve_as_site(request, ca.root, "hospital-a")
    approve_as_site(request, ca.root, "lab-x")
    _, counted = tally(ca, req)
    assert counted.valid == ("hospital-a",) and not counted.enough
    assert counted.refused == (
        (approval_path(req, "lab-x").name, "lab-x is not among admission.approvers"),
    )


def test_an_approval_of_another_request_does_not_count(ca, tmp_path):
    _, req = request_for(tmp_path)
    _, other = request_for(tmp_path / "other")  # the same name, another device's key
    for site in APPROVERS:
        approve_as_site(read_request(other, name_pattern=ID_PATTERN), ca.root, site)
        shutil.copy(approval_path(other, site), approval_path(req, site))
    _, counted = tally(ca, req)
    assert counted.valid == () and counted.missing == tuple(APPROVERS)
    assert all("approved another request" in why for _, why in counted.refused)
    assert len(counted.refused) == 2


def test_an_altered_or_foreign_approval_does_not_count(ca, tmp_path):
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    path = approve_as_site(request, ca.root, "hospital-a")
    altered = json.loads(path.read_text())
    altered["signed_at"] = "2000-01-01T00:00:00+00:00"
    path.write_text(json.dumps(altered))
    # hospital-b as another swarm's CA certified it: not this CA's
    foreign = make_swarm_certs(tmp_path / "foreign", "other", ["hospital-b"])
    approve_as_site(request, foreign.root, "hospital-b")
    _, counted = tally(ca, req)
    assert counted.valid == ()
    reasons = dict(counted.refused)
    assert "signature does not verify" in reasons[path.name]
    assert "not issued by the swarm CA" in reasons[approval_path(req, "hospital-b").name]


def test_an_approval_under_another_name_does_not_count(ca, tmp_path):
    """lab-x's certificate in an approval that says hospital-b signed it."""
    _, req = request_for(tmp_path)
    request = read_request(req, name_pattern=ID_PATTERN)
    path = approve_as_site(request, ca.root, "lab-x")
    approval = json.loads(path.read_text())
    approval["approver"] = "hospital-b"
    approval_path(req, "hospital-b").write_text(json.dumps(approval))
    path.unlink()
    _, counted = tally(ca, req)
    assert counted.valid == ()
    assert "is for 'lab-x', not 'hospital-b'" in counted.refused[0][1]


@pytest.mark.parametrize(
    "admission, error",
    [
        ("{approvals: 3, approvers: [a, b]}", "more than the 2 approvers"),
        ("{approvals: 1, approvers: [a, a]}", "twice"),
        ("{approvals: 1, approvers: ['a b']}", "site names"),
        ("{approvals: -1, approvers: []}", "greater than or equal to 0"),
    ],
)
def test_an_admission_rule_that_cannot_hold_is_refused(tmp_path, admission, error):
    from p2pfl.errors import ConfigError

    path = site_file(tmp_path, "ca-site", tmp_path, admission)
    with pytest.raises(ConfigError, match=error):
        load_site(path)
