"""One node's attacks as a wrapper around what it serves and how it trains.

The node calls an :class:`Adversary` at a handful of points and otherwise runs the honest
code paths of its method: :meth:`Adversary.outgoing` on every state it serves (a snapshot
part or an upload, ``"model"``; an aggregate it serves as the round's aggregator,
``"result"``), :meth:`Adversary.train_labels` on every training batch's labels,
:meth:`Adversary.claimed_samples` on the sample count it reports, :meth:`Adversary.serve_delay`
before serving a pull (the node sleeps; this object only returns the seconds), and
:meth:`Adversary.remember` with the states it pulled or received from peers, which the
omniscient-style attacks (ALIE, IPM, free riding) build on. Everything here is pure: no
I/O, no sleeping, randomness only from generators seeded by ``(seed, node, round)``.

The maths is :mod:`p2pfl.attacks.transforms`'s, with the papers cited there (Baruch et al.
2019; Xie et al. 2020; Fang et al. 2020; Blanchard et al. 2017).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from p2pfl.attacks import transforms
from p2pfl.config.schema import AttackSpec, TopologyConfig
from p2pfl.learning.state import State

POISON_KINDS = ("sign_flip", "scale", "noise", "nan", "alie", "ipm", "free_rider")
"""The kinds :meth:`Adversary.outgoing` applies to a served state; the other kinds
(``label_flip``, ``inflate_n``, ``delay``) act through the other hooks."""

WHAT = ("model", "result")


class Adversary:
    """The attacks of one node (``specs``, in the topology's order), applied by round.

    ``num_classes`` is the swarm's label space (for ``label_flip``), ``seed`` the swarm's
    seed (for ``noise``). ``ValueError`` when a ``label_flip`` names a class outside
    ``[0, num_classes)``."""

    def __init__(self, specs: Sequence[AttackSpec], node_id: str, num_classes: int, seed: int):
        if num_classes < 1:
            raise ValueError(f"attacks: num_classes must be at least 1, got {num_classes}")
        for spec in specs:
            if spec.kind != "label_flip" or spec.source is None:
                continue
            for name, c in (("source", spec.source), ("target", spec.target)):
                if c is not None and not 0 <= c < num_classes:
                    raise ValueError(
                        f"attack label_flip on {node_id}: {name} {c} outside [0, {num_classes})"
                    )
        self.specs: list[AttackSpec] = list(specs)
        self.node_id = node_id
        self.num_classes = num_classes
        self.seed = seed
        self._round: int | None = None  # the round of the remembered peer states
        self._peers: dict[str, State] = {}

    @classmethod
    def for_node(cls, cfg: TopologyConfig, node_id: str, num_classes: int) -> Adversary | None:
        """The adversary of ``node_id`` under ``cfg.attacks`` (:meth:`TopologyConfig.attackers`,
        the same set on every node), or None when the node attacks nothing."""
        specs = cfg.attackers().get(node_id)
        if not specs:
            return None
        return cls(specs, node_id, num_classes, cfg.seed)

    # ------------------------------------------------------------------------- round window

    def active(self, round_no: int) -> list[AttackSpec]:
        """The specs whose window holds ``round_no`` (``from_round ≤ r ≤ to_round``; no
        ``to_round``: to the end of the run), in spec order."""
        return [s for s in self.specs if _in_window(s, round_no)]

    def describe(self, round_no: int) -> list[str]:
        """The kinds active in ``round_no``, in spec order, each once (``[]`` when none): the
        round record's ``attack`` field."""
        out: list[str] = []
        for s in self.active(round_no):
            if s.kind not in out:
                out.append(s.kind)
        return out

    # ------------------------------------------------------------------------- what it saw

    def remember(self, round_no: int, states: Mapping[str, State]) -> None:
        """Record the states this node pulled or received from peers in ``round_no``, by peer
        id. Only the latest round is kept: a later round replaces what was remembered, the
        same round adds to it (a peer given twice: the later state), an earlier round is
        ignored. The states are kept by reference, never copied nor mutated; the node's own
        id is left out (its own state is passed to :meth:`outgoing`)."""
        if self._round is not None and round_no < self._round:
            return
        if self._round is None or round_no > self._round:
            self._round, self._peers = round_no, {}
        for peer, state in states.items():
            if peer != self.node_id:
                self._peers[peer] = state

    # ------------------------------------------------------------------------- what it serves

    def outgoing(self, state: State, round_no: int, what: str) -> State:
        """The state to serve instead of ``state``: each active spec of a poisoning kind
        (:data:`POISON_KINDS`) whose ``corrupts`` covers ``what`` (``"model"`` or ``"result"``;
        ``corrupts: both`` covers both), applied in spec order, each to the previous one's output.

        - ``sign_flip``, ``scale`` (``factor``), ``nan``: :mod:`~p2pfl.attacks.transforms`.
        - ``noise`` (``sigma``): the state replaced by Gaussian draws from a generator seeded
          with a CRC-32 of ``(seed, node, round, what, spec position)``, so a rerun serves the
          same values and every round different ones.
        - ``alie`` (``z``; default :func:`~p2pfl.attacks.transforms.alie_z` with
          ``n = benign states + 1``, ``f = 1``) and ``ipm`` (``epsilon``): over the *benign
          states* of each tensor, the node's own (the attacker knows its honest model) and
          those of the latest remembered round that hold the tensor's name with its shape and
          only finite values. Tensors are grouped by which peers match, so a peer that sent
          only part of the model still counts for that part. With no peer matching, the own
          state alone: ALIE then serves it unchanged (``σ = 0``), IPM ``−ε·w``.
        - ``free_rider``: each tensor the plain float64 mean of the matching remembered peer
          tensors (the own tensor when none), cast back: the node serves what others trained
          and never its own training.

        Non-floating tensors are always the own state's. The input is never mutated; when no
        spec applies, the very ``state`` object is returned. ``ValueError`` for another
        ``what``."""
        if what not in WHAT:
            raise ValueError(f"outgoing: what must be 'model' or 'result', got {what!r}")
        out = state
        for i, spec in enumerate(self.specs):
            if spec.kind not in POISON_KINDS or not _in_window(spec, round_no):
                continue
            if spec.corrupts != "both" and spec.corrupts != what:
                continue
            out = self._apply(spec, out, round_no, what, i)
        return out

    def _apply(self, spec: AttackSpec, state: State, round_no: int, what: str, i: int) -> State:
        if spec.kind == "sign_flip":
            return transforms.sign_flip(state)
        if spec.kind == "scale":
            return transforms.scale(state, spec.factor)
        if spec.kind == "nan":
            return transforms.nan_state(state)
        if spec.kind == "noise":
            return transforms.gaussian_noise(state, spec.sigma, self._generator(round_no, what, i))
        out: State = {k: t.detach().clone() for k, t in state.items()}
        for keys, peers in self._groups(state):
            own = {k: state[k] for k in keys}
            others = [{k: p[k] for k in keys} for p in peers]
            if spec.kind == "alie":
                z = spec.z if spec.z is not None else transforms.alie_z(len(others) + 2, 1)
                out.update(transforms.alie([own, *others], z))
            elif spec.kind == "ipm":
                out.update(transforms.ipm([own, *others], spec.epsilon))
            elif others:  # free_rider
                out.update(_mean(others, own))
        return out

    def _generator(self, round_no: int, what: str, i: int) -> torch.Generator:
        key = f"noise:{self.seed}:{self.node_id}:{round_no}:{what}:{i}"
        return torch.Generator().manual_seed(zlib.crc32(key.encode("utf-8")))

    def _groups(self, state: State) -> list[tuple[list[str], list[State]]]:
        """The floating keys of ``state`` grouped by the remembered peers (sorted by id) whose
        state holds the key with its shape and only finite values: ``(keys, peer states)``."""
        by_peers: dict[tuple[str, ...], list[str]] = {}
        for k, t in state.items():
            if not torch.is_floating_point(t):
                continue
            match = tuple(p for p in sorted(self._peers) if _usable(self._peers[p].get(k), t))
            by_peers.setdefault(match, []).append(k)
        return [(keys, [self._peers[p] for p in peers]) for peers, keys in by_peers.items()]

    # ------------------------------------------------------------------------- other hooks

    def claimed_samples(self, n: int, round_no: int) -> int:
        """The sample count to report: the ``claim`` of the last active ``inflate_n`` spec, or
        ``n`` when none is active."""
        for spec in reversed(self.active(round_no)):
            if spec.kind == "inflate_n":
                return spec.claim
        return n

    def serve_delay(self, round_no: int) -> float:
        """Seconds to wait before serving a pull: the sum of the active ``delay`` specs'
        ``delay_s`` (0.0 when none)."""
        return float(sum(s.delay_s for s in self.active(round_no) if s.kind == "delay"))

    def train_labels(self, y: torch.Tensor, round_no: int) -> torch.Tensor:
        """The labels to train on: ``y`` flipped by each active ``label_flip`` spec in order
        (:func:`~p2pfl.attacks.transforms.flip_labels`, a new tensor), or ``y`` itself (the
        same object) when none is active."""
        for spec in self.active(round_no):
            if spec.kind == "label_flip":
                y = transforms.flip_labels(y, self.num_classes, spec.source, spec.target)
        return y


def _in_window(spec: AttackSpec, round_no: int) -> bool:
    return spec.from_round <= round_no and (spec.to_round is None or round_no <= spec.to_round)


def _usable(peer: object, own: torch.Tensor) -> bool:
    """A peer tensor an attack may build on: a floating tensor of ``own``'s shape, all finite."""
    return (
        isinstance(peer, torch.Tensor)
        and torch.is_floating_point(peer)
        and peer.shape == own.shape
        and bool(torch.isfinite(peer).all())
    )


def _mean(states: Sequence[State], like: State) -> State:
    """The plain mean of ``states`` per key of ``like``, in float64, cast to ``like``'s dtype
    and device."""
    out: State = {}
    for k, ref in like.items():
        x = torch.stack([s[k].detach().to(device=ref.device, dtype=torch.float64) for s in states])
        out[k] = x.mean(dim=0).to(ref.dtype)
    return out
