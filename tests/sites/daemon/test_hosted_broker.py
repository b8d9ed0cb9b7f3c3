"""``broker: embedded`` hosts the federation's broker in a site's daemon, on loopback by
default and on ``broker.embedded.listen`` where other hosts must reach it; TLS (Mosquitto,
client certificates, the swarm's ACL) when the site has ``certs``.

Another host is played by a second daemon that reaches the hosted broker on ``127.0.0.2``:
an address of this machine that a broker bound to ``127.0.0.1`` does not answer."""

from __future__ import annotations

import socket

import pytest
from daemon_helpers import Site, spec

from p2pfl.launch.broker import free_port, have_mosquitto
from p2pfl.sites.daemon.site_file import SiteFile

OTHER_HOST = "127.0.0.2"  # this machine, but not the loopback address a default broker binds


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _two_sites_commit(tmp_path, hosted: dict, port: int, **extra) -> None:
    """s1 hosts the broker (``hosted`` is its ``broker``), s2 joins it from OTHER_HOST; a run
    s2 proposes for both commits at both sites."""
    s1 = Site(tmp_path, "s1", hosted, **extra)
    s2 = Site(tmp_path, "s2", f"{OTHER_HOST}:{port}", **extra)
    try:
        s1.start()
        assert s1.ask("status")["broker"] == f"127.0.0.1:{port}"
        s2.start()
        rid = s2.ask("submit", spec=spec(members=["s1", "s2"], rounds=1))["run_id"]
        for site in (s1, s2):
            run = site.wait_status(rid, {"running", "finished"}, 120)
            assert sorted(run["members"]) == ["s1", "s2"]
    finally:
        s2.stop()
        s1.stop()
    assert not _answers("127.0.0.1", port), "the hosted broker outlived its daemon"


def test_a_site_file_reads_the_hosted_brokers_listen_address():
    base = {"site": "a", "swarm": "f", "state_dir": "/tmp/state"}
    assert SiteFile.model_validate({**base, "broker": "embedded"}).hosted_broker.listen == (
        "127.0.0.1:1883"
    )
    anywhere = SiteFile.model_validate(
        {**base, "broker": {"embedded": {"listen": "0.0.0.0:1999"}}}
    ).hosted_broker
    assert anywhere.listen == "0.0.0.0:1999" and anywhere.connect == "127.0.0.1:1999"
    assert SiteFile.model_validate({**base, "broker": "10.0.0.5:1883"}).hosted_broker is None
    with pytest.raises(ValueError, match="embedded.listen"):
        SiteFile.model_validate({**base, "broker": {"embedded": {"listen": "nowhere"}}})
    with pytest.raises(ValueError, match=r"\{embedded: \{listen: HOST:PORT\}\}"):
        SiteFile.model_validate({**base, "broker": {"mosquitto": {}}})


@pytest.mark.integration
def test_a_hosted_broker_on_loopback_is_not_reached_from_another_host(tmp_path):
    """``broker: embedded`` listens on 127.0.0.1 (port 1883, here a free one)."""
    port = free_port()
    hosted = Site(tmp_path, "h", {"embedded": {"listen": f"127.0.0.1:{port}"}})
    try:
        hosted.start()
        assert _answers("127.0.0.1", port)
        assert not _answers(OTHER_HOST, port)
    finally:
        hosted.stop()


@pytest.mark.integration
def test_other_hosts_join_a_hosted_broker_that_listens_beyond_loopback(tmp_path):
    port = free_port()
    _two_sites_commit(tmp_path, {"embedded": {"listen": f"0.0.0.0:{port}"}}, port)


@pytest.mark.integration
def test_a_hosted_broker_takes_tls_when_the_site_has_certs(tmp_path):
    """With certs the hosted broker is Mosquitto with TLS and client certificates: the
    signed sites commit over it, and a client without a certificate is refused."""
    if not have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    import asyncio

    import aiomqtt

    from p2pfl.security.certs import make_swarm_certs

    certs = tmp_path / "certs"
    make_swarm_certs(certs, "fed", ["s1", "s2"], ["127.0.0.1", OTHER_HOST])
    port = free_port()
    hosted = {"embedded": {"listen": f"0.0.0.0:{port}"}}

    async def plain_client() -> None:
        async with aiomqtt.Client(OTHER_HOST, port, timeout=5):
            pass

    s1 = Site(tmp_path, "s1", hosted, certs=str(certs))
    try:
        s1.start()
        assert s1.ask("status")["signed"]
        with pytest.raises(aiomqtt.MqttError):
            asyncio.run(plain_client())
    finally:
        s1.stop()
    _two_sites_commit(tmp_path / "pair", hosted, port, certs=str(certs))
