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
* :func:`node_method`: a node's method over the common initial model, from its data, with
  :func:`warm_start` from ``model.init``, each failure a
  :class:`~p2pfl.errors.ConfigError` naming the field (:func:`model_error` for the model's):
  the one way the daemon, the audit's tools and the tests build a node's method.
"""

from __future__ import annotations

import logging
import threading
import zlib

import numpy as np
import torch

from p2pfl.algorithms.base import AlgorithmContext, Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.errors import ConfigError
from p2pfl.learning.data import NodeData
from p2pfl.learning.defence import Defence
from p2pfl.learning.models import SplitModel, UserModelError, build_model
from p2pfl.learning.task import model_outputs
from p2pfl.learning.train import epoch_steps, epochs_for_steps
from p2pfl.learning.user_code import describe

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
        model = build_model(cfg.model, model_outputs(cfg, num_classes), input_shape)
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
    method.local_epochs = epochs_for_steps(
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


def model_error(
    cfg: TopologyConfig, shape: tuple[int, ...], exc: Exception, source: str
) -> ConfigError:
    """The :class:`ConfigError` for a model that could not be built or run on inputs of
    ``shape``: a user model's own field (:class:`UserModelError`), else ``model.name`` with
    the first line of what failed."""
    if isinstance(exc, UserModelError):
        return ConfigError(source, [(exc.field, str(exc))])
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    why = why.split(": ", 1)[1] if why.startswith("model ") and ": " in why else why
    what = f"model {cfg.model.name!r} cannot take {cfg.dataset.name} inputs of shape"
    return ConfigError(source, [("model.name", f"{what} {list(shape)}: {why}")])


def node_method(
    cls: type[Method],
    cfg: TopologyConfig,
    node_id: str,
    data: NodeData,
    rng: np.random.Generator,
    device: torch.device,
    source: str = "topology",
) -> Method:
    """Node ``node_id``'s method, the one that runs, over the swarm's common initial model
    (:func:`node_model`, seeded as every node builds it) and its data
    (:func:`method_on_data`); a failure is a :class:`ConfigError` naming ``source`` and the field (the model's:
    ``model.name`` or a user model's own field; the method's: ``algorithm.name``) instead
    of a traceback. The checks of :func:`~p2pfl.check.preflight.check_model` are not
    repeated: whoever starts a node checks its inputs first (``p2pfl node``, ``p2pfl
    swarm``, :func:`p2pfl.run_swarm`)."""
    shape = tuple(data.input_shape)
    try:
        model = node_model(cls, cfg, node_id, data, device)
    except (UserModelError, RuntimeError, ValueError, TypeError) as exc:
        raise model_error(cfg, shape, exc, source) from None
    if cfg.model.init is not None:
        warm_start(model, cfg.model.init, source)
    try:
        return method_on_data(cls, cfg, model, node_id, data, rng, device)
    except Exception as exc:  # the method meeting this node's model and data
        why = (
            f"node {node_id!r}: method {cfg.algorithm.name!r} cannot work with model "
            f"{cfg.model.name!r}: {describe(exc)}"
        )
        raise ConfigError(source, [("algorithm.name", why)]) from None


def warm_start(model: SplitModel, path: str, source: str = "topology") -> None:
    """Load the safetensors file ``path`` (``model.init``: a model this node's own
    architecture wrote, as ``p2pfl export`` and a site's model store keep it) into
    ``model``, every tensor, its personal part included; a :class:`ConfigError` naming
    ``source`` and ``model.init`` when it cannot be read or does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from p2pfl.learning.artifacts import layout_problems
    from p2pfl.learning.layout import tensor_specs

    module = model.export_module()
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            source, [("model.init", f"{path}: not a readable safetensors file: {exc}")]
        ) from None
    problems = layout_problems(tensor_specs(module.state_dict()), weights)
    if problems:
        why = f"{path}: the weights do not fit this model: " + "; ".join(problems)
        raise ConfigError(source, [("model.init", why)])
    with torch.no_grad():
        module.load_state_dict(weights, strict=True)
