"""A swarm only its members can join: certificates, TLS with client certificates and a
per-node ACL on a real Mosquitto, Ed25519 signatures on every message, replay protection."""

from __future__ import annotations

import asyncio
import os
import stat
import time
import uuid

import aiomqtt
import pytest
import torch

from p2pfl.launch.broker import BrokerTLS, MosquittoBroker
from p2pfl.security.certs import (
    CertError,
    SwarmCerts,
    load_certificate,
    make_swarm_certs,
    verify_member_certificate,
)
from p2pfl.security.signing import MessageSecurity, ReplayGuard, tls_context
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

SWARM = "sec"
MEMBERS = ["n0", "n1"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SwarmCerts:
    """The swarm's CA and identities, plus ``rogue``: a CA-signed identity that is not a
    member of the topology (a leaked or extra certificate)."""
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), SWARM, [*MEMBERS, "rogue"])


@pytest.fixture
def tls_broker(certs, tmp_path):
    b = MosquittoBroker(workdir=tmp_path / "broker", tls=BrokerTLS(certs.root, SWARM)).start()
    try:
        yield b
    finally:
        b.stop()


def secure_transport(certs, node_id, port=1, members=MEMBERS, tls=True, **kw) -> Transport:
    return Transport(
        SWARM,
        node_id,
        "127.0.0.1",
        port,
        security=MessageSecurity.from_certs(certs.root, node_id, members, max_age_s=60),
        tls_context=tls_context(certs.root, node_id) if tls else None,
        connect_timeout=10,
        **kw,
    )


# ----------------------------------------------------------------------------- certificates


def test_certs_layout_private_keys_and_extension(certs, tmp_path):
    for p in (certs.ca_cert, certs.ca_key, certs.broker_cert, certs.broker_key, certs.acl):
        assert p.is_file(), p
    for nid in MEMBERS:
        assert stat.S_IMODE(os.stat(certs.node_key(nid)).st_mode) == 0o600
    assert "pattern write p2pfl/sec/gossip/%u" in certs.acl.read_text()
    assert "pattern write p2pfl/sec/status/%u" in certs.acl.read_text()
    # extending signs the newcomer with the same CA and keeps existing identities
    before = certs.node_cert("n0").read_bytes()
    ca_before = certs.ca_cert.read_bytes()
    make_swarm_certs(certs.root, SWARM, ["n0", "n9"])
    assert certs.node_cert("n0").read_bytes() == before
    assert certs.ca_cert.read_bytes() == ca_before
    ca = load_certificate(certs.ca_cert)
    verify_member_certificate(certs.node_cert("n9").read_bytes(), ca, "n9")
    # a device directory without ca.key cannot mint identities
    device = tmp_path / "device"
    (device / "nodes").mkdir(parents=True)
    (device / "ca.crt").write_bytes(ca_before)
    with pytest.raises(CertError, match="ca.key"):
        make_swarm_certs(device, SWARM, ["n5"])


def test_member_certificate_checks(certs, tmp_path):
    ca = load_certificate(certs.ca_cert)
    pem = certs.node_cert("n1").read_bytes()
    verify_member_certificate(pem, ca, "n1")
    other = make_swarm_certs(tmp_path / "other", SWARM, ["n1"])  # another CA, same names
    cases = [
        (other.node_cert("n1").read_bytes(), "n1", "not issued by the swarm CA"),
        (pem, "n0", "is for 'n1'"),
        (certs.broker_cert.read_bytes(), None, "not a node"),
        (certs.ca_cert.read_bytes(), None, "not a p2pfl node"),
        (b"-----BEGIN CERTIFICATE-----\nnope\n", None, "not a PEM"),
        (b"x" * 10_000, None, "too large"),
    ]
    for data, expected, match in cases:
        with pytest.raises(CertError, match=match):
            verify_member_certificate(data, ca, expected)


def test_identity_loading_names_the_bad_file(certs, tmp_path):
    with pytest.raises(CertError, match="n7.crt: missing"):
        MessageSecurity.from_certs(certs.root, "n7", ["n7"])
    mixed = tmp_path / "mixed"
    (mixed / "nodes").mkdir(parents=True)
    (mixed / "ca.crt").write_bytes(certs.ca_cert.read_bytes())
    (mixed / "nodes" / "n0.crt").write_bytes(certs.node_cert("n0").read_bytes())
    (mixed / "nodes" / "n0.key").write_bytes(certs.node_key("n1").read_bytes())
    with pytest.raises(CertError, match="does not match n0.crt"):
        MessageSecurity.from_certs(mixed, "n0", ["n0"])


# ----------------------------------------------------------------------------- replay guard


def test_replay_guard_window_ids_and_low_water_mark():
    g = ReplayGuard(max_age_s=10, capacity=3)
    now = 1000.0
    assert g.check("a", now, now) is None
    assert g.check("a", now, now) == "replayed"
    assert g.check("old", now - 11, now) == "stale"
    assert g.check("future", now + 11, now) == "stale"
    for mid in ("b", "c", "d"):  # capacity 3: "a" is forgotten while still fresh
        assert g.check(mid, now + 1, now + 1) is None
    assert g.low_water == now
    assert g.check("a", now, now + 1) == "stale"  # forgotten, yet never accepted again
    assert g.check("e", now + 2, now + 2) is None


# ----------------------------------------------------------------------------- signatures


def _deliver(receiver: Transport, topic: str, payload: bytes) -> None:
    receiver.inbound.mqtt_message(topic, payload)


def _gossip_pair(certs) -> tuple[Transport, Transport, list[Envelope], str]:
    """n0 receiving (gossip collected in ``seen``) what n1 sends on its gossip topic."""
    n0 = secure_transport(certs, "n0")
    n1 = secure_transport(certs, "n1")
    seen: list[Envelope] = []
    n0.on_gossip = seen.append
    return n0, n1, seen, n1.topic("gossip", "n1")


def test_signed_messages_verify_and_tampering_is_dropped(certs):
    n0, n1, seen, topic = _gossip_pair(certs)
    good = n1._envelope("gossip", 3, {"I": [0.5, 0.5]}).pack(n1._signer(topic))
    _deliver(n0, topic, good)
    assert [e.body for e in seen] == [{"I": [0.5, 0.5]}]

    # one flipped bit in the body
    i = good.index(b"I")
    _deliver(n0, topic, good[:i] + b"J" + good[i + 1 :])
    # re-addressed: a pull request for n0 replayed into n1's inbox
    pull = n1._envelope("pull", 3, {"part": "g"}).pack(n1._signer(n1.topic("inbox", "n0")))
    _deliver(n0, n0.topic("inbox", "n0"), pull)  # the right inbox: accepted (no handler)
    _deliver(n0, n0.topic("gossip", "n1"), pull)  # elsewhere: the signature fails
    # unsigned, and signed by a non-member claiming to be n1
    _deliver(n0, topic, n1._envelope("gossip", 3, {"I": [1.0]}).pack())
    rogue = MessageSecurity.from_certs(certs.root, "rogue", ["rogue"])
    forged = n1._envelope("gossip", 3, {"I": [1.0]}).pack(lambda h: rogue.sign(topic, h))
    _deliver(n0, topic, forged)
    assert len(seen) == 1
    assert n0.dropped["forged"] == 3 and n0.dropped["unsigned"] == 1
    assert n0.dropped["sender_mismatch"] == 0


def test_replayed_and_stale_messages_are_dropped(certs):
    n0, n1, seen, topic = _gossip_pair(certs)
    captured = n1._envelope("gossip", 1, {"k": 1}).pack(n1._signer(topic))
    _deliver(n0, topic, captured)
    _deliver(n0, topic, captured)  # replayed as is
    old = Envelope(SWARM, "n1", 1, "gossip", uuid.uuid4().hex[:16], {"k": 2}, ts=time.time() - 61)
    _deliver(n0, topic, old.pack(n1._signer(topic)))  # validly signed, but too old
    assert [e.body for e in seen] == [{"k": 1}]
    assert n0.dropped["replayed"] == 1 and n0.dropped["stale"] == 1


def test_presence_carries_the_certificate_and_is_ordered(certs):
    # n0 starts knowing no peer key: it learns n1's from n1's signed presence
    n0 = Transport(
        SWARM,
        "n0",
        "127.0.0.1",
        1,
        security=MessageSecurity(
            "n0",
            MessageSecurity.from_certs(certs.root, "n0", ["n0"])._key,
            certs.node_cert("n0").read_bytes(),
            load_certificate(certs.ca_cert),
            set(MEMBERS),
        ),
    )
    assert set(n0.security.keys) == {"n0"}
    n1 = secure_transport(certs, "n1")
    topic = n1.topic("presence", "n1")
    will = n1._presence_payload("offline", will=True)  # made at connect time
    online = n1._presence_payload("online")
    done = n1._presence_payload("done")
    _deliver(n0, topic, online)
    assert n0.peers["n1"]["status"] == "online" and "n1" in n0.security.keys
    _deliver(n0, topic, online)  # the retained copy again: ignored, not an attack
    _deliver(n0, topic, done)
    _deliver(n0, topic, online)  # an older presence replayed
    assert n0.peers["n1"]["status"] == "done"
    _deliver(n0, topic, will)  # the Will outranks every update of its session
    assert n0.peers["n1"]["status"] == "offline"
    assert n0.dropped["replayed"] == 1 and sum(n0.dropped.values()) == 1
    # a non-member's valid certificate does not make it a peer
    rogue = secure_transport(certs, "rogue", members=["rogue"])
    _deliver(n0, rogue.topic("presence", "rogue"), rogue._presence_payload("online"))
    assert "rogue" not in n0.peers and n0.dropped["unknown_signer"] == 1


# ----------------------------------------------------------------------------- on a broker


@pytest.mark.integration
async def test_clients_without_a_swarm_certificate_cannot_connect(certs, tls_broker, tmp_path):
    port = tls_broker.port
    with pytest.raises(aiomqtt.MqttError):  # plain MQTT on the TLS port
        async with aiomqtt.Client("127.0.0.1", port, timeout=3):
            pass
    import ssl

    no_cert = ssl.create_default_context(cafile=str(certs.ca_cert))
    with pytest.raises(aiomqtt.MqttError):  # TLS, but no client certificate
        async with aiomqtt.Client("127.0.0.1", port, tls_context=no_cert, timeout=3) as c:
            await c.subscribe("p2pfl/sec/#")
            await c.publish("p2pfl/sec/gossip/x", b"x", qos=1)
    other = make_swarm_certs(tmp_path / "other", SWARM, ["n0"])  # another swarm's CA
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client(
            "127.0.0.1", port, tls_context=tls_context(other.root, "n0"), timeout=3
        ) as c:
            await c.subscribe("p2pfl/sec/#")
            await c.publish("p2pfl/sec/gossip/x", b"x", qos=1)
    with pytest.raises(TransportError, match="no MQTT broker reachable"):
        async with Transport(SWARM, "n0", "127.0.0.1", port, connect_timeout=3):
            pass
    async with secure_transport(certs, "n0", port) as n0:  # a member gets in
        assert n0.connected


@pytest.mark.integration
async def test_acl_and_signatures_stop_a_connected_rogue(certs, tls_broker):
    """``rogue`` holds a CA-signed certificate but is not a member. The ACL keeps it off
    other nodes' topics; what it may send (inbox messages) fails verification; forged
    weights for a real transfer change nothing in what the puller receives."""
    port = tls_broker.port
    torch.manual_seed(0)
    genuine = {"g.w": torch.randn(300, 300), "h.b": torch.randn(10)}
    prepared = PreparedState.from_state(genuine)
    async with (
        secure_transport(certs, "n0", port, chunk_bytes=64 << 10) as n0,
        secure_transport(certs, "n1", port, chunk_bytes=64 << 10) as n1,
        aiomqtt.Client(
            "127.0.0.1", port, tls_context=tls_context(certs.root, "rogue"), timeout=5
        ) as rogue,
    ):
        gossip: list[Envelope] = []
        n0.on_gossip = gossip.append
        serve_now = asyncio.Event()

        async def serve(env: Envelope) -> None:
            await serve_now.wait()  # let the rogue go first
            await n1.send_state(env.sender, env.id, env.round, prepared)

        n1.on_request = serve
        for _ in range(50):
            if "n1" in n0.peers:
                break
            await asyncio.sleep(0.05)
        pull = asyncio.create_task(n0.pull("n1", 4, "all", timeout=20))
        while not n0.transfers.pending():
            await asyncio.sleep(0.01)
        xfer = n0.transfers.pending()[0]  # assume the transfer id leaked to the rogue
        rogue_key = MessageSecurity.from_certs(certs.root, "rogue", ["rogue"])
        poison = PreparedState.from_state({k: torch.zeros_like(v) for k, v in genuine.items()})
        inbox = "p2pfl/sec/inbox/n0"
        meta = {
            "xfer": xfer,
            "total": len(poison.buf),
            "chunk": len(poison.buf),
            "nchunks": 1,
            "digest": poison.digest_name,
            "hexdigest": poison.hexdigest,
            "index": poison.index,
        }
        forged_meta = Envelope(SWARM, "n1", 4, "xfer_meta", "m" * 16, meta, ts=time.time())
        chunk = Envelope(
            SWARM, "n1", 4, "xfer_chunk", "c" * 16, {"xfer": xfer, "seq": 0},
            memoryview(poison.buf), ts=time.time(),
        )  # fmt: skip
        await rogue.publish(inbox, forged_meta.pack(lambda h: rogue_key.sign(inbox, h)), qos=1)
        await rogue.publish(inbox, forged_meta.pack(), qos=1)  # unsigned
        await rogue.publish(inbox, chunk.pack(lambda h: rogue_key.sign(inbox, h)), qos=1)
        # its own identity, on n1's gossip topic and in n0's name on its presence: the ACL
        await rogue.publish("p2pfl/sec/gossip/n1", b"poison", qos=1)
        await rogue.publish("p2pfl/sec/presence/n1", b"poison", qos=1, retain=True)
        await asyncio.sleep(0.5)
        serve_now.set()
        received = await pull
        for k, v in genuine.items():
            assert torch.equal(received[k], v), k
        assert gossip == [] and n0.peers["n1"]["status"] == "online"
        assert n0.dropped["malformed"] == 0  # the ACL stopped them at the broker
        assert n0.dropped["forged"] == 2 and n0.dropped["unsigned"] == 1
        assert n0.dropped["bad_transfer"] == 0
        # a captured genuine message replayed into the inbox (say by a member that kept it)
        captured = n1._envelope("report", 4, {"x": 1}).pack(n1._signer(inbox))
        reports: list[Envelope] = []
        n0.on_inbox = reports.append
        await n1.mqtt.publish(inbox, captured)
        await rogue.publish(inbox, captured, qos=1)
        await asyncio.sleep(0.5)
        assert len(reports) == 1 and n0.dropped["replayed"] == 1


# ----------------------------------------------------------------------------- commands


def test_certs_command_and_node_refusals(tmp_path, capsys):
    from cryptography import x509

    from p2pfl.cli import main as cli_main

    out = tmp_path / "c"
    assert (
        cli_main(
            ["certs", "topologies/lan-3hosts.yaml", "--out", str(out), "--broker-host", "10.9.8.7"]
        )
        == 0
    )
    made = SwarmCerts(out)
    for nid in ("hospital-a", "jetson-1a", "jetson-1b", "laptop"):
        assert made.node_cert(nid).is_file() and made.node_key(nid).is_file()
    assert made.observer_cert.is_file() and made.observer_key.is_file()  # the dashboard's
    assert "observer.crt + observer.key" in capsys.readouterr().err  # the console: stderr
    sans = load_certificate(made.broker_cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert "10.9.8.7" in {str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)}
    # no node pinned to this host
    assert cli_main(["node", "topologies/lan-3hosts.yaml", "--host", "nowhere"]) == 2
    assert "no node pinned to host 'nowhere'" in capsys.readouterr().err
    # security on without a certificate directory, then one lacking this node's identity
    topo = "topologies/synthetic.yaml"
    assert cli_main(["node", topo, "--id", "a", "--set", "security.sign=true"]) == 2
    assert "security.certs" in capsys.readouterr().err
    assert (
        cli_main(["node", topo, "--id", "a", "--set", "security.tls=true", "--certs", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert "a.crt" in err and "missing" in err


@pytest.mark.integration
async def test_a_revoked_node_is_refused_by_the_broker_and_by_its_peers(tmp_path):
    from p2pfl.cli import main as cli_main

    root = tmp_path / "c"
    topo = tmp_path / "t.yaml"
    topo.write_text(f"name: {SWARM}\nnodes: [n0, n1, n2]\n")
    assert cli_main(["certs", str(topo), "--out", str(root)]) == 0
    paths = SwarmCerts(root)
    n1_pem = paths.node_cert("n1").read_bytes()
    assert cli_main(["certs", str(topo), "--out", str(root), "--revoke", "n1"]) == 0
    assert cli_main(["certs", str(topo), "--out", str(root), "--revoke", "n2"]) == 0
    from p2pfl.security.certs import load_crl

    crl = load_crl(paths, load_certificate(paths.ca_cert))
    assert len(list(crl)) == 2  # earlier revocations are kept
    # peers: n1's certificate is skipped at load and refused when it presents it
    n0 = MessageSecurity.from_certs(root, "n0", ["n0", "n1"])
    assert "n1" not in n0.keys
    assert n0.learn("n1", n1_pem) == "certificate revoked"
    with pytest.raises(CertError, match="revoked"):
        MessageSecurity.from_certs(root, "n1", ["n0", "n1"])
    # the broker: n0 gets in, n1 is refused at the handshake
    with MosquittoBroker(workdir=tmp_path / "b", tls=BrokerTLS(root, SWARM)) as broker:
        assert "crlfile" in (tmp_path / "b" / "mosquitto.conf").read_text()
        async with aiomqtt.Client(
            "127.0.0.1", broker.port, tls_context=tls_context(root, "n0"), timeout=5
        ) as c:
            await c.publish("p2pfl/sec/presence/n0", b"x", qos=1)
        with pytest.raises(aiomqtt.MqttError):
            async with aiomqtt.Client(
                "127.0.0.1", broker.port, tls_context=tls_context(root, "n1"), timeout=3
            ) as c:
                await c.subscribe("p2pfl/sec/#")
                await c.publish("p2pfl/sec/presence/n1", b"x", qos=1)


def test_a_running_node_takes_a_newer_crl_from_its_folder(tmp_path):
    """A CRL written to the certificate folder while the node runs (a site daemon keeps the
    one its peers spread there) is taken within CRL_CHECK_S: the revoked member's key is
    forgotten, its signatures and its certificate are refused from then on."""
    from p2pfl.security.certs import make_swarm_certs, revoke
    from p2pfl.security.signing import CRL_CHECK_S

    root = tmp_path / "certs"
    make_swarm_certs(root, "s", ["a", "b"], ["127.0.0.1"])
    a = MessageSecurity.from_certs(root, "a", ["a", "b"])
    b = MessageSecurity.from_certs(root, "b", ["a", "b"])
    topic, header = "p2pfl/s/gossip/b", b"round 1"
    assert a.verify("b", topic, header, b.sign(topic, header)) is None
    assert not a.refresh_revocations()  # nothing new
    revoke(root, ["b"])
    a._crl_checked -= CRL_CHECK_S  # as if CRL_CHECK_S had passed
    assert a.verify("b", topic, header, b.sign(topic, header)) == "unknown_signer"
    assert not a.refresh_revocations(now=a._crl_checked + CRL_CHECK_S + 1)  # taken already
    pem = (root / "nodes" / "b.crt").read_bytes()
    assert a.verify_presence("b", topic, header, b.sign(topic, header), pem) == "bad_certificate"
    assert a.verify("a", topic, header, a.sign(topic, header)) is None  # its own key stays
