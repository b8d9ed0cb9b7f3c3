"""DP-SGD local training with Opacus (docs/algorithms.md, "Differential privacy").

Contract:

- :func:`fix_model` makes a model Opacus can train privately (``ModuleValidator.fix``:
  BatchNorm becomes GroupNorm, whose output does not mix the samples of a batch) and names
  the layers it replaced. Every node of a swarm applies it to the common initial model, so
  their layouts still match.
- :func:`train_private` is :func:`p2pfl.learning.train.train_local` under DP-SGD: each step
  draws a Poisson batch (every sample with probability ``q``, from a generator seeded with
  ``seed``), computes per-sample gradients of the cross-entropy (Opacus's
  ``GradSampleModule``), clips each to ``max_grad_norm``, sums them and adds Gaussian noise
  ``N(0, (σ·C)²)`` (Opacus's ``DPOptimizer``, its generator seeded from ``seed`` too),
  divides by the expected batch size ``q·n``, then steps the configured optimizer. Same
  seed, same data, same model: the same result.
- Memory: a Poisson batch of more than ``max_physical_batch`` samples is cut, in order, into
  chunks of at most that many; each chunk's per-sample gradients are computed, clipped and
  added to the batch's sum (Opacus's ``signal_skip_step``, as its ``BatchMemoryManager``
  does), then freed, and the batch's one noisy step follows its last chunk. The batch, the
  clipping, the noise (one draw a batch) and so the guarantee and ε are those of the unsplit
  batch; the sum differs only in float summation order (allclose, not bit for bit). A batch
  that fits trains exactly as before the bound existed.
- The model is wrapped only for the call: the method, its checkpoints and the wire always
  see the plain model, its parameter names and ``state_dict`` keys unchanged (no
  ``_module.`` prefix), with no Opacus hook or per-sample attribute left on it.
- A method's ``extra_loss`` must be a **data-independent** regulariser (UA-PDFL's auxiliary
  term on ``X_unit``, DiversiFed's proximal term): it is called with empty batches (``xb``,
  ``yb``, ``logits`` with 0 rows), its gradient is computed on the plain model and added to
  the noisy gradient. A term that reads the batch sees no sample and cannot leak one.
- A ``loss_fn`` (a loss that couples the samples of a batch) is refused: per-sample
  clipping would not bound one record's influence. ``step_hook`` runs after every step, as
  in plain training.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.validators import ModuleValidator
from torch.utils.data import Dataset

from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.hooks import ExtraLoss, LossFn, StepHook
from p2pfl.learning.models import SplitModel
from p2pfl.learning.train import TaskLoss, TrainResult, epochs_for_steps, make_optimizer, set_lr

NOISE_STREAM = 0x4E015E  # the noise generator's seed is (seed ^ NOISE_STREAM): apart from sampling
_PER_SAMPLE_ATTRS = ("grad_sample", "summed_grad", "_processed")


def dp_problems(model: torch.nn.Module) -> list[str]:
    """What keeps Opacus from training ``model`` privately after :func:`fix_model` (empty:
    nothing). The model's training mode is left as it was."""
    was_training = model.training
    model.train()  # Opacus validates a model as it trains it
    try:
        return [str(e) for e in ModuleValidator.validate(model, strict=False)]
    finally:
        model.train(was_training)


def fix_model(model: SplitModel) -> tuple[SplitModel, list[str]]:
    """``model`` with the layers Opacus cannot train privately replaced
    (``ModuleValidator.fix``: BatchNorm → GroupNorm), and the replaced layers as
    ``"name: Old → New"``. In-place activations (``ReLU(inplace=True)``) are made
    out-of-place: Opacus's backward hooks refuse a view changed in place; the weights and
    the maths are the same. ``model`` itself is returned when no layer needs replacing."""
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    if not ModuleValidator.validate(model, strict=False):
        return model, []
    before = {name: type(m).__name__ for name, m in model.named_modules()}
    fixed = ModuleValidator.fix(model)
    replaced = [
        f"{name}: {before[name]} → {type(m).__name__}"
        for name, m in fixed.named_modules()
        if name in before and before[name] != type(m).__name__
    ]
    return fixed, replaced


def poisson_indices(n: int, q: float, gen: torch.Generator) -> torch.Tensor:
    """The indices of a Poisson batch: each of ``n`` samples independently with prob. ``q``."""
    return torch.nonzero(torch.rand(n, generator=gen) < q, as_tuple=False).flatten()


def _batch(
    x: torch.Tensor | Dataset, y: torch.Tensor | None, idx: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        assert y is not None
        return x[idx].to(device), y[idx].to(device)
    items = [x[int(i)] for i in idx]
    xb = torch.stack([torch.as_tensor(a) for a, _ in items])
    yb = torch.as_tensor([int(b) for _, b in items], dtype=torch.long)
    return xb.to(device), yb.to(device)


def _empty_batch(
    x: torch.Tensor | Dataset, y: torch.Tensor | None, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    first = x[0:1] if isinstance(x, torch.Tensor) else torch.as_tensor(x[0][0]).unsqueeze(0)
    return first[:0].to(device), torch.zeros(0, dtype=torch.long, device=device)


def _poisson_epochs(
    n: int, q: float, steps: int, epochs: int, gen: torch.Generator, limit: int | None = None
) -> Iterator[torch.Tensor]:
    """``epochs`` × ``steps`` Poisson batches, the first ``limit`` of them when given."""
    drawn = 0
    for _ in range(epochs):
        for _ in range(steps):
            if limit is not None and drawn >= limit:
                return
            drawn += 1
            yield poisson_indices(n, q, gen)


def train_private(
    model: SplitModel,
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    cfg: TrainingConfig,
    lr: float,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    q: float,
    steps_per_epoch: int,
    epochs: int | None = None,
    extra_loss: ExtraLoss | None = None,
    loss_fn: LossFn | None = None,
    step_hook: StepHook | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    max_physical_batch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    task_loss: TaskLoss | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``epochs`` (default :func:`~p2pfl.learning.train.round_epochs`
    of ``cfg`` over ``steps_per_epoch``) × ``steps_per_epoch`` DP-SGD steps (under
    ``training.steps``, exactly that many), with a fresh optimizer or the node's kept one
    (``optimizer``, its learning rate set to ``lr``), with the topology's loss ``task_loss``
    (default cross-entropy; :mod:`p2pfl.learning.task`), at sampling rate ``q``, noise ``noise_multiplier`` and clipping bound
    ``max_grad_norm`` (module docstring), holding the per-sample gradients of at most
    ``max_physical_batch`` samples at once (None: a whole batch; the nodes pass
    ``privacy.dp.max_physical_batch``). Returns what ``train_local`` returns; ``loss`` and
    ``ce_loss`` are the last epoch's mean over its non-empty batches (the loss includes the
    regulariser)."""
    if loss_fn is not None:
        raise ValueError("DP-SGD cannot train with a method's loss_fn (it couples samples)")
    t0 = time.perf_counter()
    model.train()
    model.to(device)
    n = len(x)  # type: ignore[arg-type]  # rows of the tensor, items of the Dataset
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        opt = make_optimizer(model, cfg, lr)
    else:
        opt = optimizer
        set_lr(opt, lr)
    noise_gen = torch.Generator(device=torch.device(device)).manual_seed(seed ^ NOISE_STREAM)
    dp_opt = DPOptimizer(
        opt,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=max(1, round(q * n)),
        loss_reduction="mean",
        generator=noise_gen,
    )
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    grad_sq = 0.0
    total = ce_total = 0.0
    batches = 0
    epoch_steps = steps_per_epoch
    try:
        for i, idx in enumerate(
            _poisson_epochs(
                n,
                q,
                epoch_steps,
                epochs or epochs_for_steps(cfg, epoch_steps),
                gen,
                cfg.steps if epochs is None else None,
            )
        ):
            if i % epoch_steps == 0:
                total = ce_total = 0.0
                batches = 0
            dp_opt.zero_grad(set_to_none=True)
            if len(idx) > 0:
                *early, last = idx.split(max_physical_batch or len(idx))
                ce_sum = 0.0  # the logical batch's cross-entropy, summed over its chunks
                for chunk in early:  # clipped and summed into p.summed_grad, then freed
                    ce_sum += _backward(gsm, x, y, chunk, device, task_loss)[2].item() * len(chunk)
                    dp_opt.signal_skip_step(do_skip=True)
                    dp_opt.pre_step()  # clip and accumulate only: no noise, no step
                    dp_opt.zero_grad(set_to_none=True)  # per-sample grads go, the sum stays
                xb, yb, ce, logits = _backward(gsm, x, y, last, device, task_loss)
                if early:
                    ce = torch.tensor((ce_sum + ce.item() * len(last)) / len(idx))
            else:  # an empty Poisson batch: the step is noise alone
                xb, yb = _empty_batch(x, y, device)
                logits = torch.zeros(0, 1, device=device)
                ce = None
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            reg_grads, reg = _regulariser(gsm, model, params, extra_loss, xb, yb, logits)
            if dp_opt.pre_step():  # clip, sum, noise, ÷ expected batch size
                for p, g in zip(params, reg_grads, strict=True):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad + g
                grad_sq += float(sum(p.grad.pow(2).sum() for p in params if p.grad is not None))
                opt.step()
            if step_hook is not None:
                step_hook(model)
            steps += 1
            if ce is not None:
                batches += 1
                ce_total += ce.item()
                total += ce.item() + reg
    finally:
        gsm.cleanup()  # hooks off, per-sample gradients gone: the plain model again
        for p in model.parameters():
            for attr in _PER_SAMPLE_ATTRS:
                if hasattr(p, attr):
                    delattr(p, attr)
    return TrainResult(
        loss=total / max(1, batches),
        ce_loss=ce_total / max(1, batches),
        steps=steps,
        seconds=time.perf_counter() - t0,
        grad_sq_sum=grad_sq,
    )


def _backward(
    gsm: GradSampleModule,
    x: torch.Tensor | Dataset,
    y: torch.Tensor | None,
    idx: torch.Tensor,
    device: torch.device | str,
    task_loss: TaskLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean loss (cross-entropy, or ``task_loss``) of the samples ``idx`` backpropagated through ``gsm``: each
    sample's own gradient lands in ``p.grad_sample`` (Opacus scales a mean loss back by the
    chunk's size). Returns the inputs, labels, loss and logits."""
    xb, yb = _batch(x, y, idx, device)
    if xb.is_floating_point():  # else torch warns, at every backward through
        xb.requires_grad_(True)  # Opacus's hooks, that no input needs a gradient
    logits = gsm(xb)
    ce = F.cross_entropy(logits, yb) if task_loss is None else task_loss(logits, yb)
    ce.backward()
    return xb, yb, ce, logits


def _regulariser(
    gsm: GradSampleModule,
    model: SplitModel,
    params: list[torch.nn.Parameter],
    extra_loss: ExtraLoss | None,
    xb: torch.Tensor,
    yb: torch.Tensor,
    logits: torch.Tensor,
) -> tuple[list[torch.Tensor | None], float]:
    """The gradient of the data-independent ``extra_loss`` on the plain model (Opacus's
    hooks off, empty batches passed) and its value; Nones and 0.0 without one."""
    if extra_loss is None:
        return [None] * len(params), 0.0
    gsm.disable_hooks()
    try:
        term = extra_loss(model, xb[:0], yb[:0], logits[:0].detach())
        if not term.requires_grad:
            return [None] * len(params), float(term)
        grads = torch.autograd.grad(term, params, allow_unused=True)
    finally:
        gsm.enable_hooks()
    return list(grads), float(term.detach())
