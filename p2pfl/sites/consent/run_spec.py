"""A run as a site daemon is asked to train it (``p2pfl submit run.yaml``): a topology
without what belongs to a device (the broker, the data's paths, certificates, emulation,
attacks, the node list), plus ``data`` (the name of the data binding each site trains on),
``members`` (the sites named, or ``any``), ``quorum.min_accept`` and ``vote_deadline_s``
(docs/design.md, "Site policy").

The ``run_id`` is a hash of the canonical spec (:func:`run_id`), so every site names the
same run alike; :func:`run_facts` is what a site's policy reads of it
(:class:`~p2pfl.sites.policy.rules.RunFacts`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from p2pfl.algorithms.cards import builtin_card, check_params, is_outside_code
from p2pfl.algorithms.cards.probe import OutsideCode
from p2pfl.check.load import load_yaml, validated
from p2pfl.config import bounds as B
from p2pfl.config.privacy_schema import PrivacyConfig
from p2pfl.config.runtime_schema import TimingConfig, TransferConfig
from p2pfl.config.schema import (
    ID_PATTERN,
    PARAMS_CHECK,
    AlgorithmConfig,
    DefenceConfig,
    GeneratedEdges,
    GeneratedEdgesField,
    ModelConfig,
    TrainingConfig,
)
from p2pfl.config.strict import StrictModel
from p2pfl.sites.policy.rules import RunFacts


class Quorum(StrictModel):
    min_accept: PositiveInt = Field(
        default=2, le=B.MAX_NODES, description="the fewest accepting sites the run commits with"
    )


class OnNewData(StrictModel):
    min_new: PositiveInt = Field(
        description="the new rows a member reports since its last cycle for it to count"
    )


class Series(StrictModel):
    """A run that trains again: cycle k+1 once ``every_s`` has passed since cycle k's vote
    deadline, or once ``quorum.min_accept`` members report ``on_new_data.min_new`` new rows
    (docs/design.md, "Series"). Each cycle is a run of its own (:func:`cycle_spec`)."""

    every_s: float | None = Field(
        None, ge=10.0, le=366 * 86400.0, description="the schedule: seconds between cycles"
    )
    on_new_data: OnNewData | None = Field(
        None, description="start a cycle when enough members' watched data grew"
    )
    rounds: int | None = Field(
        None,
        ge=1,
        le=B.MAX_ROUNDS,
        description="the rounds of each cycle after the first (default: the spec's rounds)",
    )
    warm_start: Literal["last_promoted", "fresh"] = Field(
        "last_promoted",
        description="a cycle after the first starts from each member's last promoted model "
        "of the series (its personal part too), or from the common initial model",
    )
    cycle: PositiveInt = Field(
        1, le=1_000_000, description="which cycle this spec is (1: the series as submitted)"
    )

    @model_validator(mode="after")
    def _trigger(self) -> Series:
        if self.every_s is None and self.on_new_data is None:
            raise ValueError("a series needs every_s, on_new_data, or both")
        return self


RUN_ID_PATTERN = r"^[0-9a-f]{16}$"


class Retry(StrictModel):
    """What a retried run's spec says of the run it retries (``p2pfl submit --retry``): the
    same spec as a new attempt, so its run id is new and its ledger entry names the one it
    retries."""

    of: str = Field(pattern=RUN_ID_PATTERN, description="the run this one retries")
    attempt: int = Field(ge=2, le=1000, description="this attempt's number (the first run: 1)")


class RunSpec(StrictModel):
    """What a proposer asks of the sites; every field but ``data``, ``members``, ``quorum``
    and ``vote_deadline_s`` means what it means in a topology."""

    name: str = Field(pattern=ID_PATTERN)
    seed: int = Field(0, ge=0, le=B.MAX_SEED)
    rounds: int = Field(5, ge=1, le=B.MAX_ROUNDS)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    timing: TimingConfig = Field(default_factory=TimingConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    defence: DefenceConfig = Field(default_factory=DefenceConfig)
    privacy: PrivacyConfig | None = None
    edges: GeneratedEdgesField = Field(
        default_factory=lambda: GeneratedEdges(kind="full"),
        description="the neighbours among the committed sites, as a topology's generated "
        "edges (full, ring, {kind: random-k, k: 3}, ...): the members are known only at the "
        "commit, so no list of edges",
    )
    data: str = Field(pattern=ID_PATTERN, description="the data binding each site trains on")
    members: Literal["any"] | list[str] = Field(
        default="any", description="the sites asked (any: every site that accepts)"
    )
    quorum: Quorum = Field(default_factory=Quorum)
    vote_deadline_s: float = Field(
        60.0, ge=1.0, le=7 * 86400.0, description="how long the sites have to vote"
    )
    series: Series | None = Field(None, description="train again as data grows, or on a schedule")
    retry: Retry | None = Field(None, description="the run this spec retries (submit --retry)")

    @model_validator(mode="after")
    def _no_device_fields(self) -> RunSpec:
        if self.model.init is not None:
            raise ValueError("model.init: a device's own file, never a spec's")
        return self

    @model_validator(mode="after")
    def _members(self) -> RunSpec:
        if isinstance(self.members, list):
            bad = [m for m in self.members if not re.match(ID_PATTERN, m)]
            if bad:
                raise ValueError(f"members: {bad[0]!r} is not a site name")
            if len(set(self.members)) != len(self.members):
                raise ValueError("members: a site is named twice")
            if self.quorum.min_accept > len(self.members):
                raise ValueError(
                    f"quorum.min_accept: {self.quorum.min_accept} of {len(self.members)} members"
                )
        return self

    @model_validator(mode="after")
    def _edges(self) -> RunSpec:
        # as a topology checks them, over the members when the spec names them
        self.edges.check(None if self.members == "any" else self.members)
        return self


def canonical(spec: RunSpec) -> str:
    """The spec as canonical JSON (defaults filled in, keys sorted, no spaces). Fields
    added since specs were first hashed (``series``, ``retry``, ``model.init``) are left
    out while unset, so a spec keeps its ``run_id`` across versions."""
    data = spec.model_dump(mode="json")
    for added in ("series", "retry"):
        if data.get(added) is None:
            data.pop(added, None)
    if data["model"].get("init") is None:
        data["model"].pop("init", None)
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def run_id(spec: RunSpec) -> str:
    """The run's id: 16 hex digits of SHA-256 over :func:`canonical`; equal specs, however
    written, have one id."""
    return hashlib.sha256(canonical(spec).encode()).hexdigest()[:16]


def cycle_spec(spec: RunSpec, cycle: int) -> RunSpec:
    """Cycle ``cycle`` of the series ``spec``: the same spec, its ``series.cycle`` set; its
    :func:`run_id` is the cycle's (derived from the series and the cycle alone)."""
    assert spec.series is not None
    return spec.model_copy(update={"series": spec.series.model_copy(update={"cycle": cycle})})


def retry_spec(spec: RunSpec, of: str) -> RunSpec:
    """``spec`` (the spec of run ``of``) proposed again as its next attempt: the same spec,
    ``retry`` naming ``of`` and the attempt after ``spec``'s own."""
    attempt = spec.retry.attempt + 1 if spec.retry is not None else 2
    return spec.model_copy(update={"retry": Retry(of=of, attempt=attempt)})


def series_id(spec: RunSpec) -> str | None:
    """The series' id: the :func:`run_id` of its first cycle (None: not a series)."""
    return None if spec.series is None else run_id(cycle_spec(spec, 1))


def cycle_rounds(spec: RunSpec) -> int:
    """The rounds this spec's run trains: ``series.rounds`` for a cycle after the first."""
    if spec.series is not None and spec.series.cycle > 1 and spec.series.rounds is not None:
        return spec.series.rounds
    return spec.rounds


def spec_from_dict(data: dict, source: str = "<run spec>") -> RunSpec:
    """Validate a run spec mapping, the method's knobs included (by its card: nothing is
    imported, :func:`~p2pfl.algorithms.cards.check_params`); a
    :class:`~p2pfl.errors.ConfigError` naming ``source`` and the field otherwise."""
    return validated(RunSpec, data, source, context={PARAMS_CHECK: check_params})


def load_run_spec(path: str | Path) -> RunSpec:
    """The run spec at ``path``, validated (:func:`spec_from_dict`)."""
    return spec_from_dict(load_yaml(path), str(path))


def outside_code(spec: RunSpec) -> list[str]:
    """What of ``spec`` is code from outside p2pfl, each as ``field: name``: a
    ``package.module:name`` model or method, or a method an installed plugin declares
    (:func:`~p2pfl.algorithms.cards.is_outside_code`). Nothing is imported."""
    named = [("algorithm.name", spec.algorithm.name), ("model.name", spec.model.name)]
    return [f"{field}: {name}" for field, name in named if is_outside_code(name)]


def run_facts(
    spec: RunSpec,
    proposer: str,
    members: list[str] | None = None,
    outside: OutsideCode | None = None,
) -> RunFacts:
    """What a site's policy reads of ``spec`` proposed by ``proposer``; ``members``: the
    committed sites (None: the spec's). What the method shares comes from its card; an
    outside method's from ``outside``, what a child process learned of it (None: not
    checked, so unknown). A run under DP by a noise multiplier asks no ε in advance: it
    reads as unbounded, so a site's ``max_epsilon`` applies."""
    named = members if members is not None else spec.members
    dp = spec.privacy.dp if spec.privacy is not None else None
    epsilon = None if dp is None else (dp.target_epsilon or math.inf)
    card = builtin_card(spec.algorithm.name)
    return RunFacts(
        proposer=proposer,
        method=spec.algorithm.name,
        shares=card.shares if card is not None else (outside and outside.shares),
        data=spec.data,
        rounds=cycle_rounds(spec),
        min_accept=spec.quorum.min_accept,
        members=None if named == "any" else tuple(named),
        plugins=bool(outside_code(spec)),
        plugin_problem=outside.problem if outside is not None else None,
        dp_epsilon=epsilon,
        secagg=spec.privacy is not None and spec.privacy.secagg,
    )
