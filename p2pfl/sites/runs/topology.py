"""The topology a site's worker runs a committed run under (docs/design.md, "Site policy"):
the run spec's fields, plus what belongs to this site and never came from peers.

- ``name``: the spec's name and the ``run_id`` (the run's topics, ``p2pfl/<name>/…``, are
  its own: two runs on one broker never hear each other);
- ``nodes``: the committed members, sorted, so every site numbers them alike (a built-in
  dataset's shards follow the node order);
- ``dataset``: this site's data binding the spec names;
- ``broker``, and ``security`` from the site's ``certs`` (TLS and signatures);
- ``privacy``: the spec's, with the ε the site's policy bounds applied
  (:func:`~p2pfl.sites.policy.rules.site_epsilon`): DP the site requires is applied here, whatever
  the spec asks.
"""

from __future__ import annotations

from typing import Any

from p2pfl.config.dataset_schema import DatasetConfig
from p2pfl.sites.consent.run_spec import RunSpec, cycle_rounds

RUN_ONLY = ("data", "members", "quorum", "vote_deadline_s", "series", "retry")
"""A spec's fields that say how sites agree on a run, not how it trains."""


def run_swarm_name(spec: RunSpec, run_id: str) -> str:
    """The run's swarm name: at most 64 characters, ending in the ``run_id``."""
    return f"{spec.name[: 64 - len(run_id) - 1]}-{run_id}"


def site_privacy(spec: RunSpec, epsilon: float | None) -> dict[str, Any] | None:
    """The spec's ``privacy`` with the site's ε applied: None when neither asks for DP; DP
    by ``target_epsilon`` = ``epsilon`` when the spec asks none, or asks more (a noise
    multiplier asks an unbounded ε); the spec's otherwise."""
    privacy = None if spec.privacy is None else spec.privacy.model_dump(mode="json")
    if epsilon is None:
        return privacy
    privacy = privacy or {}
    dp = privacy.get("dp") or {}
    asked = dp.get("target_epsilon")
    if asked is None or asked > epsilon:
        dp = {**dp, "target_epsilon": epsilon, "noise_multiplier": None}
    privacy["dp"] = dp
    return privacy


def worker_topology(
    spec: RunSpec,
    *,
    run_id: str,
    site: str,
    members: list[str],
    binding: DatasetConfig,
    broker: str,
    certs: str | None,
    epsilon: float | None,
    init: str | None = None,
) -> dict[str, Any]:
    """The topology mapping of ``spec`` (``run_id``) as ``site`` trains it with the
    committed ``members`` on its ``binding``; ``epsilon``: the ε the site's policy decided
    (None: the spec's privacy as it is); ``init``: the model file a warm-started cycle
    begins from. Raises ``ValueError`` when ``site`` is not a
    member."""
    if site not in members:
        raise ValueError(f"{site!r} is not a committed member")
    body = spec.model_dump(mode="json", exclude=set(RUN_ONLY), exclude_none=True)
    body["name"] = run_swarm_name(spec, run_id)
    body["nodes"] = sorted(members)
    body["rounds"] = cycle_rounds(spec)
    if init is not None:  # a warm start: this site's own file
        body["model"]["init"] = init
    dataset = binding.model_dump(mode="json", exclude_none=True)
    if dataset.pop("watch", False):  # a watched file grows: its held-out rows stay held out
        dataset["test_split"] = "row_hash"
    body["dataset"] = dataset
    body["broker"] = broker
    if certs is not None:
        body["security"] = {"tls": True, "sign": True, "certs": certs}
    privacy = site_privacy(spec, epsilon)
    if privacy is None:
        body.pop("privacy", None)
    else:
        body["privacy"] = privacy
    return body
