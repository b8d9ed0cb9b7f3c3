"""Secure aggregation (``privacy.secagg``) on the rotating aggregator, with node processes on
a real broker: the same FedAvg model as the plain run, a member killed after masking, the
aggregator killed mid-protocol."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from swarm_helpers import start_nodes

from p2pfl.launch.swarm import stop_workers
from p2pfl.metrics import read_records
from p2pfl.privacy.secagg import decode, tolerance
from p2pfl.rounds.rotation.election import aggregator_for
from p2pfl.services.checkpoint import checkpoint_path, load_checkpoint
from p2pfl.wire.codec import buffer_to_state
from p2pfl.wire.envelope import Envelope

pytestmark = pytest.mark.one_broker  # the protocol is the node's: one broker is enough

NODES = [f"n{i}" for i in range(8)]
BASE = [
    "algorithm.name=fedavg",
    "algorithm.params={}",
    f"nodes=[{', '.join(NODES)}]",
    "model.name=mlp",
    "dataset.synthetic_train=800",
    "dataset.synthetic_test=200",
    "defence.rule=mean",
    "timing.round_timeout_s=10",
    "timing.aggregator_timeout_s=30",
    "timing.linger_s=3",
    "transfer.direct=false",  # every byte through the broker, where the test sees it
]
SECAGG = ["privacy.secagg=true"]


def _records(out: Path, nid: str) -> list[dict]:
    return read_records(out / "nodes" / f"{nid}.jsonl")


class Watcher:
    """A test MQTT client on the swarm's inboxes: keeps every transfer each node receives
    (``transfers[(to, xfer)] = {round, sender, index, chunks}``) and calls ``on_env(to, env)``
    for every other message."""

    def __init__(self, broker, on_env=None):
        import paho.mqtt.client as mqtt

        self.transfers: dict[tuple[str, str], dict] = {}
        self.on_env = on_env
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.subscribe("p2pfl/synthetic/inbox/+", qos=1)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg):
        to = msg.topic.rsplit("/", 1)[1]
        env = Envelope.unpack(msg.payload, 1 << 23)
        body = env.body if isinstance(env.body, dict) else {}
        if env.kind == "xfer_meta":
            entry = self.transfers.setdefault((to, body["xfer"]), {"chunks": {}})
            entry.update(round=env.round, sender=env.sender, index=body["index"])
        elif env.kind == "xfer_chunk":
            entry = self.transfers.setdefault((to, body["xfer"]), {"chunks": {}})
            entry["chunks"][body["seq"]] = bytes(env.data)
        elif self.on_env is not None:
            self.on_env(to, env)

    def states(self):
        """``(to, round, sender, state)`` of every complete transfer seen."""
        for (to, _), entry in self.transfers.items():
            if "index" not in entry:
                continue
            buf = bytearray(b"".join(entry["chunks"][i] for i in sorted(entry["chunks"])))
            yield to, entry["round"], entry["sender"], buffer_to_state(entry["index"], buf)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def _run(tmp_path: Path, broker, overrides: list[str], timeout: float = 90, on_start=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg, out, workers = start_nodes(tmp_path, broker, [*BASE, *overrides])
    if on_start is not None:
        on_start(cfg, workers)
    try:
        for nid in cfg.node_ids:
            if workers[nid].proc.wait(timeout=timeout) not in (0, -signal.SIGKILL):
                raise AssertionError(workers[nid].log_path.read_text()[-4000:])
    finally:
        stop_workers(list(workers.values()), grace=2)
    return cfg, out


def _tensors(obj, prefix=""):
    """Every floating tensor of a checkpoint's method state, by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj} if obj.is_floating_point() else {}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def test_secagg_gives_the_plain_fedavg_model(tmp_path, broker):
    """8 nodes, 3 rounds, the same seed: with secure aggregation every node's final model
    equals the plain run's to within the fixed point's tolerance (the masks cancel exactly in
    Z_2^64), and so do the test accuracies; records carry the protocol's facts."""
    rounds = ["rounds=3"]
    _, plain = _run(tmp_path / "plain", broker, rounds)
    watcher = Watcher(broker)
    try:
        _, secure = _run(tmp_path / "secure", broker, [*rounds, *SECAGG])
    finally:
        watcher.close()
    tol = 1e-5 + 100 * tolerance(len(NODES))
    for nid in NODES:
        a, b = _records(plain, nid), _records(secure, nid)
        assert [r["round"] for r in b] == [1, 2, 3]
        for ra, rb in zip(a, b, strict=True):
            assert abs(ra["test_acc"] - rb["test_acc"]) < 1e-9, (nid, ra["round"])
            assert abs(ra["test_loss"] - rb["test_loss"]) < 1e-4, (nid, ra["round"])
            assert sorted(rb["aggregated"]) == NODES
            assert rb["secagg"]["member"]["step"] == "revealed", rb["secagg"]
        ma = _tensors(load_checkpoint(checkpoint_path(plain, nid)).method)
        mb = _tensors(load_checkpoint(checkpoint_path(secure, nid)).method)
        assert ma and sorted(ma) == sorted(mb)
        for k in ma:
            assert torch.allclose(ma[k].double(), mb[k].double(), atol=tol, rtol=0), (nid, k)
    for nid in NODES:
        for rec in _records(secure, nid):
            if rec["aggregator"] == nid:
                sa = rec["secagg"]
                assert sa["masked"] == NODES and sa["dropped"] == [], sa
                assert sa["t"] == 5 and sa["k"] == 7, sa
    _aggregator_saw_only_masked_vectors(secure, watcher)


def _aggregator_saw_only_masked_vectors(out: Path, watcher: Watcher) -> None:
    """What each round's aggregator received: only ``masked`` parts, one per counted member,
    each uniformly random in the field (no coordinate decodes near a model's scale, while
    an encoded ``n·x`` is within a few thousand); and no record holds an individual update."""
    aggregator = {r["round"]: r["aggregator"] for r in _records(out, NODES[0])}
    seen: dict[int, set[str]] = {r: set() for r in aggregator}
    for to, round_no, sender, state in watcher.states():
        if to != aggregator[round_no]:
            continue  # a member pulling its result
        assert list(state) == ["masked"], (round_no, sender, list(state))
        values = decode(state["masked"].numpy().view("uint64"))
        assert (abs(values) < 1e5).mean() < 0.01, (round_no, sender)
        seen[round_no].add(sender)
    for round_no, agg in aggregator.items():
        assert seen[round_no] == set(NODES) - {agg}, (round_no, seen[round_no])
    for nid in NODES:  # records: names and counts, never a tensor's values
        text = (out / "nodes" / f"{nid}.jsonl").read_text()
        assert len(text) < 20_000 * 3, nid


def _run_killing(tmp_path: Path, broker, kind: str, victim: str) -> tuple[Path, bool]:
    """A 2-round secure FedAvg swarm in which ``victim``'s process is SIGKILLed the moment
    it sends its first round-1 message of ``kind`` (a test client on the inboxes watches):
    the run's directory, and whether the kill happened."""
    killed: dict[str, float] = {}
    workers_of: dict = {}

    def on_env(to, env):
        if env.kind == kind and env.sender == victim and env.round == 1 and not killed:
            os.killpg(workers_of["w"][victim].proc.pid, signal.SIGKILL)
            killed["t"] = time.time()

    watcher = Watcher(broker, on_env)
    try:
        _, out = _run(
            tmp_path,
            broker,
            ["rounds=2", *SECAGG],
            on_start=lambda cfg, workers: workers_of.update(w=workers),
        )
    finally:
        watcher.close()
    return out, bool(killed)


def test_a_member_killed_after_masking_is_dropped_and_the_round_completes(tmp_path, broker):
    """8 nodes: a member is SIGKILLed the moment its ``sa_ready`` reaches round 1's
    aggregator (a test client on the inboxes kills it): the round completes over the other
    7, with the victim in ``dropped`` (its masks removed through the others' shares)."""
    ids = NODES
    agg = aggregator_for(1, ids)
    victim = next(n for n in ids if n not in (agg, aggregator_for(1, ids, attempt=1)))
    out, killed = _run_killing(tmp_path, broker, "sa_ready", victim)
    assert killed, "the victim never reported ready"
    first = _records(out, agg)[0]
    assert first["round"] == 1 and first["aggregator"] == agg and first["attempt"] == 0
    sa = first["secagg"]
    assert victim in sa["shared"] and sa["dropped"] == [victim], sa
    assert sorted(first["aggregated"]) == sorted(set(ids) - {victim}), first
    for nid in set(ids) - {victim}:
        recs = _records(out, nid)
        assert [r["round"] for r in recs] == [1, 2], nid
        assert recs[0]["received"] and recs[0]["attempt"] == 0, recs[0]


def test_aggregator_killed_mid_protocol_fails_over(tmp_path, broker):
    """Round 1's aggregator is SIGKILLed the moment it forwards the share bundles
    (``sa_bundles``): the members fail over to the next peer in order, which runs the
    protocol again with fresh keys (attempt 1) and completes the round over the other 7."""
    ids = NODES
    agg, successor = aggregator_for(1, ids), aggregator_for(1, ids, attempt=1)
    out, killed = _run_killing(tmp_path, broker, "sa_bundles", agg)
    assert killed, "the aggregator never forwarded bundles"
    first = _records(out, successor)[0]
    assert (first["round"], first["aggregator"], first["attempt"]) == (1, successor, 1), first
    sa = first["secagg"]
    assert sa["masked"] == sorted(set(ids) - {agg}) and sa["dropped"] == [], sa
    for nid in set(ids) - {agg}:
        recs = _records(out, nid)
        assert [r["round"] for r in recs] == [1, 2], nid
        assert recs[0]["attempt"] == 1 and recs[0]["received"], recs[0]
        assert recs[0]["failovers"][0]["aggregator"] == agg, recs[0]


def test_secagg_in_a_signed_tls_swarm(tmp_path):
    """The launcher's TLS-only broker with the per-node ACL, every message signed (the
    audit off, as secure aggregation requires): the sa_* messages and the masked pulls pass
    the ACL and the signature checks, nothing is dropped, and every member took part."""
    from p2pfl.check.load import load_topology
    from p2pfl.launch.swarm import run_swarm

    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", "rounds=2", "defence.rule=mean"]
        + ["security.tls=true", "security.sign=true", "security.audit=false", *SECAGG],
    )
    out = tmp_path / "run"
    code, _ = run_swarm(cfg, out, nodes_per_process=2, progress=False)
    assert code == 0
    for nid in cfg.node_ids:
        recs = _records(out, nid)
        assert [r["round"] for r in recs] == [1, 2], nid
        for rec in recs:
            assert rec["dropped_total"] == 0, (nid, rec)
            assert rec["secagg"]["member"]["step"] == "revealed", (nid, rec)
            assert sorted(rec["aggregated"]) == cfg.node_ids
