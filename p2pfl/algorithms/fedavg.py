"""FedAvg: the sample-weighted mean of the participants' whole models.

Implements docs/algorithms.md, "FedAvg": the round's aggregator computes
``w ← Σ n_i w_i / Σ n_i`` over the uploads that arrived and sends it to all.

- Floating tensors are averaged in float64 and cast back to their own dtype.
- **Reading** (non-floating tensors, e.g. BatchNorm's ``num_batches_tracked``): a mean of
  counters is meaningless, so they are taken from the upload with the largest weight (the
  first of those in sorted node order on a tie).
- The one global model is both :attr:`Aggregate.common` and every uploader's entry in
  :attr:`Aggregate.results` (the same object, so the driver packs it once).

:func:`weighted_mean_states` and :func:`fedavg_aggregate` are reused by FedPer and CriticalFL.
"""

from __future__ import annotations

from typing import Any

import torch

from p2pfl.algorithms.base import (
    Aggregate,
    CentralizedAlgorithm,
    State,
    Upload,
    register,
)
from p2pfl.learning.state import part_keys

# ----------------------------------------------------------------------------- pure math


def weighted_mean_states(states: list[State], weights: list[float]) -> State:
    """``Σ n_i s_i / Σ n_i`` per key, over states with identical keys and shapes.

    Floating tensors are accumulated in float64 and cast back to their original dtype;
    non-floating tensors take the value of the state with the largest weight (the first one on
    a tie). The result lives on the device of the first state.

    Raises ``ValueError`` on an empty input, a length mismatch between ``states`` and
    ``weights``, differing keys, shapes or dtypes, or a non-positive (or non-finite) total
    weight."""
    if not states:
        raise ValueError("weighted_mean_states needs at least one state")
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} states but {len(weights)} weights")
    w = [float(x) for x in weights]
    if any(x != x or x < 0 for x in w):  # NaN or negative
        raise ValueError("weights must be non-negative numbers")
    total = sum(w)
    if not (total > 0) or total == float("inf"):
        raise ValueError("weights must sum to a positive finite number")
    first = states[0]
    keys = list(first)
    for i, state in enumerate(states[1:], start=1):
        if set(state) != set(first):
            missing, extra = set(first) - set(state), set(state) - set(first)
            raise ValueError(
                f"state {i}: keys differ (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
            )
        for k in keys:
            a, b = first[k], state[k]
            if not isinstance(b, torch.Tensor) or b.shape != a.shape or b.dtype != a.dtype:
                raise ValueError(f"state {i}: tensor {k!r} differs in type, shape or dtype")
    heaviest = max(range(len(w)), key=lambda i: (w[i], -i))
    out: State = {}
    for k in keys:
        ref = first[k]
        if not torch.is_floating_point(ref):
            out[k] = states[heaviest][k].detach().to(ref.device, copy=True)
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for wi, state in zip(w, states, strict=True):
            if wi:
                acc += (wi / total) * state[k].detach().to(device=ref.device, dtype=torch.float64)
        out[k] = acc.to(ref.dtype)
    return out


def fedavg_aggregate(uploads: dict[str, Upload], part: str = "all") -> tuple[State, int]:
    """The sample-weighted mean of the ``part`` (``g``, ``h``, ``all``) of every upload, in
    sorted node order, and the total sample count. Raises ``ValueError`` as
    :func:`weighted_mean_states` does (no uploads, mismatched states)."""
    peers = sorted(uploads)
    states = []
    for p in peers:
        state = uploads[p].state
        states.append({k: state[k] for k in part_keys(list(state), part)})
    weights = [float(uploads[p].n) for p in peers]
    return weighted_mean_states(states, weights), int(sum(uploads[p].n for p in peers))


def check_received(model_keys: list[str], received: State, model_state: State, part: str) -> None:
    """Raise ``ValueError`` unless ``received`` holds exactly the model's ``part`` keys with
    the model's shapes (what a peer sent is untrusted)."""
    expected = set(part_keys(model_keys, part))
    got = set(received)
    if got != expected:
        missing, extra = expected - got, got - expected
        raise ValueError(
            f"received state does not match part {part!r} "
            f"(missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
        )
    for k in got:
        v = received[k]
        if not isinstance(v, torch.Tensor) or v.shape != model_state[k].shape:
            raise ValueError(f"received tensor {k!r} does not match the model")


# ----------------------------------------------------------------------------- the method


@register
class FedAvg(CentralizedAlgorithm):
    name = "fedavg"
    upload_part = "all"

    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """``w ← Σ n_i w_i / Σ n_i``; the same global model for every uploader and as
        ``common``. No server state."""
        glob, total = fedavg_aggregate(uploads, self.upload_part)
        return Aggregate(
            results=dict.fromkeys(uploads, glob),
            common=glob,
            server={},
            facts={"aggregated_n": total},
        )

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Install the received part (``upload_part``) into the model. Tensors are copied into
        the existing parameters and buffers, which moves them to the model's device and
        dtype. Raises ``ValueError`` if the keys or shapes do not match the model."""
        own = self.model.state_dict()
        check_received(list(own), received, own, self.upload_part)
        strict = self.upload_part == "all"
        self.model.load_state_dict(received, strict=strict)
        return {}
