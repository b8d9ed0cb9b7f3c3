"""A site's own file (``p2pfl daemon --site site.yaml``): who the site is, where its broker
and certificates are, its data bindings and its policy (docs/design.md, "Site policy"). It
belongs to the site and never comes from peers; a run names a binding, never a path.

Relative paths (``certs``, ``state_dir``, each binding's ``root`` and ``stats``, and
``policy`` when it names a file) resolve against the site file's folder, as a topology's do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from p2pfl.check.load import load_yaml, validated
from p2pfl.config.bounds import MAX_NODES
from p2pfl.config.dataset_schema import FILE_DATASETS, DatasetConfig, is_import_path
from p2pfl.config.paths import PathBase, resolve_fields
from p2pfl.config.schema import ID_PATTERN
from p2pfl.config.strict import PathNotes, StrictModel
from p2pfl.cpu_set import check_usable, parse_cpus
from p2pfl.sites.policy.rules import Policy

SITE_PATHS = ("certs", "state_dir", "policy")
"""The fields of a site file that hold paths (``policy`` when it is a file's name)."""

BINDING_PATHS = ("root", "stats")
"""The fields of a data binding that hold paths."""


OWN_DATA = (*FILE_DATASETS, "imagefolder")
"""The kinds of data a site's binding reads whole by default (``partition: none``), as a
user function (``package.module:function``) does: the site's own files, never a shard."""


class SiteBinding(DatasetConfig):
    """A named data binding: the reader fields of a topology's ``dataset:``, and ``watch``.
    A binding of the site's own files (:data:`OWN_DATA`) or of a user function reads them
    whole unless it says otherwise: its ``partition`` defaults to ``none`` (a built-in
    dataset's keeps the topology's default, a shard of it per committed member)."""

    watch: bool = Field(
        default=False,
        description="announce a signed data_version (content hash, rows) when the file or "
        "folder changes, for series that start a cycle on new data; its held-out rows are "
        "drawn by row hash, so they stay held out as it grows",
    )

    @model_validator(mode="before")
    @classmethod
    def _own_data_reads_whole(cls, data: Any) -> Any:
        # a site's own file is its data, not a swarm's to split: a CSV binding written
        # without partition must not be cut into a Dirichlet shard by the worker
        if isinstance(data, dict) and "partition" not in data:
            name = data.get("name")
            if isinstance(name, str) and (name in OWN_DATA or is_import_path(name)):
                return {**data, "partition": "none"}
        return data


CpuList = Annotated[list[int], BeforeValidator(lambda v: check_usable(parse_cpus(v)))]
"""A CPU set (:mod:`p2pfl.cpu_set`): ``"0-3,6"`` or ``[0, 1, 2, 3, 6]``, every CPU one this
machine lets the process that loads the site file use."""

WORKER_NICE = 0
"""``limits.worker_nice``'s default: workers at the daemon's priority. A site that serves
and trains on one machine may set it higher, so answers come before training steps (on
the 2-core machine here it moved no serving figure: results/serving/README.md)."""


class Limits(StrictModel):
    max_concurrent_runs: PositiveInt = Field(
        default=1, description="the runs this site trains at once; more wait as pending"
    )
    keep_runs: PositiveInt = Field(
        default=50,
        le=100_000,
        description="the finished runs whose files (state_dir/runs/<id>: worker log, records) "
        "stay; older ones are removed, their ledger entries and kept models stay",
    )
    warm_worker: bool | Literal["auto"] = Field(
        default="auto",
        description="a process that has imported torch forks each run's worker: auto (from "
        "this site's first vote for a run until 10 minutes without one), true (from the "
        "start, kept), false (each worker imports torch itself)",
    )
    worker_nice: int = Field(
        default=WORKER_NICE,
        ge=0,
        le=19,
        description="steps below the daemon's priority a run's worker trains at (higher: "
        "the daemon and the served model take the CPU first)",
    )
    worker_cpus: CpuList | None = Field(
        default=None,
        description="the CPUs a run's worker trains on, e.g. '1-3' (absent: any); apart "
        "from serving.cpus, training leaves the served model its cores",
    )


class Promote(StrictModel):
    offer: bool = Field(
        default=True,
        description="keep each run this site finishes as a model and judge it at the gate",
    )
    min_delta: float = Field(
        default=0.0,
        ge=0.0,
        le=1e9,
        description="a new model is served only if its held-out metric is no worse than the "
        "served one's by more than this (docs/design.md, \"A site's own models\")",
    )
    metric: Literal["accuracy", "balanced_accuracy", "auc", "f1", "mae", "rmse", "c_index"] = Field(
        default="accuracy",
        description="what the gate scores a model by on the site's held-out data (mae and "
        "rmse: lower is better); a metric of the run's task (classes or values)",
    )


def _listen(value: str | None) -> str | None:
    """``host:port`` (or None), checked as :func:`~p2pfl.sites.daemon.observe.parse_listen` reads it."""
    if value is None:
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"listen must be 'host:port', got {value!r}")
    return value


class Admission(StrictModel):
    """Who must approve a new device's enrolment before the CA holder issues its
    certificate (``p2pfl enroll approve``; docs/design.md, "Enrolment")."""

    approvals: NonNegativeInt = Field(
        default=0,
        description="how many distinct sites of approvers must approve a request (0: the "
        "CA holder alone decides)",
    )
    approvers: list[str] = Field(
        default_factory=list,
        max_length=MAX_NODES,
        description="the sites whose signed approvals count",
    )

    @field_validator("approvers")
    @classmethod
    def _approver_names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not re.fullmatch(ID_PATTERN, name)]
        if bad:
            raise ValueError(
                f"approvers are site names (letters, digits, '_', '.', '-'): {bad[0]!r}"
            )
        if len(set(value)) != len(value):
            raise ValueError("approvers lists a site twice")
        return value

    @model_validator(mode="after")
    def _reachable(self) -> Admission:
        if self.approvals > len(self.approvers):
            raise ValueError(
                f"approvals {self.approvals} is more than the {len(self.approvers)} approvers listed"
            )
        return self


class Observability(StrictModel):
    listen: str | None = Field(
        default=None,
        description="host:port of /livez, /readyz and /metrics (absent: not served)",
    )
    log_format: Literal["text", "json"] = "text"

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return _listen(value)


class Serving(StrictModel):
    listen: str | None = Field(
        default=None,
        description="host:port of the site's served model: the Open Inference Protocol "
        "(/v2/...) and POST /v1/predict, GET /v1/model (absent: not served)",
    )
    max_request_bytes: PositiveInt = Field(
        default=16 << 20, description="the largest predict request body taken (more: 413)"
    )
    missing: Literal["refuse", "impute"] = Field(
        default="refuse",
        description="a missing value in a request (null, an empty CSV cell): refuse (400 "
        "naming its column and row) or impute (the column's training mean)",
    )
    runtime: Literal["onnx", "torch"] = Field(
        default="onnx",
        description="what computes an answer: the model exported to ONNX, run by "
        "onnxruntime (a model it cannot export: torch), or the torch module",
    )
    workers: Literal["auto"] | Annotated[int, Field(ge=1, le=256)] = Field(
        default="auto",
        description="processes answering requests on the one port (auto: one a usable "
        "core, of serving.cpus when set)",
    )
    cpus: CpuList | None = Field(
        default=None,
        description="the CPUs the serving processes run on, e.g. '0' (absent: any); apart "
        "from limits.worker_cpus, a training run does not take the answers' cores",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return _listen(value)


LOOPBACK_BROKER = "127.0.0.1:1883"


class HostedBroker(StrictModel):
    """The federation's broker, hosted by this site's daemon (``broker: embedded``, or
    ``broker: {embedded: {listen: HOST:PORT}}``): Mosquitto with TLS, client certificates
    and the swarm's ACL when ``certs`` is set, else the embedded pure-Python broker. Other
    hosts reach it only where ``listen`` is not a loopback address."""

    listen: str = Field(
        default=LOOPBACK_BROKER,
        description="host:port the hosted broker listens on (0.0.0.0:1883: every interface)",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        checked = _listen(value)
        assert checked is not None
        return checked

    @property
    def connect(self) -> str:
        """``host:port`` this daemon itself connects to: the listen address, or loopback
        where it listens on every interface."""
        host, _, port = self.listen.rpartition(":")
        return f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "[::]") else self.listen


def _hosted_broker(value: Any) -> HostedBroker:
    """``broker.embedded`` as a :class:`HostedBroker`; a ``ValueError`` naming its field."""
    try:
        return HostedBroker.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("embedded", *first["loc"]))
        raise ValueError(f"{where}: {first['msg']}") from None


class SiteFile(PathNotes):
    """A site file, its relative paths resolved (:func:`load_site`)."""

    site: str = Field(
        pattern=ID_PATTERN,
        description="this site's node id in every run (its certificate's name under TLS)",
    )
    swarm: str = Field(pattern=ID_PATTERN, description="the federation this site belongs to")
    broker: str | HostedBroker = Field(
        default=LOOPBACK_BROKER,
        description="host:port, mdns (discover it), or embedded (host it: "
        "{embedded: {listen: HOST:PORT}}, loopback by default)",
    )
    certs: str | None = Field(default=None, description="the swarm's certificate folder")
    state_dir: str = Field(description="where the daemon keeps its ledger, runs and socket")
    data: dict[str, SiteBinding] = Field(
        default_factory=dict, description="named data bindings (the reader fields of dataset:)"
    )
    policy: Policy = Field(default_factory=Policy)
    limits: Limits = Field(default_factory=Limits)
    promote: Promote = Field(default_factory=Promote)
    admission: Admission = Field(default_factory=Admission)
    observability: Observability = Field(default_factory=Observability)
    serving: Serving = Field(default_factory=Serving)
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The site file this was loaded from (absolute; None when built in memory): the
        daemon's helper processes (``p2pfl serve``, ``p2pfl models offer``) read it."""
        return self._source

    @field_validator("broker", mode="before")
    @classmethod
    def _broker(cls, value: Any) -> Any:
        if value == "embedded":
            return HostedBroker()
        if isinstance(value, dict):
            if set(value) != {"embedded"}:
                raise ValueError(
                    f"broker as a mapping is {{embedded: {{listen: HOST:PORT}}}}, got keys "
                    f"{sorted(map(str, value))}"
                )
            return _hosted_broker(value["embedded"] or {})
        if value == "mdns" or isinstance(value, HostedBroker):
            return value
        if not isinstance(value, str):
            raise ValueError(f"broker must be 'host:port', 'mdns' or 'embedded', got {value!r}")
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"broker must be 'host:port', 'mdns' or 'embedded', got {value!r}")
        return value

    @property
    def hosted_broker(self) -> HostedBroker | None:
        """The broker this site's daemon hosts (``broker: embedded``), None otherwise."""
        return self.broker if isinstance(self.broker, HostedBroker) else None

    @property
    def broker_address(self) -> str:
        """Where this site connects: the site file's ``host:port`` (or ``mdns``), or its
        hosted broker's address (:attr:`HostedBroker.connect`)."""
        hosted = self.hosted_broker
        return hosted.connect if hosted is not None else str(self.broker)

    @field_validator("data")
    @classmethod
    def _binding_names(cls, value: dict[str, SiteBinding]) -> dict[str, SiteBinding]:
        bad = [name for name in value if not re.match(ID_PATTERN, name)]
        if bad:
            raise ValueError(f"binding names are letters, digits, '_', '.', '-': {bad[0]!r}")
        return value


def load_site(path: str | Path) -> SiteFile:
    """The site file at ``path``, validated, its relative paths resolved against its
    folder and its ``policy`` read when it names a file; a :class:`~p2pfl.errors.ConfigError` naming the
    file (the policy's, for an error in it) and the field otherwise."""
    data = load_yaml(path)
    base = PathBase.of_file(path)
    policy = data.get("policy")
    paths = [f for f in SITE_PATHS if f != "policy" or isinstance(policy, str)]
    notes = resolve_fields(data, paths, base)
    bindings = data.get("data")
    for name, binding in bindings.items() if isinstance(bindings, dict) else ():
        if isinstance(binding, dict):
            for field, note in resolve_fields(binding, BINDING_PATHS, base).items():
                notes[f"data.{name}.{field}"] = note
    if isinstance(policy, str):
        data["policy"] = _policy_file(data["policy"])
    site = validated(SiteFile, data, path)
    site.note_paths(notes)
    site._source = Path(path).resolve()
    return site


def _policy_file(path: str) -> dict[str, Any]:
    """The policy file at ``path`` (absolute), checked on its own so its errors name it."""
    data = load_yaml(path)
    validated(Policy, data, path)
    return data
