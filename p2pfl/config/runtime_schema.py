"""The topology's sections on how the daemons run beside each other rather than what they
learn: ``timing:`` (deadlines, sync or async rounds, a centralized round's quorum),
``transfer:`` (the direct lane between peers and how states are compressed on it) and
``security:`` (TLS, signed messages, the aggregate's audit). Each is checked alone here;
the checks that need the method or the whole topology (a lossy compression under an audit,
for one) are :mod:`p2pfl.check.preflight`'s. A sibling of :mod:`p2pfl.config.schema`, which
holds them as ``TopologyConfig.timing``, ``.transfer`` and ``.security``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from p2pfl.config import bounds as B
from p2pfl.config.strict import StrictModel


class TimingConfig(StrictModel):
    round_timeout_s: float = Field(
        60.0, gt=0, le=B.MAX_SECONDS, description="per-round deadline for gossip and weight pulls"
    )
    startup_timeout_s: float = Field(
        120.0,
        gt=0,
        le=B.MAX_SECONDS,
        description="wait for the broker, then for the neighbours, at start",
    )
    linger_s: float = Field(
        60.0,
        ge=0,
        le=B.MAX_SECONDS,
        description="after the last round, keep serving peers at most this long",
    )
    broker_timeout_s: float = Field(
        120.0,
        gt=0,
        le=B.MAX_SECONDS,
        description="a node that cannot reach its broker for this long stops with an error "
        "(non-zero exit), keeping every completed round on disk; shorter outages are ridden out",
    )
    aggregator_timeout_s: float | None = Field(
        None,
        gt=0,
        le=B.MAX_SECONDS,
        description="centralized methods: how long a client waits for the aggregator's "
        "result after reporting before the next peer takes the round over "
        "(default: 3 × round_timeout_s)",
    )

    mode: Literal["sync", "async"] = Field(
        "sync",
        description="decentralized methods: sync (each round waits for the drawn "
        "neighbours' gossip of that round) or async (each node runs its own round counter "
        "and uses the latest gossip and state each neighbour has, docs/algorithms.md, "
        '"Asynchronous rounds")',
    )
    max_staleness: int = Field(
        4,
        ge=0,
        le=B.MAX_ROUNDS,
        description="async: a neighbour whose latest gossip is more than this many rounds "
        "behind the node's round is left out of the round; quorum: a late upload counts at "
        "most min(max_staleness, 2) rounds after its own",
    )
    staleness_exponent: float = Field(
        0.5,
        ge=0,
        description="async and quorum: a stale peer's (or late upload's) weight in a "
        "method's mean is multiplied by (1 + staleness)^-a (0: stale and fresh alike)",
    )
    catch_up_training: Literal["paced", "full"] = Field(
        "paced",
        description="decentralized methods: the round a node that fell behind catches up "
        "to trains at its neighbours' pace (paced: for its previous round's time divided by "
        'the rounds they ran meanwhile) or whole (full); docs/wire.md, "Rounds and '
        'catch-up"',
    )
    quorum: float | None = Field(
        None,
        gt=0,
        le=1,
        description="centralized methods: the aggregator closes a round once this fraction "
        "of the live members has reported, or at a deadline adapted from the round times "
        "it has seen; a late upload counts in the next round, weighted by its staleness "
        "(None: wait for every member up to round_timeout_s)",
    )

    @property
    def aggregator_timeout(self) -> float:
        return self.aggregator_timeout_s or 3 * self.round_timeout_s


class TransferConfig(StrictModel):
    """How weights travel (docs/wire.md, "Direct lane")."""

    direct: bool = Field(
        True,
        description="serve and pull weights straight between peers over TCP, with the "
        "broker's MQTT lane as the fallback; false: every byte through the broker",
    )
    direct_host: str | None = Field(
        None,
        description="address the direct lane listens on and announces (default: this "
        "host's address on the route to the broker)",
    )
    direct_port: int = Field(0, ge=0, lt=65536, description="its port (0: a free one)")
    compress: str = Field(
        "none",
        pattern=r"^(none|fp16|int8|topk\((0?\.\d+|1(\.0*)?)\))$",
        description="how states travel: none, fp16, int8 (per-tensor affine), or topk(rho): "
        "each served state a stream per sender, a pull naming the base it holds of it and "
        "getting the positions of the largest rho of each tensor's change since (error "
        "feedback), or the state dense when the sender cannot answer that base "
        '(docs/wire.md, "Compression"); lossy ones are refused with a centralized audit',
    )


class SecurityConfig(StrictModel):
    """Who may join and what is trusted (docs/wire.md, "Security"). Both switches need
    ``certs``: a directory made by ``p2pfl certs`` (per device: ``certs:`` in its ``nodes/``
    file or ``--certs``; the local launcher creates one in the run directory when none is
    given)."""

    tls: bool = Field(
        False,
        description="TLS to the broker with client certificates; the launcher's Mosquitto "
        "then requires them and applies the per-node ACL",
    )
    sign: bool = Field(
        False,
        description="sign every message (Ed25519); drop unsigned, forged and replayed ones",
    )
    certs: str | None = Field(None, description="the swarm's certificate directory")
    max_age_s: float = Field(
        300.0,
        gt=0,
        le=B.MAX_SECONDS,
        description="signed messages older than this (or with a repeated id) "
        "are replays; also the clock skew tolerated between devices",
    )
    audit: bool = Field(
        True,
        description="with sign, centralized methods: a member drawn each round recomputes "
        "the aggregate from the signed uploads and announces a verdict; a mismatch fails "
        "the round over and the aggregator is skipped from then on",
    )

    @property
    def enabled(self) -> bool:
        return self.tls or self.sign
