"""Check a topology's inputs before anything trains: the data opens, the partition fits it,
the model takes its inputs (``p2pfl validate``, ``p2pfl swarm`` and ``p2pfl node`` before
any node starts; a node then builds its method once, :func:`~p2pfl.algorithms.build.node_method`).

Each problem is a :class:`~p2pfl.errors.ConfigError` naming the topology file and the
field to fix (``dataset.root``, ``dataset.partition``, ``model.name``), with the message of
what failed: the missing folder, the zip and its corrupt member, the partition argument out
of range, the shape the model could not take. With ``dataset.partition: none`` each node's
own data is checked (:func:`~p2pfl.learning.node_inputs.check_node_data`): the message names
the node and its file, the field is the one to fix (``dataset.root``, ``dataset.label``, ``dataset.classes``,
``dataset.name``, ``dataset.stats``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from p2pfl.algorithms import DecentralizedAlgorithm, get_algorithm
from p2pfl.algorithms.base import Method, drawn_count
from p2pfl.algorithms.build import adapt_for, method_over, model_error
from p2pfl.config.schema import TopologyConfig, is_import_path
from p2pfl.config.topology import build_graph
from p2pfl.errors import ConfigError
from p2pfl.learning.data import NodeData
from p2pfl.learning.models import UserModelError, build_model
from p2pfl.learning.node_inputs import check_dataset, check_node_data, root_note
from p2pfl.learning.partition import partition_indices
from p2pfl.learning.robust import check_bounds
from p2pfl.learning.split_model import SplitModel
from p2pfl.learning.task import Task, model_outputs, task_of
from p2pfl.learning.user_code import UserCodeError, describe


def check_own_data(
    cfg: TopologyConfig,
    *,
    source: str = "topology",
    data_root: str | None = None,
    node_ids: Sequence[str] | None = None,
    cache_dir=None,
) -> NodeData:
    """:func:`check_node_data` for every node of the topology (once per distinct root,
    except for a dataset function, which is called for each node), then the same input
    shape everywhere, else a :class:`ConfigError` on ``dataset.root`` naming the node, its
    file and both shapes, and the same classes (they differ only where ``dataset.classes``
    is not set: ImageFolders of different folders), else one on ``dataset.classes``.
    ``node_ids``: only these nodes (the ones a device hosts). Returns the first node's data."""
    ds = cfg.dataset.with_root(data_root)
    first: NodeData | None = None
    first_id = ""
    seen: set[str | None] = set()
    for node_id in node_ids or cfg.node_ids:
        root = ds.root_for(node_id)
        if root in seen and not is_import_path(ds.name):
            continue
        seen.add(root)
        data = check_node_data(
            cfg, node_id, source=source, data_root=data_root, cache_dir=cache_dir
        )
        if first is None:
            first, first_id = data, node_id
        elif tuple(data.input_shape) != tuple(first.input_shape):
            raise ConfigError(
                source,
                [
                    (
                        "dataset.root",
                        f"node {node_id!r}: {data.source}: inputs of shape "
                        f"{list(data.input_shape)}, but node {first_id!r}'s ({first.source}) "
                        f"are {list(first.input_shape)}: every node's inputs must have one shape",
                    )
                ],
            )
        elif data.classes != first.classes:  # dataset.classes unset: each node's own
            raise ConfigError(
                source,
                [
                    (
                        "dataset.classes",
                        f"node {node_id!r}: {data.source}: classes {data.classes}, but node "
                        f"{first_id!r}'s ({first.source}) are {first.classes}: set "
                        "dataset.classes, the swarm's label space",
                    )
                ],
            )
    assert first is not None  # a topology has at least one node
    return first


def check_inputs(
    cfg: TopologyConfig,
    *,
    source: str = "topology",
    data_root: str | None = None,
    node_ids: Sequence[str] | None = None,
    cache_dir=None,
) -> SplitModel:
    """The swarm's model as the method adapts it (for ``p2pfl validate`` to show its
    split); raise :class:`ConfigError` (naming ``source`` and the field) unless the dataset
    (at ``data_root`` when given) opens, its partition over the swarm's nodes can be drawn,
    and the model accepts the dataset's input shape (:func:`check_model`). With
    ``dataset.partition: none`` every node's own data is loaded instead
    (:func:`check_own_data`: it opens, its labels are in ``dataset.classes``, every node's
    input shape is the same; only ``node_ids``' when given) and the model is checked on the
    first node's. A node runs the
    same checks as it loads (:mod:`p2pfl.node.daemon`), drawing its partition only once."""
    if cfg.dataset.own_data:
        data = check_own_data(
            cfg, source=source, data_root=data_root, node_ids=node_ids, cache_dir=cache_dir
        )
        return check_model(cfg, data.num_classes, tuple(data.input_shape), source)
    ds = cfg.dataset.with_root(data_root)
    arrays = check_dataset(ds, cfg.seed, source, cache_dir, root_note(cfg, data_root))
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
    return check_model(cfg, arrays.num_classes, tuple(arrays.input_shape), source)


def check_model(
    cfg: TopologyConfig, num_classes: int, shape: tuple[int, ...], source: str = "topology"
) -> SplitModel:
    """The swarm's model for ``num_classes`` and inputs of ``shape``, built, run on one
    input, adapted and handed to the method (:func:`check_method`); a :class:`ConfigError`
    otherwise, on ``model.name`` (the factory does not import or raises, the forward
    fails), ``model.personal`` (a prefix matches nothing, the split leaves a part empty) or
    ``algorithm.name`` (the method cannot work with this model), ``training.loss`` (the
    model's outputs do not fit the loss, or the user's loss or metric does not import or
    fails on them: :func:`check_task`). Torch's global random state is left as it was
    (callers that share it between threads hold their own lock around this)."""
    task = user_task(cfg, source)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model = build_model(cfg.model, model_outputs(cfg, num_classes), shape)
            outputs = model.eval()(torch.zeros(2, *shape))
    except (UserModelError, RuntimeError, ValueError, TypeError) as exc:
        if getattr(exc, "field", None) == "training.loss":
            why = f"{cfg.training.loss}: {str(exc).split(': ', 1)[-1]}"
            raise ConfigError(source, [("training.loss", why)]) from None
        raise model_error(cfg, shape, exc, source) from None
    check_task(cfg, task, tuple(outputs.shape), num_classes, source)
    return check_method(cfg, model, num_classes, shape, source)


def user_task(cfg: TopologyConfig, source: str) -> Task:
    """The topology's :class:`~p2pfl.learning.task.Task`, a user's loss or metric imported;
    a :class:`ConfigError` naming ``training.loss`` or ``evaluation.metrics`` when one does
    not import."""
    try:
        return task_of(cfg)
    except UserCodeError as exc:
        field = "training.loss" if str(exc).startswith("training.loss") else "evaluation.metrics"
        raise ConfigError(source, [(field, str(exc))]) from None


def check_task(
    cfg: TopologyConfig, task: Task, shape: tuple[int, ...], num_classes: int, source: str
) -> None:
    """The model's outputs (``shape``, for a batch of 2) fit the loss, and the loss and the
    metrics compute on them (with labels of the task's kind); a :class:`ConfigError` on
    ``training.loss`` or ``evaluation.metrics`` naming what disagrees."""
    why = task.output_problem(shape, num_classes)
    if why is not None:
        raise ConfigError(source, [("training.loss", why)])
    outputs = torch.zeros(shape)
    if task.targets == "classes":
        labels = torch.tensor([0, min(1, num_classes - 1)])
    else:
        columns = task.value_columns
        labels = torch.ones(2, columns) if columns > 1 else torch.ones(2)
    try:
        loss = task.loss(outputs, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"returned {type(loss).__name__}, not a one-value tensor")
    except Exception as exc:  # the user's loss meeting the model's outputs
        why = f"{cfg.training.loss!r} on outputs {tuple(shape)}: {describe(exc)}"
        raise ConfigError(source, [("training.loss", why)]) from None
    try:
        task.score(outputs, labels)
    except Exception as exc:  # a metric meeting the task's outputs and labels
        why = f"{list(task.metrics)} on outputs {tuple(shape)}: {describe(exc)}"
        raise ConfigError(source, [("evaluation.metrics", why)]) from None


def check_method(
    cfg: TopologyConfig,
    model: SplitModel,
    num_classes: int,
    shape: tuple[int, ...],
    source: str = "topology",
) -> SplitModel:
    """``model`` adapted by the topology's method (e.g. pFedC's heads), after building the
    method over it once as a node does (its knobs, its labels, a snapshot and, for a
    decentralized method, its gossip); a :class:`ConfigError` on ``algorithm.name`` naming
    the method, the model and what failed, so a method that cannot work with a user's
    model says so before the swarm starts."""
    check_secagg(cfg, source)  # first: it names why a defence or knob cannot run with it
    check_defence(cfg, source)
    check_timing(cfg, source)
    check_transfer(cfg, source)
    check_privacy(cfg, source)
    cls = get_algorithm(cfg.algorithm.name)
    check_parts(cls, cfg, model, source)
    targets = cfg.dataset.targets or cfg.default_targets
    why = cls.task_problem(cfg.training.loss, targets, model_outputs(cfg, num_classes))
    if why is not None:
        what = f"method {cfg.algorithm.name!r} {why}"
        raise ConfigError(source, [("training.loss", what)])
    try:
        with torch.random.fork_rng(devices=[]):
            model = adapt_for(cls, cfg, model, num_classes)  # as every node builds it
            if cfg.dp is not None:
                check_dp_model(cfg, model, source)
            method = method_over(
                cls,
                cfg,
                model,
                node_id="preflight",
                num_samples=1,
                num_classes=num_classes,
                input_shape=tuple(shape),
                labels=torch.zeros(1, dtype=torch.long),
                rng=np.random.default_rng(0),
            )
            method.snapshot()
            if isinstance(method, DecentralizedAlgorithm):
                method.gossip()
    except ConfigError:
        raise
    except Exception as exc:  # any failure here is the method meeting this model
        raise ConfigError(
            source,
            [
                (
                    "algorithm.name",
                    f"method {cfg.algorithm.name!r} cannot work with model "
                    f"{cfg.model.name!r}: {describe(exc)}",
                )
            ],
        ) from None
    return model


def check_parts(cls: type[Method], cfg: TopologyConfig, model: SplitModel, source: str) -> None:
    """A :class:`ConfigError` on ``model.personal`` when the method's maths needs a part of
    the model (:attr:`~p2pfl.algorithms.base.Method.needs_parts`) that the split leaves
    empty, in one line naming the method and what to give."""
    empty = sorted(cls.needs_parts - model.parts_held)
    if not empty:
        return
    personal = getattr(model, "personal", cfg.model.personal)
    if "g" in empty:
        why = (
            f"model.personal {personal} covers every parameter, so the shared part g is "
            "empty: list only the layers each node keeps to itself"
        )
    else:
        why = (
            f"model.personal {personal} keeps nothing personal, so the part h is empty: list "
            "the layers each node keeps to itself (e.g. the last nn.Linear)"
        )
    needs = " and ".join(
        {"g": "a shared part g", "h": "a personal part h"}[p] for p in sorted(cls.needs_parts)
    )
    raise ConfigError(
        source, [("model.personal", f"method {cfg.algorithm.name!r} needs {needs}: {why}")]
    )


def split_summary(model: SplitModel) -> dict[str, list[str]]:
    """The model's split for people: ``{"g": [...], "h": [...]}``, each the modules whose
    tensors are in that part, with their parameter counts (``body.1 (1,040)``)."""
    out: dict[str, list[str]] = {"g": [], "h": []}
    counts: dict[tuple[str, str], int] = {}
    for name, tensor in model.state_dict().items():
        part, _, rest = name.partition(".")
        module = rest.rsplit(".", 1)[0] if "." in rest else rest
        key = (part, module)
        counts[key] = counts.get(key, 0) + (tensor.numel() if tensor.is_floating_point() else 0)
    for (part, module), n in counts.items():
        out.setdefault(part, []).append(f"{module} ({n:,})")
    return out


def check_timing(cfg: TopologyConfig, source: str = "topology") -> None:
    """The ``timing:`` knobs fit the method's kind: ``mode: async`` is the decentralized
    methods' (a centralized method's rounds are the aggregator's: ``quorum`` makes them
    semi-asynchronous), ``quorum`` the centralized ones'. A :class:`ConfigError` naming the
    field otherwise."""
    cls = get_algorithm(cfg.algorithm.name)
    t = cfg.timing
    if cls.kind == "centralized" and t.mode == "async":
        why = (
            f"{cls.name} is centralized: its rounds are the aggregator's; set timing.quorum "
            "(a fraction of the members) for semi-asynchronous rounds instead"
        )
        raise ConfigError(source, [("timing.mode", why)])
    if cls.kind != "centralized" and t.quorum is not None:
        why = (
            f"{cls.name} is decentralized: no aggregator waits for a quorum; use timing.mode: async"
        )
        raise ConfigError(source, [("timing.quorum", why)])


def _fits(d, n: int) -> bool:
    """Whether ``n`` inputs satisfy the bounds of the defence ``d``'s rule."""
    try:
        check_bounds(d.rule, n, d.f, d.m, d.beta)
    except ValueError:
        return False
    return True


def check_defence(cfg: TopologyConfig, source: str = "topology") -> None:
    """The ``defence:`` rule fits the swarm: its bounds hold for the most inputs a node can
    combine (a decentralized node: itself and its neighbours, checked on the node with the
    fewest; the round's aggregator: every node, or under a client fraction ``C < 1`` the
    ``max(1, ⌊C·K + ½⌋)`` members a round draws of the ``K`` nodes), and the method can
    combine under it (a method's ``defences``, when it lists them). A :class:`ConfigError`
    on ``defence.rule`` naming the rule, n and f otherwise, or on
    ``algorithm.params.fraction`` when the rule would fit every node but not the members
    the fraction draws. At run time a round with fewer inputs than the rule needs (peers
    absent) falls back to the coordinate-wise median, recorded."""
    d = cfg.defence
    cls = get_algorithm(cfg.algorithm.name)
    supported = getattr(cls, "defences", None)
    if supported is not None and d.rule not in supported:
        why = f"{cls.name} combines with {', '.join(supported)} only, not {d.rule}"
        raise ConfigError(source, [("defence.rule", why)])
    if cls.kind == "centralized":
        n, where = len(cfg.nodes), f"the aggregator combines at most {len(cfg.nodes)} uploads"
        fraction = float(getattr(cls.Params.model_validate(cfg.algorithm.params), "fraction", 1))
        drawn = drawn_count(fraction, n)
        if drawn < n and _fits(d, n):
            try:
                check_bounds(d.rule, drawn, d.f, d.m, d.beta)
            except ValueError as exc:
                why = str(exc).removeprefix("defence.rule ")
                msg = (
                    f"fraction {fraction} draws {drawn} of the {n} nodes a round: too few "
                    f"uploads for defence.rule {why}; raise the fraction or choose a rule "
                    f"that fits {drawn} inputs"
                )
                raise ConfigError(source, [("algorithm.params.fraction", msg)]) from None
            n = drawn
            where = (
                f"the aggregator combines at most {drawn} uploads (fraction {fraction} of "
                f"{len(cfg.nodes)} nodes)"
            )
    else:
        graph = build_graph(cfg)
        node = min(cfg.node_ids, key=lambda x: (graph.degree(x), x))
        n = 1 + graph.degree(node)
        where = f"node {node} combines at most {n} states (itself and {n - 1} neighbours)"
    try:
        check_bounds(d.rule, n, d.f, d.m, d.beta)
    except ValueError as exc:
        why = str(exc).removeprefix("defence.rule ")  # the field is named already
        raise ConfigError(source, [("defence.rule", f"{why}: {where}")]) from None


def check_transfer(cfg: TopologyConfig, source: str = "topology") -> None:
    """``transfer.compress`` can run in this swarm (docs/wire.md, "Compression"), else a
    :class:`ConfigError` on it saying why: a lossy codec (``fp16``, ``int8``,
    ``topk(rho)``) cannot meet the audit of a signed centralized swarm, which recomputes
    the aggregate bit for bit from uploads it pulls compressed while the aggregator
    counted its own upload exact."""
    mode = cfg.transfer.compress
    audited = cfg.security.sign and cfg.security.audit
    if mode != "none" and audited and get_algorithm(cfg.algorithm.name).kind == "centralized":
        why = (
            f"{mode} is lossy and security.audit recomputes each aggregate bit for bit, so "
            "every honest aggregator would be convicted; use compress: none, or "
            "security.audit: false"
        )
        raise ConfigError(source, [("transfer.compress", why)])


def check_privacy(cfg: TopologyConfig, source: str = "topology") -> None:
    """``privacy.dp`` can run in this swarm (docs/algorithms.md, "Differential privacy"),
    else a :class:`ConfigError` naming the field and why. At ``level: sample`` the method
    must not replace the loss (a ``loss_fn`` couples the samples of a batch, so per-sample
    clipping would not bound one record's influence: pFedC); at ``level: update`` it must
    send nothing computed from its raw training beyond the released model
    (:meth:`~p2pfl.algorithms.base.Method.update_dp_problem`: CriticalFL's report,
    DisPFL's ``regrow: grad``). ``target_epsilon`` must be above the least ε the
    accountant can certify for ``delta`` however large the noise."""
    dp = cfg.dp
    if dp is None:
        return
    cls = get_algorithm(cfg.algorithm.name)
    if dp.level == "update":
        problem = cls.update_dp_problem(cls.Params.model_validate(cfg.algorithm.params))
        if problem is not None:
            raise ConfigError(source, [problem])
    elif cls.loss_fn is not Method.loss_fn:
        why = (
            f"{cls.name} trains with its own loss over the whole batch (loss_fn), whose "
            "per-sample gradients DP-SGD cannot clip; choose another method, level: update, "
            "or no privacy.dp"
        )
        raise ConfigError(source, [("privacy.dp", why)])
    if dp.target_epsilon is not None:
        floor = _epsilon_floor(dp.level, dp.delta, dp.accountant)
        if dp.target_epsilon <= floor:
            once = "one release" if dp.level == "update" else "one step"
            why = (
                f"{dp.target_epsilon} is below {floor:.3g}, the least ε the {dp.accountant} "
                f"accountant certifies for delta {dp.delta} even for {once} with any noise"
            )
            raise ConfigError(source, [("privacy.dp.target_epsilon", why)])


# why secure aggregation cannot serve a centralized method other than the sum-based ones
SECAGG_REFUSED = {
    "fedsa": "its dispersion split and its clustering read every member's weights",
    "criticalfl": "its critical-period test reads every member's gradient norm",
    "diversifed": "it builds each member's own model from the pairwise distances of all uploads",
    "pfedc": "its clustering reads every member's head",
}
SECAGG_METHODS = ("fedavg", "fedper")


def check_secagg(cfg: TopologyConfig, source: str = "topology") -> None:
    """``privacy.secagg`` can run in this swarm (docs/design.md, "Secure aggregation"): the
    aggregator then only ever learns the weighted sum of the uploads, so everything that
    reads an individual upload is refused, each with a :class:`ConfigError` naming the
    field and why: a decentralized method, a centralized method other than the sum-based
    FedAvg and FedPer, a ``defence.rule`` other than ``mean``, an active ``security.audit``,
    ``timing.quorum`` (late uploads are individual), a ``transfer.compress`` other than
    ``none``, and fewer than 3 uploaders a round (the sum of 2 is either's upload to the
    other)."""
    p = cfg.privacy
    if p is None or not p.secagg:
        return
    cls = get_algorithm(cfg.algorithm.name)
    field = "privacy.secagg"
    if cls.kind != "centralized":
        why = (
            f"{cls.name} is decentralized: every node merges its neighbours' individual "
            "states (and gates them per neighbour), there is no aggregator to hide them from; "
            "use fedavg or fedper, or no privacy.secagg"
        )
        raise ConfigError(source, [(field, why)])
    if cls.name not in SECAGG_METHODS:
        why = SECAGG_REFUSED.get(cls.name, "its server rule reads individual uploads")
        why = f"{cls.name} cannot aggregate a masked sum: {why}; secure aggregation serves fedavg and fedper"
        raise ConfigError(source, [(field, why)])
    if cfg.defence.rule != "mean":
        why = (
            f"{cfg.defence.rule} screens or combines individual uploads, which secure "
            "aggregation hides from the aggregator; set defence.rule: mean"
        )
        raise ConfigError(source, [("defence.rule", why)])
    if cfg.security.sign and cfg.security.audit:
        why = (
            "the auditor recomputes the aggregate from the individual uploads, which secure "
            "aggregation hides; set security.audit: false"
        )
        raise ConfigError(source, [("security.audit", why)])
    if cfg.timing.quorum is not None:
        why = "a late upload is counted on its own in a later round; remove timing.quorum"
        raise ConfigError(source, [("timing.quorum", why)])
    if cfg.transfer.compress != "none":
        why = "masked field elements are uniformly random and cannot be compressed; use none"
        raise ConfigError(source, [("transfer.compress", why)])
    fraction = float(getattr(cls.Params.model_validate(cfg.algorithm.params), "fraction", 1))
    drawn = drawn_count(fraction, len(cfg.nodes))
    if drawn < 3:
        why = (
            f"{drawn} uploader(s) a round: secure aggregation needs at least 3 (the sum of "
            "2 uploads is either one's upload to the other)"
        )
        raise ConfigError(source, [("algorithm.params.fraction" if fraction < 1 else "nodes", why)])


def _epsilon_floor(level: str, delta: float, accountant: str) -> float:
    if level == "update":
        from p2pfl.privacy.update_accountant import update_epsilon_floor  # dp-accounting

        return update_epsilon_floor(delta, accountant)
    from p2pfl.privacy.accountant import epsilon_floor  # Opacus: only under privacy.dp

    return epsilon_floor(delta, accountant)


def check_dp_model(cfg: TopologyConfig, model: SplitModel, source: str = "topology") -> None:
    """At ``privacy.dp.level: sample``, a :class:`ConfigError` on ``privacy.dp`` naming the
    layers of ``model`` (as a node under ``privacy.dp`` trains it:
    :func:`~p2pfl.algorithms.build.adapt_for`) that Opacus still cannot train per sample."""
    from p2pfl.learning.dp_train import dp_problems  # Opacus: only under privacy.dp

    if cfg.dp is not None and cfg.dp.level == "update":  # trained as usual: no per-sample need
        return
    problems = dp_problems(model)
    if problems:
        why = f"model {cfg.model.name!r} has layers DP-SGD cannot train: {'; '.join(problems)}"
        raise ConfigError(source, [("privacy.dp", why)])
