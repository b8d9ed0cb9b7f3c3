"""A node under privacy.dp without a swarm: σ planned at load, a round's DP-SGD accounted
for, ε and the spent budget in the round's record, the accountant carried across a
checkpoint and a restart, and the default checkpoint unchanged."""

from __future__ import annotations

import asyncio

import pytest
from privacy_helpers import loaded_node, node_services, round_record, synthetic_cfg

from p2pfl.privacy.accountant import compose_epsilon
from p2pfl.services.checkpoint import Checkpoint, CheckpointError, checkpoint_path, load_checkpoint
from p2pfl.services.training import dp_sgd_turn


def test_rounds_are_accounted_and_recorded(tmp_path):
    node = loaded_node(synthetic_cfg("privacy.dp.noise_multiplier=1.2"))
    privacy = node.privacy
    assert privacy is not None and privacy.noise_multiplier == 1.2
    n = len(node.data.train_y)
    assert privacy.q == pytest.approx(20 / n) and privacy.round_steps == int(n / 20)
    svc = node_services(node)
    eps = []
    for r in (1, 2):
        trained = asyncio.run(svc.training.train(r))
        assert trained.result.steps == privacy.round_steps
        rec = round_record(svc, r, trained)
        eps.append(rec["epsilon"])
        assert "dp_exhausted" not in rec and rec["train_loss"] is not None
        assert list(rec)[-2:] == ["epsilon", "t"]
    expected = compose_epsilon([(1.2, privacy.q, 2 * privacy.round_steps)], 1e-5)
    assert eps[0] < eps[1] == pytest.approx(expected, abs=1e-6)


def test_a_spent_budget_stops_the_steps_and_says_so(caplog):
    node = loaded_node(synthetic_cfg("privacy={dp: {target_epsilon: 1.0, rounds: 1}}"))
    svc = node_services(node)
    before = {k: v.clone() for k, v in node.method.model.state_dict().items()}
    first = asyncio.run(svc.training.train(1))
    assert first.result.steps > 0
    rec1 = round_record(svc, 1, first)
    assert rec1["epsilon"] <= 1.0 and "dp_exhausted" not in rec1
    trained_state = {k: v.clone() for k, v in node.method.model.state_dict().items()}
    assert any(not before[k].equal(trained_state[k]) for k in before)
    with caplog.at_level("WARNING"):
        second = asyncio.run(svc.training.train(2))
        third = asyncio.run(svc.training.train(3))
    assert second.result.steps == third.result.steps == 0
    assert sum("privacy budget spent" in r.getMessage() for r in caplog.records) == 1
    after = node.method.model.state_dict()
    assert all(after[k].equal(trained_state[k]) for k in after)  # no local step
    rec2 = round_record(svc, 2, second)
    assert rec2["dp_exhausted"] is True and rec2["train_loss"] is None
    assert rec2["epsilon"] == rec1["epsilon"] and rec2["diverged"] is None


def test_the_accountant_survives_a_restart(tmp_path):
    cfg = synthetic_cfg("privacy.dp.noise_multiplier=1.0")
    node = loaded_node(cfg, tmp_path)
    svc = node_services(node)
    asyncio.run(svc.training.train(1))
    svc.ledger.save_checkpoint(1)
    spent = node.privacy.epsilon
    ckpt = load_checkpoint(checkpoint_path(tmp_path, "a"))
    assert ckpt is not None and ckpt.privacy is not None

    again = loaded_node(cfg, tmp_path)  # a restarted daemon on the same run directory
    assert again.resumed_round == 1
    assert again.privacy.accountant.history == node.privacy.accountant.history
    assert again.privacy.epsilon == spent > 0
    svc2 = node_services(again)
    asyncio.run(svc2.training.train(2))  # ε composes over the restart, as one run would
    whole = compose_epsilon([(1.0, node.privacy.q, 2 * node.privacy.round_steps)], 1e-5)
    assert again.privacy.epsilon == pytest.approx(whole, rel=1e-12)

    bad = Checkpoint.from_bytes(checkpoint_path(tmp_path, "a").read_bytes())
    bad.privacy = {"accountant": {"mechanism": "rdp", "history": [[1.0]]}}
    with pytest.raises(ValueError, match="privacy: expected keys"):
        again.privacy.load_state(bad.privacy, "ckpt")
    bad.privacy = dict(ckpt.privacy, noise_multiplier=2.0)
    checkpoint_path(tmp_path, "a").write_bytes(bad.to_bytes())
    with pytest.raises(CheckpointError, match="privacy.noise_multiplier: 2.0, planned 1.0"):
        loaded_node(cfg, tmp_path)


def test_without_privacy_nothing_changes(tmp_path):
    node = loaded_node(synthetic_cfg(), tmp_path)
    assert node.privacy is None
    svc = node_services(node)
    trained = asyncio.run(svc.training.train(1))
    rec = round_record(svc, 1, trained)
    assert "epsilon" not in rec and "dp_exhausted" not in rec
    svc.ledger.save_checkpoint(1)
    raw = checkpoint_path(tmp_path, "a").read_bytes()
    assert b"privacy" not in raw
    assert load_checkpoint(checkpoint_path(tmp_path, "a")).privacy is None


@pytest.mark.parametrize("secret", [False, True])
def test_noise_is_the_seeds_unless_secret(secret):
    cfg = synthetic_cfg("privacy.dp.noise_multiplier=1.0", f"privacy.dp.secret_noise={secret}")
    states = []
    for _ in range(2):  # the same node, built twice from the same swarm seed
        node = loaded_node(cfg)
        asyncio.run(node_services(node).training.train(1))
        states.append(node.method.model.state_dict())
    same = all(states[0][k].equal(states[1][k]) for k in states[0])
    assert same is not secret


@pytest.mark.parametrize(
    "method",
    [
        "uapdfl",
        "dfedavgm",
        "dispfl",
        "local",
        "fedavg",
        "fedper",
        "criticalfl",
        "diversifed",
        "fedsa",
    ],
)
def test_every_method_trains_a_dp_round(method):
    cfg = synthetic_cfg(
        f"algorithm.name={method}", "algorithm.params={}", "privacy.dp.noise_multiplier=1"
    )
    node = loaded_node(cfg)
    keys = list(node.method.model.state_dict())
    before = node.method.checkpoint()
    svc = node_services(node)
    trained = asyncio.run(svc.training.train(1))
    assert trained.result.steps == node.privacy.round_steps and trained.diverged is None
    assert list(node.method.model.state_dict()) == keys
    assert node.privacy.epsilon > 0
    after = node.method.model.state_dict()
    assert any(not before["model"][k].equal(after[k]) for k in keys)
    node.method.restore(node.method.checkpoint())  # what it keeps still checkpoints


def test_nodes_of_one_process_train_dp_sgd_one_at_a_time():
    """Nodes sharing an event loop (a process's nodes) take turns at DP-SGD: every forward
    pass of one node's round comes before every one of the other's, and each round is the
    one it would be alone (the same steps)."""
    cfg = synthetic_cfg("privacy.dp.noise_multiplier=1.0")
    nodes = [loaded_node(cfg, node_id=i) for i in ("a", "b", "c")]
    order: list[str] = []  # list.append is atomic: the worker threads may share it
    for node in nodes:
        node.method.model.register_forward_hook(lambda m, i, o, n=node.id: order.append(n))

    async def together():
        assert dp_sgd_turn() is dp_sgd_turn()  # one lock for the loop's nodes
        svcs = [node_services(node) for node in nodes]
        return await asyncio.gather(*(s.training.train(1) for s in svcs))

    trained = asyncio.run(together())
    assert [t.result.steps for t in trained] == [n.privacy.round_steps for n in nodes]
    runs = [order[0]] + [b for a, b in zip(order, order[1:], strict=False) if a != b]
    assert sorted(runs) == ["a", "b", "c"], runs  # three unbroken runs: no overlap
