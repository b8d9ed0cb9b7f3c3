"""DP-SGD local training (p2pfl/learning/dp_train.py): it differs from a plain step, keeps
the model plain (state_dict keys, no Opacus hook or attribute left), is seeded, clips, and
treats a method's extra loss as a data-independent regulariser."""

from __future__ import annotations

import copy

import pytest
import torch

from p2pfl.config.schema import ModelConfig, TrainingConfig
from p2pfl.learning.dp_train import dp_problems, fix_model, poisson_indices, train_private
from p2pfl.learning.models import build_model
from p2pfl.learning.train import train_local

SHAPE = (1, 8, 8)


def _data(n: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, *SHAPE, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _model(name: str = "cnn"):
    torch.manual_seed(0)
    model, _ = fix_model(build_model(ModelConfig(name=name), 4, SHAPE))
    return model


def _dp(model, x, y, seed=3, sigma=1.0, clip=1.0, **kw):
    cfg = TrainingConfig(epochs=1, batch_size=20, momentum=0.0)
    return train_private(
        model,
        x,
        y,
        cfg,
        0.05,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        q=0.2,
        steps_per_epoch=5,
        seed=seed,
        **kw,
    )


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_dp_step_differs_from_plain_and_keeps_the_model_plain():
    x, y = _data()
    base = _model()
    keys = list(base.state_dict())
    dp, plain, again = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    result = _dp(dp, x, y)
    train_local(plain, x, y, TrainingConfig(epochs=1, batch_size=20, momentum=0.0), 0.05, seed=3)
    assert result.steps == 5 and result.loss > 0
    assert list(dp.state_dict()) == keys  # no ``_module.`` prefix, nothing added
    assert not _same(dp, plain) and not _same(dp, base)
    for m in dp.modules():  # no Opacus hook left on any layer
        assert not m._forward_hooks and not m._backward_hooks
    for p in dp.parameters():  # no per-sample attribute left on any parameter
        assert not hasattr(p, "grad_sample") and not hasattr(p, "summed_grad")
    _dp(again, x, y)  # same seed, same model: the same weights, bit for bit
    assert _same(dp, again)
    other = copy.deepcopy(base)
    _dp(other, x, y, seed=4)
    assert not _same(dp, other)


def test_clipping_bounds_the_update_without_noise():
    """σ → 0 and a tiny C: one SGD step moves the weights by at most lr · C · |batch| /
    expected batch size (the sum of |batch| gradients clipped to C, over q·n)."""
    x, y = _data()
    base = _model()
    stepped = copy.deepcopy(base)
    cfg = TrainingConfig(epochs=1, batch_size=20, momentum=0.0)
    train_private(
        stepped, x, y, cfg, 0.05, noise_multiplier=1e-9, max_grad_norm=0.01, q=0.2,
        steps_per_epoch=1, epochs=1, seed=0,
    )  # fmt: skip
    batch = len(poisson_indices(len(y), 0.2, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        pairs = zip(stepped.parameters(), base.parameters(), strict=True)
        moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in pairs))
    assert 0 < float(moved) <= 0.05 * 0.01 * batch / 20 * 1.001


def test_batchnorm_is_replaced_and_named():
    model = build_model(ModelConfig(name="resnet18"), 10, (3, 32, 32))
    assert dp_problems(model)  # Opacus refuses BatchNorm as it is
    fixed, replaced = fix_model(model)
    assert replaced and all("BatchNorm2d → GroupNorm" in r for r in replaced)
    assert "g.bn1: BatchNorm2d → GroupNorm" in replaced
    assert dp_problems(fixed) == []
    cnn, none = fix_model(build_model(ModelConfig(name="cnn"), 4, SHAPE))
    assert none == []


def test_regulariser_is_data_independent_and_applied():
    """An extra loss sees no sample (empty batches) and its gradient moves the weights."""
    x, y = _data()
    base = _model("mlp")
    seen: list[int] = []
    target = {n: torch.zeros_like(p) for n, p in base.named_parameters()}

    def pull_to_zero(model, xb, yb, logits):
        seen.append(len(xb) + len(yb) + len(logits))
        return 10.0 * sum((p - target[n]).pow(2).sum() for n, p in model.named_parameters())

    with_reg, without = copy.deepcopy(base), copy.deepcopy(base)
    _dp(with_reg, x, y, extra_loss=pull_to_zero)
    _dp(without, x, y)
    assert seen and set(seen) == {0}
    norm = lambda m: float(sum(p.detach().pow(2).sum() for p in m.parameters()))  # noqa: E731
    assert norm(with_reg) < norm(without)


def test_loss_fn_is_refused():
    x, y = _data()
    with pytest.raises(ValueError, match="loss_fn"):
        _dp(_model(), x, y, loss_fn=lambda model, xb, yb: (xb.sum(), xb.sum()))


def test_empty_poisson_batches_step_on_noise_alone():
    x, y = _data(10)
    model = _model()
    result = train_private(
        model, x, y, TrainingConfig(epochs=1, batch_size=1), 0.05, noise_multiplier=1.0,
        max_grad_norm=1.0, q=1e-6, steps_per_epoch=2, seed=0,
    )  # fmt: skip
    assert result.steps == 2 and result.loss == 0.0  # no batch had a sample
    assert not _same(model, _model())  # noise moved it


def test_a_dataset_trains_as_its_tensors_do():
    """A map-style Dataset (read by Poisson batches) gives the tensors' result, bit for bit."""
    from torch.utils.data import TensorDataset

    x, y = _data()
    base = _model()
    from_tensors, from_dataset = copy.deepcopy(base), copy.deepcopy(base)
    _dp(from_tensors, x, y)
    _dp(from_dataset, TensorDataset(x, y), None)
    assert _same(from_tensors, from_dataset)


def test_physical_chunks_bound_the_per_sample_gradients_and_keep_the_step(monkeypatch):
    """A Poisson batch larger than ``max_physical_batch`` is clipped and summed in chunks:
    no per-sample gradient tensor holds more rows than the bound, the chunks of a step add
    up to its logical batch, and the noisy step is the unsplit one's (the same batch and
    noise; the sum in another float order, so allclose)."""
    from opacus.optimizers import DPOptimizer

    seen: list[int] = []  # the rows of per-sample gradients clipped at once
    original = DPOptimizer.clip_and_accumulate

    def spy(self):
        rows = {len(g) for g in self.grad_samples}
        assert len(rows) == 1
        seen.append(rows.pop())
        return original(self)

    x, y = _data()
    base = _model()
    whole, chunked, fits = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    r_whole = _dp(whole, x, y)
    gen = torch.Generator().manual_seed(3)
    batches = [len(poisson_indices(100, 0.2, gen)) for _ in range(5)]
    assert max(batches) > 6 and sum(seen) == 0
    monkeypatch.setattr(DPOptimizer, "clip_and_accumulate", spy)
    r_chunked = _dp(chunked, x, y, max_physical_batch=6)
    assert max(seen) <= 6 and sum(seen) == sum(batches)
    assert len(seen) == sum(-(-b // 6) for b in batches)  # ⌈b/6⌉ chunks a step
    assert r_chunked.steps == r_whole.steps == 5
    assert r_chunked.loss == pytest.approx(r_whole.loss, rel=1e-5)
    sw, sc = whole.state_dict(), chunked.state_dict()
    assert all(torch.allclose(sw[k], sc[k], rtol=1e-5, atol=1e-6) for k in sw)
    assert not _same(chunked, base)
    seen.clear()
    _dp(fits, x, y, max_physical_batch=max(batches))  # every batch fits: one chunk, as before
    assert seen == batches and _same(fits, whole)
    for p in chunked.parameters():  # nothing per-sample left behind by the chunks either
        assert not hasattr(p, "grad_sample") and not hasattr(p, "summed_grad")
