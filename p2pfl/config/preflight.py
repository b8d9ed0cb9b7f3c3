"""Check a topology's inputs before anything trains: the data opens, the partition fits it,
the model takes its inputs (``p2pfl validate``, and every node as it starts).

Each problem is a :class:`~p2pfl.config.load.ConfigError` naming the topology file and the
field to fix (``dataset.root``, ``dataset.partition``, ``model.name``), with the message of
what failed: the missing folder, the zip and its corrupt member, the partition argument out
of range, the shape the model could not take.
"""

from __future__ import annotations

from pathlib import Path

import torch

from p2pfl.config.load import ConfigError
from p2pfl.config.schema import DatasetConfig, TopologyConfig
from p2pfl.learning.data import DatasetArrays, load_arrays
from p2pfl.learning.models import build_model
from p2pfl.learning.partition import partition_indices

DOWNLOADABLE = ("fashionmnist", "mnist", "cifar10", "cifar100", "svhn")


def check_dataset(ds: DatasetConfig, seed: int, source: str, cache_dir=None) -> DatasetArrays:
    """The dataset's arrays, or a :class:`ConfigError` on ``dataset.root`` saying why not."""
    if ds.name != "synthetic" and ds.root:
        root = Path(ds.root).expanduser()
        if not root.exists() and not (ds.download and ds.name in DOWNLOADABLE):
            raise ConfigError(source, [("dataset.root", f"{root} does not exist")])
    try:
        return load_arrays(ds, seed, cache_dir)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        raise ConfigError(source, [("dataset.root", f"dataset {ds.name!r}: {exc}")]) from None


def check_inputs(
    cfg: TopologyConfig,
    *,
    source: str = "topology",
    data_root: str | None = None,
    cache_dir=None,
) -> None:
    """Raise :class:`ConfigError` (naming ``source`` and the field) unless the dataset
    (at ``data_root`` when given) opens, its partition over the swarm's nodes can be drawn,
    and the model accepts the dataset's input shape (:func:`check_model`). A node runs the
    same checks as it loads (:mod:`p2pfl.node.daemon`), drawing its partition only once."""
    ds = cfg.dataset if data_root is None else cfg.dataset.model_copy(update={"root": data_root})
    arrays = check_dataset(ds, cfg.seed, source, cache_dir)
    spec = ds.partition.strip().replace(" ", "")
    try:
        partition_indices(
            arrays.train_y,
            len(cfg.node_ids),
            spec,
            cfg.seed,
            arrays.num_classes,
            ds.min_samples,
            salt=ds.name,
        )
    except ValueError as exc:
        raise ConfigError(source, [("dataset.partition", str(exc))]) from None
    check_model(cfg, arrays.num_classes, tuple(arrays.input_shape), source)


def check_model(
    cfg: TopologyConfig, num_classes: int, shape: tuple[int, ...], source: str = "topology"
) -> None:
    """Raise :class:`ConfigError` on ``model.name`` unless the model takes one input of
    ``shape``. Torch's global random state is left as it was (callers that share it between
    threads hold their own lock around this)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model = build_model(cfg.model, num_classes, shape)
            model.eval()(torch.zeros(1, *shape))
    except (RuntimeError, ValueError, TypeError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = why.split(": ", 1)[1] if why.startswith("model ") and ": " in why else why
        what = f"model {cfg.model.name!r} cannot take {cfg.dataset.name} inputs of shape"
        raise ConfigError(source, [("model.name", f"{what} {list(shape)}: {why}")]) from None
