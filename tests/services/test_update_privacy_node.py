"""A node under privacy.dp.level: update without a swarm: σ planned at load, each round's
update released (clipped and noised) and adopted as the node's model, so what it serves and
uploads is the release and not the raw trained model; one release accounted a round, ε in
the record, the budget, the accountant across a restart, and the noise's seed."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from privacy_helpers import loaded_node, node_services, round_record, synthetic_cfg

from p2pfl.learning.train import round_lr, train_local
from p2pfl.node.daemon import Node
from p2pfl.privacy.update_accountant import plan_update_noise, update_epsilon
from p2pfl.privacy.update_dp import NOISE_STREAM, release
from p2pfl.services.checkpoint import Checkpoint, CheckpointError, checkpoint_path


def _update(dp: str, *overrides: str):
    return synthetic_cfg(f"privacy={{dp: {{level: update, {dp}}}}}", *overrides)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _raw_round(node: Node, round_no: int):
    """What the node's next round trains without privacy, from its current model and the
    seed its RNG will draw: (the state before, the raw trained state, the seed)."""
    seed = int(copy.deepcopy(node.rng).integers(2**31))
    ref = _state(node.method.model)
    twin = copy.deepcopy(node.method.model)
    lr = round_lr(node.cfg.training, round_no)
    m = node.method
    train_local(
        twin,
        node.data.train_inputs,
        node.data.train_y,
        node.cfg.training,
        lr,
        extra_loss=m.extra_loss(),
        loss_fn=m.loss_fn(),
        step_hook=m.step_hook(),
        seed=seed,
        device=node.device,
    )
    return ref, _state(twin), seed


@pytest.mark.parametrize("method", ["local", "fedavg"])
def test_what_leaves_the_node_is_the_release_not_the_trained_model(method):
    cfg = _update(
        "noise_multiplier: 0.5, max_update_norm: 0.2",
        f"algorithm.name={method}",
        "algorithm.params={}",
    )
    node = loaded_node(cfg)
    privacy = node.privacy
    assert privacy is not None and privacy.level == "update"
    ref, raw, seed = _raw_round(node, 1)
    svc = node_services(node)
    trained = asyncio.run(svc.training.train(1))
    assert trained.diverged is None and trained.result.steps > 0
    gen = torch.Generator().manual_seed(seed ^ NOISE_STREAM)
    expected = release(ref, raw, 0.2, 0.5, gen)
    assert expected.norm > 0.2  # the raw update was clipped, then noised
    held = _state(node.method.model)
    assert all(torch.equal(held[k], expected.state[k]) for k in held)
    assert any(not torch.equal(held[k], raw[k]) for k in held if held[k].is_floating_point())
    served = node.method.upload() if method == "fedavg" else node.method.snapshot()
    assert served and all(torch.equal(served[k], expected.state[k]) for k in served)
    # the checkpoint, which a restart resumes from, holds the release too
    assert all(torch.equal(svc.training.last_good[1]["model"][k], held[k]) for k in held)


def test_rounds_are_accounted_and_recorded():
    node = loaded_node(_update("noise_multiplier: 2.0, accountant: analytic"))
    svc = node_services(node)
    eps = []
    for r in (1, 2, 3):
        trained = asyncio.run(svc.training.train(r))
        rec = round_record(svc, r, trained)
        eps.append(rec["epsilon"])
        assert "dp_exhausted" not in rec and rec["train_loss"] is not None
        assert list(rec)[-2:] == ["epsilon", "t"]
    assert node.privacy.accountant.history == [(2.0, 3)]
    want = [round(update_epsilon([(2.0, r)], 1e-5, "analytic"), 6) for r in (1, 2, 3)]
    assert eps == want and eps[0] < eps[1] < eps[2]


def test_a_spent_budget_stops_training_and_releasing(caplog):
    node = loaded_node(_update("target_epsilon: 2.0, rounds: 1"))
    privacy = node.privacy
    assert privacy.noise_multiplier == plan_update_noise(2.0, 1e-5, 1, "rdp")
    svc = node_services(node)
    first = asyncio.run(svc.training.train(1))
    rec1 = round_record(svc, 1, first)
    assert first.result.steps > 0 and rec1["epsilon"] <= 2.0 and "dp_exhausted" not in rec1
    released = _state(node.method.model)
    with caplog.at_level("WARNING"):
        second = asyncio.run(svc.training.train(2))
        third = asyncio.run(svc.training.train(3))
    assert second.result.steps == third.result.steps == 0
    assert sum("privacy budget spent" in r.getMessage() for r in caplog.records) == 1
    after = _state(node.method.model)
    assert all(torch.equal(after[k], released[k]) for k in after)  # nothing new released
    rec2 = round_record(svc, 2, second)
    assert rec2["dp_exhausted"] is True and rec2["train_loss"] is None
    assert rec2["epsilon"] == rec1["epsilon"] and privacy.accountant.releases == 1


def test_the_accountant_survives_a_restart(tmp_path):
    cfg = _update("noise_multiplier: 1.5")
    node = loaded_node(cfg, tmp_path)
    svc = node_services(node)
    asyncio.run(svc.training.train(1))
    svc.ledger.save_checkpoint(1)
    again = loaded_node(cfg, tmp_path)  # a restarted daemon on the same run directory
    assert again.resumed_round == 1
    assert again.privacy.accountant.history == [(1.5, 1)]
    assert again.privacy.epsilon == node.privacy.epsilon > 0
    held = _state(again.method.model)  # the release it adopted, resumed
    assert all(torch.equal(held[k], node.method.model.state_dict()[k]) for k in held)
    asyncio.run(node_services(again).training.train(2))  # ε composes over the restart
    assert again.privacy.epsilon == update_epsilon([(1.5, 2)], 1e-5)

    with pytest.raises(ValueError, match="privacy.level: 'sample'"):
        again.privacy.load_state(dict(again.privacy.state(), level="sample"), "ckpt")
    bad = Checkpoint.from_bytes(checkpoint_path(tmp_path, "a").read_bytes())
    bad.privacy = dict(bad.privacy, noise_multiplier=3.0)
    checkpoint_path(tmp_path, "a").write_bytes(bad.to_bytes())
    with pytest.raises(CheckpointError, match="privacy.noise_multiplier: 3.0, planned 1.5"):
        loaded_node(cfg, tmp_path)


@pytest.mark.parametrize("secret", [False, True])
def test_noise_is_the_seeds_unless_secret(secret):
    cfg = _update("noise_multiplier: 1.0", f"privacy.dp.secret_noise={secret}")
    states = []
    for _ in range(2):  # the same node, built twice from the same swarm seed
        node = loaded_node(cfg)
        asyncio.run(node_services(node).training.train(1))
        states.append(_state(node.method.model))
    same = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert same is not secret


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("uapdfl", "{}"),
        ("dfedavgm", "{}"),
        ("dispfl", "{regrow: random}"),
        ("local", "{}"),
        ("fedavg", "{}"),
        ("fedper", "{}"),
        ("diversifed", "{}"),
        ("fedsa", "{}"),
        ("pfedc", "{}"),
    ],
)
def test_every_method_trains_and_releases_a_round(method, params):
    cfg = _update("noise_multiplier: 1.0", f"algorithm.name={method}", f"algorithm.params={params}")
    node = loaded_node(cfg)
    keys = list(node.method.model.state_dict())
    before = node.method.checkpoint()
    trained = asyncio.run(node_services(node).training.train(1))
    assert trained.result.steps > 0 and trained.diverged is None
    assert list(node.method.model.state_dict()) == keys
    assert node.privacy.epsilon == update_epsilon([(1.0, 1)], 1e-5)
    after = node.method.model.state_dict()
    assert any(not before["model"][k].equal(after[k]) for k in keys)
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    node.method.restore(node.method.checkpoint())  # what it keeps still checkpoints


def test_batchnorm_becomes_groupnorm():
    """The noise would turn BatchNorm's running variances negative: as under DP-SGD, the
    swarm's model has GroupNorm instead."""
    node = loaded_node(_update("noise_multiplier: 1.0", "model.name=resnet18"))
    kinds = {type(m).__name__ for m in node.method.model.modules()}
    assert "GroupNorm" in kinds and not any("BatchNorm" in k for k in kinds)
