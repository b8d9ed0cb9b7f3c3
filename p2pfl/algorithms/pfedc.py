"""pFedC: conflict-aware personalized FL with task-wise disentangled classifier heads.

Implements docs/algorithms.md, "pFedC" ("Disentangled Knowledge Transfer: A New Perspective for
Personalized Federated Learning"), a centralized method run by the rotating aggregator
(:mod:`p2pfl.rounds.rotation.centralized`):

- model: the shared representation ``φ`` (every layer but the last) and ``T`` heads
  ``ω^1..ω^T`` replacing the last fully connected layer (:class:`MultiHead`, installed by
  :meth:`PFedC.adapt_model`). ``groups: null`` gives ``T = C`` binary heads "is class c"
  (sigmoid / BCE); ``groups: [[...], ...]`` (a partition of the classes, e.g. CIFAR-100's
  20 superclasses) gives one softmax classifier per group;
- ``π_i``: node ``i``'s 0/1 vector of the tasks it holds, from its training labels
  (:meth:`PFedC.set_labels`), sent with every upload (:meth:`PFedC.report`);
- local training: ``Σ_t λ_t L_t(φ, ω^t)`` over the tasks the node holds, ``λ`` from MGDA-UB
  (Sener & Koltun 2018: the min-norm point of the convex hull of the task gradients w.r.t.
  the shared representation ``Z``, by Frank–Wolfe, :func:`min_norm_weights`) or equal;
- server (Eq. 6, 7): ``φ ← Σ n_i φ_i / Σ n_i``; for each node ``i`` and task ``t`` with
  ``π_i^t = 1``: ``ω_i^t ←`` mean of ``ω_n^t`` over the nodes ``n`` with ``π_n^t = 1``
  (:func:`pfedc_aggregate`); the heads of tasks a node lacks stay its own.

**Reading** (binary task loss): Eq. (3) writes ``L_c`` as a mean over the node's ``D_i^c``
samples of class ``c``; taken literally a binary "is class c" head would see positives only
and learn the constant "yes". Each sample is re-labelled ``(x, ŷ^1..ŷ^C)`` (§3.2), so binary
head ``t`` is trained with BCE-with-logits on the whole batch against ``1[y = c_t]``; ``D_i^c``
decides only whether the task is held (``π_i^c = 1``).

**Reading** (tasks the node lacks, ``π_i^t = 0``): not in the local loss. ``L_c`` is undefined
when ``D_i^c = 0``, Eq. (7) keeps such heads as they are, and Algorithm 2 masks them out of
the upload (``ω_i · Π_i``): they are neither trained nor shared, so they get no gradient.
``train_absent: true`` (not the paper) also trains absent *binary* heads, on negatives only.

**Reading** (group heads, ``T < C``): head ``t`` is a softmax classifier over its group's
classes, trained with cross-entropy on the batch samples whose label is in the group (skipped
in a batch that has none). The paper measures accuracy *within* each task (the task of a test
sample known); this daemon predicts one class by ``argmax`` over ``C`` scores, so
:class:`MultiHead` returns each group's **log-softmax placed at its classes**: the class with
the highest within-group probability wins across groups. Evaluation's cross-entropy on these
scores is the within-group cross-entropy plus ``log T``.

**Reading** (combined scores, binary heads): the ``C`` scores are the per-class logits; argmax
is the prediction and evaluation's cross-entropy is a softmax over those logits.

**Reading** (prediction): a node predicts among the tasks it holds; the classes of the others
score :data:`ABSENT_SCORE`. Its test split follows its own label distribution, the paper
scores each task separately, and a lacked head is never trained here nor shared with the node:
its untrained logit competing in the argmax only adds errors (measured on the 8-node
Fashion-MNIST demo: 0.72 mean accuracy with it; README.md, "Results", has the run without it).

**Reading** (presence): task ``t`` is held when the node has at least ``presence_min`` training
samples of its class(es) (default 1, the paper's "label c exists").

**Reading** (head mean): Eq. (7) is the plain mean over the holders (``1 / Σ_n m_{i,n}^c``);
the appendix's Eq. (13) weights by ``p_n``; the main text is used. A head whose only holder is
the node itself is not sent back to it (it already has it), nor any head it lacks.

**Reading** (MGDA-UB): gradients are taken w.r.t. the batch tensor fed to the heads, flattened
(``B·D`` entries per task) and divided by ``L_t·‖g_t‖`` (``mgda_normalization: loss+``, the
normalisation of Sener & Koltun's code; ``none``, ``l2`` and ``loss`` are knobs); Frank–Wolfe
starts from the best pair of tasks, as in their solver, and uses the exact line search between
two points. ``λ`` is detached. As in their Algorithm 2 the shared layers step along
``Σ_t λ_t ∇L_t`` and each head along its own ``∇L_t`` (:func:`make_loss`). Measured on one
Fashion-MNIST node (10 binary heads, 3 epochs): unnormalised min-norm weights scaling the
heads too left the model at 0.26 accuracy; heads on their own gradient 0.55; with ``loss+``
0.79 and ``l2`` 0.81 (plain cross-entropy: 0.77). The logged task loss is the mean of the
``L_t`` in the batch's loss.

**Reading** (contract): the daemon calls :meth:`PFedC.set_labels` once with the training
labels (until then every task counts as held). :meth:`PFedC.check_report` is an instance
method, since ``T`` depends on the configured groups and the class count; a report whose ``π``
is still malformed at the aggregator counts as "holds nothing" (its ``φ`` is averaged, its
heads neither shared nor replaced; ``facts["bad_pi"]``).

**Reading** (initial heads): the heads are cut from the original last layer (binary head ``c``
= its row ``c``; group head = its group's rows), so the adapted model starts with the same
scores as the original (binary) and draws nothing from the RNG.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from p2pfl.algorithms.base import (
    Aggregate,
    AlgorithmContext,
    CentralizedAlgorithm,
    LossFn,
    State,
    Upload,
    peer_state_mismatch,
    register,
)
from p2pfl.algorithms.cards.pfedc import CARD, PFedCParams
from p2pfl.learning.defence import Defence
from p2pfl.learning.models import SplitModel
from p2pfl.learning.state import weighted_mean

# ----------------------------------------------------------------------------- tasks


def validate_groups(groups: Sequence[Sequence[int]] | None, num_classes: int) -> list[list[int]]:
    """The task groups: ``[[0], [1], ..., [C-1]]`` for ``None`` (binary heads), else
    ``groups`` checked to be a partition of ``range(num_classes)`` into non-empty groups.
    Raises ``ValueError`` naming what is wrong."""
    if groups is None:
        return [[c] for c in range(num_classes)]
    out = [[int(c) for c in g] for g in groups]
    if not out:
        raise ValueError("pfedc: groups must hold at least one group")
    seen: dict[int, int] = {}
    for t, g in enumerate(out):
        if not g:
            raise ValueError(f"pfedc: group {t} is empty")
        for c in g:
            if not 0 <= c < num_classes:
                raise ValueError(f"pfedc: group {t} has class {c}, outside 0..{num_classes - 1}")
            if c in seen:
                raise ValueError(f"pfedc: class {c} is in groups {seen[c]} and {t}")
            seen[c] = t
    missing = sorted(set(range(num_classes)) - set(seen))
    if missing:
        raise ValueError(f"pfedc: groups must partition the classes; missing {missing}")
    return out


def task_presence(
    labels: torch.Tensor, groups: Sequence[Sequence[int]], num_classes: int, presence_min: int
) -> list[int]:
    """``π``: 1 for each task whose class(es) the node holds at least ``presence_min``
    training samples of, else 0. Raises ``ValueError`` for labels outside the classes."""
    y = torch.as_tensor(labels).reshape(-1).long().cpu()
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"pfedc: labels must lie in 0..{num_classes - 1}")
    counts = torch.bincount(y, minlength=num_classes)
    return [int(int(counts[list(g)].sum()) >= presence_min) for g in groups]


def check_pi(pi: Any, num_tasks: int | None = None) -> list[int]:
    """``pi`` as a list of 0/1 ints (of length ``num_tasks`` when given); ``ValueError`` else."""
    if not isinstance(pi, (list, tuple)) or not pi:
        raise ValueError("pi must be a non-empty list")
    if any(isinstance(v, bool) or not isinstance(v, int) or v not in (0, 1) for v in pi):
        raise ValueError("pi must hold only 0 and 1")
    if num_tasks is not None and len(pi) != num_tasks:
        raise ValueError(f"pi has {len(pi)} entries, expected {num_tasks} tasks")
    return [int(v) for v in pi]


# ----------------------------------------------------------------------------- the heads


ABSENT_SCORE = -1e4  # the combined score of a class whose task this node does not hold


class MultiHead(nn.Module):
    """``T`` task heads over a shared representation ``z`` of width ``in_features``.

    Parameters live in ``heads.<t>.weight`` / ``heads.<t>.bias`` (``nn.Linear``, output 1 for
    a binary head, ``len(group)`` for a group head). :meth:`task_logits` gives each head's raw
    output ``(B, k_t)``; ``forward`` combines them into ``(B, C)`` scores for ``argmax``:
    binary heads → the per-class logit; group heads → log-softmax within the group, placed at
    the group's classes."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        groups: Sequence[Sequence[int]] | None = None,
        bias: bool = True,
    ):
        super().__init__()
        self.binary = groups is None
        self.groups = validate_groups(groups, num_classes)
        self.num_classes = num_classes
        self.in_features = in_features
        self.heads = nn.ModuleList(
            nn.Linear(in_features, 1 if self.binary else len(g), bias=bias) for g in self.groups
        )
        order = torch.tensor([c for g in self.groups for c in g], dtype=torch.long)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(num_classes)
        local = torch.empty(num_classes, dtype=torch.long)  # class → index within its group
        for g in self.groups:
            local[torch.tensor(g)] = torch.arange(len(g))
        # not in state_dict: derived from the (config-given) groups, moves with .to(device)
        self.register_buffer("inverse_order", inverse, persistent=False)
        self.register_buffer("local_index", local, persistent=False)
        # classes the node's prediction may name (set from π); not in state_dict
        self.register_buffer(
            "class_mask", torch.ones(num_classes, dtype=torch.bool), persistent=False
        )

    @torch.no_grad()
    def predict_only(self, tasks: Sequence[int]) -> None:
        """Restrict :meth:`combine`'s scores to the classes of ``tasks`` (the others get
        :data:`ABSENT_SCORE`); an empty list lifts the restriction."""
        mask = torch.zeros_like(self.class_mask)
        for t in tasks:
            mask[torch.tensor(self.groups[t])] = True
        self.class_mask.copy_(mask if bool(mask.any()) else torch.ones_like(mask))

    @property
    def num_tasks(self) -> int:
        return len(self.groups)

    @torch.no_grad()
    def init_from(self, linear: nn.Linear) -> None:
        """Copy each task's rows of ``linear`` (the layer these heads replace)."""
        for g, head in zip(self.groups, self.heads, strict=True):
            head.weight.copy_(linear.weight[g])
            if head.bias is not None and linear.bias is not None:
                head.bias.copy_(linear.bias[g])

    def task_logits(self, z: torch.Tensor) -> list[torch.Tensor]:
        """Each head's raw output on ``z``: ``(B, 1)`` (binary) or ``(B, len(group))``."""
        return [head(z) for head in self.heads]

    def combine(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(B, C)`` class scores from :meth:`task_logits`' outputs."""
        if self.binary:
            scores = torch.cat(list(outs), dim=1)
        else:
            scores = torch.cat([F.log_softmax(o, dim=1) for o in outs], dim=1)
            scores = scores.index_select(1, self.inverse_order)
        return scores.masked_fill(~self.class_mask, ABSENT_SCORE)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.combine(self.task_logits(z))

    def extra_repr(self) -> str:
        kind = "binary" if self.binary else "groups"
        return f"{kind}, tasks={self.num_tasks}, classes={self.num_classes}"


def find_heads(model: nn.Module) -> tuple[str, MultiHead]:
    """``(name, module)`` of the model's :class:`MultiHead`, the name relative to ``model``
    (e.g. ``"h.fc2"``, or ``"h"``). ``ValueError`` if the model was not adapted."""
    for name, mod in model.named_modules():
        if isinstance(mod, MultiHead):
            return name, mod
    raise ValueError("pfedc: the model has no MultiHead (was adapt_model called?)")


def install_heads(model: SplitModel, groups: Sequence[Sequence[int]] | None) -> MultiHead:
    """Replace the last ``nn.Linear`` of ``model.h`` (in module order) by a :class:`MultiHead`
    initialised from its rows; return the heads. ``ValueError`` if ``h`` has no linear layer,
    already holds heads, or its last layer does not output ``model.num_classes`` scores."""
    if any(isinstance(m, MultiHead) for m in model.h.modules()):
        raise ValueError("pfedc: the model already has task heads")
    last: tuple[str, nn.Linear] | None = None
    for name, mod in model.h.named_modules():
        if isinstance(mod, nn.Linear):
            last = (name, mod)
    if last is None:
        raise ValueError("pfedc: the classifier h has no linear layer to split into heads")
    name, linear = last
    num_classes = model.num_classes or linear.out_features
    if linear.out_features != num_classes:
        raise ValueError(
            f"pfedc: the last layer of h outputs {linear.out_features} scores, "
            f"expected {num_classes} classes"
        )
    heads = MultiHead(linear.in_features, num_classes, groups, bias=linear.bias is not None)
    heads.init_from(linear)
    heads.to(device=linear.weight.device, dtype=linear.weight.dtype)
    if name == "":
        model.h = heads
    else:
        model.replace_module(f"h.{name}", heads)
    return heads


class _Reached(Exception):
    """Raised by a pre-hook to stop the forward pass at the heads."""


def shared_representation(model: SplitModel, x: torch.Tensor) -> torch.Tensor:
    """``Z``: the batch tensor the model feeds to its :class:`MultiHead` (everything before
    the heads), computed without running the heads."""
    _, heads = find_heads(model)
    if heads is model.h:
        return model.g(x)
    seen: list[torch.Tensor] = []

    def stop(_mod: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0])
        raise _Reached

    handle = heads.register_forward_pre_hook(stop)
    try:
        model(x)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not seen:  # pragma: no cover - heads outside the forward path
        raise ValueError("pfedc: the forward pass never reached the heads")
    return seen[0]


def task_head_keys(keys: Iterable[str], heads_name: str, num_tasks: int) -> dict[int, list[str]]:
    """State keys of each task's head: those under ``<heads_name>.heads.<t>.``."""
    pattern = re.compile(re.escape(heads_name) + r"\.heads\.(\d+)\.")
    out: dict[int, list[str]] = {t: [] for t in range(num_tasks)}
    for k in keys:
        m = pattern.match(k)
        if m and int(m.group(1)) < num_tasks:
            out[int(m.group(1))].append(k)
    return out


# ----------------------------------------------------------------------------- local loss


def task_losses(
    heads: MultiHead, outs: Sequence[torch.Tensor], y: torch.Tensor, include: Sequence[bool]
) -> tuple[list[torch.Tensor], list[int]]:
    """``(losses, tasks)``: ``L_t`` of each included task ``t`` that has data in the batch.
    Binary: BCE-with-logits of head ``t`` vs ``1[y = c_t]`` on the whole batch. Group:
    cross-entropy over the group's classes on the samples whose label is in the group."""
    losses: list[torch.Tensor] = []
    tasks: list[int] = []
    for t, (g, out) in enumerate(zip(heads.groups, outs, strict=True)):
        if not include[t]:
            continue
        if heads.binary:
            target = (y == g[0]).to(out.dtype)
            losses.append(F.binary_cross_entropy_with_logits(out[:, 0], target))
        else:
            mask = torch.isin(y, torch.tensor(g, device=y.device))
            if not bool(mask.any()):
                continue
            losses.append(F.cross_entropy(out[mask], heads.local_index[y[mask]]))
        tasks.append(t)
    return losses, tasks


def _pair_weight(v1v1: torch.Tensor, v1v2: torch.Tensor, v2v2: torch.Tensor) -> torch.Tensor:
    """Weight ``γ`` on ``v1`` of ``argmin_{γ∈[0,1]} ‖γ v1 + (1−γ) v2‖²`` (exact), from the
    three inner products (tensors, elementwise)."""
    denom = (v1v1 + v2v2 - 2 * v1v2).clamp_min(1e-300)
    gamma = ((v2v2 - v1v2) / denom).clamp(0.0, 1.0)
    gamma = torch.where(v1v2 >= v1v1, torch.ones_like(gamma), gamma)
    return torch.where((v1v2 >= v2v2) & (v1v2 < v1v1), torch.zeros_like(gamma), gamma)


def min_norm_weights(grads: torch.Tensor, iters: int = 25) -> torch.Tensor:
    """MGDA-UB's task weights: ``λ`` on the simplex minimising ``‖Σ_t λ_t g_t‖`` for the rows
    ``g_t`` of ``grads`` (``T × D``), by Frank–Wolfe from the best pair of rows (as in Sener &
    Koltun 2018) with the exact line search, at most ``iters`` steps. Returns a float tensor
    of length ``T`` (non-negative, summing to 1), on ``grads``' device."""
    if grads.dim() != 2 or grads.shape[0] == 0:
        raise ValueError(f"min_norm_weights needs a non-empty T×D matrix, got {tuple(grads.shape)}")
    T = grads.shape[0]
    G = grads.detach().to(torch.float64)
    M = G @ G.T
    lam = torch.zeros(T, dtype=torch.float64, device=G.device)
    if T == 1:
        lam[0] = 1.0
        return lam.to(grads.dtype if grads.is_floating_point() else torch.float32)
    # best pair
    i, j = torch.triu_indices(T, T, offset=1, device=G.device)
    d = M.diagonal()
    a, b, c = d[i], M[i, j], d[j]
    gamma = _pair_weight(a, b, c)
    cost = gamma * gamma * a + 2 * gamma * (1 - gamma) * b + (1 - gamma) ** 2 * c
    k = int(torch.argmin(cost))
    lam[i[k]] = gamma[k]
    lam[j[k]] += 1 - gamma[k]
    for _ in range(iters):
        Ml = M @ lam
        t = int(torch.argmin(Ml))
        v1v1, v1v2, v2v2 = lam @ Ml, Ml[t], M[t, t]
        step = _pair_weight(v1v1, v1v2, v2v2)
        new = step * lam
        new[t] += 1 - step
        done = float((new - lam).abs().sum()) < 1e-12
        lam = new
        if done:
            break
    lam = lam.clamp_min(0)
    lam = lam / lam.sum()
    return lam.to(grads.dtype if grads.is_floating_point() else torch.float32)


def normalize_gradients(grads: torch.Tensor, losses: torch.Tensor, kind: str) -> torch.Tensor:
    """Task gradients (T×D) divided by Sener & Koltun's per-task scale: ``none`` (1), ``l2``
    (‖g_t‖), ``loss`` (L_t) or ``loss+`` (L_t·‖g_t‖); a zero scale leaves the row as is."""
    if kind == "none":
        return grads
    norms = grads.norm(dim=1)
    scale = {"l2": norms, "loss": losses, "loss+": losses * norms}[kind]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return grads / scale.unsqueeze(1)


def make_loss(
    include: Sequence[bool],
    weighting: str = "mgda",
    mgda_iters: int = 25,
    normalization: str = "loss+",
) -> LossFn:
    """The local loss ``(model, xb, yb) -> (objective, mean_t L_t)`` over the tasks
    ``include`` marks (and that have data in the batch); ``λ`` from MGDA-UB on the gradients
    w.r.t. the shared representation, or ``1 / #tasks`` for ``weighting="equal"``.

    The objective's gradient is MGDA-UB's update (Sener & Koltun 2018, Algorithm 2):
    ``Σ_t λ_t ∇_φ L_t`` for the shared layers and ``∇_{ω_t} L_t`` for head ``t``.
    **Reading** (measured): scaling the heads by ``λ_t`` too stalls training with ten binary
    heads — the min-norm ``λ`` puts almost all weight on one task, the other heads get no
    gradient, and an 8-node Fashion-MNIST swarm stayed at chance (0.10) for 10 rounds."""
    include = [bool(v) for v in include]

    def pfedc_loss(model: SplitModel, xb: torch.Tensor, yb: torch.Tensor):
        _, heads = find_heads(model)
        z = shared_representation(model, xb)
        outs = heads.task_logits(z)
        losses, _ = task_losses(heads, outs, yb, include)
        if not losses:  # nothing held in this batch: a zero loss that still backpropagates
            zero = z.sum() * 0.0
            return zero, zero.detach()
        L = torch.stack(losses)
        if weighting == "mgda" and len(losses) > 1 and z.requires_grad:
            grads = torch.stack(
                [torch.autograd.grad(lt, z, retain_graph=True)[0].reshape(-1) for lt in losses]
            )
            grads = normalize_gradients(grads, L.detach().to(grads.dtype), normalization)
            lam = min_norm_weights(grads, mgda_iters).to(L.dtype)
        else:
            lam = torch.full_like(L, 1.0 / len(losses))
        lam = lam.detach()
        # Sener & Koltun (2018), Algorithm 2: the shared layers step along Σ_t λ_t ∇L_t, each
        # head along its own ∇L_t (unscaled): the detached copy gives head t the (1 − λ_t)
        # share of its gradient that the λ-weighted term leaves out, and nothing to φ
        detached, _ = task_losses(heads, heads.task_logits(z.detach()), yb, include)
        total = (lam * L).sum() + ((1.0 - lam) * torch.stack(detached)).sum()
        return total, L.detach().mean()

    return pfedc_loss


# ----------------------------------------------------------------------------- server rule


def _aggregate_parts(
    states: dict[str, State],
    weights: dict[str, float],
    pis: dict[str, list[int]],
    head_keys: dict[int, list[str]],
    defence: Defence | None = None,
    own: str | None = None,
) -> tuple[State, dict[str, State]]:
    """``(φ, per-node heads)``: see :func:`pfedc_aggregate`. With ``defence`` (the
    aggregator's, docs/design.md, "Robust aggregation") its rule combines ``φ`` around
    ``own``'s upload; each head stays the plain mean over its holders whose ``φ`` the rule
    kept (a head has no bound of its own: honest holders' heads differ by about their
    norm)."""
    if not states:
        raise ValueError("pfedc_aggregate needs at least one state")
    nodes = sorted(states)
    if float(sum(weights[n] for n in nodes)) <= 0:
        raise ValueError("pfedc_aggregate: sample counts must sum to a positive number")
    in_head = {k for keys in head_keys.values() for k in keys}
    first = states[nodes[0]]
    ordered = [states[n] for n in nodes]
    w = [float(weights[n]) for n in nodes]
    shared_keys = [k for k in first if k not in in_head]
    if defence is None:
        shared = weighted_mean(ordered, w, shared_keys)
    else:
        mine = nodes.index(own) if own in states else None
        shared = defence.combine(ordered, w, who=nodes, own=mine, keys=shared_keys)
    heads: dict[str, State] = {n: {} for n in nodes}
    for t, keys in sorted(head_keys.items()):
        holders = [n for n in nodes if t < len(pis.get(n, [])) and pis[n][t] == 1]
        if len(holders) < 2:  # none, or only the node itself: it already has its head
            continue
        # a holder whose φ the defence refused is refused for its heads too: a head varies
        # between honest holders about as much as its own norm, so it has no bound of its own
        trusted = [n for n in holders if defence is None or n not in defence.rejected]
        if not trusted:
            continue
        held = [states[n] for n in trusted]
        mean = weighted_mean(held, [1.0] * len(held), keys)
        for n in holders:
            heads[n].update(mean)
    return shared, heads


def pfedc_aggregate(
    states: dict[str, State],
    weights: dict[str, float],
    pis: dict[str, list[int]],
    head_keys: dict[int, list[str]],
) -> dict[str, State]:
    """pFedC's server rule (Eq. 6, 7): what each node receives.

    ``φ`` (every key not in ``head_keys``) is the ``weights``-weighted mean over all nodes.
    For node ``i`` and task ``t`` with ``π_i^t = 1``, head ``t`` (its ``head_keys[t]``) is the
    plain mean over the nodes ``n`` with ``π_n^t = 1``; it is sent only when another node
    holds ``t`` too (else it equals the node's own). Heads of tasks the node lacks are not
    sent: it keeps its own. Both means are the shared weighted mean (docs/algorithms.md,
    "Shared aggregation"), over the nodes in sorted order: float64 accumulation, and
    non-floating tensors taken from the first node (sorted)."""
    shared, heads = _aggregate_parts(states, weights, pis, head_keys)
    return {n: {**shared, **heads[n]} for n in sorted(states)}


# ----------------------------------------------------------------------------- the method


@register
class PFedC(CentralizedAlgorithm):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"
    needs_parts = frozenset({"h"})  # its task heads replace the last nn.Linear of h

    @classmethod
    def task_problem(cls, loss: str, targets: str, outputs: int) -> str | None:
        if targets != "classes" or loss != "cross_entropy":
            return "trains its task heads with its own loss on class labels (training.loss: cross_entropy)"
        return None

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.groups = validate_groups(self.params.groups, ctx.num_classes)
        self.num_tasks = len(self.groups)
        heads_name, heads = find_heads(self.model)
        if heads.groups != self.groups:
            raise ValueError("pfedc: the model's heads do not match the configured groups")
        self.heads_name = heads_name
        self.head_keys = task_head_keys(self.model.state_dict(), heads_name, self.num_tasks)
        # until set_labels: every task held
        self.pi: list[int] = [1] * self.num_tasks

    @classmethod
    def adapt_model(cls, model: SplitModel, params: BaseModel, num_classes: int) -> SplitModel:
        """Replace the last linear layer of ``model.h`` by :class:`MultiHead` (keys
        ``h.<layer>.heads.<t>.weight``, or ``h.heads.<t>.weight`` when ``h`` is one linear
        layer, as for ``mlp`` and ``resnet18``). ``ValueError`` if ``groups`` is not a
        partition of the classes."""
        p = params if isinstance(params, PFedCParams) else PFedCParams.model_validate(params)
        groups = None if p.groups is None else validate_groups(p.groups, num_classes)
        if model.num_classes and model.num_classes != num_classes:
            raise ValueError(
                f"pfedc: model built for {model.num_classes} classes, not {num_classes}"
            )
        install_heads(model, groups)
        return model

    # -- client side ---------------------------------------------------------------------
    def set_labels(self, labels: torch.Tensor) -> None:
        """``π`` from the node's training labels (called once, before round 1)."""
        self.pi = task_presence(labels, self.groups, self.ctx.num_classes, self.params.presence_min)
        # **Reading**: a node predicts among the tasks it holds. Its test split follows its
        # own label distribution (docs/algorithms.md, "Data partitions"), the paper scores
        # each task separately, and the heads of absent tasks are never trained here (nor
        # shared with this node), so letting their untrained scores compete in the argmax
        # only adds errors
        _, heads = find_heads(self.model)
        heads.predict_only([t for t, held in enumerate(self.pi) if held])

    def _include(self) -> list[bool]:
        binary = self.params.groups is None
        return [bool(p) or (binary and self.params.train_absent) for p in self.pi]

    def loss_fn(self) -> LossFn | None:
        p = self.params
        return make_loss(self._include(), p.weighting, p.mgda_iters, p.mgda_normalization)

    def report(self, result: Any, lr: float) -> dict[str, Any]:
        return {"pi": list(self.pi)}

    def check_report(self, report: Any) -> dict[str, Any]:  # type: ignore[override]
        """A peer's report: ``{"pi": [0/1] * T}`` (an instance method: ``T`` comes from the
        configured groups and the class count)."""
        if not isinstance(report, dict):
            raise ValueError("report must be a map")
        return {**report, "pi": check_pi(report.get("pi"), self.num_tasks)}

    def apply(self, received: State, announcement: dict[str, Any]) -> dict[str, Any]:
        """Load ``φ`` and the received heads; heads not received stay as they are.

        ``received`` must hold every key of ``φ`` and, of each head it holds, all its keys,
        each a tensor of the model's shape and dtype, and only heads of tasks this node
        holds (``π^t = 1``: the server rule sends no other, and a head the node lacks is
        its own); else ``ValueError``, before anything changes."""
        own = self.model.state_dict()
        if not isinstance(received, Mapping) or any(not isinstance(k, str) for k in received):
            raise ValueError(f"pfedc: received {peer_state_mismatch(received, own)}")
        unknown = [k for k in received if k not in own]
        if unknown:
            raise ValueError(f"pfedc: received unknown tensor {unknown[0]!r}")
        why = peer_state_mismatch(received, {k: own[k] for k in received})
        if why is not None:
            raise ValueError(f"pfedc: received {why}")
        task_of = {k: t for t, keys in self.head_keys.items() for k in keys}
        heads = {task_of[k] for k in received if k in task_of}
        lacked = sorted(t for t in heads if not self.pi[t])
        if lacked:
            raise ValueError(f"pfedc: received the head of task {lacked[0]}, which it lacks")
        whole = {k: v for k, v in own.items() if k not in task_of or task_of[k] in heads}
        why = peer_state_mismatch(received, whole)  # all of φ, and whole heads
        if why is not None:
            raise ValueError(f"pfedc: received {why}")
        self.model.load_state_dict(received, strict=False)
        got = sorted(
            t for t, keys in self.head_keys.items() if keys and all(k in received for k in keys)
        )
        return {"received_heads": got, "received_keys": len(received)}

    # -- server side (pure) --------------------------------------------------------------
    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        pis: dict[str, list[int]] = {}
        bad: list[str] = []
        for node, up in uploads.items():
            try:
                pis[node] = check_pi(up.report.get("pi"), self.num_tasks)
            except (ValueError, AttributeError):
                pis[node] = [0] * self.num_tasks  # its heads are neither shared nor replaced
                bad.append(node)
        states = {n: up.state for n, up in uploads.items()}
        weights = {n: float(up.n) for n, up in uploads.items()}
        shared, heads = _aggregate_parts(
            states, weights, pis, self.head_keys, self.ctx.defence, self.ctx.node_id
        )
        results = {n: {**shared, **heads[n]} for n in sorted(uploads)}
        holders = [sum(pis[n][t] for n in uploads) for t in range(self.num_tasks)]
        facts: dict[str, Any] = {
            "tasks_shared": sum(1 for h in holders if h >= 2),
            "task_holders": holders,
        }
        if bad:
            facts["bad_pi"] = sorted(bad)
        return Aggregate(results=results, common=shared, server=dict(server), facts=facts)
