"""What each node will train on, for ``p2pfl validate``: its training and test sample
counts and the optimizer steps it takes a round, with a warning where a node holds fewer
training rows than a batch.

The steps a round are the trainer's (:func:`~p2pfl.learning.train.round_steps`):
``training.steps`` where it is set, else ``epochs × ⌈n / batch_size⌉`` for plain training
(``training.epochs``, else the fewest whole epochs that reach ``training.min_steps``) and
``epochs × ⌊1/q⌋`` Poisson-sampled steps for DP-SGD at ``level: sample``
(:func:`~p2pfl.privacy.accountant.steps_per_epoch`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.data import load_node_data
from p2pfl.learning.node_inputs import check_node_data
from p2pfl.learning.train import epoch_steps
from p2pfl.learning.train import round_steps as round_steps_of
from p2pfl.privacy.accountant import sample_rate, steps_per_epoch

LISTED = 12
"""Nodes listed one per line by :func:`describe_sizes`; a larger swarm is summarised."""


@dataclass(frozen=True)
class NodeSize:
    """Node ``node``'s training and test samples and its optimizer steps a round."""

    node: str
    train: int
    test: int
    steps_per_round: int


def round_steps(cfg: TopologyConfig, n_train: int) -> int:
    """The optimizer steps a node with ``n_train`` training samples takes a round (module
    docstring)."""
    batch = cfg.training.batch_size
    dp = cfg.dp
    if dp is not None and dp.level == "sample" and n_train > 0:
        per_epoch = steps_per_epoch(sample_rate(batch, n_train))
    else:
        per_epoch = epoch_steps(n_train, batch)
    return round_steps_of(cfg.training, per_epoch)


def node_sizes(
    cfg: TopologyConfig,
    *,
    source: str = "topology",
    data_root: str | None = None,
    node_ids: Sequence[str] | None = None,
    cache_dir=None,
) -> list[NodeSize]:
    """Every node's (or ``node_ids``') :class:`NodeSize`, from the data each node loads as
    it starts (its partition shard, or its own files). A node whose data does not load
    raises the :class:`~p2pfl.errors.ConfigError` that :func:`check_node_data` raises."""
    ds = cfg.dataset.with_root(data_root)
    sizes = []
    for node_id in node_ids or cfg.node_ids:
        if ds.own_data:
            data = check_node_data(
                cfg, node_id, source=source, data_root=data_root, cache_dir=cache_dir
            )
        else:
            data = load_node_data(ds, cfg.node_ids, node_id, cfg.seed, cache_dir)
        n_train, n_test = len(data.train_y), len(data.test_y)
        sizes.append(NodeSize(node_id, n_train, n_test, round_steps(cfg, n_train)))
    return sizes


def size_warnings(cfg: TopologyConfig, sizes: Sequence[NodeSize]) -> list[str]:
    """One warning naming the nodes with fewer training rows than ``training.batch_size``
    (each of their epochs is one short batch)."""
    batch = cfg.training.batch_size
    small = [s for s in sizes if s.train < batch]
    if not small:
        return []
    names = ", ".join(f"{s.node} ({s.train})" for s in small[:LISTED])
    more = f" and {len(small) - LISTED} more" if len(small) > LISTED else ""
    if cfg.training.steps is not None:
        how = f"they take {cfg.training.steps} steps a round (training.steps)"
    elif cfg.training.epochs is None:
        how = f"they take {small[0].steps_per_round} steps a round (training.min_steps)"
    else:
        how = "set a smaller training.batch_size, or more training.epochs"
    return [
        f"training.batch_size: {len(small)} node(s) hold fewer training rows than a batch "
        f"of {batch}: {names}{more}; each epoch is one short batch: {how}"
    ]


def describe_sizes(cfg: TopologyConfig, sizes: Sequence[NodeSize]) -> list[str]:
    """Lines for ``p2pfl validate``: one a node (train, test, steps a round) for up to
    :data:`LISTED` nodes, else the minimum, median and maximum over the nodes."""
    epochs, batch = cfg.training.epochs, cfg.training.batch_size
    if cfg.training.steps is not None:
        how = f"{cfg.training.steps} steps (training.steps) of batches of {batch}"
    elif epochs is not None:
        how = f"{epochs} epoch(s) of batches of {batch}"
    else:
        how = (
            f"at least {cfg.training.min_steps} steps (training.min_steps) in whole epochs "
            f"of batches of {batch}"
        )
    lines = [f"training a round: {how}"]
    if len(sizes) <= LISTED:
        width = max(len(s.node) for s in sizes)
        lines += [
            f"  {s.node:<{width}}  train {s.train:>6}  test {s.test:>6}  "
            f"{s.steps_per_round} steps a round"
            for s in sizes
        ]
        return lines
    for what, values in (
        ("train", [s.train for s in sizes]),
        ("test", [s.test for s in sizes]),
        ("steps a round", [s.steps_per_round for s in sizes]),
    ):
        lines.append(
            f"  {what}: min {min(values)}, median {statistics.median(values):g}, "
            f"max {max(values)} over {len(sizes)} nodes"
        )
    return lines
