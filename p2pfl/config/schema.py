"""The topology schema: pydantic models of a swarm's configuration, nothing else.

A topology file describes one swarm: who the nodes are, how they connect, which algorithm
they run, on which data and model. Unknown keys are rejected everywhere so that a typo never
silently falls back to a default. Reading files, ``--set`` overrides and the check of a
method's knobs are :mod:`p2pfl.check.load`'s: this module is the ground floor that the rest
of p2pfl (the method registry included) builds on, so it imports none of it but its
sibling section modules (docs/design.md, "Configuration"): :mod:`p2pfl.config.dataset_schema`
(``dataset:``), :mod:`p2pfl.config.learning_schema` (``model:``, ``training:``),
:mod:`p2pfl.config.runtime_schema` (``timing:``, ``transfer:``, ``security:``),
:mod:`p2pfl.config.privacy_schema` (``privacy:``) and :mod:`p2pfl.config.emulation`
(``network:``, ``devices:``). Here are the rest: the swarm's own fields, ``algorithm:``,
``edges:``, ``defence:``, ``attacks:``, and a device's ``nodes/`` file. The sections' names
are re-exported, so the rest of p2pfl imports the whole schema from this one module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from p2pfl.config import bounds as B
from p2pfl.config.dataset_schema import BUILTIN_DATASETS as BUILTIN_DATASETS
from p2pfl.config.dataset_schema import FILE_DATASETS as FILE_DATASETS
from p2pfl.config.dataset_schema import IMPORT_PATH_RE as IMPORT_PATH_RE
from p2pfl.config.dataset_schema import PARTITION_RE as PARTITION_RE
from p2pfl.config.dataset_schema import DatasetConfig, is_import_path
from p2pfl.config.emulation import DeviceSpec, NetworkConfig, chosen_nodes
from p2pfl.config.learning_schema import BUILTIN_MODELS as BUILTIN_MODELS
from p2pfl.config.learning_schema import (
    CLASS_METRICS,
    EvaluationConfig,
    ModelConfig,
    TrainingConfig,
)
from p2pfl.config.learning_schema import MODEL_KNOBS as MODEL_KNOBS
from p2pfl.config.privacy_schema import DPConfig, PrivacyConfig
from p2pfl.config.runtime_schema import SecurityConfig, TimingConfig, TransferConfig
from p2pfl.config.strict import PathNotes, StrictModel

PARAMS_CHECK = "validate_params"

ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
"""A node id, a swarm's name (and a site's, a run's, a data binding's): what a topic level
and a file name may hold."""

ShareKind = Literal["whole_weights", "shared_part", "representations"]
SHARE_KINDS: tuple[str, ...] = get_args(ShareKind)
"""What a method may send off its node (``Method.shares``, which a site's policy ``share``
checks): its whole model's weights (the personal part included), only the shared part
``g``, or representations of its data (UA-PDFL's unit and auxiliary representations)."""
"""The validation-context key under which a loader passes the check of a method's knobs:
``check(name, params) -> params with defaults``, raising ``ValueError`` on a wrong knob."""

ParamsCheck = Callable[[str, dict[str, Any]], dict[str, Any]]


# ----------------------------------------------------------------------------- sections


class BrokerAddress(StrictModel):
    """Where the MQTT broker is: ``host:port``, or ``mdns`` to discover it (docs/wire.md,
    "Discovery")."""

    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    mdns: bool = False

    @classmethod
    def parse(cls, value: str) -> BrokerAddress:
        if value.strip().lower() == "mdns":
            return cls(mdns=True)
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"broker must be 'host:port' or 'mdns', got {value!r}")
        return cls(host=host, port=int(port))

    def __str__(self) -> str:
        return "mdns" if self.mdns else f"{self.host}:{self.port}"


class AlgorithmConfig(StrictModel):
    """``name`` picks a module in ``p2pfl.algorithms``; ``params`` are that method's knobs."""

    name: str = "uapdfl"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self, info: ValidationInfo) -> AlgorithmConfig:
        """Check ``params`` with the check the loader passes in the validation context
        (:data:`PARAMS_CHECK`; :mod:`p2pfl.check.load` passes the method registry's), which
        fills in defaults, so a wrong knob is reported as ``algorithm: params.<knob>: ...``.
        Without one, ``params`` stay as given: the schema does not know the methods."""
        check: ParamsCheck | None = (info.context or {}).get(PARAMS_CHECK)
        if check is not None:
            object.__setattr__(self, "params", check(self.name, self.params))
        return self


UNRECORDED_DEFAULTS = (
    ("training", "loss", "cross_entropy"),
    ("evaluation", "metrics", None),
    ("dataset", "targets", "classes"),
    ("training", "steps", None),
    ("training", "optimizer_state", "reset"),
    ("dataset", "test_root", None),
    ("defence", "spread", 0.0),
    ("defence", "radius", 2.0),
)
"""``(section, field, default)``: what :meth:`TopologyConfig.dump` leaves out at its default."""


class GeneratedEdges(StrictModel):
    """A graph generated over the nodes, whoever they are: what a topology's ``edges`` and a
    run spec's (whose members are known only at the commit) share. Written as the kind's
    name (``edges: full``, :func:`edges_by_name`) or a mapping with the kind's knobs;
    checked by :meth:`check`."""

    kind: Literal["ring", "full", "star", "line", "random-k", "erdos"]
    k: int | None = Field(None, ge=1, le=B.MAX_NODES, description="random-k: neighbours per node")
    p: float | None = Field(None, gt=0, le=1, description="erdos: edge probability")
    center: str | None = Field(None, description="star: the hub node id (default: first)")

    def check(self, ids: list[str] | None) -> None:
        """Raise ``ValueError`` (``edges...: why``) when the kind lacks its knob (random-k:
        ``k``, erdos: ``p``) or, over the node ids ``ids`` (None: not known yet), would
        enumerate more edges than the bound or centres a star on no node."""
        if self.kind == "random-k" and self.k is None:
            raise ValueError("edges: random-k needs k")
        if self.kind == "erdos" and self.p is None:
            raise ValueError("edges: erdos needs p")
        if ids is None:
            return
        B.check_edges(self.kind, len(ids), self.k)
        if self.center is not None and self.center not in ids:
            raise ValueError(f"edges.center: unknown node id {self.center!r}")


def edges_by_name(v: Any) -> Any:
    """``edges:`` as written, before it is validated: a generated kind's name (``full``)
    is the mapping ``{kind: full}``; anything else as it is."""
    return {"kind": v} if isinstance(v, str) else v


def _generated_only(v: Any) -> Any:
    if isinstance(v, list):
        raise ValueError(
            "a run spec's edges are generated (ring, full, star, line, random-k, erdos): "
            "its members are known only at the commit, so it cannot list edges between them"
        )
    return edges_by_name(v)


GeneratedEdgesField = Annotated[GeneratedEdges, BeforeValidator(_generated_only)]
"""``edges:`` where only a generated graph fits (a run spec's): a kind's name or a mapping,
as a topology takes it; a list of edges is refused with the reason."""


class NodeSpec(StrictModel):
    id: str = Field(pattern=ID_PATTERN)
    host: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,253}$",
        description="the device this node runs on: `p2pfl node TOPOLOGY --host NAME` runs "
        "every node pinned to NAME (default: this machine's hostname)",
    )


DefenceRule = Literal[
    "mean", "median", "trimmed_mean", "multikrum", "bulyan", "clip", "centered_clip"
]
DEFENCE_RULES: tuple[str, ...] = get_args(DefenceRule)


class DefenceConfig(StrictModel):
    """How a node screens and combines its peers' states (docs/design.md, "Robust
    aggregation"). Admission (``max_norm_ratio``, ``max_sample_ratio``, ``max_samples``) is
    always on; ``rule`` picks the combination every method uses in place of its mean."""

    rule: DefenceRule = Field(
        "centered_clip",
        description="mean (plain weighted mean), median (coordinate-wise), trimmed_mean "
        "(beta), multikrum (f, m), bulyan (f; n >= 4f + 3), clip (accept a peer's state "
        "when ||w_j - w_i|| <= gamma * exp(-kappa t / T) * ||w_i||, refuse it beyond, then "
        "the mean), centered_clip (a state beyond `radius` medians of the round's distances "
        "is pulled onto that radius instead of refused, then the mean). Default "
        "centered_clip; mean under "
        "privacy.secagg (the one rule that works on a sum)",
    )
    f: int = Field(
        1, ge=0, le=B.MAX_NODES, description="multikrum, bulyan: the Byzantine inputs tolerated"
    )
    m: int | None = Field(
        None,
        ge=1,
        le=B.MAX_NODES,
        description="multikrum: how many of the best-scored states are averaged (default: n - f)",
    )
    beta: float = Field(
        0.1, ge=0, lt=0.5, description="trimmed_mean: the fraction cut from each end"
    )
    gamma: float = Field(
        1.0, gt=0, description="clip: the distance bound at t = 0, relative to ||w_i||"
    )
    kappa: float = Field(
        0.5, ge=0, description="clip: how fast the bound tightens over the run's rounds"
    )
    spread: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="clip: the bound widens to this many times the median distance of the "
        "round's other states to the reference when that is larger (0: the fixed bound)",
    )
    radius: float = Field(
        2.0,
        gt=0,
        le=1e6,
        description="centered_clip: the clipping radius, in medians of the distances of the "
        "round's other states to the reference (with fewer than 3 of them: clip's bound)",
    )

    max_norm_ratio: float = Field(
        10.0,
        gt=1,
        description="admission: a state whose norm exceeds this many times the norm of "
        "the node's own matching state is refused",
    )
    max_sample_ratio: float = Field(
        10.0,
        gt=1,
        description="admission: a claimed sample count above this many times the median "
        "of the counts seen in the round (the node's own included) is capped there",
    )
    max_samples: int | None = Field(
        None, ge=1, le=B.MAX_CLAIM, description="admission: a hard cap on any claimed sample count"
    )
    distrust_rounds: int = Field(
        2,
        ge=0,
        le=B.MAX_ROUNDS,
        description="reputation: a peer refused in a round is left out of the draws for "
        "this many rounds, doubling with each further refusal (0: never)",
    )


AttackKind = Literal[
    "sign_flip",
    "scale",
    "noise",
    "nan",
    "alie",
    "ipm",
    "free_rider",
    "label_flip",
    "inflate_n",
    "delay",
]
ATTACK_KINDS: tuple[str, ...] = get_args(AttackKind)


class AttackSpec(StrictModel):
    """One attack of an experiment (docs/design.md, "Attack scenarios"): which nodes, when,
    and what they do. An attack wraps what a node serves or how it trains; the methods'
    code paths stay the honest ones."""

    kind: AttackKind
    nodes: list[str] | None = Field(None, description="the attackers, by id")
    fraction: float | None = Field(
        None, gt=0, le=1, description="or: this fraction of the nodes, drawn with the seed"
    )
    from_round: int = Field(1, ge=1, le=B.MAX_ROUNDS)
    to_round: int | None = Field(None, ge=1, le=B.MAX_ROUNDS)
    corrupts: Literal["model", "result", "both"] = Field(
        "model",
        description="what the attacker corrupts: the model it serves (snapshot or upload), "
        "the aggregate it serves as the round's aggregator (a malicious aggregator), or both",
    )
    factor: float = Field(100.0, description="scale: the multiplier (model replacement)")
    sigma: float = Field(1.0, gt=0, description="noise: the Gaussian's standard deviation")
    z: float | None = Field(
        None, description="alie: the standard deviations shifted (default: from n and f)"
    )
    epsilon: float = Field(0.5, gt=0, description="ipm: the inner-product manipulation scale")
    source: int | None = Field(
        None,
        ge=0,
        le=B.MAX_CLASSES,
        description="label_flip: the class relabelled (default: every class)",
    )
    target: int | None = Field(
        None,
        ge=0,
        le=B.MAX_CLASSES,
        description="label_flip: the class it becomes (default: C - 1 - y)",
    )
    claim: int = Field(
        10**9, ge=1, le=B.MAX_CLAIM, description="inflate_n: the sample count claimed"
    )
    delay_s: float = Field(
        5.0, ge=0, le=B.MAX_SECONDS, description="delay: seconds before serving a pull"
    )

    @model_validator(mode="after")
    def _check_who(self) -> AttackSpec:
        if (self.nodes is None) == (self.fraction is None):
            raise ValueError(f"attack {self.kind}: give nodes or fraction (one of them)")
        if self.to_round is not None and self.to_round < self.from_round:
            raise ValueError(f"attack {self.kind}: to_round before from_round")
        if (self.source is None) != (self.target is None):
            raise ValueError(f"attack {self.kind}: source and target go together")
        return self


class TopologyConfig(PathNotes):
    """One swarm: nodes, edges, algorithm, data, model, training."""

    name: str = Field(pattern=ID_PATTERN)
    seed: int = Field(0, ge=0, le=B.MAX_SEED)
    broker: BrokerAddress = Field(default_factory=BrokerAddress)
    rounds: int = Field(5, ge=1, le=B.MAX_ROUNDS)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    timing: TimingConfig = Field(default_factory=TimingConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    defence: DefenceConfig = Field(default_factory=DefenceConfig)
    network: NetworkConfig = Field(
        default_factory=NetworkConfig, description="emulated links (none: the real network)"
    )
    devices: list[DeviceSpec] = Field(
        default_factory=list, description="emulated devices: compute speed, offline windows"
    )
    attacks: list[AttackSpec] = Field(
        default_factory=list, description="attack scenarios for experiments (none: honest)"
    )
    privacy: PrivacyConfig | None = Field(
        None, description="differential privacy (none: off, and absent from dumps)"
    )
    nodes: list[NodeSpec]
    edges: GeneratedEdges | list[tuple[str, str]] = Field(
        default_factory=lambda: GeneratedEdges(kind="ring")
    )
    max_message_mb: float = Field(
        4.0, gt=0, le=B.MAX_MESSAGE_MB, description="largest single MQTT message accepted"
    )
    max_transfer_mb: float = Field(
        2048.0, gt=0, le=B.MAX_TRANSFER_MB, description="largest weight transfer accepted"
    )
    code_dir: str | None = Field(
        None,
        description="the folder a user's own code ('package.module:name' in model.name, "
        "dataset.name, algorithm.name) is imported from, before the current directory "
        "(default: the topology file's folder; recorded only where the topology names such code)",
    )

    @field_validator("broker", mode="before")
    @classmethod
    def _broker_from_string(cls, v: Any) -> Any:
        return BrokerAddress.parse(v) if isinstance(v, str) else v

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes_from_count(cls, v: Any) -> Any:
        """``nodes: 8`` means n0..n7; a list may hold ids or ``{id, host}`` maps."""
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 1:
                raise ValueError("node count must be at least 1")
            if v > B.MAX_NODES:  # before a spec is built for each
                raise ValueError(f"{v:,} nodes, above the bound of {B.MAX_NODES:,}")
            return [{"id": f"n{i}"} for i in range(v)]
        if isinstance(v, list):
            if len(v) > B.MAX_NODES:
                raise ValueError(f"{len(v):,} nodes listed, above the bound of {B.MAX_NODES:,}")
            return [{"id": x} if isinstance(x, str) else x for x in v]
        return v

    @field_validator("edges", mode="before")
    @classmethod
    def _edges_from_string(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > B.MAX_EDGES:  # before each is validated
            raise ValueError(f"{len(v):,} edges listed, above the bound of {B.MAX_EDGES:,}")
        return edges_by_name(v)

    @model_validator(mode="after")
    def _check_graph(self) -> TopologyConfig:
        ids = [n.id for n in self.nodes]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"nodes: duplicate ids {dup}")
        if isinstance(self.edges, list):
            known = set(ids)
            for a, b in self.edges:
                for x in (a, b):
                    if x not in known:
                        raise ValueError(f"edges: unknown node id {x!r} in edge [{a}, {b}]")
                if a == b:
                    raise ValueError(f"edges: self-loop on {a!r}")
        else:
            self.edges.check(ids)
        for i, attack in enumerate(self.attacks):
            unknown = sorted(set(attack.nodes or ()) - set(ids))
            if unknown:
                raise ValueError(f"attacks[{i}].nodes: unknown node ids {unknown}")
        for i, link in enumerate(self.network.links):
            unknown = sorted((set(link.nodes or ()) | set(link.edge or ())) - set(ids))
            if unknown:
                raise ValueError(f"network.links[{i}]: unknown node ids {unknown}")
        for i, device in enumerate(self.devices):
            unknown = sorted(set(device.nodes or ()) - set(ids))
            if unknown:
                raise ValueError(f"devices[{i}].nodes: unknown node ids {unknown}")
        return self

    def attackers(self) -> dict[str, list[AttackSpec]]:
        """Each attacking node's attacks: ``nodes`` as given, ``fraction`` as
        ``round(fraction * N)`` (at least 1) nodes drawn by a permutation seeded with
        ``seed`` and the attack's position, so every node computes the same set."""
        out: dict[str, list[AttackSpec]] = {}
        hosts = self.node_hosts
        for i, attack in enumerate(self.attacks):
            chosen = chosen_nodes(
                i, "attack", attack.nodes, None, attack.fraction, self.seed, hosts
            )
            for node in chosen:
                out.setdefault(node, []).append(attack)
        return out

    @model_validator(mode="after")
    def _task(self) -> TopologyConfig:
        """``dataset.targets`` left unset follows ``training.loss`` (values for ``mse``,
        ``mae`` and a user's loss without ``dataset.classes``); then the loss, the labels and
        the metrics are checked against each other."""
        ds, training = self.dataset, self.training
        targets = ds.targets or self.default_targets
        if ds.targets != targets:
            values = {**ds.__dict__, "targets": targets}
            self.dataset = DatasetConfig.model_construct(set(ds.model_fields_set), **values)
        loss = training.loss
        if targets == "values":
            if training.loss in ("cross_entropy", "bce"):
                raise ValueError(
                    f"training.loss: {loss} trains on classes; dataset.targets is values"
                )
            if not ds.own_data:
                raise ValueError(
                    "dataset.targets: values (training.loss "
                    f"{loss}) are a node's own labels: give dataset.partition: none"
                )
        else:
            if training.value_loss:
                raise ValueError(
                    f"dataset.targets: classes, but training.loss {loss} trains on values"
                )
            if isinstance(ds.label, list):
                raise ValueError(
                    "dataset.label: a list of columns holds values (dataset.targets: values)"
                )
            if loss == "bce" and self.class_count not in (None, 2):
                raise ValueError(
                    f"training.loss: bce is one logit for two classes; the dataset has "
                    f"{self.class_count} (cross_entropy takes any number)"
                )
        for name in self.evaluation.metrics or ():
            if name in CLASS_METRICS and targets == "values":
                raise ValueError(
                    f"evaluation.metrics: {name} scores classes; the labels are values"
                )
            if name in ("mae", "rmse", "c_index") and targets == "classes":
                raise ValueError(
                    f"evaluation.metrics: {name} scores values; the labels are classes"
                )
        return self

    @property
    def default_targets(self) -> str:
        """What ``training.loss`` trains on where ``dataset.targets`` is unset."""
        if self.training.value_loss:
            return "values"
        user_loss = self.training.loss not in ("cross_entropy", "bce")
        return "values" if user_loss and self.dataset.classes is None else "classes"

    @property
    def class_count(self) -> int | None:
        """The number of classes the topology names (``dataset.classes``, or a synthetic
        dataset's ``num_classes``); None where the data alone says (a built-in dataset)."""
        ds = self.dataset
        if ds.classes is not None:
            return ds.classes if isinstance(ds.classes, int) else len(ds.classes)
        return ds.num_classes if ds.name == "synthetic" else None

    @model_validator(mode="after")
    def _default_rule(self) -> TopologyConfig:
        """``defence.rule`` left unset takes the default that fits the other switches:
        ``mean`` under ``privacy.secagg`` (which hides the individual uploads every other
        rule reads), else ``centered_clip``. It stays unset (``model_fields_set``), so
        :meth:`defaulted_rule` can say so; a rule the user set is kept, and checked."""
        d = self.defence
        if self.defaulted_rule is not None and d.rule != self.defaulted_rule:
            values = {**d.__dict__, "rule": self.defaulted_rule}
            self.defence = DefenceConfig.model_construct(set(d.model_fields_set), **values)
        return self

    @property
    def defaulted_rule(self) -> str | None:
        """The ``defence.rule`` the switches chose where the user set none and the plain
        default (``centered_clip``) cannot work: ``mean`` under ``privacy.secagg``; else None."""
        secagg = self.privacy is not None and self.privacy.secagg
        return "mean" if secagg and "rule" not in self.defence.model_fields_set else None

    @property
    def dp(self) -> DPConfig | None:
        """``privacy.dp`` when differential privacy is on (either level), else None."""
        return None if self.privacy is None else self.privacy.dp

    def dump(self) -> dict[str, Any]:
        """The config as JSON-able data, without ``privacy`` when it is not set (so a run
        without it records exactly what it did before the section existed)."""
        data = self.model_dump(mode="json")
        if data.get("privacy") is None:
            data.pop("privacy", None)
        # fields a run that does not set them recorded before they existed: left out at
        # their defaults, so its config.yaml and its checkpoints' fingerprint stay the same
        for section, name, default in UNRECORDED_DEFAULTS:
            if data.get(section, {}).get(name, default) == default:
                data.get(section, {}).pop(name, None)
        if data.get("evaluation") == {}:
            data.pop("evaluation")
        if not self.names_user_code:  # a run of built-in parts records what it always did
            data.pop("code_dir", None)
        return data

    @property
    def names_user_code(self) -> bool:
        """Whether the model, the dataset or the method is the user's own
        (``package.module:name``), imported from :attr:`code_dir`."""
        return self.model.is_user or is_import_path(self.dataset.name) or ":" in self.algorithm.name

    @property
    def node_ids(self) -> list[str]:
        return [n.id for n in self.nodes]

    @property
    def node_hosts(self) -> dict[str, str | None]:
        return {n.id: n.host for n in self.nodes}

    def nodes_on(self, host: str) -> list[str]:
        """The ids of the nodes pinned to ``host`` (``nodes: [{id, host}]``)."""
        return [n.id for n in self.nodes if n.host == host]


class NodeOverrides(PathNotes):
    """A per-device file in ``nodes/``: what one device changes for its own daemon
    (``data_root`` and ``certs`` relative to the file's folder once loaded)."""

    id: str | None = None
    data_root: str | None = None
    device: str | None = None
    broker: str | None = None
    threads: int | None = Field(None, ge=1, le=B.MAX_THREADS)
    host: str | None = Field(None, description="run the topology's nodes pinned to this host")
    certs: str | None = Field(None, description="this device's certificate directory")


def dump_topology(cfg: TopologyConfig) -> str:
    """The resolved config as YAML, its broker written as ``host:port`` (what a run
    directory records as ``config.yaml``)."""
    data = cfg.dump()
    data["broker"] = str(cfg.broker)
    return yaml.safe_dump(data, sort_keys=False)
