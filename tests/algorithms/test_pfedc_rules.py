"""pFedC's rules against hand-computed values (docs/algorithms.md, "pFedC")."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from p2pfl.algorithms import Upload, get_algorithm
from p2pfl.algorithms.pfedc import (
    MultiHead,
    PFedC,
    PFedCParams,
    check_pi,
    find_heads,
    make_loss,
    min_norm_weights,
    pfedc_aggregate,
    shared_representation,
    task_presence,
    validate_groups,
)
from p2pfl.config.schema import ModelConfig
from p2pfl.learning.models import SplitModel, build_model

# ----------------------------------------------------------------------------- min-norm


def on_simplex(lam: torch.Tensor) -> bool:
    return bool((lam >= 0).all()) and math.isclose(float(lam.sum()), 1.0, abs_tol=1e-6)


def test_min_norm_two_orthogonal_unit_vectors():
    lam = min_norm_weights(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.allclose(lam, torch.tensor([0.5, 0.5]), atol=1e-6)


def test_min_norm_parallel_vectors_takes_the_shorter():
    v = torch.tensor([0.3, -1.2, 0.5])
    lam = min_norm_weights(torch.stack([v, 2 * v]))
    assert torch.allclose(lam, torch.tensor([1.0, 0.0]), atol=1e-6)
    lam = min_norm_weights(torch.stack([2 * v, v]))
    assert torch.allclose(lam, torch.tensor([0.0, 1.0]), atol=1e-6)


def test_min_norm_vertex_is_the_answer():
    # (0, 1) is the point of the triangle closest to the origin
    grads = torch.tensor([[1.0, 2.0], [0.0, 1.0], [-1.0, 2.0]])
    lam = min_norm_weights(grads)
    assert torch.allclose(lam, torch.tensor([0.0, 1.0, 0.0]), atol=1e-6)


def test_min_norm_interior_point_of_three():
    # three unit vectors at 120°: the origin is in the hull, reached by equal weights
    a = [math.cos(k * 2 * math.pi / 3) for k in range(3)]
    b = [math.sin(k * 2 * math.pi / 3) for k in range(3)]
    grads = torch.tensor([a, b]).T
    lam = min_norm_weights(grads, iters=2000)
    assert on_simplex(lam)
    assert float((lam @ grads).norm()) < 0.05


def test_min_norm_single_and_bad_input():
    assert min_norm_weights(torch.tensor([[3.0, 4.0]])).tolist() == [1.0]
    with pytest.raises(ValueError):
        min_norm_weights(torch.zeros(0, 3))
    with pytest.raises(ValueError):
        min_norm_weights(torch.zeros(3))


def test_min_norm_random_on_simplex_and_optimal():
    gen = torch.Generator().manual_seed(0)
    for T, D in [(2, 5), (5, 3), (10, 50), (30, 8)]:
        grads = torch.randn(T, D, generator=gen) + 0.5
        lam = min_norm_weights(grads, iters=500)
        assert lam.shape == (T,)
        assert on_simplex(lam)
        norm = float((lam @ grads).norm())
        assert norm <= float(grads.norm(dim=1).min()) + 1e-6  # no worse than any vertex
        assert norm <= float(grads.mean(0).norm()) + 1e-3  # nor than the centre
        # Frank–Wolfe gap: min_t g_t·w ≥ ‖w‖² − tol at the optimum
        w = lam.double() @ grads.double()
        assert float((grads.double() @ w).min()) >= float(w @ w) - 1e-2


# ----------------------------------------------------------------------------- the model


def adapted(name="cnn", C=10, shape=(1, 8, 8), groups=None, seed=0, **kw):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name=name, **kw), C, shape)
    return PFedC.adapt_model(model, PFedCParams(groups=groups), C)


def test_adapt_cnn_binary_heads_keep_scores():
    torch.manual_seed(0)
    base = build_model(ModelConfig(name="cnn"), 10, (1, 8, 8))
    x = torch.randn(4, 1, 8, 8)
    base.eval()
    before = base(x).detach()
    model = PFedC.adapt_model(base, PFedCParams(), 10)
    keys = list(model.state_dict())
    assert all(k.startswith(("g.", "h.")) for k in keys)
    assert "h.fc1.weight" in keys and "h.fc2.weight" not in keys
    for t in range(10):
        assert model.state_dict()[f"h.fc2.heads.{t}.weight"].shape == (1, 512)
        assert f"h.fc2.heads.{t}.bias" in keys
    name, heads = find_heads(model)
    assert name == "h.fc2" and heads.num_tasks == 10
    out = model(x)
    assert out.shape == (4, 10)
    assert torch.allclose(out, before, atol=1e-6)  # heads cut from the original rows
    z = shared_representation(model, x)
    assert z.shape == (4, 512)
    assert torch.allclose(heads(z), out)


def test_adapt_mlp_bare_linear_h():
    model = adapted("mlp", C=4, shape=(1, 3, 3), hidden=6)
    assert isinstance(model.h, MultiHead)
    keys = [k for k in model.state_dict() if k.startswith("h.")]
    assert sorted(keys) == sorted(
        [f"h.heads.{t}.{p}" for t in range(4) for p in ("weight", "bias")]
    )
    x = torch.randn(5, 1, 3, 3)
    assert model(x).shape == (5, 4)
    assert shared_representation(model, x).shape == (5, 6)


def test_adapt_lenet_and_vgg_like_classifier():
    lenet = adapted("lenet", C=10, shape=(1, 28, 28))
    assert "h.fc3.heads.9.weight" in lenet.state_dict()
    assert lenet(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    # vgg11's classifier shape (Linear, ReLU, Dropout, ..., Linear), small widths
    torch.manual_seed(0)
    g = torch.nn.Flatten()
    h = torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(16, 5),
    )
    model = SplitModel(g, h, name="vgg-like", num_classes=5, input_shape=(3, 2, 2))
    PFedC.adapt_model(model, PFedCParams(groups=[[0, 1], [2, 3, 4]]), 5)
    assert model.state_dict()["h.6.heads.1.weight"].shape == (3, 16)
    assert model.state_dict()["h.6.heads.0.bias"].shape == (2,)
    x = torch.randn(4, 3, 2, 2)
    assert model(x).shape == (4, 5)
    assert shared_representation(model, x).shape == (4, 16)


def test_adapt_twice_is_refused():
    model = adapted("mlp", C=3, shape=(2,), hidden=4)
    with pytest.raises(ValueError, match="already"):
        PFedC.adapt_model(model, PFedCParams(), 3)


def test_group_heads_log_softmax_placed_at_classes():
    groups = [[0, 4, 7], [1, 2], [3, 5, 6, 8, 9]]
    model = adapted("cnn", C=10, groups=groups)
    name, heads = find_heads(model)
    assert heads.num_tasks == 3
    assert model.state_dict()[f"{name}.heads.0.weight"].shape == (3, 512)
    x = torch.randn(3, 1, 8, 8)
    out = model(x)
    assert out.shape == (3, 10)
    outs = heads.task_logits(shared_representation(model, x))
    for g, o in zip(groups, outs, strict=True):
        assert torch.allclose(out[:, g], torch.log_softmax(o, dim=1), atol=1e-6)
        assert torch.allclose(out[:, g].exp().sum(1), torch.ones(3), atol=1e-5)


@pytest.mark.parametrize(
    "groups,match",
    [
        ([[0, 1], [2]], "missing"),
        ([[0, 1], [1, 2, 3]], "class 1 is in groups 0 and 1"),
        ([[0, 1, 2, 3, 4]], "outside"),
        ([[0, 1], [], [2, 3]], "empty"),
        ([], "at least one"),
    ],
)
def test_groups_must_partition_the_classes(groups, match):
    with pytest.raises(ValueError, match=match):
        validate_groups(groups, 4)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", hidden=4), 4, (2,))
    with pytest.raises(ValueError, match=match):
        PFedC.adapt_model(model, PFedCParams(groups=groups), 4)


def test_presence_and_check_pi():
    y = torch.tensor([0, 0, 2, 3, 3, 3])
    assert task_presence(y, validate_groups(None, 5), 5, 1) == [1, 0, 1, 1, 0]
    assert task_presence(y, validate_groups(None, 5), 5, 2) == [1, 0, 0, 1, 0]
    assert task_presence(y, [[0, 1], [2, 4], [3]], 5, 2) == [1, 0, 1]
    with pytest.raises(ValueError):
        task_presence(torch.tensor([5]), [[0]], 5, 1)
    assert check_pi([1, 0, 1], 3) == [1, 0, 1]
    for bad in ([1, 2, 0], [1, 0], "101", [], [True, False, True], [1.0, 0, 1]):
        with pytest.raises(ValueError):
            check_pi(bad, 3)


# ----------------------------------------------------------------------------- server rule


def test_masked_aggregation_hand_example():
    hk = {t: [f"h.heads.{t}.weight"] for t in range(3)}

    def st(phi, h0, h1, h2, steps):
        return {
            "g.w": torch.tensor([phi, -phi]),
            "g.steps": torch.tensor(steps),
            "h.heads.0.weight": torch.tensor([h0]),
            "h.heads.1.weight": torch.tensor([h1]),
            "h.heads.2.weight": torch.tensor([h2]),
        }

    states = {"a": st(1.0, 1.0, 10.0, 100.0, 7), "b": st(4.0, 2.0, 20.0, 200.0, 8)}
    states["c"] = st(7.0, 6.0, 30.0, 300.0, 9)
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    # task 0: everyone; task 1: a and c; task 2: b only
    pis = {"a": [1, 1, 0], "b": [1, 0, 1], "c": [1, 1, 0]}
    out = pfedc_aggregate(states, weights, pis, hk)
    phi = (1 * 1.0 + 2 * 4.0 + 3 * 7.0) / 6  # = 5
    for node in "abc":
        assert torch.allclose(out[node]["g.w"], torch.tensor([phi, -phi]))
        assert int(out[node]["g.steps"]) == 7  # non-float: the first node's
        assert torch.allclose(out[node]["h.heads.0.weight"], torch.tensor([3.0]))  # plain mean
    assert torch.allclose(out["a"]["h.heads.1.weight"], torch.tensor([20.0]))  # (10 + 30) / 2
    assert torch.allclose(out["c"]["h.heads.1.weight"], torch.tensor([20.0]))
    assert "h.heads.1.weight" not in out["b"]  # b lacks task 1: keeps its own
    for node in "abc":  # task 2: only b holds it, so nobody receives it
        assert "h.heads.2.weight" not in out[node]
    with pytest.raises(ValueError):
        pfedc_aggregate({}, {}, {}, hk)


# ----------------------------------------------------------------------------- the method


@pytest.fixture
def make_alg(make_method):
    """``make_alg(params, labels=..., seed=..., node_id=...)``: pFedC on an 8-unit MLP over
    1×3×3 inputs with 4 classes, 10 samples (tests/conftest.py)."""
    return partial(make_method, "pfedc", hidden=8, num_classes=4, input_shape=(1, 3, 3), rng_seed=0)


def test_registered_and_params():
    cls = get_algorithm("pfedc")
    assert cls is PFedC and cls.kind == "centralized" and cls.upload_part == "all"
    with pytest.raises(ValueError):
        PFedCParams.model_validate({"weighting": "pcgrad"})
    with pytest.raises(ValueError):
        PFedCParams.model_validate({"bogus": 1})


def test_set_labels_report_and_check_report(make_alg):
    alg = make_alg(labels=[0, 0, 1, 3])
    assert alg.pi == [1, 1, 0, 1]
    rep = alg.report(None, 0.1)
    assert rep == {"pi": [1, 1, 0, 1]}
    assert alg.check_report(rep) == rep
    for bad in ({"pi": [1, 1, 0]}, {"pi": [1, 1, 2, 0]}, {}, [1, 0, 1, 1]):
        with pytest.raises(ValueError):
            alg.check_report(bad)


def synthetic(C=4, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    centres = torch.randn(C, 1, 3, 3, generator=gen) * 2
    x = centres[y] + 0.3 * torch.randn(n, 1, 3, 3, generator=gen)
    return x, y


@pytest.mark.parametrize("weighting", ["mgda", "equal"])
@pytest.mark.parametrize("groups", [None, [[0, 1], [2, 3]]])
def test_loss_decreases(make_alg, weighting, groups):
    x, y = synthetic()
    alg = make_alg({"weighting": weighting, "groups": groups}, labels=y.tolist())
    loss_fn = alg.loss_fn()
    model = alg.model
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    logged = []
    for _ in range(30):
        opt.zero_grad()
        total, task = loss_fn(model, x, y)
        assert math.isfinite(total.item()) and math.isfinite(task.item())
        assert not task.requires_grad
        total.backward()
        opt.step()
        logged.append(float(task))
    assert logged[-1] < 0.7 * logged[0]


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("weighting", ["equal", "mgda"])
def test_objective_gradient_is_mgda_ub_update(make_alg, weighting):
    """Sener & Koltun (2018), Algorithm 2: shared layers get Σ_t λ_t ∇L_t, head t gets its
    own ∇L_t; λ = 1/T for "equal", the min-norm point of the normalised ∇_Z L_t for "mgda"."""
    from p2pfl.algorithms.pfedc import normalize_gradients

    x, y = synthetic(n=16)
    alg = make_alg({"weighting": weighting, "mgda_iters": 200}, labels=y.tolist())
    model = alg.model
    total, task = alg.loss_fn()(model, x, y)
    got = _grads(model, total)

    def losses():
        z = shared_representation(model, x)
        outs = model.h.task_logits(z)
        ls = [
            torch.nn.functional.binary_cross_entropy_with_logits(o[:, 0], (y == t).float())
            for t, o in enumerate(outs)
        ]
        return z, ls

    z, ls = losses()
    assert task.item() == pytest.approx(float(torch.stack(ls).mean().detach()), rel=1e-6)
    if weighting == "equal":
        lam = torch.full((4,), 0.25)
    else:
        g = torch.stack([torch.autograd.grad(lt, z, retain_graph=True)[0].reshape(-1) for lt in ls])
        lam = min_norm_weights(normalize_gradients(g, torch.stack(ls).detach(), "loss+"), 200)
    shared = _grads(model, (lam.detach() * torch.stack(losses()[1])).sum())
    for k, v in got.items():
        if ".heads." in k:
            t = int(k.split(".heads.")[1].split(".")[0])
            own = _grads(model, losses()[1][t])[k]
            assert torch.allclose(v, own, atol=1e-6), k
        else:
            assert torch.allclose(v, shared[k], atol=1e-6), k


def test_normalize_gradients_scales_rows():
    from p2pfl.algorithms.pfedc import normalize_gradients

    g = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    L = torch.tensor([2.0, 1.0])
    assert torch.allclose(normalize_gradients(g, L, "l2"), torch.tensor([[0.6, 0.8], [0, 0]]))
    assert torch.allclose(normalize_gradients(g, L, "loss"), torch.tensor([[1.5, 2.0], [0, 0]]))
    assert torch.allclose(normalize_gradients(g, L, "loss+"), torch.tensor([[0.3, 0.4], [0, 0]]))
    assert torch.equal(normalize_gradients(g, L, "none"), g)


def test_absent_task_gets_no_gradient(make_alg):
    x, y = synthetic()
    keep = y != 2
    x, y = x[keep], y[keep]
    for weighting in ("mgda", "equal"):
        alg = make_alg({"weighting": weighting}, labels=y.tolist())
        assert alg.pi == [1, 1, 0, 1]
        total, _ = alg.loss_fn()(alg.model, x, y)
        total.backward()
        heads = alg.model.h
        assert heads.heads[2].weight.grad is None and heads.heads[2].bias.grad is None
        for t in (0, 1, 3):
            assert heads.heads[t].weight.grad is not None
    # not the paper: train_absent trains it on negatives
    alg = make_alg({"train_absent": True}, labels=y.tolist())
    total, _ = alg.loss_fn()(alg.model, x, y)
    total.backward()
    assert alg.model.h.heads[2].weight.grad is not None


def test_group_without_samples_in_batch_is_skipped(make_alg):
    alg = make_alg({"groups": [[0, 1], [2, 3]]}, labels=[0, 1, 2, 3])
    x, _ = synthetic(n=4)
    y = torch.tensor([0, 1, 0, 1])
    total, task = alg.loss_fn()(alg.model, x, y)
    total.backward()
    assert alg.model.h.heads[1].weight.grad is None
    assert alg.model.h.heads[0].weight.grad is not None
    assert math.isfinite(float(task))


def test_make_loss_with_nothing_held(make_alg):
    alg = make_alg()
    x, y = synthetic(n=8)
    total, task = make_loss([False] * 4)(alg.model, x, y)
    total.backward()
    assert total.item() == 0.0 and task.item() == 0.0


def test_aggregate_and_apply_round_trip(make_alg):
    labels = {"a": [0, 1, 1], "b": [1, 2, 3], "c": [0, 3]}
    algs = {n: make_alg(labels=lab, node_id=n, seed=i) for i, (n, lab) in enumerate(labels.items())}
    assert algs["a"].pi == [1, 1, 0, 0]
    ups = {
        n: Upload(
            n=len(labels[n]), state=alg.upload(), report=alg.check_report(alg.report(None, 0))
        )
        for n, alg in algs.items()
    }
    agg = algs["a"].aggregate(ups, {}, sorted(ups), 1)
    assert agg.facts["task_holders"] == [2, 2, 1, 2]
    assert agg.facts["tasks_shared"] == 3
    assert agg.common is not None and all(k.startswith("g.") for k in agg.common)
    # a gets heads 0 (a, c) and 1 (a, b); not 2 (it lacks it) nor 3
    got_a = {k for k in agg.results["a"] if k.startswith("h.")}
    assert got_a == {f"h.heads.{t}.{p}" for t in (0, 1) for p in ("weight", "bias")}
    mean0 = (ups["a"].state["h.heads.0.weight"] + ups["c"].state["h.heads.0.weight"]) / 2
    assert torch.allclose(agg.results["a"]["h.heads.0.weight"], mean0)
    n = {k: len(v) for k, v in labels.items()}
    phi = sum(n[k] * ups[k].state["g.fc.weight"] for k in ups) / sum(n.values())
    assert torch.allclose(agg.common["g.fc.weight"], phi, atol=1e-6)

    a = algs["a"]
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    facts = a.apply(agg.results["a"], {})
    assert facts["received_heads"] == [0, 1]
    after = a.model.state_dict()
    for t in (2, 3):  # not received: unchanged
        assert torch.equal(after[f"h.heads.{t}.weight"], before[f"h.heads.{t}.weight"])
    assert torch.allclose(after["h.heads.0.weight"], mean0)
    assert torch.allclose(after["g.fc.weight"], phi, atol=1e-6)
    # a late joiner gets φ only: its heads stay
    d = make_alg(labels=[2], node_id="d", seed=9)
    heads_before = d.model.h.heads[0].weight.detach().clone()
    d.apply(agg.common, {})
    assert torch.equal(d.model.h.heads[0].weight, heads_before)


def test_aggregate_ignores_a_malformed_pi(make_alg):
    algs = [make_alg(labels=[0, 1, 2, 3], seed=i) for i in range(2)]
    ups = {
        "a": Upload(n=1, state=algs[0].upload(), report={"pi": [1, 1, 1, 1]}),
        "b": Upload(n=1, state=algs[1].upload(), report={"pi": [1, 1]}),
    }
    agg = algs[0].aggregate(ups, {}, ["a", "b"], 1)
    assert agg.facts["bad_pi"] == ["b"]
    assert not any(k.startswith("h.") for k in agg.results["a"])  # nobody to share with


def test_apply_rejects_unknown_or_misshaped(make_alg):
    alg = make_alg()
    with pytest.raises(ValueError, match="unknown"):
        alg.apply({"h.heads.9.weight": torch.zeros(1, 8)}, {})
    with pytest.raises(ValueError, match="does not match"):
        alg.apply({"h.heads.0.weight": torch.zeros(2, 8)}, {})


def test_cifar100_superclass_preset_partitions_the_100_classes_into_20_groups_of_5():
    from p2pfl.algorithms import validate_params

    groups = validate_params("pfedc", {"groups": "cifar100-superclasses"})["groups"]
    assert len(groups) == 20 and all(len(g) == 5 for g in groups)
    assert sorted(c for g in groups for c in g) == list(range(100))
    assert [0, 51, 53, 57, 83] in groups  # fruit and vegetables: apple, mushroom, orange, …
    with pytest.raises(ValueError, match="preset"):
        validate_params("pfedc", {"groups": "cifar1000"})


def test_prediction_names_only_held_classes(make_alg):
    from p2pfl.algorithms.pfedc import ABSENT_SCORE, find_heads

    x, y = synthetic()
    keep = y != 2
    alg = make_alg({}, labels=y[keep].tolist())
    assert alg.pi == [1, 1, 0, 1]
    scores = alg.model(x)
    assert torch.all(scores[:, 2] == ABSENT_SCORE) and bool((scores.argmax(1) != 2).all())
    find_heads(alg.model)[1].predict_only([])  # lifted: every class may be named again
    assert not torch.any(alg.model(x)[:, 2] == ABSENT_SCORE)
    assert "class_mask" not in "".join(alg.model.state_dict())  # never travels
