"""A site's verdict on a run, in one place: what the run says of itself (the spec and its
method's card), what a child process learned of its outside code, and the site's policy.

The daemon (at the vote, the commit and every round) and ``p2pfl policy check`` both
judge through :func:`judge`; neither imports a method, a model or torch
(docs/design.md, "Site policy"). The path of a decision: the spec validated by its card
(:func:`~p2pfl.sites.consent.run_spec.spec_from_dict`), outside code checked in a child where the
policy allows it (:func:`check_outside_code`), then the pure rule
(:func:`~p2pfl.sites.policy.rules.decide`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path

from p2pfl.algorithms.cards.probe import OutsideCode, probe_outside_code
from p2pfl.sites.consent.run_spec import RunSpec, outside_code, run_facts
from p2pfl.sites.policy.rules import Decision, Policy, Stage, decide


async def check_outside_code(spec: RunSpec, policy: Policy, cwd: Path | None) -> OutsideCode | None:
    """What a child process learns of ``spec``'s outside code (a ``package.module:name``
    method or model, a plugin's method); None when the spec names none, or when
    ``policy`` denies plugins (the run is refused without anything imported)."""
    if not outside_code(spec) or policy.code.plugins == "deny":
        return None
    return await probe_outside_code(
        spec.algorithm.name, spec.algorithm.params, spec.model.name, cwd=cwd
    )


class OutsideCodeChecks:
    """:func:`check_outside_code` remembered by what a spec names (its method, knobs and
    model): a series' cycles, or a spec heard again after a restart, are checked once. At
    most ``keep`` answers are kept, the oldest forgotten first."""

    def __init__(self, policy: Policy, cwd: Path | None, keep: int = 256):
        self.policy = policy
        self.cwd = cwd
        self.keep = keep
        self._known: dict[str, OutsideCode] = {}

    async def check(self, spec: RunSpec) -> OutsideCode | None:
        key = json.dumps(
            [spec.algorithm.name, spec.algorithm.params, spec.model.name], sort_keys=True
        )
        if key not in self._known:
            outside = await check_outside_code(spec, self.policy, self.cwd)
            if outside is None:
                return None
            if len(self._known) >= self.keep:
                self._known.pop(next(iter(self._known)))
            self._known[key] = outside
        return self._known[key]


def judge(
    spec: RunSpec,
    proposer: str,
    policy: Policy,
    bindings: Collection[str],
    *,
    stage: Stage = "vote",
    members: Collection[str] | None = None,
    outside: OutsideCode | None = None,
    hours_trained: float = 0.0,
    binding_problems: Mapping[str, str] | None = None,
) -> Decision:
    """The site's decision on ``spec`` proposed by ``proposer`` under ``policy`` at
    ``stage``: ``bindings`` are the site's data bindings, ``members`` the committed sites
    (None: the spec's), ``outside`` what :func:`check_outside_code` learned,
    ``binding_problems`` why a binding of the site cannot serve a run (binding → words)."""
    facts = run_facts(spec, proposer, list(members) if members is not None else None, outside)
    return decide(
        facts,
        policy,
        bindings=set(bindings),
        stage=stage,
        hours_trained=hours_trained,
        binding_problems=binding_problems,
    )
