"""The dashboard watching a TLS swarm (docs/wire.md, "Security"; docs/architecture.md,
"Dashboard"): ``p2pfl certs`` issues a read-only observer identity; on a real TLS-only
Mosquitto with the generated ACL the observer reads presence and status telemetry, every
publish of its is refused by the broker, and the dashboard's live state follows a real
signed TLS swarm."""

from __future__ import annotations

import asyncio
import queue
import ssl
import uuid
from pathlib import Path

import aiomqtt
import paho.mqtt.client as paho
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from waiting import wait_until

from p2pfl.check.load import load_topology
from p2pfl.config.schema import dump_topology
from p2pfl.dashboard.observer import observer_tls_context
from p2pfl.dashboard.server import Dashboard
from p2pfl.launch.broker import BrokerTLS, MosquittoBroker
from p2pfl.launch.swarm import spawn_worker, stop_workers
from p2pfl.security.certs import (
    OBSERVER_CN,
    CertError,
    SwarmCerts,
    common_name,
    load_certificate,
    make_swarm_certs,
    mosquitto_acl,
    verify_member_certificate,
)
from p2pfl.security.signing import tls_context
from p2pfl.wire.status import PHASES

SWARM = "obs"
NODES = ["a", "b"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SwarmCerts:
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), SWARM, NODES)


@pytest.fixture
def tls_broker(certs, tmp_path):
    b = MosquittoBroker(workdir=tmp_path / "broker", tls=BrokerTLS(certs.root, SWARM)).start()
    try:
        yield b
    finally:
        b.stop()


# ----------------------------------------------------------------------------- the identity


def test_certs_issue_a_read_only_observer_identity(certs, tmp_path):
    cert = load_certificate(certs.observer_cert)
    assert common_name(cert) == OBSERVER_CN
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # not Ed25519: it never passes as a node identity (nor can a node be named it)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    with pytest.raises(CertError):
        verify_member_certificate(certs.observer_cert.read_bytes(), load_certificate(certs.ca_cert))
    assert oct(certs.observer_key.stat().st_mode & 0o777) == "0o600"
    before = certs.observer_cert.read_bytes()
    make_swarm_certs(certs.root, SWARM, ["c"])  # extending keeps it
    assert certs.observer_cert.read_bytes() == before
    acl = mosquitto_acl(SWARM)
    lines = acl.splitlines()
    start = lines.index(f"user {OBSERVER_CN}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("user ", "#")))
    observer = lines[start:end]  # the observer's own entries
    assert len(observer) == 7, observer
    assert "topic deny p2pfl/obs/sites/#" in observer  # site daemons' messages
    assert "topic read p2pfl/obs/presence/+" in observer
    assert "topic read p2pfl/obs/status/+" in observer
    assert "topic deny p2pfl/obs/inbox/+" in observer
    assert not any(" write " in line or " readwrite " in line for line in observer)
    assert isinstance(observer_tls_context(certs.root), ssl.SSLContext)
    # a directory without one (made before observers existed) is named
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "ca.crt").write_bytes(certs.ca_cert.read_bytes())
    with pytest.raises(CertError, match="observer.crt"):
        observer_tls_context(bare)
    # a node's identity put in its place is refused
    (bare / "observer.crt").write_bytes(certs.node_cert("a").read_bytes())
    (bare / "observer.key").write_bytes(certs.node_key("a").read_bytes())
    with pytest.raises(CertError, match="not 'p2pfl:observer'"):
        observer_tls_context(bare)


# ----------------------------------------------------------------------------- the broker


def _observer_publishes(certs: SwarmCerts, port: int, topics: list[str]) -> dict[str, str]:
    """Publish on each of ``topics`` (QoS 1, MQTT 5) with the observer identity; return the
    broker's PUBACK reason for each (paho, in its own network thread)."""
    acks: queue.Queue = queue.Queue()
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2,
        client_id=f"p2pfl-test-observer-{uuid.uuid4().hex[:6]}",
        protocol=paho.MQTTv5,
    )
    client.tls_set_context(observer_tls_context(certs.root))
    client.on_publish = lambda _c, _u, mid, reason, _p: acks.put((mid, str(reason)))
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        mids = {client.publish(t, b"from the observer", qos=1).mid: t for t in topics}
        out = {}
        while len(out) < len(mids):
            mid, reason = acks.get(timeout=10)
            out[mids[mid]] = reason
        return out
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.mark.integration
async def test_the_observer_reads_telemetry_and_its_publishes_are_refused(certs, tls_broker):
    port = tls_broker.port
    node_ctx, obs_ctx = tls_context(certs.root, "a"), observer_tls_context(certs.root)
    async with (
        aiomqtt.Client("127.0.0.1", port, tls_context=node_ctx, timeout=5) as node,
        aiomqtt.Client("127.0.0.1", port, tls_context=obs_ctx, timeout=5) as observer,
    ):
        await node.subscribe(f"p2pfl/{SWARM}/#")
        await observer.subscribe(f"p2pfl/{SWARM}/#")
        # every topic a node may publish on, a node's inbox, and the observer's own
        forged = [
            f"p2pfl/{SWARM}/{channel}/{who}"
            for channel in ("presence", "gossip", "status", "inbox")
            for who in ("a", OBSERVER_CN)
        ] + ["elsewhere/x"]
        refused = await asyncio.to_thread(_observer_publishes, certs, port, forged)
        assert refused == dict.fromkeys(forged, "Not authorized")
        # what the node sends after them: it hears nothing of the observer's before its own
        # (each subscriber's messages leave the broker in the order it took them)
        for channel in ("gossip", "inbox", "presence", "status"):
            await node.publish(f"p2pfl/{SWARM}/{channel}/a", channel.encode(), qos=1)
        heard: dict[str, list[tuple[str, bytes]]] = {"node": [], "observer": []}

        async def listen(client: aiomqtt.Client, name: str, last: str) -> None:
            async for message in client.messages:
                heard[name].append((str(message.topic), bytes(message.payload)))
                if str(message.topic) == last:
                    return

        last = f"p2pfl/{SWARM}/status/a"
        await asyncio.wait_for(
            asyncio.gather(listen(node, "node", last), listen(observer, "observer", last)), 10
        )
    # the node hears its own messages on the topics it reads (its inbox too), none of the
    # observer's
    assert heard["node"] == [
        (f"p2pfl/{SWARM}/gossip/a", b"gossip"),
        (f"p2pfl/{SWARM}/inbox/a", b"inbox"),
        (f"p2pfl/{SWARM}/presence/a", b"presence"),
        (f"p2pfl/{SWARM}/status/a", b"status"),
    ]
    # the observer reads presence and status only: no gossip, no inbox
    assert heard["observer"] == [
        (f"p2pfl/{SWARM}/presence/a", b"presence"),
        (f"p2pfl/{SWARM}/status/a", b"status"),
    ]


# ----------------------------------------------------------------------------- the dashboard


@pytest.mark.integration
async def test_the_dashboard_follows_a_signed_tls_swarm(tmp_path):
    """Four UA-PDFL nodes (one process, synthetic data, three rounds) on the TLS-only broker,
    signing every message: the dashboard, given only the run directory (its config names
    the swarm's certificate directory), observes with the observer identity and sees each
    node's phases, the pulls between neighbours and every node done."""
    swarm_certs = make_swarm_certs(tmp_path / "certs", "synthetic", ["a", "b", "c", "d"])
    broker = MosquittoBroker(
        workdir=tmp_path / "swarm-broker", tls=BrokerTLS(swarm_certs.root, "synthetic")
    ).start()
    try:
        cfg = load_topology(
            "topologies/synthetic.yaml",
            [
                "rounds=3",
                "timing.linger_s=2",
                f"broker={broker.address}",
                "security.tls=true",
                "security.sign=true",
                f"security.certs={swarm_certs.root}",
            ],
        )
        run = tmp_path / "run"
        run.mkdir()
        (run / "config.yaml").write_text(dump_topology(cfg))
        dash = Dashboard(run, poll_s=0.1)
        await dash.start()
        seen: dict[str, set[str]] = {nid: set() for nid in cfg.node_ids}
        try:
            await wait_until(lambda: dash.live is not None and dash.live.connected, 15, "connect")
            snap = dash.snapshot()
            assert snap["broker"]["address"] == broker.address
            assert "over TLS (observer identity)" in snap["broker"]["note"], snap["broker"]
            worker = spawn_worker(run / "config.yaml", cfg.node_ids, broker.address, run, False)
            try:
                while worker.proc.poll() is None:  # every phase each node went through
                    for nid, phase in dash.live.phases.items():
                        seen[nid].add(phase.phase)
                    await asyncio.sleep(0.01)
                await wait_until(
                    lambda: (
                        len(dash.live.presence) == 4
                        and all(p.status != "online" for p in dash.live.presence.values())
                    ),
                    10,
                    "every node's last presence",
                )
            finally:
                stop_workers([worker])
            assert worker.proc.returncode == 0, worker.log_path.read_text()[-2000:]
            await wait_until(
                lambda: [n["state"] for n in dash.snapshot()["nodes"]] == ["done"] * 4,
                10,
                "every node done on the page",
            )
            live = dash.live
            assert not live.dropped, live.dropped  # signed envelopes read as well
            assert {p.dst for p in live.pulls} == set(cfg.node_ids)
            assert all(seen[nid] & set(PHASES) for nid in cfg.node_ids), seen
            assert set().union(*seen.values()) == set(PHASES), seen
        finally:
            await dash.close()
    finally:
        broker.stop()
    log = (run / "logs").glob("*.log")
    assert not any("Traceback" in p.read_text() for p in log)


def _tls_run(tmp_path, certs_dir) -> Path:
    """A run directory of a TLS swarm whose certificates are in ``certs_dir`` and whose
    broker is gone (127.0.0.1:1), as the dashboard reads it."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["broker=127.0.0.1:1", "security.tls=true", f"security.certs={certs_dir}"],
    )
    (run / "config.yaml").write_text(dump_topology(cfg))
    return run


async def test_without_an_observer_identity_the_dashboard_says_why(certs, tmp_path):
    """A TLS swarm whose certificate directory has no observer identity (made before
    observers existed): records only, and the page names the directory and the fix."""
    old = tmp_path / "old-certs"
    old.mkdir()
    (old / "ca.crt").write_bytes(certs.ca_cert.read_bytes())
    run = _tls_run(tmp_path, old)
    dash = Dashboard(run, poll_s=0.1)
    await dash.start()
    try:
        snap = dash.snapshot()
        assert dash.live is None and snap["broker"]["address"] is None
        assert str(old) in snap["broker"]["note"] and "p2pfl certs" in snap["broker"]["note"]
    finally:
        await dash.close()
    # given a directory that has one (``certs``), it observes (here: a broker that is gone)
    dash = Dashboard(run, poll_s=0.1, certs=certs.root)
    await dash.start()
    try:
        assert dash.live is not None
        await wait_until(lambda: "unreachable" in dash.snapshot()["broker"]["note"], 10, "note")
        assert dash.snapshot()["broker"]["address"] == "127.0.0.1:1"
    finally:
        await dash.close()


@pytest.mark.integration
async def test_a_revoked_observer_is_refused_and_can_be_issued_anew(tmp_path, capsys):
    """``p2pfl certs --revoke p2pfl:observer``: the broker refuses the observer at the
    handshake (a context made before the revocation included), the dashboard shows the
    records only and says why, and once the named files are deleted ``p2pfl certs`` issues
    a new identity the broker accepts."""
    from p2pfl.cli import main as cli_main

    root = tmp_path / "certs"
    topo = tmp_path / "t.yaml"
    topo.write_text(f"name: {SWARM}\nnodes: [{', '.join(NODES)}]\n")
    assert cli_main(["certs", str(topo), "--out", str(root)]) == 0
    paths = SwarmCerts(root)
    before = observer_tls_context(root)
    assert cli_main(["certs", str(topo), "--out", str(root), "--revoke", "nobody"]) == 2
    assert OBSERVER_CN in capsys.readouterr().err  # the names --revoke takes
    assert cli_main(["certs", str(topo), "--out", str(root), "--revoke", OBSERVER_CN]) == 0
    assert "delete observer.crt and observer.key" in capsys.readouterr().err
    with pytest.raises(CertError, match="revoked"):
        observer_tls_context(root)
    # the dashboard: the records only, and why
    dash = Dashboard(_tls_run(tmp_path, root), poll_s=0.1)
    await dash.start()
    try:
        assert dash.live is None and "revoked" in dash.snapshot()["broker"]["note"]
    finally:
        await dash.close()
    with MosquittoBroker(workdir=tmp_path / "b", tls=BrokerTLS(root, SWARM)) as broker:
        async with aiomqtt.Client(
            "127.0.0.1", broker.port, tls_context=tls_context(root, "a"), timeout=5
        ) as node:
            await node.publish(f"p2pfl/{SWARM}/status/a", b"x", qos=1)
        with pytest.raises(aiomqtt.MqttError):
            async with aiomqtt.Client("127.0.0.1", broker.port, tls_context=before, timeout=3):
                pass
    # issued anew: a certificate the CRL does not hold, which the broker lets in
    paths.observer_cert.unlink()
    paths.observer_key.unlink()
    assert cli_main(["certs", str(topo), "--out", str(root)]) == 0
    after = observer_tls_context(root)
    with MosquittoBroker(workdir=tmp_path / "b2", tls=BrokerTLS(root, SWARM)) as broker:
        async with aiomqtt.Client("127.0.0.1", broker.port, tls_context=after, timeout=5) as c:
            await c.subscribe(f"p2pfl/{SWARM}/status/+")
