"""Swarms that span brokers: two sites, each with its own ``p2pfl broker``, joined by a
Mosquitto bridge (``--bridge``; docs/wire.md, "Bridged brokers and clustered brokers").

Sites ``a`` and ``b`` are network namespaces on one bridge. Each site runs two brokers; site
b's bridge to site a's. Every node connects only to its own site's broker. Two swarms run at
once, 4 nodes each, 2 at each site:

- UA-PDFL (decentralized, plain MQTT, plain bridge): every node must take peers from the
  other site every round (with ``com: 2`` among 3 neighbours, one of them is always remote);
- FedAvg (rotating aggregator; TLS, client certificates, the ACL and signatures on the nodes
  and on the bridge): round 1's aggregator is ``n1`` (site a) and round 2's is ``n2`` (site
  b), and each aggregates the uploads of all four nodes.

Needs root and ``ip netns`` (skipped otherwise); everything it creates is removed in
``finally``. ``-s`` prints the figures (wall time, round times, bytes per node).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from netns_helpers import (
    Net,
    Proc,
    remove_staged_tls,
    require_netns,
    synthetic_topology,
    wait_all,
)

from p2pfl.check.load import load_topology
from p2pfl.launch.broker import find_mosquitto
from p2pfl.metrics import read_records
from p2pfl.rounds.rotation.election import aggregator_for
from p2pfl.security.certs import make_swarm_certs

pytestmark = pytest.mark.integration

SITES = {"a": ["n0", "n1"], "b": ["n2", "n3"]}
SITE_OF = {n: s for s, ids in SITES.items() for n in ids}
ROUNDS = 2
BROKER_READY_S = 45.0
DEADLINE_S = 150.0


def _topology(swarm: str, algorithm: str, secure: bool) -> str:
    return synthetic_topology(swarm, SITES, rounds=ROUNDS, algorithm=algorithm, secure=secure)


def _ready(proc: Proc, host: str, swarm: str) -> str:
    m = proc.wait_for(
        rf"broker \w+ on ({re.escape(host)}:\d+) announced for swarm {swarm}", BROKER_READY_S
    )
    assert m, f"{proc.name} did not come up in {BROKER_READY_S:g} s\n{proc.tail()}"
    return m.group(1)


def _bridged(proc: Proc, target: str) -> None:
    line = f"bridge to {target} connected"
    assert proc.wait_for(re.escape(line), BROKER_READY_S), f"no '{line}'\n{proc.tail()}"


def _records(run_dir, logs: str) -> dict[str, list[dict]]:
    out = {}
    for nid in SITE_OF:
        recs = [r for r in read_records(run_dir / "nodes" / f"{nid}.jsonl") if "round" in r]
        assert [r["round"] for r in recs] == list(range(1, ROUNDS + 1)), f"{nid}: {recs}\n{logs}"
        out[nid] = recs
    return out


def _figures(recs: dict[str, list[dict]]) -> dict:
    return {
        nid: {
            "round_s": [r.get("round_s") for r in rs],
            "bytes_sent": sum(r.get("bytes_sent", 0) for r in rs),
            "bytes_recv": sum(r.get("bytes_recv", 0) for r in rs),
            "direct_bytes_recv": sum(r.get("direct_bytes_recv", 0) for r in rs),
        }
        for nid, rs in recs.items()
    }


def test_two_swarms_span_two_bridged_site_brokers(tmp_path):
    ip = require_netns()
    try:
        find_mosquitto()
    except Exception as exc:
        pytest.fail(str(exc))
    net = Net(ip, list(SITES), tag="bs")
    plain, secure = f"bu{net.sfx}", f"bf{net.sfx}"
    topo = {plain: tmp_path / "uapdfl.yaml", secure: tmp_path / "fedavg.yaml"}
    topo[plain].write_text(_topology(plain, "uapdfl", secure=False))
    topo[secure].write_text(_topology(secure, "fedavg", secure=True))
    certs = tmp_path / "certs"
    cfg = load_topology(topo[secure])
    # one broker certificate for both sites: each site's address is in its SANs
    make_swarm_certs(certs, cfg.name, cfg.node_ids, list(net.addr.values()))
    runs = {plain: tmp_path / "run-uapdfl", secure: tmp_path / "run-fedavg"}
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        try:
            net.up()
        except (RuntimeError, OSError) as exc:
            pytest.skip(f"cannot build the network namespaces: {exc}")

        def broker(site: str, swarm: str, *extra: str) -> Proc:
            tls = ["--certs", str(certs)] if swarm == secure else []
            p = Proc(
                net,
                site,
                ["broker", "--host", net.addr[site], "--swarm", swarm, *tls, *extra]
                + ["--workdir", str(tmp_path / f"broker-{site}-{swarm}")],
                tmp_path / f"broker-{site}-{swarm}.log",
            )
            procs.append(p)
            return p

        hub = {s: broker("a", s) for s in (plain, secure)}
        address = {s: _ready(p, net.addr["a"], s) for s, p in hub.items()}
        # the plain swarm bridges its whole topic tree; the secure one names the nodes at
        # site a, so only what site b's nodes send or receive crosses
        scoped = ["--topology", str(topo[secure])]
        spoke = {
            plain: broker("b", plain, "--bridge", address[plain]),
            secure: broker("b", secure, "--bridge", f"{address[secure]}=n0,n1", *scoped),
        }
        local = {("a", s): address[s] for s in hub}
        for s, p in spoke.items():
            local["b", s] = _ready(p, net.addr["b"], s)
            _bridged(p, address[s])
        t_bridged = time.monotonic() - t0

        nodes = []
        for swarm in (plain, secure):
            for site in SITES:
                tls = ["--certs", str(certs)] if swarm == secure else []
                p = Proc(
                    net,
                    site,
                    ["node", str(topo[swarm]), "--host", site, "--broker", local[site, swarm], *tls]
                    + ["--out", str(runs[swarm]), "--no-rich"],
                    tmp_path / f"node-{site}-{swarm}.log",
                )
                procs.append(p)
                nodes.append(p)
        wait_all(nodes, t0 + DEADLINE_S)
        wall = time.monotonic() - t0
        logs = "\n".join(p.tail() for p in procs)
        for p in nodes:
            rc = p.proc.poll()
            assert rc is not None, f"{p.name} still running after {DEADLINE_S:g} s\n{logs}"
            assert rc == 0, f"{p.name} exited with {rc}\n{logs}"

        # UA-PDFL: every node, every round, merged peers from the other site
        dec = _records(runs[plain], logs)
        for nid, recs in dec.items():
            for r in recs:
                remote = [p for p in r["peers"] if SITE_OF[p] != SITE_OF[nid]]
                assert remote, f"{nid} round {r['round']}: no peer from the other site: {r}"

        # FedAvg: the aggregator of round 1 sits at site a, round 2's at site b; each
        # aggregated all four uploads, and every node applied every round on attempt 0
        cen = _records(runs[secure], logs)
        roster = sorted(SITE_OF)
        where = {}
        for rnd in range(1, ROUNDS + 1):
            agg = aggregator_for(rnd, roster)
            where[rnd] = (agg, SITE_OF[agg])
            for nid, recs in cen.items():
                rec = recs[rnd - 1]
                assert rec["aggregator"] == agg and rec["attempt"] == 0, (nid, rec)
                assert not rec["failovers"] and rec["received"], (nid, rec)
                assert sorted(rec["aggregated"]) == roster, (nid, rec)
        assert {site for _, site in where.values()} == set(SITES), where

        # the weights went peer to peer between the sites (the direct lane; mutual TLS in
        # the secure swarm): the bridge carried control traffic only
        for recs in (*dec.values(), *cen.values()):
            for r in recs:
                assert set(r["lanes"].values()) <= {"direct"}, r
        assert all(r["lanes"] for recs in dec.values() for r in recs)

        figures = {
            "wall_s": round(wall, 1),
            "bridges_up_s": round(t_bridged, 1),
            "aggregators": {r: f"{a} (site {s})" for r, (a, s) in where.items()},
            # everything that crossed between the sites (both swarms, mDNS included)
            "site_b_link_bytes": net.link_bytes("b"),
            "uapdfl": _figures(dec),
            "fedavg": _figures(cen),
        }
        print(json.dumps(figures, indent=1))
    finally:
        for proc in reversed(procs):
            proc.stop()
        net.down()
        for site in SITES:
            remove_staged_tls(tmp_path / f"broker-{site}-{secure}" / "mosquitto.conf")
