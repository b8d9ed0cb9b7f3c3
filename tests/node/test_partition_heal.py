"""A swarm split by a partition heals into one (docs/wire.md, "Partitions").

Two sites, ``a`` and ``b``, are network namespaces on one bridge, each with its own
``p2pfl broker``; site b's broker bridges to site a's (as in ``test_bridged_sites.py``).
Two nodes run at each site, each connected only to its own site's broker. When every node
has finished round :data:`CUT_AT`, the cable of site b is unplugged (its port on the bridge
goes down: the Mosquitto bridge and the direct lane between the sites both go dead), and
plugged back in once every node has finished :data:`CUT_ROUNDS` more rounds (or after
:data:`CUT_MAX_S`). Then:

- no round of any node took more than ``K × round_timeout_s`` (:data:`K`, :data:`T`; round
  1, which holds the start, excepted): a member does not wait out the aggregators across
  the cut (FedAvg), nor for peers there;
- FedAvg: the two sides forked (records of both sides name different lineages while cut
  off), and within :data:`HEAL_ROUNDS` rounds of the heal every node names one lineage, to
  the end, where every node holds the same model;
- UA-PDFL (decentralized; unchanged by this work): each side carries on during the cut, and
  after the heal every node merges peers of the other site again.

Every access link is emulated as ``wan`` (100 ms one way), so rounds take about a second
or two, as between two sites: the heal then spans a few rounds rather than dozens. Needs
root and ``ip netns`` (skipped otherwise); everything it creates is removed in
``finally``. ``-s`` prints each run's figures.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

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
from p2pfl.security.certs import make_swarm_certs

pytestmark = pytest.mark.integration

SITES = {"a": ["n0", "n1"], "b": ["n2", "n3"]}
SITE_OF = {n: s for s, ids in SITES.items() for n in ids}
ROUNDS = 30
T = 8.0  # round_timeout_s
K = 2.0  # no round may take more than K × T
CUT_AT = 3  # the cable is cut once every node finished this round
CUT_ROUNDS = 4  # ... and plugged back in once every node finished this many more
CUT_MAX_S = 60.0
HEAL_ROUNDS = 10  # rounds after the heal within which the swarm is one lineage again
# every access link 100 ms one way (the ``wan`` preset): rounds of about a second or two,
# as between two sites, so that a heal (the bridge's stalled TCP resuming) spans few rounds
NETWORK = "network: {default: wan}\n"
BROKER_READY_S = 45.0
DEADLINE_S = 420.0


def _topology(swarm: str, algorithm: str, secure: bool) -> str:
    text = synthetic_topology(swarm, SITES, rounds=ROUNDS, algorithm=algorithm, secure=secure)
    return text.replace("round_timeout_s: 30", f"round_timeout_s: {T:g}") + NETWORK


def _records(run: Path, nid: str) -> list[dict]:
    """The round records ``nid`` wrote so far (a line being written is skipped)."""
    path = run / "nodes" / f"{nid}.jsonl"
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "round" in rec:
            out.append(rec)
    return out


def _wait_rounds(run: Path, at_least: int, timeout: float, procs: list[Proc]) -> bool:
    """Wait until every node's records reach round ``at_least`` (or a node exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(max((r["round"] for r in _records(run, n)), default=0) >= at_least for n in SITE_OF):
            return True
        if any(p.proc.poll() is not None for p in procs):
            return False
        time.sleep(0.2)
    return False


def _cable(net: Net, site: str, up: bool) -> None:
    """Plug ``site``'s cable in (``up``) or out: its port on the bridge, in the bridge's
    namespace (the sites' own namespaces are not touched)."""
    state = "up" if up else "down"
    subprocess.run(
        [net.ip, "-n", net.ns_br, "link", "set", net.ports[site], state],
        check=True,
        capture_output=True,
        timeout=20,
    )


def _models_equal(run: Path) -> bool:
    from safetensors.torch import load_file

    states = [load_file(str(run / "nodes" / f"{n}.safetensors")) for n in SITE_OF]
    first = states[0]
    return all(
        s.keys() == first.keys() and all((s[k] == first[k]).all() for k in first)
        for s in states[1:]
    )


@pytest.mark.parametrize("algorithm", ["fedavg", "uapdfl"])
def test_partition_heals_into_one_swarm(tmp_path, algorithm):
    ip = require_netns()
    try:
        find_mosquitto()
    except Exception as exc:
        pytest.fail(str(exc))
    net = Net(ip, list(SITES), tag="pt")
    swarm = f"pt{algorithm[:2]}{net.sfx}"
    secure = algorithm == "fedavg"  # TLS, the ACL and signatures: bridge state via the ACL
    topo = tmp_path / "topology.yaml"
    topo.write_text(_topology(swarm, algorithm, secure))
    certs = tmp_path / "certs"
    tls: list[str] = []
    if secure:
        cfg = load_topology(topo)
        make_swarm_certs(certs, cfg.name, cfg.node_ids, list(net.addr.values()))
        tls = ["--certs", str(certs)]
    run = tmp_path / "run"
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        try:
            net.up()
        except (RuntimeError, OSError) as exc:
            pytest.skip(f"cannot build the network namespaces: {exc}")

        def broker(site: str, *extra: str) -> tuple[Proc, str]:
            p = Proc(
                net,
                site,
                ["broker", "--host", net.addr[site], "--swarm", swarm, *tls, *extra]
                + ["--workdir", str(tmp_path / f"broker-{site}")],
                tmp_path / f"broker-{site}.log",
            )
            procs.append(p)
            m = p.wait_for(
                rf"broker \w+ on ({re.escape(net.addr[site])}:\d+) announced for swarm {swarm}",
                BROKER_READY_S,
            )
            assert m, f"{p.name} did not come up\n{p.tail()}"
            return p, m.group(1)

        _, hub = broker("a")
        spoke, local_b = broker("b", "--bridge", f"{hub}=n0,n1", "--topology", str(topo))
        line = f"bridge to {hub} connected"
        assert spoke.wait_for(re.escape(line), BROKER_READY_S), f"no '{line}'\n{spoke.tail()}"
        local = {"a": hub, "b": local_b}

        nodes = []
        for site in SITES:
            p = Proc(
                net,
                site,
                ["node", str(topo), "--host", site, "--broker", local[site], *tls]
                + ["--out", str(run), "--no-rich"],
                tmp_path / f"node-{site}.log",
            )
            procs.append(p)
            nodes.append(p)

        def logs() -> str:
            return "\n".join(p.tail(6000) for p in procs)

        assert _wait_rounds(run, CUT_AT, 180.0, nodes), f"no round {CUT_AT}\n{logs()}"
        cut_round = max(max(r["round"] for r in _records(run, n)) for n in SITE_OF)
        _cable(net, "b", up=False)
        t_cut = time.monotonic()
        _wait_rounds(run, cut_round + CUT_ROUNDS, CUT_MAX_S, nodes)
        _cable(net, "b", up=True)
        cut_s = time.monotonic() - t_cut
        heal_round = max(max(r["round"] for r in _records(run, n)) for n in SITE_OF)
        assert heal_round < ROUNDS - HEAL_ROUNDS, f"the run ended while cut off\n{logs()}"

        wait_all(nodes, t0 + DEADLINE_S)
        for p in nodes:
            rc = p.proc.poll()
            assert rc == 0, f"{p.name} exited with {rc}\n{logs()}"
        recs = {n: _records(run, n) for n in SITE_OF}
        for n, rs in recs.items():
            assert rs and rs[-1]["round"] == ROUNDS, f"{n}: {[r['round'] for r in rs]}\n{logs()}"

        # no round waited out the other side: at most K × round_timeout_s, on both sides
        # (round 1 holds the start, first connections and first model build, not the cut)
        slow = {
            n: [(r["round"], r["round_s"]) for r in rs if r["round"] > 1 and r["round_s"] > K * T]
            for n, rs in recs.items()
        }
        figures = {
            "algorithm": algorithm,
            "cut_after_round": cut_round,
            "healed_after_round": heal_round,
            "cut_s": round(cut_s, 1),
            "wall_s": round(time.monotonic() - t0, 1),
            "max_round_s": {n: max(r["round_s"] for r in rs) for n, rs in recs.items()},
        }
        if algorithm == "fedavg":  # round:lineage:attempt
            figures["lineage"] = {
                n: " ".join(f"{r['round']}:{r.get('lineage')}:{r.get('attempt')}" for r in rs)
                for n, rs in recs.items()
            }
        else:  # round:the peers of the other site merged
            figures["remote_peers"] = {
                n: " ".join(
                    f"{r['round']}:{','.join(p for p in r['peers'] if SITE_OF[p] != SITE_OF[n])}"
                    for r in rs
                )
                for n, rs in recs.items()
            }
        print(json.dumps(figures, indent=1))
        assert not any(slow.values()), f"rounds over {K:g} × {T:g} s: {slow}\n{logs()}"

        if algorithm == "fedavg":
            by_round: dict[int, dict[str, str]] = {}
            for n, rs in recs.items():
                for r in rs:
                    by_round.setdefault(r["round"], {})[n] = r["lineage"]
            # the two sides forked while cut off: not one model named twice
            assert any(
                {v for k, v in names.items() if SITE_OF[k] == "a"}.isdisjoint(
                    {v for k, v in names.items() if SITE_OF[k] == "b"}
                )
                for rnd, names in by_round.items()
                if cut_round < rnd <= heal_round and len(names) == len(SITE_OF)
            ), f"no fork recorded: {figures['lineage']}"
            # one lineage from HEAL_ROUNDS after the heal to the end, and one model
            for rnd in range(heal_round + HEAL_ROUNDS, ROUNDS + 1):
                names = set(by_round.get(rnd, {}).values())
                assert len(names) == 1, f"round {rnd}: lineages {by_round.get(rnd)}"
            assert _models_equal(run), "the final models differ"
        else:
            # each side trained on during the cut, and merged across the sites after the heal
            for n, rs in recs.items():
                after = [r for r in rs if r["round"] > heal_round + HEAL_ROUNDS]
                assert any(SITE_OF[p] != SITE_OF[n] for r in after for p in r["peers"]), (
                    n,
                    figures["remote_peers"][n],
                )
    finally:
        for proc in reversed(procs):
            proc.stop()
        net.down()
        for site in SITES:
            remove_staged_tls(tmp_path / f"broker-{site}" / "mosquitto.conf")
