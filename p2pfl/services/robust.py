"""The robust port: what a peer's state must pass before a method sees it, the claims it
may make, the states refused this round, and the reputation refusals earn
(docs/design.md, "Robust aggregation").

- **admit**: admission (:func:`~p2pfl.learning.admission.admit_state`: layout, finite
  values, norm bound, ``defence.max_norm_ratio``; the reference's norm computed once a
  round, :class:`~p2pfl.learning.admission.ReferenceNorms`);
- **cap**: a peer's claimed sample count capped (:func:`~p2pfl.learning.admission.cap_claims`);
- **reject**: a state refused this round, logged, counted (``rejected_state``) and kept for
  the round's record;
- **trust**: a peer whose states were refused sits out ``defence.distrust_rounds`` rounds,
  doubled per refusal.

The method's combination rule is its context's :class:`~p2pfl.learning.defence.Defence`;
this port is the one that hands it each round's inputs (a
:class:`~p2pfl.learning.defence.DefenceInputs`: the round and its DP noise spread, with what
the round code adds before it merges or aggregates) and reads what it refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from p2pfl.attacks import Adversary
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.admission import ReferenceNorms, admit_state, cap_claims
from p2pfl.learning.defence import Defence, DefenceInputs
from p2pfl.learning.state import State

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy

log = logging.getLogger(__name__)


class Robustness:
    """Node ``node_id``'s admission, claim caps, refusals and reputation; ``own_samples`` is
    its own training-set size (the median the caps measure from includes it)."""

    def __init__(
        self,
        cfg: TopologyConfig,
        node_id: str,
        defence: Defence,
        own_samples: int,
        dropped: Counter,
        adversary: Adversary | None = None,
        privacy: NodePrivacy | NodeUpdatePrivacy | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self.defence = defence
        self._own_samples = own_samples
        self._dropped = dropped
        self._adversary = adversary
        self._privacy = privacy
        self.round_no = 0
        self.rejected: dict[str, str] = {}
        self.capped: dict[str, int] = {}
        self.distrusted: dict[str, int] = {}  # peer -> the first round it is drawn again
        self._strikes: dict[str, int] = {}
        self._ref_norms = ReferenceNorms()  # the round's reference norms, each computed once

    def admit(self, state: Any, reference: State, *, layout: bool = True) -> str | None:
        """None when a peer's ``state`` may reach the method, else why not (admission:
        :mod:`p2pfl.learning.admission`, bounded by ``defence.max_norm_ratio``)."""
        ratio = self.cfg.defence.max_norm_ratio
        return admit_state(state, reference, ratio, layout=layout, reference_norm=self._ref_norms)

    def begin_round(self, round_no: int) -> None:
        """Round ``round_no`` starts: no state refused yet; the defence measures with the
        round's inputs as this port knows them (the round and, under ``privacy.dp``, the
        noise spread an honest node's weights carry this round)."""
        self.round_no = round_no
        self._ref_norms.clear()
        self.rejected = {}
        self.capped = {}
        spread = 0.0
        if self._privacy is not None:  # honest peers' models carry this round's DP noise
            spread = self._privacy.noise_spread(round_no, self.cfg.training)
        self.defence.begin_round(DefenceInputs(round_no, noise_spread=spread))

    def measure_with(
        self,
        *,
        reference: State | None = None,
        staleness: Mapping[str, float] | None = None,
    ) -> DefenceInputs:
        """The round's defence inputs with what the round code adds before it merges or
        aggregates (None: unchanged): the aggregator's ``reference`` (its own upload, or
        its current model's part when it did not train) or the ``staleness`` weight of
        each stale peer of an asynchronous round. Handed to the defence and returned; the
        refusals so far stand."""
        inputs = self.defence.inputs
        inputs = dataclasses.replace(
            inputs,
            reference=inputs.reference if reference is None else reference,
            staleness=inputs.staleness if staleness is None else staleness,
        )
        self.defence.take(inputs)
        return inputs

    def reject(self, peer: str, reason: str, round_no: int) -> None:
        """Refuse ``peer``'s state of ``round_no``: logged with the peer's id, counted
        (``rejected_state``) and kept for the round's record."""
        if peer in self.rejected:
            return
        self.rejected[peer] = reason
        self._dropped["rejected_state"] += 1
        log.warning("%s: round %d: refused %s's state: %s", self.id, round_no, peer, reason)

    def trusted(self, peer: str, round_no: int) -> bool:
        """Whether ``peer`` may be drawn in ``round_no`` (reputation: a peer whose states
        were refused sits out ``defence.distrust_rounds`` rounds, doubled per refusal)."""
        return self.distrusted.get(peer, 0) <= round_no

    def cap_claims(self, claims: dict[str, int]) -> dict[str, int]:
        """Peers' claimed sample counts, capped (admission,
        :func:`~p2pfl.learning.admission.cap_claims`); the capped claims are kept for the
        round's record."""
        d = self.cfg.defence
        out, capped = cap_claims(self._own_samples, claims, d.max_sample_ratio, d.max_samples)
        for peer, claimed in capped.items():
            self.capped[peer] = claimed
            log.warning(
                "%s: round %d: %s claims %d samples; capped at %d",
                self.id,
                self.round_no,
                peer,
                claimed,
                out[peer],
            )
        return out

    def facts(self, round_no: int, method_rejected: dict[str, str] | None = None) -> dict[str, Any]:
        """The round's robustness facts for its record, and the reputation they earn:
        ``rejected`` (peer → reason, admission's and the defence's), ``clipped`` (under
        ``centered_clip``, only when some state was: peer → its distance over the bound; a
        clipped state still counts, and earns no distrust), ``capped`` (peer → the count it
        claimed), ``distrusted`` (peer → the first round it is drawn again) and
        ``attack`` (what this node did, in an attack experiment). ``method_rejected``: the
        states the method itself left out (its ``merge`` facts' ``rejected``)."""
        rejected = dict(self.rejected)
        extra = method_rejected if isinstance(method_rejected, dict) else {}
        for peer, reason in [*self.defence.rejected.items(), *extra.items()]:
            if peer not in rejected:
                rejected[peer] = reason
                log.warning("%s: round %d: left out %s: %s", self.id, round_no, peer, reason)
        base = self.cfg.defence.distrust_rounds
        for peer in rejected:
            if base > 0:
                strikes = self._strikes[peer] = self._strikes.get(peer, 0) + 1
                self.distrusted[peer] = round_no + 1 + base * 2 ** min(strikes - 1, 10)
        facts: dict[str, Any] = {
            "rejected": rejected,
            "capped": dict(self.capped),
            "distrusted": {p: r for p, r in sorted(self.distrusted.items()) if r > round_no + 1},
        }
        if self.defence.clipped:  # centered_clip: pulled onto the bound, counted, not distrusted
            clipped = facts["clipped"] = dict(sorted(self.defence.clipped.items()))
            log.info(
                "%s: round %d: pulled within the bound: %s",
                self.id,
                round_no,
                ", ".join(f"{p} (x{r:.3g})" for p, r in clipped.items()),
            )
        if self.defence.fallbacks:
            facts["defence_fallbacks"] = self.defence.fallbacks
        if self._adversary is not None:
            facts["attack"] = self._adversary.describe(round_no)
        return facts
