"""A site's policy over the runs proposed to it, and the decision it gives (a pure rule).

The policy belongs to the site and never comes from peers (``policy:`` of the site file, or
a ``policy.yaml`` it names). It is checked when the site votes, when the run commits and
every round; :func:`decide` is the rule, applied to what the run says of itself
(:class:`RunFacts`) at one ``stage``:

- ``proposers``: who may propose here (``any``, or site names);
- ``methods.allow``: the methods the site runs (``any``, or method names);
- ``code.plugins``: ``deny`` refuses a run that loads code from outside the package
  (a user model module, a method plugin) before anything is imported; under ``allow`` the
  outside code is checked in a short-lived child process (what it declares, or
  ``plugin_failed``), never in the daemon;
- ``data``: which data bindings a run may name, each for which methods (absent: every
  binding of the site, for any method); a binding whose files cannot serve a run (its
  problems found by the caller, :mod:`p2pfl.sites.policy.binding_check`) refuses it;
- ``share``: what may leave the site, of ``whole_weights``, ``shared_part`` and
  ``representations``; checked against what the method declares it sends
  (its card's ``shares``, :mod:`p2pfl.algorithms.cards`), never against its name. Whole
  weights include the shared part;
- ``privacy``: ``require_dp`` and ``max_epsilon`` are applied by the site itself (the
  decision carries the ε its node trains under, whatever the run asks), ``require_secagg``
  (a swarm-wide protocol, which one site cannot apply alone) and ``min_members``;
- ``peers.deny``: sites this one never trains with;
- ``resources``: ``max_rounds``, and ``max_hours`` of training (checked every round);
- ``approve``: ``auto``, or ``manual`` (a run that passes every rule is ``pending`` until
  the operator decides).

Every refusal is a :class:`Reason` with a code (a bounded set: :data:`REASON_CODES`, the
label of ``p2pfl_policy_rejections_total``) and words an operator can act on. The decision
names the digest of the policy it checked (:func:`policy_digest`), so a vote says which
policy it was given under.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from p2pfl.config.schema import SHARE_KINDS, ShareKind
from p2pfl.config.strict import StrictModel

REASON_CODES = (
    "proposer_not_allowed",
    "method_not_allowed",
    "plugins_denied",
    "plugin_failed",
    "unknown_binding",
    "binding_invalid",
    "data_not_allowed",
    "share_not_allowed",
    "secagg_required",
    "too_few_members",
    "denied_peer",
    "too_many_rounds",
    "over_time",
    "manual_approval",
    "operator_rejected",
    "draining",
)
"""Every reason a decision gives (bounded: a metric's label takes them)."""

Stage = Literal["vote", "commit", "round"]
Vote = Literal["accept", "reject", "pending"]


class MethodsRule(StrictModel):
    allow: Literal["any"] | list[str] = Field(
        default="any", description="the methods this site runs: any, or a list of names"
    )


class CodeRule(StrictModel):
    plugins: Literal["allow", "deny"] = Field(
        default="allow",
        description="deny: refuse runs that load code from outside the package (a user "
        "model module, a method plugin)",
    )


class DataRule(StrictModel):
    methods: Literal["any"] | list[str] = Field(
        default="any", description="the methods this binding may be trained with"
    )


class PrivacyRule(StrictModel):
    require_dp: bool = Field(
        default=False,
        description="train with DP here, whatever the run asks, at most max_epsilon",
    )
    max_epsilon: PositiveFloat | None = Field(
        default=None,
        description="the ε this site's node may spend at most (a run asking none, or more, "
        "trains under it here)",
    )
    require_secagg: bool = Field(
        default=False, description="only runs under secure aggregation (privacy.secagg)"
    )
    min_members: PositiveInt = Field(
        default=1, description="only runs of at least this many sites (this one included)"
    )

    @model_validator(mode="after")
    def _dp_bound(self) -> PrivacyRule:
        if self.require_dp and self.max_epsilon is None:
            raise ValueError("require_dp needs max_epsilon: the ε this site trains under")
        return self


class PeersRule(StrictModel):
    deny: list[str] = Field(default_factory=list, description="sites this one never trains with")


class ResourcesRule(StrictModel):
    max_rounds: PositiveInt | None = Field(
        default=None, description="the most rounds a run may ask"
    )
    max_hours: PositiveFloat | None = Field(
        default=None, description="the most hours this site trains a run (checked every round)"
    )


class Policy(StrictModel):
    """A site's policy (the ``policy:`` section of its site file, or its ``policy.yaml``).
    Its defaults admit every run: a site states what it refuses."""

    proposers: Literal["any"] | list[str] = Field(
        default="any", description="who may propose runs here: any, or site names"
    )
    methods: MethodsRule = Field(default_factory=MethodsRule)
    code: CodeRule = Field(default_factory=CodeRule)
    data: dict[str, DataRule] | None = Field(
        default=None,
        description="the data bindings a run may name, each for which methods "
        "(absent: every binding, for any method)",
    )
    share: list[ShareKind] = Field(
        default_factory=lambda: list(SHARE_KINDS), description="what may leave this site"
    )
    privacy: PrivacyRule = Field(default_factory=PrivacyRule)
    peers: PeersRule = Field(default_factory=PeersRule)
    resources: ResourcesRule = Field(default_factory=ResourcesRule)
    approve: Literal["auto", "manual"] = Field(
        default="auto", description="manual: a run that passes every rule waits for the operator"
    )


def policy_digest(policy: Policy) -> str:
    """The digest of ``policy`` (32 hex digits of SHA-256 over its canonical JSON, defaults
    filled in): equal policies, however written, have equal digests."""
    text = json.dumps(policy.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RunFacts:
    """What a run says of itself that a policy reads. ``members``: the sites named (at
    ``commit`` and after: the committed ones); None when the run is open to ``any``.
    ``min_accept``: the fewest accepting sites it commits with. ``dp_epsilon``: the ε the
    run asks of each node (None: no DP). ``shares``: what its method sends off a node
    (``Method.shares``). ``plugins``: whether it loads code from outside the package."""

    proposer: str
    method: str
    shares: frozenset[str] | None
    data: str
    rounds: int
    min_accept: int
    members: tuple[str, ...] | None = None
    plugins: bool = False
    plugin_problem: str | None = None
    dp_epsilon: float | None = None
    secagg: bool = False


@dataclass(frozen=True)
class Reason:
    """Why a rule did not pass: ``code`` (of :data:`REASON_CODES`) and words."""

    code: str
    detail: str


@dataclass(frozen=True)
class Decision:
    """A site's decision on a run: its ``vote``, the ``reasons`` (empty when it accepts),
    the ε its node trains under (``dp_epsilon``; None: no DP; the site's own bound when its
    policy requires DP) and the digest of the policy checked (``policy``)."""

    vote: Vote
    reasons: tuple[Reason, ...]
    policy: str
    dp_epsilon: float | None = None

    def as_record(self) -> dict[str, object]:
        """The decision as a vote message and the ledger carry it."""
        return {
            "vote": self.vote,
            "reasons": [{"code": r.code, "detail": r.detail} for r in self.reasons],
            "policy": self.policy,
            "dp_epsilon": self.dp_epsilon,
        }


def _allowed(rule: Literal["any"] | list[str], name: str) -> bool:
    return rule == "any" or name in rule


def site_epsilon(policy: Policy, asked: float | None) -> float | None:
    """The ε a site's node trains under: the run's (None: no DP), unless the policy bounds
    it (``max_epsilon``, which ``require_dp`` needs): then the smaller of the two, and the
    bound when the run asks for no DP. The site's daemon applies it, whatever the run asks."""
    bound = policy.privacy.max_epsilon
    if bound is None:
        return asked
    return bound if asked is None else min(asked, bound)


def decide(
    run: RunFacts,
    policy: Policy,
    *,
    bindings: frozenset[str] | set[str],
    stage: Stage = "vote",
    hours_trained: float = 0.0,
    binding_problems: Mapping[str, str] | None = None,
) -> Decision:
    """A site's decision on ``run`` under its ``policy`` at ``stage`` (``vote``, ``commit``,
    ``round``; ``hours_trained``: the hours its node has trained the run so far).
    ``bindings``: the names of the site's data bindings; ``binding_problems``: binding →
    why it cannot serve a run (:mod:`p2pfl.sites.policy.binding_check`, found by the caller), which
    refuses a run on that binding at the vote and the commit (a running worker holds its
    data already). ``reject`` when any rule fails
    (every failing rule is a reason); else ``pending`` under ``approve: manual`` at the vote;
    else ``accept``."""
    reasons: list[Reason] = []

    def refuse(code: str, detail: str) -> None:
        reasons.append(Reason(code, detail))

    if not _allowed(policy.proposers, run.proposer):
        refuse("proposer_not_allowed", f"{run.proposer!r} may not propose runs here")
    if not _allowed(policy.methods.allow, run.method):
        refuse("method_not_allowed", f"method {run.method!r} is not in methods.allow")
    if run.plugins and policy.code.plugins == "deny":
        refuse("plugins_denied", "the run loads code from outside p2pfl (code.plugins: deny)")
    elif run.plugin_problem is not None:
        refuse("plugin_failed", run.plugin_problem)
    elif run.shares is None:
        refuse("plugin_failed", f"what method {run.method!r} sends off the site is not known")
    if run.data not in bindings:
        refuse("unknown_binding", f"this site has no data binding {run.data!r}")
    elif policy.data is not None:
        rule = policy.data.get(run.data)
        if rule is None:
            refuse("data_not_allowed", f"data binding {run.data!r} is not offered to runs")
        elif not _allowed(rule.methods, run.method):
            refuse(
                "data_not_allowed", f"data binding {run.data!r} is not offered to {run.method!r}"
            )
    problems = binding_problems or {}
    if stage != "round" and run.data in bindings and run.data in problems:
        refuse(
            "binding_invalid", f"data binding {run.data!r} cannot serve a run: {problems[run.data]}"
        )
    allowed = set(policy.share)
    if "whole_weights" in allowed:
        allowed.add("shared_part")
    leaving = sorted((run.shares or frozenset()) - allowed)
    if leaving:
        refuse(
            "share_not_allowed",
            f"method {run.method!r} sends {', '.join(leaving)} off the site; share allows "
            f"{', '.join(policy.share) or 'nothing'}",
        )
    privacy = policy.privacy
    if privacy.require_secagg and not run.secagg:
        refuse("secagg_required", "this site trains only under secure aggregation")
    least = len(run.members) if run.members is not None else run.min_accept
    if least < privacy.min_members:
        refuse(
            "too_few_members",
            f"the run may train with {least} site(s); this site needs {privacy.min_members}",
        )
    denied = sorted(set(run.members or ()) & set(policy.peers.deny))
    if denied:
        refuse("denied_peer", f"this site never trains with {', '.join(denied)}")
    limit = policy.resources
    if limit.max_rounds is not None and run.rounds > limit.max_rounds:
        refuse("too_many_rounds", f"{run.rounds} rounds asked; at most {limit.max_rounds} here")
    if stage == "round" and limit.max_hours is not None and hours_trained > limit.max_hours:
        refuse("over_time", f"{hours_trained:.2f} h trained; at most {limit.max_hours:g} h here")
    vote: Vote = "reject" if reasons else "accept"
    if vote == "accept" and stage == "vote" and policy.approve == "manual":
        vote = "pending"
        reasons.append(Reason("manual_approval", "the operator decides (p2pfl vote)"))
    return Decision(
        vote, tuple(reasons), policy_digest(policy), site_epsilon(policy, run.dp_epsilon)
    )
