"""A node's local training of its method's model, and its evaluation.

One round of training (:meth:`LocalTraining.train`) is plain SGD under the method's loss and
hooks, DP-SGD under ``privacy.dp`` at ``level: sample``, or plain training whose update is
then released (clipped and noised) at ``level: update`` (docs/algorithms.md, "Differential
privacy"); an attacking node's labels are its adversary's, an emulated slower device waits
out the rest of its time, and a non-finite loss rolls the method back to its last good
state. Everything heavy runs in worker threads. The round drivers reach it through
:class:`~p2pfl.services.bundle.NodeServices`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from p2pfl.algorithms.base import Method
from p2pfl.attacks import Adversary
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.data import NodeData
from p2pfl.learning.state import State
from p2pfl.learning.task import record_field, task_of
from p2pfl.learning.train import (
    TrainResult,
    epoch_steps,
    evaluate,
    evaluate_task,
    round_lr,
    round_steps,
    train_local,
)
from p2pfl.services.device import EmulatedDevice
from p2pfl.services.optimizer_state import KeptOptimizer

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.privacy.update_dp import Released
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy

log = logging.getLogger(__name__)

EVAL_BATCH = 500

_DP_SGD_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def dp_sgd_turn() -> asyncio.Lock:
    """The lock a node holds while it trains with DP-SGD, one for the nodes of the running
    event loop (the nodes a process packs share one loop, p2pfl/node/daemon.py): they train
    one at a time, so a process holds the per-sample gradients of one node, not of all of
    them at once. Waiters take their turns in arrival order (``asyncio.Lock`` is fair) and
    wait without holding a worker thread."""
    loop = asyncio.get_running_loop()
    lock = _DP_SGD_TURNS.get(loop)
    if lock is None:
        lock = _DP_SGD_TURNS[loop] = asyncio.Lock()
    return lock


class Evaluation(NamedTuple):
    """A round's evaluation on the node's test split: ``acc`` (``test_acc``; NaN where the
    task reports no accuracy), ``loss`` (``test_loss``) and the task's other metrics by
    their record field (``test_auc``; None for the default task, whose records hold
    accuracy and loss alone)."""

    acc: float
    loss: float
    metrics: dict[str, float] | None = None


@dataclass
class TrainOutcome:
    """One round of local training: the trainer's result, the learning rate used and the
    facts the method's ``after_train`` hook returned. ``diverged`` is set when the loss
    turned non-finite and the node rolled back (:meth:`LocalTraining.train`)."""

    result: TrainResult
    lr: float
    facts: dict[str, Any] = field(default_factory=dict)
    diverged: dict[str, Any] | None = None


class LocalTraining:
    """One node's training and evaluation of its method's model. :attr:`merged_from` names
    the peers whose states went into the model the next training starts from (the
    driver's account, :meth:`merged`, logged when that training diverges). ``last_good`` is ``(round,
    the method's checkpoint)`` after the latest round whose loss was finite (None before
    one), what a diverged round rolls back to (the initial checkpoint before that)."""

    def __init__(
        self,
        *,
        cfg: TopologyConfig,
        node_id: str,
        method: Method,
        data: NodeData,
        rng: np.random.Generator,
        device: torch.device,
        privacy: NodePrivacy | NodeUpdatePrivacy | None,
        adversary: Adversary | None,
        emulated: EmulatedDevice,
        optimizer: KeptOptimizer | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self.method = method
        self.data = data
        self.rng = rng
        self.device = device
        self.privacy = privacy
        self.adversary = adversary
        self.emulated = emulated
        self.optimizer = optimizer  # training.optimizer_state: keep (None: a new one a round)
        self.task = task_of(cfg)  # the loss it trains with, the metrics it reports
        self._label_dtype = torch.long if self.task.targets == "classes" else torch.float32
        self.merged_from: list[str] = []
        self.last_good: tuple[int, dict[str, Any]] | None = None
        self._initial = method.checkpoint()  # what a node whose first round diverges keeps

    def merged(self, peers: list[str]) -> None:
        """The model the next training starts from merges the states of ``peers`` (at a
        decentralized merge, or a centralized result's apply)."""
        self.merged_from = list(peers)

    def round_steps(self) -> int:
        """The optimizer steps of one of this node's rounds over its training data
        (:func:`~p2pfl.learning.train.round_steps`): under DP-SGD, its Poisson epochs'
        (:attr:`NodePrivacy.round_steps`, planned with its noise)."""
        privacy = self.privacy
        if privacy is not None and privacy.level == "sample":
            return cast("NodePrivacy", privacy).round_steps
        n = len(self.data.train_inputs)
        return round_steps(self.cfg.training, epoch_steps(n, self.cfg.training.batch_size))

    async def train(self, round_no: int, *, budget_s: float | None = None) -> TrainOutcome:
        """One round of local training of the method's model (the method's loss and hooks,
        the round's learning rate, a seed drawn from the node's RNG), then the method's
        ``after_train``; in worker threads.

        ``budget_s`` (a catch-up round at the swarm's pace,
        :func:`~p2pfl.learning.train.catch_up_budget_s`; docs/wire.md, "Rounds and
        catch-up") ends the steps, plain or at ``level: update``, once they took that long
        on this device (an emulated one's time stretched by ``1 / speed``). DP-SGD
        (``level: sample``) trains its whole round: its noise is planned for it.

        When the loss turns non-finite the node does not go on from a broken model: it
        rolls back to the method's state after its last finite round (model and what the
        method keeps), logs the peers whose states it merged this round
        (:attr:`merged_from`), and says so in :attr:`TrainOutcome.diverged`.

        Under ``privacy.dp`` at ``level: sample`` the round trains with DP-SGD instead
        (:meth:`_train_private`); at ``level: update`` it trains as here and the node adopts
        the release of its update (:meth:`_train_released`)."""
        privacy = self.privacy
        if privacy is not None and privacy.level == "sample":
            return await self._train_private(round_no, cast("NodePrivacy", privacy))
        lr = round_lr(self.cfg.training, round_no)
        labels = self._round_labels(round_no)
        seed = int(self.rng.integers(2**31))
        if privacy is not None:
            update = cast("NodeUpdatePrivacy", privacy)
            return await self._train_released(round_no, update, lr, labels, seed, budget_s)
        t0 = time.monotonic()
        result = await self._local_steps(lr, labels, seed, budget_s)
        return await self._trained(round_no, result, lr, t0)

    async def _local_steps(
        self, lr: float, labels: Any, seed: int, budget_s: float | None
    ) -> TrainResult:
        """The round's plain local training of the method's model (its loss and hooks),
        within ``budget_s`` of this device's time when given, in a worker thread."""
        method = self.method
        return await asyncio.to_thread(
            train_local,
            method.model,
            self.data.train_inputs,  # train_set (a Dataset read by batches) or train_x
            labels,
            self.cfg.training,
            lr,
            extra_loss=method.extra_loss(),
            loss_fn=method.loss_fn(),
            step_hook=method.step_hook(),
            seed=seed,
            device=self.device,
            optimizer=self._kept(lr),
            task_loss=self.task.loss,
            label_dtype=self._label_dtype,
            budget_s=budget_s,
            time_scale=1.0 / self.emulated.speed,
        )

    def _kept(self, lr: float) -> torch.optim.Optimizer | None:
        """The node's kept optimizer for a round at ``lr``; None when it makes one a round."""
        return None if self.optimizer is None else self.optimizer.for_round(lr)

    async def _train_released(
        self,
        round_no: int,
        privacy: NodeUpdatePrivacy,
        lr: float,
        labels: Any,
        seed: int,
        budget_s: float | None,
    ) -> TrainOutcome:
        """:meth:`train` under ``privacy.dp.level: update``: the round's plain training from
        the model the node holds (the reference: what it last merged, applied or
        released), then, when the loss is finite, the node's model becomes the release
        ``ref + clip(w − ref) + noise`` (:meth:`NodeUpdatePrivacy.release`) before
        ``after_train``, so whatever leaves the node from now on (snapshots, uploads,
        representations) is computed from the release. One release is counted, even when a
        non-finite loss rolls the round back (:meth:`_trained`). A node whose budget is
        spent trains and releases nothing (a result of 0 steps, as :meth:`_train_private`'s)
        and still runs ``after_train``."""
        method = self.method
        if not await asyncio.to_thread(privacy.may_train, round_no):
            idle = TrainResult(math.nan, math.nan, 0, 0.0, 0.0)
            facts = await asyncio.to_thread(method.after_train)
            method.model_changed()
            return TrainOutcome(idle, lr, facts or {})
        ref = method.model_state()
        t0 = time.monotonic()
        result = await self._local_steps(lr, labels, seed, budget_s)
        if math.isfinite(result.loss):
            released = await asyncio.to_thread(self._adopt_release, privacy, ref, seed)
            log.debug(
                "%s: round %d: update norm %.4g%s, released with noise σC %.4g",
                self.id,
                round_no,
                released.norm,
                " (clipped)" if released.clipped(privacy.max_norm) else "",
                privacy.noise_multiplier * privacy.max_norm,
            )
        await asyncio.to_thread(privacy.released)  # even if rolled back
        return await self._trained(round_no, result, lr, t0)

    def _adopt_release(self, privacy: NodeUpdatePrivacy, ref: State, seed: int) -> Released:
        """The release of the trained model against ``ref``, loaded as the node's model."""
        released = privacy.release(ref, self.method.model_state(), seed)
        self.method.model.load_state_dict(released.state)
        return released

    async def _train_private(self, round_no: int, privacy: NodePrivacy) -> TrainOutcome:
        """:meth:`train` under ``privacy.dp``: the round's DP-SGD steps
        (:func:`~p2pfl.learning.dp_train.train_private`, seeded from the node's RNG as plain
        training is, per-sample gradients of at most ``dp.max_physical_batch`` samples at
        once, and in this process's turn: :func:`dp_sgd_turn`), accounted for in
        :attr:`privacy`; then ``after_train``. A node whose
        budget is spent takes no step (a result of 0 steps, its losses NaN and recorded as
        None) and still runs ``after_train``, so the method's round goes on as usual."""
        from p2pfl.learning.dp_train import train_private  # Opacus: only under privacy.dp

        method, cfg = self.method, self.cfg
        lr = round_lr(cfg.training, round_no)
        labels = self._round_labels(round_no)
        seed = int(self.rng.integers(2**31))  # drawn either way: the RNG's stream is kept
        if privacy.dp.secret_noise:  # unknown to anyone who knows the swarm's seed
            seed = secrets.randbits(31)
        if not await asyncio.to_thread(privacy.may_train, round_no):  # PRV takes seconds
            idle = TrainResult(math.nan, math.nan, 0, 0.0, 0.0)
            facts = await asyncio.to_thread(method.after_train)
            method.model_changed()
            return TrainOutcome(idle, lr, facts or {})
        dp = privacy.dp
        async with dp_sgd_turn():  # one DP-SGD training at a time in this process
            t0 = time.monotonic()  # the wait for the turn is not this device's compute
            result = await asyncio.to_thread(
                train_private,
                method.model,
                self.data.train_inputs,
                labels,
                cfg.training,
                lr,
                noise_multiplier=privacy.noise_multiplier,
                max_grad_norm=dp.max_grad_norm,
                q=privacy.q,
                steps_per_epoch=privacy.steps_per_epoch,
                extra_loss=method.extra_loss(),
                loss_fn=method.loss_fn(),
                step_hook=method.step_hook(),
                seed=seed,
                device=self.device,
                max_physical_batch=dp.max_physical_batch,
                optimizer=self._kept(lr),
                task_loss=self.task.loss,
            )
        await asyncio.to_thread(privacy.spent, result.steps)  # even if rolled back
        return await self._trained(round_no, result, lr, t0)

    def _round_labels(self, round_no: int) -> Any:
        """The training labels of round ``round_no``: the data's, or what an attacking
        node's adversary flips them to (tensor data only)."""
        labels = self.data.train_y
        if self.adversary is not None and self.data.train_set is None:
            labels = self.adversary.train_labels(labels, round_no)
        return labels

    async def _trained(
        self, round_no: int, result: TrainResult, lr: float, t0: float
    ) -> TrainOutcome:
        """What follows a round's training (plain or DP-SGD), begun at monotonic ``t0``: an
        emulated slower device waits out the rest of its time; a non-finite loss rolls the
        method back (:meth:`_roll_back`); otherwise the method's ``after_train`` runs and the
        state is kept as the last good one."""
        method = self.method
        method.model_changed()  # trained: batch-norm statistics move without a version
        if self.emulated.speed < 1.0:  # a slower device: the same work, stretched
            await asyncio.sleep(self.emulated.extra_compute_s(time.monotonic() - t0))
            result = replace(result, seconds=time.monotonic() - t0)
        if not math.isfinite(result.loss):
            diverged = await asyncio.to_thread(self._roll_back, round_no, result.loss, lr)
            return TrainOutcome(result, lr, {}, diverged)
        facts = await asyncio.to_thread(method.after_train)
        method.model_changed()
        self.last_good = (round_no, method.checkpoint())
        return TrainOutcome(result, lr, facts or {})

    def _roll_back(self, round_no: int, loss: float, lr: float) -> dict[str, Any]:
        merged = sorted(self.merged_from)
        if self.last_good is None:
            good_round, ckpt = 0, self._initial
        else:
            good_round, ckpt = self.last_good
        self.method.restore(ckpt)
        if self.optimizer is not None:  # its moments hold the non-finite steps
            self.optimizer.reset()
        log.warning(
            "%s: round %d: training loss is %s (lr %.4g; merged from %s): rolled back to "
            "the model after round %d",
            self.id,
            round_no,
            loss,
            lr,
            ", ".join(merged) or "no peer",
            good_round,
        )
        return {"merged_from": merged, "rolled_back_to": good_round}

    async def evaluate(self) -> Evaluation:
        """The method's model on this node's test split: accuracy and mean cross-entropy
        for the default task, else the task's loss and every metric of it
        (:mod:`p2pfl.learning.task`; accuracy NaN where the task does not report it)."""
        model, inputs, labels = self.method.model, self.data.test_inputs, self.data.test_y
        if self.task.is_default:
            acc, loss = await asyncio.to_thread(
                evaluate, model, inputs, labels, EVAL_BATCH, self.device
            )
            return Evaluation(acc, loss)
        loss, scores = await asyncio.to_thread(
            evaluate_task, model, inputs, labels, self.task, EVAL_BATCH, self.device
        )
        acc = scores.pop("accuracy", math.nan)
        return Evaluation(acc, loss, {record_field(m): v for m, v in scores.items()})
