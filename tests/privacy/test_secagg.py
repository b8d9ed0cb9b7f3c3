"""SecAgg+ end to end (p2pfl/privacy/secagg): members and the aggregator exchange their
messages in memory; the aggregate is exact in the field with and without dropouts, the
aggregator holds no individual vector, and every refusal of the protocol holds."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from p2pfl.privacy.secagg import (
    RoundContext,
    SecAggError,
    SecAggMember,
    SecAggServer,
    decode,
    encode,
    tolerance,
)

LENGTH = 10_000
IDS = [f"node-{i}" for i in range(8)]
CONTEXT = RoundContext("swarm-a", 7, 0)


def inputs(ids: Iterable[str], seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    xs = {u: rng.normal(0.0, 0.5, LENGTH) for u in ids}
    ws = {u: float(rng.integers(50, 5000)) for u in ids}
    return xs, ws


def setup(ids=IDS, threshold=5, context=CONTEXT, neighbours=None, seed=0, skip_share=()):
    """Members and the aggregator through step 3; ``skip_share`` advertise but never
    share keys."""
    members = {
        u: SecAggMember(
            u,
            ids,
            threshold,
            context,
            np.random.default_rng([seed, i]),
            neighbours=neighbours,
        )
        for i, u in enumerate(ids)
    }
    server = SecAggServer(ids, threshold, context, LENGTH, neighbours=neighbours)
    for u, m in members.items():
        server.receive_keys(u, m.advertise())
    advertised = server.advertised()
    for u, m in members.items():
        if u not in skip_share:
            server.receive_bundles(u, m.share_keys(advertised))
    for u in server.shared():
        members[u].receive_shares(server.bundles_for(u))
    return members, server


def run(members, server, xs, ws, drop_after_mask=(), answer=None):
    """Steps 4 and 5: every member of U2 masks; those in ``drop_after_mask`` never deliver;
    the survivors in ``answer`` (all by default) answer the unmask request."""
    for u in server.shared():
        y = members[u].mask(xs[u], ws[u])
        if u not in drop_after_mask:
            server.receive_masked(u, y)
    request = server.unmask_request()
    for u in request["survivors"] if answer is None else answer:
        server.receive_unmask(u, members[u].unmask_shares(**request))
    return request


def expected_field(ids, xs, ws):
    total = np.zeros(LENGTH, dtype=np.uint64)
    for u in ids:
        total += encode(ws[u] * xs[u], len(IDS))
    return total


def check_sum(server, ids, xs, ws):
    assert np.array_equal(server.result_field(), expected_field(ids, xs, ws))  # exact
    reference = sum(ws[u] * xs[u] for u in ids)  # float64
    result = server.result()
    assert result.dtype == np.float64
    bound = tolerance(len(ids)) + 1e-12 * np.max(np.abs(reference))
    assert np.max(np.abs(result - reference)) <= bound


def test_eight_members_sum_exactly():
    xs, ws = inputs(IDS)
    members, server = setup()
    request = run(members, server, xs, ws)
    assert request == {"survivors": IDS, "dropped": []}
    check_sum(server, IDS, xs, ws)


@pytest.mark.parametrize("gone", ["node-0", "node-4", "node-7"])  # lowest, middle, highest id
def test_one_member_dropping_after_masking_is_unmasked_by_the_others(gone):
    xs, ws = inputs(IDS, seed=1)
    members, server = setup(seed=1)
    request = run(members, server, xs, ws, drop_after_mask={gone})
    assert request["dropped"] == [gone]
    check_sum(server, [u for u in IDS if u != gone], xs, ws)


def test_two_members_dropping_within_the_threshold():
    xs, ws = inputs(IDS, seed=2)
    members, server = setup(threshold=5, seed=2)  # k = 7: up to 2 silent neighbours
    gone = {"node-2", "node-5"}
    run(members, server, xs, ws, drop_after_mask=gone)
    check_sum(server, [u for u in IDS if u not in gone], xs, ws)


def test_too_few_masked_inputs_is_refused_at_the_unmask_request():
    xs, ws = inputs(IDS)
    members, server = setup(threshold=6)
    with pytest.raises(SecAggError, match="5 masked inputs arrived, fewer than the threshold 6"):
        run(members, server, xs, ws, drop_after_mask={"node-0", "node-1", "node-2"})


def test_too_few_unmask_responses_is_a_clear_error():
    xs, ws = inputs(IDS)
    members, server = setup(threshold=5)
    run(members, server, xs, ws, drop_after_mask={"node-7"}, answer=IDS[:4])  # 4 < t = 5
    with pytest.raises(SecAggError, match=r"too few unmask responses \(4 arrived\)") as err:
        server.result()
    assert "node-7 (4 of 5 shares of s^SK)" in str(err.value)
    assert "node-0 (3 of 5 shares of b)" in str(err.value)  # its own share is not held


def test_a_member_that_never_shared_keys_is_not_in_the_round():
    xs, ws = inputs(IDS)
    members, server = setup(skip_share={"node-3"})
    assert "node-3" not in server.shared()
    request = run(members, server, xs, ws)
    assert request == {"survivors": [u for u in IDS if u != "node-3"], "dropped": []}
    check_sum(server, request["survivors"], xs, ws)
    with pytest.raises(SecAggError, match="did not share keys"):
        server.receive_masked("node-3", np.zeros(LENGTH, dtype=np.uint64))


def test_secagg_plus_sparse_graph_with_dropouts():
    ids = [f"n{i:02d}" for i in range(20)]
    xs, ws = inputs(ids, seed=3)
    members, server = setup(ids=ids, threshold=3, neighbours=4, seed=3)
    assert {len(server.graph[u]) for u in ids} == {4}
    assert all(members[u].neighbours == server.graph[u] for u in ids)
    gone = {"n03", "n11"}
    request = run(members, server, xs, ws, drop_after_mask=gone)
    check_sum(server, [u for u in ids if u not in gone], xs, ws)
    for u in request["survivors"]:  # shares only of its neighbours: O(k), not O(n)
        reply = members[u].unmask_shares(**request)
        assert set(reply["b"]) == set(server.graph[u]) - gone
        assert set(reply["sk"]) == set(server.graph[u]) & gone


def test_a_masked_vector_reveals_nothing_about_its_input():
    xs, ws = inputs(IDS)
    members, server = setup()
    u = "node-2"
    y = members[u].mask(xs[u], ws[u])
    e = encode(ws[u] * xs[u], len(IDS))
    assert y.dtype == np.uint64 and y.shape == (LENGTH,)
    assert np.count_nonzero(y == e) == 0
    top = y >> np.uint64(32)  # uniform over [0, 2^32): mean 2^31, each bit set half the time
    assert abs(top.mean() / 2.0**31 - 1.0) < 0.02
    for bit in (63, 40, 0):
        assert abs(((y >> np.uint64(bit)) & np.uint64(1)).mean() - 0.5) < 0.03
    decoded = decode(y)  # as if the aggregator tried to read it
    assert np.median(np.abs(decoded - ws[u] * xs[u])) > 1e6
    assert abs(np.corrcoef(decoded, xs[u])[0, 1]) < 0.05


def test_the_aggregator_holds_no_individual_vector():
    xs, ws = inputs(IDS)
    members, server = setup()
    masked = {u: members[u].mask(xs[u], ws[u]) for u in IDS}
    for u in IDS[:-1]:
        server.receive_masked(u, masked[u])
    request = server.unmask_request()
    for u in request["survivors"]:
        server.receive_unmask(u, members[u].unmask_shares(**request))
    server.result()

    arrays = []

    def walk(value):
        if isinstance(value, np.ndarray):
            arrays.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                walk(v)
        else:
            assert isinstance(value, (str, bytes, int, float, type(None), RoundContext))

    walk(vars(server))
    assert len(arrays) == 1  # the running sum of masked inputs, nothing else
    (held,) = arrays
    survivors = IDS[:-1]
    assert np.array_equal(held, sum(masked[u] for u in survivors))
    for u in IDS:
        assert np.count_nonzero(held == masked[u]) < 5  # chance matches only
        assert np.count_nonzero(held == encode(ws[u] * xs[u], len(IDS))) < 5


def test_another_attempt_gives_other_masks_from_the_same_randomness():
    xs, ws = inputs(IDS)
    u = "node-1"
    outputs = []
    for context in (CONTEXT, CONTEXT, RoundContext("swarm-a", 7, 1), RoundContext("swarm-a", 8, 0)):
        members, _ = setup(context=context, seed=5)  # same rng seeds: same keys and b_u
        outputs.append(members[u].mask(xs[u], ws[u]))
    same, other_attempt, other_round = outputs[0], outputs[2], outputs[3]
    assert np.array_equal(outputs[1], same)  # deterministic for a seed and context
    assert np.count_nonzero(other_attempt == same) < 5
    assert np.count_nonzero(other_round == same) < 5


def test_bundles_of_one_attempt_do_not_open_in_another():
    advertise_ctx, other_ctx = CONTEXT, RoundContext("swarm-a", 7, 1)
    a0 = SecAggMember("node-0", IDS, 5, advertise_ctx, np.random.default_rng(1))
    a1 = SecAggMember("node-1", IDS, 5, other_ctx, np.random.default_rng(2))
    others = {u: SecAggMember(u, IDS, 5, advertise_ctx) for u in IDS[2:]}
    advertised = {u: m.advertise() for u, m in others.items()}
    advertised["node-0"], advertised["node-1"] = a0.advertise(), a1.advertise()
    bundles = a0.share_keys(advertised)
    a1.share_keys(advertised)
    with pytest.raises(SecAggError, match="bundle of node-0: the encrypted bundle fails auth"):
        a1.receive_shares({"node-0": bundles["node-1"]})


class TestRefusals:
    def test_unmask_consistency(self):
        xs, ws = inputs(IDS)
        members, server = setup()
        m = members["node-0"]
        survivors, dropped = IDS[:6], IDS[6:]
        with pytest.raises(SecAggError, match="both survivor and dropped"):
            m.unmask_shares(survivors + ["node-6"], dropped)
        with pytest.raises(SecAggError, match="not members"):
            m.unmask_shares(survivors, ["stranger"])
        with pytest.raises(SecAggError, match="fewer than the threshold"):
            m.unmask_shares(IDS[:4], IDS[4:])
        with pytest.raises(SecAggError, match="list of node ids"):
            m.unmask_shares("node-1", [])
        first = m.unmask_shares(survivors, dropped)
        assert set(first["b"]) == set(survivors) - {"node-0"} and set(first["sk"]) == set(dropped)
        assert all(len(s) == 16 and i >= 1 for i, s in first["b"].values())
        assert all(len(s) == 32 and i >= 1 for i, s in first["sk"].values())
        assert m.unmask_shares(list(reversed(survivors)), dropped) == first  # the same question
        with pytest.raises(SecAggError, match="unmask asked again"):
            m.unmask_shares(IDS[:7], IDS[7:])  # node-6 now a survivor: its b share too

    def test_steps_out_of_order_or_repeated(self):
        m = SecAggMember("node-0", IDS, 5, CONTEXT)
        with pytest.raises(SecAggError, match="receive_shares before share_keys"):
            m.receive_shares({})
        with pytest.raises(SecAggError, match="mask before receive_shares"):
            m.mask(np.zeros(3), 1.0)
        with pytest.raises(SecAggError, match="unmask_shares before receive_shares"):
            m.unmask_shares(IDS, [])
        xs, ws = inputs(IDS)
        members, server = setup()
        m = members["node-0"]
        m.mask(xs["node-0"], 1.0)
        with pytest.raises(SecAggError, match="mask called twice"):
            m.mask(xs["node-0"], 2.0)

    def test_share_keys_refusals(self):
        peers = {u: SecAggMember(u, IDS, 5, CONTEXT) for u in IDS}
        advertised = {u: p.advertise() for u, p in peers.items()}
        m = peers["node-0"]
        with pytest.raises(SecAggError, match="not a member"):
            m.share_keys({**advertised, "stranger": advertised["node-1"]})
        with pytest.raises(SecAggError, match="c_pk and s_pk must differ"):
            bad = advertised["node-1"]["c_pk"]
            m.share_keys({**advertised, "node-1": {"c_pk": bad, "s_pk": bad}})
        with pytest.raises(SecAggError, match="not its own"):
            m.share_keys({**advertised, "node-0": advertised["node-1"]})
        with pytest.raises(SecAggError, match="4 of its neighbours advertised"):
            m.share_keys({u: advertised[u] for u in IDS[:5]})
        bundles = m.share_keys(advertised)
        assert set(bundles) == set(IDS[1:])
        assert m.share_keys(advertised) == bundles
        with pytest.raises(SecAggError, match="share_keys called again"):
            m.share_keys({u: advertised[u] for u in IDS[:7]})

    def test_receive_shares_refusals(self):
        peers = {u: SecAggMember(u, IDS, 5, CONTEXT) for u in IDS}
        advertised = {u: p.advertise() for u, p in peers.items()}
        sent = {u: p.share_keys(advertised) for u, p in peers.items()}
        m = peers["node-0"]
        mine = {u: sent[u]["node-0"] for u in IDS[1:]}
        with pytest.raises(SecAggError, match="bundle of node-1: the encrypted bundle fails"):
            m.receive_shares({**mine, "node-1": sent["node-1"]["node-2"]})  # replayed to us
        with pytest.raises(SecAggError, match="bundle of node-2: the encrypted bundle fails"):
            m.receive_shares({**mine, "node-2": mine["node-1"]})  # relabelled sender
        flipped = bytearray(mine["node-3"])
        flipped[-1] ^= 1
        with pytest.raises(SecAggError, match="bundle of node-3"):
            m.receive_shares({**mine, "node-3": bytes(flipped)})
        with pytest.raises(SecAggError, match="4 neighbours shared keys"):
            m.receive_shares({u: mine[u] for u in IDS[1:5]})
        m.receive_shares(mine)
        m.receive_shares(mine)  # the same again: no-op
        with pytest.raises(SecAggError, match="receive_shares called again"):
            m.receive_shares({u: mine[u] for u in IDS[1:7]})

    def test_server_refusals(self):
        xs, ws = inputs(IDS)
        members, server = setup()
        with pytest.raises(SecAggError, match="advertising step is closed"):
            server.receive_keys("node-0", members["node-0"].advertise())
        with pytest.raises(SecAggError, match="key-sharing step is closed"):
            server.receive_bundles("node-0", {})
        with pytest.raises(SecAggError, match="expected a uint64 array"):
            server.receive_masked("node-0", ws["node-0"] * xs["node-0"])
        with pytest.raises(SecAggError, match="shape"):
            server.receive_masked("node-0", np.zeros(3, dtype=np.uint64))
        with pytest.raises(SecAggError, match="not a member"):
            server.receive_masked("stranger", np.zeros(LENGTH, dtype=np.uint64))
        with pytest.raises(SecAggError, match="before the unmask request"):
            server.result()
        y = members["node-0"].mask(xs["node-0"], ws["node-0"])
        server.receive_masked("node-0", y)
        with pytest.raises(SecAggError, match="already received"):
            server.receive_masked("node-0", y)
        for u in IDS[1:]:
            server.receive_masked(u, members[u].mask(xs[u], ws[u]))
        request = server.unmask_request()
        reply = members["node-1"].unmask_shares(**request)
        with pytest.raises(SecAggError, match="no 'sk' share of node-2 due"):
            server.receive_unmask("node-1", {"b": {}, "sk": {"node-2": [2, bytes(32)]}})
        with pytest.raises(SecAggError, match="wrong index"):
            server.receive_unmask("node-1", {"b": {"node-2": reply["b"]["node-0"]}, "sk": {}})
        with pytest.raises(SecAggError, match="malformed"):
            server.receive_unmask("node-1", {"b": {"node-2": [1, b"short"]}, "sk": {}})

    def test_corrupt_key_shares_are_detected(self):
        xs, ws = inputs(IDS)
        members, server = setup(threshold=4)
        run(members, server, xs, ws, drop_after_mask={"node-7"}, answer=[])
        request = server.unmask_request()
        for u in IDS[:7]:
            reply = members[u].unmask_shares(**request)
            if u == "node-0":  # lowest index: among the t the aggregator combines
                index, share = reply["sk"]["node-7"]
                reply["sk"]["node-7"] = [index, bytes(32 - 1) + b"\x01"]
            server.receive_unmask(u, reply)
        with pytest.raises(SecAggError, match="shares of node-7's masking key are inconsistent"):
            server.result()


@pytest.mark.parametrize(("threshold", "ok"), [(3, False), (4, True), (7, True), (8, False)])
def test_threshold_must_be_a_majority_of_the_neighbourhood(threshold, ok):
    if ok:
        SecAggMember("node-0", IDS, threshold, CONTEXT)
        SecAggServer(IDS, threshold, CONTEXT, LENGTH)
    else:
        with pytest.raises(SecAggError, match=r"in \[4, 7\]"):
            SecAggMember("node-0", IDS, threshold, CONTEXT)
        with pytest.raises(SecAggError, match=r"in \[4, 7\]"):
            SecAggServer(IDS, threshold, CONTEXT, LENGTH)


def test_an_input_beyond_the_fixed_point_bound_is_refused_at_mask():
    members, _ = setup()
    with pytest.raises(SecAggError, match="exceeds"):
        members["node-0"].mask(np.full(LENGTH, 1e6), 1e3)
