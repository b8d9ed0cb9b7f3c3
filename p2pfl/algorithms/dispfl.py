"""DisPFL: decentralized sparse personalized FL (Dai et al., ICML 2022).

Implements docs/algorithms.md, "DisPFL": each node keeps a personalized
sparse mask (ERK initialisation, density 0.5), trains the masked model, aggregates
element-wise over the neighbours whose mask covers the element and re-applies its own mask;
each round it prunes ``anneal/2·(1+cos(πr/R))`` of its smallest active weights and regrows as
many (by |grad| or at random).

Round ``r`` of node ``i`` (merge-then-train, the default order):

1. its snapshot is the sparse model ``w_i ⊙ m_i`` *with* the mask ``m_i`` (the wire form
   below: only the active values travel, so a pull costs about ``density`` of a dense one);
2. it draws ``peers`` of its live neighbours and pulls their sparse models;
3. **mask-aware average** (:func:`masked_average`): for every masked tensor,
   ``w_i ← m_i ⊙ (Σ_u c_u m_u ⊙ w_u) / (Σ_u c_u m_u)`` over ``u ∈ {i} ∪ pulled``, element by
   element, so an element is averaged only over the models that hold it (``c_u = 1``, or
   ``n_u`` with ``weighted``); dense tensors (biases, norms) are plain averages (the shared
   weighted mean with masks, docs/algorithms.md, "Shared aggregation"; non-floating buffers
   are the node's own);
4. trains with the mask re-applied after every optimizer step (:meth:`DisPFL.step_hook`);
5. **prune and regrow** (:func:`prune_and_regrow`), per masked tensor: drop
   ``⌊f_r · active⌋`` active elements of smallest ``|w|``, with
   ``f_r = anneal/2 · (1 + cos(π r / R))`` (:func:`prune_fraction`; ``R`` = the run's rounds),
   then activate as many inactive elements, those of largest ``|grad|`` (or random ones);
   regrown weights start at 0. Each tensor keeps its number of active elements.

**Reading** (which tensors are sparse). As in DisPFL's code, the weights of convolutional
and linear layers (floating tensors of 2+ dimensions) carry masks; biases and normalisation
parameters stay dense and are averaged over every pulled model.

**Reading** (ERK). Density per tensor ``∝ (Σ dims) / (Π dims)`` (``erk_power_scale``
exponent), scaled so that the masked tensors together hold ``density`` of their elements;
a tensor whose density would exceed 1 is made dense and the rest rescaled (RigL's
Erdős–Rényi-Kernel, as DisPFL uses). Each node draws its own random mask with these
per-tensor densities from its own seed: masks are personalized from round 1.

**Reading** (regrow score). ``|Σ_steps ∇w|``: the sum of the dense mini-batch gradients of
the round's local training (masked elements get gradients too; the mask is applied to the
weights, not to the gradients). DisPFL screens the gradient of the trained model over the
local data; summing the training steps' gradients costs no extra pass. Ties are broken at
random; ``regrow: random`` ignores the gradient.

**Reading** (neighbours). DisPFL lets each client talk to a few random neighbours per round;
``peers`` (default 10) are drawn among the live topology neighbours (None: all of them).
The average is uniform over the models, as DisPFL's code; ``weighted: true`` weights by
the gossiped sample counts.

**Wire form.** For a masked tensor ``k``: ``k:mask`` (the mask, bit-packed, uint8, row-major)
and ``k:values`` (the active values, float32, row-major); other tensors as themselves.
A pulled model is checked against the node's own layout (:func:`decode_sparse`) and dropped
with a reason when malformed: peers are untrusted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel

from p2pfl.algorithms.base import (
    AlgorithmContext,
    State,
    StepHook,
    WholeModelExchange,
    check_keys,
    check_tensor,
    register,
)
from p2pfl.algorithms.cards.dispfl import CARD
from p2pfl.learning.defence import SELECTING_RULES, Combine
from p2pfl.learning.models import SplitModel
from p2pfl.learning.state import weighted_mean

Masks = dict[str, torch.Tensor]  # tensor name -> bool mask of the tensor's shape
MASK_SUFFIX = ":mask"
VALUES_SUFFIX = ":values"


# ----------------------------------------------------------------------------- pure math


def maskable_keys(state: State) -> list[str]:
    """Names of the tensors that carry a mask: floating tensors of 2+ dimensions (conv and
    linear weights), in ``state``'s order."""
    return [k for k, v in state.items() if torch.is_floating_point(v) and v.dim() >= 2]


def erk_densities(
    shapes: dict[str, tuple[int, ...]], density: float, power_scale: float = 1.0
) -> dict[str, float]:
    """Per-tensor densities of the Erdős–Rényi-Kernel distribution whose overall density over
    ``shapes`` is ``density``: ``d_k = ε · ((Σ dims)/(Π dims))^power_scale``, with tensors whose
    ``d_k`` would exceed 1 made dense (and ``ε`` solved again for the others)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if density == 1:
        return {k: 1.0 for k in shapes}
    dense: set[str] = set()
    while True:
        rhs = 0.0
        divisor = 0.0
        raw: dict[str, float] = {}
        for k, shape in shapes.items():
            n = math.prod(shape)
            if k in dense:
                rhs -= n * (1 - density)
            else:
                rhs += n * density
                raw[k] = (sum(shape) / n) ** power_scale
                divisor += raw[k] * n
        if not raw:
            return {k: 1.0 for k in shapes}
        eps = rhs / divisor
        top = max(raw.values())
        if top * eps <= 1:
            break
        dense.update(k for k, p in raw.items() if p == top)
    return {k: 1.0 if k in dense else eps * raw[k] for k in shapes}


def random_masks(
    shapes: dict[str, tuple[int, ...]], densities: dict[str, float], gen: torch.Generator
) -> Masks:
    """For each tensor, a bool mask with exactly ``max(1, round(d_k · numel))`` active
    elements at positions drawn uniformly (``gen``)."""
    masks: Masks = {}
    for k, shape in shapes.items():
        n = math.prod(shape)
        keep = min(n, max(1, round(densities[k] * n)))
        flat = torch.zeros(n, dtype=torch.bool)
        flat[torch.randperm(n, generator=gen)[:keep]] = True
        masks[k] = flat.view(shape)
    return masks


def masked_average(
    models: list[tuple[float, State, Masks]], own_masks: Masks, combine: Combine | None = None
) -> State:
    """The mask-aware average of step 3: for a masked key,
    ``m_own ⊙ (Σ_u c_u m_u ⊙ w_u) / (Σ_u c_u m_u)`` element-wise (0 where no model holds the
    element); for a dense floating key, ``Σ c_u w_u / Σ c_u``; a non-floating key is the
    first model's. ``models`` are ``(c_u, w_u, m_u)`` with the node's own first; every ``m_u``
    has the masked keys of ``own_masks``. The shared weighted mean with masks
    (docs/algorithms.md, "Shared aggregation": float64 accumulation, numerator and
    denominator summed, then divided), then ``m_own ⊙``; returns the first model's dtypes.
    ``combine`` (the node's defence with its names bound; a rule that selects whole
    states) stands in for the weighted mean. Raises ``ValueError`` for no models, a
    negative weight or a non-positive total weight, or models whose layout differs from
    the first's."""
    if not models:
        raise ValueError("masked_average needs at least one model")
    if any(k not in m for _, _, m in models for k in own_masks):
        raise ValueError("masked_average: a model lacks a mask of the node's masked keys")
    masks = [{k: m[k] for k in own_masks} for _, _, m in models]
    states, weights = [s for _, s, _ in models], [c for c, _, _ in models]
    if combine is None:
        out = weighted_mean(states, weights, masks=masks)
    else:
        out = combine(states, weights, masks=masks)
    for key, own in own_masks.items():  # m_own ⊙: exact, the mask is 0 or 1
        if torch.is_floating_point(out[key]):
            out[key] = out[key] * own.to(device=out[key].device, dtype=out[key].dtype)
    return out


def prune_fraction(round_no: int, total_rounds: int, anneal: float) -> float:
    """``f_r = anneal/2 · (1 + cos(π r / R))``: the share of active weights pruned (and
    regrown) after round ``r`` of ``R`` (0 at the last round)."""
    r = min(max(round_no, 0), max(total_rounds, 1))
    return anneal / 2 * (1 + math.cos(math.pi * r / max(total_rounds, 1)))


def prune_and_regrow(
    weights: torch.Tensor,
    mask: torch.Tensor,
    fraction: float,
    gen: torch.Generator,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """One tensor's mask update (step 5). Drops ``k = ⌊fraction · active⌋`` active elements of
    smallest ``|weights|`` and activates ``k`` elements among those inactive after the drop,
    the ones of largest ``|scores|`` (``scores`` None: at random). Ties are broken at random
    (``gen``). Returns the new mask (same count of active elements) and ``k``."""
    flat_mask = mask.reshape(-1).to(torch.bool).cpu()
    active = int(flat_mask.sum())
    k = min(int(math.floor(fraction * active)), active)
    if k <= 0:
        return mask.clone().to(torch.bool), 0
    n = flat_mask.numel()
    jitter = torch.rand(n, generator=gen, dtype=torch.float64) * 1e-12  # random tie-break
    mag = weights.detach().reshape(-1).abs().cpu().to(torch.float64)
    drop_score = torch.where(flat_mask, mag + jitter, torch.full_like(mag, math.inf))
    drop = torch.topk(drop_score, k, largest=False).indices
    new = flat_mask.clone()
    new[drop] = False
    if scores is None:
        grow_score = torch.rand(n, generator=gen, dtype=torch.float64)
    else:
        g = scores.detach().reshape(-1).abs().cpu().to(torch.float64)
        grow_score = g / max(float(g.max()), 1e-300) + jitter
    grow_score = torch.where(new, torch.full_like(grow_score, -math.inf), grow_score)
    grow = torch.topk(grow_score, k, largest=True).indices
    new[grow] = True
    return new.view(mask.shape), k


def encode_sparse(state: State, masks: Masks) -> State:
    """The wire form: ``k:mask`` (bit-packed uint8) and ``k:values`` (active values, float32)
    for each masked ``k``; other tensors as CPU copies."""
    out: State = {}
    for k, v in state.items():
        v = v.detach().to("cpu")
        if k not in masks:
            out[k] = v.clone()
            continue
        m = masks[k].to("cpu").reshape(-1)
        bits = np.packbits(m.numpy().astype(np.uint8))
        out[k + MASK_SUFFIX] = torch.from_numpy(bits)
        out[k + VALUES_SUFFIX] = v.reshape(-1)[m].to(torch.float32).clone()
    return out


def decode_sparse(wire: Any, template: State, masked: list[str]) -> tuple[State, Masks]:
    """A peer's wire form back to ``(dense state, masks)``, checked against ``template`` (the
    node's own state) and the list of masked keys. Raises ``ValueError`` naming the first
    problem: not a map, keys that are not all ``str``, missing or extra keys, a wrong dtype
    or shape, values that do not match the mask's count, non-zero padding bits, or non-finite
    values. The float32 values come back in the template's dtypes."""
    if not isinstance(wire, dict):
        raise ValueError("not a map")
    odd = [type(k).__name__ for k in wire if not isinstance(k, str)]
    if odd:  # e.g. bytes keys, which the codec lets through (and which do not sort with str)
        raise ValueError(f"keys differ ({len(odd)} not str, e.g. a {odd[0]} key)")
    expected = {k for k in template if k not in masked}
    expected |= {k + s for k in masked for s in (MASK_SUFFIX, VALUES_SUFFIX)}
    if set(wire) != expected:
        missing, extra = sorted(expected - set(wire)), sorted(set(wire) - expected)
        raise ValueError(f"keys differ (missing {missing[:3]}, extra {extra[:3]})")
    state: State = {}
    masks: Masks = {}
    for key, ref in template.items():
        if key not in masked:
            t = wire[key]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"{key}: expected a tensor of shape {tuple(ref.shape)}")
            if torch.is_floating_point(ref):
                if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{key}: expected finite float32 values")
                t = t.to(ref.dtype)  # as the masked values below (a no-op for float32 models)
            elif t.dtype != ref.dtype:
                raise ValueError(f"{key}: dtype {t.dtype}, expected {ref.dtype}")
            state[key] = t
            continue
        bits, values = wire[key + MASK_SUFFIX], wire[key + VALUES_SUFFIX]
        n = ref.numel()
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or bits.dim() != 1:
            raise ValueError(f"{key}{MASK_SUFFIX}: expected a 1-D uint8 tensor")
        if bits.numel() != (n + 7) // 8:
            raise ValueError(f"{key}{MASK_SUFFIX}: {bits.numel()} bytes, expected {(n + 7) // 8}")
        unpacked = np.unpackbits(bits.numpy())
        if unpacked[n:].any():
            raise ValueError(f"{key}{MASK_SUFFIX}: padding bits are set")
        m = torch.from_numpy(unpacked[:n].astype(bool))
        if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
            raise ValueError(f"{key}{VALUES_SUFFIX}: expected float32 values")
        if values.dim() != 1 or values.numel() != int(m.sum()):
            raise ValueError(
                f"{key}{VALUES_SUFFIX}: {values.numel()} values for {int(m.sum())} active elements"
            )
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{key}{VALUES_SUFFIX}: not finite")
        dense = torch.zeros(n, dtype=ref.dtype)
        dense[m] = values.to(ref.dtype)
        state[key] = dense.view(ref.shape)
        masks[key] = m.view(ref.shape)
    return state, masks


def mask_overlap(a: Masks, b: Masks) -> float:
    """Intersection over union of two nodes' active elements, over every masked tensor."""
    inter = sum(int((a[k] & b[k]).sum()) for k in a)
    union = sum(int((a[k] | b[k]).sum()) for k in a)
    return inter / union if union else 1.0


# ----------------------------------------------------------------------------- the method


@register
class DisPFL(WholeModelExchange):
    name = CARD.name
    shares = CARD.shares
    defences = ("mean", *SELECTING_RULES)  # the masked mean: whole states only
    Params = CARD.Params

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        own = self.model_state()
        self.masked = maskable_keys(own)
        shapes = {k: tuple(own[k].shape) for k in self.masked}
        self.densities = erk_densities(shapes, self.params.density, self.params.erk_power_scale)
        self._gen = torch.Generator().manual_seed(int(ctx.rng.integers(2**62)))
        self.masks: Masks = random_masks(shapes, self.densities, self._gen)  # CPU, bool
        self._dev_masks = {k: m.to(ctx.device) for k, m in self.masks.items()}
        self._grad_sum: dict[str, torch.Tensor] = {}
        self.round_no = 0
        self.total_rounds = 1  # the driver sets the run's rounds
        self._apply_own_masks()

    def _apply_own_masks(self) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k in self.masked:
                params[k].mul_(self._dev_masks[k])

    @classmethod
    def update_dp_problem(cls, params: BaseModel) -> tuple[str, str] | None:
        """``regrow: grad`` picks the mask the node serves by its raw gradients."""
        if getattr(params, "regrow", None) != "grad":
            return None
        why = (
            "grad regrows the mask the node serves by the raw gradients of its local "
            "training, which update-level noise does not cover; use regrow: random under "
            "privacy.dp.level: update"
        )
        return ("algorithm.params.regrow", why)

    # -- what peers pull -----------------------------------------------------------------
    def snapshot(self) -> State:
        """The sparse model with its mask, in the wire form (:func:`encode_sparse`)."""
        return encode_sparse(self.model_state(), self.masks)

    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """Step 3: the mask-aware average over this node and the valid pulled models."""
        own = self.model_state()
        models: list[tuple[float, State, Masks]] = [(self.own_weight(), own, self.masks)]
        merged_from: list[str] = []
        rejected: dict[str, str] = {}
        overlaps: list[float] = []
        for peer in sorted(pulled):
            w = self.peer_weight(gossip.get(peer))
            try:
                if w is None:
                    raise ValueError("no usable sample count")
                state, masks = decode_sparse(pulled[peer], own, self.masked)
            except ValueError as exc:
                rejected[peer] = str(exc)
                continue
            models.append((w, state, masks))
            merged_from.append(peer)
            overlaps.append(mask_overlap(self.masks, masks))
        defence = self.ctx.defence
        who = [self.ctx.node_id, *merged_from]
        new = masked_average(
            models,
            self.masks,
            lambda states, w, masks: defence.combine(states, w, who=who, own=0, masks=masks),
        )
        self.model.load_state_dict(new)
        merged_from = [p for p in merged_from if p not in defence.rejected]
        facts: dict[str, Any] = {"merged_from": merged_from}
        if overlaps:
            facts["mask_overlap"] = round(float(np.mean(overlaps)), 4)
        if rejected:
            facts["rejected"] = rejected
        return facts

    # -- local training ------------------------------------------------------------------
    def step_hook(self) -> StepHook:
        """After every optimizer step: add the dense gradients to the round's sum (the regrow
        score) and re-apply the mask to the weights."""
        track, grad_sum, masks = self.params.regrow == "grad", self._grad_sum, self._dev_masks
        params = dict(self.model.named_parameters())  # once per round, not once per step
        masked = [(k, params[k]) for k in self.masked]

        def hook(model: SplitModel) -> None:
            with torch.no_grad():
                for k, p in masked:
                    if track and p.grad is not None:
                        if k in grad_sum:
                            grad_sum[k].add_(p.grad)
                        else:
                            grad_sum[k] = p.grad.detach().clone()
                    p.mul_(masks[k])

        return hook

    def after_train(self) -> dict[str, Any]:
        """Step 5: prune ``f_r`` of each tensor's active weights and regrow as many; returns
        the fraction, how many elements moved and the resulting density (logged)."""
        self.round_no += 1
        fraction = prune_fraction(self.round_no, self.total_rounds, self.params.anneal)
        params = dict(self.model.named_parameters())
        changed = 0
        for k in self.masked:
            scores = self._grad_sum.get(k) if self.params.regrow == "grad" else None
            new, moved = prune_and_regrow(params[k], self.masks[k], fraction, self._gen, scores)
            changed += moved
            self.masks[k] = new
            self._dev_masks[k] = new.to(self.ctx.device)
        self._grad_sum.clear()
        self._apply_own_masks()  # pruned weights go to 0; regrown ones start at 0
        return {
            "prune_fraction": round(fraction, 6),
            "regrown": changed,
            "density": round(self.density(), 6),
        }

    def density(self) -> float:
        """The share of active elements over the masked tensors."""
        active = sum(int(m.sum()) for m in self.masks.values())
        return active / max(1, sum(m.numel() for m in self.masks.values()))

    # -- checkpoints ---------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """The personal masks (bool, CPU), the state of the generator that breaks ties and
        draws random regrowth (``torch.Generator.get_state()``, a uint8 tensor), the rounds
        done (the annealing step ``r``) and the gradient sums of a round in progress (empty
        between rounds)."""
        return {
            "masks": {k: m.clone() for k, m in self.masks.items()},
            "gen": self._gen.get_state(),
            "round_no": self.round_no,
            "grad_sum": {k: g.detach().to("cpu", copy=True) for k, g in self._grad_sum.items()},
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        extra = check_keys(
            extra, ("masks", "gen", "round_no", "grad_sum"), "dispfl checkpoint extra"
        )
        masks = check_keys(extra["masks"], self.masked, "dispfl checkpoint masks")
        for k, m in masks.items():
            check_tensor(m, self.masks[k], f"dispfl checkpoint mask {k!r}")
            active, expected = int(m.sum()), int(self.masks[k].sum())
            if active != expected:  # the count is fixed by the density (ERK), whatever r is
                raise ValueError(
                    f"dispfl checkpoint mask {k!r}: {active} active elements, expected "
                    f"{expected} (another density?)"
                )
        gen_state = check_tensor(extra["gen"], self._gen.get_state(), "dispfl checkpoint gen")
        gen = torch.Generator()
        try:
            gen.set_state(gen_state)
        except RuntimeError as exc:
            raise ValueError(f"dispfl checkpoint gen: {exc}") from None
        round_no = extra["round_no"]
        if isinstance(round_no, bool) or not isinstance(round_no, int) or round_no < 0:
            raise ValueError(f"dispfl checkpoint round_no: {round_no!r} is not an int >= 0")
        grad_sum = extra["grad_sum"]
        if not isinstance(grad_sum, dict):
            raise ValueError("dispfl checkpoint grad_sum: expected a map")
        params = dict(self.model.named_parameters())
        for k, g in grad_sum.items():
            if k not in self.masks:
                raise ValueError(f"dispfl checkpoint grad_sum: {k!r} is not a masked tensor")
            check_tensor(g, params[k].detach(), f"dispfl checkpoint grad_sum {k!r}")
        for k, m in masks.items():  # in place: the maps a step hook holds stay current
            self.masks[k] = m.clone()
            self._dev_masks[k] = self.masks[k].to(self.ctx.device)
        self._gen = gen
        self.round_no = round_no
        self._grad_sum.clear()
        self._grad_sum.update({k: g.to(self.ctx.device, copy=True) for k, g in grad_sum.items()})
