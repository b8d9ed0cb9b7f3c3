"""``training.steps`` (exactly that many optimizer steps a round) and
``training.optimizer_state: keep`` (the optimizer's state carried across rounds, per node,
through a resume)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from privacy_helpers import loaded_node, node_services, synthetic_cfg

from p2pfl.check.sizes import round_steps
from p2pfl.config.schema import TopologyConfig, TrainingConfig
from p2pfl.learning.models import build_model
from p2pfl.learning.train import train_local
from p2pfl.services.checkpoint import Checkpoint, checkpoint_path, load_checkpoint
from p2pfl.services.optimizer_state import KeptOptimizer


def _data(n: int = 36) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    return torch.randn(n, 4, generator=g) + torch.nn.functional.one_hot(y, 4), y


def _mlp():
    torch.manual_seed(0)
    return build_model(TopologyConfig(name="t", nodes=1, model={"name": "mlp"}).model, 3, (4,))


@pytest.mark.parametrize("steps", [1, 4, 9, 25])
def test_steps_are_exactly_that_many_optimizer_steps(steps):
    x, y = _data(36)  # batches of 8: 5 an epoch, the last one short
    cfg = TrainingConfig(steps=steps, batch_size=8)
    assert train_local(_mlp(), x, y, cfg, 0.05).steps == steps
    topo = TopologyConfig(name="t", nodes=1, training={"steps": steps, "batch_size": 8})
    assert round_steps(topo, 36) == steps


def test_steps_and_epochs_are_one_or_the_other():
    with pytest.raises(ValueError, match="give epochs or steps a round, not both"):
        TrainingConfig(steps=10, epochs=2)


def test_without_steps_training_is_what_it_was():
    x, y = _data(36)
    a, b = _mlp(), _mlp()
    ra = train_local(a, x, y, TrainingConfig(epochs=2, batch_size=8), 0.05, seed=3)
    rb = train_local(b, x, y, TrainingConfig(steps=10, batch_size=8), 0.05, seed=3)
    assert ra.steps == rb.steps == 10  # two whole epochs are ten steps: the same batches
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_kept_adam_remembers_its_moments_and_reset_forgets_them():
    x, y = _data(36)
    cfg = TrainingConfig(optimizer="adam", optimizer_state="keep", steps=3, batch_size=8)
    model = _mlp()
    kept = KeptOptimizer(model, cfg)
    train_local(model, x, y, cfg, 0.01, optimizer=kept.for_round(0.01))
    opt = kept.for_round(0.005)
    train_local(model, x, y, cfg, 0.005, optimizer=opt, seed=1)
    assert opt is kept.optimizer and opt.param_groups[0]["lr"] == 0.005
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {6}  # two rounds of 3 steps, on one optimizer
    kept.reset()
    assert kept.state() is None and kept.for_round(0.01) is not opt


def test_the_kept_state_survives_the_checkpoints_codec_and_refuses_another_model():
    x, y = _data(36)
    cfg = TrainingConfig(optimizer="adam", optimizer_state="keep", steps=4, batch_size=8)
    model = _mlp()
    kept = KeptOptimizer(model, cfg)
    train_local(model, x, y, cfg, 0.01, optimizer=kept.for_round(0.01))
    ckpt = Checkpoint("a", "s", "f", 1, {}, {}, optimizer=kept.state())
    again = Checkpoint.from_bytes(ckpt.to_bytes())
    other = KeptOptimizer(model, cfg)
    other.load_state(again.optimizer, "a.ckpt")
    want, got = kept.optimizer.state_dict(), other.optimizer.state_dict()
    for i, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][i][key]))
    wider = build_model(
        TopologyConfig(name="t", nodes=1, model={"name": "mlp", "hidden": 7}).model, 3, (4,)
    )
    with pytest.raises(ValueError, match="a.ckpt: the kept optimizer's state does not fit"):
        KeptOptimizer(wider, cfg).load_state(again.optimizer, "a.ckpt")


def test_a_node_keeps_its_optimizer_through_a_resume(tmp_path):
    cfg = synthetic_cfg(
        "training.optimizer=adam",
        "training.optimizer_state=keep",
        "training.epochs=null",
        "training.steps=3",
    )
    node = loaded_node(cfg, tmp_path)
    svc = node_services(node)
    outcome = asyncio.run(svc.training.train(1))
    assert outcome.result.steps == 3
    svc.ledger.save_checkpoint(1)
    saved = load_checkpoint(checkpoint_path(tmp_path, "a"))
    assert saved is not None and saved.optimizer is not None
    again = loaded_node(cfg, tmp_path)  # a restarted daemon on the same run directory
    assert again.resumed_round == 1 and again.optimizer is not None
    before = node.optimizer.optimizer.state_dict()["state"]
    after = again.optimizer.optimizer.state_dict()["state"]
    assert sorted(before) == sorted(after)
    for i in before:
        assert torch.equal(before[i]["exp_avg"], after[i]["exp_avg"])
    # reset (the default) writes no optimizer into the checkpoint
    plain = loaded_node(synthetic_cfg(), tmp_path / "plain")
    assert plain.optimizer is None
