"""A node's checkpoint: what a restarted daemon needs to go on from the round it finished
(docs/architecture.md, "Checkpoints and resume").

After every round a node writes ``<run>/nodes/<id>.ckpt`` (atomically: a reader, or a crash,
never sees half a file): its method's :meth:`~p2pfl.algorithms.base.Method.checkpoint`
(the model and what the method keeps between rounds), the state of the node's random
generator, its kept optimizer (``training.optimizer_state: keep``), the round, and a fingerprint of the configuration that shaped them. A daemon
started again on the same run directory restores it and rejoins the swarm's current round
(:mod:`p2pfl.rounds.gossip.decentralized`, :mod:`p2pfl.rounds.rotation.centralized`). A checkpoint of another
node, swarm or configuration is refused with a message, never loaded.

The file is the wire's own codec (msgpack and raw tensors, :mod:`p2pfl.wire.codec`): no
pickle, even on the node's own disk.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.config.schema import TopologyConfig
from p2pfl.errors import P2PFLError
from p2pfl.files import write_bytes_atomic
from p2pfl.wire.codec import CodecError, decode, encode

FORMAT = "p2pfl-checkpoint/1"


class CheckpointError(P2PFLError, ValueError):
    """A checkpoint that cannot be used: unreadable, corrupt, or of another run."""


def checkpoint_path(run_dir: Path, node_id: str) -> Path:
    return Path(run_dir) / "nodes" / f"{node_id}.ckpt"


# the latest configs' fingerprints, by identity (each config held, so its id is not reused):
# every node of a process checkpoints every round under the one config it was started with
_FINGERPRINTS: OrderedDict[int, tuple[TopologyConfig, str]] = OrderedDict()
_FINGERPRINTS_KEPT = 4


def config_fingerprint(cfg: TopologyConfig) -> str:
    """A digest of what shapes a node's model and method state: the swarm, its nodes and
    edges, the dataset and its partition, the model, the method and its knobs, training,
    rounds and seed. Where the broker is, the data's folder, the code's folder, certificates
    and timeouts may change between a crash and a restart. Computed once per config object (a config is not
    changed once loaded: a changed one is a copy), as every node checkpoints every round."""
    hit = _FINGERPRINTS.get(id(cfg))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    digest = _fingerprint(cfg)
    _FINGERPRINTS[id(cfg)] = (cfg, digest)
    while len(_FINGERPRINTS) > _FINGERPRINTS_KEPT:
        _FINGERPRINTS.popitem(last=False)
    return digest


def _fingerprint(cfg: TopologyConfig) -> str:
    data = cfg.dump()
    for name in ("broker", "timing", "security", "code_dir"):
        data.pop(name, None)
    data.get("dataset", {}).pop("root", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """The generator's state with its (128-bit) integers as strings: msgpack stops at 64."""

    def conv(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        return v

    return conv(rng.bit_generator.state)


def _set_rng_state(rng: np.random.Generator, state: Any) -> None:
    def conv(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, str) and v.lstrip("-").isdigit():
            return int(v)
        return v

    if (
        not isinstance(state, dict)
        or state.get("bit_generator") != type(rng.bit_generator).__name__
    ):
        raise CheckpointError("the random generator's state is missing or of another kind")
    try:
        rng.bit_generator.state = conv(state)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"bad random generator state: {exc}") from None


@dataclass
class Checkpoint:
    """One node's state after ``round``."""

    node: str
    swarm: str
    fingerprint: str
    round: int
    method: dict[str, Any]
    rng: dict[str, Any]
    # ``privacy.dp``: the node's accountant (NodePrivacy.state); None, and absent from the
    # file, without it
    privacy: dict[str, Any] | None = None
    # ``training.optimizer_state: keep``: the node's optimizer (KeptOptimizer.state); None,
    # and absent from the file, otherwise
    optimizer: dict[str, Any] | None = None

    @classmethod
    def take(cls, cfg: TopologyConfig, node_id: str, round_no: int, method: Any, rng: Any):
        """The checkpoint of ``method`` and ``rng`` after round ``round_no``."""
        return cls(
            node=node_id,
            swarm=cfg.name,
            fingerprint=config_fingerprint(cfg),
            round=round_no,
            method=method.checkpoint(),
            rng=_rng_state(rng),
        )

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {
            "format": FORMAT,
            "node": self.node,
            "swarm": self.swarm,
            "fingerprint": self.fingerprint,
            "round": self.round,
            "method": self.method,
            "rng": self.rng,
        }
        if self.privacy is not None:
            obj["privacy"] = self.privacy
        if self.optimizer is not None:
            obj["optimizer"] = self.optimizer
        return encode(obj)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "checkpoint") -> Checkpoint:
        """Decode and check the fields (not whose it is: see :meth:`check_for`)."""
        try:
            obj = decode(data, max_size=len(data))
        except CodecError as exc:
            raise CheckpointError(f"{where}: not a readable checkpoint: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a {FORMAT} file")
        fields = {"node": str, "swarm": str, "fingerprint": str, "round": int}
        for name, kind in fields.items():
            if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
                raise CheckpointError(f"{where}: field {name!r} is missing or malformed")
        if obj["round"] < 1 or not isinstance(obj.get("method"), dict):
            raise CheckpointError(f"{where}: field 'round' or 'method' is malformed")
        return cls(
            node=obj["node"],
            swarm=obj["swarm"],
            fingerprint=obj["fingerprint"],
            round=obj["round"],
            method=obj["method"],
            rng=obj.get("rng") if isinstance(obj.get("rng"), dict) else {},
            privacy=obj.get("privacy"),
            optimizer=obj.get("optimizer") if isinstance(obj.get("optimizer"), dict) else None,
        )

    def check_for(self, cfg: TopologyConfig, node_id: str, where: str) -> None:
        """Raise :class:`CheckpointError` unless this checkpoint is ``node_id``'s in this
        swarm, under the same configuration."""
        if self.node != node_id or self.swarm != cfg.name:
            raise CheckpointError(
                f"{where}: checkpoint of node {self.node!r} in swarm {self.swarm!r}, "
                f"not {node_id!r} in {cfg.name!r}"
            )
        if self.fingerprint != config_fingerprint(cfg):
            raise CheckpointError(
                f"{where}: written under another configuration (model, data, method or "
                "rounds changed); use another run directory, or start with --fresh"
            )
        if self.round > cfg.rounds:
            raise CheckpointError(f"{where}: round {self.round} is past the run's {cfg.rounds}")

    def restore(self, method: Any, rng: np.random.Generator, where: str) -> None:
        """Load the method's state and the generator's into a freshly built node."""
        try:
            method.restore(self.method)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        _set_rng_state(rng, self.rng)


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` atomically and durably (fsync); ``OSError`` when the disk refuses."""
    write_bytes_atomic(path, ckpt.to_bytes(), fsync=True)


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path``, None when there is none; :class:`CheckpointError` when
    the file is there but unusable."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    return Checkpoint.from_bytes(data, str(path))
