"""Secure aggregation's node side without a broker: the threshold, the flat vector, the
check of a pulled masked vector, FedAvg's rule on the secure sum against its plain rule
(real SecAgg+ members and server in between), and the drop of hostile ``sa_*`` messages."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from services_helpers import offline_services

from p2pfl.algorithms.base import Upload
from p2pfl.check.load import load_topology
from p2pfl.privacy.secagg import RoundContext, SecAggMember, SecAggServer, encode, tolerance
from p2pfl.rounds.rotation.secure_round import (
    PART,
    flatten,
    masked_of,
    threshold_for,
    unflatten,
    vector_length,
)
from p2pfl.wire.envelope import Envelope


@pytest.mark.parametrize(
    ("members", "k", "fraction", "expected"),
    [
        (8, None, 0.6, (5, 7)),  # ⌈0.6·7⌉ = 5
        (8, None, 0.1, (4, 7)),  # clamped up to ⌊7/2⌋ + 1
        (8, None, 1.0, (7, 7)),
        (50, 10, 0.6, (6, 10)),
        (50, 9, 0.6, (6, 10)),  # k rounded up to even
        (3, None, 0.6, (2, 2)),
    ],
)
def test_threshold_is_a_fraction_of_the_neighbourhood_clamped(members, k, fraction, expected):
    assert threshold_for(members, k, fraction) == expected


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "steps": torch.tensor(7),  # a counter: not summed
    }


def test_flatten_unflatten_and_the_masked_check():
    s = _state(0)
    v = flatten(s)
    assert v.dtype == np.float64 and v.shape == (vector_length(s),) == (17,) and v[-1] == 1.0
    back = unflatten(v, s)
    assert sorted(back) == ["b", "w"] and all(torch.equal(back[k].float(), s[k]) for k in back)
    good = {PART: torch.zeros(17, dtype=torch.int64)}
    assert masked_of(good, 17) is not None and masked_of(good, 17).dtype == np.uint64
    for bad in (
        {PART: torch.zeros(16, dtype=torch.int64)},
        {PART: torch.zeros(17, dtype=torch.float64)},
        {PART: torch.zeros(17, dtype=torch.int64), "w": torch.zeros(1)},
        {"upload": torch.zeros(17, dtype=torch.int64)},
        [1, 2],
    ):
        assert masked_of(bad, 17) is None


def test_fedavg_on_the_secure_sum_equals_its_plain_rule():
    """Members mask their flattened uploads times n; the server's unmasked sum, through
    FedAvg's aggregate_sum, is FedAvg's weighted mean within the fixed point's tolerance —
    with one member dropped after masking. No masked vector is its member's encode(n·x)."""
    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", "defence.rule=mean"],
    )
    alg = offline_services(cfg, "a").method
    ids = ["a", "b", "c", "d", "e"]
    states = {u: _state(i) for i, u in enumerate(ids)}
    n = {u: 10 * (i + 1) for i, u in enumerate(ids)}
    ctx = RoundContext("s", 1, 0)
    t, k = threshold_for(len(ids), None, 0.6)
    members = {u: SecAggMember(u, ids, t, ctx) for u in ids}
    length = vector_length(states["a"])
    server = SecAggServer(ids, t, ctx, length)
    for u, m in members.items():
        server.receive_keys(u, m.advertise())
    keys = server.advertised()
    for u, m in members.items():
        server.receive_bundles(u, m.share_keys(keys))
    u2 = server.shared()
    masked = {}
    for u in u2:
        members[u].receive_shares(server.bundles_for(u))
        masked[u] = members[u].mask(flatten(states[u]), float(n[u]))
        plain = encode(n[u] * flatten(states[u]), len(ids))
        assert not np.array_equal(masked[u], plain)
        assert (np.abs(masked[u].view(np.int64) - plain.view(np.int64)) < 2**40).mean() < 0.01
    survivors = [u for u in u2 if u != "e"]  # e drops after masking
    for u in survivors:
        server.receive_masked(u, masked[u])
    request = server.unmask_request()
    assert request == {"survivors": survivors, "dropped": ["e"]}
    for u in survivors:
        server.receive_unmask(u, members[u].unmask_shares(**request))
    total = server.result()
    assert abs(total[-1] - sum(n[u] for u in survivors)) < 1e-6
    summed = unflatten(total, states["a"])
    secure = alg.aggregate_sum(summed, float(total[-1]), states["a"], survivors, {}, ids, 1)
    plain = alg.aggregate({u: Upload(n[u], states[u], {}) for u in survivors}, {}, ids, 1)
    tol = tolerance(len(ids)) * 2 + 1e-6
    for key in ("w", "b"):
        assert torch.allclose(secure.common[key], plain.common[key], atol=tol, rtol=0)
        assert secure.common[key].dtype == torch.float32
    assert torch.equal(secure.common["steps"], states["a"]["steps"])
    assert sorted(secure.results) == survivors and secure.facts["aggregated_n"] == 100


def _env(sender, kind, rnd, attempt, body):
    return Envelope("s", sender, rnd, kind, f"{sender}{kind}{rnd}{attempt}", body, attempt=attempt)


def _driver(node_id, overrides=("privacy.secagg=true", "defence.rule=mean")):
    from p2pfl.rounds.rotation.centralized import CentralizedRounds

    cfg = load_topology(
        "topologies/synthetic.yaml",
        ["algorithm.name=fedavg", "algorithm.params={}", *overrides],
    )
    cfg = cfg.model_copy(update={"broker": SimpleNamespace(host="127.0.0.1", port=1)})
    return CentralizedRounds(offline_services(cfg, node_id))


def test_hostile_secagg_messages_are_dropped_and_counted():
    d = _driver("b")  # members a, b, c, d
    dropped = d.services.exchange.transport.dropped
    d.rosters[3] = ["a", "b", "c", "d"]  # round 3: attempt 0 → sorted[3 % 4] = d, 1 → a
    d.current, d.applied = (3, 0), 2
    keys = SecAggMember("a", ["a", "b", "c"], 2, RoundContext("s", 3, 0)).advertise()
    d.on_gossip(_env("a", "sa_keys", 3, 0, {"keys": keys}))
    assert d.secure.keys[(3, 0)] == {"a": keys}
    d.on_gossip(_env("a", "sa_keys", 3, 0, {"keys": keys}))
    assert dropped["duplicate"] == 1
    d.on_gossip(_env("c", "sa_keys", 3, 0, {"keys": {"c_pk": b"x"}}))
    assert dropped["malformed"] == 1
    d.on_gossip(_env("zz", "sa_keys", 3, 0, {"keys": keys}))
    assert dropped["not_member"] == 1
    d.on_gossip(_env("a", "sa_keys", 2, 0, {"keys": keys}))  # round 2 is applied
    assert dropped["stale_round"] == 1
    d.on_inbox(_env("c", "sa_step", 3, 0, {"members": ["a"]}))  # c does not aggregate 3/0
    assert dropped["not_aggregator"] == 1
    d.on_inbox(_env("a", "sa_shares", 3, 0, {"bundles": {}}))  # b does not aggregate 3/0
    assert dropped["misdirected_report"] == 1
    d.on_inbox(_env("d", "sa_step", 3, 0, [1, 2]))  # not a map
    assert dropped["malformed"] == 2
    d.on_inbox(_env("d", "sa_step", 3, 0, {"members": ["a", "b"]}))
    assert d.secure.inbox[(3, 0)] == {("sa_step", "d"): {"members": ["a", "b"]}}
    d.current = (3, 1)
    d.on_inbox(_env("d", "sa_unmask", 3, 0, {}))  # attempt 0 is dead
    assert dropped["stale_attempt"] == 1
    d.on_inbox(_env("c", "sa_ready", 3, 1, {}))  # attempt 1 → a: not this node
    assert dropped["misdirected_report"] == 2
    d.secure.forget(3)
    assert not d.secure.keys and not d.secure.inbox
    plain = _driver("b", ())
    plain.on_inbox(_env("a", "sa_ready", 1, 0, {}))  # no secagg in this swarm
    assert plain.services.exchange.transport.dropped["unexpected_kind"] == 1
