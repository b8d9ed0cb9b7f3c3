"""Building a node's model and method, the one way the daemon, preflight, the audit's
tools and :func:`p2pfl.load_model` all build them.

* :func:`build_node_model`: the swarm's common initial model (``model`` built with torch's
  RNG seeded with ``seed``, under :data:`MODEL_INIT_LOCK`), adapted by the method
  (:func:`adapt_for`);
* :func:`adapt_for`: a built model as method ``cls`` trains it: the method's adaptation
  (e.g. pFedC's heads), then, under ``privacy.dp``, the layers DP-SGD cannot train replaced
  (:func:`~p2pfl.learning.dp_train.fix_model`);
* :func:`method_over`: method ``cls`` over a model, told its knobs, the run's rounds, its
  epochs, its defence and its training labels;
* :func:`node_model`: a node's model (the common initial model, on its device);
* :func:`build_method`: a node's method over the common initial model, from its data.
"""

from __future__ import annotations

import logging
import threading
import zlib

import numpy as np
import torch

from p2pfl.algorithms.base import AlgorithmContext, Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.data import NodeData
from p2pfl.learning.defence import Defence
from p2pfl.learning.models import SplitModel, build_model
from p2pfl.learning.train import epoch_steps, round_epochs

log = logging.getLogger(__name__)

# torch's global RNG is shared by co-hosted nodes: whoever builds a model holds this
MODEL_INIT_LOCK = threading.Lock()


def node_seed(seed: int, node_id: str) -> list[int]:
    """A per-node seed sequence that is stable across processes (no ``hash()``)."""
    return [seed, zlib.crc32(node_id.encode())]


def adapt_for(
    cls: type[Method],
    cfg: TopologyConfig,
    model: SplitModel,
    num_classes: int,
    replaced: list[str] | None = None,
) -> SplitModel:
    """``model`` as method ``cls`` trains it under ``cfg``: adapted by the method, then,
    under ``privacy.dp`` (either level), with the layers DP-SGD cannot train replaced
    (BatchNorm → GroupNorm; at ``level: update`` for BatchNorm's running statistics, which
    the noise would turn into negative variances); their names are appended to
    ``replaced`` when given."""
    params = cls.Params.model_validate(cfg.algorithm.params)
    model = cls.adapt_model(model, params, num_classes)
    if cfg.dp is None:
        return model
    from p2pfl.learning.dp_train import fix_model  # Opacus: only under privacy.dp

    model, names = fix_model(model)
    if replaced is not None:
        replaced.extend(names)
    return model


def build_node_model(
    cls: type[Method],
    cfg: TopologyConfig,
    num_classes: int,
    input_shape: tuple[int, ...],
    replaced: list[str] | None = None,
) -> SplitModel:
    """The swarm's common initial model for method ``cls``: ``model`` built with torch's RNG
    seeded with ``cfg.seed`` (under :data:`MODEL_INIT_LOCK`), then :func:`adapt_for`. Every
    node, and :func:`p2pfl.load_model`, builds the same."""
    with MODEL_INIT_LOCK:  # the same initial model on every node of the swarm
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, num_classes, input_shape)
        return adapt_for(cls, cfg, model, num_classes, replaced)


def method_over(
    cls: type[Method],
    cfg: TopologyConfig,
    model: SplitModel,
    *,
    node_id: str,
    num_samples: int,
    num_classes: int,
    input_shape: tuple[int, ...],
    labels: torch.Tensor,
    rng: np.random.Generator,
    device: torch.device | None = None,
) -> Method:
    """Method ``cls`` of node ``node_id`` over ``model`` (already adapted): its knobs
    (``algorithm.params``), the topology's defence, its epochs, the run's rounds (e.g.
    DisPFL's annealing horizon) and its training ``labels``."""
    ctx = AlgorithmContext(
        node_id=node_id,
        model=model,
        num_samples=num_samples,
        num_classes=num_classes,
        input_shape=tuple(input_shape),
        rng=rng,
        device=device if device is not None else torch.device("cpu"),
        defence=Defence(cfg.defence, cfg.rounds),
    )
    method = cls(cfg.algorithm.params, ctx)
    method.local_epochs = round_epochs(
        cfg.training, epoch_steps(num_samples, cfg.training.batch_size)
    )
    method.total_rounds = cfg.rounds
    method.set_labels(labels)
    return method


def node_model(
    cls: type[Method], cfg: TopologyConfig, node_id: str, data: NodeData, device: torch.device
) -> SplitModel:
    """Node ``node_id``'s model: the swarm's common initial model (:func:`build_node_model`)
    for its data's classes and input shape, on ``device``. Under ``privacy.dp`` it logs,
    once, the layers replaced for DP."""
    replaced: list[str] = []
    model = build_node_model(cls, cfg, data.num_classes, tuple(data.input_shape), replaced)
    if cfg.dp is not None:
        log.info(
            "%s: privacy.dp: layers replaced for DP: %s", node_id, "; ".join(replaced) or "none"
        )
    return model.to(device)


def build_method(
    cls: type[Method],
    cfg: TopologyConfig,
    node_id: str,
    data: NodeData,
    rng: np.random.Generator,
    device: torch.device,
) -> Method:
    """Node ``node_id``'s method instance over the swarm's common initial model
    (:func:`node_model`), on ``device``, from its data (:func:`method_on_data`)."""
    return method_on_data(
        cls, cfg, node_model(cls, cfg, node_id, data, device), node_id, data, rng, device
    )


def method_on_data(
    cls: type[Method],
    cfg: TopologyConfig,
    model: SplitModel,
    node_id: str,
    data: NodeData,
    rng: np.random.Generator,
    device: torch.device,
) -> Method:
    """:func:`method_over` ``model`` with what node ``node_id``'s ``data`` says: its sample
    count, classes, input shape and training labels."""
    return method_over(
        cls,
        cfg,
        model,
        node_id=node_id,
        num_samples=len(data.train_y),
        num_classes=data.num_classes,
        input_shape=tuple(data.input_shape),
        labels=data.train_y,
        rng=rng,
        device=device,
    )
