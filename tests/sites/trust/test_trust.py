"""Trust that spreads (docs/design.md, "Trust that spreads"): numbered CRLs and the ACL
that denies revoked identities, the trust message's checks, and real daemons over a TLS
broker taking a revocation without a restart, then an enrolled site joining a run with
no file of any other site changed."""

from __future__ import annotations

import shutil
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from daemon_helpers import Site, p2pfl_cli, spec, wait

from p2pfl.security.certs import (
    OBSERVER_CN,
    SwarmCerts,
    crl_number,
    load_certificate,
    load_crl,
    make_swarm_certs,
    revoke,
)
from p2pfl.security.trust import TrustError, crl_text, is_newer, revoked_serials_of, verify_crl


def _crl(certs):
    paths = SwarmCerts(certs)
    return load_crl(paths, load_certificate(paths.ca_cert))


def test_revocations_are_numbered_and_the_acl_denies_the_revoked(tmp_path):
    certs = tmp_path / "certs"
    make_swarm_certs(certs, "fed", ["a", "b", "c"], ["127.0.0.1"])
    assert _crl(certs) is None
    revoke(certs, ["c"])
    first = _crl(certs)
    assert crl_number(first) == 1
    revoke(certs, [OBSERVER_CN])
    second = _crl(certs)
    assert crl_number(second) == 2 and len(revoked_serials_of(second)) == 2
    acl = (certs / "acl").read_text()
    assert "user c\ntopic deny #" in acl and f"user {OBSERVER_CN}\ntopic deny #" in acl
    assert "user a\n" not in acl and "user b\n" not in acl
    ca = load_certificate(SwarmCerts(certs).ca_cert)
    assert crl_number(verify_crl(crl_text(second), ca)) == 2
    assert is_newer(second, 1) and not is_newer(first, 1) and not is_newer(first, 2)


def test_a_crl_not_of_the_swarm_ca_is_refused(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    make_swarm_certs(ours, "fed", ["a"], ["127.0.0.1"])
    make_swarm_certs(theirs, "fed", ["a"], ["127.0.0.1"])
    revoke(theirs, ["a"])
    ca = load_certificate(SwarmCerts(ours).ca_cert)
    with pytest.raises(TrustError, match="not signed by the swarm CA"):
        verify_crl(crl_text(_crl(theirs)), ca)
    with pytest.raises(TrustError, match="not a PEM CRL"):
        verify_crl("-----BEGIN X509 CRL-----\njunk\n-----END X509 CRL-----\n", ca)
    with pytest.raises(TrustError, match="at most"):
        verify_crl("A" * (300 * 1024), ca)
    with pytest.raises(TrustError, match="PEM text"):
        verify_crl(b"bytes", ca)
    revoke(ours, ["a"])
    der = bytearray(_crl(ours).public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0xFF  # the signature
    tampered = x509.load_der_x509_crl(bytes(der))
    with pytest.raises(TrustError, match="not signed"):
        verify_crl(crl_text(tampered), ca)


@pytest.mark.one_broker
def test_a_revocation_spreads_to_every_daemon_and_an_enrolled_site_joins(tmp_path):
    """Three sites over a TLS broker, each with a copy of the swarm's certificate folder
    (no folder is shared). The CA holder revokes c and publishes the CRL through a: within
    10 s every daemon has it, with no restart, and c's messages are dropped as revoked.
    Then d enrols (its key made on its device), and a run proposed by a commits with d and
    finishes, no file of a, b or the broker changed."""
    from p2pfl.launch.broker import BrokerTLS, MosquittoBroker

    ca_dir = tmp_path / "ca"
    make_swarm_certs(ca_dir, "fed", ["a", "b", "c"], ["127.0.0.1"])
    made: list[Site] = []
    with MosquittoBroker(workdir=tmp_path / "broker", tls=BrokerTLS(ca_dir, None)) as broker:
        try:
            for name in ("a", "b", "c"):
                own = tmp_path / f"{name}-certs"
                shutil.copytree(ca_dir, own, ignore=shutil.ignore_patterns("ca.key"))
                made.append(Site(tmp_path, name, broker.address, certs=str(own)).start())
            a, b, c = made
            assert all(s.ask("status")["crl_number"] == 0 for s in made)

            revoke(ca_dir, ["c"])
            started = time.monotonic()
            out = p2pfl_cli("trust", "publish", "--certs", str(ca_dir), "--site", str(a.path))
            assert out.returncode == 0, out.stdout + out.stderr
            assert "CRL number 1 (1 revoked)" in out.stdout
            wait(
                lambda: all(s.ask("status")["crl_number"] == 1 for s in (a, b)),
                10,
                "a and b to take the CRL",
            )
            took = time.monotonic() - started
            assert took <= 10, took
            assert (tmp_path / "b-certs" / "crl.pem").is_file()  # kept for its workers
            assert a.proc.pid and b.proc.poll() is None  # no restart

            rid = c.ask("submit", spec=spec("after"))["run_id"]  # c still holds a connection
            for site in (a, b):
                wait(
                    lambda s=site: s.ask("status")["dropped"].get("revoked", 0) >= 1,
                    10,
                    f"{site.name} to drop c's spec",
                )
                assert rid not in site.runs()

            # d enrols: its key never leaves its device; the certificate comes back
            d_certs = tmp_path / "d-certs"
            d_certs.mkdir()
            shutil.copy(ca_dir / "ca.crt", d_certs / "ca.crt")
            req = tmp_path / "d.request.pem"
            out = p2pfl_cli(
                "enroll", "request", "--site", "d", "--certs", str(d_certs), "--out", str(req)
            )
            assert out.returncode == 0, out.stdout + out.stderr
            out = p2pfl_cli("enroll", "approve", str(req), "--certs", str(ca_dir))
            assert out.returncode == 0, out.stdout + out.stderr
            (d_certs / "nodes").mkdir(exist_ok=True)
            shutil.copy(tmp_path / "d.crt", d_certs / "nodes" / "d.crt")
            d = Site(tmp_path, "d", broker.address, certs=str(d_certs))
            made.append(d.start())
            run = a.ask("submit", spec=spec("with-d", members=["a", "b", "d"]))["run_id"]
            for site in (a, b, d):
                done = site.wait_status(run, {"finished"}, 180)
                assert done["members"] == ["a", "b", "d"]
        finally:
            for site in made:
                site.stop()


@pytest.mark.one_broker
def test_the_broker_cuts_a_revoked_identity_off_on_reload_without_a_restart(tmp_path):
    """A p2pfl-run Mosquitto re-reads its ACL on SIGHUP (reload_trust): a revoked node's
    publications stop reaching others over the connection it already holds, while a member
    that is not revoked goes on, and the broker's process is the same."""
    import asyncio

    import aiomqtt

    from p2pfl.launch.broker import BrokerTLS, MosquittoBroker
    from p2pfl.security.signing import tls_context

    certs = tmp_path / "certs"
    make_swarm_certs(certs, "s", ["a", "b", "c"], ["127.0.0.1"])

    async def drill(broker) -> list[str]:
        def client(name):
            return aiomqtt.Client("127.0.0.1", broker.port, tls_context=tls_context(certs, name))

        heard: list[str] = []
        async with client("a") as a, client("b") as b, client("c") as c:
            await a.subscribe("p2pfl/s/presence/+", qos=1)

            async def hear_until(marker: str) -> None:
                async for message in a.messages:
                    heard.append(message.payload.decode())
                    if heard[-1] == marker:
                        return

            async def round_trip(i: int) -> bool:
                """Whether c's publication i reached a (b's marker follows it)."""
                await c.publish("p2pfl/s/presence/c", f"c{i}", qos=1)  # PUBACK: handled
                await b.publish("p2pfl/s/presence/b", f"b{i}", qos=1)
                await asyncio.wait_for(hear_until(f"b{i}"), 10)
                return f"c{i}" in heard

            assert await round_trip(0)  # before: c is heard
            revoke(certs, ["c"])
            pid = broker.proc.pid
            broker.reload_trust()
            deadline = time.monotonic() + 10
            i = 1
            while await round_trip(i):  # SIGHUP is taken between two of its loops
                assert time.monotonic() < deadline, "c still heard 10 s after the reload"
                i += 1
            assert not await round_trip(i + 1)  # and from then on
            assert broker.proc.pid == pid and broker.proc.poll() is None
        return heard

    with MosquittoBroker(workdir=tmp_path / "broker", tls=BrokerTLS(certs, "s")) as broker:
        heard = asyncio.run(drill(broker))
    assert heard[0] == "c0" and heard[-1].startswith("b")
