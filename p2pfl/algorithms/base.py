"""The contracts between a method and the node daemon that runs it.

A method is data-in, data-out (docs/design.md, "Principles"): it never touches the network.
There are two kinds, both registered with :func:`register` in one module per method.

**Decentralized** (:class:`DecentralizedAlgorithm`). Each round the node

1. takes a :meth:`DecentralizedAlgorithm.snapshot` and publishes :meth:`DecentralizedAlgorithm.gossip` (small),
2. draws peers with :meth:`DecentralizedAlgorithm.choose_peers` and waits (up to the round deadline) for
   their gossip,
3. asks :meth:`DecentralizedAlgorithm.plan` which named part (``g``, ``h``, ``all``) to pull from whom,
4. pulls those parts (peers serve them from their snapshot of this round),
5. calls :meth:`DecentralizedAlgorithm.merge` with what arrived, then trains locally with
   :meth:`DecentralizedAlgorithm.extra_loss` added to the cross-entropy, then :meth:`DecentralizedAlgorithm.after_train`.

**Centralized** (:class:`CentralizedAlgorithm`), run by a rotating aggregator peer
(:mod:`p2pfl.rounds.rotation.centralized`). Each round every participant

1. trains locally (``loss_fn`` or cross-entropy + ``extra_loss``) and keeps
   :meth:`CentralizedAlgorithm.upload` (the part the aggregator may pull) with a small
   :meth:`CentralizedAlgorithm.report`;
2. the round's aggregator pulls the uploads and calls the pure server rule
   :meth:`CentralizedAlgorithm.aggregate`, which says what each node receives and the small
   server state carried to the next round's aggregator;
3. every node pulls what it receives and calls :meth:`CentralizedAlgorithm.apply`.

**Checkpoints** (both kinds). A node saves :meth:`Method.checkpoint` every round and, after a
restart, builds its method afresh (same model, config and data) and calls
:meth:`Method.restore`. The checkpoint is the model's weights plus
:meth:`Method.extra_state`: whatever the method keeps between rounds beyond the model (a
proximal target, masks, the previous round's representations). A method that keeps nothing
but its model needs no override; one that does overrides :meth:`Method.extra_state` and
:meth:`Method.load_extra_state` in its own module. What is derived from the config or the
data at construction (shapes, labels, knobs) is rebuilt, not saved; the node's RNG
(``ctx.rng``) is saved by the daemon.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel

from p2pfl.algorithms.cards.card import CentralizedParams, Params
from p2pfl.config.schema import SHARE_KINDS
from p2pfl.learning.defence import Defence
from p2pfl.learning.hooks import ExtraLoss, LossFn, StepHook
from p2pfl.learning.models import SplitModel
from p2pfl.learning.state import State, TensorStamp, layout_mismatch, select_part

PullPlan = dict[str, str]  # peer id -> part ("g", "h" or "all")

REGISTRY: dict[str, type[Method]] = {}


def check_shares(cls: type[Method]) -> None:
    """Raise ``ValueError`` unless ``cls.shares`` is a frozenset of :data:`SHARE_KINDS`."""
    shares = getattr(cls, "shares", None)
    if not isinstance(shares, frozenset) or not shares <= set(SHARE_KINDS):
        raise ValueError(
            f"{cls.__name__}.shares must be a frozenset of {list(SHARE_KINDS)}, not {shares!r}"
        )


def check_card(cls: type[Method]) -> None:
    """Raise ``ValueError`` unless a built-in method's class says what its card says (its
    ``name``, ``kind``, ``shares`` and ``Params``): the daemon judges a run by the card
    alone (:mod:`p2pfl.algorithms.cards`)."""
    from p2pfl.algorithms.cards import builtin_card

    card = builtin_card(cls.name)
    if card is None:
        raise ValueError(f"built-in method {cls.name!r} has no card in p2pfl.algorithms.cards")
    ours = (cls.name, cls.kind, cls.shares, cls.Params)
    if ours != (card.name, card.kind, card.shares, card.Params):
        raise ValueError(f"method {cls.name!r}: its class and its card disagree")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator of a built-in method: make it available under ``cls.name`` (its
    class must agree with its card, :func:`check_card`)."""
    if cls.name in REGISTRY:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    check_shares(cls)
    check_card(cls)
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class AlgorithmContext:
    """What a method may know about its node (no I/O handles)."""

    node_id: str
    model: SplitModel
    num_samples: int
    num_classes: int
    input_shape: tuple[int, ...]
    rng: np.random.Generator
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the robust combination a method uses in place of its mean (the topology's
    # ``defence:``; docs/design.md, "Robust aggregation"); the plain mean by default
    defence: Defence = field(default_factory=Defence)


class Method(ABC):
    """What every method has: a name, validated knobs, the node's model, training hooks."""

    name: ClassVar[str]
    kind: ClassVar[str] = "decentralized"
    Params: ClassVar[type[BaseModel]] = Params
    # the ``defence.rule``s this method can combine under (None: every rule); a method with
    # its own arithmetic lists the rules that select whole states (docs/design.md,
    # "Robust aggregation"), checked at load
    defences: ClassVar[tuple[str, ...] | None] = None
    # what leaves the node, of :data:`SHARE_KINDS` (a site's policy ``share`` is checked
    # against it, not against the method's name); by default the whole model's weights
    shares: ClassVar[frozenset[str]] = frozenset({"whole_weights"})
    # the parts of the model (``"g"``, ``"h"``) whose maths needs parameters in them: a
    # user's model whose ``model.personal`` leaves one of them empty is refused when it is
    # checked, naming the method and the field (a method of the whole model needs none)
    needs_parts: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def task_problem(cls, loss: str, targets: str, outputs: int) -> str | None:
        """Why this method's maths cannot train the topology's task (``training.loss``
        ``loss`` on ``targets``, ``"classes"`` or ``"values"``, with a model of ``outputs`` a
        row), in words that follow the method's name; None when it can (the default: any
        loss, any labels)."""
        return None

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        self.params = self.Params.model_validate(params)
        self.ctx = ctx
        self.model = ctx.model
        # model_state's latest copy, with the stamp of the tensors it was copied from
        self._state_copy: tuple[TensorStamp, State] | None = None

    @classmethod
    def adapt_model(cls, model: SplitModel, params: BaseModel, num_classes: int) -> SplitModel:
        """Change the architecture before training starts (e.g. pFedC's heads). Called once
        per node with torch's RNG seeded identically on every node; default: unchanged."""
        return model

    def model_state(self) -> State:
        """A detached CPU copy of the model's whole state (a new map each call). The copy is
        taken once per state of the model: while the model holds the same tensors and none
        changed since the last copy (torch's version counter of each, which every in-place
        change, an optimizer step, ``load_state_dict`` or a buffer update moves), the last
        copy's tensors are handed out again, so a round's snapshot, rollback point and
        checkpoint share one copy. Nobody may write into the returned tensors."""
        live = self.model.state_dict(keep_vars=True)
        stamp = TensorStamp.of(live.values())
        cached = getattr(self, "_state_copy", None)  # a user method may skip __init__
        if stamp is not None and cached is not None:
            if stamp.matches(cached[0]) and list(cached[1]) == list(live):
                return dict(cached[1])
        state = {k: v.detach().to("cpu", copy=True) for k, v in live.items()}
        self._state_copy = None if stamp is None else (stamp, state)
        return dict(state)

    def model_changed(self) -> None:
        """Forget :meth:`model_state`'s copy: the model may have changed in a way torch's
        version counters do not show (a batch-norm kernel's running statistics in a
        training forward, an assignment to a tensor's ``.data``). The node calls it after
        training and after a method's merge; a method that changes its model that way in
        another hook calls it too."""
        self._state_copy = None

    def snapshot(self) -> State:
        """What peers may pull this round (default: :meth:`model_state`)."""
        return self.model_state()

    @staticmethod
    def select(state: State, part: str) -> State:
        """The named part (``g``, ``h``, ``all``) of a state, by parameter names."""
        return select_part(state, part)

    def extra_loss(self) -> ExtraLoss | None:
        """A term added to the cross-entropy during local training, or None. Under
        ``privacy.dp`` it must not depend on the batch: DP-SGD calls it with empty batches
        and adds its gradient after the noise (docs/algorithms.md, "Differential privacy")."""
        return None

    def loss_fn(self) -> LossFn | None:
        """A loss that replaces cross-entropy (and ``extra_loss``) in training, or None. A
        method that has one cannot run under ``privacy.dp`` (refused at load)."""
        return None

    @classmethod
    def update_dp_problem(cls, params: BaseModel) -> tuple[str, str] | None:
        """Under ``privacy.dp.level: update`` only the node's model is noised, once a round
        (docs/algorithms.md, "Differential privacy"): ``(field, why)`` when this method,
        with these knobs, sends something computed from its raw training beyond that model
        (refused at load); None when all it sends is computed from the released model,
        what it received and public settings. Default: None."""
        return None

    def step_hook(self) -> StepHook | None:
        """Called with the model after every optimizer step (gradients still in ``.grad``),
        e.g. to re-apply a sparse mask; None for nothing."""
        return None

    def after_train(self) -> dict[str, Any] | None:
        """Hook after local training (e.g. recompute representations, update a sparse mask);
        may return facts to log with the round (decentralized driver). Default: nothing."""
        return None

    def set_labels(self, labels: torch.Tensor) -> None:
        """Told once, before round 1, the node's training labels (e.g. pFedC's task
        presence π); default: ignored."""
        return None

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """Everything this node's method needs to continue after a restart:
        ``{"model": the model's state_dict on CPU (detached clones), "extra":
        self.extra_state()}``. Encodable by :func:`p2pfl.wire.codec.encode` (maps with str
        keys, lists, str/int/float/bool/None, bytes, torch tensors, numpy arrays); shares no
        storage with the method, so later rounds do not change it."""
        return {"model": self.model_state(), "extra": self.extra_state()}

    def restore(self, ckpt: dict[str, Any]) -> None:
        """Load a :meth:`checkpoint` (as :func:`p2pfl.wire.codec.decode` returns it: tensors
        as CPU torch tensors, tuples as lists) into this freshly built method on the same
        model, config and data. The weights must have the model's layout (keys, shapes,
        dtypes: :func:`~p2pfl.learning.state.layout_mismatch`) and are copied to the model's
        device; then :meth:`load_extra_state` gets ``ckpt["extra"]``. Bad or foreign content
        raises ``ValueError`` naming what is wrong, and leaves the method as it was (the
        previous weights are put back when ``load_extra_state`` refuses)."""
        if not isinstance(ckpt, Mapping):
            raise ValueError(f"checkpoint: expected a map, got {type(ckpt).__name__}")
        if set(ckpt) != {"model", "extra"}:
            keys = sorted(map(str, ckpt))
            raise ValueError(f"checkpoint: keys {keys}, expected ['extra', 'model']")
        weights, extra = ckpt["model"], ckpt["extra"]
        why = layout_mismatch(weights, self.model.state_dict())
        if why is not None:
            raise ValueError(f"checkpoint model: {why}")
        if not isinstance(extra, Mapping):
            raise ValueError(f"checkpoint extra: expected a map, got {type(extra).__name__}")
        before = self.model_state()
        self.model.load_state_dict(weights)  # copies into the model's tensors (its device)
        try:
            self.load_extra_state(dict(extra))
        except BaseException:
            self.model.load_state_dict(before)
            raise

    def extra_state(self) -> dict[str, Any]:
        """What the method keeps between rounds beyond the model, for :meth:`checkpoint`
        (encodable as said there; msgpack holds ints in ``[-2**63, 2**64)``: store a
        larger one, e.g. a 128-bit RNG state, as a str). Default: nothing (``{}``)."""
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Install :meth:`extra_state`'s output from a checkpoint. Called by :meth:`restore`
        after the checkpoint's weights are in the model; checks all of ``extra`` before
        changing anything and raises ``ValueError`` naming what is wrong (a missing or
        unknown key, a wrong shape). Default: ``extra`` must be empty (a checkpoint with
        state this method does not keep is foreign)."""
        check_keys(extra, (), f"{self.name} checkpoint extra")


class DecentralizedAlgorithm(Method):
    """One decentralized method. Subclasses set ``name`` and ``Params``.

    ``exchange_after_training`` picks the round's order: False (default) is merge-then-train
    as listed above (UA-PDFL, DisPFL); True trains first, then takes the snapshot peers pull
    and merges what they sent (DFedAvgM mixes the models its neighbours just trained). A
    class sets it, or an instance from its params before its first round (UA-PDFL's
    ``order``); the driver reads the instance's.

    ``keeps_in_step`` says whether the node keeps in step with its neighbours (docs/wire.md,
    "Rounds and catch-up"): True (default) joins a swarm under way at its round and skips
    ahead when :data:`~p2pfl.services.peers.LAG_ROUNDS` behind, so a slow node does not hold
    its neighbours back; False (a method with no swarm to keep in step with: Local) runs every
    one of its rounds, from round 1 (or its checkpoint) to the last, whatever its neighbours'
    rounds, so its training budget never depends on the machine's load."""

    exchange_after_training: bool = False
    keeps_in_step: ClassVar[bool] = True

    def gossip(self) -> dict[str, Any] | None:
        """Small per-round message published to neighbours (msgpack-able, may hold tensors);
        None publishes nothing (a method that never communicates)."""
        return {"n": self.ctx.num_samples}

    # -- one round -----------------------------------------------------------------------
    def choose_peers(self, candidates: list[str]) -> list[str]:
        """Peers to hear from this round (default: every live neighbour)."""
        return list(candidates)

    @abstractmethod
    def plan(self, gossip: dict[str, dict[str, Any]]) -> tuple[PullPlan, dict[str, Any]]:
        """Given the gossip of the peers that answered, return what to pull from whom and a
        dict of facts to log (divergences, decisions)."""

    @abstractmethod
    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """Combine the pulled parts (peers whose pull failed are absent) into the local model;
        return facts to log.

        Every pulled state, and every peer's gossip, comes from an untrusted peer. A pulled
        state that does not have the layout the method expects of it (keys, shapes and
        dtypes of the matching part of the node's own model or snapshot:
        :func:`peer_state_mismatch`) or whose values are unusable (not tensors) is **left
        out**, as if its pull had failed, and named in the facts as ``"rejected": {peer:
        reason}``; the method carries on with the others. The model is never partly loaded
        from a rejected state, and when every pulled state is rejected the node keeps its
        own model. Nothing pulled or gossiped makes merge raise (no ``RuntimeError``,
        ``KeyError``, ``IndexError``, ``TypeError``, ``AttributeError``, ``ValueError``)."""


def check_keys(value: Any, keys: Sequence[str], what: str) -> dict[str, Any]:
    """``value`` if it is a map with exactly ``keys``; ``ValueError`` naming ``what`` and the
    missing or unknown keys otherwise (for :meth:`Method.load_extra_state`)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected a map, got {type(value).__name__}")
    missing = sorted(set(keys) - set(value))
    extra = sorted(map(str, set(value) - set(keys)))
    if missing or extra:
        raise ValueError(f"{what}: keys differ (missing {missing}, unknown {extra})")
    return dict(value)


def check_tensor(value: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` if it is a tensor of ``like``'s shape and dtype; ``ValueError`` naming
    ``what`` otherwise (for :meth:`Method.load_extra_state`)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(value).__name__}")
    if value.shape != like.shape or value.dtype != like.dtype:
        raise ValueError(
            f"{what}: {value.dtype} of shape {tuple(value.shape)}, "
            f"expected {like.dtype} of shape {tuple(like.shape)}"
        )
    return value


def check_state(value: Any, template: State, what: str) -> State:
    """``value`` if it has ``template``'s layout (keys, shapes, dtypes); ``ValueError``
    naming ``what`` and the mismatch otherwise (for :meth:`Method.load_extra_state`)."""
    why = layout_mismatch(value, template)
    if why is not None:
        raise ValueError(f"{what}: {why}")
    return dict(value)


def peer_state_mismatch(state: Any, template: State, *, dtype: bool = True) -> str | None:
    """Why a state a peer sent cannot stand for ``template`` (None when it can):
    :func:`~p2pfl.learning.state.layout_mismatch` for any decoded content. It must first be
    a map whose keys are all ``str`` (the codec lets ``bytes`` keys through, which do not
    even sort with ``str``). For :meth:`DecentralizedAlgorithm.merge` and
    :meth:`CentralizedAlgorithm.apply`."""
    if not isinstance(state, Mapping):
        return f"not a map ({type(state).__name__})"
    odd = [type(k).__name__ for k in state if not isinstance(k, str)]
    if odd:
        return f"keys differ ({len(odd)} not str, e.g. a {odd[0]} key)"
    return layout_mismatch(state, template, dtype=dtype)


def draw_peers(candidates: list[str], k: int | None, rng: np.random.Generator) -> list[str]:
    """``k`` distinct peers drawn uniformly from ``candidates`` with ``rng`` (sorted); all of
    them when ``k`` is None or not smaller than their number (``rng`` then unused)."""
    pool = sorted(candidates)
    if k is None or len(pool) <= k:
        return pool
    picks = rng.choice(len(pool), size=k, replace=False)
    return sorted(pool[int(i)] for i in picks)


def gossiped_count(gossip: Any) -> int | None:
    """A peer's gossiped training-sample count ``n`` (a positive int), None when absent or
    malformed (peers are untrusted)."""
    n = gossip.get("n") if isinstance(gossip, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return None
    return n


class WholeModelExchange(DecentralizedAlgorithm):
    """A decentralized method that pulls the whole published state of ``peers`` random live
    neighbours each round and weights them by their gossiped sample counts (``weighted``) or
    uniformly. Its ``Params`` must have ``peers: int | None`` and ``weighted: bool``."""

    def gossip(self) -> dict[str, Any]:
        return {"n": self.ctx.num_samples}

    def choose_peers(self, candidates: list[str]) -> list[str]:
        """``peers`` random live neighbours (all of them when ``peers`` is None)."""
        return draw_peers(candidates, self.params.peers, self.ctx.rng)

    def peer_weight(self, gossip: Any) -> float | None:
        """A peer's averaging weight from its gossip (1 when unweighted), None when unusable."""
        if not self.params.weighted:
            return 1.0
        n = gossiped_count(gossip)
        return None if n is None else float(n)

    def own_weight(self) -> float:
        """This node's averaging weight (1 when unweighted or when it has no samples)."""
        return float(max(self.ctx.num_samples, 1)) if self.params.weighted else 1.0

    def plan(self, gossip: dict[str, dict[str, Any]]) -> tuple[PullPlan, dict[str, Any]]:
        """Pull ``all`` from every peer that gossiped a usable weight; log the others."""
        pull: PullPlan = {}
        bad: list[str] = []
        for peer in sorted(gossip):
            if self.peer_weight(gossip[peer]) is None:
                bad.append(peer)
            else:
                pull[peer] = "all"
        return pull, {"bad_gossip": bad} if bad else {}


@dataclass
class Upload:
    """What one participant contributed to a round, as the aggregator received it."""

    # its weight: the training samples it reported (capped), discounted to
    # n · (1 + s)^-a when it is counted s rounds late (quorum rounds; an int when fresh)
    n: float
    state: State  # the uploaded part of the trained model (CPU tensors, already shape-checked)
    report: dict[str, Any]  # the small facts it reported (validated by ``check_report``)


@dataclass
class Aggregate:
    """The outcome of one server rule.

    ``results[node]`` is what that node receives (only what it does not already have);
    ``common`` is what any other member receives (a node that did not upload, a late joiner),
    or None when there is nothing for it. ``server`` is small, msgpack-able state carried to
    the next round's aggregator (every node stores the latest); ``facts`` are logged."""

    results: dict[str, State]
    common: State | None
    server: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


def kept_uploads(uploads: dict[str, Upload], defence: Defence, own: str) -> dict[str, Upload]:
    """The uploads ``defence`` keeps (:meth:`~p2pfl.learning.defence.Defence.select`, around
    the aggregator ``own``'s upload when it has one), each with its state as kept (under
    ``centered_clip``, pulled within the bound), for a server rule with its own arithmetic;
    the others are named in the defence's rejections."""
    nodes = sorted(uploads)
    mine = nodes.index(own) if own in uploads else None
    kept = defence.select([uploads[n].state for n in nodes], who=nodes, own=mine)
    return {
        nodes[i]: uploads[nodes[i]]
        if state is uploads[nodes[i]].state
        else dataclasses.replace(uploads[nodes[i]], state=state)
        for i, state in kept.items()
    }


FRACTION_STREAM = 0xF4AC7  # the client-fraction draw's generator stream (see draw_members)


def drawn_count(fraction: float, members: int) -> int:
    """How many of ``members`` live members a round draws under client fraction ``fraction``
    (C): ``m = max(1, ⌊C·K + ½⌋)`` (rounded half-up), never more than ``K``; 0 when ``K``
    is 0."""
    if members <= 0:
        return 0
    return min(members, max(1, math.floor(fraction * members + 0.5)))


def draw_members(roster: Sequence[str], fraction: float, seed: int, round_no: int) -> list[str]:
    """The members of ``roster`` drawn to train and upload in round ``round_no`` under client
    fraction ``fraction`` (docs/algorithms.md, "Client fraction"), sorted: every member when
    :func:`drawn_count` is all of them (no generator used), else that many drawn without
    replacement from the sorted roster by ``numpy.random.default_rng([seed, round_no,
    FRACTION_STREAM])``. A pure function of its arguments, so every node that knows the
    round's roster draws the same members."""
    pool = sorted(set(roster))
    m = drawn_count(fraction, len(pool))
    if m >= len(pool):
        return pool
    rng = np.random.default_rng([seed, round_no, FRACTION_STREAM])
    picks = rng.choice(len(pool), size=m, replace=False)
    return sorted(pool[int(i)] for i in picks)


class CentralizedAlgorithm(Method):
    """One server-based method run by a rotating aggregator peer (:mod:`p2pfl.rounds.rotation.centralized`).

    Subclasses set ``name``, ``Params``, ``upload_part`` and implement :meth:`aggregate` (the
    pure server rule: no I/O, no use of ``self.model``) and :meth:`apply`. Their ``Params``
    derive from :class:`CentralizedParams` (the knobs every centralized method has, such as
    the client ``fraction``); one that does not has it mixed in when the class is made."""

    kind: ClassVar[str] = "centralized"
    Params: ClassVar[type[BaseModel]] = CentralizedParams
    upload_part: ClassVar[str] = "all"  # "g", "h" or "all": what a participant uploads

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.Params
        if issubclass(own, CentralizedParams):
            return
        if issubclass(CentralizedParams, own):  # Params itself (a method without knobs)
            cls.Params = CentralizedParams
            return
        cls.Params = type(
            own.__name__,
            (own, CentralizedParams),
            {"__module__": own.__module__, "__doc__": own.__doc__},
        )

    @property
    def fraction(self) -> float:
        """The client fraction C (knob ``fraction``; 1.0: every live member trains)."""
        return float(getattr(self.params, "fraction", 1.0))

    # -- client side ---------------------------------------------------------------------
    def upload(self) -> State:
        """A detached CPU copy of the part this node uploads after training."""
        return self.select(self.snapshot(), self.upload_part)

    def report(self, result: Any, lr: float) -> dict[str, Any]:
        """Small facts sent with the upload notice (``result`` is a ``TrainResult``)."""
        return {}

    @classmethod
    def check_report(cls, report: Any) -> dict[str, Any]:
        """Validate a peer's (untrusted) report; raise ``ValueError`` if it is malformed."""
        if not isinstance(report, dict):
            raise ValueError("report must be a map")
        return report

    @abstractmethod
    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Install what the aggregator sent this node (from :attr:`Aggregate.results` or
        :attr:`Aggregate.common`); return facts to log.

        ``received`` comes from an untrusted peer (the round's aggregator). When it does not
        have the layout the method expects (keys, shapes and dtypes of the matching part of
        the node's model: :func:`peer_state_mismatch`), holds unusable values (not
        tensors), or a value the method reads from ``announcement`` does not fit what it
        indexes, apply raises ``ValueError`` naming the mismatch **before** anything in the
        model or the method's state changes (the driver catches it and the node keeps its
        model). It raises nothing else for any received content."""

    def needs_result(self, participated: bool, participates_next: bool, last_round: bool) -> bool:
        """Whether this node pulls the round's result (default: always)."""
        return True

    # -- server side (pure) --------------------------------------------------------------
    def initial_server_state(self, roster: list[str]) -> dict[str, Any]:
        """Server state before round 1 (every node computes it alike)."""
        return {}

    def participants(
        self, server: dict[str, Any], roster: list[str], round_no: int, rng: np.random.Generator
    ) -> list[str]:
        """Who trains and uploads in ``round_no`` (default: the whole roster). ``rng`` is
        seeded by (swarm seed, round) so every node computes the same set."""
        return sorted(roster)

    @abstractmethod
    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """The server rule over the uploads that arrived (at least one). ``roster`` lists
        the members that may receive the result."""

    def aggregate_sum(
        self,
        total: State,
        weight: float,
        template: State,
        members: list[str],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """The server rule under secure aggregation (``privacy.secagg``; docs/design.md,
        "Secure aggregation"): the aggregator learns only ``total`` = ``Σ n_u x_u`` over
        ``members`` (each floating tensor of the upload part, in float64) and ``weight`` =
        ``Σ n_u``, never an individual upload; ``template`` is the aggregator's own upload
        part (the layout and dtypes, and the non-floating tensors, which are not summed). Only a
        sum-based method implements it; the others raise ``NotImplementedError`` (preflight
        refuses them with ``privacy.secagg``)."""
        raise NotImplementedError(f"{self.name} cannot aggregate a masked sum")
