"""Partitions and per-node test splits (p2pfl.learning.partition; pure index maths on label
arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from p2pfl.learning import partition as P

C = 10


def _labels(n_per_class: int = 300, classes: int = C, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(classes), n_per_class))


def _max_class_fraction(labels: np.ndarray, shards: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[s], minlength=C).max() / len(s) for s in shards]))


def _assert_disjoint(shards: list[np.ndarray]) -> np.ndarray:
    allidx = np.concatenate(shards)
    assert len(np.unique(allidx)) == len(allidx), "shards overlap"
    return allidx


# ----------------------------------------------------------------------------- partitions


@pytest.mark.parametrize(
    "spec", ["iid", "dirichlet(0.5)", "pathological(2)", "groups", "groups(2,4,0.7)"]
)
def test_partition_is_deterministic(spec):
    labels = _labels()
    a = P.partition_indices(labels, 8, spec, seed=1, num_classes=C)
    b = P.partition_indices(labels.copy(), 8, spec, seed=1, num_classes=C)
    assert len(a) == 8
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(x.dtype == np.int64 for x in a)
    c = P.partition_indices(labels, 8, spec, seed=2, num_classes=C)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    d = P.partition_indices(labels, 8, spec, seed=1, num_classes=C, salt="other-dataset")
    assert any(not np.array_equal(x, y) for x, y in zip(a, d, strict=True))
    _assert_disjoint(a)


@pytest.mark.parametrize("spec", ["iid", "dirichlet(0.5)", "dirichlet(0.1)", "dirichlet(100)"])
def test_iid_and_dirichlet_cover_every_sample(spec):
    labels = _labels()
    shards = P.partition_indices(labels, 7, spec, seed=0, num_classes=C)
    allidx = _assert_disjoint(shards)
    assert np.array_equal(np.sort(allidx), np.arange(len(labels)))


def test_iid_shards_are_balanced():
    shards = P.partition_indices(_labels(), 7, "iid", seed=0, num_classes=C)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_label_skewed():
    labels = _labels()
    iid = _max_class_fraction(labels, P.partition_indices(labels, 10, "iid", 0, C))
    skew = _max_class_fraction(labels, P.partition_indices(labels, 10, "dirichlet(0.1)", 0, C))
    mild = _max_class_fraction(labels, P.partition_indices(labels, 10, "dirichlet(100)", 0, C))
    assert iid < 0.2 and mild < 0.25
    assert skew > 0.5 and skew > 2.5 * iid


def test_dirichlet_min_samples_respected_and_impossible_is_clear():
    labels = _labels(n_per_class=30)  # 300 samples
    for seed in range(5):
        shards = P.partition_indices(labels, 10, "dirichlet(0.05)", seed, C, min_samples=12)
        assert min(len(s) for s in shards) >= 12
    with pytest.raises(ValueError, match="min_samples"):
        P.partition_indices(labels, 10, "dirichlet(0.5)", 0, C, min_samples=31)
    with pytest.raises(ValueError, match="tries"):
        P.partition_indices(labels, 10, "dirichlet(100)", 0, C, min_samples=30)


def test_pathological_gives_exactly_k_classes_equally():
    labels = _labels()
    for nodes in (5, 8, 12):
        shards = P.partition_indices(labels, nodes, "pathological(2)", 0, C)
        _assert_disjoint(shards)
        seen = set()
        for s in shards:
            hist = np.bincount(labels[s], minlength=C)
            present = np.flatnonzero(hist)
            assert len(present) == 2
            assert hist[present[0]] == hist[present[1]]
            seen.update(present.tolist())
        assert seen == set(range(C))  # nodes * k >= classes: every class is used
    with pytest.raises(ValueError, match="pathological"):
        P.partition_indices(labels, 4, "pathological(11)", 0, C)


@pytest.mark.parametrize("spec,g,d,f", [("groups", 3, 3, 0.8), ("groups(2,4,0.6)", 2, 4, 0.6)])
def test_groups_fraction_from_dominant_classes(spec, g, d, f):
    labels = _labels()
    nodes = 9
    shards = P.partition_indices(labels, nodes, spec, 0, C)
    _assert_disjoint(shards)
    tops = []
    for i, s in enumerate(shards):
        hist = np.bincount(labels[s], minlength=C)
        dom = np.argsort(-hist, kind="stable")[:d]
        assert hist[dom].sum() / hist.sum() == pytest.approx(f, abs=0.03)
        assert len(np.flatnonzero(hist)) == C  # the rest comes from every other class
        tops.append((i % g, frozenset(dom.tolist())))
    # nodes of one group share their dominant classes; different groups differ
    by_group: dict[int, set] = {}
    for grp, dom in tops:
        by_group.setdefault(grp, set()).add(dom)
    assert all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == g


def test_partition_errors_are_clear():
    labels = _labels(n_per_class=1)
    with pytest.raises(ValueError, match="no samples"):
        P.partition_indices(labels, 20, "iid", 0, C)
    with pytest.raises(ValueError, match="partition must be"):
        P.partition_indices(labels, 2, "bogus", 0, C)
    with pytest.raises(ValueError, match="groups"):
        P.partition_indices(_labels(), 3, "groups(2,10,0.5)", 0, C)


def test_subsample_keeps_proportions():
    labels = _labels()
    idx = np.flatnonzero(labels < 3)[:600]
    hist = np.bincount(labels[idx], minlength=C)
    sub = P.subsample_like(labels, idx, 60, C, np.random.default_rng(0))
    assert len(sub) == 60 and set(sub) <= set(idx)
    np.testing.assert_allclose(
        np.bincount(labels[sub], minlength=C), hist / hist.sum() * 60, atol=1
    )


def test_test_split_follows_train_distribution():
    test_labels = _labels(n_per_class=100, seed=5)
    train_hist = np.array([50, 0, 30, 0, 0, 20, 0, 0, 0, 0])
    rng = np.random.default_rng(0)
    idx = P.test_indices_like(test_labels, train_hist, 40, rng)
    assert len(idx) == 40 and len(np.unique(idx)) == 40
    hist = np.bincount(test_labels[idx], minlength=C)
    assert set(np.flatnonzero(hist)) == set(np.flatnonzero(train_hist))
    np.testing.assert_allclose(hist / 40, train_hist / train_hist.sum(), atol=0.03)
    again = P.test_indices_like(test_labels, train_hist, 40, np.random.default_rng(0))
    assert np.array_equal(idx, again)
    # a class short of test samples gives all it has; the rest goes to the node's other classes
    idx = P.test_indices_like(test_labels, np.array([900, 100] + [0] * 8), 300, rng)
    hist = np.bincount(test_labels[idx], minlength=C)
    assert hist[0] == 100 and hist[1] == 100 and hist[2:].sum() == 0
