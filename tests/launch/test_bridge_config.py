"""Bridges between site brokers (``p2pfl broker --bridge``; docs/wire.md, "Bridged brokers and
clustered brokers"): the flag's checks, the generated config (plain, TLS, whole tree and
site-scoped), the bridge identity and ACL, and two real Mosquittos on loopback: presence, a
Will, gossip and inbox cross both ways, and a healed partition leaves each broker with every
node's latest presence."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import aiomqtt
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from p2pfl.cli import main
from p2pfl.launch.bridge import (
    BridgeError,
    Bridges,
    BridgeTarget,
    bridge_config,
    bridge_id,
    bridge_topics,
    bridges_from_flags,
    watch_bridges,
)
from p2pfl.launch.broker import (
    BrokerError,
    BrokerTLS,
    MosquittoBroker,
    have_mosquitto,
    make_broker,
    mosquitto_config,
)
from p2pfl.security.certs import (
    BRIDGE_CN,
    CertError,
    SwarmCerts,
    common_name,
    load_certificate,
    make_swarm_certs,
    verify_member_certificate,
)
from p2pfl.security.signing import tls_context

SWARM = "br"
MiB = 2**20


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize(
    "text, host, port, nodes",
    [
        ("10.0.1.5:1883", "10.0.1.5", 1883, ()),
        (" broker.site-a.lan:8883 ", "broker.site-a.lan", 8883, ()),
        ("[fd00::5]:1883", "fd00::5", 1883, ()),
        ("10.0.1.5:1883=n0,n1", "10.0.1.5", 1883, ("n0", "n1")),
        ("[::1]:1=a.b_c-d", "::1", 1, ("a.b_c-d",)),
    ],
)
def test_a_bridge_target_parses(text, host, port, nodes):
    t = BridgeTarget.parse(text)
    assert (t.host, t.port, t.nodes) == (host, port, nodes)


@pytest.mark.parametrize(
    "text",
    [
        "nope",
        "10.0.1.5",
        ":1883",
        "host:0",
        "host:65536",
        "host:18x3",
        "a b:1883",
        "::1:1883",  # IPv6 needs brackets
        "[nohost]:1883",
        "p2pfl/#:1883",
        "host:1883=",
        "host:1883=n0,,n1",
        "host:1883=n:0",
        "host:1883=n0,n0",
    ],
)
def test_a_malformed_bridge_is_refused_naming_the_flag(text):
    with pytest.raises(BridgeError, match="^--bridge "):
        BridgeTarget.parse(text)


ROSTER = ("n0", "n1", "n2", "n3")


@pytest.mark.parametrize(
    "values, swarm, roster, match",
    [
        (["h:1", "h:1"], SWARM, ROSTER, "given twice"),
        (["h:1=n0"], SWARM, (), "needs the swarm's topology"),
        (["h:1=n9"], SWARM, ROSTER, r"no node \['n9'\]"),
        (["h:1=n0", "g:2=n1,n0"], SWARM, ROSTER, "n0 is already behind h:1"),
        (["h:1=n0,n1,n2,n3"], SWARM, ROSTER, "every node of the swarm is behind it"),
        (["h:1=n0"], None, ROSTER, "needs the swarm's name"),
    ],
)
def test_bridges_are_checked_together(values, swarm, roster, match):
    with pytest.raises(BridgeError, match=match):
        Bridges.parse(values, swarm, roster)


def test_the_flags_read_the_roster_from_the_topology():
    assert bridges_from_flags(None, SWARM) is None
    b = bridges_from_flags(["h:1=a,b"], None, "topologies/synthetic.yaml")
    assert (b.swarm, b.roster, b.targets[0].nodes) == (
        "synthetic",
        ("a", "b", "c", "d"),
        ("a", "b"),
    )
    with pytest.raises(BridgeError, match="is swarm 'synthetic', but --swarm is 'other'"):
        bridges_from_flags(["h:1"], "other", "topologies/synthetic.yaml")
    with pytest.raises(BridgeError, match="--topology is only used with --bridge"):
        bridges_from_flags(None, None, "topologies/synthetic.yaml")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--bridge", "nope"], "--bridge 'nope': expected HOST:PORT"),
        (["--bridge", "127.0.0.1:1=n0"], "needs the swarm's topology"),
        (["--bridge", "127.0.0.1:1", "--broker-kind", "embedded"], "--bridge needs Mosquitto"),
    ],
)
def test_p2pfl_broker_refuses_a_bad_bridge_before_starting(argv, expected, capsys):
    assert main(["broker", "--port", "1", *argv]) == 2
    assert expected in " ".join(capsys.readouterr().err.split())


def test_the_embedded_broker_cannot_bridge():
    with pytest.raises(BrokerError, match="--bridge needs Mosquitto"):
        make_broker("embedded", bridges=Bridges.parse(["127.0.0.1:1883"]))


# ----------------------------------------------------------------------------- the config


def _section(conf: str) -> list[str]:
    lines = conf.splitlines()
    return lines[lines.index(next(x for x in lines if x.startswith("connection "))) :]


def test_a_plain_bridge_carries_the_whole_tree_both_ways():
    bridges = Bridges.parse(["10.0.1.5:1883"], SWARM)
    conf = mosquitto_config("10.0.2.7", 1883, 8.0, None, bridges)
    name = bridge_id("10.0.2.7", 1883, bridges.targets[0], SWARM)
    assert _section(conf) == [
        f"connection {name}",
        "address 10.0.1.5:1883",
        f"remote_clientid {name}",
        "topic p2pfl/br/# both 1",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession true",
        "start_type automatic",
        "keepalive_interval 15",
        "restart_timeout 1 10",
        "notifications true",
        f"bridge_max_packet_size {8 * MiB}",
    ]
    # the broker's own options come first, unchanged
    head = conf.split("\n# bridge to")[0]
    assert f"max_packet_size {8 * MiB}" in head and "max_queued_messages 100000" in head
    assert "bridge_" not in head and "allow_anonymous true" in head
    # a broker of any swarm bridges every swarm; an IPv6 address goes without brackets
    anyswarm = bridge_config(Bridges.parse(["[fd00::5]:1883"]), "::1", 1883, MiB)
    assert "topic p2pfl/# both 1" in anyswarm and "address fd00::5:1883" in anyswarm


def test_a_tls_bridge_presents_the_bridge_identity(tmp_path):
    bridges = Bridges.parse(["site-a:8883", "site-c:8883"], SWARM)
    conf = mosquitto_config("0.0.0.0", 8883, 2.0, tmp_path, bridges)
    assert conf.count("\nconnection ") == 2
    for sect in conf.split("\n# bridge to")[1:]:
        lines = sect.splitlines()
        assert f"bridge_cafile {tmp_path / 'ca.crt'}" in lines
        assert f"bridge_certfile {tmp_path / 'bridge.crt'}" in lines
        assert f"bridge_keyfile {tmp_path / 'bridge.key'}" in lines
        assert "bridge_tls_version tlsv1.2" in lines
        assert "bridge_insecure true" not in lines  # the remote's name is checked
        assert f"bridge_max_packet_size {2 * MiB}" in lines
    assert f"acl_file {tmp_path / 'acl'}" in conf and "require_certificate true" in conf


def test_a_site_scoped_bridge_carries_per_node_only_what_crosses():
    bridges = Bridges.parse(["h:1=n0,n1"], SWARM, ROSTER)
    p = "topic p2pfl/br"
    assert bridge_topics(bridges, bridges.targets[0]) == [
        f"{p}/presence/n2 out 1",
        f"{p}/gossip/n2 out 1",
        f"{p}/inbox/n2 in 1",
        f"{p}/status/n2 out 0",
        f"{p}/presence/n3 out 1",
        f"{p}/gossip/n3 out 1",
        f"{p}/inbox/n3 in 1",
        f"{p}/status/n3 out 0",
        f"{p}/presence/n0 in 1",
        f"{p}/gossip/n0 in 1",
        f"{p}/inbox/n0 out 1",
        f"{p}/status/n0 in 0",
        f"{p}/presence/n1 in 1",
        f"{p}/gossip/n1 in 1",
        f"{p}/inbox/n1 out 1",
        f"{p}/status/n1 in 0",
    ]


def test_a_bridge_to_itself_is_refused():
    with pytest.raises(BridgeError, match="this broker's own listener"):
        mosquitto_config("127.0.0.1", 1883, 8.0, None, Bridges.parse(["127.0.0.1:1883"]))


def test_bridge_ids_are_stable_and_distinct():
    t, u = BridgeTarget.parse("hub:1883"), BridgeTarget.parse("hub:1884")
    assert bridge_id("a", 1, t, SWARM) == bridge_id(
        "a", 1, BridgeTarget.parse("hub:1883=n0"), SWARM
    )
    ids = {bridge_id("a", 1, t, SWARM), bridge_id("b", 1, t, SWARM), bridge_id("a", 2, t, SWARM)}
    ids |= {bridge_id("a", 1, u, SWARM), bridge_id("a", 1, t, None)}
    assert len(ids) == 5 and all(len(i) <= 64 for i in ids)


# ----------------------------------------------------------------------------- identity, ACL


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SwarmCerts:
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), SWARM, ["n0", "n1"])


def test_the_bridge_identity_is_a_client_of_the_swarm_ca_and_never_a_node(certs):
    cert = load_certificate(certs.bridge_cert)
    assert common_name(cert) == BRIDGE_CN
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
    ca = load_certificate(certs.ca_cert)
    cert.verify_directly_issued_by(ca)
    with pytest.raises(CertError):  # no node may present it as its own
        verify_member_certificate(certs.bridge_cert.read_bytes(), ca)
    acl = certs.acl.read_text().splitlines()
    at = acl.index(f"user {BRIDGE_CN}")
    assert acl[at + 1 :] == [
        f"topic readwrite p2pfl/{SWARM}/#",
        "topic readwrite $SYS/broker/connection/+/state",
    ]


def test_extending_keeps_the_bridge_identity_and_an_old_directory_gets_one(certs):
    before = certs.bridge_cert.read_bytes()
    make_swarm_certs(certs.root, SWARM, ["n0", "n1"])
    assert certs.bridge_cert.read_bytes() == before
    certs.bridge_cert.unlink()  # a directory made before bridges existed
    certs.bridge_key.unlink()
    with pytest.raises(CertError, match="bridge.crt: missing"):
        MosquittoBroker(
            tls=BrokerTLS(certs.root, SWARM), bridges=Bridges.parse(["127.0.0.1:1"])
        )._stage_tls()
    make_swarm_certs(certs.root, SWARM, ["n0", "n1"])
    assert certs.bridge_cert.is_file() and certs.bridge_key.is_file()


def test_a_revoked_bridge_identity_stops_a_bridging_broker_before_it_starts(tmp_path):
    """``p2pfl certs --revoke p2pfl:bridge``: the broker's bridges would be refused at every
    handshake, so a bridging broker stops before it starts, naming the files to delete."""
    topo = tmp_path / "t.yaml"
    topo.write_text(f"name: {SWARM}\nnodes: [n0, n1]\n")
    root = tmp_path / "certs"
    assert main(["certs", str(topo), "--out", str(root)]) == 0
    assert main(["certs", str(topo), "--out", str(root), "--revoke", BRIDGE_CN]) == 0
    broker = MosquittoBroker(tls=BrokerTLS(root, SWARM), bridges=Bridges.parse(["127.0.0.1:1"]))
    with pytest.raises(CertError, match=r"bridge\.crt: revoked .*delete bridge\.crt and bridge"):
        broker._stage_tls()


# ----------------------------------------------------------------------------- two Mosquittos

needs_mosquitto = pytest.mark.skipif(not have_mosquitto(), reason="mosquitto is not installed")
ROOT = Path(__file__).resolve().parents[2]

# a node in its own process: Will and retained presence on its site's broker, then waits
NODE = textwrap.dedent(
    """
    import asyncio, sys, aiomqtt
    from p2pfl.security.signing import tls_context
    async def main(port, nid, certs):
        tls = tls_context(certs, nid) if certs else None
        topic = f"p2pfl/br/presence/{nid}"
        will = aiomqtt.Will(topic, b"offline", qos=1, retain=True)
        async with aiomqtt.Client("127.0.0.1", port, identifier=nid, will=will,
                                  tls_context=tls, keepalive=5) as c:
            await c.publish(topic, b"online", qos=1, retain=True)
            print("UP", flush=True)
            await asyncio.Event().wait()
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
    """
)


@contextlib.contextmanager
def _node(port: int, nid: str, certs: Path | None):
    """Node ``nid`` on the broker at ``port``, in a child process (kill it: its Will)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE, str(port), nid, str(certs or "")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "UP"
        yield proc
    finally:
        proc.kill()
        proc.wait()


class _Said:
    """What :func:`watch_bridges` said, awaitable."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = asyncio.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.changed.set()

    async def wait(self, text: str, timeout: float = 20.0) -> None:
        async def seen() -> None:
            while not any(text in x for x in self.lines):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(seen(), timeout)


async def _retained(port: int, tls, quiet: float = 0.5) -> dict[str, bytes]:
    """The retained presence a newcomer at the broker on ``port`` reads (until ``quiet``
    seconds pass without a message)."""
    out: dict[str, bytes] = {}
    async with aiomqtt.Client("127.0.0.1", port, tls_context=tls) as c:
        await c.subscribe("p2pfl/br/presence/+", qos=1)
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                m = await asyncio.wait_for(anext(c.messages), quiet)
                out[str(m.topic).rsplit("/", 1)[1]] = bytes(m.payload)
    return out


async def _holds(port: int, tls, want: dict[str, bytes], timeout: float = 20.0) -> None:
    """Wait until the broker on ``port`` holds exactly ``want`` as retained presence."""

    async def check() -> None:
        while (got := await _retained(port, tls)) != want:
            last[0] = got
            await asyncio.sleep(0.2)

    last: list[dict] = [{}]
    try:
        await asyncio.wait_for(check(), timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"port {port} holds {last[0]}, not {want}")


async def _receive(client: aiomqtt.Client, n: int, timeout: float = 10.0) -> set:
    """The next ``n`` messages as (topic under the swarm, payload)."""

    async def take() -> set:
        got = set()
        while len(got) < n:
            m = await anext(client.messages)
            got.add((str(m.topic).split("/", 2)[2], bytes(m.payload)))
        return got

    return await asyncio.wait_for(take(), timeout)


class _Cable:
    """A TCP relay from a free port to ``target``: :meth:`cut` drops every connection and
    refuses new ones (a partition the bridge notices at once), :meth:`mend` lets them in."""

    def __init__(self, target: int):
        self.target = target
        self.open = True
        self.conns: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer) -> None:
        if not self.open:
            writer.transport.abort()
            return
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.target)
        self.conns += [writer, w2]

        async def pipe(src, dst) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, w2), pipe(r2, writer))

    def cut(self) -> None:
        self.open = False
        for w in self.conns:
            w.transport.abort()
        self.conns.clear()

    def mend(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@needs_mosquitto
@pytest.mark.integration
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
async def test_two_bridged_brokers_relay_presence_will_gossip_and_inbox(tmp_path, certs, secure):
    """n0 at site a, n1 at site b (whose broker bridges to a's): each site holds both
    retained presences, gossip and inbox messages cross both ways, and n1's Will, published
    by site b's broker when n1 dies, reaches site a retained. TLS: the nodes and the bridge
    present certificates and pass the swarm ACL."""
    tls = BrokerTLS(certs.root, SWARM) if secure else None
    a = MosquittoBroker(workdir=tmp_path / "a", tls=tls).start()
    bridges = Bridges.parse([a.address], SWARM)
    b = MosquittoBroker(workdir=tmp_path / "b", tls=tls, bridges=bridges).start()
    root = certs.root if secure else None
    ctx = {n: tls_context(certs.root, n) if secure else None for n in ("n0", "n1")}
    said = _Said()
    try:
        async with watch_bridges(bridges, b.host, b.port, root, say=said):
            await said.wait(f"bridge to {a.address} connected")
            with _node(a.port, "n0", root), _node(b.port, "n1", root) as n1:
                both = {"n0": b"online", "n1": b"online"}
                await _holds(a.port, ctx["n0"], both)
                await _holds(b.port, ctx["n1"], both)
                async with (
                    aiomqtt.Client("127.0.0.1", a.port, tls_context=ctx["n0"]) as c0,
                    aiomqtt.Client("127.0.0.1", b.port, tls_context=ctx["n1"]) as c1,
                ):
                    await c0.subscribe("p2pfl/br/gossip/n1", qos=1)
                    await c0.subscribe("p2pfl/br/inbox/n0", qos=1)
                    await c1.subscribe("p2pfl/br/gossip/n0", qos=1)
                    await c1.subscribe("p2pfl/br/inbox/n1", qos=1)
                    await c0.publish("p2pfl/br/gossip/n0", b"g0", qos=1)
                    await c0.publish("p2pfl/br/inbox/n1", b"pull from n0", qos=1)
                    await c1.publish("p2pfl/br/gossip/n1", b"g1", qos=1)
                    await c1.publish("p2pfl/br/inbox/n0", b"chunk from n1", qos=1)
                    assert await _receive(c0, 2) == {
                        ("gossip/n1", b"g1"),
                        ("inbox/n0", b"chunk from n1"),
                    }
                    assert await _receive(c1, 2) == {
                        ("gossip/n0", b"g0"),
                        ("inbox/n1", b"pull from n0"),
                    }
                n1.kill()  # no DISCONNECT: site b's broker publishes its Will
                n1.wait()
                await _holds(a.port, ctx["n0"], {"n0": b"online", "n1": b"offline"})
    finally:
        b.stop()
        a.stop()


@needs_mosquitto
@pytest.mark.integration
async def test_a_healed_partition_leaves_every_nodes_latest_presence_at_both_sites(tmp_path):
    """A site-scoped bridge (each broker sends only its own nodes' presence) through a
    cable that is cut: while apart, x (site a) moves on and y (site b) dies. Once mended,
    both brokers hold x's new presence and y's Will; neither side's stale copy of the
    other's node comes back. The bridge's watcher says it went down and came back."""
    a = MosquittoBroker(workdir=tmp_path / "a").start()
    cable = _Cable(a.port)
    said = _Said()
    b = None
    try:
        port = await cable.start()
        bridges = Bridges.parse([f"127.0.0.1:{port}=x"], SWARM, ("x", "y"))
        b = MosquittoBroker(workdir=tmp_path / "b", bridges=bridges).start()
        async with (
            watch_bridges(bridges, b.host, b.port, say=said),
            aiomqtt.Client("127.0.0.1", a.port, identifier="x") as x,
        ):
            await said.wait("connected")
            await x.publish("p2pfl/br/presence/x", b"online r0", qos=1, retain=True)
            with _node(b.port, "y", None) as y:
                both = {"x": b"online r0", "y": b"online"}
                await _holds(a.port, None, both)
                await _holds(b.port, None, both)
                cable.cut()
                await said.wait("down")
                await x.publish("p2pfl/br/presence/x", b"online r5", qos=1, retain=True)
                y.kill()
                y.wait()
                await _holds(b.port, None, {"x": b"online r0", "y": b"offline"})
                await _holds(a.port, None, {"x": b"online r5", "y": b"online"})  # a can't know
                said.lines.clear()
                cable.mend()
                await said.wait("connected")
                latest = {"x": b"online r5", "y": b"offline"}
                await _holds(a.port, None, latest)
                await _holds(b.port, None, latest)
                await asyncio.sleep(1.0)  # and nothing stale arrives after
                assert await _retained(a.port, None) == latest
                assert await _retained(b.port, None) == latest
    finally:
        cable.close()
        if b is not None:
            b.stop()
        a.stop()
