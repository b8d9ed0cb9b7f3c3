"""Partitioners: split a dataset's train labels over the nodes of a swarm.

Contract: pure numpy index maths, no I/O. Every result is a deterministic function of the seed,
the dataset (its labels, and its name as ``salt``), the partition spec and the node count:
random draws come from :func:`stable_rng`, a numpy Generator seeded with stable CRC32 hashes of
the strings (never Python's ``hash()``), so every node computes the same partition on its own
and keeps its own shard (node index = position of its id in the swarm's node list), in every
process and on every host.

The partitions follow docs/algorithms.md, "Data partitions": ``dirichlet(a)``,
``pathological(k)`` and the practical ``groups(G,D,F)``, plus ``iid``;
:func:`test_indices_like` draws a node's test split following its own train label distribution.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from p2pfl.config.schema import PARTITION_RE

MAX_DIRICHLET_TRIES = 1000


def stable_rng(*parts: int | str) -> np.random.Generator:
    """A numpy Generator seeded from ints and strings (strings through CRC32): the same parts
    give the same stream in every process and on every host."""
    words: list[int] = []
    for p in parts:
        if isinstance(p, str):
            words.append(zlib.crc32(p.encode("utf-8")))
        else:
            v = int(p) % (1 << 64)
            words.extend((v & 0xFFFFFFFF, v >> 32))
    return np.random.default_rng(np.random.SeedSequence(words))


def _apportion(weights: Sequence[float] | np.ndarray, total: int) -> np.ndarray:
    """Split the integer ``total`` proportionally to ``weights`` (largest remainder; ties go
    to the lower index). All-zero weights give all zeros."""
    w = np.asarray(weights, dtype=np.float64)
    out = np.zeros(len(w), dtype=np.int64)
    if total <= 0 or w.sum() <= 0:
        return out
    raw = w / w.sum() * total
    out = np.floor(raw).astype(np.int64)
    rest = int(total - out.sum())
    if rest > 0:
        order = np.argsort(-(raw - out), kind="stable")
        out[order[:rest]] += 1
    return out


# ----------------------------------------------------------------------------- partitions


def _parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    m = PARTITION_RE.match(spec.strip().replace(" ", ""))
    if not m:
        raise ValueError(
            "partition must be one of iid, dirichlet(ALPHA), pathological(K), groups, "
            f"groups(G,DOMINANT,FRACTION); got {spec!r}"
        )
    if m.group("iid"):
        return "iid", {}
    if m.group("alpha") is not None:
        return "dirichlet", {"alpha": float(m.group("alpha"))}
    if m.group("k") is not None:
        return "pathological", {"k": int(m.group("k"))}
    if m.group("g") is not None:
        return "groups", {
            "g": int(m.group("g")),
            "d": int(m.group("dom")),
            "f": float(m.group("frac")),
        }
    return "groups", {"g": 3, "d": 3, "f": 0.8}


def partition_indices(
    labels: np.ndarray,
    num_nodes: int,
    spec: str,
    seed: int,
    num_classes: int,
    min_samples: int = 10,
    *,
    salt: str = "",
) -> list[np.ndarray]:
    """Split the sample indices ``0..len(labels)-1`` over ``num_nodes`` nodes by ``spec``.

    Returns one sorted int64 index array per node; shards are pairwise disjoint.
    Deterministic in ``(labels, num_nodes, spec, seed, salt)`` (``salt``: e.g. the dataset
    name). Specs:

    * ``iid``: a random permutation cut into ``num_nodes`` near-equal shards (covers all).
    * ``dirichlet(a)``: per class, proportions over nodes drawn from ``Dir(a)`` (nodes that
      already hold ``>= N/num_nodes`` samples get no more, as in NIID-Bench); the draw is
      repeated until every node has ``>= min_samples`` samples (at most 1000 tries, then
      ``ValueError``). Covers all samples.
    * ``pathological(k)``: node ``i`` holds classes ``perm[(i*k + j) % C]``, ``j < k`` (all
      classes covered when ``num_nodes * k >= C``); each class is cut into equal chunks, one
      per node holding it, and a node takes the same number of samples from each of its classes.
    * ``groups(G,D,F)`` (``groups`` = ``groups(3,3,0.8)``): node ``i`` is in group ``i % G``;
      group ``g`` has ``D`` dominant classes ``perm[(g*D + j) % C]``; a fraction ``F`` of each
      node's samples come from its group's dominant classes (equally), the rest from the other
      classes (equally). Every node gets the same number of samples, as many as the classes
      can supply.

    Raises ``ValueError`` when the spec cannot be met (e.g. a node would get fewer than
    ``min_samples`` samples under Dirichlet, or no samples at all otherwise).
    """
    labels = np.asarray(labels).astype(np.int64, copy=False)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    kind, args = _parse_spec(spec)
    rng = stable_rng(seed, salt, spec.strip().replace(" ", ""), num_nodes, "partition")
    n = len(labels)
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]

    if kind == "iid":
        shards = np.array_split(rng.permutation(n), num_nodes)
    elif kind == "dirichlet":
        shards = _dirichlet(by_class, n, num_nodes, args["alpha"], min_samples, rng)
    elif kind == "pathological":
        shards = _pathological(by_class, num_nodes, int(args["k"]), num_classes, rng)
    else:
        shards = _groups(
            by_class, n, num_nodes, int(args["g"]), int(args["d"]), args["f"], num_classes, rng
        )
    out = [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    sizes = [len(s) for s in out]
    if min(sizes) == 0:
        raise ValueError(
            f"partition {spec!r} over {num_nodes} nodes leaves node {sizes.index(0)} with no "
            f"samples ({n} samples, {num_classes} classes); use fewer nodes or another partition"
        )
    return out


def _dirichlet(
    by_class: list[np.ndarray],
    n: int,
    num_nodes: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    if num_nodes * min_samples > n:
        raise ValueError(
            f"dirichlet({alpha}): {n} samples cannot give each of {num_nodes} nodes at least "
            f"min_samples={min_samples}"
        )
    cap = n / num_nodes
    for _ in range(MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
        sizes = np.zeros(num_nodes, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_nodes, alpha))
            if not np.all(np.isfinite(p)):
                p = np.full(num_nodes, 1.0 / num_nodes)
            balanced = np.where(sizes < cap, p, 0.0)
            p = balanced if balanced.sum() > 0 else p
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
                sizes[k] += len(chunk)
        if sizes.min() >= min_samples:
            return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]
    raise ValueError(
        f"dirichlet({alpha}): no draw in {MAX_DIRICHLET_TRIES} tries gave every one of "
        f"{num_nodes} nodes at least min_samples={min_samples} samples; raise alpha, lower "
        "dataset.min_samples or use fewer nodes"
    )


def _pathological(
    by_class: list[np.ndarray],
    num_nodes: int,
    k: int,
    num_classes: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if not 1 <= k <= num_classes:
        raise ValueError(f"pathological({k}): k must be in 1..{num_classes} (the class count)")
    perm = rng.permutation(num_classes)
    assign = [[int(perm[(i * k + j) % num_classes]) for j in range(k)] for i in range(num_nodes)]
    holders: dict[int, list[int]] = {}
    for i, cls in enumerate(assign):
        for c in cls:
            holders.setdefault(c, []).append(i)
    shuffled = {c: rng.permutation(by_class[c]) for c in sorted(holders)}
    chunk = {c: len(shuffled[c]) // len(holders[c]) for c in holders}
    shards = []
    for i, cls in enumerate(assign):
        m = min(chunk[c] for c in cls)
        take = []
        for c in cls:
            start = holders[c].index(i) * chunk[c]
            take.append(shuffled[c][start : start + m])
        shards.append(np.concatenate(take))
    return shards


def _groups(
    by_class: list[np.ndarray],
    n: int,
    num_nodes: int,
    groups: int,
    dominant: int,
    frac: float,
    num_classes: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    spec = f"groups({groups},{dominant},{frac})"
    if groups < 1 or not 1 <= dominant <= num_classes:
        raise ValueError(f"{spec}: need G >= 1 and 1 <= D <= {num_classes} (the class count)")
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"{spec}: the dominant fraction must be in [0, 1]")
    if dominant == num_classes and frac < 1.0:
        raise ValueError(f"{spec}: D equals the class count, so no classes are left for 1-F")
    perm = rng.permutation(num_classes)
    dom = [
        {int(perm[(g * dominant + j) % num_classes]) for j in range(dominant)}
        for g in range(groups)
    ]
    others = num_classes - dominant
    w = np.zeros((num_nodes, num_classes))
    for i in range(num_nodes):
        for c in range(num_classes):
            if c in dom[i % groups]:
                w[i, c] = frac / dominant
            elif others:
                w[i, c] = (1.0 - frac) / others
    supply = np.array([len(b) for b in by_class], dtype=np.float64)
    demand = w.sum(axis=0)
    used = demand > 0
    size = min(n / num_nodes, float(np.min(supply[used] / demand[used])))
    counts = np.floor(size * w).astype(np.int64)
    shards: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
    for c in range(num_classes):
        idx = rng.permutation(by_class[c])
        start = 0
        for i in range(num_nodes):
            shards[i].append(idx[start : start + counts[i, c]])
            start += counts[i, c]
    return [np.concatenate(s) for s in shards]


def subsample_like(
    labels: np.ndarray, idx: np.ndarray, cap: int, num_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """At most ``cap`` of the indices ``idx``, keeping the label proportions (largest
    remainder per class; random within a class). Sorted int64."""
    idx = np.asarray(idx, dtype=np.int64)
    if len(idx) <= cap:
        return idx
    lab = labels[idx]
    hist = np.bincount(lab, minlength=num_classes)
    want = _apportion(hist, cap)
    take = [rng.permutation(idx[lab == c])[: want[c]] for c in range(num_classes) if want[c]]
    return np.sort(np.concatenate(take))


def test_indices_like(
    test_labels: np.ndarray,
    train_hist: Sequence[int] | np.ndarray,
    n_test: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """``n_test`` indices into ``test_labels`` whose label distribution follows ``train_hist``
    (largest remainder per class, sampled without replacement by ``rng``). A class with too
    few test samples gives all it has and the shortfall goes to the node's other classes.
    Classes absent from ``train_hist`` are never drawn. Sorted int64."""
    hist = np.asarray(train_hist, dtype=np.int64)
    test_labels = np.asarray(test_labels).astype(np.int64, copy=False)
    by_class = [np.flatnonzero(test_labels == c) for c in range(len(hist))]
    avail = np.array([len(b) for b in by_class], dtype=np.int64)
    want = _apportion(hist, n_test)
    for _ in range(len(hist) + 1):
        excess = int(np.maximum(want - avail, 0).sum())
        want = np.minimum(want, avail)
        if excess == 0:
            break
        room = (avail > want) & (hist > 0)
        if not room.any():
            break
        want += np.minimum(_apportion(np.where(room, hist, 0), excess), avail - want)
    take = [rng.choice(by_class[c], size=int(want[c]), replace=False) for c in range(len(hist))]
    out = np.concatenate(take) if take else np.zeros(0, np.int64)
    return np.sort(out.astype(np.int64))


test_indices_like.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


__all__ = [
    "MAX_DIRICHLET_TRIES",
    "partition_indices",
    "stable_rng",
    "subsample_like",
    "test_indices_like",
]
